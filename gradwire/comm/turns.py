"""Deprecated (one release): the old home of `TimedTurns`, re-exports auto/turns.py."""

import warnings

from .auto.turns import Phase, TimedTurns

warnings.warn("gradwire.comm.turns moved to gradwire.comm.auto.turns;"
              " this alias goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["Phase", "TimedTurns"]
