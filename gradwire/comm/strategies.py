"""Exchange strategies: how one flat gradient bucket becomes the sum over ranks.

- `allreduce`: summable compressors (none, fp16, bf16, randomk): allreduce the payload.
- `allgather`: any compressor: allgather packets, decode and sum in rank order.
- `artopk`: AR-compatible top-k: a rotating leader's top-k indices are broadcast and every
  rank allreduces its values there (Tyagi & Swany, 2023).
- `powersgd` lives in powersgd.py, `auto` in cost.py.

Every strategy returns a `Work` of the bucket's sum (or mean with average=True) and records
what it sent and received in `stats`.

A bucket holds one or more segments (the parameters DDP packed into it). Compression,
randomness and error feedback work per segment under the segment's stable key (a parameter
name), so results do not depend on how DDP groups parameters into buckets, which changes
after its first iteration and again in a resumed process. Each strategy still makes one
collective per bucket. A segment whose packet would not be smaller than its dense bytes is
sent uncompressed.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Iterable

import torch

from ..compress import Compressor, Ctx, ErrorFeedback, compressor as make_compressor
from ..errors import WireFormatError
from .backend import Backend, Work
from .framing import packet_bound


@dataclass
class ExchangeStats:
    """Totals for one step (reset by the caller); seconds are wall time on this rank."""

    bytes_sent: int = 0
    bytes_received: int = 0
    dense_bytes: int = 0
    encode_s: float = 0.0
    exchange_s: float = 0.0
    decode_s: float = 0.0
    buckets: dict[str, str] = field(default_factory=dict)  # bucket key -> strategy used
    intra_bytes_sent: int = 0  # of bytes_sent/received: what stayed inside a node (hierarchical)
    intra_bytes_received: int = 0

    def merge(self, other: "ExchangeStats") -> "ExchangeStats":
        return ExchangeStats(self.bytes_sent + other.bytes_sent, self.bytes_received + other.bytes_received,
                             self.dense_bytes + other.dense_bytes, self.encode_s + other.encode_s,
                             self.exchange_s + other.exchange_s, self.decode_s + other.decode_s,
                             {**self.buckets, **other.buckets}, self.intra_bytes_sent + other.intra_bytes_sent,
                             self.intra_bytes_received + other.intra_bytes_received)

    @property
    def ratio(self) -> float:
        return self.dense_bytes / self.bytes_sent if self.bytes_sent else math.inf

    def as_dict(self) -> dict[str, Any]:
        return {"bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "dense_bytes": self.dense_bytes, "ratio": self.ratio, "encode_s": self.encode_s,
                "exchange_s": self.exchange_s, "decode_s": self.decode_s, "buckets": dict(self.buckets),
                "intra_bytes_sent": self.intra_bytes_sent, "intra_bytes_received": self.intra_bytes_received,
                "inter_bytes_sent": self.bytes_sent - self.intra_bytes_sent,
                "inter_bytes_received": self.bytes_received - self.intra_bytes_received}


def take_stats_of(strategies: Iterable["Strategy"]) -> ExchangeStats:
    """The merged step statistics of several strategies (each starts a fresh record)."""
    stats = ExchangeStats()
    for s in strategies:
        stats = stats.merge(s.take_stats())
    return stats


@dataclass(frozen=True)
class Segment:
    """One tensor inside a bucket: a stable key and where it lies."""

    key: str
    offset: int
    numel: int

    def of(self, x: torch.Tensor) -> torch.Tensor:
        return x[self.offset: self.offset + self.numel]


def segments_of(x: torch.Tensor, key: int | str, shapes: list[torch.Size] | None,
                keys: list[str] | None) -> list[Segment]:
    """The bucket's segments; without keys the whole bucket is one segment under `key`."""
    if keys is None:
        return [Segment(str(key), 0, x.numel())]
    if shapes is None or len(shapes) != len(keys):
        raise ValueError("segment keys need one shape each")
    out, offset = [], 0
    for k, shape in zip(keys, shapes):
        n = 1
        for d in shape:
            n *= d
        out.append(Segment(str(k), offset, n))
        offset += n
    if offset != x.numel():
        raise ValueError(f"segment shapes cover {offset} elements but the bucket has {x.numel()}")
    return out


def segment_ctx(ctx: Ctx, seg: Segment) -> Ctx:
    return replace(ctx, key=Ctx.key_of(seg.key))


class Strategy:
    """Base: holds the backend, compressor, optional error feedback and stats."""

    name = "strategy"
    #: what the DDP hook's uncompressed first steps use instead of a plain allreduce (None: that)
    warmup_strategy: "Strategy | None" = None

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True,
                 min_numel: int = 0) -> None:
        if int(min_numel) < 0:
            raise ValueError(f"min_numel must be >= 0, got {min_numel}")
        self.backend = backend
        self.compressor = make_compressor(compressor)
        self.feedback = ErrorFeedback(self.compressor) if error_feedback else None
        self.min_numel = int(min_numel)
        self.raw = make_compressor("none")  # for segments not worth compressing
        self.stats = ExchangeStats()
        #: the result may be written into the exchanged tensor (the DDP hook's bucket buffer,
        #: which torch's own hooks overwrite too); otherwise results are fresh tensors
        self.into_input = False

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        """Sum (or mean) of the flat bucket x over ranks. `shapes`/`keys` name its segments."""
        raise NotImplementedError

    def set_compressor(self, c: Compressor) -> None:
        """Use `c` from now on, keeping error feedback's residuals (a density schedule changes k per step)."""
        self.compressor = c
        if self.feedback is not None:
            self.feedback.compressor = c

    def take_stats(self) -> ExchangeStats:
        """This step's statistics; starts a fresh record."""
        stats, self.stats = self.stats, ExchangeStats()
        return stats

    def compresses(self, numel: int, dtype: torch.dtype) -> bool:
        """Whether a segment this size is worth compressing: at least `min_numel` elements (tiny
        tensors such as biases starve under a 1% top-k and cost few bytes dense) and a packet
        smaller than dense."""
        from .cost import worth_compressing

        return numel >= self.min_numel and worth_compressing(self.compressor, numel, dtype)


    def _codec(self, seg: Segment, dtype: torch.dtype) -> Compressor:
        """The compressor for one segment: raw (`none`) when compressing it does not pay."""
        return self.compressor if self.compresses(seg.numel, dtype) else self.raw
    def _correct(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return self.feedback.correct(x, key) if self.feedback is not None else x

    def _remember(self, key: str, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        if self.feedback is not None:
            self.feedback.update(key, corrected, sent)

    def _count(self, key: int | str, x: torch.Tensor, sent: int, received: int) -> None:
        self.stats.bytes_sent += sent
        self.stats.bytes_received += received
        self.stats.dense_bytes += x.numel() * x.element_size()
        self.stats.buckets[str(key)] = self.name

    def _timed_allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        """Allreduce `t` in place, adding the wait until its result to the exchange time."""
        started = time.perf_counter()

        def done(result: torch.Tensor) -> torch.Tensor:
            self.stats.exchange_s += time.perf_counter() - started
            return result

        return self.backend.allreduce(t).then(done)

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.state_dict() if self.feedback is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("feedback") is None) != (self.feedback is None):
            raise ValueError("checkpoint and strategy disagree on whether error feedback is on")
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])


class DenseAllreduce(Strategy):
    """Plain allreduce, divided by world size first exactly as torch's allreduce_hook does."""

    name = "dense"

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, "none", error_feedback=False)

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t = x if self.into_input else x.clone()
        if average:
            t.div_(self.backend.world_size)
        nbytes = t.numel() * t.element_size()
        self._count(key, x, nbytes, nbytes * (self.backend.world_size - 1))
        return self._timed_allreduce(t)


class Allreduce(Strategy):
    """Summable payloads (casts, shared-index values), one allreduce per bucket, divided
    before the sum as torch's hooks do."""

    name = "allreduce"

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True) -> None:
        super().__init__(backend, compressor, error_feedback)
        if not self.compressor.summable:
            raise ValueError(f"{self.compressor} payloads are not summable; use the allgather strategy")

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        if self.feedback is None and getattr(self.compressor, "elementwise", False):
            return self._whole(x, key, ctx, average, t0)
        segs = segments_of(x, key, shapes, keys)
        payloads = []
        fused = self.feedback is not None and getattr(self.compressor, "elementwise", False)
        for seg in segs:
            part, sctx = seg.of(x), segment_ctx(ctx, seg)
            if fused:  # a cast's payload is its packet's data: error feedback in place, in one pass
                payloads.append(self.feedback.encode(part, seg.key, sctx).sections[0].data)  # type: ignore[union-attr]
                continue
            corrected = self._correct(part, seg.key)
            payload = self.compressor.to_summable(corrected, sctx)
            if self.feedback is not None:
                self._remember(seg.key, corrected, self.compressor.from_summable(payload.clone(), corrected, sctx))
            payloads.append(payload)
        sizes = [p.numel() for p in payloads]

        def decode(summed: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            for seg, part in zip(segs, torch.split(summed, sizes)):
                seg.of(out).copy_(self.compressor.from_summable(part, seg.of(x), segment_ctx(ctx, seg)))
            return out

        return self._send(x, key, payloads[0] if len(payloads) == 1 else torch.cat(payloads), average, t0, decode)

    def _whole(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool, t0: float) -> Work[torch.Tensor]:
        """An elementwise cast without error feedback: the bucket converted at once (the same
        bits as segment by segment), as torch's fp16 hook does, and widened into x's memory
        on the way back: no per-segment work, no concatenation, no fresh output."""

        def decode(summed: torch.Tensor) -> torch.Tensor:
            if self.into_input and not x.is_cuda:  # (CUDA: gradwire's cast kernel sets NaN bits)
                return x.copy_(summed.view(x.shape))
            return self.compressor.from_summable(summed, x, ctx)

        return self._send(x, key, self.compressor.to_summable(x, ctx), average, t0, decode)

    def _send(self, x: torch.Tensor, key: int | str, payload: torch.Tensor, average: bool, t0: float,
              decode: Callable[[torch.Tensor], torch.Tensor]) -> Work[torch.Tensor]:
        """Divide the payload first (as torch's hooks do), allreduce it, `decode` the sum; timed and counted."""
        if average:
            payload.div_(self.backend.world_size)
        t1 = time.perf_counter()
        self.stats.encode_s += t1 - t0
        nbytes = payload.numel() * payload.element_size()
        self._count(key, x, nbytes, nbytes * (self.backend.world_size - 1))

        def finish(summed: torch.Tensor) -> torch.Tensor:
            t2 = time.perf_counter()
            self.stats.exchange_s += t2 - t1
            out = decode(summed)
            self.stats.decode_s += time.perf_counter() - t2
            return out

        return self.backend.allreduce(payload).then(finish)


class Allgather(Strategy):
    """Packets of any compressor, one message per bucket: an int64 length per segment, then
    the segments' packets. Decoded and summed in rank order, so all ranks agree bit for bit.
    Segments under `min_numel` elements travel uncompressed."""

    name = "allgather"

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


def split_message(message: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The packets of one allgather message; a malformed table raises WireFormatError."""
    if message.numel() < 8 * count:
        raise WireFormatError(f"message of {message.numel()} bytes is shorter than its {count}-entry length table")
    lengths = message[: 8 * count].clone().view(torch.int64).tolist()
    if any(n < 0 for n in lengths) or 8 * count + sum(lengths) != message.numel():
        raise WireFormatError(f"message length table {lengths} does not match its {message.numel()} bytes")
    out, pos = [], 8 * count
    for n in lengths:
        out.append(message[pos: pos + n])
        pos += n
    return out


def packet_indices(packet, numel: int) -> torch.Tensor:
    """The ascending int64 indices a sparse packet carries (raw or delta-packed)."""
    from ..compress import indexcodec
    from ..compress.wire import Kind

    kinds = packet.kinds()
    if Kind.INDICES in kinds:
        return packet.section(Kind.INDICES).to(torch.int64)
    count = packet.section(Kind.VALUES).numel()
    return indexcodec.decode(packet.section(Kind.INDICES_PACKED), count, numel).to(torch.int64)


def check_leader_indices(idx: torch.Tensor, segs: list[Segment], counts: list[int]) -> None:
    """The leader's broadcast indices: counts[i] strictly ascending ones inside segment i each.

    Every rank (the leader too) runs this on the same bytes after the broadcast, so a bad
    index makes every rank raise WireFormatError before the allreduce: none hangs in it."""
    if idx.dtype != torch.int64 or idx.numel() != sum(counts):
        raise WireFormatError(f"artopk: {idx.numel()} {idx.dtype} indices, expected {sum(counts)} int64")
    if not idx.numel():
        return
    dev = idx.device
    reps = torch.tensor(counts, device=dev)
    lo = torch.repeat_interleave(torch.tensor([s.offset for s in segs], device=dev), reps)
    hi = lo + torch.repeat_interleave(torch.tensor([s.numel for s in segs], device=dev), reps)
    ok = (idx >= lo).logical_and_(idx < hi).all()
    if idx.numel() > 1:
        ok = ok.logical_and_((idx[1:] > idx[:-1]).all())
    if not bool(ok):
        raise WireFormatError("artopk: the leader's indices are out of their segments or not strictly ascending")


class ARTopK(Strategy):
    """AR-compatible top-k: the leader (rotating with the step) picks its top-k indices per
    segment, broadcasts them, and every rank allreduces its own values there. One extra
    element carries sum(x) so a NaN/Inf anywhere still reaches every rank."""

    name = "artopk"

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True) -> None:
        super().__init__(backend, compressor, error_feedback)
        if self.compressor.name != "topk":
            raise ValueError(f"artopk needs a plain topk compressor, got {self.compressor}")

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        world, rank = self.backend.world_size, self.backend.rank
        segs = segments_of(x, key, shapes, keys)
        counts = [self.compressor.value_count(seg.numel) for seg in segs]  # type: ignore[attr-defined]
        corrected = [self._correct(seg.of(x), seg.key) for seg in segs]
        leader = ctx.step % world
        if rank == leader:
            idx = torch.cat([packet_indices(self.compressor.encode(c, segment_ctx(ctx, seg)), seg.numel) + seg.offset
                             for seg, c in zip(segs, corrected)])
        else:
            idx = torch.empty(sum(counts), dtype=torch.int64, device=x.device)
        self.backend.broadcast(idx, leader).wait()
        check_leader_indices(idx, segs, counts)
        flat = torch.cat(corrected) if len(corrected) > 1 else corrected[0]
        values = torch.cat([flat[idx], flat.sum().reshape(1)])
        if self.feedback is not None:
            sent = torch.zeros_like(flat)
            sent[idx] = flat[idx]
            for seg, c in zip(segs, corrected):
                self._remember(seg.key, c, seg.of(sent))
        if average:
            values.div_(world)
        t1 = time.perf_counter()
        self.stats.encode_s += t1 - t0
        item, nidx = values.element_size(), idx.numel() * 8
        self._count(key, x, values.numel() * item + (nidx if rank == leader else 0),
                    values.numel() * item * (world - 1) + (0 if rank == leader else nidx))

        def finish(summed: torch.Tensor) -> torch.Tensor:
            t2 = time.perf_counter()
            self.stats.exchange_s += t2 - t1
            out = torch.zeros_like(x)
            out[idx] = summed[:-1]
            out.add_(summed[-1:] * 0)  # NaN/Inf anywhere on any rank reaches everyone
            self.stats.decode_s += time.perf_counter() - t2
            return out

        return self.backend.allreduce(values).then(finish)
