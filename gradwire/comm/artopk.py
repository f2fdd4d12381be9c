"""`artopk`: AR-compatible top-k (Tyagi & Swany, 2023): a rotating leader's top-k positions for all.

At step s the leader is rank s mod P. It picks the top-k indices of each segment of its
error-corrected gradient (the compressor's rule) and broadcasts them; every rank then
allreduces its own corrected values at those positions, so the sum is exact there and zero
elsewhere. One extra element carries sum(x), so a NaN/Inf on any rank reaches every rank. Error
feedback keeps, per rank, everything outside the leader's positions. Every rank checks the
broadcast indices before the allreduce, so a hostile leader makes all ranks raise
WireFormatError instead of hanging.

Tests: tests/comm/test_artopk.py (an independent oracle, real gloo ranks),
tests/compress/hostile/run_corpus.py (the leader-index check).
"""

from __future__ import annotations

import time

import torch

from ..compress import Compressor, Ctx, indexcodec
from ..compress.wire import Kind, Packet
from ..errors import WireFormatError
from .backend import Backend, Work
from .base import Segment, Strategy, StrategyTraits, Workload, segment_ctx, segments_of
from .links import Links


def packet_indices(packet: Packet, numel: int) -> torch.Tensor:
    """The ascending int64 indices a sparse packet carries (raw or delta-packed)."""
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
    TRAITS = StrategyTraits("artopk", frozenset(), stateful=True)

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True) -> None:
        super().__init__(backend, compressor, error_feedback)
        if not self.compressor.selects_global_topk:
            raise ValueError(f"artopk needs a plain topk compressor (it selects from the sum over ranks, "
                             f"not per chunk), got {self.compressor}")

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

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float:
        """The leader's k int64 indices broadcast, then k values and the sum allreduced."""
        k = sum(self.compressor.value_count(n) for n in work.sizes)  # type: ignore[attr-defined]
        return (links.flat.broadcast(8 * k // work.share, world)
                + links.flat.allreduce((k + 1) * work.dtype.itemsize // work.share, world))

    def compute_seconds(self, work: Workload, world: int) -> float:
        """The leader's selection, which every rank waits for, and one scatter of the sum."""
        return work.numel // work.share * (work.encode_s + work.decode_s)
