"""Deprecated (one release): the old home of `FasterUncompressed`, re-exports auto/uncompressed.py."""

import warnings

from .auto.uncompressed import FasterUncompressed

warnings.warn("gradwire.comm.uncompressed moved to gradwire.comm.auto.uncompressed;"
              " this alias goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["FasterUncompressed"]
