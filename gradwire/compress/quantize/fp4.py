"""`fp4` (codec id 15): per-block scaled 4-bit floats (e2m1), two codes per byte.

An eighth of fp32's bytes plus a scale per block: the format Streaming DiLoCo sends its
outer gradients in, and usable per step. Small blocks (32 elements by default, as the OCP
microscaling formats) keep the relative error of each block's largest values.

e2m1 magnitudes are 0, 0.5, 1, 1.5, 2, 3, 4, 6 (codes 0..7; bit 3 is the sign).
``scale = absmax / 6``, ``v = x * min(6 / absmax, FLT_MAX)`` (so absmax maps to 6), code =
the nearest magnitude to |v|, ties to the even code, with v's sign bit (a NaN v gives code
0); decode ``value(code) * scale``. Error: at most half the gap between neighbouring
magnitudes, times scale: ``<= 0.25 * scale`` below 2, ``0.5 * scale`` in [2, 4),
``scale`` in [4, 6]. An all-zero block has scale 0 and decodes to 0; a block holding a
NaN/Inf has a non-finite scale and decodes non-finite.

Wire (n = numel, c = ceil(n / chunk), g = ceil(n / 8)): SCALES fp32 [c], DATA uint8
[4g] (element 2j in the low nibble of byte j; `tiles` bit packing with b = 4).

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.fp4_encode`, `ops.fp4_decode`),
feedback.cu (`ops.ef_fp4`); the code arithmetic is common.cuh's `f32_to_e2m1` and
`e2m1_to_f32`. Tests: tests/compress/test_fp4.py, tests/cuda/test_cuda_parity.py,
tests/cuda/test_cuda_feedback.py.
"""

from __future__ import annotations

import math

import torch

from ..base import Ctx, expect
from ..registry import register
from ..wire import Kind, Packet, Section
from .tiles import (FLT_MAX, _ceil, _Chunked, _chunk_param, _empty_f32, _gpu, _Residual, _rows, _scale_to, _split,
                    _Tiles, _unpack)

FP4_MAX = 6.0
#: value of each 4-bit code (bit 3: sign)
VALUES = torch.tensor([0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0])
#: rounding points between neighbouring magnitudes; True where a tie goes up (to the even code)
_THRESHOLDS = ((0.25, False), (0.75, True), (1.25, False), (1.75, True), (2.5, False), (3.5, True), (5.0, False))


def e2m1_codes(v: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """The e2m1 code of each fp32 value of v (already scaled to [-6, 6]) into int32 `out`."""
    out.zero_()
    a = torch.abs(v)
    for t, tie_up in _THRESHOLDS:
        out.add_(torch.ge(a, t) if tie_up else torch.gt(a, t))
    neg = torch.signbit(v).logical_and_(~torch.isnan(v))  # NaN: code 0, whatever its sign bit
    return out.bitwise_or_(neg.to(torch.int32).mul_(8))


@register
class FP4(_Chunked):
    """Per-block scaled e2m1: the block's absmax maps to 6, round to nearest even."""

    name = "fp4"
    codec_id = 15
    _layout = ("chunk", 4)
    params = (_chunk_param("chunk", 32),)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return [4 * self._nchunks(numel), 4 * _ceil(numel, 8)]

    # ---- encode -------------------------------------------------------------------
    def _encode_cuda(self, ops, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        scales, data = ops.fp4_encode(flat, self.chunk)
        return [Section(Kind.SCALES, scales), Section(Kind.DATA, data)]

    def _encode_cpu(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None) -> list[Section]:
        n, chunk = flat.numel(), self.chunk
        scales = _empty_f32(flat, self._nchunks(n))
        data = torch.zeros(4 * _ceil(n, 8), dtype=torch.uint8, device=flat.device)
        if n:
            tiles = _Tiles(flat, math.lcm(chunk, 8), fb)
            if fb is not None:  # |decoded| <= 6 * scale, with the sign of x (or zero)
                fb.by_scales(scales, FLT_MAX / (2 * FP4_MAX))
            values = VALUES.to(flat.device)
            for s, e, x in tiles:
                c0 = s // chunk
                sc = scales[c0: c0 + _ceil(e - s, chunk)]
                w = tiles.f32[: e - s]
                parts = _scale_to(x, chunk, FP4_MAX, sc, w)
                q = e2m1_codes(w, tiles.i32[: e - s])
                tiles.pack(q, 4, data, s)
                if fb is not None:
                    torch.index_select(values, 0, q, out=w)
                    for p, f in zip(_rows(w, chunk), _split(sc, parts)):
                        p.mul_(f)
                    fb.subtract(s, e, w)
        return [Section(Kind.SCALES, scales), Section(Kind.DATA, data)]

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        return [(Kind.SCALES, torch.float32, self._nchunks(n)), (Kind.DATA, torch.uint8, 4 * _ceil(n, 8))]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_fp4(x, e, out, self.chunk, *sections)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.SCALES, torch.float32, self._nchunks(pk.numel)), (Kind.DATA, torch.uint8, 4 * _ceil(pk.numel, 8)))

    def _decode(self, pk: Packet) -> torch.Tensor:
        scales, data = pk.section(Kind.SCALES), pk.section(Kind.DATA)
        ops = _gpu(data, pk.numel)
        if ops is not None:
            return ops.fp4_decode(data, scales, pk.numel, self.chunk, pk.dtype)
        codes = _unpack(data, 4, pk.numel).to(torch.int32)
        vals = torch.index_select(VALUES.to(data.device), 0, codes)
        parts = _rows(vals, self.chunk)
        for p, f in zip(parts, _split(scales, parts)):
            p.mul_(f)
        return self._finish(vals, pk)
