"""Striped allreduce over several gloo connections (TorchDistBackend(stripes=K), GRADWIRE_GLOO_STRIPES)
on real gloo ranks: the same sums on every rank, only large tensors striped, disagreement raised
on every rank. Its goodput across a long link: benchmarks/wan_links.py."""

from __future__ import annotations

import os
import threading
import time

import pytest
import torch
import torch.distributed as dist

from gradwire.comm.torch_dist import STRIPE_MIN_BYTES, TorchDistBackend, stripes_from_env
from gradwire.errors import ConfigMismatchError
from gradwire.hooks import ddp as gw_ddp
from multiproc import run_ranks


def _striped(rank: int, world: int) -> dict:
    gen = torch.Generator().manual_seed(rank)
    big = torch.randn(STRIPE_MIN_BYTES // 4 * 3 + 5, generator=gen)  # not a multiple of the stripes
    small = torch.randn(1000, generator=gen)
    plain, striped = TorchDistBackend(stripes=1), TorchDistBackend(stripes=3)
    want = plain.allreduce(big.clone()).wait()
    small_out = striped.allreduce(small.clone()).wait()
    made_for_small = striped._stripe_groups is not None
    got = striped.allreduce(big.clone()).wait()
    inter = striped.split(rank % 2, rank)  # sub-groups stripe too
    sub = inter.allreduce(big.clone()).wait()
    return {"want": want, "got": got, "small": small_out, "small_want": plain.allreduce(small.clone()).wait(),
            "made_for_small": made_for_small, "groups": len(striped._stripe_groups or []),
            "sub": sub, "sub_stripes": inter.stripes}


@pytest.mark.parametrize("world", [2, 4])
def test_a_striped_allreduce_gives_every_rank_the_same_sums(world: int) -> None:
    results = run_ranks(_striped, world)
    a = results[0]
    assert a["groups"] == 3 and not a["made_for_small"]  # small tensors never opened the extra connections
    assert torch.equal(a["small"], a["small_want"])
    torch.testing.assert_close(a["got"], a["want"], rtol=1e-6, atol=1e-6)  # the same sums, pieces in other rings
    if world == 2:
        assert torch.equal(a["got"], a["want"])  # two ranks: x + y either way round
    assert a["sub_stripes"] == 3
    for r in results[1:]:
        assert torch.equal(r["got"], a["got"]) and torch.equal(r["small"], a["small"])  # replicas stay identical


def _disagree(rank: int, world: int) -> str:
    backend = TorchDistBackend(stripes=2 + rank)
    try:
        backend.allreduce(torch.zeros(STRIPE_MIN_BYTES // 4))
    except ConfigMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_told_different_stripes_all_raise() -> None:
    for message in run_ranks(_disagree, 2):
        assert "different numbers of gloo stripes" in message and "[2, 3]" in message


def _hook_with_env_stripes(rank: int, world: int) -> list[torch.Tensor]:
    os.environ["GRADWIRE_GLOO_STRIPES"] = "4"
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(256, 512), torch.nn.ReLU(), torch.nn.Linear(512, 10)))
    state = gw_ddp.register(model, "bf16", strategy="allreduce")
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    gen = torch.Generator().manual_seed(rank)
    for _ in range(4):
        opt.zero_grad()
        model(torch.randn(8, 256, generator=gen)).sum().backward()
        opt.step()
    assert state.strategy.backend.stripes == 4 and state.strategy.backend._stripe_groups is not None
    return [p.detach().clone() for p in model.parameters()]


def test_the_hook_stripes_when_the_environment_says_so() -> None:
    a, b = run_ranks(_hook_with_env_stripes, 2)
    assert all(torch.equal(x, y) for x, y in zip(a, b))


_torn_down = threading.Event()


class _HoldsTheThreadUntilTeardown:
    def __del__(self) -> None:
        _torn_down.wait(10)


def _released_on_the_groups_own_thread(rank: int, world: int, which: str) -> str:
    backend = TorchDistBackend(stripes=2).split(0, rank)  # a group split() made, striped
    backend.allreduce(torch.ones(STRIPE_MIN_BYTES // 4)).wait()
    group = backend.group if which == "split" else backend._stripe_groups[1]

    # A collective's callback that holds the backend, as gradwire's closures do; the group's worker
    # thread drops it only after the process group is torn down (defaults go last to first).
    def callback(f: torch.futures.Future, held: TorchDistBackend = backend,
                 stall: _HoldsTheThreadUntilTeardown = _HoldsTheThreadUntilTeardown()) -> int:
        return 1

    done = dist.all_reduce(torch.ones(10), group=group, async_op=True).get_future().then(callback)
    del backend, group, callback
    done.wait()
    del done
    dist.destroy_process_group()
    _torn_down.set()
    time.sleep(0.5)  # long enough for the worker thread to drop the backend
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # multiproc destroys it
    return "alive"


@pytest.mark.parametrize("which", ["split", "stripe"])
def test_a_group_dropped_last_on_its_own_thread_does_not_abort_the_process(which: str) -> None:
    """A gloo group freed on its own worker thread joins itself: "Resource deadlock avoided", SIGABRT."""
    assert run_ranks(_released_on_the_groups_own_thread, 2, which) == ["alive", "alive"]


def test_a_bad_stripe_count_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("GRADWIRE_GLOO_STRIPES", "many")
    with pytest.raises(ValueError, match="GRADWIRE_GLOO_STRIPES must be a positive integer"):
        stripes_from_env()
    monkeypatch.setenv("GRADWIRE_GLOO_STRIPES", "0")
    with pytest.raises(ValueError, match="positive integer"):
        stripes_from_env()
    monkeypatch.delenv("GRADWIRE_GLOO_STRIPES")
    assert stripes_from_env() == 1
    assert dist.is_available()
