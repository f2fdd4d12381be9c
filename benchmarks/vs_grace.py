"""gradwire's compress + decompress round trip beside GRACE's algorithms, same tensor, one run.

    python benchmarks/vs_grace.py [--numel 25000000] [--reps 5] [--only randomk,dgc]

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

gradwire's round trip is `decode(encode(x))` (a fresh output, like GRACE's) and, beside it,
`add_decoded(encode(x), out)` into a zeroed reused buffer (how the allgather strategy sums
packets). Timings interleave the two sides; printed is the median and gradwire's speed-up
(GRACE time / gradwire time). 1 torch thread. Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradwire
from gradwire import Ctx


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


def _time(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", help="comma-separated row names (default: all)")
    p.add_argument("--min", action="store_true", help="minimums instead of medians (a shared machine's bursts)")
    args = p.parse_args()
    torch.set_num_threads(1)
    x = torch.randn(args.numel, generator=torch.Generator().manual_seed(0))
    out = torch.zeros_like(x)
    rows = [r for r in ROWS if not args.only or r[0] in args.only.split(",")]
    print(f"{args.numel:,} fp32 elements, 1 thread, {'minimum' if args.min else 'median'} of {args.reps}")
    print(f"{'algorithm':10s} {'gradwire spec':20s} {'GRACE ms':>9s} {'decode ms':>10s} {'speed-up':>9s} "
          f"{'add_decoded ms':>15s} {'speed-up':>9s}")
    for name, grace, spec in rows:
        c = gradwire.compressor(spec)
        g, a, b = [], [], []
        for t in range(args.reps + 1):  # the first round warms up
            ctx = Ctx(step=t, key=1)
            tg = _time(lambda: grace(x, 0.01, t))
            ta = _time(lambda: c.decode(c.encode(x, ctx)))
            tb = _time(lambda: c.add_decoded(c.encode(x, ctx), out.zero_()))
            if t:
                g.append(tg)
                a.append(ta)
                b.append(tb)
        mg, ma, mb = (statistics.median(v) * 1e3 for v in (g, a, b)) if not args.min else \
            (min(v) * 1e3 for v in (g, a, b))
        print(f"{name:10s} {spec:20s} {mg:9.1f} {ma:10.1f} {mg / ma:8.2f}x {mb:15.1f} {mg / mb:8.2f}x", flush=True)


if __name__ == "__main__":
    main()
