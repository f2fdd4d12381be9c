"""A Horovod job whose last rank dies mid-training (gradwire's DistributedOptimizer).

Run as ``horovodrun --gloo -np 2 python dies.py SPEC``. Every rank prints ``STEP <rank> <n>``
after each optimizer step it completes; the last rank vanishes (os._exit(0): horovodrun then
leaves the survivors running, so they must notice by themselves) before step DIES_AT. A survivor
that notices prints ``RAISED <rank> <type>: <message>`` and exits 1; no survivor may print a
step after the death (tests/hooks/test_horovod.py checks the lines).
"""

from __future__ import annotations

import os
import sys

os.environ.setdefault("OMP_NUM_THREADS", "1")

import torch  # noqa: E402
from torch import nn  # noqa: E402

import horovod.torch as hvd  # noqa: E402

from gradwire.hooks import horovod as gwh  # noqa: E402

DIES_AT = 3

if __name__ == "__main__":
    hvd.init()
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Linear(64, 4))
    opt = gwh.DistributedOptimizer(torch.optim.SGD(model.parameters(), lr=0.1), model.named_parameters(),
                                   compression=sys.argv[1])
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(hvd.rank()))
    victim = hvd.rank() == hvd.size() - 1
    try:
        for step in range(8):
            if victim and step == DIES_AT:
                os._exit(0)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            print(f"STEP {hvd.rank()} {step + 1}", flush=True)
    except Exception as e:  # noqa: BLE001 - reported for the test
        print(f"RAISED {hvd.rank()} {type(e).__name__}: {str(e)[:300]}", flush=True)
        os._exit(1)
