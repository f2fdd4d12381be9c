"""The machinery every quantizer shares: the tile loop, bit packing, error feedback inside
the tiles (`_Residual`) and the `_Chunked` base (chunk counts, tiled decode, the CUDA
residual path).

Tiles (CPU): the encoders stream over the tensor in tiles of about `TILE` elements (whole
chunks, a multiple of 8) and run every step of a tile on cache-resident scratch buffers
before moving on (cache blocking: the count of tiles does not depend on the chunk size;
the tile size does not change the bytes). On a GPU the whole tensor is one tile.

Bit packing (`BITS` and the qsgd levels): element ``i`` holds a ``b``-bit code; the codes of
elements ``8j .. 8j+7`` form the little-endian integer ``sum(code[8j+k] << (b*k))``, stored
as ``b`` bytes at byte offset ``b*j`` (``b = 1``: LSB-first bit order). A partial last group
is padded with zero codes. Decoders ignore the padding.

Kernels: gradwire/cuda/kernels/feedback.cu (the fused residual kernels behind
`_Chunked.encode_residual`). Compiled CPU loops: gradwire/compress/compiled.py (the
``residual_*`` loops `_Residual.fast` holds). Tests: tests/compress/test_quantize.py,
tests/compress/test_feedback.py, tests/compress/test_compiled.py, tests/cuda/test_cuda_host.py.
"""

from __future__ import annotations

import math
from typing import Iterator

import torch

from .. import alloc, compiled, wire
from ..base import Compressor, Ctx, Param, Piece, check_input, deliver
from ..finite import parts_finite
from ..wire import Kind, Packet, Section

#: Elements per encode tile on the CPU (rounded to whole chunks and bytes).
TILE = 1 << 19
FLT_MAX = torch.finfo(torch.float32).max
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

    def compiled_tile(self, s: int, e: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(the corrected tile, out's tile) over [s, e), for a compiled loop (`fast`) that
        writes out = corrected - decoded itself in one pass, instead of `subtract`."""
        return self._corrected(s, e), self.flat[s:e]

    def compiled_finite(self, ok: bool) -> None:
        """What a compiled loop reported: whether the residual it wrote is all finite
        (int8, sign, onebit; the others are judged by their scales, `by_scales`)."""
        self._flags.append(ok)

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


def _scale_to(x: torch.Tensor, chunk: int, fmax: float, sc: torch.Tensor, w: torch.Tensor) -> list[torch.Tensor]:
    """fp8's and fp4's per-chunk scaling: sc <- absmax / fmax, w <- x * min(fmax / absmax, FLT_MAX)
    (so each chunk's absmax maps to fmax); returns x's `_rows` parts."""
    parts = _for_rows(x, chunk, sc, _absmax_rows)
    inv = torch.div(fmax, sc).clamp_(max=FLT_MAX)  # 0 -> FLT_MAX, inf -> 0, NaN stays
    sc.div_(fmax)
    for p, f, o in zip(parts, _split(inv, parts), _rows(w, chunk)):
        torch.mul(p, f, out=o)
    return parts


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
    # imported on the first CUDA tensor: a CPU-only process never loads the CUDA layer
    # (its kernel loader and launcher, CuPy behind them); not an import circle
    from ...cuda import ops

    return ops


class _Chunked(Compressor):
    """The base of every quantizer: chunk counts, the encode dispatch (CUDA kernels or the
    CPU tile loop), error feedback (inside the tiles, or the fused CUDA kernels) and the
    tiled CPU decode; results are made in fp32 and cast to the packet dtype."""

    role = "dense"

    @property
    def _chunk_size(self) -> int:
        return self.chunk

    def _nchunks(self, numel: int) -> int:
        return _ceil(numel, self._chunk_size)

    @staticmethod
    def _finish(vals: torch.Tensor, pk: Packet) -> torch.Tensor:
        return vals if pk.dtype == torch.float32 else vals.to(pk.dtype)

    def _encode(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None = None) -> list[Section]:
        """The kernels for a CUDA tensor with elements, else the CPU tile loop (with error
        feedback's subtraction inside the tiles when `fb` is given: CPU only)."""
        ops = _gpu(flat, flat.numel())
        if ops is not None:
            return self._encode_cuda(ops, flat, ctx)
        return self._encode_cpu(flat, ctx, fb)

    def _encode_cuda(self, ops, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        """The packet's sections, made by the CUDA kernels (`gradwire.cuda.ops`)."""
        raise NotImplementedError

    def _encode_cpu(self, flat: torch.Tensor, ctx: Ctx, fb: _Residual | None) -> list[Section]:
        """The packet's sections, made tile by tile (`_Tiles`)."""
        raise NotImplementedError

    def encode_residual(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """On the CPU the addition and the subtraction run inside the encode tiles (`_Residual`).
        On a GPU: the statistics kernel writes x + residual into out, then one fused kernel
        encodes into the packet, subtracts the decoded values and flags non-finite ones."""
        ops = _gpu(out, out.numel())
        if ops is not None and out.is_contiguous():
            return self._encode_residual_cuda(ops, x, residual, out, ctx if ctx is not None else Ctx())
        if out.is_cuda or not out.is_contiguous() or not out.numel():
            return super().encode_residual(x, residual, out, ctx)
        check_input(self.name, out)
        flat = out.detach().view(-1)
        fb = _Residual(x.detach().reshape(-1), None if residual is None else residual.reshape(-1), flat)
        sections = self._encode(flat, ctx if ctx is not None else Ctx(), fb)
        packet = Packet(self.codec_id, out.dtype, tuple(out.shape), sections, self.crc).freeze()
        return packet, fb.finite()

    def _encode_residual_cuda(self, ops, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                              ctx: Ctx) -> tuple[Packet, torch.Tensor]:
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


