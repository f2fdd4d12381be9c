"""The `artopk` strategy on real gloo ranks, against an oracle that rebuilds what AR-top-k must
produce from every rank's inputs (deterministic, so each rank can recompute all of them):

at step s the leader is rank s mod P; in each segment it picks the k = ceil(n/20) positions of
largest |corrected gradient| (corrected = gradient + its residual); the result is, at those
positions, the sum over ranks of each rank's corrected values (each divided by P first when
averaging), and zero elsewhere; each rank's new residual is its corrected gradient with those
positions zeroed.

Tolerance: on 2 ranks the sum is one addition, which gloo and the oracle round alike, so results
and residuals are compared bit for bit. On 3 ranks gloo's ring adds in an order of its own, so the
summed values may differ from the oracle's rank-order sum by at most 4 float32 ulps of the sum of
their magnitudes; positions, zeros and residuals are still compared bit for bit.
"""

from __future__ import annotations

import pytest
import torch

from gradwire import Ctx
from gradwire.comm.backend import Backend, Work
from gradwire.comm.registry import make_strategy
from gradwire.comm.torch_dist import TorchDistBackend
from gradwire.errors import WireFormatError
from multiproc import run_ranks

SIZES = [600, 37, 5]  # a matrix-sized tensor, a bias, a tiny one (k = 1)
KEYS = ["w", "b", "tiny"]
SPEC = "topk:ratio=0.05"
EPS32 = 2.0 ** -23


def _k(n: int) -> int:
    return min(n, max(1, -(-n // 20)))  # ceil(0.05 n) in integers: no float noise


def _input(rank: int, step: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(104729 * step + rank)
    return torch.randn(sum(SIZES), generator=g) * torch.rand(sum(SIZES), generator=g).mul(3).exp()


class Oracle:
    """AR-top-k computed densely for all ranks at once, with its own residuals."""

    def __init__(self, world: int, error_feedback: bool) -> None:
        self.world, self.error_feedback = world, error_feedback
        self.residuals = [torch.zeros(sum(SIZES)) for _ in range(world)]

    def positions(self, corrected: torch.Tensor) -> torch.Tensor:
        """Ascending positions of each segment's k largest magnitudes, as bucket offsets."""
        out, offset = [], 0
        for n in SIZES:
            part = corrected[offset: offset + n].abs()
            out.append(torch.argsort(part, descending=True, stable=True)[: _k(n)].sort().values + offset)
            offset += n
        return torch.cat(out)

    def step(self, step: int, average: bool, leader: int | None = None) -> dict:
        """This step's result, its positions, every rank's new residual and, per position, the
        sum of the magnitudes added there (for the 3-rank tolerance). `leader` overrides the
        rotation without advancing the residuals (to show a wrong leader would be noticed)."""
        corrected = [_input(r, step) + (self.residuals[r] if self.error_feedback else 0) for r in range(self.world)]
        idx = self.positions(corrected[step % self.world if leader is None else leader])
        summed, magnitudes = torch.zeros(idx.numel()), torch.zeros(idx.numel())
        for c in corrected:  # rank order
            values = c[idx] / self.world if average else c[idx]
            summed = summed + values
            magnitudes += values.abs()
        result = torch.zeros(sum(SIZES))
        result[idx] = summed
        residuals = []
        for c in corrected:
            kept = c.clone()
            kept[idx] = 0.0
            residuals.append(kept)
        if leader is None and self.error_feedback:
            self.residuals = residuals
        return {"want": result, "idx": idx, "residuals": residuals, "magnitudes": magnitudes}


def _run(rank: int, world: int, error_feedback: bool) -> dict:
    backend = TorchDistBackend()
    s = make_strategy("artopk", backend, SPEC, error_feedback=error_feedback)
    oracle = Oracle(world, error_feedback)
    shapes = [torch.Size([n]) for n in SIZES]
    report: dict = {"steps": [], "wrong_leader_noticed": 0}
    for step in range(2 * world + 1):  # every rank leads at least twice
        average = step % 2 == 1
        got = s.exchange(_input(rank, step), 0, Ctx(step=step, rank=rank), average=average, shapes=shapes,
                         keys=KEYS).wait()
        stats = s.take_stats()
        wrong = oracle.step(step, average, leader=(step + 1) % world)["want"]  # (before the real step)
        want = oracle.step(step, average)
        residual = torch.cat([s.feedback.residuals[k] for k in KEYS]) if error_feedback else None  # type: ignore
        everyone = [t.numpy().tobytes() for t in backend.allgather(got.view(torch.uint8).clone()).wait()]
        report["steps"].append({"got": got, **want, "residual": residual, "want_residual": want["residuals"][rank],
                                "same_on_all_ranks": len(set(everyone)) == 1, "bytes_sent": stats.bytes_sent,
                                "leader": step % world})
        if not torch.equal(wrong, want["want"]):
            report["wrong_leader_noticed"] += 1
    return report


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("error_feedback", [True, False])
def test_artopk_matches_the_oracle(world: int, error_feedback: bool) -> None:
    k_total = sum(_k(n) for n in SIZES)
    for rank, report in enumerate(run_ranks(_run, world, error_feedback, timeout=300)):
        # a wrong leader's positions would give another result: the comparison below can tell
        assert report["wrong_leader_noticed"] == len(report["steps"])
        for step, r in enumerate(report["steps"]):
            got, want, idx = r["got"], r["want"], r["idx"]
            where = f"rank {rank}, step {step}"
            assert r["same_on_all_ranks"], f"{where}: ranks hold different results"
            assert idx.numel() == k_total
            assert torch.equal(got.nonzero().view(-1), want.nonzero().view(-1)), f"{where}: other positions"
            if world == 2:
                assert torch.equal(got.view(torch.int32), want.view(torch.int32)), f"{where}: not bit for bit"
            else:
                err = (got[idx] - want[idx]).abs()
                assert bool((err <= 4 * EPS32 * r["magnitudes"]).all()), f"{where}: off by {err.max()}"
            if error_feedback:
                assert torch.equal(r["residual"].view(torch.int32), r["want_residual"].view(torch.int32)), \
                    f"{where}: residual differs from corrected minus what was sent"
            # the leader sends its k int64 indices and k + 1 float32 values, the others the values
            expected = (k_total + 1) * 4 + (8 * k_total if r["leader"] == rank else 0)
            assert r["bytes_sent"] == expected, f"{where}: sent {r['bytes_sent']} bytes, expected {expected}"


def _nonfinite(rank: int, world: int) -> list[bool]:
    s = make_strategy("artopk", TorchDistBackend(), SPEC, error_feedback=True)
    x = _input(rank, 0)
    if rank == world - 1:
        x[3] = float("inf")  # on a rank that does not lead step 0
    got = s.exchange(x, 0, Ctx(step=0, rank=rank), shapes=[torch.Size([n]) for n in SIZES], keys=KEYS).wait()
    return [bool(torch.isnan(got).all())]


def test_a_nonfinite_gradient_on_any_rank_reaches_every_rank() -> None:
    assert run_ranks(_nonfinite, 2) == [[True], [True]]


class _LyingLeader(Backend):
    """A real backend whose rank 0, leading step 0, broadcasts an index outside its segment."""

    def __init__(self, inner: Backend) -> None:
        self.inner, self.rank, self.world_size = inner, inner.rank, inner.world_size

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        if self.rank == src == 0:
            t[0] = sum(SIZES) + 7
        return self.inner.broadcast(t, src)

    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        return self.inner.allreduce(t)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        return self.inner.allgather(t)

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        return self.inner.allgatherv(t, max_numel)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        return self.inner.alltoall(chunks, recv_counts, max_recv)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        return self.inner.allgather_ints(values)


def _lying_leader(rank: int, world: int) -> str:
    s = make_strategy("artopk", _LyingLeader(TorchDistBackend()), SPEC, error_feedback=False)
    try:
        s.exchange(_input(rank, 0), 0, Ctx(step=0, rank=rank), shapes=[torch.Size([n]) for n in SIZES],
                   keys=KEYS).wait()
    except WireFormatError as e:
        return str(e)
    return "no error"


def test_a_leader_index_outside_its_segment_fails_every_rank() -> None:
    for message in run_ranks(_lying_leader, 2):
        assert "leader's indices are out of their segments" in message, message
