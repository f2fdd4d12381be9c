"""`EmulatorLauncher`: the CPU emulator behind gradwire's `Launcher` interface.

Plugged in with `gradwire.cuda.launch.emulated(...)` (by `EmulatedDevice`), it gets the
exact launches `gradwire.cuda.ops` makes on a GPU -- kernel text, grids, arguments -- and
runs them on CPU memory, so everything above the launch is the GPU path's own code.
"""

from __future__ import annotations

import contextlib
from typing import Callable, ContextManager

import torch

from gradwire.cuda import loader

from . import tsan as _tsan
from .module import EmulatorError, Schedule, load


class EmulatorLauncher:
    """Kernels compiled by g++ from the same text and run as fibers on CPU memory.

    `source` maps a kernel file to its text (default `loader.source`: what NVRTC gets;
    the mutation check passes planted copies). `sms` sets the grid cap (32 blocks per SM,
    as on a GPU); `host` turns an argument tensor into the CPU tensor holding its bytes;
    `tsan` replays each launch in a ThreadSanitizer build first.
    """

    def __init__(self, schedule: Schedule | None = None, source: Callable[[str], str] = loader.source,
                 sms: int = 2, host: Callable[[torch.Tensor], torch.Tensor] = lambda t: t, tsan: bool = False):
        self.schedule = schedule if schedule is not None else Schedule()
        self.source, self.sms, self.host, self.tsan = source, sms, host, tsan
        self.launches = 0
        self.names: list[str] = []  # every launch in order, as "file:name" (tests read it)

    def launch(self, file: str, name: str, grid: int, block: int, args: tuple) -> None:
        if name not in loader.INSTANTIATIONS[file]:
            raise KeyError(f"{name} is not instantiated in {file}; add it to INSTANTIATIONS")
        stem, text, names = file.removesuffix(".cu"), self.source(file), loader.INSTANTIATIONS[file]
        kernel = load(stem, text, names).get_function(name)
        conv = tuple(self.host(a) if isinstance(a, torch.Tensor) else a for a in args)
        if self.tsan:  # the same launch on the same inputs, first in the TSan build
            kernel.check(conv)
            races, report, _ = _tsan.host(stem, text, names).replay(name, grid, block, conv, self.schedule)
            if races:
                raise EmulatorError(f"{name}: ThreadSanitizer reports {races} data race(s):\n{report[-6000:]}")
        kernel(grid, block, conv, self.schedule)
        self.launches += 1
        self.names.append(f"{file}:{name}")

    def stream(self, device: torch.device) -> ContextManager[None]:
        return contextlib.nullcontext()

    def max_blocks(self, device: torch.device) -> int:
        return 32 * self.sms
