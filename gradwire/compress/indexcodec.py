"""Ascending indices <-> compact bytes: gaps coded per block, Rice or Exp-Golomb.

An ascending, duplicate-free index list ``i_0 < i_1 < ...`` becomes gaps
``d_0 = i_0`` and ``d_j = i_j - i_{j-1} - 1`` (all >= 0), cut into blocks of `BLOCK`
(128). Each block picks a width ``b`` (0..32) and a mode from its own gaps, so the code
adapts to local density; a gap is split into ``b`` low bits and a quotient ``q = d >> b``:

* Rice mode: q in unary (q zeros, then a one). Within a few hundredths of a bit of the
  entropy for geometric gaps, i.e. uniformly random positions (~8.2 bits at 1%).
* Exp-Golomb mode: q + 1 = 2**L + r is sent as L in unary plus r in L raw bits, so a few
  huge gaps between dense clusters cost O(log gap) instead of O(gap). Clustered real
  gradients often get 3-6 bits per index this way.

Byte layout (``count`` comes from the packet's VALUES section)::

    params  nblocks x u8          b (bits 0-5, <= 32) | 0x80 for Exp-Golomb; bit 6 is 0
    low     8 * sum(w) bytes      each block's low b bits per gap, packed LSB-first into w
                                  little-endian 64-bit words: w = 2*b for a full block of
                                  128, ceil(r*b/64) for a last block of r gaps
    unary   bytes up to the count-th one bit (LSB-first): per gap q (Rice) or L (Exp-Golomb)
            zeros then a one; the rest of its last byte is zero
    raw     ceil(R / 8) bytes     the r of every Exp-Golomb gap in order, L bits each,
                                  packed LSB-first (R = the sum of those L); pad bits zero

The work is vectorised (no Python loop over elements or blocks) and runs on the host in
NumPy: these arrays are small (one entry per kept element), and on a CPU shared by more
runnable threads than cores every multi-threaded torch op of this size waits a scheduler
slice for its OpenMP barrier (~10 ms instead of ~0.1 ms for 250k elements). CPU tensors
are viewed without copies; other devices copy the (small) arrays to and from the host.
`decode` validates widths, lengths, padding, overflow and range and raises
`WireFormatError` naming the field, before anything proportional to ``numel`` exists.
"""

from __future__ import annotations

import math

import numpy as np
import torch

from ..errors import WireFormatError

BLOCK = 128
MAX_WIDTH = 32
_EG = 0x80
_WIDTH_BITS = 0x3F
_FIELD = "INDICES_PACKED"


def raw_dtype(numel: int) -> torch.dtype:
    """dtype of a raw INDICES section for a tensor of `numel` elements."""
    return torch.int32 if numel < 2**31 else torch.int64


def _host(t: torch.Tensor) -> np.ndarray:
    return t.detach().cpu().numpy() if t.device.type != "cpu" else t.detach().numpy()


# ---- bit helpers ----------------------------------------------------------------------

def _pack_fields(values: np.ndarray, pos: np.ndarray, width: np.ndarray, nbytes: int) -> np.ndarray:
    """Write each value (< 2**width, width <= 62) at its bit position, LSB-first, into `nbytes`
    bytes; positions ascend, so the fields sharing a 64-bit word are neighbours."""
    words = np.zeros(nbytes // 8 + 2, dtype="<u8")  # +2: spills and zero-width fields at the end
    if values.size:
        v = values.view(np.uint64)  # values and shifts are non-negative int64: views, no copies
        w = pos >> 6
        sh = pos & 63
        spill = sh + width
        spill = np.flatnonzero(spill > 64)
        hi = v[spill] >> (64 - sh[spill]).view(np.uint64)
        shv = sh.view(np.uint64)
        _or_into(words, w, np.left_shift(v, shv, out=shv))
        if spill.size:
            _or_into(words, w[spill] + 1, hi)
    return words.view(np.uint8)[:nbytes]


def _or_into(words: np.ndarray, w: np.ndarray, bits: np.ndarray) -> None:
    """words[w[i]] |= bits[i] for non-decreasing w (one reduceat per run of equal w)."""
    starts = np.flatnonzero(np.diff(w, prepend=-1))
    words[w[starts]] |= np.bitwise_or.reduceat(bits, starts)


def _unpack_fields(data: np.ndarray, pos: np.ndarray, width: np.ndarray) -> np.ndarray:
    """The `width`-bit field (width <= 62) starting at each bit position `pos`; int64."""
    words = np.zeros(data.size // 8 + 2, dtype="<u8")
    words.view(np.uint8)[: data.size] = data
    w = pos >> 6
    sh = (pos & 63).astype(np.uint64)
    lo = words[w] >> sh
    hi = np.where(sh > 0, words[w + 1] << ((np.uint64(64) - sh) & np.uint64(63)), np.uint64(0))
    mask = (np.uint64(1) << width.astype(np.uint64)) - np.uint64(1)
    return ((lo | hi) & mask).astype(np.int64)


def _low_layout(b: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, int]:
    """(bit position, width) of each gap's low bits, and the low section's byte length.

    A full block's 128 fields fill exactly 2*b words, so the fields are contiguous and only
    the last block is padded (to a whole word)."""
    width = np.repeat(b, BLOCK)[:count]
    pos = np.cumsum(width)
    pos -= width
    r = count - (b.size - 1) * BLOCK
    words = 2 * int(b[:-1].sum()) + (r * int(b[-1]) + 63) // 64
    return pos, width, 8 * words


def _unary(u: np.ndarray) -> np.ndarray:
    """u[j] zeros then a one, for each j, LSB-first."""
    ones = u + 1
    np.cumsum(ones, out=ones)
    ones -= 1
    bits = np.zeros(int(ones[-1]) + 1, dtype=np.uint8)
    bits[ones] = 1
    return np.packbits(bits, bitorder="little")


# ---- encode ---------------------------------------------------------------------------

def encode(indices: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """Pack ascending unique non-negative indices; returns a 1-D uint8 tensor (same device)."""
    m = indices.numel()
    if m == 0:
        return torch.empty(0, dtype=torch.uint8, device=indices.device)
    if indices.is_cuda:  # stay on the device (one small host read, see encode_torch)
        return encode_torch(indices, numel)
    idx = _host(indices.reshape(-1)).astype(np.int64, copy=False)
    nb = -(-m // BLOCK)
    D = np.zeros(nb * BLOCK, dtype=np.int64)
    D[0] = idx[0]
    np.subtract(idx[1:], idx[:-1], out=D[1:m])
    D[1:m] -= 1
    D2 = D.reshape(nb, BLOCK)
    b, eg = _choose(D2, m)
    bel = np.repeat(b, BLOCK)[:m]
    D = D[:m]
    q = D >> bel
    low = np.left_shift(q, bel)
    np.subtract(D, low, out=low)
    eg_el = np.repeat(eg, BLOCK)[:m]
    # Exp-Golomb gaps: q + 1 = 2**L + r, L in unary, r in L raw bits.
    v = q[eg_el] + 1
    L = np.frexp(v.astype(np.float64))[1].astype(np.int64) - 1  # exact below 2**53
    if v.size and int(idx[-1]) + 1 >= 1 << 53:  # float64 may have rounded up a power of two
        L -= (np.int64(1) << L) > v
    r = v - (np.int64(1) << L)
    u = q  # q is not needed any more
    u[eg_el] = L
    lpos, _, lbytes = _low_layout(b, m)
    params = (b | eg.astype(np.int64) * _EG).astype(np.uint8)
    rbytes = -(-int(L.sum()) // 8)
    parts = [params, _pack_fields(low, lpos, bel, lbytes), _unary(u), _pack_fields(r, np.cumsum(L) - L, L, rbytes)]
    return torch.from_numpy(np.concatenate(parts)).to(indices.device)


def _choose(D: np.ndarray, m: int) -> tuple[np.ndarray, np.ndarray]:
    """Per block (b, Exp-Golomb?) of least cost among a few candidates (full blocks counted)."""
    nb = D.shape[0]
    counts = np.full(nb, BLOCK, dtype=np.int64)
    counts[-1] = m - (nb - 1) * BLOCK
    # Rice: b near log2(mean gap * ln 2), the optimum for geometric gaps.
    mean = D.sum(1) / counts
    br = np.minimum(np.floor(np.log2(np.maximum(mean * math.log(2), 1.0))), MAX_WIDTH - 1).astype(np.int64)
    # Exp-Golomb: b near the mean of log2(gap + 1), which outliers barely move.
    f = D.astype(np.float32)  # (reused buffers: fresh MB-sized arrays page-fault)
    f += 1.0
    logs = np.log2(f, out=f).sum(1) / counts
    be = np.clip(np.floor(logs + 0.5), 1, MAX_WIDTH).astype(np.int64)
    if int(D.max()) < 1 << 31:
        D = D.astype(np.int32)  # halves the memory traffic of the cost passes
    q = np.empty_like(D)
    e = f.view(np.int32)
    best_b, best_eg, best = br, np.zeros(nb, dtype=bool), None
    for bb, is_eg in ((br, False), (br + 1, False), (be, True), (be - 1, True)):
        np.right_shift(D, bb[:, None].astype(D.dtype), out=q)
        if is_eg:  # 2 * floor(log2(q + 1)) from float32 exponent bits (rounding near 2**24+ only
            np.add(q, 1, out=f, casting="unsafe")  # blurs the estimate)
            np.right_shift(e, 23, out=e)
            cost = 2 * (e.sum(1, dtype=np.int64) - 127 * BLOCK)
        else:
            cost = q.sum(1, dtype=np.int64)
        cost += BLOCK * bb
        if best is None:
            best = cost
            continue
        better = cost < best
        best = np.where(better, cost, best)
        best_b = np.where(better, bb, best_b)
        best_eg = (best_eg | better) if is_eg else (best_eg & ~better)
    return best_b, best_eg


def max_size(count: int, numel: int) -> int:
    """Bytes `encode` can write for `count` indices below `numel`, at most.

    Each block's width is chosen by least cost, so it costs no more than Rice with
    b = floor(log2(mean gap * ln 2)) (<= 31): 128*b low bits plus under 370 quotient bits
    plus 128 terminators, i.e. under 4.4 bytes per index, plus a word of low-section padding,
    a params byte and slack per block, and 1 bit per 2**31 of the gaps' sum (<= numel)."""
    if count <= 0:
        return 0
    nb = -(-count // BLOCK)
    return 5 * count + 24 * nb + (numel >> 31) // 8 + 16


# ---- decode ---------------------------------------------------------------------------

def check(data: torch.Tensor, count: int) -> None:
    """Cheap structural checks (params and the low section's length) without decoding."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise WireFormatError(f"{_FIELD} must be 1-D uint8, got {data.dtype} {tuple(data.shape)}")
    _layout(_host(data), count)


def _layout(data: np.ndarray, count: int) -> tuple[np.ndarray, np.ndarray, int]:
    if count < 0:
        raise WireFormatError(f"{_FIELD}: negative count {count}")
    n = data.size
    if count == 0:
        if n:
            raise WireFormatError(f"{_FIELD}: {n} bytes for 0 indices")
        return data, data, 0
    nb = -(-count // BLOCK)
    if n < nb:
        raise WireFormatError(f"{_FIELD}: truncated, {n} bytes cannot hold {nb} block params")
    params = data[:nb].astype(np.int64)
    if bool((params & 0x40).any()):
        raise WireFormatError(f"{_FIELD}: block param has the reserved bit 6 set")
    b = params & _WIDTH_BITS
    wmax = int(b.max())
    if wmax > MAX_WIDTH:
        raise WireFormatError(f"{_FIELD}: block width {wmax} exceeds {MAX_WIDTH}")
    _, _, lbytes = _low_layout(b, count)
    if n <= nb + lbytes:
        raise WireFormatError(f"{_FIELD}: truncated, {n} bytes but the block widths need {nb + lbytes} "
                              "plus the unary codes")
    return b, params >= _EG, nb + lbytes


def decode(data: torch.Tensor, count: int, numel: int) -> torch.Tensor:
    """Inverse of `encode`: `count` ascending int64 indices, all < numel (same device)."""
    if data.dtype != torch.uint8 or data.dim() != 1:
        raise WireFormatError(f"{_FIELD} must be 1-D uint8, got {data.dtype} {tuple(data.shape)}")
    raw = _host(data)
    b, eg, low_end = _layout(raw, count)
    if count == 0:
        return torch.empty(0, dtype=torch.int64, device=data.device)
    nb = b.size
    rest = raw[low_end:]
    bits = np.unpackbits(rest, bitorder="little")
    ones = np.flatnonzero(bits)
    if ones.size < count:
        raise WireFormatError(f"{_FIELD}: unary codes end after {ones.size} of {count} indices (truncated)")
    ones = ones[:count]
    uend = int(ones[-1]) + 1
    ubytes = -(-uend // 8)
    if bool(bits[uend: ubytes * 8].any()):
        raise WireFormatError(f"{_FIELD}: pad bits after the unary codes are not zero")
    u = np.diff(ones, prepend=-1) - 1
    eg_el = np.repeat(eg, BLOCK)[:count]
    L = u[eg_el]
    if L.size and int(L.max()) > 61:
        raise WireFormatError(f"{_FIELD}: an Exp-Golomb length exceeds 61 bits")
    rbits = int(L.sum())
    rbytes = rest.size - ubytes
    if rbytes != -(-rbits // 8):
        raise WireFormatError(f"{_FIELD}: {rbytes} bytes of Exp-Golomb remainders, the codes need "
                              f"{-(-rbits // 8)} (truncated or padded)")
    if rbits % 8 and bool(bits[ubytes * 8 + rbits:].any()):
        raise WireFormatError(f"{_FIELD}: pad bits after the Exp-Golomb remainders are not zero")
    q = u
    if L.size:
        r = _unpack_fields(rest[ubytes:], np.cumsum(L) - L, L)
        q[eg_el] = (np.int64(1) << L) + r - 1
    lpos, bel, _ = _low_layout(b, count)
    # Bound every gap before shifting or summing so nothing can overflow int64.
    if bool(((q >> (62 - bel)) != 0).any()):
        raise WireFormatError(f"{_FIELD}: a gap is too large")
    d = (q << bel) | _unpack_fields(raw[nb:low_end], lpos, bel)
    if bool((d >= numel).any()):
        raise WireFormatError(f"{_FIELD}: an index is out of range for {numel} elements")
    # Each gap < numel, so the running sum stays below count * numel; bound that too.
    if count * numel >= 1 << 62 and float(d.sum(dtype=np.float64)) + count > numel:
        raise WireFormatError(f"{_FIELD}: an index is out of range for {numel} elements")
    idx = np.cumsum(d + 1) - 1
    last = int(idx[-1])
    if last >= numel:
        raise WireFormatError(f"{_FIELD}: index {last} is out of range for {numel} elements")
    return torch.from_numpy(idx).to(data.device)


# ---- device encoder ---------------------------------------------------------------------

def encode_torch(indices: torch.Tensor, numel: int | None = None) -> torch.Tensor:
    """`encode` in torch ops on the indices' own device (CUDA tensors use it: no round trip
    through the host except one small read of the section lengths).

    Same layout and block choices as `encode`; the Exp-Golomb width estimate sums float32
    log2s in torch's order rather than NumPy's, so a block whose mean lands within rounding
    of a half-integer may pick the neighbouring width (the bytes differ, the indices do
    not). Bit fields never overlap, so they are placed by integer addition into 64-bit
    words (`index_add_`), which equals OR and is order-independent.
    """
    m = indices.numel()
    dev = indices.device
    if m == 0:
        return torch.empty(0, dtype=torch.uint8, device=dev)
    idx = indices.reshape(-1).to(torch.int64)
    nb = -(-m // BLOCK)
    D = torch.zeros(nb * BLOCK, dtype=torch.int64, device=dev)
    D[0] = idx[0]
    torch.sub(idx[1:], idx[:-1], out=D[1:m]).sub_(1)
    b, eg = _choose_torch(D.view(nb, BLOCK), m)
    bel = b.repeat_interleave(BLOCK)[:m]
    d = D[:m]
    q = d >> bel
    low = d - (q << bel)
    eg_el = eg.repeat_interleave(BLOCK)[:m]
    v = (q + 1) * eg_el  # Exp-Golomb gaps: q + 1 = 2**L + r (0 elsewhere, L = 0)
    L = torch.where(eg_el, torch.frexp(v.double()).exponent.to(torch.int64) - 1, torch.zeros_like(v))
    L -= (((1 << L) > v) & eg_el).to(torch.int64)  # float64 may round a value just below a power of two up
    r = torch.where(eg_el, v - (1 << L), torch.zeros_like(v))
    u = torch.where(eg_el, L, q)
    ones = torch.cumsum(u + 1, 0) - 1
    lpos = torch.cumsum(bel, 0) - bel
    rpos = torch.cumsum(L, 0) - L
    # the one host read: section lengths
    last_r = m - (nb - 1) * BLOCK
    sizes = torch.stack([b[:-1].sum(), b[-1], ones[-1], L.sum()]).tolist()
    lbytes = 8 * (2 * sizes[0] + (last_r * sizes[1] + 63) // 64)
    ubytes = (sizes[2] + 1 + 7) // 8
    rbytes = (sizes[3] + 7) // 8
    params = (b | eg.to(torch.int64) * _EG).to(torch.uint8)
    parts = [params, _fields_torch(low, lpos, bel, lbytes),
             _fields_torch(torch.ones_like(ones), ones, torch.ones_like(ones), ubytes),
             _fields_torch(r, rpos, L, rbytes)]
    return torch.cat(parts)


def _fields_torch(values: torch.Tensor, pos: torch.Tensor, width: torch.Tensor, nbytes: int) -> torch.Tensor:
    """Values (< 2**width, width <= 62) at bit positions `pos`, LSB-first, in `nbytes` bytes."""
    words = torch.zeros(nbytes // 8 + 2, dtype=torch.int64, device=values.device)
    if values.numel():
        w = pos >> 6
        sh = pos & 63
        words.index_add_(0, w, values << sh)  # bits past 63 are cut: the spill below carries them
        spill = (sh + width > 64) & (width > 0)
        hi = torch.where(spill, values >> (64 - sh).clamp_(max=63), torch.zeros_like(values))
        words.index_add_(0, w + 1, hi)
    return words.view(torch.uint8)[:nbytes].clone()


def _choose_torch(D: torch.Tensor, m: int) -> tuple[torch.Tensor, torch.Tensor]:
    """`_choose` in torch ops (same candidates, costs and tie order)."""
    nb = D.shape[0]
    counts = torch.full((nb,), BLOCK, dtype=torch.int64, device=D.device)
    counts[-1] = m - (nb - 1) * BLOCK
    mean = D.sum(1).double() / counts
    br = torch.floor(torch.log2(torch.clamp(mean * math.log(2), min=1.0))).clamp(max=MAX_WIDTH - 1).to(torch.int64)
    logs = torch.log2(D.float() + 1.0).sum(1).double() / counts
    be = torch.floor(logs + 0.5).clamp(1, MAX_WIDTH).to(torch.int64)
    best_b, best_eg, best = br, torch.zeros(nb, dtype=torch.bool, device=D.device), None
    for bb, is_eg in ((br, False), (br + 1, False), (be, True), (be - 1, True)):
        q = D >> bb[:, None]
        if is_eg:
            e = (q + 1).float().view(torch.int32) >> 23
            cost = 2 * (e.sum(1, dtype=torch.int64) - 127 * BLOCK)
        else:
            cost = q.sum(1)
        cost = cost + BLOCK * bb
        if best is None:
            best = cost
            continue
        better = cost < best
        best = torch.where(better, cost, best)
        best_b = torch.where(better, bb, best_b)
        best_eg = (best_eg | better) if is_eg else (best_eg & ~better)
    return best_b, best_eg
