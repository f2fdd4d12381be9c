"""A rank that sends bad bytes makes every rank raise WireFormatError (real gloo ranks).

Rank 1 misbehaves in a different way per scenario; after each scenario every rank records
what it raised, then all ranks run a plain allreduce, which would hang if any rank had gone
on or stayed behind.
"""

from __future__ import annotations

from typing import Any, Callable

import torch

import gradwire
from gradwire import Ctx, WireFormatError
from gradwire.comm.backend import Backend, Work
from gradwire.comm.registry import make_strategy
from gradwire.comm.sparse_exchange import pack, sparse_allgather
from gradwire.comm.torch_dist import TorchDistBackend
from gradwire.compress.sparse import TopK
from multiproc import run_ranks

BAD = 1  # the rank that sends bad bytes


class Forging(Backend):
    """A real backend whose outgoing buffers pass through `forge` first (on the bad rank)."""

    def __init__(self, inner: Backend, forge: Callable[[torch.Tensor], torch.Tensor] | None) -> None:
        self.inner, self.forge = inner, forge
        self.rank, self.world_size = inner.rank, inner.world_size
        self.allreduce_identical = inner.allreduce_identical

    def _out(self, t: torch.Tensor) -> torch.Tensor:
        return self.forge(t) if self.forge is not None else t

    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        return self.inner.allreduce(t)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        return self.inner.allgather(self._out(t))

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        return self.inner.allgatherv(self._out(t), max_numel)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        if self.rank == src and self.forge is not None:
            t.copy_(self.forge(t))
        return self.inner.broadcast(t, src)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        if self.forge is not None:  # only rank 0's chunk: the other ranks receive good bytes
            chunks = [self.forge(c) if j == 0 else c for j, c in enumerate(chunks)]
        return self.inner.alltoall(chunks, recv_counts, max_recv)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        return self.inner.allgather_ints(values)


def _one_element_packet(spec: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """Replace the message's only packet by a same-size packet of shape (1,) holding 100."""
    c = gradwire.compressor(spec)

    def forge(message: torch.Tensor) -> torch.Tensor:
        packet = c.encode(torch.tensor([100.0])).tensor()
        return torch.cat([torch.tensor([packet.numel()]).view(torch.uint8), packet])
    return forge


class OneElementTopK(TopK):
    """A misconfigured rank's compressor: every packet it writes has shape (1,), through
    `encode` and through `encode_selected` (the path error feedback's in-place step takes)."""

    def encode(self, x: torch.Tensor, ctx: Ctx | None = None):
        return super().encode(torch.full((1,), 100.0), ctx)

    def encode_selected(self, x: torch.Tensor, ctx: Ctx | None = None):
        return super().encode_selected(torch.full((1,), 100.0), ctx)


def _outcome(fn: Callable[[], Any]) -> str:
    try:
        fn()
    except WireFormatError:
        return "WireFormatError"
    except Exception as e:  # noqa: BLE001 - the test reports any other type
        return f"{type(e).__name__}: {e}"
    return "no error"


def _scenarios(rank: int, world: int) -> dict[str, str]:
    real = TorchDistBackend()
    x = torch.randn(200, generator=torch.Generator().manual_seed(rank))
    bad = rank == BAD
    out: dict[str, str] = {}

    def allgather(spec: str, forge=None, compressor=None) -> Callable[[], Any]:
        backend = Forging(real, forge if bad else None)
        s = make_strategy("allgather", backend, compressor if compressor is not None else spec)
        return lambda: s.exchange(x.clone(), "w", Ctx(rank=rank)).wait()

    # a forged (1,) packet of the same byte size as the (200,) one: statically sized allgather
    out["topk wrong shape"] = _outcome(allgather("topk:k=1", _one_element_packet("topk:k=1")))
    # a chain with a lossless stage: variable size, allgatherv
    out["zstd chain wrong shape"] = _outcome(allgather("topk:k=1+zstd", _one_element_packet("topk:k=1+zstd")))
    # the bad rank's own compressor writes the wrong shape: it raises after the exchange, with its peers
    compressor = OneElementTopK(k=1) if bad else gradwire.compressor("topk:k=1")
    out["own encoder wrong shape"] = _outcome(allgather("topk:k=1", compressor=compressor))
    # a bit flipped in the header flags
    out["flag bits"] = _outcome(allgather("fp16", lambda m: _set_byte(m, 8 + 7, 0x80)))

    # artopk: the leader of step 1 (rank 1) broadcasts an index outside the tensor
    art = make_strategy("artopk", Forging(real, (lambda t: t + 1000) if bad else None), "topk:k=2")
    out["artopk bad index"] = _outcome(lambda: art.exchange(x.clone(), "w", Ctx(step=BAD, rank=rank)).wait())

    # sparse index/value exchange: rank 1 declares another numel
    def sparse() -> Any:
        forge = (lambda b: pack(torch.tensor([0]), torch.tensor([1.0]), 201)) if bad else None
        return sparse_allgather(Forging(real, forge), torch.tensor([rank]), torch.tensor([1.0]), 200).wait()
    out["sparse numel"] = _outcome(sparse)

    # all-to-all reduce-scatter: rank 1 sends rank 0 alone a bad packet; the others decode good
    # bytes, and still raise with rank 0
    from gradwire.comm.reduce_scatter import AlltoallReduceScatter
    from gradwire.comm.base import Segment

    rs = AlltoallReduceScatter(Forging(real, _one_element_packet("topk:k=1") if bad else None), "topk:k=1",
                               error_feedback=False)
    xs = torch.randn(world * 200, generator=torch.Generator().manual_seed(rank))
    out["reduce-scatter to one rank"] = _outcome(lambda: rs.reduce_scatter(xs, [Segment("w", 0, 200)],
                                                                            Ctx(rank=rank)).wait())

    # every rank is still in step: one more collective completes everywhere
    total = torch.ones(1)
    real.allreduce(total).wait()
    out["in step"] = str(int(total.item()) == world)
    return out


def _set_byte(message: torch.Tensor, at: int, value: int) -> torch.Tensor:
    m = message.clone()
    m[at] = value
    return m


def test_every_rank_raises_wire_format_error_when_one_sends_bad_bytes():
    results = run_ranks(_scenarios, 3, timeout=240)
    for rank, out in enumerate(results):
        assert out.pop("in step") == "True"
        assert out == {name: "WireFormatError" for name in out}, f"rank {rank}: {out}"
    assert set(results[0]) == {"topk wrong shape", "zstd chain wrong shape", "own encoder wrong shape",
                               "flag bits", "artopk bad index", "sparse numel", "reduce-scatter to one rank"}


def _ddp(rank: int, world: int) -> str:
    from torch import nn
    from torch.nn.parallel import DistributedDataParallel as DDP

    from gradwire.hooks import ddp as gw_ddp

    torch.manual_seed(0)
    model = DDP(nn.Sequential(nn.Linear(32, 64), nn.Linear(64, 4)))
    state = gw_ddp.register(model, "topk:k=1", start_iter=2, strategy="allgather")
    if rank == BAD:
        state.strategy.backend = Forging(state.strategy.backend, _one_element_packet("topk:k=1"))
    x = torch.randn(8, 32, generator=torch.Generator().manual_seed(rank))
    try:
        for _ in range(3):  # dense for 2 iterations, then the hook's allgather
            model(x).sum().backward()
    except RuntimeError as e:  # DDP's reducer rethrows the hook future's error as RuntimeError
        return "WireFormatError" if "WireFormatError" in str(e) else f"RuntimeError: {e}"
    return "no error"


def test_ddp_hook_every_rank_raises_on_bad_bytes():
    assert run_ranks(_ddp, 2, timeout=180) == ["WireFormatError", "WireFormatError"]
