"""GPU entropy coding for the lossless stage: nvCOMP's ANS through its Python package.

Optional twice over: it needs CuPy's CUDA stack and `nvidia-nvcomp-cu12` / `-cu13`. When
nvCOMP is missing, the lossless stage falls back to host zstd (and warns once, naming
the package). `GRADWIRE_GPU_ENTROPY=zstd` forces host zstd, e.g. for a job whose CPU ranks
must read GPU ranks' packets (an ANS frame needs nvCOMP on a CUDA device to decode).
"""

from __future__ import annotations

import functools
import importlib.util
import os
import threading
import warnings

import torch

ALGORITHM = "ANS"
_tls = threading.local()  # nvCOMP codecs are not thread-safe: one per thread, device and stream
_warned = False


@functools.lru_cache(maxsize=None)
def _nvcomp_installed() -> bool:
    try:
        return importlib.util.find_spec("nvidia.nvcomp") is not None
    except ModuleNotFoundError:
        return False


def use_nvcomp() -> bool:
    """Whether CUDA packets are entropy-coded on the device (nvCOMP) rather than by host zstd."""
    mode = os.environ.get("GRADWIRE_GPU_ENTROPY", "auto").lower()
    if mode == "zstd":
        return False
    if mode == "ans" and not _nvcomp_installed():
        raise RuntimeError("GRADWIRE_GPU_ENTROPY=ans needs nvCOMP: pip install nvidia-nvcomp-cu12 (or -cu13)")
    return _nvcomp_installed()


def warn_host_fallback() -> None:
    """One warning per process: CUDA packets go through host zstd."""
    global _warned
    if not _warned:
        _warned = True
        warnings.warn("gradwire: zstd on CUDA tensors runs on the host (a device-to-host copy per packet); "
                      "install nvidia-nvcomp-cu12 or nvidia-nvcomp-cu13 for GPU entropy coding (nvCOMP ANS)",
                      RuntimeWarning, stacklevel=3)


def _codec(device: torch.device):
    from nvidia import nvcomp

    index = device.index if device.index is not None else torch.cuda.current_device()
    stream = torch.cuda.current_stream(device).cuda_stream
    cache = getattr(_tls, "codecs", None)
    if cache is None:
        cache = _tls.codecs = {}
    key = (index, stream)
    if key not in cache:
        cache[key] = nvcomp.Codec(algorithm=ALGORITHM, device_id=index, cuda_stream=stream)
    return cache[key]


def _as_bytes(arr, device: torch.device) -> torch.Tensor:
    t = torch.from_dlpack(arr)
    return t.reshape(-1).view(torch.uint8) if t.dtype != torch.uint8 else t.reshape(-1)


def compress(content: torch.Tensor) -> torch.Tensor:
    """nvCOMP ANS of a uint8 CUDA tensor, as a uint8 CUDA tensor (nvCOMP's own framing)."""
    from nvidia import nvcomp

    out = _codec(content.device).encode(nvcomp.as_array(content.contiguous()))
    return _as_bytes(out, content.device).clone()  # own the bytes (the Array may be reused)


def decompress(frame: torch.Tensor, bound: int) -> torch.Tensor:
    """Inverse of `compress`; raises ValueError on a malformed frame or more than `bound` bytes."""
    from nvidia import nvcomp

    try:
        out = _codec(frame.device).decode(nvcomp.as_array(frame.contiguous()))
        content = _as_bytes(out, frame.device).clone()
    except Exception as e:  # nvCOMP raises its own types for corrupt input
        raise ValueError(f"nvCOMP {ALGORITHM} frame does not decompress: {e}") from None
    if content.numel() > bound:
        raise ValueError(f"nvCOMP frame holds {content.numel()} bytes, more than the bound {bound}")
    return content
