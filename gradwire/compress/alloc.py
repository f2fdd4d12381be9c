"""Where a CPU decode writes: the caller's `out` as it is, else a fresh tensor on huge pages.

A fresh 100 MB tensor costs ~25k page faults the first time it is written (more time than
decoding into it). Where the kernel offers transparent huge pages
(``/sys/kernel/mm/transparent_hugepage/enabled`` is ``always`` or ``madvise``), fresh
outputs of at least `MIN_BYTES` are an anonymous mapping advised ``MADV_HUGEPAGE``: 2 MiB
pages, 512x fewer faults (the kernel zero-fills them). The tensor owns its mapping, which
is unmapped with it; unlike torch's allocations its storage cannot be resized. Set
`ENABLED = False` for torch's allocator everywhere.
"""

from __future__ import annotations

import mmap

import torch

ENABLED = True
MIN_BYTES = 8 << 20
_THP: bool | None = None


def _thp() -> bool:
    global _THP
    if _THP is None:
        try:
            with open("/sys/kernel/mm/transparent_hugepage/enabled") as f:
                mode = f.read()
        except OSError:
            mode = ""
        _THP = hasattr(mmap, "MADV_HUGEPAGE") and ("[always]" in mode or "[madvise]" in mode)
    return _THP


def _mapped(numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    nbytes = numel * dtype.itemsize
    if not (ENABLED and nbytes >= MIN_BYTES and _thp()):
        return None
    mm = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    mm.madvise(mmap.MADV_HUGEPAGE)
    return torch.frombuffer(mm, dtype=dtype, count=numel)  # the tensor keeps mm alive


def empty(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh 1-D CPU tensor (contents undefined)."""
    t = _mapped(numel, dtype)
    return t if t is not None else torch.empty(numel, dtype=dtype)


def zeros(numel: int, dtype: torch.dtype) -> torch.Tensor:
    """A fresh zeroed 1-D CPU tensor (a new anonymous mapping is zero already)."""
    t = _mapped(numel, dtype)
    return t if t is not None else torch.zeros(numel, dtype=dtype)


def direct(out: torch.Tensor | None, numel: int, dtype: torch.dtype) -> torch.Tensor | None:
    """out as a flat view when a CPU decode of numel dtype elements can write into it as
    it is (contiguous, same dtype and size), else None (then decode fresh and copy)."""
    if out is None or out.device.type != "cpu" or out.dtype != dtype or out.numel() != numel \
            or not out.is_contiguous():
        return None
    return out.view(-1)
