"""`sign` (codec id 12) and `onebit` (codec id 13): one bit per element, the sign, plus one
or two fp32 numbers per chunk.

The smallest dense packets (32x below fp32): only the direction of each element travels,
so both are biased and need error feedback. sign: ``scale = mean |x|`` per chunk; decode
``(-1)**sign * scale``. onebit (1-bit SGD with two reconstruction values):
``pos = sum(x; sign bit clear) / max(count, 1)``, ``neg = sum(x; sign bit set) /
max(count, 1)``; decode ``neg`` where the sign bit is set, else ``pos`` (-0.0 counts as
negative, which only adds a zero to the negative mean). A chunk's mean overflows fp32 once
its sum does, and the chunk (onebit: its half that held the value) then decodes non-finite.

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.sign_encode`, `ops.sign_decode`),
feedback.cu (`ops.ef_sign`). Compiled CPU loops: gradwire/compress/compiled.py
(`residual_signs`). Tests: tests/compress/test_quantize.py, tests/compress/test_compiled.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .. import compiled
from ..base import Ctx, Piece, expect
from ..registry import register
from ..wire import Kind, Packet, Section
from .tiles import (_ceil, _Chunked, _chunk_param, _empty_f32, _flip_signs, _gpu, _plus_minus, _Residual, _rows,
                    _split, _tile_step, _Tiles, _unpack)


class _OneBit(_Chunked):
    """Sign bits and per-chunk statistics (`_stats`): what sign and onebit share."""

    params = (_chunk_param("chunk", 1024),)
    per_chunk = 1  # fp32 values per chunk
    _layout = ("chunk", 1)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return [4 * self.per_chunk * self._nchunks(numel), _ceil(numel, 8)]

    # ---- encode -------------------------------------------------------------------
    def _encode_cuda(self, ops, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        scales, bits = ops.sign_encode(flat, self.chunk, self.per_chunk == 2)
        return [Section(Kind.SCALES, scales), Section(Kind.BITS, bits)]

    def _encode_cpu(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None) -> list[Section]:
        n, chunk = flat.numel(), self.chunk
        scales = _empty_f32(flat, self.per_chunk * self._nchunks(n))
        bits = torch.empty(_ceil(n, 8), dtype=torch.uint8, device=flat.device)
        if n:
            tiles = _Tiles(flat, math.lcm(chunk, 8), fb)
            for s, e, x in tiles:
                c0, k = s // chunk, _ceil(e - s, chunk)
                neg = tiles.signs(x)
                w, sc = tiles.f32[: e - s], scales[self.per_chunk * c0: self.per_chunk * (c0 + k)]
                self._stats(x, neg, w, sc)
                tiles.pack(neg, 1, bits, s)
                if fb is not None and fb.fast is not None:
                    self._residual_compiled(fb, s, e, sc)
                elif fb is not None:
                    fb.subtract(s, e, self._decode_tile(neg, sc, w))
        return [Section(Kind.SCALES, scales), Section(Kind.BITS, bits)]

    def _residual_compiled(self, fb: _Residual, s: int, e: int, sc: torch.Tensor) -> None:
        """The tile's residual in one compiled pass, its decoded values made from the
        corrected input's sign bits and the chunk scales; also says whether it is finite."""
        corrected, out = fb.compiled_tile(s, e)
        n = compiled.np_view
        fb.compiled_finite(bool(fb.fast.residual_signs(n(corrected), n(corrected.view(torch.int32)), n(sc),
                                                       self.per_chunk == 2, self.chunk, n(out))))

    def _stats(self, x: torch.Tensor, neg: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        """A tile's chunk scales into out, from x and its signs (int32 -1/0); w is scratch."""
        raise NotImplementedError

    def _decode_tile(self, neg: torch.Tensor, scales: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A tile's decoded values into w, from its signs (int32 -1/0, consumed) and scales."""
        raise NotImplementedError

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        return [(Kind.SCALES, torch.float32, self.per_chunk * self._nchunks(n)), (Kind.BITS, torch.uint8, _ceil(n, 8))]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_sign(x, e, out, self.chunk, self.per_chunk == 2, *sections)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.SCALES, torch.float32, self.per_chunk * self._nchunks(pk.numel)),
               (Kind.BITS, torch.uint8, _ceil(pk.numel, 8)))


@register
class Sign(_OneBit):
    """Scaled sign: one bit per element and the chunk's mean |x|."""

    name = "sign"
    codec_id = 12

    def _stats(self, x, neg, w, out) -> None:
        torch.abs(x, out=w)
        for p, o, width in zip(_rows(w, self.chunk), _split(out, _rows(w, self.chunk)), _widths(w, self.chunk)):
            torch.sum(p, 1, keepdim=True, out=o).div_(width)

    def _decode_tile(self, neg: torch.Tensor, scales: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        parts = _rows(w, self.chunk)
        for p, f in zip(parts, _split(scales, parts)):
            p.copy_(f.expand_as(p))
        return _flip_signs(w, neg)

    def _decode(self, pk: Packet) -> torch.Tensor:
        n = pk.numel
        scales, bits = pk.section(Kind.SCALES), pk.section(Kind.BITS)
        ops = _gpu(bits, n)
        if ops is not None:
            return ops.sign_decode(bits, scales, n, self.chunk, False, pk.dtype)
        vals = torch.empty(n, dtype=torch.float32, device=bits.device)
        parts = _rows(vals, self.chunk)
        for p, f in zip(parts, _split(scales, parts)):
            p.copy_(f.expand_as(p))
        vals.mul_(_plus_minus(bits, n))
        return self._finish(vals, pk)


@register
class OneBit(_OneBit):
    """1-bit with two values per chunk: the mean of its non-negative and of its negative elements."""

    name = "onebit"
    codec_id = 13
    per_chunk = 2

    def _stats(self, x, neg, w, out) -> None:
        chunk = self.chunk
        pairs = out.view(-1, 2)
        xs, ns, ws = _rows(x, chunk), _rows(neg, chunk), _rows(w, chunk)
        i = 0
        for xp, npart, wp, width in zip(xs, ns, ws, _widths(x, chunk)):
            k = xp.shape[0]
            cneg = npart.sum(1, dtype=torch.int32).neg_()  # elements with the sign bit set
            cpos = (width - cneg).clamp_(min=1)
            cneg.clamp_(min=1)  # an empty group has sum 0: mean 0, not 0/0
            # non-negative group: x with the sign bit clear (relu keeps their values, zeroes the rest)
            torch.clamp(xp, min=0, out=wp)
            pairs[i: i + k, 0].copy_(wp.sum(1).div_(cpos))
            torch.clamp(xp, max=0, out=wp)
            pairs[i: i + k, 1].copy_(wp.sum(1).div_(cneg))
            i += k

    def _sent(self, pk: Packet) -> Iterator[Piece]:
        """Tile by tile through `_decode_tile` (the same bits as `_decode`'s `where`)."""
        n, chunk = pk.numel, self.chunk
        step = _tile_step(n, math.lcm(chunk, 8), pk.device)
        w = torch.empty(min(n, step), dtype=torch.float32, device=pk.device)
        for s in range(0, n, step):
            e = min(n, s + step)
            sub = self._slice(pk, s, e)
            neg = _unpack(sub.sections[1].data, 1, e - s).to(torch.int32).neg_()
            yield slice(s, e), self._finish(self._decode_tile(neg, sub.sections[0].data, w[: e - s]), pk)

    def _decode_tile(self, neg: torch.Tensor, scales: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """neg's value where the sign bit is set, else pos, chosen bitwise (exactly `where`,
        which is slower here): pos ^ ((pos ^ neg) & mask)."""
        pairs = scales.view(-1, 2).view(torch.int32)
        parts = _rows(w.view(torch.int32), self.chunk)
        for p, m, pos, diff in zip(parts, _rows(neg, self.chunk), _split(pairs[:, 0], parts),
                                   _split(pairs[:, 0] ^ pairs[:, 1], parts)):
            torch.bitwise_and(m, diff, out=p).bitwise_xor_(pos)
        return w

    def _decode(self, pk: Packet) -> torch.Tensor:
        n = pk.numel
        scales, bits = pk.section(Kind.SCALES), pk.section(Kind.BITS)
        ops = _gpu(bits, n)
        if ops is not None:
            return ops.sign_decode(bits, scales, n, self.chunk, True, pk.dtype)
        pairs = scales.view(-1, 2)
        neg = _unpack(bits, 1, n).view(torch.bool)
        vals = torch.empty(n, dtype=torch.float32, device=bits.device)
        parts = _rows(neg, self.chunk)
        for p, o, pos_k, neg_k in zip(parts, _rows(vals, self.chunk), _split(pairs[:, 0], parts), _split(pairs[:, 1], parts)):
            torch.where(p, neg_k, pos_k, out=o)
        return self._finish(vals, pk)


def _widths(t: torch.Tensor, chunk: int) -> list[int]:
    """The width of each `_rows` part of t: chunk, and the partial last chunk's."""
    return [p.shape[1] for p in _rows(t, chunk)]
