"""error_feedback.py's measurement on one line, to alternate two checkouts (A/B) on a shared machine.

    PYTHONPATH=<checkout> python benchmarks/feedback_ab.py fp8,qsgd,D:topk:ratio=0.01 7 LABEL

For each spec (``D:`` = DGCMomentum around it, else ErrorFeedback), after 3 warm-up steps:
`reps` interleaved repetitions of `e.add_(x)`, the bare encode of the data the wrapper
compresses, and the wrapper's encode, timed with the thread's CPU clock. Printed:
``spec:extra/add from the minimums/from the medians``. Only the public API is used, so an
older checkout runs it too. Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import statistics
import sys
import time

import torch

import gradwire
from gradwire import Ctx, DGCMomentum, ErrorFeedback


def _time(fn) -> float:
    start = time.thread_time()
    fn()
    return time.thread_time() - start


def main() -> None:
    specs, reps, label = sys.argv[1].split(","), int(sys.argv[2]), sys.argv[3]
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(25_000_000, generator=gen)
    e = torch.randn(25_000_000, generator=gen) * 1e-3
    out = []
    for spec in specs:
        dgc = spec.startswith("D:")
        c = gradwire.compressor(spec[2:] if dgc else spec)
        w = DGCMomentum(c) if dgc else ErrorFeedback(c)
        for t in range(3):
            w.encode(x, "w", Ctx(step=t))
        adds, bare, wrapped = [], [], []
        for r in range(reps):
            same = w.v["w"] + (w.u["w"] * w.momentum + x) if dgc else x + w.residual("w")
            adds.append(_time(lambda: e.add_(x)))
            bare.append(_time(lambda: c.encode(same, Ctx(step=r))))
            wrapped.append(_time(lambda: w.encode(x, "w", Ctx(step=r))))
        lo = (min(wrapped) - min(bare)) / min(adds)
        med = (statistics.median(wrapped) - statistics.median(bare)) / statistics.median(adds)
        out.append(f"{spec}:{lo:.2f}/{med:.2f}")
    print(label, " ".join(out), flush=True)


if __name__ == "__main__":
    main()
