"""Compiled CPU loops (numba) for the hot paths of error feedback and DGC momentum.

Why: each torch op makes its own pass over a tile, so a formula of five ops costs five
passes, and a residual written into a spare buffer pays for reading it before the write.
These loops run a whole update in one pass with the same float32 operations in the same
order as the torch code they stand in for. LLVM contracts ``a * b + c`` into a fused
multiply-add only under fast-math flags, and numba sets none, so the results are the torch
path's bit for bit (tests/compress/test_compiled.py compares both paths).

`loops()` returns the compiled functions, or None when numba cannot be imported.
`enabled()` says whether callers should use them now: not with ``GRADWIRE_COMPILED=0``,
and not when torch runs more than one intra-op thread, since torch's own ops then run in
parallel and these loops on one thread only (torchrun defaults to one thread per rank
when it starts several). Either way the torch path runs instead. Each loop compiles on
its first call, and the compiled code is cached on disk (numba's ``cache=True``).
"""

from __future__ import annotations

import os
from types import SimpleNamespace

import torch

_LOOPS: SimpleNamespace | None = None
_TRIED = False

#: Bits of |x| for x = FLT_MAX / 8, as int32 (0x7E7FFFFF): DGC's in-place update only runs
#: while u, v and g all stay at or below this bound (see `DGCMomentum`).
SAFE_BITS = 0x7E7FFFFF


def enabled() -> bool:
    """Whether the compiled loops may be used now (numba present, one torch thread)."""
    return torch.get_num_threads() == 1 and os.environ.get("GRADWIRE_COMPILED", "1") != "0" and loops() is not None


def loops() -> SimpleNamespace | None:
    """The compiled loops (numba imported and the functions defined on first use), or None."""
    global _LOOPS, _TRIED
    if not _TRIED:
        _TRIED = True
        try:
            _LOOPS = _define()
        except ImportError:
            _LOOPS = None
    return _LOOPS


def np_view(t: torch.Tensor):
    """A NumPy array on t's memory (CPU, contiguous)."""
    return t.detach().numpy()


def _define() -> SimpleNamespace:
    # imported here, on first use: numba's import is slow, and gradwire runs without it
    import numba
    import numpy as np

    jit = numba.njit(cache=True, nogil=True, boundscheck=False)
    mag = np.int32(0x7FFFFFFF)
    exp = np.int32(0x7F800000)

    @jit
    def absbits_max(bits):
        """The largest ``bits & 0x7FFFFFFF`` of float32 bit patterns: |x|'s bits, and at
        least 0x7F800000 iff some x is NaN or Inf. It is an integer reduction, so it is
        vectorized, where a float max would not be."""
        h = bits.size // 2
        lo, hi = bits[:h], bits[h:2 * h]
        a = np.int32(0)
        b = np.int32(0)
        for i in range(h):  # two streams at once: faster than one
            a = max(a, lo[i] & mag)
            b = max(b, hi[i] & mag)
        for i in range(2 * h, bits.size):
            a = max(a, bits[i] & mag)
        return max(a, b)

    @jit
    def dgc_inplace(g, u, v, m, nesterov):
        """u = m*u + g;  v = v + u (Nesterov: v + (m*u + g)), in place, and the largest
        |u| and |v| bits afterwards (for the next step's overflow bound)."""
        ui, vi = u.view(np.int32), v.view(np.int32)
        ub = np.int32(0)
        vb = np.int32(0)
        if nesterov:
            for i in range(g.size):
                t = u[i] * m + g[i]
                u[i] = t
                v[i] = (t * m + g[i]) + v[i]
                ub = max(ub, ui[i] & mag)
                vb = max(vb, vi[i] & mag)
        else:
            for i in range(g.size):
                t = u[i] * m + g[i]
                u[i] = t
                v[i] = v[i] + t
                ub = max(ub, ui[i] & mag)
                vb = max(vb, vi[i] & mag)
        return ub, vb

    @numba.njit(cache=True, nogil=True, boundscheck=False, inline="always")  # into each caller's block loop
    def note(bits, s, e, key, out, c):
        """Write at out[c], out[c + 1], ... the indices in [s, e) whose magnitude key, ``bits &
        0x7FFFFFFF``, is at least key; returns the new count, which goes on counting past the
        end of out. Branch-free once over 1/16 of [0, s) have passed (dense data would
        mispredict every other branch)."""
        cap = out.size
        if c * 16 > s and c + (e - s) <= cap:
            for i in range(s, e):
                out[c] = i
                c += np.int64((bits[i] & mag) >= key)
        else:
            for i in range(s, e):
                if (bits[i] & mag) >= key:
                    if c < cap:
                        out[c] = i
                    c += 1
        return c

    @jit
    def at_least(bits, key, out):
        """Ascending indices of the float32s (as int32 bits) whose magnitude key, ``bits &
        0x7FFFFFFF``, is at least key (NaN included), written to out; returns their count,
        which exceeds out.size when out is too small (only out.size are written then).
        Blocks of 128: a vectorized max, then a look (`note`) only into blocks that hold one
        (timings: benchmarks/candidate_scan.py)."""
        c, width = 0, 128
        blocks = bits.size // width
        for b in range(blocks):
            s = b * width
            top = np.int32(0)
            for i in range(s, s + width):
                top = max(top, bits[i] & mag)
            if top >= key:
                c = note(bits, s, s + width, key, out, c)
        return note(bits, blocks * width, bits.size, key, out, c)

    @jit
    def dgc_inplace_at_least(g, u, v, m, nesterov, key, out):
        """`dgc_inplace` that also writes, as `at_least` does, the indices of the new v whose
        magnitude key is at least key: a sparsifier's first candidates, found while v is
        in registers instead of in a pass of their own. Returns (ub, vb, count). Blocks of
        32 with a fixed trip count (a variable trip count stops LLVM vectorizing). The update
        is `dgc_inplace`'s, written out again: calling an inlined span of it per block is
        slower."""
        ui, vi = u.view(np.int32), v.view(np.int32)
        ub = np.int32(0)
        vb = np.int32(0)
        c, width = 0, 32
        blocks = g.size // width
        for b in range(blocks):
            s = b * width
            top = np.int32(0)
            if nesterov:
                for i in range(s, s + width):
                    t = u[i] * m + g[i]
                    u[i] = t
                    v[i] = (t * m + g[i]) + v[i]
                    ub = max(ub, ui[i] & mag)
                    top = max(top, vi[i] & mag)
            else:
                for i in range(s, s + width):
                    t = u[i] * m + g[i]
                    u[i] = t
                    v[i] = v[i] + t
                    ub = max(ub, ui[i] & mag)
                    top = max(top, vi[i] & mag)
            vb = max(vb, top)
            if top >= key:
                c = note(vi, s, s + width, key, out, c)
        s = blocks * width
        tb, tv = dgc_inplace(g[s:], u[s:], v[s:], m, nesterov)
        return max(ub, tb), max(vb, tv), note(vi, s, g.size, key, out, c)

    @jit
    def sum_at_least(x, e, out, key, found):
        """out = x + e (e None: a copy of x), writing down as `at_least` does the indices of
        the sums whose magnitude key is at least key, in the same pass. Returns the count.
        (Blocks as in `dgc_inplace_at_least`: 0.45 adds over the sum alone, where a scan of
        its own costs 1.4-1.6.)"""
        bits = out.view(np.int32)
        c, width = 0, 32
        blocks = x.size // width
        for b in range(blocks):
            s = b * width
            top = np.int32(0)
            if e is None:
                for i in range(s, s + width):
                    out[i] = x[i]
                    top = max(top, bits[i] & mag)
            else:
                for i in range(s, s + width):
                    out[i] = x[i] + e[i]
                    top = max(top, bits[i] & mag)
            if top >= key:
                c = note(bits, s, s + width, key, found, c)
        for i in range(blocks * width, x.size):
            out[i] = x[i] if e is None else x[i] + e[i]
        return note(bits, blocks * width, x.size, key, found, c)

    @jit
    def mask_own(u, v, idx):
        """Momentum-factor masking where the sent values are v's own: at each sent index,
        u *= (v == 0) and v = +0 (torch: ``u * (sent == 0)``, then ``index_fill_``)."""
        zero = np.float32(0.0)
        one = np.float32(1.0)
        for j in range(idx.size):
            i = idx[j]
            u[i] = u[i] * (one if v[i] == zero else zero)
            v[i] = zero

    @jit
    def residual_levels(c, q, cbits, step, chunk, out):
        """out = c - (+-)(q * step[chunk]): the stochastic quantizers' residual, the sign
        being c's sign bit (as `_flip_signs` sets it)."""
        n = c.size
        for j in range(step.size):  # per chunk, on slices: indices from 0 vectorize
            f, s = step[j], j * chunk
            m = min(chunk, n - s)
            cs, qs, bs, os = c[s:s + m], q[s:s + m], cbits[s:s + m], out[s:s + m]
            for i in range(m):
                d = np.float32(qs[i]) * f
                os[i] = cs[i] - (-d if bs[i] < 0 else d)

    @jit
    def residual_int8(c, w, scale, mid, chunk, out):
        """out = c - ((w - 127.5) * scale + mid) per chunk, w holding the codes as floats;
        True iff every result is finite."""
        n = c.size
        bad = np.int32(0)
        half = np.float32(127.5)
        for j in range(scale.size):
            f, o, s = scale[j], mid[j], j * chunk
            m = min(chunk, n - s)
            cs, ws, os = c[s:s + m], w[s:s + m], out[s:s + m]
            bits = os.view(np.int32)
            for i in range(m):
                os[i] = cs[i] - ((ws[i] - half) * f + o)
                bad |= np.int32((bits[i] & exp) == exp)
        return bad == 0

    @jit
    def residual_fp8(c, codes, factor, chunk, e5m2, out):
        """out = c - w * factor[chunk], w being each fp8 code's value times 2**-8 (e4m3) or
        2**0 (e5m2), built from its bits as `quantize.fp8._fp8_as_half` builds it through fp16
        (exact: normal codes move their exponent, subnormal ones are small integers times a
        power of two); the caller checks by scales. In two passes over each chunk, integer
        then float, so both vectorize. NaN/Inf codes (a non-finite chunk only) come out
        non-finite or finite as there, times that chunk's non-finite factor."""
        n = c.size
        bits = out.view(np.int32)
        for j in range(factor.size):
            f, s = factor[j], j * chunk
            m = min(chunk, n - s)
            cs, ks, os, bs = c[s:s + m], codes[s:s + m], out[s:s + m], bits[s:s + m]
            if e5m2:
                for i in range(m):
                    b = np.int32(ks[i]) & np.int32(0xFF)
                    bs[i] = ((b & np.int32(0x80)) << 24) | ((((b >> 2) & np.int32(0x1F)) + np.int32(112)) << 23) \
                        | ((b & np.int32(3)) << 21)
                for i in range(m):
                    b = np.int32(ks[i]) & np.int32(0xFF)
                    ex = (b >> 2) & np.int32(0x1F)
                    sign = np.float32(-1.0) if b >= np.int32(0x80) else np.float32(1.0)
                    w = sign * np.float32(b & np.int32(3)) * np.float32(2.0 ** -16) if ex == 0 else os[i]
                    w = w * np.float32(np.inf) if ex == np.int32(0x1F) else w
                    os[i] = cs[i] - w * f
            else:
                for i in range(m):
                    b = np.int32(ks[i]) & np.int32(0xFF)
                    bs[i] = ((b & np.int32(0x80)) << 24) | ((((b >> 3) & np.int32(0xF)) + np.int32(112)) << 23) \
                        | ((b & np.int32(7)) << 20)
                for i in range(m):
                    b = np.int32(ks[i]) & np.int32(0xFF)
                    sign = np.float32(-1.0) if b >= np.int32(0x80) else np.float32(1.0)
                    w = sign * np.float32(b & np.int32(7)) * np.float32(2.0 ** -17) if (b & np.int32(0x78)) == 0 \
                        else os[i]
                    os[i] = cs[i] - w * f

    @jit
    def residual_signs(c, cbits, scales, pairs, chunk, out):
        """out = c - d, d being the chunk's scale with c's sign (sign), or the chunk's
        negative value where c's sign bit is set, else its non-negative one (onebit,
        ``pairs``: scales holds (pos, neg) per chunk); True iff every result is finite."""
        n = c.size
        bad = np.int32(0)
        for j in range(scales.size // (2 if pairs else 1)):
            if pairs:
                pos, neg = scales[2 * j], scales[2 * j + 1]
            else:
                pos = scales[j]
                neg = -pos
            s = j * chunk
            m = min(chunk, n - s)
            cs, bs, os = c[s:s + m], cbits[s:s + m], out[s:s + m]
            ob = os.view(np.int32)
            for i in range(m):
                os[i] = cs[i] - (neg if bs[i] < 0 else pos)
                bad |= np.int32((ob[i] & exp) == exp)
        return bad == 0

    @jit
    def zero_at_least(bits, key):
        """Set to +0 every float32 (as int32 bits) whose magnitude key, ``bits & 0x7FFFFFFF``,
        is at least key (NaN included)."""
        for i in range(bits.size):
            if (bits[i] & mag) >= key:
                bits[i] = 0

    @jit
    def sum_into(x, e, data, out):
        """data = x + e (e None: a copy of x) and out = +0, in one pass; True iff every sum is
        finite (a lossless cast under error feedback: the new residual is 0)."""
        bits = data.view(np.int32)
        bad = np.int32(0)
        zero = np.float32(0.0)
        if e is None:
            for i in range(x.size):
                data[i] = x[i]
                out[i] = zero
                bad |= np.int32((bits[i] & exp) == exp)
        else:
            for i in range(x.size):
                data[i] = x[i] + e[i]
                out[i] = zero
                bad |= np.int32((bits[i] & exp) == exp)
        return bad == 0

    return SimpleNamespace(absbits_max=absbits_max, dgc_inplace=dgc_inplace, mask_own=mask_own,
                           at_least=at_least, dgc_inplace_at_least=dgc_inplace_at_least, sum_at_least=sum_at_least,
                           residual_levels=residual_levels, residual_int8=residual_int8,
                           residual_signs=residual_signs, residual_fp8=residual_fp8, zero_at_least=zero_at_least,
                           sum_into=sum_into)
