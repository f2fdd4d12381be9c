"""The one launcher interface `ops` talks to, with two implementations.

`CupyLauncher` runs the kernels on a GPU (NVRTC through `cupy.RawModule`, torch's current
stream). `EmulatorLauncher` runs the same kernel text, grids and arguments on CPU memory
(gradwire/cuda/emulator), so everything above this line -- shapes, launch configuration,
the torch ops between launches -- is the code a GPU runs. The emulator is active only
inside `emulated(...)` (tests, the mutation check); otherwise a launch goes to CuPy.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import Callable, ContextManager, Iterator, Protocol

import torch

from . import loader


class Launcher(Protocol):
    def launch(self, file: str, name: str, grid: int, block: int, args: tuple) -> None: ...

    def stream(self, device: torch.device) -> ContextManager[None]: ...

    def max_blocks(self, device: torch.device) -> int: ...


class CupyLauncher:
    """Kernels through NVRTC (CuPy), ordered on torch's current CUDA stream."""

    def launch(self, file: str, name: str, grid: int, block: int, args: tuple) -> None:
        from .interop import to_cupy

        conv = tuple(to_cupy(a) if isinstance(a, torch.Tensor) else a for a in args)
        loader.kernel(file, name)((grid,), (block,), conv)

    def stream(self, device: torch.device) -> ContextManager[None]:
        from .interop import on_torch_stream

        return on_torch_stream(device)

    def max_blocks(self, device: torch.device) -> int:
        from .interop import max_blocks

        return max_blocks(device.index or 0)


class EmulatorLauncher:
    """Kernels compiled by g++ from the same text and run as fibers on CPU memory.

    `source` maps a kernel file to its text (default `loader.source`: what NVRTC gets;
    the mutation check passes planted copies). `sms` sets the grid cap (32 blocks per SM,
    as on a GPU); `host` turns an argument tensor into the CPU tensor holding its bytes.
    """

    def __init__(self, schedule: "object | None" = None, source: Callable[[str], str] = loader.source,
                 sms: int = 2, host: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, tsan: bool = False):
        from .emulator import Schedule

        self.schedule = schedule if schedule is not None else Schedule()
        self.source, self.sms, self.host, self.tsan = source, sms, host, tsan
        self.launches = 0
        self.names: list[str] = []  # every launch in order, as "file:name" (tests read it)

    def launch(self, file: str, name: str, grid: int, block: int, args: tuple) -> None:
        from .emulator import load

        if name not in loader.INSTANTIATIONS[file]:
            raise KeyError(f"{name} is not instantiated in {file}; add it to INSTANTIATIONS")
        stem, text, names = file.removesuffix(".cu"), self.source(file), loader.INSTANTIATIONS[file]
        kernel = load(stem, text, names).get_function(name)
        conv = tuple(self.host(a) if isinstance(a, torch.Tensor) else a for a in args)
        if self.tsan:  # the same launch on the same inputs, first in the TSan build
            from .emulator import EmulatorError, tsan

            kernel.check(conv)
            races, report, err = tsan.host(stem, text, names).replay(name, grid, block, conv, self.schedule)
            if races:
                raise EmulatorError(f"{name}: ThreadSanitizer reports {races} data race(s):\n{report[-6000:]}")
        kernel(grid, block, conv, self.schedule)
        self.launches += 1
        self.names.append(f"{file}:{name}")

    def stream(self, device: torch.device) -> ContextManager[None]:
        return contextlib.nullcontext()

    def max_blocks(self, device: torch.device) -> int:
        return 32 * self.sms


_state = threading.local()


@functools.lru_cache(maxsize=None)
def _cupy() -> CupyLauncher:
    return CupyLauncher()


def current() -> Launcher:
    """The launcher of this thread: the emulator inside `emulated`, else CuPy."""
    return getattr(_state, "launcher", None) or _cupy()


def is_emulated() -> bool:
    return getattr(_state, "launcher", None) is not None


@contextlib.contextmanager
def emulated(launcher: Launcher) -> Iterator[Launcher]:
    """Route this thread's launches to `launcher` for the block."""
    prev = getattr(_state, "launcher", None)
    _state.launcher = launcher
    try:
        yield launcher
    finally:
        _state.launcher = prev
