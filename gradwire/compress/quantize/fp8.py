"""`fp8` (codec id 4): per-chunk scaled float8, e4m3 or e5m2.

Half of fp16's bytes with a float's relative error: each chunk is scaled so its absmax
maps to the format's largest value, so small chunks keep their precision.

``scale = absmax / FMAX`` (FMAX = 448 for e4m3, 57344 for e5m2);
``code = fp8(x * min(FMAX / absmax, FLT_MAX))`` (so absmax maps to FMAX); decode
``code * scale``. Error: ``|x - x'| <= 2**-(m+1) |x| + 2**(e_min-1) * scale`` (m = 3 / 2
mantissa bits, e_min = -9 / -16 the smallest subnormal's exponent) up to fp32 rounding,
for chunks whose absmax is above FMAX / FLT_MAX (~1e-36; below that the multiplier is
capped and codes underflow). An all-zero chunk has scale 0 and decodes to 0.

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.fp8_encode`, `ops.fp8_decode`),
feedback.cu (`ops.ef_fp8`). Compiled CPU loops: gradwire/compress/compiled.py
(`residual_fp8`). Tests: tests/compress/test_quantize.py, tests/compress/test_compiled.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import math

import torch

from .. import compiled
from ..base import Ctx, Param, expect
from ..registry import register
from ..wire import Kind, Packet, Section
from .tiles import (FLT_MAX, _ceil, _Chunked, _chunk_param, _empty_f32, _gpu, _Residual, _rows, _scale_to, _split,
                    _Tiles)

_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}


@register
class FP8(_Chunked):
    """Per-chunk scaled float8 (e4m3 or e5m2): the chunk's absmax maps to the format's max."""

    name = "fp8"
    codec_id = 4
    _layout = ("chunk", "elem")
    params = (Param("format", str, "e4m3", lambda v: v in _FP8, "e4m3 or e5m2"),
              _chunk_param("chunk", 1024))

    @property
    def code_dtype(self) -> torch.dtype:
        return _FP8[self.format]

    @property
    def fmax(self) -> float:
        return float(torch.finfo(self.code_dtype).max)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return [4 * self._nchunks(numel), numel]

    # ---- encode -------------------------------------------------------------------
    def _encode_cuda(self, ops, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        scales, codes = ops.fp8_encode(flat, self.chunk, self.format == "e5m2", self.fmax, self.code_dtype)
        return [Section(Kind.SCALES, scales), Section(Kind.DATA, codes)]

    def _encode_cpu(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None) -> list[Section]:
        n, chunk, fmax = flat.numel(), self.chunk, self.fmax
        scales = _empty_f32(flat, self._nchunks(n))
        codes = torch.empty(n, dtype=self.code_dtype, device=flat.device)
        if n:
            tiles = _Tiles(flat, math.lcm(chunk, 8), fb)
            if fb is not None:  # |code * scale| <= fmax * scale, same sign as x
                fb.by_scales(scales, FLT_MAX / (2 * fmax))
            for s, e, x in tiles:
                c0 = s // chunk
                sc = scales[c0: c0 + _ceil(e - s, chunk)]
                w = tiles.f32[: e - s]
                parts = _scale_to(x, chunk, fmax, sc, w)
                codes[s:e].copy_(w)  # one rounding to fp8 (faster than a mixed-dtype mul)
                if fb is not None and fb.fast is not None:
                    self._residual_compiled(fb, s, e, codes[s:e], sc)
                elif fb is not None:
                    self._residual_torch(fb, s, e, codes[s:e], sc, parts, tiles, w)
        return [Section(Kind.SCALES, scales), Section(Kind.DATA, codes)]

    def _residual_compiled(self, fb: _Residual, s: int, e: int, codes: torch.Tensor, sc: torch.Tensor) -> None:
        """The tile's residual in one compiled pass: codes times their chunk's factor (scale
        times `_fp8_as_half`'s lift); the caller checks by scales."""
        e5m2 = self.format == "e5m2"
        factor = sc * (1.0 if e5m2 else 256.0)
        corrected, out = fb.compiled_tile(s, e)
        n = compiled.np_view
        fb.fast.residual_fp8(n(corrected), n(codes.view(torch.int8)), n(factor), self.chunk, e5m2, n(out))

    def _residual_torch(self, fb: _Residual, s: int, e: int, codes: torch.Tensor, sc: torch.Tensor,
                        parts: list[torch.Tensor], tiles: _Tiles, w: torch.Tensor) -> None:
        """The tile's residual in torch ops: decode into w (codes times scale, through
        `_fp8_as_half`: torch's fp8 -> fp32 cast is slow), then subtract."""
        lift = _fp8_as_half(codes, self.format, tiles.i32, w)
        for p, f in zip(_rows(w, self.chunk), _split(sc * lift, parts)):
            p.mul_(f)
        fb.subtract(s, e, w)

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        return [(Kind.SCALES, torch.float32, self._nchunks(n)), (Kind.DATA, self.code_dtype, n)]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_fp8(x, e, out, self.chunk, self.format == "e5m2", self.fmax, *sections)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.SCALES, torch.float32, self._nchunks(pk.numel)), (Kind.DATA, self.code_dtype, pk.numel))

    def _decode(self, pk: Packet) -> torch.Tensor:
        scales, codes = pk.section(Kind.SCALES), pk.section(Kind.DATA)
        ops = _gpu(codes, pk.numel)
        if ops is not None:
            return ops.fp8_decode(codes, scales, self.chunk, self.format == "e5m2", pk.dtype)
        vals = codes.to(torch.float32)
        parts = _rows(vals, self.chunk)
        for p, f in zip(parts, _split(scales, parts)):
            p.mul_(f)
        return self._finish(vals, pk)


def _fp8_as_half(codes: torch.Tensor, fmt: str, scratch: torch.Tensor, out: torch.Tensor) -> float:
    """out (fp32) <- the fp8 codes' values divided by the returned power of two, through
    their fp16 bit patterns (exact; faster here than a 256-entry table lookup or torch's
    fp8 -> fp32 cast).

    e5m2 is the top byte of an fp16. An e4m3 byte s.eeee.mmm shifted left by 7, with the
    sign's copy in bit 14 cleared, is the fp16 s.0eeee.mmm0000000: the same significand
    with the exponent bias 15 instead of 7 (subnormals included), so 2**-8 times the
    value. A scale times 2**8 never overflows (scale <= FLT_MAX / 448), so
    ``out * (scale * lift)`` rounds exactly like ``value * scale``. NaN codes (a
    non-finite chunk only) come out finite, times that chunk's non-finite scale."""
    h = scratch.view(torch.int16)[: codes.numel()].copy_(codes.view(torch.int8))  # sign-extending
    if fmt == "e5m2":
        h.mul_(256)  # << 8; |byte| * 256 <= 2**15: no overflow (and faster than torch's shift)
        lift = 1.0
    else:
        h.mul_(128).bitwise_and_(_s16(0xBF80))
        lift = 256.0
    out.copy_(h.view(torch.float16))
    return lift


def _s16(v: int) -> int:
    return v - (1 << 16) if v >= 1 << 15 else v
