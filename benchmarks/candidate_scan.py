"""The candidate scan of topk/dgc/threshold on the CPU: NumPy's masks vs the compiled loop.

    python benchmarks/candidate_scan.py [--numel 25000000] [--reps 3]

One 1-D fp32 tensor of randn, 1 torch thread, this thread's CPU clock. For each density (the
share of elements at or above the threshold) the fastest of --reps scans of each path, which
must find the same indices. Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from gradwire.compress import select


def _fastest(reps: int, fn) -> tuple[float, torch.Tensor]:
    best, out = float("inf"), None
    for _ in range(reps):
        start = time.thread_time()
        out = fn()
        best = min(best, time.thread_time() - start)
    return best, out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=3)
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    sample = x[: min(args.numel, 1_000_000)].abs()
    print(f"{args.numel:,} fp32 elements, 1 thread, fastest of {args.reps}, thread clock")
    print(f"{'density':>8s} {'count':>11s} {'NumPy ms':>9s} {'compiled ms':>12s}")
    for density in (0.001, 0.01, 0.05, 0.2, 0.5):
        key = select.ceil_key(float(torch.quantile(sample, 1 - density)), torch.float32)
        times = {}
        found = {}
        for path in ("0", "1"):
            os.environ["GRADWIRE_COMPILED"] = path
            times[path], found[path] = _fastest(args.reps, lambda: select.candidates(x, key))
        assert torch.equal(found["0"], found["1"]), "the two paths found different candidates"
        print(f"{density:8.3f} {found['1'].numel():11,d} {times['0'] * 1e3:9.1f} {times['1'] * 1e3:12.1f}")


if __name__ == "__main__":
    main()
