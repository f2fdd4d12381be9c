"""Bytes per rank per step of top-k strategies as the cluster grows: P = 2, 4, 8, 16 gloo ranks.

    python benchmarks/sparse_scaling.py [--worlds 2,4,8,16] [--numel 4000000] [--json out.json]

Every rank exchanges one bucket of `numel` fp32 gradients (heavy-tailed random values, a new
draw each step, error feedback on) with dense allreduce, allgather top-k 1%, AR-top-k and
oktopk, and the comm layer counts what it hands to and gets from the collectives. Bytes do not
depend on the cores, so P = 16 processes on a 2-core machine measure what 16 machines would
send. Reported: medians over the steps after the first (oktopk's threshold estimate included
where it falls), rank 0 and the maximum over ranks. Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
from multiproc import run_ranks  # noqa: E402

from gradwire import Ctx  # noqa: E402
from gradwire.comm.registry import make_strategy  # noqa: E402
from gradwire.comm.torch_dist import TorchDistBackend  # noqa: E402

STRATEGIES = [("dense", "none"), ("allgather", "topk:ratio=0.01"), ("artopk", "topk:ratio=0.01"),
              ("oktopk", "topk:ratio=0.01")]


def _run(rank: int, world: int, numel: int, steps: int) -> list[dict]:
    torch.set_num_threads(1)
    backend = TorchDistBackend()
    rows = []
    for name, spec in STRATEGIES:
        strategy = make_strategy(name, backend, spec, error_feedback=name != "dense")
        sent, received = [], []
        for step in range(steps + 1):
            g = torch.Generator().manual_seed(1000 * step + rank)
            x = torch.randn(numel, generator=g) * torch.rand(numel, generator=g).mul_(4).exp_()
            strategy.exchange(x, 0, Ctx(step=step, rank=rank), average=True).wait()
            stats = strategy.take_stats()
            if step:
                sent.append(stats.bytes_sent)
                received.append(stats.bytes_received)
        rows.append({"strategy": name, "compressor": spec, "bytes_sent": statistics.median(sent),
                     "bytes_received": statistics.median(received)})
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--worlds", default="2,4,8,16")
    p.add_argument("--numel", type=int, default=4_000_000)
    p.add_argument("--steps", type=int, default=4)
    p.add_argument("--json")
    args = p.parse_args()
    k = args.numel // 100
    table = []
    print(f"one bucket of {args.numel:,} fp32, top-k 1% (k = {k:,}), median of {args.steps} steps after the first; "
          f"MB per rank per step (rank 0 / max over ranks)")
    print(f"{'P':>3s} {'strategy':10s} {'sent':>15s} {'received':>17s} {'recv / allgather':>17s}")
    for world in (int(w) for w in args.worlds.split(",")):
        per_rank = run_ranks(_run, world, args.numel, args.steps, timeout=3600)
        allgather_recv = per_rank[0][1]["bytes_received"]
        for i, (name, spec) in enumerate(STRATEGIES):
            sent = [r[i]["bytes_sent"] for r in per_rank]
            recv = [r[i]["bytes_received"] for r in per_rank]
            row = {"world": world, "strategy": name, "compressor": spec, "sent_rank0": sent[0], "sent_max": max(sent),
                   "received_rank0": recv[0], "received_max": max(recv), "k": k,
                   "received_vs_allgather": recv[0] / allgather_recv}
            table.append(row)
            print(f"{world:3d} {name:10s} {sent[0] / 1e6:7.3f} /{max(sent) / 1e6:7.3f} {recv[0] / 1e6:8.3f} /"
                  f"{max(recv) / 1e6:8.3f} {row['received_vs_allgather']:17.3f}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"numel": args.numel, "steps": args.steps, "rows": table}, f, indent=2)


if __name__ == "__main__":
    main()
