"""The device index encoder (`indexcodec.encode_torch`, used for CUDA tensors) against the
NumPy reference, run here on CPU tensors: same bytes, same decoded indices."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from gradwire.compress import indexcodec


def _indices(kind: str, n: int, m: int, seed: int) -> np.ndarray:
    g = np.random.default_rng(seed)
    if kind == "uniform":
        return np.sort(g.choice(n, min(m, n), replace=False))
    if kind == "strided":
        return np.arange(min(m, n)) * (n // min(m, n))
    if kind == "clusters":  # dense runs far apart: Exp-Golomb blocks
        c = np.sort(g.choice(n, max(1, m // 50), replace=False))
        return np.unique(np.clip((c[:, None] + np.arange(50)).ravel(), 0, n - 1))
    return np.unique(np.concatenate([np.arange(min(m, n)), [n - 1]]))  # dense then one far index


@pytest.mark.parametrize("kind", ["uniform", "strided", "clusters", "dense"])
@pytest.mark.parametrize("n,m", [(1, 1), (1000, 7), (100_000, 129), (3_000_000, 30_000), (2**33, 5000)])
def test_same_bytes_as_numpy(kind, n, m):
    if n > 10**8 and kind in ("uniform", "dense"):
        idx = np.unique(np.random.default_rng(m).integers(0, n, m))
    else:
        idx = _indices(kind, n, m, seed=m)
    t = torch.from_numpy(idx.astype(np.int64))
    got = indexcodec.encode_torch(t, n)
    assert torch.equal(got, indexcodec.encode(t, n))
    assert torch.equal(indexcodec.decode(got, t.numel(), n), t)


def test_huge_gaps():
    t = torch.tensor([0, 1, 2**40, 2**40 + 5, 2**45 - 1], dtype=torch.int64)
    assert torch.equal(indexcodec.encode_torch(t, 2**45), indexcodec.encode(t, 2**45))


def test_empty():
    assert indexcodec.encode_torch(torch.empty(0, dtype=torch.int64)).numel() == 0
