"""gradwire's DDP hooks beside torch's own, one model, one run, 2 gloo ranks.

    python benchmarks/hooks_vs_torch.py [--steps 20] [--rounds 3] [--json out.json]

Model: an MLP of 6.3M fp32 parameters (1024 -> 2048 -> 1024 -> 2048 -> 10), batch 32, SGD,
1 torch thread per rank, one gradient bucket (`bucket_cap_mb=100`, see BUCKET_MB).
Configurations, each its own DDP replica of the same model:
DDP's default allreduce; torch's `fp16_compress_hook` beside gradwire `fp16` (allreduce,
no error feedback, compressing from the first step as torch does); torch's `powerSGD_hook`
(rank 4, start_powerSGD_iter 2, error feedback and warm start) beside gradwire `powersgd`
(the same rank, start iteration and options); gradwire's top-k 1% strategies (allgather,
artopk, with error feedback). Options are passed explicitly, not left to defaults.

Every configuration first runs its warm-up steps (past its start iteration), then the
configurations take turns, `--steps` steps each per round, so machine noise spreads over
all of them. Reported: the median step time (forward, backward with the hook's exchange,
optimizer step) and its ratio to DDP's default and to torch's hook for the same algorithm.
Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
from multiproc import run_ranks  # noqa: E402

START = 2  # the iteration at which both PowerSGD hooks start compressing
CONFIGS = [  # (label, kind, options); "pair" names the torch hook a gradwire row is compared with
    ("ddp default", "ddp", {}),
    ("torch fp16_compress_hook", "torch-fp16", {}),
    ("gradwire fp16", "gradwire", {"compressor": "fp16", "strategy": "allreduce", "error_feedback": False,
                                   "start_iter": 0, "pair": "torch fp16_compress_hook"}),
    ("torch powerSGD_hook r4", "torch-powersgd", {}),
    ("gradwire powersgd r4", "gradwire", {"compressor": "none", "strategy": "powersgd", "error_feedback": True,
                                          "start_iter": START, "rank": 4, "min_compression_rate": 2.0,
                                          "warm_start": True, "pair": "torch powerSGD_hook r4"}),
    ("gradwire topk 1% allgather", "gradwire", {"compressor": "topk:ratio=0.01", "strategy": "allgather",
                                                "error_feedback": True, "start_iter": START}),
    ("gradwire topk 1% artopk", "gradwire", {"compressor": "topk:ratio=0.01", "strategy": "artopk",
                                             "error_feedback": True, "start_iter": START}),
]
BATCH = 32
BUCKET_MB = 100  # one bucket for every replica: with several, torch's powerSGD_hook issues its
# collectives from future callbacks in an order that can differ between gloo ranks (and hangs)


def model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 1024), nn.ReLU(),
                         nn.Linear(1024, 2048), nn.ReLU(), nn.Linear(2048, 10))


def _replica(kind: str, options: dict):
    from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
    from torch.distributed.algorithms.ddp_comm_hooks import powerSGD_hook as psgd
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwire.hooks import ddp as gw

    ddp = DDP(model(), bucket_cap_mb=BUCKET_MB)
    if kind == "torch-fp16":
        ddp.register_comm_hook(None, default_hooks.fp16_compress_hook)
    elif kind == "torch-powersgd":
        state = psgd.PowerSGDState(process_group=None, matrix_approximation_rank=4, start_powerSGD_iter=START,
                                   min_compression_rate=2.0, use_error_feedback=True, warm_start=True, random_seed=0)
        ddp.register_comm_hook(state, psgd.powerSGD_hook)
    elif kind == "gradwire":
        opts = {k: v for k, v in options.items() if k != "pair"}
        gw.register(ddp, opts.pop("compressor"), **opts)
    return ddp, torch.optim.SGD(ddp.parameters(), lr=0.01)


def _run(rank: int, world: int, steps: int, rounds: int, only: str | None) -> dict:
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(rank)
    x = torch.randn(BATCH, 1024, generator=gen)
    y = torch.randint(0, 10, (BATCH,), generator=gen)
    replicas = [_replica(kind, opts) for _, kind, opts in _configs(only)]

    def step(ddp, opt) -> float:
        torch.distributed.barrier()
        start = time.perf_counter()
        opt.zero_grad(set_to_none=False)
        nn.functional.cross_entropy(ddp(x), y).backward()
        opt.step()
        return time.perf_counter() - start

    for ddp, opt in replicas:  # warm-up: DDP's bucket rebuild, dense iterations, state allocation
        for _ in range(START + 2):
            step(ddp, opt)
    times: list[list[float]] = [[] for _ in replicas]
    for _ in range(rounds):
        for i, (ddp, opt) in enumerate(replicas):
            times[i] += [step(ddp, opt) for _ in range(steps)]
    return {"params": sum(p.numel() for p in model().parameters()), "times": times}


def _configs(only: str | None) -> list:
    """CONFIGS, or those whose label contains one of the comma-separated words (DDP's default always)."""
    if not only:
        return CONFIGS
    return [c for i, c in enumerate(CONFIGS) if i == 0 or any(w in c[0] for w in only.split(","))]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json")
    p.add_argument("--only", help="comma-separated words: run the configurations whose label holds one")
    args = p.parse_args()
    configs = _configs(args.only)
    out = run_ranks(_run, 2, args.steps, args.rounds, args.only, timeout=3600)
    # a step ends when both ranks are done: the slower rank's time counts
    medians = [statistics.median(max(a, b) for a, b in zip(t0, t1))
               for t0, t1 in zip(out[0]["times"], out[1]["times"])]
    by_label = {label: m for (label, _, _), m in zip(configs, medians)}
    print(f"MLP of {out[0]['params']:,} fp32 parameters, 2 gloo ranks, batch {BATCH}, 1 thread; "
          f"median of {args.rounds} x {args.steps} steps")
    print(f"{'configuration':30s} {'step ms':>8s} {'vs ddp':>7s} {'vs torch hook':>14s}")
    rows = []
    for (label, _, opts), m in zip(configs, medians):
        pair = opts.get("pair") if opts.get("pair") in by_label else None
        ratio = f"{m / by_label[pair]:.3f}x" if pair else ""
        print(f"{label:30s} {m * 1e3:8.1f} {m / medians[0]:6.2f}x {ratio:>14s}")
        rows.append({"label": label, "step_s": m, "vs_ddp": m / medians[0],
                     "vs_torch": m / by_label[pair] if pair else None})
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"steps": args.steps, "rounds": args.rounds, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
