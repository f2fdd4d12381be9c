"""Fresh zeroed CPU tensors on huge pages (gradwire.compress.hostmem)."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from gradwire.compress import hostmem

THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.int64])
@pytest.mark.parametrize("numel", [0, 1, 1000, (hostmem.MIN_BYTES // 2) + 3, 3 * hostmem.MIN_BYTES // 2 + 1])
def test_zeros_are_zeros(numel: int, dtype: torch.dtype) -> None:
    # memory that held something else first: a reused block must still come back zeroed
    junk = torch.full((numel,), 7, dtype=dtype)
    del junk
    t = hostmem.zeros(numel, dtype)
    assert t.shape == (numel,) and t.dtype == dtype and t.device.type == "cpu" and t.is_contiguous()
    assert not bool(t.any())
    t += 1  # an ordinary, writable tensor
    assert bool((t == 1).all())


@pytest.mark.skipif(not THP.exists() or "[never]" in THP.read_text(), reason="no transparent huge pages")
def test_large_tensors_get_the_advice() -> None:
    t = torch.empty(hostmem.MIN_BYTES // 4, dtype=torch.float32)
    assert hostmem.advise_huge(t)
    assert not hostmem.advise_huge(torch.empty(100))  # no whole 2 MiB page inside: nothing to advise
