"""Finding the largest magnitudes fast: the selection engine under topk, dgc and threshold,
DGC momentum's pass (`feedback.py`) and the `oktopk` strategy (`topk`).

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

Kernels: gradwire/cuda/kernels/select.cu (`ops.topk`: radix select; `ops.at_least`,
`ops.sample_keys`). Compiled CPU loops: gradwire/compress/compiled.py (`at_least`,
`sum_at_least`, `dgc_inplace_at_least`). Tests: tests/compress/test_sparse.py,
tests/compress/test_compiled.py, tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import math
import threading
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import torch

from . import compiled

# ---- magnitude keys -------------------------------------------------------------------
_INT_VIEW = {torch.float32: torch.int32, torch.float16: torch.int16, torch.bfloat16: torch.int16}
_MAG_MASK = {torch.float32: 0x7FFFFFFF, torch.float16: 0x7FFF, torch.bfloat16: 0x7FFF}
INF_KEY = {torch.float32: 0x7F800000, torch.float16: 0x7C00, torch.bfloat16: 0x7F80}
_NP_UINT = {np.dtype(np.int32): np.uint32, np.dtype(np.int16): np.uint16}
_SIGN = {torch.float32: 1 << 31, torch.float16: 1 << 15, torch.bfloat16: 1 << 15}
_ONES8 = 0x0101010101010101  # one True byte in each lane of an int64 word of bools
SMALL = 1 << 15  # below this many elements, select exactly among all of them
TOPK_STRIDE = 97  # prime stride: a >= 1% sample that no small period aliases with


def keys_of(ints, dtype: torch.dtype):
    """Magnitude keys (int32) of the integer views of some elements (a tensor, or a NumPy
    array on the host path); NaN -> Inf + 1."""
    if isinstance(ints, np.ndarray):
        keys = (ints & _MAG_MASK[dtype]).astype(np.int32, copy=False)
        return np.minimum(keys, INF_KEY[dtype] + 1, out=keys)
    keys = torch.bitwise_and(ints, _MAG_MASK[dtype])
    if keys.dtype != torch.int32:
        keys = keys.to(torch.int32)
    return keys.clamp_(max=INF_KEY[dtype] + 1)


def key_value(key: int, dtype: torch.dtype) -> float:
    """The (non-negative) value whose magnitude key is `key`."""
    return float(torch.tensor([key], dtype=_INT_VIEW[dtype]).view(dtype)[0])


def ceil_key(t: float, dtype: torch.dtype) -> int:
    """Smallest key whose value is >= t (t > 0): |x| >= t  <=>  key(x) >= this (NaN aside)."""
    v = torch.tensor([t], dtype=torch.float64).to(dtype)
    key = int(v.view(_INT_VIEW[dtype])[0]) & _MAG_MASK[dtype]
    return key + 1 if float(v[0]) < t else key


# ---- per-thread scratch -----------------------------------------------------------------
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


# ---- candidates: every element at or above a key ----------------------------------------
def on_host(t: torch.Tensor) -> bool:
    """CPU tensors take the NumPy path (see the module docstring)."""
    return t.device.type == "cpu"


def _ints(flat: torch.Tensor) -> torch.Tensor:
    return flat.view(_INT_VIEW[flat.dtype])


def candidates(flat: torch.Tensor, key: int) -> torch.Tensor:
    """Ascending int64 indices of the elements whose magnitude key is >= key (NaN included)."""
    n = flat.numel()
    if key <= 0:
        return torch.arange(n, device=flat.device)
    if on_host(flat) and flat.dtype == torch.float32 and compiled.enabled():
        return _candidates_compiled(flat, key)
    if on_host(flat):
        return _candidates_numpy(flat, key)
    return _candidates_torch(flat, key)


def _candidates_compiled(flat: torch.Tensor, key: int) -> torch.Tensor:
    """One compiled loop (`compiled` ``at_least``) into this thread's index buffer."""
    out = candidate_buffer(flat.numel())
    return found_indices(out, compiled.loops().at_least(_ints(flat).numpy(), key, out), flat, key)


def _candidates_numpy(flat: torch.Tensor, key: int) -> torch.Tensor:
    """NumPy compares on views of the tensor's memory, in parallel parts."""
    n = flat.numel()
    nw = -(-n // 8)
    hit, other = _masks(nw * 8, flat.device)
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


def _candidates_torch(flat: torch.Tensor, key: int) -> torch.Tensor:
    """The same scan in torch ops (other devices), through int64 views of the masks."""
    n = flat.numel()
    nw = -(-n // 8)
    hit, other = _masks(nw * 8, flat.device)
    if flat.dtype == torch.float32 and key <= INF_KEY[torch.float32]:
        # Two compares straight from the input (no 4-byte temporary): an element is *not* a
        # candidate iff x < t and x > -t; NaN fails both, so it is one.
        t = key_value(key, flat.dtype)
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


# ---- the exact k among candidates ---------------------------------------------------------
def kth_largest(keys, r: int) -> int:
    """The r-th largest entry of keys (a tensor or a NumPy array), r clamped to [1, len]."""
    m = keys.shape[0]
    r = max(1, min(r, m))
    if isinstance(keys, np.ndarray):
        return int(np.partition(keys, m - r)[m - r])
    return int(torch.kthvalue(keys, m - r + 1).values)


def _top_mask(keys, k: int):
    """Mask of the k largest of `keys` (in index order), ties to the lowest; None: all of them."""
    c = keys.shape[0]
    if c <= k:
        return None
    v = kth_largest(keys, k)
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


def gather(flat: torch.Tensor, idx: torch.Tensor) -> torch.Tensor:
    """flat[idx] as a new tensor."""
    if on_host(flat):
        return torch.from_numpy(_ints(flat).numpy()[idx.numpy()]).view(flat.dtype)
    return torch.index_select(flat, 0, idx)


def pick(flat: torch.Tensor, idx: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The exact top k among candidate indices: (ascending indices, their values)."""
    if on_host(flat):
        ix = idx.numpy()
        vals = _ints(flat).numpy()[ix]
        keep = _top_mask(keys_of(vals, flat.dtype), k)
        if keep is not None:
            ix, vals = ix[keep], vals[keep]
        return torch.from_numpy(ix), torch.from_numpy(vals).view(flat.dtype)
    vals = torch.index_select(flat, 0, idx)
    keep = _top_mask(keys_of(vals.view(_INT_VIEW[flat.dtype]), flat.dtype), k)
    if keep is None:
        return idx, vals
    return torch.masked_select(idx, keep), torch.masked_select(vals, keep)


def all_indices(flat: torch.Tensor) -> torch.Tensor:
    """Every index of flat: the candidates of the last resort."""
    return torch.arange(flat.numel(), device=flat.device)


def without_sample(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The selection when it needs no sample (k >= numel, k <= 0, or a small tensor), else None."""
    n = flat.numel()
    if k >= n:
        return all_indices(flat), flat.clone()
    if k <= 0:
        return torch.empty(0, dtype=torch.int64, device=flat.device), flat[:0].clone()
    if n <= SMALL:
        return pick(flat, all_indices(flat), k)
    return None


# ---- sampled thresholds -----------------------------------------------------------------
def sample_view(a, stride: int):
    """The sampled elements of a 1-D array or tensor, as a view: every stride-th run of 16
    elements (one 64-byte line of fp32), so a 1% sample reads 1% of the memory instead of
    one line per sampled element; every stride-th element when that gives too few rows."""
    rows = a.shape[0] // 16
    if rows >= 64 * stride:
        return a[: rows * 16].reshape(rows, 16)[::stride]
    return a[::stride]


def sample_keys(flat: torch.Tensor, stride: int):
    """Magnitude keys of flat's sample (`sample_view`), 1-D."""
    ints = _ints(flat).numpy() if on_host(flat) else _ints(flat)
    return sample_keys_of(sample_view(ints, stride), flat.dtype)


def sample_keys_of(ints, dtype: torch.dtype):
    """Magnitude keys of a sample's integer views (`sample_view` of `_ints`), 1-D."""
    return keys_of(ints.reshape(-1), dtype)


# ---- exact top-k ------------------------------------------------------------------------
def cuda_ops(t: torch.Tensor):
    """gradwire.cuda.ops for CUDA tensors (the kernels), else None (the reference path)."""
    if not t.is_cuda:
        return None
    # imported on the first CUDA tensor: a CPU-only process never loads the CUDA layer
    # (its kernel loader and launcher, CuPy behind them); not an import circle
    from ..cuda import ops

    return ops


def topk(flat: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending int64 indices, values) of the k largest |flat|; NaN > Inf > finite,
    ties to the lowest index. `flat` is 1-D and contiguous."""
    flat = flat.detach()
    ops = cuda_ops(flat)
    if ops is not None and 0 < k < flat.numel():
        return ops.topk(flat, k)  # radix select: exact, no host sync
    done = without_sample(flat, k)
    if done is not None:
        return done
    skeys = sample_keys(flat, TOPK_STRIDE)
    key = kth_largest(skeys, topk_rank(skeys.shape[0], flat.numel(), k))
    return topk_from(flat, k, skeys, candidates(flat, key))


def chunked_topk(flat: torch.Tensor, chunk: int, k_full: int, k_last: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending int64 indices, values): each run of `chunk` consecutive elements keeps its own
    `k_full` largest |flat| (the shorter last run: `k_last`), NaN > Inf > finite, ties to the
    lowest index. SparseLoCo's selection: every part of the tensor is represented, and one
    stable sort per chunk is the same torch op on every device, so CPU and CUDA pick alike."""
    flat = flat.detach()
    n = flat.numel()
    full = n // chunk
    parts = []
    if full:
        keys = flat[: full * chunk].view(full, chunk).abs()
        order = torch.sort(keys, dim=1, descending=True, stable=True).indices[:, :k_full]
        starts = torch.arange(0, full * chunk, chunk, device=flat.device).unsqueeze(1)
        parts.append((order.sort(dim=1).values + starts).reshape(-1))
    if n > full * chunk:
        keys = flat[full * chunk:].abs()
        order = torch.sort(keys, descending=True, stable=True).indices[:k_last]
        parts.append(order.sort().values + full * chunk)
    idx = torch.cat(parts) if parts else torch.empty(0, dtype=torch.int64, device=flat.device)
    return idx, flat[idx]


def topk_rank(m: int, n: int, k: int) -> int:
    """The rank in an m-element sample whose key is topk's first threshold. Margin:
    P(fewer than k candidates) ~ 3e-5 for iid data; a miss only costs a retry."""
    expect = k * m / n
    return math.ceil(expect + 4.0 * math.sqrt(expect) + 4.0)


def topk_from(flat: torch.Tensor, k: int, skeys, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """topk after its first scan: idx are the candidates of the first threshold."""
    m = skeys.shape[0]
    r = topk_rank(m, flat.numel(), k)
    while True:
        if idx.numel() >= k:
            return pick(flat, idx, k)
        if r >= m:  # even the smallest sampled magnitude was too high
            return pick(flat, all_indices(flat), k)
        r *= 4
        idx = candidates(flat, kth_largest(skeys, r))
