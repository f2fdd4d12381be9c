"""`dgc` (codec id 9): Deep Gradient Compression's selection (Lin et al., 2018), made to
send exactly k.

DGC picks a threshold from a small sample instead of sorting, and lowers it when too few
elements pass; here the k largest of those that pass are then sent, so the count is
fixed and the result is the exact top k (ties to the lowest index), like `topk`'s.

Kernels: gradwire/cuda/kernels/select.cu (`ops.sample_keys`, `ops.dgc`; `ops.topk` for
small tensors). Compiled CPU loops: gradwire/compress/compiled.py (`at_least`,
`sum_at_least`, `dgc_inplace_at_least`). Candidates: gradwire/compress/select.py.
Tests: tests/compress/test_sparse.py, tests/compress/test_feedback.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import math

import torch

from .. import select
from ..base import Ctx, Param
from ..registry import register
from .base import _INDICES, _K, _RATIO, _FixedK

_DGC_MIN_SAMPLE = 1024


@register
class DGC(_FixedK):
    """Deep Gradient Compression's selection (Lin et al., 2018), made to send exactly k.

    The threshold is the top-`ratio` magnitude of a strided `sample_ratio` sample (at
    least 1024 elements); if fewer than k elements pass it, it is lowered to 0.8x (up to
    10 times, then every element competes); the exact k largest of those that pass are
    sent (ties to the lowest index). Deterministic: the sample is strided, not random.
    `dgc` is the fast sparsifier, so its indices travel raw by default (fixed size, no
    packing pass); `indices=auto` trades a packing pass for ~3 fewer bytes per index.
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


def _dgc(flat: torch.Tensor, k: int, sample_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """(ascending int64 indices, values) of DGC's selection of k elements of flat."""
    flat = flat.detach()
    ops = select.cuda_ops(flat)
    if ops is not None and 0 < k < flat.numel():
        return _dgc_cuda(ops, flat, k, sample_ratio)
    done = select.without_sample(flat, k)
    if done is not None:
        return done
    skeys = select.sample_keys(flat, _dgc_stride(flat.numel(), sample_ratio))
    key = _dgc_first_key(skeys, flat.numel(), k)
    return _dgc_from(flat, k, key, select.candidates(flat, key))


def _dgc_stride(n: int, sample_ratio: float) -> int:
    return max(1, n // max(_DGC_MIN_SAMPLE, math.ceil(sample_ratio * n)))


def _dgc_first_key(skeys, n: int, k: int) -> int:
    """DGC's threshold: the top-(k/n) key of the sample, with a margin of two sigmas."""
    expect = k * skeys.shape[0] / n
    return select.kth_largest(skeys, math.ceil(expect + 2.0 * math.sqrt(expect)))


def _dgc_from(flat: torch.Tensor, k: int, key: int, idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """dgc after its first scan: idx are the candidates of the first threshold `key`."""
    dtype = flat.dtype
    inf_key = select.INF_KEY[dtype]
    for attempt in range(11):
        if attempt:
            idx = select.candidates(flat, key)
        if idx.numel() >= k:  # enough (DGC's > 1.3k case included): the exact top k of them
            return select.pick(flat, idx, k)
        if key <= 0:
            break
        # Too few: lower the threshold to 0.8x (DGC), at least one representable step.
        if key > inf_key:
            key = inf_key
        elif key == inf_key:
            key -= 1
        else:
            key = min(key - 1, select.ceil_key(select.key_value(key, dtype) * 0.8, dtype))
    return select.pick(flat, select.all_indices(flat), k)


def _dgc_cuda(ops, flat: torch.Tensor, k: int, sample_ratio: float) -> tuple[torch.Tensor, torch.Tensor]:
    """dgc on the device: the same strided sample and rank as the CPU path, its key as the
    threshold, compaction (one host sync for the count), the exact top k of the candidates.
    Like the CPU path the result is always the exact top k (ties to the lowest index)."""
    n = flat.numel()
    if n <= select.SMALL:
        return ops.topk(flat, k)
    stride = _dgc_stride(n, sample_ratio)
    rows = n // 16
    by_rows = rows >= 64 * stride
    m = -(-rows // stride) * 16 if by_rows else -(-n // stride)
    expect = k * m / n
    keys = ops.sample_keys(flat, stride, by_rows, m)
    return ops.dgc(flat, k, keys, math.ceil(expect + 2.0 * math.sqrt(expect)))
