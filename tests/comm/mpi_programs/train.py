"""GradientExchanger over MPI: training with top-k + error feedback reaches a loss bound with
bit-identical parameters on every rank; bucketing, write-back, checkpoints, config checks.
mpiexec -n 4 python tests/comm/mpi_programs/train.py"""

from __future__ import annotations

import os
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import bits_equal, check, main, same_on_all_ranks  # noqa: E402

from gradwire.comm.api import ConfigMismatchError, GradientExchanger  # noqa: E402

TOPK = "topk:ratio=0.01,indices=raw"  # raw indices: packing costs ~5 ms a call on tiny tensors
LOSS_BOUND = 0.03  # the loss starts near 2; ~0.007 after 50 steps with 2 ranks
STEPS = 50


def shard(rank: int, n: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """rank's data: a fixed random teacher (same on every rank), rank-specific inputs."""
    teacher = torch.randn(32, 1, generator=torch.Generator().manual_seed(7))
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(n, 32, generator=g)
    y = torch.tanh(x @ teacher / 4) * 2 + 0.01 * torch.randn(n, 1, generator=g)
    return x, y


def model(seed: int) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(32, 64), nn.Tanh(), nn.Linear(64, 1))  # 2177 parameters


def sgd_step(m: nn.Module, lr: float) -> None:
    """Plain SGD by hand: constructing torch.optim.SGD imports torch._dynamo (seconds per rank)."""
    with torch.no_grad():
        for p in m.parameters():
            if p.grad is not None:
                p.sub_(p.grad, alpha=lr)


def flat_params(m: nn.Module) -> torch.Tensor:
    return torch.cat([p.detach().reshape(-1) for p in m.parameters()])


def global_loss(b, m: nn.Module) -> float:
    x, y = shard(b.rank)
    with torch.no_grad():
        loss = nn.functional.mse_loss(m(x), y).double().reshape(1)
    return float(b.allreduce(loss).wait()) / b.world_size


@check
def topk_error_feedback_trains_identically(b) -> None:
    m = model(seed=b.rank)  # different initial weights on purpose: broadcast_ must fix that
    # global top-k over the bucket: one packet per rank and step (per-tensor is tested below)
    ex = GradientExchanger(TOPK, backend=b, strategy="allgather", error_feedback=True, per_tensor=False)
    ex.broadcast_(m.parameters())
    same_on_all_ranks(b, "parameters after broadcast_", flat_params(m))
    x, y = shard(b.rank)
    first = global_loss(b, m)
    for step in range(STEPS):
        m.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        stats = ex.exchange_(m.parameters())
        sgd_step(m, lr=0.5)
        assert stats["step"] == step and ex.step == step + 1
        if step in (0, STEPS - 1):
            same_on_all_ranks(b, f"averaged gradients at step {step}",
                              *[p.grad for p in m.parameters()])
            assert 0 < stats["bytes_sent"] < stats["dense_bytes"] / 10, stats
            assert stats["bytes_received"] > 0 if b.world_size > 1 else True, stats
    last = global_loss(b, m)
    same_on_all_ranks(b, "parameters after training", flat_params(m))
    assert last < LOSS_BOUND and last < first / 10, f"loss {first:.4f} -> {last:.4f} (bound {LOSS_BOUND})"
    assert ex.totals.bytes_sent > 0 and ex.totals.dense_bytes == STEPS * 2177 * 4
    if b.rank == 0:
        print(f"topk+EF: loss {first:.4f} -> {last:.4f} in {STEPS} steps, sent "
              f"{ex.totals.bytes_sent} of {ex.totals.dense_bytes} dense bytes", flush=True)


def known_grads(rank: int) -> list[torch.Tensor]:
    g = torch.Generator().manual_seed(500 + rank)
    return [torch.randn(3, 5, generator=g), torch.randn(7, generator=g),
            torch.randn(4, 4, generator=g).to(torch.bfloat16), torch.randn(2, 3, generator=g).t()]  # last: strided


@check
def exact_mean_written_back_per_bucket(b) -> None:
    """'none' over allgather: every tensor (mixed dtypes, a strided one, 1 KiB buckets) gets
    exactly the rank-order mean."""
    for bucket_mb in (None, 1 / 1024 / 16):  # one bucket per dtype / a bucket per tensor or two
        ex = GradientExchanger("none", backend=b, strategy="allgather", error_feedback=False, bucket_mb=bucket_mb)
        grads = known_grads(b.rank)
        ex.exchange_(grads)
        for i, out in enumerate(grads):
            total = torch.zeros_like(out)
            for r in range(b.world_size):
                total.add_(known_grads(r)[i])
            bits_equal(out, total.div_(b.world_size), f"tensor {i} bucket_mb={bucket_mb}")
        summed = known_grads(b.rank)
        ex.exchange_(summed, average=False)
        ref = sum(known_grads(r)[0] for r in range(b.world_size))
        assert torch.allclose(summed[0], ref, rtol=1e-6, atol=1e-6)


@check
def parameters_frozen_and_unused(b) -> None:
    m = model(seed=0)
    m[0].weight.requires_grad_(False)  # frozen: skipped
    m[2].bias.grad = None  # unused: exchanged as zeros
    m[0].bias.grad = torch.full_like(m[0].bias, float(b.rank))
    m[2].weight.grad = torch.ones_like(m[2].weight)
    ex = GradientExchanger("none", backend=b, error_feedback=False)
    ex.exchange_(m.parameters())
    assert m[0].weight.grad is None
    bits_equal(m[2].bias.grad, torch.zeros_like(m[2].bias), "unused parameter")
    expect = sum(range(b.world_size)) / b.world_size
    assert torch.allclose(m[0].bias.grad, torch.full_like(m[0].bias, expect)), m[0].bias.grad
    bits_equal(m[2].weight.grad, torch.ones_like(m[2].weight), "ones")


@check
def other_strategies_agree_across_ranks(b) -> None:
    for spec, strategy, options in (("fp16", "allreduce", {}), ("topk:ratio=0.05", "artopk", {}),
                                    ("randomk:ratio=0.1", "allgather", {}),  # packets without indices
                                    ("topk:ratio=0.05", "oktopk", {}),
                                    ("topk:ratio=0.05", "hierarchical", {"ranks_per_node": max(b.world_size // 2, 1)}),
                                    ("fp16", "auto", {"alpha": 1e-5, "beta": 1e-9}),
                                    ("topk:ratio=0.05", "auto", {"alpha": 1e-5, "beta": 1e-9})):
        m = model(seed=1)
        ex = GradientExchanger(spec, backend=b, strategy=strategy, **options)
        x, y = shard(b.rank)
        for _ in range(3):
            m.zero_grad()
            nn.functional.mse_loss(m(x), y).backward()
            stats = ex.exchange_(m.parameters())
            sgd_step(m, lr=0.05)
        same_on_all_ranks(b, f"{spec} over {strategy}: parameters", flat_params(m))
        assert stats["bytes_sent"] > 0, stats


@check
def state_dict_round_trip_continues_bit_identically(b) -> None:
    m = model(seed=2)
    x, y = shard(b.rank)
    ex = GradientExchanger(TOPK, backend=b, seed=3)

    def grads() -> list[torch.Tensor]:
        m.zero_grad()
        nn.functional.mse_loss(m(x), y).backward()
        return [p.grad.clone() for p in m.parameters()]

    for _ in range(3):
        ex.exchange_(grads())
    state = ex.state_dict()
    clone = GradientExchanger(TOPK, backend=b, seed=3)
    clone.load_state_dict(state)
    assert clone.step == ex.step == 3
    a, c = grads(), grads()
    ex.exchange_(a)
    clone.exchange_(c)
    for i, (u, v) in enumerate(zip(a, c)):
        bits_equal(u, v, f"gradient {i} after restoring the state")
    try:
        GradientExchanger("fp16", backend=b).load_state_dict(state)
    except ValueError:
        pass
    else:
        raise AssertionError("loading a topk exchanger's state into an fp16 one should raise")


@check
def config_mismatch_raises_everywhere(b) -> None:
    try:  # checked when the exchangers are built, before any strategy runs a collective
        GradientExchanger("none", backend=b, seed=b.rank)  # seeds differ
    except ConfigMismatchError as e:
        assert "seed" in str(e)
    else:
        raise AssertionError("different seeds should raise ConfigMismatchError on every rank")
    try:
        GradientExchanger("topk:k=1", backend=b, strategy="auto" if b.rank == 0 else "allgather")
    except ConfigMismatchError as e:
        assert "auto" in str(e)
    else:
        raise AssertionError("auto against allgather should raise ConfigMismatchError on every rank")
    ex = GradientExchanger("none", backend=b)
    try:
        ex.exchange_([torch.ones(4 + (b.rank == 0))])  # layouts differ
    except ConfigMismatchError:
        pass
    else:
        raise AssertionError("different gradient layouts should raise ConfigMismatchError on every rank")


class _Forging:
    """A real MPIBackend whose allgathered messages are replaced on the last rank: a peer that
    sends a same-size top-k packet of shape (1,) holding 100."""

    def __init__(self, b) -> None:
        self.b = b
        self.rank, self.world_size, self.allreduce_identical = b.rank, b.world_size, b.allreduce_identical

    def __getattr__(self, name):
        return getattr(self.b, name)

    def _forge(self, t: torch.Tensor) -> torch.Tensor:
        if self.rank != self.world_size - 1:
            return t
        import gradwire

        packet = gradwire.compressor("topk:k=1").encode(torch.tensor([100.0])).tensor()
        return torch.cat([torch.tensor([packet.numel()]).view(torch.uint8), packet])

    def gather_packets(self, packet: torch.Tensor, static_size, max_size):
        return self.b.gather_packets(self._forge(packet), static_size, max_size)


@check
def bad_packet_from_one_rank_raises_everywhere(b) -> None:
    from gradwire import WireFormatError

    # two buckets: the error in each is raised on every rank, and no gradient is written
    ex = GradientExchanger("topk:k=1", backend=_Forging(b), error_feedback=False, bucket_mb=0.0005)
    gen = torch.Generator().manual_seed(b.rank)
    grads = [torch.randn(200, generator=gen), torch.randn(150, generator=gen)]
    before = [g.clone() for g in grads]
    try:
        ex.exchange_([("w", grads[0]), ("v", grads[1])])
    except WireFormatError:
        pass
    else:
        raise AssertionError("a (1,) packet for a (200,) gradient should raise WireFormatError on every rank")
    assert all(torch.equal(g, g0) for g, g0 in zip(grads, before)), "a gradient was written despite the error"
    same_on_all_ranks(b, "ranks still in step after the error", torch.ones(1))


if __name__ == "__main__":
    main(__name__)
