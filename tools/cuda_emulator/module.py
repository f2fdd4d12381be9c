"""Loading an emulated kernel file and launching its kernels on CPU tensors.

Arguments are marshalled as CuPy does (a tensor becomes its data pointer, a NumPy scalar
its bytes) and checked against the kernel's parameter types, which the build reports per
instantiation: a pointer must get a tensor of the pointee's size, a scalar a NumPy scalar
of the same kind and width. A real launch cannot check this; a wrong width there reads
garbage silently.
"""

from __future__ import annotations

import ctypes
import dataclasses
import functools
import threading
from typing import Sequence

import numpy as np
import torch

from . import build as _build
from .fence import fence

POLICIES = {"lowest": 0, "highest": 1, "random": 2}
_POISON = (0xFF, 0xA5, 0x00)
_LOCK = threading.Lock()  # fault handlers are process-wide: one launch at a time


class EmulatorError(RuntimeError):
    """A kernel did something a GPU would fault on or leave undefined."""


@dataclasses.dataclass(frozen=True)
class Schedule:
    """Order of threads and blocks: lowest index first, highest first, or seeded random.
    `split` cuts `__activemask()` sets randomly in two (on by default for random)."""

    policy: str = "lowest"
    seed: int = 0
    split: bool | None = None

    def __post_init__(self) -> None:
        if self.policy not in POLICIES:
            raise ValueError(f"unknown schedule {self.policy!r}; use one of {sorted(POLICIES)}")

    @classmethod
    def parse(cls, spec: str) -> "Schedule":
        """'lowest', 'highest', 'random' or 'random:SEED'."""
        policy, _, seed = spec.partition(":")
        return cls(policy, int(seed) if seed else 0)

    def __str__(self) -> str:
        return self.policy if self.policy != "random" else f"random:{self.seed}"


class _Desc(ctypes.Structure):
    _fields_ = [("grid", ctypes.c_uint * 3), ("block", ctypes.c_uint * 3), ("sched", ctypes.c_int),
                ("split", ctypes.c_int), ("seed", ctypes.c_uint64), ("poison", ctypes.c_ubyte * 3),
                ("args", ctypes.POINTER(ctypes.c_void_p)), ("err", ctypes.c_char * 2048),
                ("fault_addr", ctypes.c_uint64)]


def _dim3(v: int | Sequence[int]) -> tuple[int, int, int]:
    t = (v,) if isinstance(v, int) else tuple(v)
    t = tuple(int(x) for x in t) + (1,) * (3 - len(t))
    if len(t) != 3 or min(t) < 1:
        raise ValueError(f"bad launch dimension {v!r}")
    return t  # type: ignore[return-value]


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}[{t.numel()}]"


class Kernel:
    def __init__(self, module: "Module", index: int, name: str):
        self.module, self.index, self.name = module, index, name
        lib = module.lib
        sig = getattr(lib, f"gw_sig_{index}")
        sig.restype = ctypes.c_char_p
        self.params = [p for p in sig().decode().split(";") if p]
        self._fn = getattr(lib, f"gw_launch_{index}")
        self._fn.restype = ctypes.c_int
        self._fn.argtypes = [ctypes.POINTER(_Desc)]
        self.launches = 0

    def check(self, args: tuple) -> None:
        """Raise TypeError/ValueError unless `args` match the kernel's parameters."""
        if len(args) != len(self.params):
            raise TypeError(f"{self.name}: {len(args)} arguments for {len(self.params)} parameters")
        for i, (a, p) in enumerate(zip(args, self.params)):
            kind, rest = p[0], p[1:]
            width = int(rest.rstrip("c"))
            if kind == "p":
                if not isinstance(a, torch.Tensor):
                    raise TypeError(f"{self.name}: argument {i} is {type(a).__name__}, the parameter is a pointer")
                if width and a.element_size() != width:
                    raise TypeError(f"{self.name}: argument {i} is {_describe(a)} ({a.element_size()}-byte elements), "
                                    f"the parameter points to {width}-byte elements")
                if not a.is_contiguous():
                    raise ValueError(f"{self.name}: argument {i} is not contiguous")
                continue
            if isinstance(a, torch.Tensor):
                raise TypeError(f"{self.name}: argument {i} is a tensor, the parameter is a {width}-byte scalar")
            if not isinstance(a, np.generic):
                raise TypeError(f"{self.name}: argument {i} is a Python {type(a).__name__}; pass a NumPy scalar of "
                                f"the parameter's type ({p}) so its width is explicit")
            want = {"i": "i", "u": "u", "f": "f", "b": "b", "o": "V"}[kind]
            if a.dtype.kind != want or a.dtype.itemsize != width:
                raise TypeError(f"{self.name}: argument {i} is {a.dtype}, the parameter is {p} "
                                f"(kind {kind}, {width} bytes)")

    def __call__(self, grid, block, args: tuple, schedule: Schedule = Schedule()) -> None:
        self.check(args)
        g, b = _dim3(grid), _dim3(block)
        if b[0] * b[1] * b[2] > 1024:
            raise ValueError(f"{self.name}: {b[0] * b[1] * b[2]} threads per block (at most 1024)")
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        for t in tensors:
            if t.device.type != "cpu":
                raise ValueError(f"{self.name}: emulated launches take CPU tensors, got {t.device}")
        self.launches += 1
        seed = (schedule.seed * 0x9E3779B1 + self.launches * 0x85EBCA77 + self.index) & (2**64 - 1)
        canary = 0xC0 | (self.launches & 0x3F)
        with _LOCK:
            regions, placed = fence(tensors, canary)
            try:
                slots: list[ctypes._SimpleCData | np.ndarray] = []
                it = iter(placed)
                for a in args:
                    slots.append(ctypes.c_uint64(next(it)[1]) if isinstance(a, torch.Tensor) else np.array(a))
                ptrs = (ctypes.c_void_p * max(1, len(args)))(
                    *[ctypes.addressof(s) if isinstance(s, ctypes.c_uint64) else s.ctypes.data for s in slots])
                d = _Desc()
                d.grid[:], d.block[:] = g, b
                d.sched = POLICIES[schedule.policy]
                split = schedule.split if schedule.split is not None else schedule.policy == "random"
                d.split = int(split)
                d.seed = seed
                rot = self.launches % 3
                d.poison[:] = _POISON[rot:] + _POISON[:rot]
                d.args = ptrs
                rc = self._fn(ctypes.byref(d))
                if rc:
                    raise EmulatorError(f"{self._message(d, tensors, placed, args)} [grid {g}, block {b}, "
                                        f"schedule {schedule}]")
                for r in regions:
                    ok, addr = r.intact()
                    if not ok:
                        i = next(j for j, (rr, _) in enumerate(placed) if rr is r)
                        off = addr - placed[i][1]
                        raise EmulatorError(f"{self.name}: out-of-bounds write {self._where(off, tensors[i], args, i)}")
                for r in regions:
                    r.copy_back()
            finally:
                for r in regions:
                    r.release()

    def _where(self, off: int, t: torch.Tensor, args: tuple, ti: int) -> str:
        ai = [k for k, a in enumerate(args) if isinstance(a, torch.Tensor)][ti]
        n = t.numel() * t.element_size()
        if off < 0:
            return f"{-off} bytes before argument {ai} ({_describe(t)})"
        return f"at byte {off} of argument {ai} ({_describe(t)}, {n} bytes: {off - n} past its end)"

    def _message(self, d: _Desc, tensors: list, placed: list, args: tuple) -> str:
        msg = f"{self.name}: {d.err.decode(errors='replace')}"
        if d.fault_addr:
            best = None
            for i, (r, ptr) in enumerate(placed):
                if r.where(d.fault_addr) is not None:
                    off = d.fault_addr - ptr
                    if best is None or abs(off) < abs(best[1]):
                        best = (i, off)
            if best is not None:
                msg += f" ({self._where(best[1], tensors[best[0]], args, best[0])})"
        return msg


class Module:
    """One kernel file, compiled by g++ and loaded with RTLD_LOCAL."""

    def __init__(self, stem: str, text: str, names: tuple[str, ...], tsan: bool = False):
        self.path = _build.build(stem, text, names, tsan)
        self.lib = ctypes.CDLL(str(self.path), mode=getattr(ctypes, "RTLD_LOCAL", 0))
        self.names = names
        self._kernels: dict[str, Kernel] = {}

    def get_function(self, name: str) -> Kernel:
        if name not in self._kernels:
            if name not in self.names:
                raise KeyError(f"{name} is not instantiated in this module")
            self._kernels[name] = Kernel(self, self.names.index(name), name)
        return self._kernels[name]


@functools.lru_cache(maxsize=None)
def load(stem: str, text: str, names: tuple[str, ...], tsan: bool = False) -> Module:
    """The module of a kernel text (one build and load per distinct text in a process)."""
    return Module(stem, text, names, tsan)
