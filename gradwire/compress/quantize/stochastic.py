"""The stochastic rounding qsgd and terngrad share: a sign bit and a level in [0, s] per
element, the level drawn so that the decode is unbiased.

With a per-bucket scale (qsgd: the L2 norm, terngrad: max |x|; `_scale_rows` in each
codec's module) and ``s`` levels above zero: ``f = min(s / scale, FLT_MAX)``,
``r = |x| * f`` (in [0, s]), ``u = u24 * 2**-24`` from `rng` (stream = codec id, element
index = position in the flat tensor), ``level = min(floor(r + u), s)``; decode
``(-1)**sign * level * (scale / s)``. P(level = floor(r) + 1) = frac(r), so E[decode] = x
(unbiased up to the fp32 rounding of r + u, below 2**-16 of a level step). Packet: SCALES,
BITS (signs), then the levels packed `level_bits` to an element (`tiles`).

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.stochastic_encode`,
`ops.stochastic_decode`), feedback.cu (`ops.ef_stochastic`). Compiled CPU loops:
gradwire/compress/compiled.py (`residual_levels`). Random draws: gradwire/compress/rng.py
(`bits24`). Tests: tests/compress/test_quantize.py, tests/compress/test_feedback.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .. import compiled, rng
from ..base import Ctx, Piece, expect
from ..wire import Kind, Packet, Section
from .tiles import (FLT_MAX, _ceil, _Chunked, _empty_f32, _flip_signs, _for_rows, _gpu, _plus_minus, _Residual,
                    _rows, _split, _tile_step, _Tiles, _unpack)


class _Stochastic(_Chunked):
    """Sign bit + stochastic level in [0, s] scaled by a per-bucket scale (qsgd, terngrad).
    A codec gives `levels` (s), `level_bits` and its scale (`_scale_rows`)."""

    stochastic = True
    feedback_helps = False  # unbiased stochastic rounding
    level_kind = Kind.DATA
    by_norm = True  # the scale: the bucket's L2 norm (qsgd), else its max |x| (terngrad)

    @property
    def _chunk_size(self) -> int:
        return self.bucket

    @property
    def _layout(self) -> tuple[str | int, ...]:  # type: ignore[override]
        return ("chunk", 1, self.level_bits)

    @property
    def levels(self) -> int:  # s
        raise NotImplementedError

    @property
    def level_bits(self) -> int:
        raise NotImplementedError

    def _scale_rows(self, p: torch.Tensor, out: torch.Tensor) -> None:
        """The scale of each row (bucket) of p into out."""
        raise NotImplementedError

    def _nchunks(self, numel: int) -> int:
        if self.bucket == 0:
            return 1 if numel else 0
        return _ceil(numel, self.bucket)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        g = _ceil(numel, 8)
        return [4 * self._nchunks(numel), g, self.level_bits * g]

    def _key(self, ctx: Ctx) -> tuple[int, int]:
        return rng.stream_key(ctx.seed, ctx.step, ctx.rank, ctx.key, stream=self.codec_id)

    def _sections(self, scales, signs, levels) -> list[Section]:
        return [Section(Kind.SCALES, scales), Section(Kind.BITS, signs), Section(self.level_kind, levels)]

    # ---- encode -------------------------------------------------------------------
    def _encode_cuda(self, ops, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        return self._sections(*ops.stochastic_encode(flat, self.bucket or flat.numel(), self.levels,
                                                     self.level_bits, self._key(ctx), self.by_norm))

    def _encode_cpu(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None) -> list[Section]:
        n, b = flat.numel(), self.level_bits
        g = _ceil(n, 8)
        scales = _empty_f32(flat, self._nchunks(n))
        signs = torch.empty(g, dtype=torch.uint8, device=flat.device)
        levels = torch.empty(b * g, dtype=torch.uint8, device=flat.device)
        if not n:
            return self._sections(scales, signs, levels)
        key = self._key(ctx)
        per_tensor = self.bucket == 0
        if fb is not None:  # |level * (scale / s)| <= scale (+ a rounding), sign of x
            fb.by_scales(scales, FLT_MAX / 2)
        factor = None
        if per_tensor:  # one scale: a pre-pass over the whole tensor
            if fb is not None:
                fb.correct_all()
            self._scale_rows(flat.view(1, -1), scales)
            factor = torch.div(float(self.levels), scales).clamp_(max=FLT_MAX)
        tiles = _Tiles(flat, 8 if per_tensor else math.lcm(self.bucket, 8), fb)
        fast = fb is not None and fb.fast is not None
        for s, e, x in tiles:
            if fast:  # signs first: per tensor, x is out's own tile, which the residual overwrites
                tiles.pack(tiles.signs(x), 1, signs, s)
            w, q, sc, parts = self._tile_levels(tiles, s, e, x, key, scales, factor, levels)
            if fast:
                self._residual_compiled(fb, s, e, q, sc)
                continue
            if fb is not None:  # decode into w: level * (scale / s); the sign follows
                self._tile_decode(w, q, sc, parts)
            neg = tiles.signs(x)
            tiles.pack(neg, 1, signs, s)
            if fb is not None:
                fb.subtract(s, e, _flip_signs(w, neg))
        return self._sections(scales, signs, levels)

    def _tile_levels(self, tiles: _Tiles, s: int, e: int, x: torch.Tensor, key: tuple[int, int],
                     scales: torch.Tensor, factor: torch.Tensor | None,
                     levels: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, list | None]:
        """A tile's levels, written (packed) into `levels`: (r + u in fp32 scratch, the levels
        as int32 scratch, the tile's scales, its `_rows` parts or None per tensor). `factor`:
        the per-tensor s / scale, else None (the tile's bucket scales are made here)."""
        m, s_lv, b = e - s, float(self.levels), self.level_bits
        w = torch.abs(x, out=tiles.f32[:m])
        if factor is not None:
            w.mul_(factor)
            sc, parts = scales, None
        else:
            chunk = self.bucket
            c0 = s // chunk
            sc = scales[c0: c0 + _ceil(m, chunk)]
            parts = _for_rows(x, chunk, sc, self._scale_rows)
            f = torch.div(s_lv, sc).clamp_(max=FLT_MAX)  # 0 -> FLT_MAX (x = 0 there), NaN stays
            for p, fk in zip(_rows(w, chunk), _split(f, parts)):
                p.mul_(fk)
        u = rng.bits24(key, m, start=s, out=tiles.i32[:m])
        w.add_(u, alpha=2.0 ** -24).clamp_(max=s_lv)  # r + u, exact u; then floor by truncation
        q = tiles.i32[:m]
        q.copy_(w)
        if b == 8:
            levels[s:e].copy_(q)
            if e == tiles.n:
                levels[tiles.n:].zero_()  # the zero padding of the last group
        else:
            tiles.pack(q, b, levels, s)
        return w, q, sc, parts

    def _tile_decode(self, w: torch.Tensor, q: torch.Tensor, sc: torch.Tensor, parts: list | None) -> None:
        """w <- q * (scale / s), per tensor or per bucket (without the sign)."""
        w.copy_(q)
        if parts is None:
            w.mul_(sc / self.levels)
        else:
            for p, fk in zip(_rows(w, self.bucket), _split(sc / self.levels, parts)):
                p.mul_(fk)

    def _residual_compiled(self, fb: _Residual, s: int, e: int, q: torch.Tensor, sc: torch.Tensor) -> None:
        """The tile's residual in one compiled pass: ``(-1)**sign * q * (scale / s)``, the
        sign being the corrected input's sign bit; the caller checks by scales."""
        step = sc / self.levels
        chunk = self.bucket or (e - s)
        corrected, out = fb.compiled_tile(s, e)
        n = compiled.np_view
        fb.fast.residual_levels(n(corrected), n(q), n(corrected.view(torch.int32)), n(step), chunk, n(out))

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        g = _ceil(n, 8)
        return [(Kind.SCALES, torch.float32, self._nchunks(n)), (Kind.BITS, torch.uint8, g),
                (self.level_kind, torch.uint8, self.level_bits * g)]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_stochastic(x, e, out, self.bucket or x.numel(), self.levels, self.level_bits, self._key(ctx),
                                 self.by_norm, *sections)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        g = _ceil(pk.numel, 8)
        expect(pk, (Kind.SCALES, torch.float32, self._nchunks(pk.numel)), (Kind.BITS, torch.uint8, g),
               (self.level_kind, torch.uint8, self.level_bits * g))

    def _sent(self, pk: Packet) -> Iterator[Piece]:
        """On the CPU, `_decode`'s steps tile by tile into two reused fp32 scratch tiles (the
        signs as +-1.0: the same products as `_decode`'s int8 ones, without its mixed-dtype
        multiply or a fresh tile per step)."""
        n, bucket = pk.numel, self.bucket
        if pk.device.type != "cpu":
            yield from super()._sent(pk)
            return
        step = _tile_step(n, math.lcm(bucket or 8, 8), pk.device)
        w = torch.empty(min(n, step), dtype=torch.float32)
        pm = torch.empty_like(w)
        for s in range(0, n, step):
            e = min(n, s + step)
            scales, signs, levels = (sec.data for sec in self._slice(pk, s, e).sections)
            vals = w[: e - s].copy_(_unpack(levels, self.level_bits, e - s))
            lv = scales / self.levels
            if bucket == 0:
                vals.mul_(lv)
            else:
                parts = _rows(vals, bucket)
                for p, f in zip(parts, _split(lv, parts)):
                    p.mul_(f)
            vals.mul_(pm[: e - s].copy_(_plus_minus(signs, e - s)))
            yield slice(s, e), self._finish(vals, pk)

    def _decode(self, pk: Packet) -> torch.Tensor:
        n = pk.numel
        scales, signs, levels = (s.data for s in pk.sections)
        ops = _gpu(signs, n)
        if ops is not None:
            return ops.stochastic_decode(signs, levels, scales, n, self.bucket or n, self.levels, self.level_bits,
                                         pk.dtype)
        vals = _unpack(levels, self.level_bits, n).to(torch.float32)
        step = scales / self.levels  # value of one level
        if self.bucket == 0:
            vals.mul_(step)
        else:
            parts = _rows(vals, self.bucket)
            for p, f in zip(parts, _split(step, parts)):
                p.mul_(f)
        vals.mul_(_plus_minus(signs, n))
        return self._finish(vals, pk)
