"""`int8` (codec id 5): per-chunk affine uint8, min/max to 0..255.

A quarter of fp32's bytes, deterministic, with an absolute error of half a step: the
quantizer for chunks whose values span a narrow range.

``lo = min``, ``hi = max``, ``scale = hi/255 - lo/255``, ``inv = 1/scale`` (0 when
scale = 0, capped at FLT_MAX); ``q = clamp(round_half_even((x - lo) * inv), 0, 255)``;
decode ``(q - 127.5) * scale + (lo + 127.5 * scale)`` (that is q * scale + lo, centred so
no intermediate overflows). Error ``<= scale / 2`` (plus fp32 rounding); a constant chunk
decodes exactly.

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.int8_encode`, `ops.int8_decode`),
feedback.cu (`ops.ef_int8`). Compiled CPU loops: gradwire/compress/compiled.py
(`residual_int8`). Tests: tests/compress/test_quantize.py, tests/compress/test_compiled.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import math

import torch

from .. import compiled
from ..base import Ctx, expect
from ..registry import register
from ..wire import Kind, Packet, Section
from .tiles import FLT_MAX, _ceil, _Chunked, _chunk_param, _empty_f32, _for_rows, _gpu, _Residual, _rows, _split, _Tiles


@register
class Int8(_Chunked):
    """Per-chunk affine uint8: min/max -> scale/offset, round to nearest."""

    name = "int8"
    codec_id = 5
    _layout = ("chunk", "chunk", "elem")
    params = (_chunk_param("chunk", 1024),)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        c = self._nchunks(numel)
        return [4 * c, 4 * c, numel]

    # ---- encode -------------------------------------------------------------------
    def _encode_cuda(self, ops, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        scales, offsets, codes = ops.int8_encode(flat, self.chunk)
        return [Section(Kind.SCALES, scales), Section(Kind.OFFSETS, offsets), Section(Kind.DATA, codes)]

    def _encode_cpu(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None) -> list[Section]:
        n, chunk = flat.numel(), self.chunk
        c = self._nchunks(n)
        scales, offsets = _empty_f32(flat, c), _empty_f32(flat, c)
        codes = torch.empty(n, dtype=torch.uint8, device=flat.device)
        if n:
            tiles = _Tiles(flat, math.lcm(chunk, 8), fb)
            for s, e, x in tiles:
                m, c0 = e - s, s // chunk
                k = _ceil(m, chunk)
                lo, sc = offsets[c0: c0 + k], scales[c0: c0 + k]
                parts = _for_rows(x, chunk, lo, lambda p, o: torch.amin(p, 1, out=o))
                _for_rows(x, chunk, sc, lambda p, o: torch.amax(p, 1, out=o))
                sc.div_(255).sub_(lo / 255)  # hi/255 - lo/255 cannot overflow
                inv = torch.reciprocal(sc).clamp_(max=FLT_MAX)
                inv.masked_fill_(sc == 0, 0.0)
                w = tiles.f32[:m]
                for p, o, lo_k, inv_k in zip(parts, _rows(w, chunk), _split(lo, parts), _split(inv, parts)):
                    torch.sub(p, lo_k, out=o).mul_(inv_k)
                w.round_().clamp_(0, 255)
                q = tiles.i32[:m]
                q.copy_(w)  # exact: w is integral (NaN from a NaN chunk lands on some code)
                codes[s:e].copy_(q)
                if fb is not None and fb.fast is not None:
                    self._residual_compiled(fb, s, e, w, sc, lo)
                elif fb is not None:
                    self._residual_torch(fb, s, e, w, sc, lo, parts)
        return [Section(Kind.SCALES, scales), Section(Kind.OFFSETS, offsets), Section(Kind.DATA, codes)]

    def _residual_compiled(self, fb: _Residual, s: int, e: int, w: torch.Tensor, sc: torch.Tensor,
                           lo: torch.Tensor) -> None:
        """The tile's residual in one compiled pass: ``(w - 127.5) * scale + mid`` per chunk
        (w holds the codes), which also says whether it is finite."""
        mid = lo + sc * 127.5
        corrected, out = fb.compiled_tile(s, e)
        n = compiled.np_view
        fb.compiled_finite(bool(fb.fast.residual_int8(n(corrected), n(w), n(sc), n(mid), self.chunk, n(out))))

    def _residual_torch(self, fb: _Residual, s: int, e: int, w: torch.Tensor, sc: torch.Tensor, lo: torch.Tensor,
                        parts: list[torch.Tensor]) -> None:
        """The tile's residual in torch ops: decode into w (which holds the codes) as
        ``(q - 127.5) * scale + (lo + 127.5 * scale)``, then subtract."""
        w.sub_(127.5)
        for p, f, o in zip(_rows(w, self.chunk), _split(sc, parts), _split(lo + sc * 127.5, parts)):
            p.mul_(f).add_(o)
        fb.subtract(s, e, w)

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        c = self._nchunks(n)
        return [(Kind.SCALES, torch.float32, c), (Kind.OFFSETS, torch.float32, c), (Kind.DATA, torch.uint8, n)]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_int8(x, e, out, self.chunk, *sections)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        c = self._nchunks(pk.numel)
        expect(pk, (Kind.SCALES, torch.float32, c), (Kind.OFFSETS, torch.float32, c), (Kind.DATA, torch.uint8, pk.numel))

    def _decode(self, pk: Packet) -> torch.Tensor:
        scales, offsets, codes = (s.data for s in pk.sections)
        ops = _gpu(codes, pk.numel)
        if ops is not None:
            return ops.int8_decode(codes, scales, offsets, self.chunk, pk.dtype)
        vals = codes.to(torch.float32).sub_(127.5)
        mid = offsets + scales * 127.5  # centred, so no step overflows when the true value fits
        parts = _rows(vals, self.chunk)
        for p, f, o in zip(parts, _split(scales, parts), _split(mid, parts)):
            p.mul_(f).add_(o)
        return self._finish(vals, pk)
