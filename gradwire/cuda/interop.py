"""torch <-> CuPy without copies, and launches on torch's current stream.

Tensors cross through DLPack (`cupy.from_dlpack`); CuPy has no bfloat16, so 16-bit floats
cross as their int16 bits and float8 as uint8 (kernels read the bits). Every launch and
every conversion happens inside `on_torch_stream`, which makes torch's current CUDA
stream CuPy's current stream: kernels are ordered with the torch ops around them and the
DLPack exchange needs no extra event.
"""

from __future__ import annotations

import contextlib
import functools
from typing import Iterator

import torch

_BITS_VIEW = {torch.float16: torch.int16, torch.bfloat16: torch.int16,
              torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}


def to_cupy(t: torch.Tensor):
    """A CuPy view of a contiguous CUDA tensor (no copy)."""
    import cupy

    if not t.is_contiguous():
        raise ValueError("gradwire.cuda: kernels take contiguous tensors")
    view = _BITS_VIEW.get(t.dtype)
    return cupy.from_dlpack(t.view(view) if view is not None else t)


@contextlib.contextmanager
def on_torch_stream(device: torch.device) -> Iterator[None]:
    """Make torch's current stream on `device` CuPy's current stream for the block."""
    import cupy

    stream = torch.cuda.current_stream(device)
    with cupy.cuda.Device(device.index if device.index is not None else torch.cuda.current_device()):
        with cupy.cuda.ExternalStream(stream.cuda_stream):
            yield


@functools.lru_cache(maxsize=None)
def max_blocks(device_index: int) -> int:
    """Grid cap for grid-stride kernels: 32 blocks of 256 threads per SM fill the device."""
    return 32 * torch.cuda.get_device_properties(device_index).multi_processor_count
