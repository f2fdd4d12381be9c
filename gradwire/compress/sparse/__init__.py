"""Sparsifiers (role "sparse", codec ids 6-9), one module each: `topk`, `randomk`,
`threshold`, `dgc`. What they share -- params, sections, index packing, residual paths,
decode -- is in `base`; the selection engine under topk, dgc and threshold is
gradwire/compress/select.py."""

from __future__ import annotations

from .dgc import DGC
from .randomk import RandomK
from .threshold import Threshold
from .topk import TopK

# Compatibility, until gradwire/comm/oktopk.py imports gradwire.compress.select.topk: the
# function `topk`. Bound after the submodule of the same name is imported, which would
# otherwise set this attribute to the module (`import gradwire.compress.sparse.topk` still
# loads the module; as an attribute of this package, `topk` is the function).
from ..select import topk  # noqa: E402,F401

__all__ = ["TopK", "DGC", "Threshold", "RandomK"]
