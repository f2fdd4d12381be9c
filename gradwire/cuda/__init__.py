"""CUDA kernels (CuPy). CuPy is optional: importing gradwire never needs it."""

from __future__ import annotations

import importlib.util


def cupy_available() -> bool:
    return importlib.util.find_spec("cupy") is not None


def require_cupy() -> None:
    """Fail with the install hint when a CUDA tensor arrives and CuPy is missing."""
    from .launch import is_emulated

    if not cupy_available() and not is_emulated():
        raise RuntimeError(
            "gradwire needs CuPy for CUDA tensors: pip install 'gradwire[cuda12]' "
            "(CUDA 12) or 'gradwire[cuda13]' (CUDA 13)")
