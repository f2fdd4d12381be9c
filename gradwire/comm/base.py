"""What every exchange strategy shares: its statistics, a bucket's segments, the allgather message
layout, the dtypes sums accumulate in, what is worth compressing, and the `Strategy` base.

A bucket holds one or more segments (the parameters DDP packed into it). Compression,
randomness and error feedback work per segment under the segment's stable key (a parameter
name), so results do not depend on how DDP groups parameters into buckets, which changes
after its first iteration and again in a resumed process. Each strategy still makes one
collective per bucket. A segment whose packet would not be smaller than its dense bytes is
sent uncompressed.

Every strategy returns a `Work` of the bucket's sum (or mean with average=True), records what it
sent and received in `stats`, and models its own cost (`modelled_seconds`), so `auto` compares
strategies without knowing their wire formats. The strategies live one per module above this
one; `auto` above them; the registry on top.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace
from typing import Any, ClassVar, Iterable

import torch

from ..compress import Compressor, Ctx, ErrorFeedback, compressor as make_compressor
from ..errors import WireFormatError
from .backend import Backend, Work
from .links import Links

#: Half-precision values are summed in float32 and rounded once, so sums do not lose bits to
#: every addition (and match on every rank); other dtypes are summed as they are.
ACCUMULATE = {torch.float16: torch.float32, torch.bfloat16: torch.float32}


def accumulation_dtype(dtype: torch.dtype) -> torch.dtype:
    return ACCUMULATE.get(dtype, dtype)


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


def take_stats_of(strategies: Iterable["CompressingExchange"]) -> ExchangeStats:
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


def split_message(message: torch.Tensor, count: int) -> list[torch.Tensor]:
    """The packets of one message (an int64 length per segment, then the packets: allgather's
    and the reduce-scatter's layout); a malformed table raises WireFormatError."""
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


def estimated_packet_bytes(c: Compressor, numel: int, dtype: torch.dtype) -> int | None:
    """Packet size from numel alone (identical on every rank), or None if data-dependent
    with no estimate."""
    static = c.static_size(numel, dtype)
    if static is not None:
        return static
    count = getattr(c, "value_count", None) or getattr(getattr(c, "first", None), "value_count", None)
    if count is not None and count(numel) is not None:
        return 128 + count(numel) * (dtype.itemsize + 4)
    return None


def worth_compressing(c: Compressor, numel: int, dtype: torch.dtype) -> bool:
    """Whether c's packet for numel elements is smaller than the dense bytes (decided from numel
    and dtype alone, so identically on every rank; unknown sizes count as worth it)."""
    est = estimated_packet_bytes(c, numel, dtype)
    return est is None or est < numel * dtype.itemsize


@dataclass(frozen=True)
class Workload:
    """What a strategy's cost model prices: tensors of `sizes` elements (`shapes` when known) of
    `dtype`; encode and decode seconds per element (measured by `auto`; 0: not counted); and
    `share`: the rank carries 1/share of the bytes and elements (`hierarchical`'s chunk between
    nodes). Shared amounts are floor-divided, as a node's chunk is."""

    sizes: list[int]
    dtype: torch.dtype
    shapes: list[torch.Size] | None = None
    encode_s: float = 0.0
    decode_s: float = 0.0
    share: int = 1

    @property
    def numel(self) -> int:
        return sum(self.sizes)

    @property
    def dense_bytes(self) -> int:
        return self.numel * self.dtype.itemsize


@dataclass(frozen=True)
class StrategyTraits:
    """What an entry point must know about a strategy, declared once on its class (`TRAITS`)
    and collected by the registry, so that no hook matches on strategy names."""

    name: str
    #: option names the strategy takes (None: it checks its own, e.g. `inner=` and the inner's)
    options: frozenset[str] | None
    #: compresses by itself and ignores the compressor (PowerSGD): its error feedback is on by
    #: default and `seed=` seeds its shared random init
    own_compression: bool = False
    #: keeps state per bucket across steps, so DDP's buckets must have settled (start_iter >= 2)
    stateful: bool = False
    #: stateful unless its compressor is summable (auto, which then never leaves an allreduce)
    stateful_unless_summable: bool = False
    #: takes a new compressor every step (`set_compressor`: DGC's density warm-up)
    swaps_compressor: bool = False
    #: takes `inner=` (a strategy name) and `ranks_per_node=`; `traits()` resolves the inner one
    wraps_inner: bool = False
    #: a reduce-scatter (FSDP2's reduce-scatter), not an all-reduce of whole buckets
    reduce_scatter: bool = False
    #: usable on HSDP's cross-replica all-reduce
    cross_replica: bool = True
    #: `exchange` only issues collectives and never waits inside, so exchanges may start in
    #: whatever order a rank's backward reaches them (from gradient hooks)
    never_waits: bool = False
    #: the sum is one allreduce of a linear payload, so a backend that averages after summing
    #: (Horovod's hvd.Average) may do the averaging
    one_linear_allreduce: bool = False


class CompressingExchange:
    """What strategies and reduce-scatters hold: the backend, the compressor, optional error
    feedback and this step's statistics; and the rule for which segments are worth compressing."""

    name = "exchange"
    #: the registry's entry for this class (None: not built by name)
    TRAITS: ClassVar[StrategyTraits | None] = None

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
        return numel >= self.min_numel and worth_compressing(self.compressor, numel, dtype)

    def _codec(self, seg: Segment, dtype: torch.dtype) -> Compressor:
        """The compressor for one segment: raw (`none`) when compressing it does not pay."""
        return self.compressor if self.compresses(seg.numel, dtype) else self.raw

    def _correct(self, x: torch.Tensor, key: str) -> torch.Tensor:
        return self.feedback.correct(x, key) if self.feedback is not None else x

    def _remember(self, key: str, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        if self.feedback is not None:
            self.feedback.update(key, corrected, sent)

    def take_leftover(self, x: torch.Tensor, key: int | str, shapes: list[torch.Size] | None = None,
                      keys: list[str] | None = None) -> torch.Tensor | None:
        """What error feedback still holds for this bucket, laid out as x and removed from it (None:
        nothing). When another strategy takes the bucket over (`auto` after its trial), a rank
        adds it to its next gradient, so what this one held back is sent, not lost."""
        if self.feedback is None:
            return None
        out, found = torch.zeros_like(x), False
        for seg in segments_of(x, key, shapes, keys):
            e = self.feedback.residuals.pop(seg.key, None)
            if e is not None and e.numel() == seg.numel:
                seg.of(out).copy_(e.reshape(-1))
                found = True
        return out if found else None

    def state_dict(self) -> dict[str, Any]:
        return {"feedback": self.feedback.state_dict() if self.feedback is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if (state.get("feedback") is None) != (self.feedback is None):
            raise ValueError("checkpoint and strategy disagree on whether error feedback is on")
        if self.feedback is not None:
            self.feedback.load_state_dict(state["feedback"])


class Strategy(CompressingExchange):
    """An all-reduce of whole buckets: `exchange` returns every rank's sum (or mean)."""

    name = "strategy"
    #: what the DDP hook's uncompressed first steps use instead of a plain allreduce (None: that)
    warmup_strategy: "Strategy | None" = None

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True,
                 min_numel: int = 0) -> None:
        super().__init__(backend, compressor, error_feedback, min_numel)
        #: the result may be written into the exchanged tensor (the DDP hook's bucket buffer,
        #: which torch's own hooks overwrite too); otherwise results are fresh tensors
        self.into_input = False

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        """Sum (or mean) of the flat bucket x over ranks. `shapes`/`keys` name its segments."""
        raise NotImplementedError

    # ---- its cost, for `auto` ----------------------------------------------------------
    def modelled_seconds(self, links: Links, work: Workload, world: int) -> float | None:
        """Modelled seconds to exchange `work` over `world` ranks on `links`: the wire, then
        encode and decode; None when the strategy cannot tell before sending."""
        wire = self.wire_seconds(links, work, world)
        return None if wire is None else wire + self.compute_seconds(work, world)

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float | None:
        """The collectives' modelled seconds (None: not modelled)."""
        return None

    def compute_seconds(self, work: Workload, world: int) -> float:
        """Encode and decode seconds from the workload's per-element costs (0: not modelled)."""
        return 0.0

    # ---- helpers ---------------------------------------------------------------------
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
