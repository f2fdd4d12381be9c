"""Alpha-beta cost of a link: what each strategy's `modelled_seconds` prices its collectives with.

A collective of n bytes over P ranks is modelled with ring algorithms: allreduce
``2(P-1)·alpha + 2(P-1)/P · n · beta``, allgather of m bytes each ``(P-1)·alpha + (P-1) · m · beta``,
broadcast ``ceil(log2 P)·(alpha + n·beta)``, all-to-all of n bytes out ``2(P-1)·alpha + n·beta``
(counts first). alpha (s) and beta (s/byte) are measured by `auto` (auto/probe.py); this module
only prices, so the strategies below `auto` can model themselves without measuring anything.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class CostModel:
    """One kind of link: alpha seconds per message, beta seconds per byte."""

    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def allreduce(self, nbytes: int, world: int) -> float:
        return 2 * (world - 1) * self.alpha + 2 * (world - 1) / world * nbytes * self.beta

    def allgather(self, nbytes_each: int, world: int, sized: bool = True) -> float:
        t = (world - 1) * (self.alpha + nbytes_each * self.beta)
        return t if sized else t + (world - 1) * (self.alpha + 8 * self.beta)  # size exchange

    def broadcast(self, nbytes: int, world: int) -> float:
        return math.ceil(math.log2(max(world, 2))) * (self.alpha + nbytes * self.beta)

    def alltoall(self, nbytes_out: int, world: int) -> float:
        """Pairwise exchange: one message to each peer, nbytes_out in all, after a size exchange."""
        return 2 * (world - 1) * self.alpha + (nbytes_out + 16 * (world - 1)) * self.beta


@dataclass(frozen=True)
class Links:
    """The links a strategy may cross: `flat` between any two ranks; on several nodes also
    `intra` (inside a node) and `inter` (between nodes), which `hierarchical` prices apart."""

    flat: CostModel
    intra: CostModel | None = None
    inter: CostModel | None = None
