"""A rank that dies or freezes mid-training: every survivor raises within the group's timeout and
completes no further optimizer step (issue: a failed collective never goes unnoticed).

Real gloo groups with a short timeout (PG_TIMEOUT); the victim (the last rank) exits with
os._exit or sleeps, between steps or in the middle of an exchange (tests/adversary.Saboteur).
Each survivor reports what it raised, after how many seconds and how many optimizer steps it
completed; the victim reports nothing.
"""

from __future__ import annotations

import os
import time
from typing import Any

import pytest
import torch

from adversary import Saboteur, outcome
from multiproc import run_ranks

PG_TIMEOUT = 8.0  # seconds; torch's default is 30 minutes
SLACK = 20.0  # a survivor must fail within PG_TIMEOUT + SLACK (spawned ranks share 2 cores)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.ReLU(), torch.nn.Linear(64, 4))


def _ddp_run(rank: int, world: int, spec: str, options: dict[str, Any], fail: str, at_step: int) -> dict[str, Any]:
    """Train 6 steps with the DDP hook; the victim fails at `at_step` (`fail`: "die" or "freeze"
    between steps, or "die between P and Q" inside PowerSGD's exchange)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwire.hooks import ddp as gw_ddp

    victim = rank == world - 1
    model = DDP(_model())
    state = gw_ddp.register(model, spec, **options)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)

    def sabotage(step: int) -> None:
        if victim and step == at_step:
            if fail == "die":
                os._exit(17)
            if fail == "freeze":
                time.sleep(600)
            if fail == "die between P and Q":  # PowerSGD: dense, P, then Q allreduce per step
                state.strategy.backend = Saboteur(state.strategy.backend, "allreduce", at=3)

    return _train(rank, model, opt, 6, sabotage)


def _train(rank: int, model: torch.nn.Module, opt: torch.optim.Optimizer, steps: int, before_step) -> dict[str, Any]:
    """Train `steps` steps, calling before_step(step) first in each; the outcome and how many
    optimizer steps completed."""
    done = 0
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))

    def train() -> None:
        nonlocal done
        for step in range(steps):
            before_step(step)
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            done += 1

    result = outcome(train)
    result["steps"] = done
    return result


DDP_CASES = {
    "fp16 allreduce, a rank dies": ("fp16", {}, "die", 3),
    "powersgd, a rank dies between P and Q": ("none", {"strategy": "powersgd", "rank": 2}, "die between P and Q", 2),
    "topk allgather, a rank freezes": ("topk:ratio=0.05", {"strategy": "allgather"}, "freeze", 3),
    "topk oktopk, a rank dies": ("topk:ratio=0.05", {"strategy": "oktopk"}, "die", 3),
}


@pytest.mark.parametrize("case", list(DDP_CASES))
def test_ddp_survivors_raise_and_stop_when_a_rank_fails(case: str) -> None:
    spec, options, fail, at_step = DDP_CASES[case]
    world = 3
    results = run_ranks(_ddp_run, world, spec, options, fail, at_step, timeout=180, may_die=(world - 1,),
                        pg_timeout=PG_TIMEOUT)
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] != "ok", (case, rank, got)
        assert "CollectiveError" in got["message"] or got["kind"] == "CollectiveError", (case, rank, got)
        assert got["steps"] == at_step, (case, rank, got)  # no optimizer step after the failure
        assert got["seconds"] < PG_TIMEOUT + SLACK, (case, rank, got)


def _exchanger_run(rank: int, world: int, strategy: str, spec: str, options: dict[str, Any],
                   fail: str) -> dict[str, Any]:
    """GradientExchanger over torch.distributed: the victim fails in the second exchange; the
    survivors' gradients must stay what they were (nothing built from data that never came)."""
    from gradwire.comm.api import GradientExchanger
    from gradwire.comm.torch_dist import TorchDistBackend

    victim = rank == world - 1
    model = _model()
    ex = GradientExchanger(spec, backend=TorchDistBackend(), strategy=strategy, **options)
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    model(x).square().mean().backward()
    ex.exchange_(model.named_parameters())
    if victim:
        if fail == "freeze in the inner exchange":  # hierarchical: between nodes, on a sub-group
            ex.strategy.inner.backend = Saboteur(ex.strategy.inner.backend, "any", at=1, mode="freeze")
        else:
            os._exit(17)
    before = [p.grad.clone() for p in model.parameters()]
    result = outcome(lambda: ex.exchange_(model.named_parameters()))
    result["grads unchanged"] = all(torch.equal(b, p.grad) for b, p in zip(before, model.parameters()))
    return result


EXCHANGER_CASES = {
    "allgather": ("allgather", "topk:ratio=0.05", {}, 3, "die"),
    "allreduce": ("allreduce", "fp16", {}, 3, "die"),
    "artopk": ("artopk", "topk:ratio=0.05", {}, 3, "die"),
    "oktopk": ("oktopk", "topk:ratio=0.05", {}, 3, "die"),
    "powersgd": ("powersgd", "none", {"rank": 2}, 3, "die"),
    "dense": ("dense", "none", {}, 3, "die"),
    "auto": ("auto", "topk:ratio=0.05", {"trials": 0}, 3, "die"),
    "hierarchical": ("hierarchical", "topk:ratio=0.05", {"ranks_per_node": 2}, 4, "die"),
    "hierarchical, frozen between nodes": ("hierarchical", "topk:ratio=0.05", {"ranks_per_node": 2}, 4,
                                           "freeze in the inner exchange"),
}


@pytest.mark.parametrize("case", list(EXCHANGER_CASES))
def test_exchanger_survivors_raise_without_touching_gradients(case: str) -> None:
    strategy, spec, options, world, fail = EXCHANGER_CASES[case]
    results = run_ranks(_exchanger_run, world, strategy, spec, options, fail, timeout=180,
                        may_die=(world - 1,), pg_timeout=PG_TIMEOUT)
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] == "CollectiveError", (case, rank, got)
        assert got["grads unchanged"], (case, rank)
        # sub-groups (hierarchical's node and between-node groups) inherit the short timeout
        assert got["seconds"] < PG_TIMEOUT + SLACK, (case, rank, got)


def _fsdp_run(rank: int, world: int) -> dict[str, Any]:
    """FSDP2 with the compressed reduce-scatter; the victim dies inside it, in its third step."""
    from torch.distributed.fsdp import fully_shard

    from gradwire.hooks import fsdp as gw_fsdp

    model = _model()
    for layer in model:
        if isinstance(layer, torch.nn.Linear):
            fully_shard(layer)
    fully_shard(model)
    state = gw_fsdp.register(model, "int8")

    def sabotage(step: int) -> None:
        if rank == world - 1 and step == 2:  # dies inside the first compressed reduce-scatter of step 2
            state._strategy.backend = Saboteur(state._strategy.backend, "alltoall", at=1)

    return _train(rank, model, torch.optim.SGD(model.parameters(), lr=0.1), 5, sabotage)


def test_fsdp_survivors_raise_and_stop_when_a_rank_dies() -> None:
    results = run_ranks(_fsdp_run, 3, timeout=180, may_die=(2,), pg_timeout=PG_TIMEOUT)
    for rank, got in enumerate(results[:-1]):
        assert got["kind"] != "ok" and got["steps"] == 2, (rank, got)
        assert "CollectiveError" in got["kind"] + got["message"], (rank, got)
        assert got["seconds"] < PG_TIMEOUT + SLACK, (rank, got)
