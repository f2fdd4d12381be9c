"""gradwire: gradient compression and communication middleware for PyTorch.

    >>> import gradwire
    >>> c = gradwire.compressor("topk:ratio=0.01")
    >>> packet = c.encode(grad)
    >>> approx = c.decode(packet.tensor())
"""

from .compress import (Compressor, Ctx, DGCMomentum, ErrorFeedback, Packet, available, compressor,
                       from_config, register)
from .errors import CollectiveError, ConfigMismatchError, WireFormatError

__version__ = "0.1.0"
__all__ = [
    "Compressor", "Ctx", "Packet", "ErrorFeedback", "DGCMomentum", "WireFormatError", "ConfigMismatchError",
    "CollectiveError",
    "available", "compressor", "from_config", "register", "__version__",
]
