"""Sparsifiers: `topk`, `randomk`, `threshold`, `dgc` (codec ids 6-9, role "sparse").

Packet: an index section -- INDICES (raw ascending int32, int64 when numel >= 2**31) or
INDICES_PACKED (uint8, see `indexcodec`) -- then VALUES (the kept elements, input dtype).
`randomk` sends no indices: a META section holds the stream key its positions are drawn
from, and a SENTINEL (one float32: 0, or NaN when the input held NaN/Inf) follows VALUES.
Decode validates counts, order, range and the packed layout before it allocates the
output, then scatters the values into zeros.

Selection works on *magnitude keys*: an element's bits with the sign cleared, read as an
integer. Keys order like |x| and put NaN above Inf (every NaN is clamped to one key),
so NaN/Inf are the largest magnitudes and always survive `topk`/`dgc`.

Fast top-k (no full-tensor `torch.topk`): the k-th largest key of a strided sample
(every 97th run of 16 elements: >= 1% of the tensor, 1% of its memory traffic), with a
statistical margin, gives a threshold key. Two one-sided compares straight from the
input's integer views (no temporary copy; into per-thread reusable byte masks) mark the
candidates ``|x| >= t`` or NaN; they are located eight at a time through an int64 view of
the masks (`nonzero` over 8x fewer words, then within the few words that hold one). The
exact k are then chosen among the ~1.1k candidates by the k-th largest key (a partial
sort), ties going to the lowest index, and come out ascending without a sort. Too few
candidates lowers the threshold and retries; the last resort is every element, so the
result is always exact.

With one torch thread (`compiled.enabled()`) the candidate scan of float32 on the CPU is
one compiled loop (`compiled` ``at_least``), 2-3x NumPy's masks below. Otherwise
CPU tensors run all of this in NumPy on views of the tensor's memory: NumPy's compares
are about twice as fast as torch's per thread here, and every multi-threaded torch op on
1e5-1e6 elements waits for its OpenMP barrier, which costs a scheduler slice (~10 ms
rather than ~0.1 ms) whenever the cores are oversubscribed. Other devices use the
equivalent torch ops (float compares ``x < t``, ``x > -t`` for float32).
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor
from fractions import Fraction
from typing import Iterator

import numpy as np
import torch

from ..errors import WireFormatError
from . import alloc, compiled, indexcodec, rng, wire
from .base import Compressor, Ctx, Param, Piece, check_input
from .finite import parts_finite
from .registry import register
from .wire import Kind, Packet, Section

# ---- magnitude keys -------------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_MAG_MASK = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}
_INF_KEY = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
_NP_INT = {torch.int32: np.int32, torch.int16: np.int16, torch.int64: np.int64}
_NP_UINT = {np.dtype(np.int32): np.uint32, np.dtype(np.int16): np.uint16}
_SIGN = {torch.float32: 1 << 31, torch.float16: 1 << 15, torch.bfloat16: 1 << 15}
_ONES8 = 0x0101010101010101  # one True byte in each lane of an int64 word of bools
_SMALL = 1 << 15  # below this many elements, select exactly among all of them
_TOPK_STRIDE = 97  # prime stride: a >= 1% sample that no small period aliases with
_DGC_MIN_SAMPLE = 1024
_PACK_MIN = 64


def _keys_of(ints, dtype: torch.dtype):
    """Magnitude keys (int32) of the integer views of some elements (a tensor, or a NumPy
    array on the host path); NaN -> Inf + 1."""
    if isinstance(ints, np.ndarray):
        keys = (ints & _MAG_MASK[dtype]).astype(np.int32, copy=False)
        return np.minimum(keys, _INF_KEY[dtype] + 1, out=keys)
    keys = torch.bitwise_and(ints, _MAG_MASK[dtype])
    if keys.dtype != torch.int32:
        keys = keys.to(torch.int32)
    return keys.clamp_(max=_INF_KEY[dtype] + 1)


def _key_value(key: int, dtype: torch.dtype) -> float:
    """The (non-negative) value whose magnitude key is `key`."""
    return float(torch.tensor([key], dtype=_INT_VIEW[dtype]).view(dtype)[0])


def _ceil_key(t: float, dtype: torch.dtype) -> int:
    """Smallest key whose value is >= t (t > 0): |x| >= t  <=>  key(x) >= this (NaN aside)."""
    v = torch.tensor([t], dtype=torch.float64).to(dtype)
    key = int(v.view(_INT_VIEW[dtype])[0]) & _MAG_MASK[dtype]
    return key + 1 if float(v[0]) < t else key


class _Scratch(threading.local):
    """Per-thread reusable byte masks for CPU candidate passes.

    A fresh multi-megabyte tensor costs a page fault per 4 KiB on first touch, more than
    the compare that fills it; two masks of the largest tensor seen (2 bytes/element)
    are kept per thread instead. `release_scratch()` frees them.
    """

    buf: torch.Tensor | None = None
    found: np.ndarray | None = None
    most: int = 0  # the most candidates one scan has found (`found_indices`)

    def masks(self, n: int) -> tuple[torch.Tensor, torch.Tensor]:
        if self.buf is None or self.buf.numel() < 2 * n:
            self.buf = None
            self.buf = torch.empty(2 * n, dtype=torch.bool)
        return self.buf[:n], self.buf[n: 2 * n]

    def indices(self, n: int, k: int = 0) -> np.ndarray:
        """Room for the candidates of an n-element scan by the compiled loops for k: n/4
        int64s (2 bytes an element, as the masks), or 2k, or 5/4 of the most found before
        (a threshold under error feedback can pass over half the tensor)."""
        cap = max(1024, n // 4, 2 * k, min(n, self.most + self.most // 4))
        if self.found is None or self.found.shape[0] < cap:
            self.found = None
            self.found = np.empty(cap, dtype=np.int64)
        return self.found[:cap]


_scratch = _Scratch()


def release_scratch() -> None:
    """Free this thread's cached candidate masks and index buffer."""
    _scratch.buf = None
    _scratch.found = None
    _scratch.most = 0


def _masks(n: int, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    if device.type == "cpu":
        return _scratch.masks(n)
    return (torch.empty(n, dtype=torch.bool, device=device), torch.empty(n, dtype=torch.bool, device=device))


def _on_host(t: torch.Tensor) -> bool:
    """CPU tensors take the NumPy path (see the module docstring)."""
    return t.device.type == "cpu"


def _ints(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_VIEW[flat.dtype])


def _candidates(flat: torch.Tensor, key: int) -> torch.Tensor:
    """Ascending int64 indices of the elements whose magnitude key is >= key (NaN included)."""
    n = flat.numel()
    dev = flat.device
    if key <= 0:
        return torch.arange(n, device=dev)
    if _on_host(flat) and flat.dtype == torch.float32 and compiled.enabled():
        out = candidate_buffer(n)
        return found_indices(out, compiled.loops().at_least(_ints(flat).numpy(), key, out), flat, key)
    nw = -(-n // 8)
    hit, other = _masks(nw * 8, dev)
    if _on_host(flat):
        ints = _ints(flat).numpy()
        h, o = hit.numpy(), other.numpy()
        h[n:] = False
        o[n:] = False
        # NumPy runs one thread and releases the GIL: split the scan into one contiguous
        # part per torch thread (8-element aligned) and run the parts concurrently.
        parts = _parts(nw, torch.get_num_threads())
        found = _pool().map(lambda ab: _scan_part(ints, h, o, key, flat.dtype, ab[0], ab[1]), parts) \
            if len(parts) > 1 else [_scan_part(ints, h, o, key, flat.dtype, *parts[0])]
        return torch.from_numpy(np.concatenate(list(found)))
    if flat.dtype == torch.float32 and key <= _INF_KEY[torch.float32]:
        # Two compares straight from the input (no 4-byte temporary): an element is *not* a
        # candidate iff x < t and x > -t; NaN fails both, so it is one.
        t = _key_value(key, flat.dtype)
        torch.lt(flat, t, out=hit[:n])
        torch.gt(flat, -t, out=other[:n])
        hit[n:] = True
        other[n:] = True
        words = hit.view(torch.int64).bitwise_and_(other.view(torch.int64))
        w = torch.nonzero(torch.ne(words, _ONES8)).view(-1)
        sub = torch.index_select(words, 0, w).bitwise_xor_(_ONES8)
    else:
        torch.ge(torch.bitwise_and(_ints(flat), _MAG_MASK[flat.dtype]), key, out=hit[:n])
        hit[n:] = False
        words = hit.view(torch.int64)
        w = torch.nonzero(words).view(-1)
        sub = torch.index_select(words, 0, w)
    j = torch.nonzero(sub.view(torch.bool)).view(-1)
    return torch.index_select(w, 0, j >> 3).mul_(8).add_(j & 7)


def _compiled_sum(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether `compiled` ``sum_at_least`` can write out = x + residual."""
    return (out.device.type == "cpu" and out.is_contiguous() and x.is_contiguous() and out.numel() > 0
            and x.dtype == out.dtype == torch.float32 and compiled.enabled()
            and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous())))


def candidate_buffer(n: int, k: int = 0) -> np.ndarray:
    """This thread's buffer for the candidate indices a compiled scan of n elements writes
    (`found_indices` takes them out), with room for twice k."""
    return _scratch.indices(n, k)


def found_indices(out: np.ndarray, count: int, flat: torch.Tensor, key: int) -> torch.Tensor:
    """The candidates a compiled scan wrote to `out` (`count` of them), as a new tensor; when
    they did not fit (over a quarter of flat passed), a scan into a buffer of their size."""
    if count > out.shape[0]:
        _scratch.most = max(_scratch.most, count)  # the next scan has room
        out = np.empty(count, dtype=np.int64)
        compiled.loops().at_least(_ints(flat).numpy(), key, out)
        return torch.from_numpy(out)
    return torch.from_numpy(out[:count].copy())


def _scan_part(ints: np.ndarray, h: np.ndarray, o: np.ndarray, key: int, dtype: torch.dtype,
               w0: int, w1: int) -> np.ndarray:
    """Candidate indices among words w0..w1 (8 elements each) of the input."""
    a, b = 8 * w0, min(8 * w1, ints.shape[0])
    # Two one-sided integer compares, no temporary: as signed ints the positive
    # elements with key >= `key` are exactly those >= key; as unsigned ints the negative
    # ones are exactly those >= sign bit + key. NaN of either sign has the largest key.
    np.greater_equal(ints[a:b], key, out=h[a:b])
    np.greater_equal(ints[a:b].view(_NP_UINT[ints.dtype]), _SIGN[dtype] + key, out=o[a:b])
    # Find candidate bytes eight at a time: first the int64 words holding one (a scan of
    # n/8 words), then the bytes within those words.
    words = h[8 * w0: 8 * w1].view(np.int64)
    np.bitwise_or(words, o[8 * w0: 8 * w1].view(np.int64), out=words)
    w = np.flatnonzero(words != 0)
    j = np.flatnonzero(words[w].view(np.bool_))  # bytes are 0/1; NumPy scans bool fastest
    return ((w[j >> 3] + w0) << 3) | (j & 7)


def _parts(nwords: int, threads: int) -> list[tuple[int, int]]:
    """Split nwords into up to `threads` contiguous ranges (small inputs stay whole)."""
    count = max(1, min(threads, nwords // (1 << 16)))
    bounds = [nwords * i // count for i in range(count + 1)]
    return list(zip(bounds[:-1], bounds[1:]))


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(max_workers=max(2, torch.get_num_threads()), thread_name_prefix="gradwire-scan")
    return _POOL


def _kth_largest(keys, r: int) -> int:
    """The r-th largest entry of keys (a tensor or a NumPy array), r clamped to [1, len]."""
    m = keys.shape[0]
    r = max(1, min(r, m))
    if isinstance(keys, np.ndarray):
        return int(np.partition(keys, m - r)[m - r])
    return int(torch.kthvalue(keys, m - r + 1).values)


def _select(keys, k: int):
    """Mask of the k largest of `keys` (in index order), ties to the lowest; None: all of them."""
    c = keys.shape[0]
    if c <= k:
        return None
    v = _kth_largest(keys, k)
    keep = keys >= v
    if isinstance(keys, np.ndarray):
        extra = int(np.count_nonzero(keep)) - k
        if extra:  # ties at v straddle the cut: keep the first of them
            eq = keys == v
            keep = (keys > v) | (eq & (np.cumsum(eq) <= int(np.count_nonzero(eq)) - extra))
        return keep
    extra = int(torch.count_nonzero(keep)) - k
    if extra:
        eq = keys == v
        keep = (keys > v) | (eq & (torch.cumsum(eq, 0) <= int(torch.count_nonzero(eq)) - extra))
    return keep


def _gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """flat[idx] as a new tensor."""
    if _on_host(flat):
        return torch.from_numpy(_ints(flat).numpy()[idx.numpy()]).view(flat.dtype)
    return torch.index_select(flat, 0, idx)


def _pick(flat: torch.Tensor, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top k among candidate indices: (ascending indices, their values)."""
    if _on_host(flat):
        ix = idx.numpy()
        vals = _ints(flat).numpy()[ix]
        keep = _select(_keys_of(vals, flat.dtype), k)
        if keep is not None:
            ix, vals = ix[keep], vals[keep]
        return torch.from_numpy(ix), torch.from_numpy(vals).view(flat.dtype)
    vals = torch.index_select(flat, 0, idx)
    keep = _select(_keys_of(vals.view(_INT_VIEW[flat.dtype]), flat.dtype), k)
    if keep is None:
        return idx, vals
    return torch.masked_select(idx, keep), torch.masked_select(vals, keep)


def sample_view(a, stride: int):
    """The sampled elements of a 1-D array or tensor, as a view: every stride-th run of 16
    elements (one 64-byte line of fp32), so a 1% sample reads 1% of the memory instead of
    one line per sampled element; every stride-th element when that gives too few rows."""
    rows = a.shape[0] // 16
    if rows >= 64 * stride:
        return a[: rows * 16].reshape(rows, 16)[::stride]
    return a[::stride]


def _sample_keys(flat: torch.Tensor, stride: int):
    """Magnitude keys of flat's sample (`sample_view`), 1-D."""
    ints = _ints(flat).numpy() if _on_host(flat) else _ints(flat)
    return sample_keys_of(sample_view(ints, stride), flat.dtype)


def sample_keys_of(ints, dtype: torch.dtype):
    """Magnitude keys of a sample's integer views (`sample_view` of `_ints`), 1-D."""
    return _keys_of(ints.reshape(-1), dtype)


def _cuda_ops(t: torch.Tensor):
    """gradwire.cuda.ops for CUDA tensors (the kernels), else None (the reference path)."""
    if not t.is_cuda:
        return None
    from ..cuda import ops

    return ops


def _everything(flat: torch.Tensor) -> torch.Tensor:
    return torch.arange(flat.numel(), device=flat.device)


def _trivial(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    n = flat.numel()
    if k >= n:
        return _everything(flat), flat.clone()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device), flat[:0].clone()
    if n <= _SMALL:
        return _pick(flat, _everything(flat), k)
    return None


def topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending int64 indices, values) of the k largest |flat|; NaN > Inf > finite,
    ties to the lowest index. `flat` is 1-D and contiguous."""
    flat = flat.detach()
    ops = _cuda_ops(flat)
    if ops is not None and 0 < k < flat.numel():
        return ops.topk(flat, k)  # radix select: exact, no host sync
    done = _trivial(flat, k)
    if done is not None:
        return done
    skeys = _sample_keys(flat, _TOPK_STRIDE)
    key = _kth_largest(skeys, _topk_rank(skeys.shape[0], flat.numel(), k))
    return _topk_from(flat, k, skeys, _candidates(flat, key))


def _topk_rank(m: int, n: int, k: int) -> int:
    """The rank in an m-element sample whose key is topk's first threshold. Margin:
    P(fewer than k candidates) ~ 3e-5 for iid data; a miss only costs a retry."""
    expect = k * m / n
    return math.ceil(expect + 4.0 * math.sqrt(expect) + 4.0)


def _topk_from(flat: torch.Tensor, k: int, skeys, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """topk after its first scan: idx are the candidates of the first threshold."""
    m = skeys.shape[0]
    r = _topk_rank(m, flat.numel(), k)
    while True:
        if idx.numel() >= k:
            return _pick(flat, idx, k)
        if r >= m:  # even the smallest sampled magnitude was too high
            return _pick(flat, _everything(flat), k)
        r *= 4
        idx = _candidates(flat, _kth_largest(skeys, r))


def _dgc(flat: torch.Tensor, k: int, sample_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    flat = flat.detach()
    ops = _cuda_ops(flat)
    if ops is not None and 0 < k < flat.numel():
        return _dgc_cuda(ops, flat, k, sample_ratio)
    done = _trivial(flat, k)
    if done is not None:
        return done
    skeys = _sample_keys(flat, _dgc_stride(flat.numel(), sample_ratio))
    key = _dgc_first_key(skeys, flat.numel(), k)
    return _dgc_from(flat, k, key, _candidates(flat, key))


def _dgc_stride(n: int, sample_ratio: float) -> int:
    return max(1, n // max(_DGC_MIN_SAMPLE, math.ceil(sample_ratio * n)))


def _dgc_first_key(skeys, n: int, k: int) -> int:
    """DGC's threshold: the top-(k/n) key of the sample, with a margin of two sigmas."""
    expect = k * skeys.shape[0] / n
    return _kth_largest(skeys, math.ceil(expect + 2.0 * math.sqrt(expect)))


def _dgc_from(flat: torch.Tensor, k: int, key: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dgc after its first scan: idx are the candidates of the first threshold `key`."""
    dtype = flat.dtype
    for attempt in range(11):
        if attempt:
            idx = _candidates(flat, key)
        if idx.numel() >= k:  # enough (DGC's > 1.3k case included): the exact top k of them
            return _pick(flat, idx, k)
        if key <= 0:
            break
        # Too few: lower the threshold to 0.8x (DGC), at least one representable step.
        if key > _INF_KEY[dtype]:
            key = _INF_KEY[dtype]
        elif key == _INF_KEY[dtype]:
            key -= 1
        else:
            key = min(key - 1, _ceil_key(_key_value(key, dtype) * 0.8, dtype))
    return _pick(flat, _everything(flat), k)


def _dgc_cuda(ops, flat: torch.Tensor, k: int, sample_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dgc on the device: the same strided sample and rank as the CPU path, its key as the
    threshold, compaction (one host sync for the count), the exact top k of the candidates.
    Like the CPU path the result is always the exact top k (ties to the lowest index)."""
    n = flat.numel()
    if n <= _SMALL:
        return ops.topk(flat, k)
    stride = _dgc_stride(n, sample_ratio)
    rows = n // 16
    by_rows = rows >= 64 * stride
    m = -(-rows // stride) * 16 if by_rows else -(-n // stride)
    expect = k * m / n
    keys = ops.sample_keys(flat, stride, by_rows, m)
    return ops.dgc(flat, k, keys, math.ceil(expect + 2.0 * math.sqrt(expect)))


def _count_from(ratio: float, k: int | None, numel: int) -> int:
    if numel <= 0:
        return 0
    if k is not None:
        return min(numel, k)
    # ceil(ratio * numel) on the ratio's decimal spelling, so float noise
    # (0.07 * 100 == 7.000000000000001) never adds an element.
    return min(numel, max(1, math.ceil(Fraction(repr(ratio)) * numel)))


def _sentinel(flat: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 tensor: 0 when flat is all finite, NaN otherwise (one read pass)."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    lo, hi = torch.aminmax(flat)
    return (lo.float() * 0).add_(hi.float() * 0)


def _raise_if(err: torch.Tensor, message: str) -> None:
    """Raise WireFormatError when a device-side check flagged the packet: the one host read
    of a sparse decode on CUDA (the writes themselves were already bounds-checked)."""
    if int(err.item()):
        raise WireFormatError(message)


# ---- compressors ---------------------------------------------------------------------
_RATIO = Param("ratio", float, 0.01, lambda v: 0.0 < v <= 1.0, "0 < ratio <= 1")
_K = Param("k", int, None, lambda v: v >= 1, "k >= 1; overrides ratio")
_INDICES = Param("indices", str, "auto", lambda v: v in ("auto", "raw", "packed"), "auto, raw or packed")


class _Sparse(Compressor):
    role = "sparse"
    _sentinel = False  # randomk: a SENTINEL section follows VALUES

    # ---- sizes --------------------------------------------------------------------
    def value_count(self, numel: int) -> int | None:
        """Elements kept for a tensor of `numel` elements, None when data-dependent."""
        return _count_from(self.ratio, self.k, numel)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int] | None:
        k = self.value_count(numel)
        if k is None or self.indices != "raw":
            return None
        isz = torch.empty((), dtype=indexcodec.raw_dtype(numel)).element_size()
        sizes = [k * isz, k * torch.empty((), dtype=dtype).element_size()]
        return sizes + [4] if self._sentinel else sizes

    def max_section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        k = self.value_count(numel)
        k = numel if k is None else k
        index = k * torch.empty((), dtype=indexcodec.raw_dtype(numel)).element_size()
        if self.indices == "packed":  # "auto" packs only when that is smaller than raw
            index = max(index, indexcodec.max_size(k, numel))
        sizes = [index, k * torch.empty((), dtype=dtype).element_size()]
        return sizes + [4] if self._sentinel else sizes

    # ---- encode -------------------------------------------------------------------
    def _index_section(self, idx: torch.Tensor, numel: int) -> Section:
        mode = self.indices
        raw_dt = indexcodec.raw_dtype(numel)
        # auto: pack when that is smaller; below 64 indices (<= 256 raw bytes) keep raw and
        # skip the packing work (a small tensor is latency-bound, not bandwidth-bound).
        if mode == "packed" or (mode == "auto" and idx.numel() >= _PACK_MIN):
            packed = indexcodec.encode(idx, numel)
            raw_bytes = idx.numel() * torch.empty((), dtype=raw_dt).element_size()
            if mode == "packed" or wire.align(packed.numel()) < wire.align(raw_bytes):
                return Section(Kind.INDICES_PACKED, packed)
        if _on_host(idx):
            return Section(Kind.INDICES, torch.from_numpy(idx.numpy().astype(_NP_INT[raw_dt])))
        return Section(Kind.INDICES, idx.to(raw_dt))

    def _sections(self, numel: int, idx: torch.Tensor, values: torch.Tensor) -> list[Section]:
        return [self._index_section(idx, numel), Section(Kind.VALUES, values)]

    def _encode(self, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        return self._selected(flat, ctx)[0]

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        """The packet's sections and the ascending int64 indices they carry."""
        raise NotImplementedError

    def encode_sent(self, x: torch.Tensor, ctx: Ctx | None = None) -> tuple[Packet, Iterator[Piece]]:
        """One piece: the sent indices (as selected, never unpacked) and their decoded values."""
        pk, idx = self.encode_selected(x, ctx)
        return pk, self.pieces(pk, idx, pk.section(Kind.VALUES))

    #: VALUES are the input's own elements (topk, dgc, threshold; not randomk, which scales them)
    sends_input_values = True

    def encode_residual(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """Where the values are the input's own, the residual there is v - v = +0 for every
        finite v: one scatter of zeros, no gather. Every NaN/Inf is among the sent values
        (largest magnitudes / at least the threshold), so they alone decide finiteness."""
        if self.sends_input_values and out.is_cuda:
            return self._encode_residual_cuda(x, residual, out, ctx)
        if not self.sends_input_values or out.is_cuda:
            return super().encode_residual(x, residual, out, ctx)
        packet, idx = self._sum_and_select(x, residual, out, ctx)
        values = packet.section(Kind.VALUES)
        self._zero_sent(out.view(-1), idx)
        return packet, parts_finite([values.sum()], [values])

    def _sum_and_select(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None) -> tuple[Packet, torch.Tensor]:
        """out = x + residual (x when None), then `encode_selected(out)`. Where the compiled
        loops run and the selection's first scan is for a key known before out is written
        (`_scan_key`), the sum's pass writes the candidates down and that scan is skipped."""
        found = self._scan_key(x, residual) if _compiled_sum(x, residual, out) else None
        if found is None:
            if residual is None:
                out.copy_(x)
            else:
                torch.add(x, residual, out=out)
            return self.encode_selected(out, ctx)
        skeys, key = found
        n, flat = compiled.np_view, out.view(-1)
        buf = candidate_buffer(flat.numel(), self.value_count(flat.numel()) or 0)
        e = None if residual is None else n(residual.view(-1))
        count = compiled.loops().sum_at_least(n(x.detach().view(-1)), e, n(flat), key, buf)
        return self.encode_found(out, ctx, skeys, key, found_indices(buf, count, flat, key))

    def _scan_key(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[object, int] | None:
        """(the sample keys of x + residual or None, the key of the selection's first scan of
        it) when that key can be known before the sum is written; else None."""
        return None

    def encode_found(self, x: torch.Tensor, ctx: Ctx | None, skeys, key: int,
                     idx: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """`encode_selected(x, ctx)`, given what `_scan_key` gave and the candidates of key."""
        raise NotImplementedError

    def _zero_sent(self, flat: torch.Tensor, idx: torch.Tensor) -> None:
        """The residual at the sent positions: +0."""
        flat.index_fill_(0, idx, 0.0)

    def _encode_residual_cuda(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                              ctx: Ctx | None) -> tuple[Packet, torch.Tensor]:
        """out = x + residual (one pass into the spare buffer: the old state must survive a
        non-finite step), select from it, then one kernel at the k sent positions only:
        out[idx] -= values (+0 for finite values) and the finiteness flag."""
        from ..cuda import ops

        if residual is None:
            out.copy_(x)
        else:
            torch.add(x, residual, out=out)
        packet, idx = self.encode_selected(out, ctx)
        return packet, ops.ok(ops.ef_sub_sent(out.view(-1), idx, packet.section(Kind.VALUES)))

    def encode_selected(self, x: torch.Tensor, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """encode(x) and the ascending int64 indices it selected."""
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        sections, idx = self._selected(flat, ctx if ctx is not None else Ctx())
        return self._packet(x, sections), idx

    def _packet(self, x: torch.Tensor, sections: list[Section]) -> Packet:
        return Packet(self.codec_id, x.dtype, tuple(x.shape), sections, self.crc).freeze()

    def pieces(self, pk: Packet, idx: torch.Tensor, values: torch.Tensor) -> Iterator[Piece]:
        """What a packet with these indices and (decoded) VALUES decodes to, as pieces."""
        yield idx, values

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        want = 3 if self._sentinel else 2
        kinds = pk.kinds()
        if len(kinds) != want:
            raise WireFormatError(f"{self.name}: expected {want} sections, packet has "
                                  f"[{', '.join(k.name for k in kinds)}]")
        isec, vsec = pk.sections[0], pk.sections[1]
        allowed = {"raw": (Kind.INDICES,), "packed": (Kind.INDICES_PACKED,)}.get(
            self.indices, (Kind.INDICES, Kind.INDICES_PACKED))
        if isec.kind not in allowed:
            raise WireFormatError(f"{self.name}: first section is {isec.kind.name}, expected "
                                  f"{' or '.join(k.name for k in allowed)} (indices={self.indices})")
        if vsec.kind != Kind.VALUES:
            raise WireFormatError(f"{self.name}: second section is {vsec.kind.name}, expected VALUES")
        values = vsec.data
        if values.dtype != pk.dtype:
            raise WireFormatError(f"{self.name}: VALUES dtype {values.dtype} is not the tensor dtype {pk.dtype}")
        count = values.numel()
        numel = pk.numel
        k = self.value_count(numel)
        if k is not None and count != k:
            raise WireFormatError(f"{self.name}: VALUES count {count} does not match k={k} "
                                  f"for {numel} elements ({self})")
        if count > numel:
            raise WireFormatError(f"{self.name}: VALUES count {count} exceeds numel {numel}")
        if isec.kind == Kind.INDICES:
            idx = isec.data
            want_dt = indexcodec.raw_dtype(numel)
            if idx.dtype != want_dt:
                raise WireFormatError(f"{self.name}: INDICES dtype {idx.dtype}, expected {want_dt} for numel {numel}")
            if idx.numel() != count:
                raise WireFormatError(f"{self.name}: INDICES count {idx.numel()} != VALUES count {count}")
            if not idx.is_cuda:  # CUDA: checked by the decode scatter on the device (docs/cuda.md)
                self._check_indices(idx, numel)
        else:
            indexcodec.check(isec.data, count)
        if self._sentinel:
            s = pk.sections[2]
            if s.kind != Kind.SENTINEL or s.data.dtype != torch.float32 or s.data.numel() != 1:
                raise WireFormatError(f"{self.name}: third section must be a SENTINEL of one float32, got "
                                      f"{s.kind.name} {s.data.dtype} x{s.data.numel()}")

    def _check_indices(self, idx: torch.Tensor, numel: int) -> None:
        """Ascending, unique and in range (raises WireFormatError)."""
        if idx.numel() == 0:
            return
        first, last = int(idx[0]), int(idx[-1])
        if first < 0:
            raise WireFormatError(f"{self.name}: INDICES has a negative index {first}")
        if last >= numel:
            raise WireFormatError(f"{self.name}: INDICES index {last} is out of range for {numel} elements")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise WireFormatError(f"{self.name}: INDICES are not strictly ascending")

    def _indices(self, pk: Packet) -> torch.Tensor:
        isec = pk.sections[0]
        count = pk.sections[1].data.numel()
        if isec.kind == Kind.INDICES:
            return isec.data.to(torch.int64)
        idx = indexcodec.decode(isec.data, count, pk.numel)
        self._check_indices(idx, pk.numel)
        return idx

    def _received(self, pk: Packet) -> Iterator[Piece]:
        """The validated indices and their values (CUDA: the checked scatter, densely)."""
        values = pk.sections[1].data
        if values.is_cuda:
            return super()._received(pk)
        return self.pieces(pk, self._indices(pk), values)

    def _raw_or_decoded(self, pk: Packet) -> torch.Tensor:
        """CUDA: raw indices as they are (the scatter kernel checks them), packed ones decoded."""
        isec = pk.sections[0]
        return isec.data if isec.kind == Kind.INDICES else self._indices(pk)

    def _decode(self, pk: Packet) -> torch.Tensor:
        values = pk.sections[1].data
        ops = _cuda_ops(values)
        if ops is not None:
            out, err = ops.scatter_sorted(self._raw_or_decoded(pk), values, pk.numel)
            _raise_if(err, f"{self.name}: INDICES are out of range for {pk.numel} elements or not strictly ascending")
            return out
        idx = self._indices(pk)  # validated before the output exists
        out = alloc.zeros(pk.numel, pk.dtype) if values.device.type == "cpu" else \
            torch.zeros(pk.numel, dtype=pk.dtype, device=values.device)
        return out.index_copy_(0, idx, values)

    def decode(self, packet: Packet | torch.Tensor, out: torch.Tensor | None = None, *,
               shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
               max_numel: int | None = None) -> torch.Tensor:
        """On the CPU, where the values are the input's own (a plain scatter), straight into
        `out` when it can take the result as it is: zeroed, then the values scattered."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        into = alloc.direct(out, pk.numel, pk.dtype) if self.sends_input_values else None
        if into is None or pk.device.type != "cpu":
            return super().decode(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        self.check_header(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        idx = self._indices(pk)  # validated before out is touched
        into.zero_().index_copy_(0, idx, pk.sections[1].data)
        return out


class _FixedK(_Sparse):
    """A sparsifier of k elements that samples its input for a first threshold, then scans
    it for the candidates at or above it. A caller that writes the input itself (DGC
    momentum's pass) can find those candidates while writing, with no scan of its own:
    `scan_plan`, the sample's keys (`sample_view`, `sample_keys_of`) from the values about
    to be written, `first_key`, the candidates written down in the same pass (as
    `compiled` ``at_least`` does), then `encode_found`. The result is `encode_selected`'s."""

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        idx, values = self._select(flat, self.value_count(flat.numel()), ctx)
        return self._sections(flat.numel(), idx, values), idx

    def _select(self, flat: torch.Tensor, k: int, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(ascending int64 indices, their values as a new tensor)."""
        raise NotImplementedError

    def scan_plan(self, x: torch.Tensor) -> int | None:
        """The sample stride when encoding x samples and then scans it in compiled code
        (topk, dgc; float32 on the CPU, `compiled.enabled()`, k < numel, not small), else None."""
        n = x.numel()
        k = self.value_count(n)
        if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < k < n or n <= _SMALL \
                or not compiled.enabled():
            return None
        return self._stride(n)

    def _stride(self, n: int) -> int | None:
        """The sample stride of a selection that samples and scans (randomk does not)."""
        return None

    def _scan_key(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[object, int] | None:
        stride = self.scan_plan(x)
        if stride is None:
            return None
        n = compiled.np_view
        sample = sample_view(n(x.detach().view(-1)), stride)
        if residual is not None:  # float32 sums, as the pass (and torch.add) makes them
            sample = sample + sample_view(n(residual.view(-1)), stride)
        skeys = sample_keys_of(np.ascontiguousarray(sample).view(np.int32), torch.float32)
        return skeys, self.first_key(skeys, x.numel())

    def first_key(self, skeys, n: int) -> int:
        """The first threshold key, from the keys of the sample of an n-element input."""
        raise NotImplementedError

    def encode_found(self, x: torch.Tensor, ctx: Ctx | None, skeys, key: int,
                     idx: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """`encode_selected(x, ctx)`, given x's sample keys, the first key and its candidates."""
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        n = flat.numel()
        idx, values = self._select_from(flat, self.value_count(n), skeys, key, idx)
        return self._packet(x, self._sections(n, idx, values)), idx

    def _select_from(self, flat: torch.Tensor, k: int, skeys, key: int,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError


@register
class TopK(_FixedK):
    """The k largest magnitudes, exactly (NaN/Inf count as largest; ties to the lowest index).

    k = min(numel, max(1, ceil(ratio * numel))), or the `k` parameter when given.
    """

    name = "topk"
    codec_id = 6
    params = (_RATIO, _K, _INDICES)

    def _select(self, flat: torch.Tensor, k: int, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return topk(flat, k)

    def _stride(self, n: int) -> int:
        return _TOPK_STRIDE

    def first_key(self, skeys, n: int) -> int:
        return _kth_largest(skeys, _topk_rank(skeys.shape[0], n, self.value_count(n)))

    def _select_from(self, flat: torch.Tensor, k: int, skeys, key: int,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _topk_from(flat, k, skeys, idx)


@register
class DGC(_FixedK):
    """Deep Gradient Compression's selection (Lin et al., 2018), made to send exactly k.

    The threshold is the top-`ratio` magnitude of a strided `sample_ratio` sample (at
    least 1024 elements); if fewer than k elements pass it, it is lowered to 0.8x (up to
    10 times, then every element competes); the exact k largest of those that pass are
    sent (ties to the lowest index). Deterministic: the sample is strided, not random.
    `dgc` is the fast sparsifier, so its indices travel raw by default (fixed size, no
    packing pass); `indices=auto` trades ~30 ms per 25M elements for ~3 fewer bytes per index.
    """

    name = "dgc"
    codec_id = 9
    params = (_RATIO, _K, Param("sample_ratio", float, 0.01, lambda v: 0.0 < v <= 1.0, "0 < sample_ratio <= 1"),
              Param("indices", str, "raw", _INDICES.check, _INDICES.rule))

    def _select(self, flat: torch.Tensor, k: int, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return _dgc(flat, k, self.sample_ratio)

    def _stride(self, n: int) -> int:
        return _dgc_stride(n, self.sample_ratio)

    def first_key(self, skeys, n: int) -> int:
        return _dgc_first_key(skeys, n, self.value_count(n))

    def _select_from(self, flat: torch.Tensor, k: int, skeys, key: int,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return _dgc_from(flat, k, key, idx)


@register
class Threshold(_Sparse):
    """Every element with |x| >= threshold (NaN too); the count varies with the data."""

    name = "threshold"
    codec_id = 8
    params = (Param("threshold", float, 1e-3, lambda v: v > 0.0, "threshold > 0"), _INDICES)

    def value_count(self, numel: int) -> int | None:
        return None

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        ops = _cuda_ops(flat)
        if ops is not None and flat.numel():
            idx, vals = ops.at_least(flat, _ceil_key(self.threshold, flat.dtype))  # one host sync: the count
            return self._sections(flat.numel(), idx, vals), idx
        idx = _candidates(flat, _ceil_key(self.threshold, flat.dtype))
        return self._sections(flat.numel(), idx, _gather(flat, idx)), idx

    def _scan_key(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[object, int] | None:
        return None, _ceil_key(self.threshold, torch.float32)

    def encode_found(self, x: torch.Tensor, ctx: Ctx | None, skeys, key: int,
                     idx: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        return self._packet(x, self._sections(flat.numel(), idx, _gather(flat, idx))), idx

    def _zero_sent(self, flat: torch.Tensor, idx: torch.Tensor) -> None:
        """Under error feedback the count follows the residual and can pass half the tensor;
        above 1/16 of it, one compiled pass zeroing the elements that pass the threshold
        (the same test as `_candidates`) costs less than a scatter to each."""
        if idx.numel() * 16 > flat.numel() and flat.dtype == torch.float32 and compiled.enabled():
            compiled.loops().zero_at_least(compiled.np_view(flat.view(torch.int32)),
                                           _ceil_key(self.threshold, flat.dtype))
        else:
            flat.index_fill_(0, idx, 0.0)


@register
class RandomK(_FixedK):
    """k random elements, one per stratum, scaled by the stratum length (unbiased).

    The tensor is cut into k strata ``[floor(i*n/k), floor((i+1)*n/k))``; stratum i sends
    one uniformly chosen element, decoded as ``value * len_i``, so E[decode] = x. The
    choice is a function of the 64-bit stream key of (seed, step, key) -- not of the rank,
    so every rank picks the same elements and payloads are summable. No indices travel:
    the packet's META holds that key and the receiver draws the positions again (a forged
    key can only move each value within its own stratum). VALUES hold the unscaled
    elements; the SENTINEL is 0, or NaN when the input held NaN/Inf, and is added (times 0)
    to the whole decoded tensor so an overflow is never hidden by sampling.
    """

    name = "randomk"
    codec_id = 7
    params = (_RATIO, _K)  # no `indices`: there are none on the wire
    stochastic = True
    summable = True
    feedback_helps = False  # scaled to be unbiased: residuals would grow, not shrink
    _sentinel = True
    sends_input_values = False  # scaled by the stratum length on decode

    # ---- the draw ------------------------------------------------------------------
    @staticmethod
    def _strata(numel: int, k: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, length) of each of the k strata, int64."""
        if k == 0:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return empty, empty
        q, r = divmod(numel, k)
        if torch.device(device).type == "cpu":  # NumPy divides by a scalar with libdivide: ~3x torch
            edges = np.arange(k + 1, dtype=np.int64)
            if r:
                extra = edges * r
                extra //= k
                edges *= q
                edges += extra
            else:
                edges *= q
            return torch.from_numpy(edges[:-1]), torch.from_numpy(np.diff(edges))
        i = torch.arange(k + 1, dtype=torch.int64, device=device)
        edges = i * q + (i * r) // k
        return edges[:-1], edges[1:] - edges[:-1]

    @staticmethod
    def _long(numel: int, k: int) -> bool:
        """Strata of 2**24 elements or more draw 48 bits (two 24-bit draws) instead of 24."""
        return k > 0 and -(-numel // k) >= 1 << 24

    def _key(self, ctx: Ctx) -> tuple[int, int]:
        return rng.stream_key(ctx.seed, ctx.step, 0, ctx.key, stream=self.codec_id)  # rank-free: summable

    def _draw(self, numel: int, k: int, key: tuple[int, int],
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the k drawn positions, ascending int64; the strata lengths): `rng.randbelow` of
        each length (floor(u24 * len / 2**24)), or floor(u48 * len / 2**48) from two 24-bit
        draws when strata reach 2**24 elements. The same integers as the CUDA kernels."""
        start, length = self._strata(numel, k, device)
        if k == 0:
            return start, length
        if not self._long(numel, k):
            off = rng.randbelow(key, length)
        else:
            hi = rng.bits24(key, k, device).to(torch.int64)
            lo = rng.bits24(key, k, device, start=k).to(torch.int64)
            off = hi.mul_(length).add_(lo.mul_(length).bitwise_right_shift_(24)).bitwise_right_shift_(24)
        return off.add_(start), length

    def _sample(self, numel: int, k: int, ctx: Ctx, device: torch.device | str) -> torch.Tensor:
        return self._draw(numel, k, self._key(ctx), device)[0]

    # ---- sizes and sections --------------------------------------------------------
    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        """META (the int64 stream key), VALUES[k], SENTINEL (one float32): always known."""
        return [8, self.value_count(numel) * torch.empty((), dtype=dtype).element_size(), 4]

    def max_section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return self._section_sizes(numel, dtype)

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        numel = flat.numel()
        k = self.value_count(numel)
        key = self._key(ctx)
        ops = _cuda_ops(flat)
        if ops is not None and k:
            idx, values = ops.randomk(flat, k, key, self._long(numel, k))
        else:
            idx = self._draw(numel, k, key, flat.device)[0]
            values = _gather(flat, idx)
        sentinel = ops.sentinel(flat) if ops is not None else _sentinel(flat).reshape(1)
        return [Section(Kind.META, _key_section(key, flat.device)), Section(Kind.VALUES, values),
                Section(Kind.SENTINEL, sentinel)], idx

    def pieces(self, pk: Packet, idx: torch.Tensor, values: torch.Tensor) -> Iterator[Piece]:
        """Values scaled by their stratum length, as `_scatter` does; an overflow sentinel
        makes every element NaN (on the CPU a piece only then; on a GPU always, times 0)."""
        numel, k = pk.numel, idx.numel()
        if k:
            _, length = self._strata(numel, k, values.device)
            yield idx, (values.to(torch.float32) * length).to(pk.dtype)
        nonfinite = pk.sections[2].data[0]
        if nonfinite.is_cuda or not bool(torch.isfinite(nonfinite)):
            yield slice(0, numel), (nonfinite.float() * 0).to(pk.dtype).expand(numel)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        kinds = pk.kinds()
        if kinds != [Kind.META, Kind.VALUES, Kind.SENTINEL]:
            raise WireFormatError(f"{self.name}: expected sections [META, VALUES, SENTINEL] (no indices: the "
                                  f"key in META draws them), packet has [{', '.join(k.name for k in kinds)}]")
        meta, values, sentinel = (s.data for s in pk.sections)
        if meta.dtype != torch.int64 or meta.numel() != 1:
            raise WireFormatError(f"{self.name}: META must be one int64 (the stream key), got "
                                  f"{meta.dtype} x{meta.numel()}")
        if values.dtype != pk.dtype:
            raise WireFormatError(f"{self.name}: VALUES dtype {values.dtype} is not the tensor dtype {pk.dtype}")
        k = self.value_count(pk.numel)
        if values.numel() != k:
            raise WireFormatError(f"{self.name}: VALUES count {values.numel()} does not match k={k} "
                                  f"for {pk.numel} elements ({self})")
        if sentinel.dtype != torch.float32 or sentinel.numel() != 1:
            raise WireFormatError(f"{self.name}: SENTINEL must be one float32, got "
                                  f"{sentinel.dtype} x{sentinel.numel()}")

    def _indices(self, pk: Packet) -> torch.Tensor:
        """The positions of a checked packet's values, drawn again from its key."""
        meta, values = pk.sections[0].data, pk.sections[1].data
        return self._draw(pk.numel, values.numel(), _key_of(int(meta[0])), values.device)[0]

    def _scatter(self, idx: torch.Tensor, values: torch.Tensor, numel: int, dtype: torch.dtype,
                 nonfinite: torch.Tensor) -> torch.Tensor:
        k = idx.numel()
        out = alloc.zeros(numel, dtype) if values.device.type == "cpu" else torch.zeros(numel, dtype=dtype, device=values.device)  # huge pages: 512x fewer faults
        if k:
            _, length = self._strata(numel, k, values.device)
            out.index_copy_(0, idx, (values.to(torch.float32) * length).to(dtype))
        # 0 * sentinel: NaN everywhere when any rank's input held NaN/Inf.
        if nonfinite.is_cuda or not bool(torch.isfinite(nonfinite).all()):
            out.add_((nonfinite.float() * 0).to(dtype))
        return out

    def _decode(self, pk: Packet) -> torch.Tensor:
        meta, values, sentinel = (s.data for s in pk.sections)
        ops = _cuda_ops(values)
        if ops is not None:
            return ops.scatter_randomk(meta, values, pk.numel, sentinel, self._long(pk.numel, values.numel()))
        return self._scatter(self._indices(pk), values, pk.numel, pk.dtype, sentinel[0])

    # ---- summable --------------------------------------------------------------------
    def to_summable(self, x: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        """The k sampled (unscaled) elements; all NaN when x held NaN/Inf."""
        ctx = ctx if ctx is not None else Ctx()
        flat = x.detach().reshape(-1)
        k = self.value_count(flat.numel())
        vals = torch.index_select(flat, 0, self._sample(flat.numel(), k, ctx, flat.device))
        return vals.add_(_sentinel(flat).to(vals.dtype))

    def from_summable(self, payload: torch.Tensor, like: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        ctx = ctx if ctx is not None else Ctx()
        numel = like.numel()
        k = self.value_count(numel)
        if payload.dim() != 1 or payload.numel() != k:
            raise ValueError(f"{self.name}: summable payload has shape {tuple(payload.shape)}, expected ({k},)")
        idx = self._sample(numel, k, ctx, payload.device)
        return self._scatter(idx, payload, numel, like.dtype, _sentinel(payload)).reshape(like.shape)


def _key_section(key: tuple[int, int], device: torch.device) -> torch.Tensor:
    """randomk's META: the stream key (k0 + 2**32 * k1) as one int64, on `device`
    (a CUDA copy from pinned memory, asynchronous: an encode that never syncs)."""
    w = key[0] | key[1] << 32
    word = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w], dtype=torch.int64)
    if device.type == "cpu":
        return word
    out = torch.empty(1, dtype=torch.int64, device=device)
    wire.copy_host_bytes(out.view(torch.uint8), word.numpy().tobytes())
    return out


def _key_of(word: int) -> tuple[int, int]:
    """The two 32-bit words of a META key (as `rng.stream_key` returns them)."""
    word &= (1 << 64) - 1
    return word & 0xFFFFFFFF, word >> 32
