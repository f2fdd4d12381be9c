"""The one launcher interface `ops` talks to.

`CupyLauncher` runs the kernels on a GPU (NVRTC through `cupy.RawModule`, torch's current
stream). `emulated(launcher)` routes a thread's launches elsewhere: the tests plug in the
CPU emulator from tools/cuda_emulator (not part of the package), which runs the same
kernel text, grids and arguments on CPU memory, so everything above this seam -- shapes,
launch configuration, the torch ops between launches -- is the code a GPU runs.
"""

from __future__ import annotations

import contextlib
import functools
import threading
from typing import ContextManager, Iterator, Protocol

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


_state = threading.local()


@functools.lru_cache(maxsize=None)
def _cupy() -> CupyLauncher:
    return CupyLauncher()


def current() -> Launcher:
    """The launcher of this thread: the one given to `emulated`, else CuPy."""
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
