"""Per-step exchange time and bytes for a ~25M-parameter model's gradients, N gloo ranks.

    python benchmarks/exchange.py --world 4 --steps 3 [--json out.json]

Each rank holds the gradients of a model of 6 Linear(2048, 2048) layers (25.2M parameters),
grouped into 25 MB buckets as DDP does by default, and exchanges them with each strategy
through gradwire's strategy API (what the DDP hook calls). Reported per step: the median
wall time from the first bucket's launch until every bucket's sum is ready (encode +
exchange + decode), and the bytes this rank sent. Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
from multiproc import run_ranks  # noqa: E402

from gradwire import Ctx  # noqa: E402
from gradwire.comm.registry import make_strategy  # noqa: E402
from gradwire.comm.torch_dist import TorchDistBackend  # noqa: E402

LAYERS, WIDTH = 6, 2048
CONFIGS = [
    ("dense", "none", {}),
    ("allreduce", "fp16", {}),
    ("allgather", "topk:ratio=0.01", {}),
    ("artopk", "topk:ratio=0.01", {}),
    ("oktopk", "topk:ratio=0.01", {}),
    ("allgather", "qsgd:bits=4", {}),
    ("allgather", "topk:ratio=0.01+fp16", {}),
    ("allreduce", "randomk:ratio=0.01", {}),
    ("powersgd", "none", {"rank": 4}),
    ("auto", "topk:ratio=0.01", {}),
]


def shapes() -> list[tuple[int, ...]]:
    out: list[tuple[int, ...]] = []
    for _ in range(LAYERS):
        out += [(WIDTH, WIDTH), (WIDTH,)]
    return out


def buckets(cap_bytes: int = 25 * 1024 * 1024) -> list[list[int]]:
    """Indices of shapes per bucket, filled in reverse order like DDP."""
    groups: list[list[int]] = [[]]
    size = 0
    for i in reversed(range(len(shapes()))):
        n = 4 * torch.Size(shapes()[i]).numel()
        if groups[-1] and size + n > cap_bytes:
            groups.append([])
            size = 0
        groups[-1].append(i)
        size += n
    return groups


def _run(rank: int, world: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    backend = TorchDistBackend()
    all_shapes = shapes()
    names = [f"layer{i // 2}.{'weight' if i % 2 == 0 else 'bias'}" for i in range(len(all_shapes))]
    results = []
    for strategy_name, spec, options in CONFIGS:
        strategy = make_strategy(strategy_name, backend, spec, error_feedback=True, **options)
        strategy.into_input = True  # results may land in the bucket, as the DDP hook allows
        if hasattr(strategy, "plan_sizes"):
            strategy.plan_sizes = [torch.Size(s).numel() for s in all_shapes]
        times, sent, received = [], [], []
        for step in range(steps + 1):  # step 0 warms up
            g = torch.Generator().manual_seed(1000 * step + rank)
            flats = [torch.randn(sum(torch.Size(all_shapes[i]).numel() for i in b), generator=g) * 1e-3
                     for b in buckets()]
            torch.distributed.barrier()
            start = time.perf_counter()
            works = [strategy.exchange(flat, bi, Ctx(seed=0, step=step, rank=rank, key=bi), average=True,
                                       shapes=[torch.Size(all_shapes[i]) for i in b], keys=[names[i] for i in b])
                     for bi, (b, flat) in enumerate(zip(buckets(), flats))]
            for w in works:
                w.wait()
            elapsed = time.perf_counter() - start
            stats = strategy.take_stats()
            if step:
                times.append(elapsed)
                sent.append(stats.bytes_sent)
                received.append(stats.bytes_received)
        results.append({"strategy": strategy_name, "compressor": spec, "options": options,
                        "step_s": statistics.median(times), "bytes_sent": int(statistics.median(sent)),
                        "bytes_received": int(statistics.median(received)),
                        "choice": getattr(strategy, "choice", None)})
    return results


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--world", type=int, default=4)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--json")
    args = p.parse_args()
    rows = run_ranks(_run, args.world, args.steps, timeout=3600)[0]
    dense = rows[0]
    numel = sum(torch.Size(s).numel() for s in shapes())
    print(f"{numel:,} fp32 parameters in {len(buckets())} buckets, {args.world} gloo ranks, median of {args.steps} steps")
    print(f"{'strategy':10s} {'compressor':22s} {'step s':>8s} {'speed-up':>8s} {'MB sent':>9s} {'MB recv':>9s} {'less':>7s}")
    for r in rows:
        label = r["strategy"] + (f"->{r['choice']}" if r["choice"] else "")
        print(f"{label:10s} {r['compressor'] + (' ' + str(r['options']) if r['options'] else ''):22s} "
              f"{r['step_s']:8.3f} {dense['step_s'] / r['step_s']:8.2f} {r['bytes_sent'] / 1e6:9.2f} "
              f"{r['bytes_received'] / 1e6:9.2f} {dense['bytes_sent'] / max(r['bytes_sent'], 1):6.1f}x")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"world": args.world, "steps": args.steps, "numel": numel, "rows": rows}, f, indent=2)


if __name__ == "__main__":
    main()
