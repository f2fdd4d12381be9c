"""Device buffers electric-fence style: each kernel argument's bytes are copied into their own
mapping, flush against a no-access page (and with one before), for the duration of a launch.

A read or write past the end faults at once (the fault becomes "illegal address at
block/thread"); the few alignment bytes between the data and the guard page, and the
bytes before the data, are filled with a canary and checked after the launch, so a
write there is reported too. Arguments whose bytes overlap share one mapping, so aliasing
behaves as on the device. The alignment of each pointer modulo 16 is kept.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap

import torch

PAGE = mmap.PAGESIZE
_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
_PROT_NONE, _PROT_RW = 0, 3
_MAP_PRIVATE_ANON = 0x02 | 0x20


class Region:
    """One fenced mapping holding the bytes [lo, hi) of host memory."""

    def __init__(self, lo: int, hi: int, canary: int):
        self.lo, self.hi, self.canary = lo, hi, canary
        n = hi - lo
        self.data_pages = -(-(n + 16 + 1) // PAGE)
        self.size = (self.data_pages + 2) * PAGE
        base = _libc.mmap(None, self.size, _PROT_RW, _MAP_PRIVATE_ANON, -1, 0)
        if base in (None, ctypes.c_void_p(-1).value):
            raise MemoryError("emulator: mmap failed")
        self.base = base
        _libc.mprotect(base, PAGE, _PROT_NONE)
        self.fence = base + (self.data_pages + 1) * PAGE  # first byte of the trailing guard page
        _libc.mprotect(self.fence, PAGE, _PROT_NONE)
        addr = self.fence - n
        addr -= (addr - lo) % 16  # same alignment as the original pointer, modulo 16
        self.addr = addr
        self.first = base + PAGE  # first data-page byte
        ctypes.memset(self.first, canary, self.fence - self.first)
        ctypes.memmove(addr, lo, n)

    def translate(self, ptr: int) -> int:
        return self.addr + (ptr - self.lo)

    def intact(self) -> tuple[bool, int]:
        """(canary bytes untouched, address of the first changed one)."""
        for start, end in ((self.first, self.addr), (self.addr + self.hi - self.lo, self.fence)):
            if end > start:
                got = ctypes.string_at(start, end - start)
                if got != bytes([self.canary]) * (end - start):
                    off = next(i for i, b in enumerate(got) if b != self.canary)
                    return False, start + off
        return True, 0

    def copy_back(self) -> None:
        ctypes.memmove(self.lo, self.addr, self.hi - self.lo)

    def release(self) -> None:
        _libc.munmap(self.base, self.size)

    def where(self, addr: int) -> int | None:
        """Offset of `addr` from the data start if it lies in this mapping (guards included)."""
        if self.base <= addr < self.base + self.size:
            return addr - self.addr
        return None


def fence(tensors: list[torch.Tensor], canary: int) -> tuple[list[Region], list[tuple[Region, int]]]:
    """Regions for the tensors (overlapping ones share a region) and each tensor's (region, pointer)."""
    spans = sorted((t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), i) for i, t in enumerate(tensors))
    regions: list[Region] = []
    owner: dict[int, Region] = {}
    group: list[tuple[int, int, int]] = []

    def close() -> None:
        if group:
            r = Region(min(g[0] for g in group), max(g[1] for g in group), canary)
            regions.append(r)
            for g in group:
                owner[g[2]] = r
            group.clear()

    for lo, hi, i in spans:
        if group and lo < max(g[1] for g in group) and hi > lo:
            group.append((lo, hi, i))
        else:
            close()
            group.append((lo, hi, i))
    close()
    placed = [(owner[i], owner[i].translate(t.data_ptr())) for i, t in enumerate(tensors)]
    return regions, placed
