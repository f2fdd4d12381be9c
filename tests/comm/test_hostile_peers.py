"""A malicious peer, class by class (issue: nothing a peer declares is trusted, no rank waits alone).

Real gloo groups; rank 1 (the attacker) replaces its own backend (tests/support/adversary.py), as a
modified process would, and the honest ranks run gradwire unmodified. Each case records, on
every rank, what it raised, in how many seconds and how much the rank's peak memory grew; after
the cases that keep ranks in step, one plain allreduce shows nobody went on or stayed behind.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any

import torch

from adversary import Liar, outcome
from gradwire import Ctx
from gradwire.comm.oktopk import _pairs
from gradwire.comm.registry import make_strategy
from gradwire.comm.sparse_exchange import sparse_allgather
from gradwire.comm.torch_dist import TorchDistBackend
from multiproc import run_ranks

EVIL = 1  # the attacker's rank
GIB = 1 << 30


def _backend(rank: int, **lies: Any) -> TorchDistBackend:
    """The attacker's lying backend on its rank, a plain one elsewhere."""
    return Liar(**lies) if rank == EVIL else TorchDistBackend()


def _claim(numel: int):
    """Rewrite an allgatherv size declaration ([numel, dtype code]) to claim `numel` elements."""
    return lambda values: [numel, values[1]] if len(values) == 2 else values


def _in_step(world: int) -> bool:
    total = torch.ones(1)
    TorchDistBackend().allreduce(total).wait()
    return int(total.item()) == world


def _sizes(rank: int, world: int) -> dict[str, Any]:
    """Class 3/4/8: sizes and counts a peer declares are bounded by what the receiver expects."""
    x = torch.randn(4000, generator=torch.Generator().manual_seed(rank))
    out: dict[str, Any] = {}

    # a 64 GiB claim in the allgatherv size exchange (zstd chain: variable-size packets)
    s = make_strategy("allgather", _backend(rank, ints=_claim(64 * GIB)), "topk:ratio=0.01+zstd")
    out["allgather 64 GiB claim"] = outcome(lambda: s.exchange(x.clone(), "w", Ctx(rank=rank)).wait())
    out["allgather 64 GiB claim in step"] = _in_step(world)

    # a 256 MiB claim (old behaviour: +1.3 GiB RSS on every honest rank, padded to the largest)
    s = make_strategy("allgather", _backend(rank, ints=_claim(256 << 20)), "topk:ratio=0.01+zstd")
    out["allgather 256 MiB claim"] = outcome(lambda: s.exchange(x.clone(), "w", Ctx(rank=rank)).wait())

    # the sparse index/value exchange: more pairs than the tensor has elements
    def sparse() -> Any:
        b = _backend(rank, ints=_claim(1 << 28))
        return sparse_allgather(b, torch.tensor([rank]), torch.tensor([1.0]), 4000).wait()
    out["sparse 2 GiB claim"] = outcome(sparse)

    # a dtype lie in the allgatherv declaration
    s = make_strategy("allgather", _backend(rank, ints=lambda v: [v[0], 2] if len(v) == 2 else v),
                      "topk:ratio=0.01+zstd")
    out["allgatherv dtype lie"] = outcome(lambda: s.exchange(x.clone(), "w", Ctx(rank=rank)).wait())

    # oktopk: a 256 MiB chunk declared for rank 0 alone (a lie to one rank in the all-to-all plan)
    def plan(values: list[int]) -> list[int]:
        return [256 << 20] + values[1:] if len(values) == world + 1 else values
    s = make_strategy("oktopk", _backend(rank, ints=plan), "topk:ratio=0.01")
    out["oktopk 256 MiB chunk to one rank"] = outcome(lambda: s.exchange(x.clone(), "w", Ctx(rank=rank)).wait())
    out["oktopk claim in step"] = _in_step(world)

    # oktopk: far more pairs than k allows, well formed and declared honestly, to rank 0 only
    def more_pairs(dst: int, chunk: torch.Tensor) -> torch.Tensor:
        if dst != 0:
            return chunk
        idx = torch.arange(0, 60, dtype=torch.int64)  # k = 40 for 4000 elements at 1%
        return _pairs(idx, torch.ones(60), 0, 4000 // world)
    s = make_strategy("oktopk", _backend(rank, content=more_pairs), "topk:ratio=0.01")
    out["oktopk more pairs than k"] = outcome(lambda: s.exchange(x.clone(), "w", Ctx(rank=rank)).wait())
    out["in step"] = _in_step(world)
    return out


def _every_case_raised(results: list[dict[str, Any]], kind: str) -> None:
    """Every rank stayed in step after every case (the booleans) and raised `kind` in each."""
    for rank, out in enumerate(results):
        for name in [n for n, v in out.items() if isinstance(v, bool)]:
            assert out.pop(name) is True, (rank, name)
        for name, got in out.items():
            assert got["kind"] == kind, (rank, name, got)


def test_declared_sizes_are_bounded_before_allocation_on_every_rank():
    results = run_ranks(_sizes, 3, timeout=240)
    _every_case_raised(results, "WireFormatError")
    for rank, out in enumerate(results):
        for name, got in out.items():
            assert got["grew_mb"] < 64, (rank, name, got)  # nothing of the claim was allocated
            if rank != EVIL and "claim" in name:
                assert f"rank {EVIL}" in got["message"], (rank, name, got["message"])
    assert "outside the 0.." in results[0]["allgather 64 GiB claim"]["message"]
    assert "more than the" in results[0]["oktopk more pairs than k"]["message"] \
        or f"rank {EVIL} sent rank 0" in results[0]["oktopk more pairs than k"]["message"]


def _framing(rank: int, world: int) -> dict[str, Any]:
    """Class 5/7: short deliveries and hierarchical's shares and chunks."""
    out: dict[str, Any] = {}
    x = torch.randn(1400, generator=torch.Generator().manual_seed(rank))

    # a short all-to-all chunk to rank 0 only, in the static int8 reduce-scatter (no size exchange)
    from gradwire.comm.reduce_scatter import AlltoallReduceScatter
    from gradwire.comm.base import Segment

    def short(dst: int, framed_chunk: torch.Tensor) -> torch.Tensor:
        return framed_chunk[: framed_chunk.numel() // 2] if dst == 0 else framed_chunk
    rs = AlltoallReduceScatter(_backend(rank, chunk=short), "int8", error_feedback=False)
    xs = torch.randn(world * 700, generator=torch.Generator().manual_seed(rank))
    out["int8 reduce-scatter short to one rank"] = outcome(
        lambda: rs.reduce_scatter(xs, [Segment("w", 0, 700)], Ctx(rank=rank)).wait())
    out["reduce-scatter in step"] = _in_step(world)

    # hierarchical, 2 nodes of 2: the attacker sends its node partner a 1-element share
    h = make_strategy("hierarchical", TorchDistBackend(), "topk:ratio=0.01", ranks_per_node=2)
    if rank == EVIL:
        partner = 0  # rank 1's node partner has local rank 0
        h.intra = Liar(h.intra.group, chunk=lambda dst, c: c[:12] if dst == partner else c)
    out["hierarchical 1-element share"] = outcome(lambda: h.exchange(x.clone(), "b", Ctx(rank=rank)).wait())
    out["share in step"] = _in_step(world)

    # hierarchical: the attacker's summed chunk is one element longer (declared so) in step 3
    h = make_strategy("hierarchical", TorchDistBackend(), "topk:ratio=0.01", ranks_per_node=2)
    if rank == EVIL:
        h.intra = Liar(h.intra.group, content=lambda dst, t: torch.cat([t, t[:1]]) if dst < 0 else t)
    out["hierarchical chunk one element long"] = outcome(lambda: h.exchange(x.clone(), "b", Ctx(rank=rank)).wait())
    out["in step"] = _in_step(world)
    return out


def test_short_deliveries_and_bad_hierarchical_shares_fail_on_every_rank():
    results = run_ranks(_framing, 4, timeout=240)
    _every_case_raised(results, "WireFormatError")
    assert "short or altered" in results[0]["int8 reduce-scatter short to one rank"]["message"]
    assert "short or altered" in results[0]["hierarchical 1-element share"]["message"]
    for rank in (2, 3):  # the other node: told by the agreement, naming the receiver and the sender
        assert f"from rank {EVIL}" in results[rank]["hierarchical 1-element share"]["message"]
        assert "received a malformed message" in results[rank]["hierarchical chunk one element long"]["message"]


def _short_broadcast(rank: int, world: int) -> dict[str, Any]:
    """Class 7: artopk's leader (the attacker, at step 1) broadcasts fewer index bytes than expected."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(rank))
    if rank == EVIL:  # the attacker skips gradwire and sends a short broadcast by hand, then leaves
        import torch.distributed as dist

        dist.broadcast(torch.ones(8, dtype=torch.uint8), src=EVIL)
        return {}
    s = make_strategy("artopk", TorchDistBackend(), "topk:k=4")
    return outcome(lambda: s.exchange(x, "w", Ctx(step=EVIL, rank=rank)).wait())


def test_short_broadcast_from_the_leader_is_detected():
    results = run_ranks(_short_broadcast, 3, timeout=120, pg_timeout=20)
    for rank in (0, 2):
        assert results[rank]["kind"] == "WireFormatError", results[rank]
        assert f"rank {EVIL}'s message arrived short" in results[rank]["message"]


def _config(rank: int, world: int, case: str) -> dict[str, Any]:
    """Class 6: mismatched configs are caught before any strategy runs a collective."""
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwire.comm.api import GradientExchanger
    from gradwire.hooks import ddp as gw_ddp

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(16, 32), nn.Linear(32, 2))
    evil = rank == EVIL
    if case == "ddp hierarchical vs allgather":
        ddp = DDP(model)
        gw_ddp.register(ddp, "topk:k=4", strategy="hierarchical" if evil else "allgather", start_iter=2,
                        **({"ranks_per_node": 2} if evil else {}))
        return outcome(lambda: ddp(torch.randn(4, 16)).sum().backward())
    if case == "ddp auto vs allgather":
        ddp = DDP(model)
        gw_ddp.register(ddp, "topk:k=4", strategy="auto" if evil else "allgather", start_iter=2)
        return outcome(lambda: ddp(torch.randn(4, 16)).sum().backward())
    if case == "ddp LOCAL_WORLD_SIZE on one rank":
        if evil:
            os.environ["LOCAL_WORLD_SIZE"] = "2"
        ddp = DDP(model)
        gw_ddp.register(ddp, "topk:k=4", strategy="hierarchical", start_iter=2)
        return outcome(lambda: ddp(torch.randn(4, 16)).sum().backward())
    if case == "exchanger hierarchical vs allgather":
        kw = {"strategy": "hierarchical", "ranks_per_node": 2} if evil else {"strategy": "allgather"}
        return outcome(lambda: GradientExchanger("topk:k=4", backend=TorchDistBackend(), **kw))
    if case == "exchanger auto vs allgather":
        kw = {"strategy": "auto"} if evil else {"strategy": "allgather"}
        return outcome(lambda: GradientExchanger("topk:k=4", backend=TorchDistBackend(), **kw))
    if case == "a pickle as the config text":
        # the attacker's description is a pickle that would create a file if unpickled
        import pickle

        marker = Path(os.environ["GW_TEST_MARKER"])

        class Boom:
            def __reduce__(self):
                return (marker.write_text, ("unpickled",))
        payload = pickle.dumps(Boom()).decode("latin-1")
        ddp = DDP(model)
        state = gw_ddp.register(ddp, "topk:k=4", strategy="allgather", start_iter=2)
        if evil:
            state.describe = lambda: payload  # type: ignore[method-assign]
        result = outcome(lambda: ddp(torch.randn(4, 16)).sum().backward())
        result["marker"] = marker.exists()
        return result
    raise AssertionError(case)


CONFIG_CASES = ("ddp hierarchical vs allgather", "ddp auto vs allgather", "ddp LOCAL_WORLD_SIZE on one rank",
                "exchanger hierarchical vs allgather", "exchanger auto vs allgather", "a pickle as the config text")


def test_config_mismatches_fail_before_any_strategy_collective(tmp_path, monkeypatch):
    monkeypatch.setenv("GW_TEST_MARKER", str(tmp_path / "unpickled"))
    monkeypatch.delenv("LOCAL_WORLD_SIZE", raising=False)
    for case in CONFIG_CASES:
        results = run_ranks(_config, 4, case, timeout=120, pg_timeout=30)
        for rank, got in enumerate(results):
            assert "ConfigMismatchError" in got["kind"] + got["message"], (case, rank, got)
            assert got["seconds"] < 25, (case, rank, got)  # no rank waited for a timeout
            assert got.get("marker", False) is False, (case, rank)


def test_no_peer_bytes_are_unpickled_anywhere_in_the_package():
    """Static companion of the pickle case: no unpickling collective or loader remains in gradwire."""
    root = Path(__file__).resolve().parents[2] / "gradwire"
    banned = re.compile(r"all_gather_object|allgather_object|broadcast_object|pickle\.loads|\.comm\.(allgather|alltoall|"
                        r"bcast|gather|scatter|recv|sendrecv)\(|self\.comm\.(allgather|alltoall|bcast)\(")
    found = [f"{p.relative_to(root)}:{i}: {line.strip()}" for p in root.rglob("*.py")
             for i, line in enumerate(p.read_text().splitlines(), 1) if banned.search(line)]
    assert not found, found
