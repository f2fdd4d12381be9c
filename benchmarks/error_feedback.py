"""What error feedback and DGC momentum add over the bare compressor, in in-place adds.

    python benchmarks/error_feedback.py [--numel 25000000] [--reps 5] [--only topk,int8] [--clock thread] [--each]
                                        [--best-of 1]

One 1-D fp32 tensor, 1 torch thread. For each compressor, in one run and interleaved so
machine noise hits all alike: the median time of `e.add_(x)` on the same tensor (the unit),
of `compressor.encode(x)` (bare), of `ErrorFeedback.encode(x)` and of `DGCMomentum.encode`
after warm-up steps (steady state: its buffers exist), the bare encode on the very data the
wrapper compresses (x plus the residual: a threshold's count grows with it). Printed: the times and
(EF - bare) / add, the cost of error feedback counted in in-place adds (target <= 3), from the
medians, from the minimums, and paired (the median over repetitions of each one's own
(EF - bare) / add: the fair figure where the data sets the work, as threshold's count, which
swings from step to step under error feedback). `--best-of N` times each repetition's bare encode
and (ErrorFeedback rows) its wrapped encode N times on the same data and state, the residual put
back in between, and keeps the fastest: an encode that allocates a large packet can take 3x longer
on one call than the next, with the same input (threshold at high counts). `--clock thread` times with the thread's CPU clock instead of
the wall clock: on a machine shared with other jobs the time spent waiting for a core then
drops out (memory-bandwidth contention does not; page faults are counted either way).
Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch

import gradwire
from gradwire import Ctx, DGCMomentum, ErrorFeedback

SPECS = ["topk:ratio=0.01", "dgc:ratio=0.01", "randomk:ratio=0.01", "threshold:threshold=2.5",
         "topk:ratio=0.01+fp16", "int8", "fp8", "qsgd:bits=4", "qsgd", "terngrad", "sign", "onebit",
         "fp16", "bf16", "none"]
DGC_SPECS = ["topk:ratio=0.01", "dgc:ratio=0.01"]


_CLOCK = time.perf_counter


def _time(fn) -> float:
    start = _CLOCK()
    fn()
    return _CLOCK() - start


def _next_input(wrapper, x: torch.Tensor) -> torch.Tensor:
    """The tensor the wrapper's next encode hands to its compressor (x + residual, or
    DGC's v + m*u + x), so the bare encode sees the same data (selection counts depend on it)."""
    if isinstance(wrapper, ErrorFeedback):
        return x + wrapper.residual("w")
    return wrapper.v["w"] + (wrapper.u["w"] * wrapper.momentum + x)


def _timed_wrapper(wrapper, x: torch.Tensor, t: int, best_of: int) -> float:
    """The wrapper's encode of x at step t; for ErrorFeedback the fastest of best_of runs, the
    residual restored before each rerun (so every run sees the same state and data)."""
    if best_of <= 1 or not isinstance(wrapper, ErrorFeedback):
        return _time(lambda: wrapper.encode(x, "w", Ctx(step=t)))
    saved = wrapper.residual("w").clone()
    times = []
    for b in range(best_of):
        if b:
            wrapper.residual("w").copy_(saved)
        times.append(_time(lambda: wrapper.encode(x, "w", Ctx(step=t))))
    return min(times)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--only", help="comma-separated specs (default: all)")
    p.add_argument("--clock", choices=["wall", "thread"], default="wall",
                   help="wall clock, or this thread's CPU time (robust to other jobs' load)")
    p.add_argument("--each", action="store_true", help="also print every repetition's times")
    p.add_argument("--best-of", type=int, default=1, help="time each repetition N times, keep the fastest")
    args = p.parse_args()
    global _CLOCK
    _CLOCK = time.perf_counter if args.clock == "wall" else time.thread_time
    torch.set_num_threads(1)
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(args.numel, generator=gen)
    e = torch.randn(args.numel, generator=gen) * 1e-3
    specs = args.only.split(",") if args.only else SPECS
    rows = [(s, "ef") for s in specs] + [(s, "dgc") for s in DGC_SPECS if not args.only or s in specs]
    print(f"{args.numel:,} fp32 elements, 1 thread, {args.reps} interleaved repetitions, {args.clock} clock; "
          f"times are medians, "
          f"extra/add from medians and (robust to a shared machine's bursts) from minimums")
    print(f"{'compressor':26s} {'add ms':>7s} {'bare ms':>8s} {'with ms':>8s} {'extra/add':>9s} {'(min)':>6s} "
          f"{'(paired)':>8s}")
    for spec, kind in rows:
        c = gradwire.compressor(spec)
        wrapper = ErrorFeedback(c) if kind == "ef" else DGCMomentum(c)
        for t in range(3):  # warm-up: state and spare buffers exist afterwards
            wrapper.encode(x, "w", Ctx(step=t))
        adds, bare, wrapped = [], [], []
        for t in range(args.reps):
            same = _next_input(wrapper, x)  # what the wrapper will compress: the same data for both
            adds.append(_time(lambda: e.add_(x)))
            bare.append(min(_time(lambda: c.encode(same, Ctx(step=t))) for _ in range(args.best_of)))
            wrapped.append(_timed_wrapper(wrapper, x, t, args.best_of))
        a, b, w = (statistics.median(v) * 1e3 for v in (adds, bare, wrapped))
        lo = (min(wrapped) - min(bare)) / min(adds)
        paired = statistics.median((wr - br) / ar for wr, br, ar in zip(wrapped, bare, adds))
        label = spec if kind == "ef" else f"DGCMomentum({spec})"
        print(f"{label:26s} {a:7.1f} {b:8.1f} {w:8.1f} {(w - b) / a:9.2f} {lo:6.2f} {paired:8.2f}", flush=True)
        if args.each:
            for r, (ar, br, wr) in enumerate(zip(adds, bare, wrapped)):
                print(f"    repetition {r}: add {ar * 1e3:.1f} ms, bare {br * 1e3:.1f} ms, with {wr * 1e3:.1f} ms, "
                      f"extra/add {(wr - br) / ar:.2f}")
        del wrapper


if __name__ == "__main__":
    main()
