"""DiLoCo between replicas that are themselves groups: 2 replicas x 2 gloo ranks, DDP or FSDP2
inside a replica, DiLoCo between the ranks that hold the same part of the model (the real
deployment: fast links inside a datacenter, an outer loop between them). Checked against the
replicas simulated in one process from the papers' equations."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from gradwire.comm.torch_dist import TorchDistBackend
from gradwire.outer import DiLoCo
from multiproc import run_ranks

REPLICAS, PER_REPLICA = 2, 2
STEPS, SYNC_EVERY, LR = 8, 4, 0.1


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(6, 16, generator=gen), torch.randn(6, 4, generator=gen)


def _loss(model: torch.nn.Module, rank: int, step: int) -> torch.Tensor:
    x, y = _batch(rank, step)
    return torch.nn.functional.mse_loss(model(x), y)


def simulate() -> list[torch.Tensor]:
    """One process, uncompressed: replica r's inner gradient is the mean over its ranks' batches
    (what DDP and FSDP2 average); every SYNC_EVERY steps Nesterov SGD (lr 0.7, momentum 0.9) steps
    the global weights with the mean of (global - local), which then replace every replica's."""
    models = [_model() for _ in range(REPLICAS)]
    opts = [torch.optim.SGD(m.parameters(), lr=LR) for m in models]
    glob = [p.detach().clone().requires_grad_() for p in models[0].parameters()]
    outer = torch.optim.SGD(glob, lr=0.7, momentum=0.9, nesterov=True)
    for step in range(STEPS):
        for r, (m, o) in enumerate(zip(models, opts)):
            o.zero_grad()
            ranks = range(r * PER_REPLICA, (r + 1) * PER_REPLICA)
            (sum(_loss(m, rank, step) for rank in ranks) / PER_REPLICA).backward()
            o.step()
        if (step + 1) % SYNC_EVERY == 0:
            with torch.no_grad():
                for i, g in enumerate(glob):
                    g.grad = sum(g - list(m.parameters())[i] for m in models) / REPLICAS
            outer.step()
            with torch.no_grad():
                for m in models:
                    for p, g in zip(m.parameters(), glob):
                        p.copy_(g)
    return [g.detach().clone() for g in glob]


def _groups(rank: int) -> tuple[dist.ProcessGroup, dist.ProcessGroup]:
    """(this rank's replica: consecutive ranks, the ranks of the other replicas that hold the same part)."""
    inner = [dist.new_group(list(range(r * PER_REPLICA, (r + 1) * PER_REPLICA))) for r in range(REPLICAS)]
    across = [dist.new_group([r * PER_REPLICA + i for r in range(REPLICAS)]) for i in range(PER_REPLICA)]
    return inner[rank // PER_REPLICA], across[rank % PER_REPLICA]


def _train(model: torch.nn.Module, outer: DiLoCo, rank: int) -> list[int]:
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for step in range(STEPS):
        opt.zero_grad()
        _loss(model, rank, step).backward()
        opt.step()
        outer.step()
    outer.finish()
    return [s["bytes_sent"] for s in outer.stats]


def _ddp_inside(rank: int, world: int, options: dict) -> dict:
    inner, across = _groups(rank)
    model = torch.nn.parallel.DistributedDataParallel(_model(), process_group=inner)
    outer = DiLoCo(model, sync_every=SYNC_EVERY, backend=TorchDistBackend(across), **options)
    sent = _train(model, outer, rank)
    return {"params": [p.detach().clone() for p in model.module.parameters()], "sent": sent}


def _fsdp_inside(rank: int, world: int, options: dict) -> dict:
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (REPLICAS, PER_REPLICA), mesh_dim_names=("replicate", "shard"))
    model = _model()
    fully_shard(model, mesh=mesh["shard"])
    outer = DiLoCo(model, sync_every=SYNC_EVERY, backend=TorchDistBackend(mesh["replicate"].get_group()),
                   **options)
    sent = _train(model, outer, rank)
    return {"params": [p.full_tensor().detach().clone() for p in model.parameters()], "sent": sent,
            "shard_numel": sum(p.to_local().numel() for p in model.parameters())}


@pytest.mark.parametrize("inside", [_ddp_inside, _fsdp_inside], ids=["ddp", "fsdp2"])
def test_replicas_of_two_ranks_train_as_the_simulated_replicas(inside) -> None:
    results = run_ranks(inside, REPLICAS * PER_REPLICA, {}, timeout=180)
    want = simulate()
    full = sum(p.numel() for p in want)
    for rank, r in enumerate(results):
        assert len(r["sent"]) == STEPS // SYNC_EVERY
        for got, ref in zip(r["params"], want):
            torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-6, msg=f"rank {rank}")
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"])), rank
        if "shard_numel" in r:  # each rank sends only its shard's pseudo-gradient between replicas
            assert r["shard_numel"] < full and all(s == 4 * r["shard_numel"] for s in r["sent"]), r["sent"]
        else:
            assert all(s == 4 * full for s in r["sent"]), r["sent"]


def test_int8_between_replicas_of_fsdp2_shards_keeps_every_rank_identical() -> None:
    """Compressed pseudo-gradients between FSDP2 replicas: fewer bytes than float32, every rank
    identical after every sync, and close to the uncompressed run."""
    results = run_ranks(_fsdp_inside, REPLICAS * PER_REPLICA, {"compressor": "int8"}, timeout=180)
    want = simulate()
    for r in results:
        # (a byte a value plus each tensor's header and scale: on shards this small, about half)
        assert all(s < 0.6 * 4 * r["shard_numel"] for s in r["sent"]), r["sent"]
        assert all(torch.equal(a, b) for a, b in zip(r["params"], results[0]["params"]))
        assert 0 < max((a - b).abs().max().item() for a, b in zip(r["params"], want)) < 0.05
