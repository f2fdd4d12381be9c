"""gradwire's compress + decompress round trip beside GRACE's algorithms, same tensor, one run.

    python benchmarks/vs_grace.py [--numel 25000000] [--reps 5] [--only randomk,dgc] [--min] [--clock thread]

The anchors re-implement, in plain torch, the algorithms GRACE publishes for its torch
compressors (sands-lab/grace, grace_dl/dist/compressor/: randomk.py, topk.py, dgc.py,
terngrad.py, onebit.py, fp16.py) -- the steps are GRACE's, the code is ours:

* randomk: seed from the name and step, k = max(1, int(n * ratio)) indices by randint
  (with repetition), gather; decompress: zeros, scatter.
* topk: torch.topk of |x| (unsorted), gather; decompress: zeros, scatter.
* dgc: a 1% uniform random sample, the top ratio of its |x| as threshold, mask |x| >= thr,
  up to 10 threshold corrections (x1.3 above 1.3k, x0.7 below 0.7k), where(mask), gather;
  decompress: zeros, scatter.
* terngrad: clip to 2.5 standard deviations, scalar = max |x|, keep sign where a uniform
  sample times scalar is below |x|, int8 signs; decompress: sign * scalar.
* onebit: mask x < 0, the means of both halves, a uint8 mask; decompress: mask * mean0 +
  ~mask * mean1.
* fp16: x.half(); decompress: .float() (also the bare cast pair the fp16 codec is held to).

gradwire's round trip three ways: `decode(encode(x))` (a fresh output, like GRACE's);
`decode(encode(x), out=buf)` into a buffer reused every step (a receiver with a bucket it
keeps across steps; GRACE's decompress API has no `out=`, so its anchor
always builds a fresh tensor, as gradwire's first column does -- on transparent huge pages
where the kernel offers them, see gradwire/compress/alloc.py; `--no-huge-pages` turns that
off); and `add_decoded(encode(x), buf.zero_())` (how the allgather
strategy sums packets). Timings interleave all sides; printed is the median (or minimum)
and gradwire's speed-up (GRACE time / gradwire time). 1 torch thread; `--clock thread`
times this thread's CPU time (robust to other jobs on a shared machine). Not a test;
numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradwire
from gradwire import Ctx
from gradwire.compress import alloc


# ---- GRACE's algorithms, re-implemented ---------------------------------------------------
def grace_randomk(x: torch.Tensor, ratio: float, step: int) -> torch.Tensor:
    torch.manual_seed(sum(b"w") + step)
    n = x.numel()
    idx = torch.randint(n, [max(1, int(n * ratio))])
    values = x[idx]
    return torch.zeros(n, dtype=values.dtype).scatter_(0, idx, values)


def grace_topk(x: torch.Tensor, ratio: float, step: int) -> torch.Tensor:
    n = x.numel()
    _, idx = torch.topk(x.abs(), max(1, int(n * ratio)), sorted=False)
    values = torch.gather(x, 0, idx)
    return torch.zeros(n, dtype=values.dtype).scatter_(0, idx, values)


def grace_dgc(x: torch.Tensor, ratio: float, step: int) -> torch.Tensor:
    n = x.numel()
    sample = x[torch.empty(max(1, int(n * 0.01))).uniform_(0, n).long()]
    thr = torch.topk(sample.abs(), max(1, int(n * ratio * 0.01))).values.min()
    mask = x.abs() >= thr
    selected = mask.sum()
    for _ in range(10):
        if selected > 1.3 * n * ratio:
            thr = 1.3 * thr
        elif selected < 0.7 * n * ratio:
            thr = 0.7 * thr
        else:
            break
        mask = x.abs() >= thr
        selected = mask.sum()
    idx, = torch.where(mask)
    values = x[idx]
    return torch.zeros(n, dtype=values.dtype).scatter_(0, idx, values)


def grace_terngrad(x: torch.Tensor, ratio: float, step: int) -> torch.Tensor:
    std = torch.sqrt(torch.mean((x - torch.mean(x)) ** 2))
    c = 2.5 * std.item()
    g = torch.clamp(x, -c, c)
    a = g.abs()
    scalar = a.max()
    signs = g.sign() * scalar
    signs[torch.empty_like(x).uniform_(0, 1) * scalar.item() >= a] = 0
    return signs.sign().char().float() * scalar


def grace_onebit(x: torch.Tensor, ratio: float, step: int) -> torch.Tensor:
    n = x.numel()
    mask0 = x < 0
    sum0, num0 = torch.sum(x[mask0]), torch.sum(mask0).float()
    mean0 = sum0 / num0 if num0 > 0 else sum0
    sum1, num1 = torch.sum(x[~mask0]), n - num0
    mean1 = sum1 / num1 if num1 > 0 else sum1
    m = mask0.to(torch.uint8)
    return m * mean0 + (1 - m) * mean1  # GRACE: mask0 * mean0 + ~mask0 * mean1


def grace_fp16(x: torch.Tensor, ratio: float, step: int) -> torch.Tensor:
    return x.half().float()


ROWS = [("randomk", grace_randomk, "randomk:ratio=0.01"), ("topk", grace_topk, "topk:ratio=0.01"),
        ("dgc", grace_dgc, "dgc:ratio=0.01"), ("terngrad", grace_terngrad, "terngrad:bucket=0"),
        ("onebit", grace_onebit, "onebit"), ("fp16", grace_fp16, "fp16")]


_CLOCK = time.perf_counter


def _time(fn) -> float:
    start = _CLOCK()
    fn()
    return _CLOCK() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", help="comma-separated row names (default: all)")
    p.add_argument("--min", action="store_true", help="minimums instead of medians (a shared machine's bursts)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="wall clock, or this thread's CPU time (robust to other jobs' load)")
    p.add_argument("--no-huge-pages", action="store_true",
                   help="gradwire's fresh outputs from torch's allocator (gradwire.compress.alloc.ENABLED = False)")
    args = p.parse_args()
    alloc.ENABLED = not args.no_huge_pages
    global _CLOCK
    _CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(1)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    out = torch.zeros_like(x)
    rows = [r for r in ROWS if not args.only or r[0] in args.only.split(",")]
    print(f"{args.numel:,} fp32 elements, 1 thread, {'minimum' if args.min else 'median'} of {args.reps}, "
          f"{args.clock} clock, huge pages {'off' if args.no_huge_pages else 'on'}; speed-up = GRACE ms / gradwire ms")
    print(f"{'algorithm':10s} {'gradwire spec':20s} {'GRACE ms':>9s} {'fresh decode':>13s} {'x':>7s} "
          f"{'decode(out=buf)':>16s} {'x':>7s} {'add_decoded':>12s} {'x':>7s}")
    for name, grace, spec in rows:
        c = gradwire.compressor(spec)
        times: list[list[float]] = [[], [], [], []]
        for t in range(args.reps + 1):  # the first round warms up
            ctx = Ctx(step=t, key=1)
            run = [_time(lambda: grace(x, 0.01, t)),
                   _time(lambda: c.decode(c.encode(x, ctx))),
                   _time(lambda: c.decode(c.encode(x, ctx), out=out)),
                   _time(lambda: c.add_decoded(c.encode(x, ctx), out.zero_()))]
            if t:
                for v, r in zip(times, run):
                    v.append(r)
        mg, ma, mo, mb = ((min(v) if args.min else statistics.median(v)) * 1e3 for v in times)
        print(f"{name:10s} {spec:20s} {mg:9.1f} {ma:13.1f} {mg / ma:6.2f}x {mo:16.1f} {mg / mo:6.2f}x "
              f"{mb:12.1f} {mg / mb:6.2f}x", flush=True)


if __name__ == "__main__":
    main()
