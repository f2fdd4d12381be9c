"""Measurements behind `gradwire compare` and `gradwire bench` (benchmarks, not tests).

Every figure is the best of `repeat` runs in one process, so ratios between rows of one
run are meaningful even on a shared, noisy machine.
"""

from __future__ import annotations

import math
import time
from dataclasses import asdict, dataclass
from typing import Any, Callable

import torch
import zstandard

from .compress import Ctx, compressor

DEFAULT_SPECS = [
    "none", "fp16", "bf16", "fp8", "fp8:format=e5m2", "fp4", "int8", "qsgd", "qsgd:bits=4", "terngrad", "sign",
    "onebit", "topk:ratio=0.01", "topk:ratio=0.01+fp16", "randomk:ratio=0.01", "threshold", "dgc:ratio=0.01",
    "topk:ratio=0.01+qsgd:bits=8+zstd", "zstd", "fp16+zstd",
]


def best_time(fn: Callable[[], Any], repeat: int) -> float:
    """Best wall time of `repeat` calls after one warm-up call."""
    fn()
    best = math.inf
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


@dataclass
class Row:
    spec: str
    packet_bytes: int
    ratio: float
    rel_l2_error: float
    encode_gbps: float
    decode_gbps: float


def measure(spec: str, x: torch.Tensor, repeat: int = 3, ctx: Ctx | None = None) -> Row:
    """Packet size, error and speed of one compressor on one tensor."""
    c = compressor(spec)
    ctx = ctx or Ctx(seed=1)
    packet = c.encode(x, ctx).tensor()
    y = c.decode(packet, shape=x.shape)
    err = torch.linalg.vector_norm((y.float() - x.float())).item()
    norm = torch.linalg.vector_norm(x.float()).item()
    nbytes = x.numel() * x.element_size()
    t_enc = best_time(lambda: c.encode(x, ctx).tensor(), repeat)
    t_dec = best_time(lambda: c.decode(packet, shape=x.shape), repeat)
    return Row(str(c), packet.numel(), nbytes / max(packet.numel(), 1), err / norm if norm else 0.0,
               nbytes / t_enc / 1e9, nbytes / t_dec / 1e9)


def threshold_spec(x: torch.Tensor, density: float = 0.01) -> str:
    """A `threshold` spec keeping about `density` of x (3 significant digits)."""
    k = max(1, int(x.numel() * density))
    t = torch.kthvalue(x.abs().float().reshape(-1), x.numel() - k + 1).values.item()
    return f"threshold:threshold={float(f'{t:.3g}')}"


def with_threshold(specs: list[str], x: torch.Tensor) -> list[str]:
    """Replace a bare `threshold` by one fitted to x, so it keeps ~1% like the others."""
    return [threshold_spec(x) if s == "threshold" else s for s in specs]


def compare(x: torch.Tensor, specs: list[str] | None = None, repeat: int = 3) -> list[Row]:
    return [measure(s, x, repeat) for s in with_threshold(specs or DEFAULT_SPECS, x)]


def throughput(numel: int = 25_000_000, specs: list[str] | None = None, repeat: int = 3,
               seed: int = 0) -> list[dict[str, Any]]:
    """Encode/decode GB/s of every compressor on randn(numel) fp32, beside clone and torch.topk."""
    x = torch.randn(numel, generator=torch.Generator().manual_seed(seed))
    nbytes = x.numel() * x.element_size()
    k = max(1, numel // 100)
    rows: list[dict[str, Any]] = [
        {"spec": "baseline: x.clone()", "encode_gbps": nbytes / best_time(x.clone, repeat) / 1e9},
        {"spec": "baseline: torch.topk(|x|, 1%, sorted=False)",
         "encode_gbps": nbytes / best_time(lambda: torch.topk(x.abs(), k, sorted=False), max(1, repeat - 1)) / 1e9},
    ]
    copy = rows[0]["encode_gbps"]
    for spec in with_threshold(specs or DEFAULT_SPECS, x):
        r = asdict(measure(spec, x, repeat))
        r["vs_copy"] = r["encode_gbps"] / copy
        rows.append(r)
    rows[0]["vs_copy"], rows[1]["vs_copy"] = 1.0, rows[1]["encode_gbps"] / copy
    return rows


def wire_efficiency(tensors: dict[str, torch.Tensor]) -> list[dict[str, Any]]:
    """Bytes on the wire per kept element for top-k 1% with fp32 and fp16 values."""
    rows = []
    for label, x in tensors.items():
        for spec in ("topk:ratio=0.01", "topk:ratio=0.01+fp16"):
            c = compressor(spec)
            k = c.stages[0].value_count(x.numel()) if hasattr(c, "stages") else c.value_count(x.numel())
            nbytes = c.encode(x, Ctx()).nbytes
            rows.append({"tensor": label, "numel": x.numel(), "spec": spec, "kept": k,
                         "packet_bytes": nbytes, "bytes_per_kept": nbytes / k})
    return rows


def lossless_ratios(tensors: dict[str, torch.Tensor], level: int = 3) -> list[dict[str, Any]]:
    """zstd of the raw bytes vs gradwire's zstd on byte planes, at the same level."""
    rows = []
    for label, x in tensors.items():
        raw = x.contiguous().view(torch.uint8).numpy().tobytes()
        plain = len(zstandard.ZstdCompressor(level=level).compress(raw))
        planes = compressor(f"zstd:level={level}").encode(x, Ctx()).nbytes
        rows.append({"tensor": label, "bytes": len(raw), "zstd_raw_ratio": len(raw) / plain,
                     "zstd_byteplane_ratio": len(raw) / planes, "gain": plain / planes - 1.0})
    return rows


def format_table(rows: list[dict[str, Any]], columns: list[tuple[str, str, str]]) -> str:
    """Plain-text table; columns are (key, header, format)."""
    cells = [[h for _, h, _ in columns]]
    for r in rows:
        cells.append([("" if r.get(k) is None else format(r[k], f)) for k, _, f in columns])
    widths = [max(len(row[i]) for row in cells) for i in range(len(columns))]
    lines = ["  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(row, widths)))
             for row in cells]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines)


ROW_COLUMNS = [("spec", "compressor", "s"), ("packet_bytes", "bytes", "d"), ("ratio", "ratio", ".1f"),
               ("rel_l2_error", "rel L2 err", ".4f"), ("encode_gbps", "enc GB/s", ".3f"),
               ("decode_gbps", "dec GB/s", ".3f")]
