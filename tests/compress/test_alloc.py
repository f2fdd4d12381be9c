"""Fresh CPU decode outputs on huge pages (gradwire.compress.alloc)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradwire.compress import alloc

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 1000, (alloc.MIN_BYTES // 2) + 3, 3 * alloc.MIN_BYTES // 2 + 1])
def test_zeros_are_zeros(numel: int, dtype: torch.dtype) -> None:
    # memory that held something else first: a reused block must still come back zeroed
    junk = torch.full((numel,), 7, dtype=dtype)
    del junk
    t = alloc.zeros(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert not bool(t.any())
    t += 1  # an ordinary, writable tensor
    assert bool((t == 1).all())


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_large_outputs_are_their_own_huge_page_mappings() -> None:
    t = alloc.zeros(alloc.MIN_BYTES // 4, torch.float32)
    small = alloc.zeros(100, torch.float32)
    # a mapping of its own: the tensor's storage is not resizable, torch's allocations are
    with pytest.raises(RuntimeError):
        t.untyped_storage().resize_(0)
    small.untyped_storage().resize_(0)
    alloc.ENABLED = False
    try:
        alloc.zeros(alloc.MIN_BYTES // 4, torch.float32).untyped_storage().resize_(0)  # torch's allocator
    finally:
        alloc.ENABLED = True
