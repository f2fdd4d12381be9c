"""Checks of the `oktopk` strategy that run on any backend: gloo (tests/comm/test_oktopk.py) and
mpiexec (tests/comm/mpi_programs/oktopk.py). Each takes a Backend and raises AssertionError.

The oracle recomputes the documented selection rule densely from every rank's inputs (which
are deterministic, so each rank can rebuild them): exact top-k per segment on each rank, the
sum over ranks in rank order, keep the entries whose magnitude reaches the edge of the
histogram bin holding the k-th largest sum (at most k per region), regions balanced on the
kept indices every `boundary_every` steps.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from gradwire import Ctx
from gradwire.comm.backend import Backend, Work
from gradwire.comm.registry import make_strategy
from gradwire.errors import WireFormatError

SHIFT = 20  # histogram bin of a magnitude: its float32 bits >> 20


def inputs(rank: int, step: int, sizes: list[int], dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(7919 * step + rank)
    scale = torch.rand(sum(sizes), generator=g) * 4  # heavy tails, as gradients have
    return (torch.randn(sum(sizes), generator=g) * scale.exp()).to(dtype)


def exact_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Ascending indices of the k largest |x|, ties to the lowest index (a plain sort)."""
    return torch.argsort(-x.float().abs(), stable=True)[:k].sort().values


class Oracle:
    """The selection rule, densely, with its own copy of the region boundaries."""

    def __init__(self, world: int, sizes: list[int], ratio: float, boundary_every: int, min_numel: int = 0) -> None:
        self.world, self.sizes, self.boundary_every, self.steps = world, sizes, boundary_every, 0
        self.small = [n < min_numel for n in sizes]  # sent whole, always kept, outside the budget
        self.ks = [n if s else min(n, max(1, math.ceil(ratio * n))) if n else 0 for n, s in zip(sizes, self.small)]
        total = sum(sizes)
        self.bounds = [total * j // world for j in range(world + 1)]

    def step(self, xs: list[torch.Tensor], average: bool) -> torch.Tensor:
        dtype, total = xs[0].dtype, xs[0].numel()
        k = sum(kk for kk, s in zip(self.ks, self.small) if not s)
        forced = torch.zeros(total, dtype=torch.bool)
        offset = 0
        for n, s in zip(self.sizes, self.small):
            forced[offset: offset + n] = s
            offset += n
        acc = torch.float32 if dtype in (torch.float16, torch.bfloat16) else dtype
        summed = torch.zeros(total, dtype=acc)
        chosen = torch.zeros(total, dtype=torch.bool)
        for x in xs:  # rank order
            offset = 0
            for n, kk in zip(self.sizes, self.ks):
                idx = exact_topk(x[offset: offset + n], kk) + offset
                summed[idx] += x[idx].to(acc)
                chosen[idx] = True
                offset += n
        always = (chosen & forced).nonzero().view(-1)
        cand = (chosen & ~forced).nonzero().view(-1)
        bits = summed[cand].float().abs().view(torch.int32)
        edge = 0
        if cand.numel() >= k > 0:  # inside the k-th largest's bin, take the needed share of its bit range
            kth = int(bits.sort(descending=True).values[k - 1])
            lo = (kth >> SHIFT) << SHIFT
            in_bin = int(((bits >= lo) & (bits < lo + (1 << SHIFT))).sum())
            need = k - int((bits >= lo + (1 << SHIFT)).sum())
            edge = lo + (1 << SHIFT) - ((1 << SHIFT) * need) // in_bin
        kept = []
        for j in range(self.world):
            lo, hi = self.bounds[j], self.bounds[j + 1]
            inside = (cand >= lo) & (cand < hi) & (bits >= edge)
            pos, b = cand[inside], bits[inside]
            if pos.numel() > k:
                pos = pos[torch.argsort(b, descending=True, stable=True)[:k]].sort().values
            kept.append(pos)
        kept_all = torch.cat(kept + [always]).sort().values
        out = torch.zeros(total, dtype=dtype)
        vals = summed[kept_all]
        out[kept_all] = (vals / self.world if average else vals).to(dtype)
        self.steps += 1
        if (self.steps == 1 or self.steps % self.boundary_every == 0) and kept_all.numel() >= self.world:
            self.bounds = [0] + [int(kept_all[kept_all.numel() * j // self.world]) for j in range(1, self.world)] \
                + [total]
        return out


def _same_everywhere(b: Backend, t: torch.Tensor, what: str) -> None:
    raw = t.contiguous().view(-1).view(torch.uint8).clone()
    copies = [c.numpy().tobytes() for c in b.allgather(raw).wait()]
    assert len(set(copies)) == 1, f"{what}: ranks hold different results"


def _bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, what
    if not torch.equal(a.view(-1).view(torch.uint8), b.view(-1).view(torch.uint8)):
        bad = (a != b).nonzero().view(-1)[:5].tolist()
        raise AssertionError(f"{what}: differs from the oracle at {bad}: {a[bad].tolist()} vs {b[bad].tolist()}")


def matches_the_dense_oracle(b: Backend) -> None:
    """Every step (thresholds re-estimated each step, boundaries moving every 3) equals the oracle."""
    sizes = [3000, 1234, 7]
    shapes = [torch.Size([n]) for n in sizes]
    keys = ["w", "v", "bias"]
    for dtype, min_numel in ((torch.float32, 0), (torch.bfloat16, 0), (torch.float32, 8)):
        s = make_strategy("oktopk", b, "topk:ratio=0.02", error_feedback=False, boundary_every=3, threshold_every=1,
                          min_numel=min_numel)
        oracle = Oracle(b.world_size, sizes, 0.02, boundary_every=3, min_numel=min_numel)
        for step in range(5):
            average = step % 2 == 1
            x = inputs(b.rank, step, sizes, dtype)
            got = s.exchange(x, 0, Ctx(step=step, rank=b.rank), average=average, shapes=shapes, keys=keys).wait()
            want = oracle.step([inputs(r, step, sizes, dtype) for r in range(b.world_size)], average)
            _bits_equal(got, want, f"{dtype} step {step}")
            _same_everywhere(b, got, f"{dtype} step {step}")
            assert s.take_stats().bytes_sent > 0


def bytes_stay_within_6k_pairs(b: Backend) -> None:
    """Per rank and step: at most 6k (int32 index, fp32 value) pairs plus headers, at any P."""
    numel, ratio = 80_000, 0.01
    k = math.ceil(numel * ratio)
    s = make_strategy("oktopk", b, f"topk:ratio={ratio}", error_feedback=True)
    for step in range(4):
        s.exchange(inputs(b.rank, step, [numel], torch.float32), 0, Ctx(step=step, rank=b.rank)).wait()
        stats = s.take_stats()
        histogram = 4 * 2048  # the threshold estimate (step 0, every 32, or after a step far from k)
        headers = 16 * (b.world_size - 1) + 8 + 12
        assert stats.bytes_sent <= 6 * k * 8 + headers + histogram, (step, stats.bytes_sent, 6 * k * 8)
        assert stats.bytes_received <= 6 * k * 8 + headers * b.world_size + 2 * histogram, (step, stats.bytes_received)


def empty_and_all_selected_ranks_work(b: Backend) -> None:
    world, rank = b.world_size, b.rank
    # ratio 1: every entry selected everywhere -> the dense sum in rank order; rank 0 all zeros
    s = make_strategy("oktopk", b, "topk:ratio=1.0", error_feedback=False)
    xs = [inputs(r, 0, [501], torch.float32) * (r != 0) for r in range(world)]
    got = s.exchange(xs[rank].clone(), 0, Ctx(rank=rank)).wait()
    want = torch.zeros(501)
    for x in xs:
        want += x
    _bits_equal(got, want, "ratio=1")
    # an empty bucket
    s = make_strategy("oktopk", b, "topk:ratio=0.1", error_feedback=False)
    assert s.exchange(torch.zeros(0), 0, Ctx(rank=rank)).wait().numel() == 0
    # fewer elements than ranks: some regions are empty
    got = s.exchange(torch.full((1,), float(rank + 1)), 1, Ctx(rank=rank)).wait()
    assert got.tolist() == [world * (world + 1) / 2]


def nonfinite_reaches_every_rank(b: Backend) -> None:
    s = make_strategy("oktopk", b, "topk:ratio=0.01", error_feedback=True)
    x = inputs(b.rank, 0, [2000], torch.float32)
    if b.rank == b.world_size - 1:
        x[5] = float("inf")
    got = s.exchange(x, 0, Ctx(rank=b.rank)).wait()
    assert not torch.isfinite(got).all()
    _same_everywhere(b, got, "non-finite")


def error_feedback_keeps_what_was_not_sent(b: Backend) -> None:
    """sum over ranks of (corrected - residual) is the result: nothing lost, nothing twice."""
    s = make_strategy("oktopk", b, "topk:ratio=0.05", error_feedback=True)
    for step in range(3):
        x = inputs(b.rank, step, [4000], torch.float32)
        corrected = s.feedback.correct(x, "0")  # type: ignore[union-attr]
        got = s.exchange(x, 0, Ctx(step=step, rank=b.rank)).wait()
        residual = s.feedback.residuals["0"]  # type: ignore[union-attr]
        contributed = b.allreduce((corrected - residual).clone()).wait()
        assert torch.allclose(contributed, got, rtol=1e-5, atol=1e-5), f"step {step}"
        assert int((got != 0).sum()) > 0


class _CorruptingBackend(Backend):
    """A real backend whose rank 1 sends rank 0 an out-of-region index (a hostile peer)."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        if self.rank == 1:
            chunks = list(chunks)
            chunks[0] = torch.tensor([10**6, 0], dtype=torch.int32).view(torch.uint8)[:8].clone()
        return self.inner.alltoall(chunks, recv_counts, max_recv)

    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        return self.inner.allreduce(t)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        return self.inner.allgather(t)

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        return self.inner.allgatherv(t, max_numel)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        return self.inner.broadcast(t, src)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        return self.inner.allgather_ints(values)


def hostile_chunk_fails_every_rank(b: Backend) -> None:
    s = make_strategy("oktopk", _CorruptingBackend(b), "topk:ratio=0.01", error_feedback=False)
    try:
        s.exchange(inputs(b.rank, 0, [2000], torch.float32), 0, Ctx(rank=b.rank)).wait()
    except WireFormatError as e:
        assert "rank 1 sent rank 0 a malformed chunk" in str(e), str(e)
    else:
        raise AssertionError("a malformed chunk did not raise WireFormatError on this rank")


CHECKS = [matches_the_dense_oracle, bytes_stay_within_6k_pairs, empty_and_all_selected_ranks_work,
          nonfinite_reaches_every_rank, error_feedback_keeps_what_was_not_sent, hostile_chunk_fails_every_rank]
