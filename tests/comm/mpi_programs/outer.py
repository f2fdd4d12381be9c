"""DiLoCo over MPI (gradwire.outer through MPIBackend): the outer loop matches the replicas
simulated in one process, streamed int8 keeps the replicas identical, a rank with another H
fails on every rank.
mpiexec -n 2 python tests/comm/mpi_programs/run.py outer"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import check, same_on_all_ranks  # noqa: E402

from gradwire.errors import ConfigMismatchError  # noqa: E402
from gradwire.outer import DiLoCo  # noqa: E402

STEPS, SYNC_EVERY, LR = 12, 4, 0.1


def model() -> nn.Module:
    torch.manual_seed(0)  # the same initial weights on every replica
    return nn.Sequential(nn.Linear(16, 32), nn.Tanh(), nn.Linear(32, 4))


def inner_step(m: nn.Module, rank: int, step: int) -> None:
    """Plain SGD on this replica's own batch (by hand: no torch.optim in the inner loop)."""
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(6, 16, generator=gen), torch.randn(6, 4, generator=gen)
    m.zero_grad()
    nn.functional.mse_loss(m(x), y).backward()
    with torch.no_grad():
        for p in m.parameters():
            p.sub_(p.grad, alpha=LR)


def simulate(world: int) -> list[torch.Tensor]:
    """Every replica in one process, from DiLoCo's equations: every SYNC_EVERY steps the mean of
    (global - local) steps the global weights by Nesterov SGD (lr 0.7, momentum 0.9)."""
    models = [model() for _ in range(world)]
    glob = [p.detach().clone() for p in models[0].parameters()]
    velocity = [torch.zeros_like(g) for g in glob]
    for step in range(STEPS):
        for r, m in enumerate(models):
            inner_step(m, r, step)
        if (step + 1) % SYNC_EVERY:
            continue
        with torch.no_grad():
            for i, g in enumerate(glob):
                delta = sum(g - list(m.parameters())[i] for m in models) / world
                velocity[i] = 0.9 * velocity[i] + delta
                g -= 0.7 * (delta + 0.9 * velocity[i])
                for m in models:
                    list(m.parameters())[i].copy_(g)
    return glob


def train(b, **options) -> tuple[nn.Module, DiLoCo]:
    m = model()
    outer = DiLoCo(m, sync_every=SYNC_EVERY, backend=b, **options)
    for step in range(STEPS):
        inner_step(m, b.rank, step)
        outer.step()
    outer.finish()
    return m, outer


@check
def diloco_matches_the_simulated_replicas(b) -> None:
    m, outer = train(b)
    same_on_all_ranks(b, "parameters after DiLoCo", *m.parameters())
    for got, want in zip(m.parameters(), simulate(b.world_size)):
        torch.testing.assert_close(got.detach(), want, rtol=1e-5, atol=1e-6)
    numel = sum(p.numel() for p in m.parameters())
    assert [s["bytes_sent"] for s in outer.stats] == [4 * numel] * (STEPS // SYNC_EVERY), outer.stats


@check
def streamed_int8_keeps_the_replicas_identical(b) -> None:
    m, outer = train(b, compressor="int8", fragments=2, delay=1)
    same_on_all_ranks(b, "global weights after streamed int8 DiLoCo", *outer.globals)  # (local ones trained on)
    numel = sum(p.numel() for p in m.parameters())
    assert len(outer.stats) == 2 * STEPS // SYNC_EVERY  # each fragment once per period
    assert sum(s["dense_bytes"] for s in outer.stats) == STEPS // SYNC_EVERY * 4 * numel
    big = [s for s in outer.stats if s["dense_bytes"] >= 2048]  # the 32 x 16 weight's fragment
    assert big and all(s["bytes_sent"] < s["dense_bytes"] / 3 for s in big), outer.stats  # a byte a value
    assert all(s["bytes_sent"] < s["dense_bytes"] for s in outer.stats), outer.stats  # (+ headers and scales)
    drift = max((a - w).abs().max().item() for a, w in zip(m.parameters(), simulate(b.world_size)))
    assert 0 < drift < 0.05, drift  # quantized and one step late: near the uncompressed run, not on it


@check
def another_sync_period_fails_on_every_rank(b) -> None:
    try:
        DiLoCo(model(), sync_every=SYNC_EVERY + (b.rank == 0), backend=b)
    except ConfigMismatchError as exc:
        assert "sync_every" in str(exc), exc
    else:
        raise AssertionError("a rank with another sync_every was not refused")
