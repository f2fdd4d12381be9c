"""Fresh zeroed CPU tensors whose pages are faulted in 2 MiB at a time.

A fresh 100 MB tensor takes ~25,000 page faults of 4 KiB on first touch: 30-60 ms on the
2-core test VM, several times the work of a sparse decode that writes 1% of it. Asking the
kernel for transparent huge pages on the allocation (``madvise(MADV_HUGEPAGE)``, honoured
where /sys/kernel/mm/transparent_hugepage/enabled is ``madvise`` or ``always``) makes that
50 faults, and zeroing it runs at memory speed (~5 ms). Advice is best effort: elsewhere
(not Linux, THP off, a failed call) the tensor is the same, with 4 KiB pages.
"""

from __future__ import annotations

import ctypes
import functools
import sys
from typing import Callable

import torch

_HUGE = 2 << 20  # x86-64 / arm64 (4 KiB base pages) THP size
MIN_BYTES = 8 << 20  # below this the faults cost little and small tensors may come from the heap
_MADV_HUGEPAGE = 14  # <asm-generic/mman-common.h>


@functools.lru_cache(maxsize=None)
def _madvise() -> Callable[[int, int, int], int] | None:
    """libc's madvise, or None where there is none to call."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        fn = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    fn.restype = ctypes.c_int
    return fn


def advise_huge(t: torch.Tensor) -> bool:
    """Ask for huge pages on the 2 MiB-aligned interior of t's memory (before it is touched);
    True when the kernel accepted the advice."""
    advise = _madvise()
    if advise is None or t.device.type != "cpu":
        return False
    begin = t.data_ptr()
    start = -(-begin // _HUGE) * _HUGE
    end = (begin + t.numel() * t.element_size()) // _HUGE * _HUGE
    return end > start and advise(start, end - start, _MADV_HUGEPAGE) == 0


def zeros(numel: int, dtype: torch.dtype, device: torch.device | str = "cpu") -> torch.Tensor:
    """torch.zeros(numel, dtype, device), backed by huge pages when on the CPU and large."""
    if torch.device(device).type != "cpu" or numel * torch.empty((), dtype=dtype).element_size() < MIN_BYTES:
        return torch.zeros(numel, dtype=dtype, device=device)
    t = torch.empty(numel, dtype=dtype)
    advise_huge(t)
    return t.zero_()  # the memory may be reused, not fresh from the kernel: always written
