"""Compressors, the wire format and error feedback (no communication here)."""

from . import casts, chain, lossless, quantize, sparse  # noqa: F401  (register the built-ins)
from .base import Compressor, Ctx, Param
from .feedback import DGCMomentum, ErrorFeedback, resolve_error_feedback
from .registry import available, compressor, from_config, register
from .wire import Kind, Packet, Section

__all__ = [
    "Compressor", "Ctx", "Param", "Packet", "Section", "Kind",
    "available", "compressor", "from_config", "register",
    "ErrorFeedback", "DGCMomentum", "resolve_error_feedback",
]
