"""Dense quantizers: `fp8`, `int8`, `qsgd`, `terngrad`, `sign`, `onebit`.

All six cut the flat tensor into chunks (``chunk``/``bucket`` elements; the last one may
be shorter) and keep one or two fp32 numbers per chunk. Chunks are never looped over in
Python: every step is a torch op over 2-D ``(chunks, chunk)`` views, plus a 1-row view
for a trailing partial chunk (only fixed-size cache tiles are looped over; see Speed).

Specs and defaults: ``fp8:format=e4m3|e5m2,chunk=1024``, ``int8:chunk=1024``,
``qsgd:bits=8,bucket=512`` (bits 1..8; bits + 1 bits per element), ``terngrad:bucket=512``
(0: one scale per tensor), ``sign:chunk=1024``, ``onebit:chunk=1024``. Only qsgd and
terngrad are stochastic; none is summable.

Wire formats (n = numel, c = ceil(n / chunk), g = ceil(n / 8); every section is padded to
8 bytes, so ``packet bytes = header_size(ndim, nsections) + sum(align8(section bytes))``):

============  =======================================================  =========================
codec         sections, in order                                       section bytes
============  =======================================================  =========================
fp8     (4)   SCALES fp32 [c], DATA float8_e4m3fn/float8_e5m2 [n]      4c, n
int8    (5)   SCALES fp32 [c], OFFSETS fp32 [c], DATA uint8 [n]        4c, 4c, n
qsgd   (10)   SCALES fp32 [c] (L2 norms), BITS uint8 [g] (signs),      4c, g, bits * g
              DATA uint8 [bits * g] (levels)
terngrad (11) SCALES fp32 [c] (max |x|; c = 1 if bucket=0),            4c, g, g
              BITS uint8 [g] (signs), BITS uint8 [g] (nonzero)
sign   (12)   SCALES fp32 [c] (mean |x|), BITS uint8 [g] (signs)       4c, g
onebit (13)   SCALES fp32 [2c] (pairs: mean of x>=0, mean of x<0),     8c, g
              BITS uint8 [g] (signs)
============  =======================================================  =========================

Formulas (all arithmetic in fp32, round-to-nearest, no fused multiply-add; fp16/bf16
inputs are first converted to fp32; "sign" is the IEEE sign bit, so -0.0 counts as
negative, which only adds a zero to onebit's negative mean):

* fp8: ``scale = absmax / FMAX`` (FMAX = 448 for e4m3, 57344 for e5m2);
  ``code = fp8(x * min(FMAX / absmax, FLT_MAX))`` (so absmax maps to FMAX);
  decode ``code * scale``. Error: ``|x - x'| <= 2**-(m+1) |x| + 2**(e_min-1) * scale``
  (m = 3 / 2 mantissa bits, e_min = -9 / -16 the smallest subnormal's exponent) up to fp32
  rounding, for chunks whose absmax is above FMAX / FLT_MAX (~1e-36; below that the
  multiplier is capped and codes underflow). An all-zero chunk has scale 0 and decodes to 0.
* int8: ``lo = min``, ``hi = max``, ``scale = hi/255 - lo/255``, ``inv = 1/scale`` (0 when
  scale = 0, capped at FLT_MAX); ``q = clamp(round_half_even((x - lo) * inv), 0, 255)``;
  decode ``(q - 127.5) * scale + (lo + 127.5 * scale)`` (that is q * scale + lo, centred so
  no intermediate overflows). Error ``<= scale / 2`` (plus fp32 rounding); a constant chunk
  decodes exactly.
* qsgd (``s = 2**bits - 1`` levels above zero, sign separate): ``norm = ||chunk||_2``,
  ``f = min(s / norm, FLT_MAX)``, ``r = |x| * f`` (in [0, s]), ``u = u24 * 2**-24`` from
  `rng` (stream = codec id, element index = position in the flat tensor),
  ``level = min(floor(r + u), s)``; decode ``(-1)**sign * level * (norm / s)``.
  P(level = floor(r) + 1) = frac(r), so E[decode] = x (unbiased up to the fp32 rounding of
  r + u, below 2**-16 of a level step).
* terngrad: qsgd with ``s = 1`` and ``scale = max |x|`` per bucket (or per tensor when
  bucket = 0): ``level = min(floor(|x| * min(1 / scale, FLT_MAX) + u), 1)``; decode
  ``(-1)**sign * level * scale``. Unbiased.
* sign: ``scale = mean |x|`` per chunk; decode ``(-1)**sign * scale``.
* onebit: ``pos = sum(x; sign bit clear) / max(count, 1)``, ``neg = sum(x; sign bit set) /
  max(count, 1)``; decode ``neg`` where the sign bit is set, else ``pos``.

Bit packing (`BITS` and the qsgd levels): element ``i`` holds a ``b``-bit code; the codes of
elements ``8j .. 8j+7`` form the little-endian integer ``sum(code[8j+k] << (b*k))``, stored
as ``b`` bytes at byte offset ``b*j`` (``b = 1``: LSB-first bit order). A partial last group
is padded with zero codes. Decoders ignore the padding.

Non-finite input: a NaN/Inf makes its chunk's scale (norm, absmax, min/max, mean) non-finite,
and every decode multiplies or adds that scale, so the chunk decodes non-finite (onebit:
the chunk's half -- sign bit clear or set -- that held it, which includes its position).
The values encoded next to it are meaningless then; the step is meant to be skipped. The
same happens to finite chunks whose fp32 statistic overflows: qsgd's norm once sum(x**2)
passes FLT_MAX (|x| around 1e19), sign's and onebit's means once a chunk's sum does;
fp8, int8 and terngrad use max/min only and stay finite up to FLT_MAX.

Speed (CPU): the encoders stream over the tensor in tiles of about `TILE` elements (whole
chunks, a multiple of 8) and run every step of a tile on cache-resident scratch buffers
before moving on (cache blocking: the count of tiles does not depend on the chunk size;
the tile size does not change the bytes). On a GPU the whole tensor is one tile. A 25M
tile loop issues ~1-2k torch ops: when the machine has more runnable threads than cores,
libgomp's spin-waiting barriers make each multi-threaded op slow (seconds per encode), so
run oversubscribed hosts with ``OMP_WAIT_POLICY=PASSIVE`` or ``torch.set_num_threads(1)``.
Determinism: same input, config, Ctx and thread count give the same bytes (a chunk longer
than torch's parallel grain, 32768, may sum in another order under another thread count).
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from . import alloc, compiled, rng, wire
from .base import Compressor, Ctx, Param, Piece, check_input, deliver, expect
from .finite import parts_finite
from .registry import register
from .wire import Kind, Packet, Section

#: Elements per encode tile on the CPU (rounded to whole chunks and bytes).
TILE = 1 << 19
FLT_MAX = torch.finfo(torch.float32).max
_FP8 = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}
_MAX_CHUNK = 1 << 31


def _ceil(a: int, b: int) -> int:
    return -(-a // b)


def _s64(v: int) -> int:
    """An unsigned 64-bit pattern as the signed Python int torch's int64 ops accept."""
    return v - (1 << 64) if v >= 1 << 63 else v


def _rep(pattern: int, width: int) -> int:
    """`pattern` repeated every `width` bits over 64 bits, as a signed int64 constant."""
    v = 0
    for i in range(0, 64, width):
        v |= pattern << i
    return _s64(v & ((1 << 64) - 1))


# ---- bit packing ----------------------------------------------------------------------
def _pack(codes: torch.Tensor, b: int, out: torch.Tensor, tmp: torch.Tensor) -> None:
    """Pack uint8 `codes` (8g of them, contiguous, each < 2**b; for b = 1 any byte whose low
    bit is the code) into the g*b bytes of `out`; `tmp` is an int64 scratch of >= g elements.

    Works on int64 words of 8 codes: shift-or merges put each group's packed bytes at the
    bottom of a 16/32/64-bit lane, and a narrowing copy keeps them (no strided byte copy).
    """
    g = codes.numel() // 8
    if b == 8:
        out.copy_(codes)
        return
    w = codes.view(torch.int64)
    t = tmp[:g]
    if b == 1:  # bit k of byte k -> bit 56 + k: one multiply gathers the 8 bits, no carries
        w.bitwise_and_(0x0101010101010101).mul_(0x0102040810204080)
        out.copy_(torch.bitwise_right_shift(w, 56, out=t))
    elif b == 4:  # 16-bit lanes: low byte <- c0 | c1 << 4 (the high byte is dropped)
        torch.bitwise_right_shift(w, 4, out=t).bitwise_or_(w)
        out.copy_(t.view(torch.int16))
    elif b == 2:  # 16-bit lanes c0 | c1 << 2, then 32-bit lanes: low byte <- 4 codes
        torch.bitwise_right_shift(w, 6, out=t)
        w.bitwise_or_(t)
        torch.bitwise_right_shift(w, 12, out=t).bitwise_or_(w)
        out.copy_(t.view(torch.int32))
    else:  # 3, 5, 6, 7: masked merges up to 64-bit lanes, then the low b bytes of each word
        w.bitwise_and_(_rep((1 << b) - 1, 8))
        fb = b  # bits per field before this merge
        for lane in (16, 32, 64):  # values stay below 2**63, so arithmetic shifts are logical
            half = lane // 2
            torch.bitwise_right_shift(w, half - fb, out=t)
            t.bitwise_and_(_rep(((1 << fb) - 1) << fb, lane))
            w.bitwise_and_(_rep((1 << fb) - 1, lane))
            w.bitwise_or_(t)
            fb *= 2
        out.view(g, b).copy_(w.view(torch.uint8).view(g, 8)[:, :b])


def _unpack(packed: torch.Tensor, b: int, n: int) -> torch.Tensor:
    """Inverse of `_pack`: the first n b-bit codes of `packed` as uint8 (values < 2**b)."""
    g = _ceil(n, 8)
    if b == 8:
        return packed[:n]
    if b == 1:  # each byte copied into all 8 lanes of a word, lane k keeps bit k (0 or 2**k), min 1
        w = packed[:g].to(torch.int64).mul_(0x0101010101010101).bitwise_and_(_s64(0x8040201008040201))
        return w.view(torch.uint8).clamp_(max=1)[:n]
    buf = torch.zeros(g, 8, dtype=torch.uint8, device=packed.device)
    buf[:, :b] = packed.view(g, b)
    w = buf.view(-1).view(torch.int64)
    t = torch.empty_like(w)
    fb = 4 * b
    for lane in (64, 32, 16):
        half = lane // 2
        mask = _rep((1 << fb) - 1, lane)
        torch.bitwise_right_shift(w, fb, out=t)
        t.bitwise_and_(mask).bitwise_left_shift_(half)
        w.bitwise_and_(mask).bitwise_or_(t)
        fb //= 2
    return buf.view(-1)[:n]


def _plus_minus(signs: torch.Tensor, n: int) -> torch.Tensor:
    """int8 -1 where a packed sign bit is set, else +1 (multiplying keeps -0.0 for level 0)."""
    return _unpack(signs, 1, n).view(torch.int8).mul_(-2).add_(1)


# ---- chunk views and tiles ------------------------------------------------------------
def _rows(t: torch.Tensor, chunk: int) -> list[torch.Tensor]:
    """2-D views of 1-D `t`: its whole chunks as (k, chunk), then a partial one as (1, r)."""
    k = t.numel() // chunk
    parts = [t[: k * chunk].view(k, chunk)] if k else []
    if t.numel() > k * chunk:
        parts.append(t[k * chunk:].view(1, -1))
    return parts


def _split(v: torch.Tensor, parts: list[torch.Tensor]) -> list[torch.Tensor]:
    """Per-chunk values `v` split to match `_rows` parts, as (k, 1) columns."""
    out, i = [], 0
    for p in parts:
        k = p.shape[0]
        out.append(v[i: i + k].unsqueeze(1))
        i += k
    return out


def _tile_step(n: int, unit: int, device: torch.device) -> int:
    if device.type != "cpu":
        return max(unit, _ceil(n, unit) * unit)
    return unit * max(1, TILE // unit)


class _Tiles:
    """Tile ranges plus the per-tile fp32 view of the input and reused scratch buffers."""

    def __init__(self, flat: torch.Tensor, unit: int, fb: "_Residual | None" = None) -> None:
        self.flat = flat
        self.fb = fb
        self.n = n = flat.numel()
        self.device = flat.device
        self.step = _tile_step(n, unit, flat.device)
        size = min(self.step, _ceil(n, 8) * 8)
        self.size = size
        self._x32 = None if flat.dtype == torch.float32 else torch.empty(size, dtype=torch.float32, device=self.device)
        self.f32 = torch.empty(size, dtype=torch.float32, device=self.device)
        self.i32 = torch.empty(size, dtype=torch.int32, device=self.device)
        self.u8 = torch.empty(size, dtype=torch.uint8, device=self.device)
        self.i64 = torch.empty(size // 8 + 1, dtype=torch.int64, device=self.device)

    def __iter__(self):
        for s in range(0, self.n, self.step):
            e = min(self.n, s + self.step)
            x = self.flat[s:e] if self.fb is None else self.fb.correct(s, e)
            if self._x32 is not None:
                x = self._x32[: e - s].copy_(x)
            yield s, e, x

    def pack(self, codes_i32: torch.Tensor, b: int, out: torch.Tensor, s: int) -> None:
        """Pack a tile's int32 codes (tile starts at element s, a multiple of 8) into `out`."""
        m = codes_i32.numel()
        m8 = _ceil(m, 8) * 8
        u8 = self.u8[:m8]
        u8[:m].copy_(codes_i32)  # int32 -> uint8 keeps the low byte
        if m8 > m:
            u8[m:].zero_()
        _pack(u8, b, out[s // 8 * b: s // 8 * b + m8 // 8 * b], self.i64)

    def signs(self, x: torch.Tensor) -> torch.Tensor:
        """int32 scratch holding -1 where x's sign bit is set, else 0."""
        return torch.bitwise_right_shift(x.view(torch.int32), 31, out=self.i32[: x.numel()])


class _Residual:
    """Error feedback inside an encode's tile loop (`encode_residual`): each tile's decoded
    values, rebuilt from the encoder's own intermediates while the tile is in cache, are
    subtracted from the input in place, and the tile's sum kept for the finiteness check.
    Every value equals what `_decode` gives for the finite chunks; in a chunk with a
    non-finite scale both are non-finite (NaN payloads may differ: that step is skipped)."""

    def __init__(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> None:
        self.x, self.e, self.flat = x, residual, out
        self.sums: list[torch.Tensor] = []
        self._tile: torch.Tensor | None = None  # the corrected tile, in cache
        self._scratch = torch.empty(min(TILE + 8, out.numel()), dtype=out.dtype, device=out.device)
        self._done = False
        self._scales: tuple[torch.Tensor, float] | None = None
        self._flags: list[bool] = []  # finiteness of tiles written by compiled loops
        #: the compiled loops (`compiled`), when they can do the subtraction (fp32, one thread)
        self.fast = compiled.loops() if out.dtype == torch.float32 and compiled.enabled() else None

    def by_scales(self, scales: torch.Tensor, limit: float) -> None:
        """Judge finiteness from the chunk scales instead of summing every residual tile.

        For an encoder whose decoded value has the sign of its (corrected) input and a
        magnitude at most its chunk's scale times limit's margin: every scale finite and
        at most `limit` means input and decode are finite and ``x - d`` cannot overflow
        (same signs); a non-finite scale makes its whole chunk decode non-finite. So the
        answer is the same as the sums'; scales above `limit` fall back to checking the
        residual itself. fp32 only: a narrower residual may overflow when d is rounded."""
        if self.flat.dtype == torch.float32:
            self._scales = (scales, limit)

    def correct(self, s: int, e: int) -> torch.Tensor:
        """x + residual over [s, e), made as the tile loop goes into a cache-sized scratch
        (out is written once, by `subtract`), or out's tile after `correct_all`."""
        if self._done:
            return self.flat[s:e]
        t = self._scratch[: e - s] if e - s <= self._scratch.numel() else torch.empty_like(self.flat[s:e])
        if self.e is None:
            t.copy_(self.x[s:e])
        else:
            torch.add(self.x[s:e], self.e[s:e], out=t)
        self._tile = t
        return t

    def correct_all(self) -> None:
        """All of it now, into out (an encoder whose pre-pass reads the whole input)."""
        if self.e is None:
            self.flat.copy_(self.x)
        else:
            torch.add(self.x, self.e, out=self.flat)
        self._done = True

    def subtract(self, s: int, e: int, decoded: torch.Tensor) -> None:
        """out[s:e] = corrected - decoded (in the input dtype)."""
        part = self.flat[s:e]
        d = decoded if part.dtype == decoded.dtype else decoded.to(part.dtype)
        if self._done:
            part.sub_(d)
        else:
            torch.sub(self._tile, d, out=part)  # type: ignore[arg-type]
        if self._scales is None:
            self.sums.append(part.sum())

    def subtract_levels(self, s: int, e: int, q: torch.Tensor, step: torch.Tensor, chunk: int) -> None:
        """`subtract` of ``(-1)**sign * q * step[chunk]`` (qsgd, terngrad; the sign is the
        corrected input's sign bit) in one compiled pass; the caller checks by scales."""
        c = self._corrected(s, e)
        n = compiled.np_view
        self.fast.residual_levels(n(c), n(q), n(c.view(torch.int32)), n(step), chunk, n(self.flat[s:e]))

    def subtract_affine(self, s: int, e: int, w: torch.Tensor, scale: torch.Tensor, mid: torch.Tensor,
                        chunk: int) -> None:
        """`subtract` of ``(w - 127.5) * scale + mid`` per chunk (int8) in one compiled pass."""
        c = self._corrected(s, e)
        n = compiled.np_view
        self._flags.append(bool(self.fast.residual_int8(n(c), n(w), n(scale), n(mid), chunk, n(self.flat[s:e]))))

    def subtract_fp8(self, s: int, e: int, codes: torch.Tensor, factor: torch.Tensor, chunk: int,
                     e5m2: bool) -> None:
        """`subtract` of fp8 codes times their chunk's factor (scale times `_fp8_as_half`'s
        lift) in one compiled pass; the caller checks by scales."""
        c = self._corrected(s, e)
        n = compiled.np_view
        self.fast.residual_fp8(n(c), n(codes.view(torch.int8)), n(factor), chunk, e5m2, n(self.flat[s:e]))

    def subtract_signs(self, s: int, e: int, scales: torch.Tensor, pairs: bool, chunk: int) -> None:
        """`subtract` of sign's or onebit's decoded values (from the corrected input's sign
        bits and the chunk scales) in one compiled pass."""
        c = self._corrected(s, e)
        n = compiled.np_view
        self._flags.append(bool(self.fast.residual_signs(n(c), n(c.view(torch.int32)), n(scales), pairs, chunk,
                                                         n(self.flat[s:e]))))

    def _corrected(self, s: int, e: int) -> torch.Tensor:
        return self.flat[s:e] if self._done else self._tile  # type: ignore[return-value]

    def finite(self) -> torch.Tensor:
        if not all(self._flags):
            return torch.zeros((), dtype=torch.bool)
        if self._scales is None:
            if self._flags and not self.sums:
                return torch.ones((), dtype=torch.bool)
            return parts_finite(self.sums, [self.flat])
        scales, limit = self._scales
        lo, hi = torch.aminmax(scales)  # scales are >= 0 or NaN (which both propagate)
        if not bool(torch.isfinite(lo) & torch.isfinite(hi)):
            return torch.zeros((), dtype=torch.bool)
        if float(hi) <= limit:
            return torch.ones((), dtype=torch.bool)
        return parts_finite([], [self.flat])


def _flip_signs(vals: torch.Tensor, neg: torch.Tensor) -> torch.Tensor:
    """vals (fp32) times -1 where neg (int32 -1/0) is -1, as a sign-bit flip: the same
    value as the multiply for every non-NaN. Consumes neg."""
    vals.view(torch.int32).bitwise_xor_(neg.bitwise_and_(_SIGN32))
    return vals


_SIGN32 = -(1 << 31)


def _absmax_rows(p: torch.Tensor, out: torch.Tensor) -> torch.Tensor:
    """max |x| of each row of p into out (NaN-propagating), via two fast reductions."""
    torch.amax(p, 1, out=out)
    lo = torch.amin(p, 1).neg_()
    return torch.maximum(out, lo, out=out)


def _for_rows(x: torch.Tensor, chunk: int, out: torch.Tensor, fn) -> list[torch.Tensor]:
    """fn(part, out_slice) for each `_rows` part of x; returns the parts."""
    parts = _rows(x, chunk)
    i = 0
    for p in parts:
        fn(p, out[i: i + p.shape[0]])
        i += p.shape[0]
    return parts


def _chunk_param(name: str, default: int, allow_zero: bool = False) -> Param:
    lo = 0 if allow_zero else 1
    rule = f"{lo} <= {name} <= 2**31" + (" (0: one scale for the whole tensor)" if allow_zero else "")
    return Param(name, int, default, lambda v: lo <= v <= _MAX_CHUNK, rule)


def _empty_f32(like: torch.Tensor, n: int) -> torch.Tensor:
    return torch.empty(n, dtype=torch.float32, device=like.device)


def _gpu(t: torch.Tensor, n: int):
    """gradwire.cuda.ops when `t` is a CUDA tensor with elements to work on, else None."""
    if not (t.is_cuda and n):
        return None
    from ..cuda import ops

    return ops


class _Chunked(Compressor):
    """Shared helpers: chunk count and fp32 results cast to the packet dtype."""

    role = "dense"

    @property
    def _chunk_size(self) -> int:
        return self.chunk

    def _nchunks(self, numel: int) -> int:
        return _ceil(numel, self._chunk_size)

    @staticmethod
    def _finish(vals: torch.Tensor, pk: Packet) -> torch.Tensor:
        return vals if pk.dtype == torch.float32 else vals.to(pk.dtype)

    def encode_residual(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """On the CPU the addition and the subtraction run inside the encode tiles (`_Residual`).
        On a GPU: the statistics kernel writes x + residual into out, then one fused kernel
        encodes into the packet, subtracts the decoded values and flags non-finite ones."""
        if out.is_cuda and out.is_contiguous() and out.numel():
            return self._encode_residual_cuda(x, residual, out, ctx if ctx is not None else Ctx())
        if out.is_cuda or not out.is_contiguous() or not out.numel():
            return super().encode_residual(x, residual, out, ctx)
        check_input(self.name, out)
        flat = out.detach().view(-1)
        fb = _Residual(x.detach().reshape(-1), None if residual is None else residual.reshape(-1), flat)
        sections = self._encode(flat, ctx if ctx is not None else Ctx(), fb)
        packet = Packet(self.codec_id, out.dtype, tuple(out.shape), sections, self.crc).freeze()
        return packet, fb.finite()

    def _encode_residual_cuda(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                              ctx: Ctx) -> tuple[Packet, torch.Tensor]:
        from ..cuda import ops

        check_input(self.name, out)
        n = out.numel()
        packet = wire.allocate(self.codec_id, out.dtype, tuple(out.shape), self._cuda_layout(n), self.crc,
                               device=out.device)
        e = None if residual is None else residual.view(-1)
        bad = self._feedback_cuda(ops, x.detach().reshape(-1).contiguous(), e, out.view(-1),
                                  [s.data for s in packet.sections], ctx)
        return packet, ops.ok(bad)

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        """(kind, dtype, count) of each section of an n-element packet."""
        raise NotImplementedError

    def _feedback_cuda(self, ops, x: torch.Tensor, e: torch.Tensor | None, out: torch.Tensor,
                       sections: list[torch.Tensor], ctx: Ctx) -> torch.Tensor:
        """The fused kernels into the packet's sections; returns the `bad` flag."""
        raise NotImplementedError

    #: How each section is laid out, in order: "chunk" (per_chunk fp32 values per chunk),
    #: "elem" (one code per element) or an int b (b bytes per group of 8 elements).
    _layout: tuple[str | int, ...] = ()
    per_chunk = 1

    def decode(self, packet: Packet | torch.Tensor, out: torch.Tensor | None = None, *,
               shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
               max_numel: int | None = None) -> torch.Tensor:
        """On the CPU, decoded tile by tile into one output (`_sent`): no full-size
        intermediates (unpacked codes, signs, fp32 values), only the result -- `out`
        itself where it can take it as it is (see `alloc`)."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        if pk.device.type != "cpu" or not pk.numel:
            return super().decode(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        self.check_header(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        into = alloc.direct(out, pk.numel, pk.dtype)
        flat = into if into is not None else alloc.empty(pk.numel, pk.dtype)
        for where, values in self._sent(pk):
            flat[where].copy_(values)
        return out if into is not None else deliver(flat, pk, out)

    def _sent(self, pk: Packet) -> Iterator[Piece]:
        """Decode tile by tile (whole chunks, a multiple of 8), each tile through the same
        `_decode` as a sub-packet, so no full-size decoded tensor exists."""
        n = pk.numel
        step = _tile_step(n, math.lcm(self._chunk_size or 8, 8), pk.device)
        for s in range(0, n, step):
            e = min(n, s + step)
            yield slice(s, e), self._decode(self._slice(pk, s, e))

    def _slice(self, pk: Packet, s: int, e: int) -> Packet:
        """The sub-packet of elements [s, e); s is a multiple of the chunk and of 8."""
        chunk = self._chunk_size
        sections = []
        for sec, unit in zip(pk.sections, self._layout):
            if unit == "chunk":
                a, b = (0, 1) if not chunk else (s // chunk * self.per_chunk, _ceil(e, chunk) * self.per_chunk)
            elif unit == "elem":
                a, b = s, e
            else:
                a, b = s // 8 * int(unit), _ceil(e, 8) * int(unit)
            sections.append(Section(sec.kind, sec.data[a:b]))
        return Packet(pk.codec, pk.dtype, (e - s,), sections, pk.config)


# ---- fp8 ------------------------------------------------------------------------------
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

    def _encode(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None = None) -> list[Section]:
        n, chunk, fmax = flat.numel(), self.chunk, self.fmax
        ops = _gpu(flat, n)
        if ops is not None:
            scales, codes = ops.fp8_encode(flat, chunk, self.format == "e5m2", fmax, self.code_dtype)
            return [Section(Kind.SCALES, scales), Section(Kind.DATA, codes)]
        scales = _empty_f32(flat, self._nchunks(n))
        codes = torch.empty(n, dtype=self.code_dtype, device=flat.device)
        if n:
            tiles = _Tiles(flat, math.lcm(chunk, 8), fb)
            if fb is not None:  # |code * scale| <= fmax * scale, same sign as x
                fb.by_scales(scales, FLT_MAX / (2 * fmax))
            for s, e, x in tiles:
                c0 = s // chunk
                sc = scales[c0: c0 + _ceil(e - s, chunk)]
                parts = _for_rows(x, chunk, sc, _absmax_rows)
                inv = torch.div(fmax, sc).clamp_(max=FLT_MAX)  # 0 -> FLT_MAX, inf -> 0, NaN stays
                sc.div_(fmax)
                w = tiles.f32[: e - s]
                for p, f, o in zip(parts, _split(inv, parts), _rows(w, chunk)):
                    torch.mul(p, f, out=o)
                codes[s:e].copy_(w)  # one rounding to fp8 (faster than a mixed-dtype mul)
                if fb is not None and fb.fast is not None:
                    fb.subtract_fp8(s, e, codes[s:e], sc * (1.0 if self.format == "e5m2" else 256.0), chunk,
                                    self.format == "e5m2")
                elif fb is not None:  # decode: codes times scale (torch's fp8 -> fp32 cast is slow)
                    lift = _fp8_as_half(codes[s:e], self.format, tiles.i32, w)
                    for p, f in zip(_rows(w, chunk), _split(sc * lift, parts)):
                        p.mul_(f)
                    fb.subtract(s, e, w)
        return [Section(Kind.SCALES, scales), Section(Kind.DATA, codes)]

    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.SCALES, torch.float32, self._nchunks(pk.numel)), (Kind.DATA, self.code_dtype, pk.numel))

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        return [(Kind.SCALES, torch.float32, self._nchunks(n)), (Kind.DATA, self.code_dtype, n)]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_fp8(x, e, out, self.chunk, self.format == "e5m2", self.fmax, *sections)

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
    their fp16 bit patterns (exact; here ~5x faster than a 256-entry table lookup and ~15x
    faster than torch's fp8 -> fp32 cast).

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


# ---- int8 -----------------------------------------------------------------------------
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

    def _encode(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None = None) -> list[Section]:
        n, chunk = flat.numel(), self.chunk
        ops = _gpu(flat, n)
        if ops is not None:
            scales, offsets, codes = ops.int8_encode(flat, chunk)
            return [Section(Kind.SCALES, scales), Section(Kind.OFFSETS, offsets), Section(Kind.DATA, codes)]
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
                    fb.subtract_affine(s, e, w, sc, lo + sc * 127.5, chunk)
                elif fb is not None:  # decode: (q - 127.5) * scale + (lo + 127.5 * scale); w holds q
                    w.sub_(127.5)
                    for p, f, o in zip(_rows(w, chunk), _split(sc, parts), _split(lo + sc * 127.5, parts)):
                        p.mul_(f).add_(o)
                    fb.subtract(s, e, w)
        return [Section(Kind.SCALES, scales), Section(Kind.OFFSETS, offsets), Section(Kind.DATA, codes)]

    def _check(self, pk: Packet) -> None:
        c = self._nchunks(pk.numel)
        expect(pk, (Kind.SCALES, torch.float32, c), (Kind.OFFSETS, torch.float32, c), (Kind.DATA, torch.uint8, pk.numel))

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        c = self._nchunks(n)
        return [(Kind.SCALES, torch.float32, c), (Kind.OFFSETS, torch.float32, c), (Kind.DATA, torch.uint8, n)]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_int8(x, e, out, self.chunk, *sections)

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


# ---- qsgd / terngrad ------------------------------------------------------------------
class _Stochastic(_Chunked):
    """Sign bit + stochastic level in [0, s] scaled by a per-bucket scale (qsgd, terngrad)."""

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

    def _nchunks(self, numel: int) -> int:
        if self.bucket == 0:
            return 1 if numel else 0
        return _ceil(numel, self.bucket)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        g = _ceil(numel, 8)
        return [4 * self._nchunks(numel), g, self.level_bits * g]

    def _scale_rows(self, p: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _encode(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None = None) -> list[Section]:
        n, s_lv, b = flat.numel(), float(self.levels), self.level_bits
        g = _ceil(n, 8)
        scales = _empty_f32(flat, self._nchunks(n))
        signs = torch.empty(g, dtype=torch.uint8, device=flat.device)
        levels = torch.empty(b * g, dtype=torch.uint8, device=flat.device)
        if not n:
            return self._sections(scales, signs, levels)
        key = rng.stream_key(ctx.seed, ctx.step, ctx.rank, ctx.key, stream=self.codec_id)
        ops = _gpu(flat, n)
        if ops is not None:
            return self._sections(*ops.stochastic_encode(flat, self.bucket or n, self.levels, b, key, self.by_norm))
        per_tensor = self.bucket == 0
        chunk = self.bucket if not per_tensor else None
        if fb is not None:  # |level * (scale / s)| <= scale (+ a rounding), sign of x
            fb.by_scales(scales, FLT_MAX / 2)
        if per_tensor:  # one scale: a pre-pass over the whole tensor
            if fb is not None:
                fb.correct_all()
            self._scale_rows(flat.view(1, -1), scales)
            factor = torch.div(s_lv, scales).clamp_(max=FLT_MAX)
        tiles = _Tiles(flat, 8 if per_tensor else math.lcm(chunk, 8), fb)
        fast = fb is not None and fb.fast is not None
        for s, e, x in tiles:
            m = e - s
            if fast:  # signs first: per tensor, x is out's own tile, which the residual overwrites
                tiles.pack(tiles.signs(x), 1, signs, s)
            w = torch.abs(x, out=tiles.f32[:m])
            if per_tensor:
                w.mul_(factor)
            else:
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
                if e == n:
                    levels[n:].zero_()  # the zero padding of the last group
            else:
                tiles.pack(q, b, levels, s)
            if fast:  # decode and subtract in one compiled pass
                fb.subtract_levels(s, e, q, (scales if per_tensor else sc) / self.levels, chunk or m)
                continue
            if fb is not None:  # decode: level * (scale / s), then the sign
                w.copy_(q)
                if per_tensor:
                    w.mul_(scales / self.levels)
                else:
                    for p, fk in zip(_rows(w, chunk), _split(sc / self.levels, parts)):
                        p.mul_(fk)
            neg = tiles.signs(x)
            tiles.pack(neg, 1, signs, s)
            if fb is not None:
                fb.subtract(s, e, _flip_signs(w, neg))
        return self._sections(scales, signs, levels)

    def _sections(self, scales, signs, levels) -> list[Section]:
        return [Section(Kind.SCALES, scales), Section(Kind.BITS, signs), Section(self.level_kind, levels)]

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

    def _check(self, pk: Packet) -> None:
        g = _ceil(pk.numel, 8)
        expect(pk, (Kind.SCALES, torch.float32, self._nchunks(pk.numel)), (Kind.BITS, torch.uint8, g),
               (self.level_kind, torch.uint8, self.level_bits * g))

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        g = _ceil(n, 8)
        return [(Kind.SCALES, torch.float32, self._nchunks(n)), (Kind.BITS, torch.uint8, g),
                (self.level_kind, torch.uint8, self.level_bits * g)]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        key = rng.stream_key(ctx.seed, ctx.step, ctx.rank, ctx.key, stream=self.codec_id)
        return ops.ef_stochastic(x, e, out, self.bucket or x.numel(), self.levels, self.level_bits, key,
                                 self.by_norm, *sections)

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


@register
class QSGD(_Stochastic):
    """QSGD: per-bucket L2 norm, sign bit, level in [0, 2**bits - 1] by unbiased stochastic rounding."""

    name = "qsgd"
    codec_id = 10
    params = (Param("bits", int, 8, lambda v: 1 <= v <= 8, "1 <= bits <= 8"),
              _chunk_param("bucket", 512))

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def level_bits(self) -> int:
        return self.bits

    def _scale_rows(self, p: torch.Tensor, out: torch.Tensor) -> None:
        if p.dtype == torch.float32:
            torch.linalg.vector_norm(p, dim=1, out=out)
        else:
            out.copy_(torch.linalg.vector_norm(p, dim=1, dtype=torch.float32))


@register
class TernGrad(_Stochastic):
    """TernGrad: scale = max |x| per bucket (bucket=0: per tensor), unbiased stochastic {-1, 0, 1}."""

    name = "terngrad"
    codec_id = 11
    params = (_chunk_param("bucket", 512, allow_zero=True),)
    levels = 1
    level_bits = 1
    level_kind = Kind.BITS
    by_norm = False

    def _scale_rows(self, p: torch.Tensor, out: torch.Tensor) -> None:
        if p.dtype == torch.float32:
            _absmax_rows(p, out)
        else:
            out.copy_(torch.maximum(torch.amax(p, 1), torch.amin(p, 1).neg_()))


# ---- sign / onebit --------------------------------------------------------------------
class _OneBit(_Chunked):
    params = (_chunk_param("chunk", 1024),)
    per_chunk = 1  # fp32 values per chunk
    _layout = ("chunk", 1)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return [4 * self.per_chunk * self._nchunks(numel), _ceil(numel, 8)]

    def _encode(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None = None) -> list[Section]:
        n, chunk = flat.numel(), self.chunk
        ops = _gpu(flat, n)
        if ops is not None:
            scales, bits = ops.sign_encode(flat, chunk, self.per_chunk == 2)
            return [Section(Kind.SCALES, scales), Section(Kind.BITS, bits)]
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
                    fb.subtract_signs(s, e, sc, self.per_chunk == 2, chunk)
                elif fb is not None:
                    fb.subtract(s, e, self._decode_tile(neg, sc, w))
        return [Section(Kind.SCALES, scales), Section(Kind.BITS, bits)]

    def _stats(self, x: torch.Tensor, neg: torch.Tensor, w: torch.Tensor, out: torch.Tensor) -> None:
        raise NotImplementedError

    def _decode_tile(self, neg: torch.Tensor, scales: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        """A tile's decoded values into w, from its signs (int32 -1/0, consumed) and scales."""
        raise NotImplementedError

    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.SCALES, torch.float32, self.per_chunk * self._nchunks(pk.numel)),
               (Kind.BITS, torch.uint8, _ceil(pk.numel, 8)))

    def _cuda_layout(self, n: int) -> list[tuple[Kind, torch.dtype, int]]:
        return [(Kind.SCALES, torch.float32, self.per_chunk * self._nchunks(n)), (Kind.BITS, torch.uint8, _ceil(n, 8))]

    def _feedback_cuda(self, ops, x, e, out, sections, ctx) -> torch.Tensor:
        return ops.ef_sign(x, e, out, self.chunk, self.per_chunk == 2, *sections)


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
        which is ~10x slower here): pos ^ ((pos ^ neg) & mask)."""
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
    return [p.shape[1] for p in _rows(t, chunk)]
