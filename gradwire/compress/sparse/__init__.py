"""Sparsifiers (role "sparse", codec ids 6-9), one module each: `topk`, `randomk`,
`threshold`, `dgc`. What they share -- params, sections, index packing, residual paths,
decode -- is in `base`; the selection engine under topk, dgc and threshold is
gradwire/compress/select.py."""

from __future__ import annotations

from .dgc import DGC
from .randomk import RandomK
from .threshold import Threshold
from .topk import TopK

__all__ = ["TopK", "DGC", "Threshold", "RandomK"]
