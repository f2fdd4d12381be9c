"""Deprecated (one release): the old home of the strategies, re-exports only.

The strategies' base is base.py; `dense` and `allreduce` live in dense.py, `allgather` in
allgather.py, `artopk` in artopk.py."""

import warnings

from .allgather import Allgather
from .artopk import ARTopK, check_leader_indices, packet_indices
from .base import (ExchangeStats, Segment, Strategy, segment_ctx, segments_of, split_message,
                   take_stats_of)
from .dense import Allreduce, DenseAllreduce

warnings.warn("gradwire.comm.strategies moved to gradwire.comm.base, .dense, .allgather and .artopk;"
              " this alias goes in the next release",
              DeprecationWarning, stacklevel=2)

__all__ = ["ARTopK", "Allgather", "Allreduce", "DenseAllreduce", "ExchangeStats", "Segment", "Strategy",
           "check_leader_indices", "packet_indices", "segment_ctx", "segments_of", "split_message", "take_stats_of"]
