"""A CPU emulator for gradwire's CUDA kernels (docs/cuda.md, "The emulator").

A test tool, kept out of the wheel: tests import it as `cuda_emulator` (tools/ on sys.path)
and plug its launcher into `gradwire.cuda.launch.emulated`.
"""

from .build import available
from .module import EmulatorError, Module, Schedule, load

__all__ = ["EmulatorError", "Module", "Schedule", "available", "load"]
