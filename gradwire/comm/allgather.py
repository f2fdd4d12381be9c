"""`allgather`: packets of any compressor, one message per bucket, decoded and summed in rank order.

A message is an int64 length per segment, then the segments' packets (`base.split_message`
reads it). Every rank decodes every message, its own included, and sums in rank order, so all
ranks agree bit for bit whatever order bytes arrive in. Segments under `min_numel` elements, or
whose packet would not be smaller than dense, travel raw; a bucket with nothing worth
compressing is allreduced where the backend's sums are identical on every rank.

Tests: tests/comm/test_strategies.py, tests/comm/test_hostile_exchange.py.
"""

from __future__ import annotations

import time

import torch

from ..compress import Compressor, Ctx
from ..errors import WireFormatError
from .backend import Backend, Work
from .base import Strategy, StrategyTraits, Workload, estimated_packet_bytes, segment_ctx, segments_of, split_message
from .framing import packet_bound
from .links import Links


class Allgather(Strategy):
    """Packets of any compressor, one message per bucket: an int64 length per segment, then
    the segments' packets. Decoded and summed in rank order, so all ranks agree bit for bit.
    Segments under `min_numel` elements travel uncompressed."""

    name = "allgather"
    TRAITS = StrategyTraits("allgather", frozenset({"min_numel"}), swaps_compressor=True, never_waits=True)

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True,
                 min_numel: int = 0) -> None:
        super().__init__(backend, compressor, error_feedback, min_numel)

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        segs = segments_of(x, key, shapes, keys)
        codecs = [self._codec(seg, x.dtype) for seg in segs]
        if self.backend.allreduce_identical and all(c is self.raw for c in codecs):
            # nothing worth compressing: a plain allreduce (its sums are equal on every rank)
            t = x.clone()
            if average:
                t.div_(self.backend.world_size)
            nbytes = t.numel() * t.element_size()
            self._count(key, x, nbytes, nbytes * (self.backend.world_size - 1))
            self.stats.buckets[str(key)] = "dense"
            return self._timed_allreduce(t)
        packets = []
        for seg, c in zip(segs, codecs):
            part = seg.of(x)
            if c is self.raw:
                packets.append(c.encode(part).tensor())
            elif self.feedback is not None:
                packets.append(self.feedback.encode(part, seg.key, segment_ctx(ctx, seg)).tensor())
            else:
                packets.append(c.encode(part, segment_ctx(ctx, seg)).tensor())
        lengths = torch.tensor([p.numel() for p in packets], dtype=torch.int64, device=x.device)
        message = torch.cat([lengths.view(torch.uint8)] + packets)
        static = [c.static_size(seg.numel, x.dtype) for seg, c in zip(segs, codecs)]
        size = None if None in static else 8 * len(segs) + sum(static)  # type: ignore[operator]
        # what a peer's message may hold at most, by this rank's own segments (checked before allocating)
        bound = 8 * len(segs) + sum(packet_bound(c, seg.numel, x.dtype) for seg, c in zip(segs, codecs))
        t1 = time.perf_counter()
        self.stats.encode_s += t1 - t0
        world, rank = self.backend.world_size, self.backend.rank

        def finish(messages: list[torch.Tensor]) -> torch.Tensor:
            t2 = time.perf_counter()
            self.stats.exchange_s += t2 - t1
            self._count(key, x, message.numel(), sum(m.numel() for m in messages) - message.numel())
            total = x.zero_() if self.into_input else torch.zeros_like(x)  # x was read by the encode only
            for r, m in enumerate(messages):  # rank order: bit-identical sums on every rank
                # Every rank checks every message, its own included, against its own segments, so
                # a bad packet makes all ranks raise WireFormatError here, none hangs or goes on.
                try:
                    parts = split_message(m, len(segs))
                    if r == rank and not torch.equal(m, message):
                        raise WireFormatError("this rank's own message came back altered from the allgather")
                    for seg, c, packet in zip(segs, codecs, parts):  # added where sent: no dense decode
                        c.add_decoded(packet, seg.of(total), shape=(seg.numel,), dtype=x.dtype)
                except WireFormatError as e:
                    raise WireFormatError(f"allgather: rank {r}'s message: {e}", peer=r) from e
            if average:
                total.div_(world)
            self.stats.decode_s += time.perf_counter() - t2
            return total

        return self.backend.gather_packets(message, size, bound).then(finish)

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float | None:
        """Every rank's estimated packets to every rank, with a size exchange unless packet sizes
        are static; None when a packet's size is known only once it is encoded."""
        packed = [estimated_packet_bytes(self.compressor, n, work.dtype) for n in work.sizes]
        if None in packed:
            return None
        item = work.dtype.itemsize
        est = sum(min(p, n * item) for p, n in zip(packed, work.sizes))  # type: ignore[type-var]
        static = all(self.compressor.static_size(n, work.dtype) is not None for n in work.sizes)
        return links.flat.allgather(est // work.share, world, sized=static)

    def compute_seconds(self, work: Workload, world: int) -> float:
        """One encode, and a decode of every rank's packets."""
        return work.numel // work.share * (work.encode_s + world * work.decode_s)
