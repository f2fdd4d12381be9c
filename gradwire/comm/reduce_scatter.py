"""Compressed reduce-scatter: each rank ends with the sum (or mean) of one chunk of everyone's input.

The input of a rank is ``world`` equal destination chunks (chunk j goes to rank j), and every
chunk holds the same segments (one per parameter shard, as FSDP lays its reduce-scatter input
out). A rank compresses each (segment, destination) piece on its own, under the key
``"<segment key>/<destination>"`` (its randomness and error feedback), packs one destination's
packets into one message (an int64 length per segment, then the packets) and one all-to-all
moves the messages. Each rank decodes the ``world`` messages it received and sums them in fp32
in rank order (ZeRO++'s qgZ shape: low-precision wire, full-precision accumulation), so the
result does not depend on arrival order. Message sizes are exchanged first unless every packet
size is static (quantizers, casts, top-k with raw indices), then each rank knows them. Each
piece is decoded with its segment's shape and dtype; since each rank reads different bytes,
the ranks then agree on success with one 4-byte allreduce, so a malformed packet sent to one
rank makes every rank raise `WireFormatError`.

Segments not worth compressing (fewer than `min_numel` elements, or a packet not smaller than
dense) travel raw. A reduce-scatter is not a `Strategy`: it cannot exchange whole buckets, so it
has its own base, `ReduceScatter`. The uncompressed collective, `dense_reduce_scatter`, lives with
the torch.distributed backend (torch_dist.py) and is re-exported here for the FSDP hook.

Tests: tests/comm/test_reduce_scatter.py (every kind of compressor, real gloo ranks),
tests/comm/test_hostile_exchange.py, tests/comm/mpi_programs/collectives.py (mpiexec).
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch

from ..compress import Ctx
from ..errors import WireFormatError
from .backend import Backend, Work
from .base import CompressingExchange, Segment, StrategyTraits, split_message
from .framing import agree, packet_bound
from .torch_dist import dense_reduce_scatter

__all__ = ["AlltoallReduceScatter", "ReduceScatter", "dense_reduce_scatter"]


class ReduceScatter(CompressingExchange):
    """Each rank ends with the sum (or mean) of one destination chunk of every rank's input."""

    def reduce_scatter(self, x: torch.Tensor, segments: list[Segment], ctx: Ctx,
                       average: bool = False) -> Work[torch.Tensor]:
        """This rank's chunk of the sum (mean with average=True) over ranks. x is `world`
        destination chunks, each holding `segments` (offsets relative to the chunk)."""
        raise NotImplementedError


class AlltoallReduceScatter(ReduceScatter):
    """Per-destination compression, one all-to-all, fp32 decode-and-sum in rank order."""

    name = "alltoall"
    TRAITS = StrategyTraits("alltoall", frozenset({"min_numel"}), reduce_scatter=True, cross_replica=False)

    def reduce_scatter(self, x: torch.Tensor, segments: list[Segment], ctx: Ctx,
                       average: bool = False) -> Work[torch.Tensor]:
        """This rank's chunk of the sum (mean with average=True) over ranks, as fp32.
        `segments` lie inside one destination chunk (offsets relative to the chunk)."""
        t0 = time.perf_counter()
        world, rank = self.backend.world_size, self.backend.rank
        chunk = sum(s.numel for s in segments)
        if x.dim() != 1 or x.numel() != world * chunk:
            raise ValueError(f"reduce-scatter input of shape {tuple(x.shape)} is not {world} chunks of the "
                             f"{chunk} elements its segments cover")
        rows = x.view(world, chunk)
        codecs = [self._codec(seg, x.dtype) for seg in segments]
        messages: list[torch.Tensor] = []
        own: list[torch.Tensor] = []  # what this rank's own piece decodes to
        failed: WireFormatError | None = None
        for j in range(world):
            packets = []
            for seg, c in zip(segments, codecs):
                part = seg.of(rows[j])
                if c is self.raw:
                    packets.append(c.encode(part).tensor())
                    if j == rank:
                        own.append(part)
                    continue
                key = f"{seg.key}/{j}"
                corrected = self._correct(part, key)
                packet = c.encode(corrected, replace(ctx, key=Ctx.key_of(key))).tensor()
                if self.feedback is not None or j == rank:
                    try:
                        sent = c.decode(packet, shape=part.shape, dtype=part.dtype)
                    except WireFormatError as e:  # raised after the exchange, with the other ranks
                        failed, sent = failed or e, part
                    if j == rank:
                        own.append(sent)
                    self._remember(key, corrected, sent)
                packets.append(packet)
            lengths = torch.tensor([p.numel() for p in packets], dtype=torch.int64, device=x.device)
            messages.append(torch.cat([lengths.view(torch.uint8)] + packets))
        static = [c.static_size(seg.numel, x.dtype) for seg, c in zip(segments, codecs)]
        recv = None if None in static else [messages[rank].numel()] * world  # every rank's chunk is alike
        bound = 8 * len(segments) + sum(packet_bound(c, seg.numel, x.dtype) for seg, c in zip(segments, codecs))
        t1 = time.perf_counter()
        self.stats.encode_s += t1 - t0
        sent_bytes = sum(m.numel() for j, m in enumerate(messages) if j != rank)

        def finish(received: list[torch.Tensor]) -> torch.Tensor:
            t2 = time.perf_counter()
            self.stats.exchange_s += t2 - t1
            self.stats.bytes_sent += sent_bytes
            self.stats.bytes_received += sum(m.numel() for r, m in enumerate(received) if r != rank)
            self.stats.dense_bytes += (world - 1) * chunk * x.element_size()  # a ring reduce-scatter's share
            if failed is not None:
                raise failed
            total = torch.zeros(chunk, dtype=torch.float32, device=x.device)
            for r, m in enumerate(received):  # rank order: the same sum on every rank
                try:
                    pieces = own if r == rank else [c.decode(p, shape=(seg.numel,), dtype=x.dtype) for seg, c, p in
                                                    zip(segments, codecs, split_message(m, len(segments)))]
                except WireFormatError as e:
                    raise WireFormatError(f"reduce-scatter: rank {r}'s message to rank {rank}: {e}", peer=r) from e
                for seg, piece in zip(segments, pieces):
                    seg.of(total).add_(piece.reshape(-1))
            if average:
                total.div_(world)
            self.stats.decode_s += time.perf_counter() - t2
            return total

        # without static sizes, every rank's claims are checked against this rank's bound first
        decoded = self.backend.alltoall(messages, recv, max_recv=bound).then(finish)
        return Work(wait=lambda: _agreed(self.backend, decoded, x.device))


def _agreed(backend: Backend, decoded: Work[torch.Tensor], device: torch.device) -> torch.Tensor:
    """The decoded chunk once every rank has decoded its own: unlike an allgather, each rank
    reads different bytes here, so one tiny allreduce of error flags makes a bad packet sent
    to one rank raise WireFormatError on every rank (none goes on to the next collective alone)."""
    try:
        result, error = decoded.wait(), None
    except WireFormatError as e:
        result, error = None, e
    agree(backend, error, "reduce-scatter", device=device)
    return result  # type: ignore[return-value]
