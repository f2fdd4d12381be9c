"""A CPU emulator for gradwire's CUDA kernels (docs/cuda.md, "The emulator")."""

from .build import available
from .module import EmulatorError, Module, Schedule, load

__all__ = ["EmulatorError", "Module", "Schedule", "available", "load"]
