"""GPU kernel throughput: GB/s per kernel at 1M, 16M and 256M elements, fp32 and bf16,
beside torch.topk and a device-to-device copy measured in the same run; error feedback's
fused steps beside the bare encodes (what feedback costs on a GPU).

Timing: CUDA events around each call, 3 warm-ups, median of up to 15 runs. GB/s counts
the bytes a kernel must move at least (its input read once plus its output written);
"% copy" compares that with the copy's read + write bandwidth in the same run.

    python benchmarks/cuda_kernels.py --out DIR      (writes DIR/cuda_kernels.json and .md)
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from pathlib import Path

import torch

from gradwire import Ctx, compressor
from gradwire.compress import rng
from gradwire.compress.select import ceil_key
from gradwire.cuda import entropy, ops

SIZES = (1 << 20, 1 << 24, 1 << 28)
DTYPES = (torch.float32, torch.bfloat16)


def timed(fn, reps: int = 15, budget_s: float = 2.0) -> float:
    """Median milliseconds of fn() by CUDA events (3 warm-ups; fewer runs when slow)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < reps and (len(times) < 3 or time.perf_counter() - start < budget_s):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times)


def cases(x: torch.Tensor):
    """(name, fn, bytes moved) for every kernel on input x."""
    n, isz = x.numel(), x.element_size()
    k = max(1, n // 100)
    inb = n * isz
    g = -(-n // 8)
    key = rng.stream_key(0, 1, 0, 7, stream=10)
    other = torch.bfloat16 if x.dtype == torch.float32 else torch.float32
    fp8 = ops.fp8_encode(x, 1024, False, 448.0, torch.float8_e4m3fn)
    fp4 = ops.fp4_encode(x, 32)
    i8 = ops.int8_encode(x, 1024)
    qs = ops.stochastic_encode(x, 512, 255, 8, key, True)
    sg = ops.sign_encode(x, 1024, False)
    idx, vals = ops.topk(x, k)
    planes = torch.empty(inb, dtype=torch.uint8, device=x.device)
    ops.split_planes(x, planes)
    thr = torch.sort(x.float().abs()[:: max(1, n // 100_000)]).values
    tkey = ceil_key(float(thr[int(0.99 * (thr.numel() - 1))]), x.dtype)
    yield "cast", lambda: ops.cast(x, other), inb + n * torch.empty((), dtype=other).element_size()
    yield "fp8 encode (e4m3)", lambda: ops.fp8_encode(x, 1024, False, 448.0, torch.float8_e4m3fn), inb + n
    yield "fp8 decode", lambda: ops.fp8_decode(fp8[1], fp8[0], 1024, False, x.dtype), n + inb
    yield "fp4 encode (e2m1, blocks of 32)", lambda: ops.fp4_encode(x, 32), inb + 4 * g + n // 8
    yield "fp4 decode", lambda: ops.fp4_decode(fp4[1], fp4[0], n, 32, x.dtype), 4 * g + n // 8 + inb
    yield "int8 encode", lambda: ops.int8_encode(x, 1024), inb + n
    yield "int8 decode", lambda: ops.int8_decode(i8[2], i8[0], i8[1], 1024, x.dtype), n + inb
    yield "qsgd encode (8 bits)", lambda: ops.stochastic_encode(x, 512, 255, 8, key, True), inb + 9 * g
    yield "qsgd decode", lambda: ops.stochastic_decode(qs[1], qs[2], qs[0], n, 512, 255, 8, x.dtype), 9 * g + inb
    yield "terngrad encode", lambda: ops.stochastic_encode(x, 512, 1, 1, key, False), inb + 2 * g
    yield "sign encode (pack)", lambda: ops.sign_encode(x, 1024, False), inb + g
    yield "sign decode", lambda: ops.sign_decode(sg[1], sg[0], n, 1024, False, x.dtype), g + inb
    yield "onebit encode", lambda: ops.sign_encode(x, 1024, True), inb + g
    yield "topk 1% (radix select)", lambda: ops.topk(x, k), inb + k * (8 + isz)
    yield "torch.topk 1%", lambda: torch.topk(x.abs(), k, sorted=False), inb + k * (8 + isz)
    yield "threshold ~1%", lambda: ops.at_least(x, tkey), inb + k * (8 + isz)
    yield "randomk 1%", lambda: ops.randomk(x, k, key, False), k * (8 + 2 * isz)
    yield "scatter decode 1%", lambda: ops.scatter_sorted(idx, vals, n), k * (8 + isz) + inb
    yield "byte planes split", lambda: ops.split_planes(x, planes), 2 * inb
    yield "byte planes merge", lambda: ops.merge_planes(planes, isz, torch.empty_like(planes)), 2 * inb
    yield from feedback_cases(x)
    if entropy.use_nvcomp():
        frame = entropy.compress(planes)
        yield "nvCOMP ANS compress", lambda: entropy.compress(planes), inb + frame.numel()
        yield "nvCOMP ANS decompress", lambda: entropy.decompress(frame, 2 * inb + 4096), frame.numel() + inb


def feedback_cases(x: torch.Tensor):
    """Error feedback's fused steps (feedback.cu) through `encode_residual`, beside the bare
    encode of the same compressor: the bytes are the least an EF step must move (x and the
    residual read, the new residual and the packet written)."""
    n, isz = x.numel(), x.element_size()
    inb, g, k = n * isz, -(-n // 8), max(1, n // 100)
    e, out = torch.zeros_like(x), torch.empty_like(x)
    ctx = Ctx(seed=0, step=1, rank=0, key=7)
    for spec, packet in (("fp16", 2 * n), ("int8", n), ("fp4", 4 * g + n // 8), ("qsgd", 9 * g), ("sign", g),
                         ("topk:ratio=0.01,indices=raw", k * (8 + isz))):
        comp = compressor(spec)
        yield f"{spec} bare encode", lambda c=comp: c.encode(x, ctx), inb + packet
        yield f"{spec} error feedback (fused)", lambda c=comp: c.encode_residual(x, e, out, ctx), 3 * inb + packet
    u0, v0, u, v = (torch.zeros_like(x) for _ in range(4))
    yield "dgc momentum accumulate", lambda: ops.dgc_accumulate(x, u0, v0, u, v, 0.9, False), 5 * inb


def bench_size(dtype: torch.dtype, n: int) -> list[dict]:
    """The copy baseline, then every kernel, on one random input."""
    g = torch.Generator(device="cuda").manual_seed(0)
    x = torch.randn(n, device="cuda", generator=g).to(dtype)
    dst = torch.empty_like(x)
    name = str(dtype).replace("torch.", "")
    copy_ms = timed(lambda: dst.copy_(x))
    copy_gbs = 2 * x.numel() * x.element_size() / copy_ms / 1e6
    rows = [dict(op="copy (device to device)", dtype=name, n=n, ms=copy_ms, gbs=copy_gbs, pct_copy=100.0)]
    for op, fn, moved in cases(x):
        ms = timed(fn)
        gbs = moved / ms / 1e6
        rows.append(dict(op=op, dtype=name, n=n, ms=ms, gbs=gbs, pct_copy=100.0 * gbs / copy_gbs))
        print(f"{name:8} {n:>10} {op:28} {ms:9.3f} ms {gbs:9.1f} GB/s {rows[-1]['pct_copy']:6.1f}% of copy", flush=True)
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--out", default=".")
    ap.add_argument("--sizes", default=",".join(str(s) for s in SIZES))
    args = ap.parse_args()
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    sizes = [int(s) for s in args.sizes.split(",")]
    rows = []
    for dtype in DTYPES:
        for n in sizes:
            rows += bench_size(dtype, n)
            torch.cuda.empty_cache()
    meta = dict(device=torch.cuda.get_device_name(), torch=torch.__version__, python=platform.python_version(),
                date=time.strftime("%Y-%m-%d"), nvcomp=entropy.use_nvcomp(),
                timing="CUDA events, 3 warm-ups, median of up to 15 runs",
                gbs="bytes the kernel must move (input read once + output written) / time")
    (out / "cuda_kernels.json").write_text(json.dumps(dict(meta=meta, rows=rows), indent=1))
    lines = [f"GPU kernels on {meta['device']} ({meta['date']}, torch {meta['torch']}, nvCOMP: {meta['nvcomp']}); "
             f"{meta['timing']}; GB/s = {meta['gbs']}.", "",
             "| op | dtype | elements | ms | GB/s | % of copy |", "|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['op']} | {r['dtype']} | {r['n']:,} | {r['ms']:.3f} | {r['gbs']:.1f} | {r['pct_copy']:.0f}% |")
    (out / "cuda_kernels.md").write_text("\n".join(lines) + "\n")
    print(f"wrote {out / 'cuda_kernels.json'} and {out / 'cuda_kernels.md'}")


if __name__ == "__main__":
    main()
