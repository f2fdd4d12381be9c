"""The FSDP2 hook on real `fully_shard` models over gloo process groups (2 and 4 ranks, 2x2 HSDP).

Each test spawns its ranks once and runs several configurations inside them, to keep the
file's time modest on a 2-core machine.
"""

from __future__ import annotations

import os
import tempfile

import pytest
import torch
import torch.distributed as dist
from torch import nn

from multiproc import run_ranks

D, SEQ, BATCH = 32, 8, 8


class Block(nn.Module):
    """A small transformer block (attention + MLP, pre-norm) with an input and output projection."""

    def __init__(self) -> None:
        super().__init__()
        self.inp = nn.Linear(D, D)
        self.layer = nn.TransformerEncoderLayer(D, nhead=2, dim_feedforward=2 * D, dropout=0.0,
                                                batch_first=True, norm_first=True)
        self.out = nn.Linear(D, D)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(self.layer(self.inp(x)))


def batch(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A fixed batch per rank; the target is a fixed random linear map of the tokens."""
    g = torch.Generator().manual_seed(100 + rank)
    teacher = torch.randn(D, D, generator=torch.Generator().manual_seed(7)) / D ** 0.5
    x = torch.randn(BATCH, SEQ, D, generator=g)
    return x, x @ teacher


def build(mesh=None, mp=None, dtype=torch.float32, unused: bool = False):
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = Block().to(dtype)
    if unused:
        model.unused = nn.Linear(2, 2)  # in the root's group, but forward never uses it
    kw = {} if mesh is None else {"mesh": mesh}
    if mp is not None:
        kw["mp_policy"] = mp
    fully_shard(model.layer, **kw)
    fully_shard(model, **kw)
    return model


def train(model, rank: int, steps: int, lr: float = 3e-3, opt=None, data_rank: int | None = None):
    opt = opt or torch.optim.Adam(model.parameters(), lr=lr)
    x, y = batch(rank if data_rank is None else data_rank)
    losses = []
    for _ in range(steps):
        loss = nn.functional.mse_loss(model(x.to(next(model.parameters()).dtype)).float(), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return opt, losses


def full_params(model) -> list[torch.Tensor]:
    return [p.full_tensor().detach().float().clone() for p in model.parameters()]


# ---- none parity and compressed training, plain FSDP ----------------------------------------
def _flat(rank: int, world: int) -> dict:
    from gradwire.hooks import fsdp as gw

    out: dict = {}
    model = build()
    train(model, rank, 4)
    out["default"] = full_params(model)
    model = build()
    state = gw.register(model, "none")
    train(model, rank, 4)
    out["none"] = full_params(model)
    out["none_bytes"] = state.take_stats().bytes_sent
    for spec in ("int8", "fp8", "topk:ratio=0.01"):
        model = build()
        state = gw.register(model, spec)
        _, losses = train(model, rank, 40, lr=1e-2)
        stats = state.take_stats()
        out[spec] = {"losses": losses, "params": full_params(model), "ratio": stats.ratio,
                     "ef": state.error_feedback,
                     "residual_keys": sorted(state.state_dict()["strategy"]["feedback"]["residuals"])}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_none_is_fsdp_default_and_compressors_train(world):
    results = run_ranks(_flat, world, timeout=600)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["default"], r["none"]))
        assert r["none_bytes"] > 0
    for spec, min_ratio in (("int8", 2.0), ("fp8", 2.0), ("topk:ratio=0.01", 4.0)):
        first = results[0][spec]
        assert first["ef"]  # auto: on for int8, fp8 and topk
        assert first["losses"][-1] < 0.5 * first["losses"][0], (spec, first["losses"][::8])
        assert first["ratio"] > min_ratio, (spec, first["ratio"])
        # one residual per (parameter shard, destination)
        assert any(k.endswith(f"/{world - 1}") for k in first["residual_keys"])
        for r in results[1:]:  # full parameters gathered on every rank agree
            assert all(torch.equal(a, b) for a, b in zip(first["params"], r[spec]["params"]))


# ---- HSDP: dense reduce-scatter in a node, compressed all-reduce across --------------------
def _hsdp(rank: int, world: int) -> dict:
    from torch.distributed.device_mesh import init_device_mesh

    from gradwire.hooks import fsdp as gw

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    group = mesh["replicate"].get_group()
    out: dict = {}
    for name, spec, opts in (("int8", "int8", {}), ("topk", "topk:ratio=0.01", {}),
                             ("powersgd", "none", {"strategy": "powersgd", "rank": 2})):
        model = build(mesh["shard"])
        state = gw.register(model, spec, replicate_group=group, **opts)
        _, losses = train(model, rank, 40, lr=1e-2)
        out[name] = {"losses": losses, "params": full_params(model), "ratio": state.take_stats().ratio}
    return out


def test_hsdp_2x2_compressed_all_reduce_keeps_replicas_identical():
    results = run_ranks(_hsdp, 4, timeout=600)
    for name in ("int8", "topk", "powersgd"):
        first = results[0][name]
        assert first["losses"][-1] < 0.5 * first["losses"][0], (name, first["losses"][::8])
        assert first["ratio"] > 1.5, (name, first["ratio"])
        for r in results[1:]:  # replicas (and the shards they gather) bit-identical
            assert all(torch.equal(a, b) for a, b in zip(first["params"], r[name]["params"]))


# ---- mixed precision and bf16 parameters ------------------------------------------------------
def _precision(rank: int, world: int) -> dict:
    from torch.distributed.fsdp import MixedPrecisionPolicy

    from gradwire.hooks import fsdp as gw

    out = {}
    mp = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    model = build(mp=mp)
    train(model, rank, 3)
    default = full_params(model)
    model = build(mp=mp)
    gw.register(model, "none")
    train(model, rank, 3)
    out["none_equal"] = all(torch.equal(a, b) for a, b in zip(default, full_params(model)))
    for name, kw in (("mp", {"mp": mp}), ("bf16", {"dtype": torch.bfloat16})):
        model = build(**kw)
        gw.register(model, "int8")
        _, losses = train(model, rank, 40, lr=1e-2)
        out[name] = {"losses": losses, "dtype": str(next(model.parameters()).dtype),
                     "grad_dtype": str(next(model.parameters()).grad.dtype)}
    return out


def test_bf16_params_and_mixed_precision_train_and_none_stays_fsdp_default():
    results = run_ranks(_precision, 2, timeout=600)
    assert all(r["none_equal"] for r in results)  # "none" is FSDP's default under mixed precision too
    mp, bf = results[0]["mp"], results[0]["bf16"]
    assert mp["dtype"] == "torch.float32" and bf["dtype"] == "torch.bfloat16" == bf["grad_dtype"]
    for r in (mp, bf):
        assert r["losses"][-1] < 0.5 * r["losses"][0], r["losses"][::8]


# ---- checkpoint / resume with torch.distributed.checkpoint --------------------------------------
def _resume(rank: int, world: int, path: str, spec: str, options: dict) -> dict:
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import get_state_dict, set_state_dict

    from gradwire.hooks import fsdp as gw

    mesh = None
    if options.get("strategy") == "powersgd":  # HSDP 2x2
        from torch.distributed.device_mesh import init_device_mesh

        full = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
        mesh, options = full["shard"], dict(options, replicate_group=full["replicate"].get_group())

    def restore(model, opt, state):
        msd, osd = get_state_dict(model, opt)
        sd = {"model": msd, "optim": osd, **({"gradwire": state.dcp()} if state is not None else {})}
        dcp.load(sd, checkpoint_id=path)
        set_state_dict(model, opt, model_state_dict=sd["model"], optim_state_dict=sd["optim"])

    model = build(mesh)
    state = gw.register(model, spec, **options)
    opt, _ = train(model, rank, 3)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd, "gradwire": state.dcp()}, checkpoint_id=path)
    train(model, rank, 3, opt=opt)
    straight = full_params(model)

    model = build(mesh)
    state = gw.register(model, spec, **options)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    train(model, rank, 1, opt=opt, data_rank=rank + 50)  # different weights, optimizer and hook state first
    restore(model, opt, state)
    train(model, rank, 3, opt=opt)
    resumed = full_params(model)

    model = build(mesh)  # control: model and optimizer restored, hook state fresh
    gw.register(model, spec, **options)
    opt = torch.optim.Adam(model.parameters(), lr=3e-3)
    restore(model, opt, None)
    train(model, rank, 3, opt=opt)
    return {"straight": straight, "resumed": resumed, "fresh_hook": full_params(model)}


@pytest.mark.parametrize("world, spec, options", [(2, "topk:ratio=0.05", {}), (2, "qsgd:bits=4", {}),
                                                  (4, "none", {"strategy": "powersgd", "rank": 2})])
def test_dcp_resume_is_bit_identical(world, spec, options):
    with tempfile.TemporaryDirectory() as tmp:
        results = run_ranks(_resume, world, os.path.join(tmp, "ckpt"), spec, options, timeout=600)
    for r in results:
        assert all(torch.equal(a, b) for a, b in zip(r["straight"], r["resumed"]))
        # the hook's state matters: without it the run continues differently
        assert any(not torch.equal(a, b) for a, b in zip(r["straight"], r["fresh_hook"]))


# ---- config mismatch and bad input -------------------------------------------------------------
def _mismatch(rank: int, world: int) -> str:
    from gradwire.errors import ConfigMismatchError
    from gradwire.hooks import fsdp as gw

    model = build()
    gw.register(model, "int8" if rank == 0 else "fp8")
    try:
        train(model, rank, 1)
    except ConfigMismatchError as e:
        return str(e)
    return "no error"


def test_config_mismatch_raises_on_every_rank():
    for msg in run_ranks(_mismatch, 2, timeout=300):
        assert "differ across ranks" in msg and "int8" in msg and "fp8" in msg


def _bad_input(rank: int, world: int) -> dict:
    from gradwire.hooks import fsdp as gw

    out = {}
    try:
        gw.register(build(), "none", strategy="powersgd")
    except ValueError as e:
        out["powersgd"] = str(e)
    try:
        gw.register(nn.Linear(4, 4), "int8")
    except ValueError as e:
        out["unsharded"] = str(e)
    model = build(unused=True)
    gw.register(model, "int8")
    try:
        train(model, rank, 1)
    except ValueError as e:
        out["unused"] = str(e)
    model = build(unused=True)
    model.set_reduce_scatter_unused_params(True)  # the fix the error names
    gw.register(model, "int8")
    _, out["unused_fixed"] = train(model, rank, 2)
    model = build()
    model.set_gradient_divide_factor(3.0)  # PREMUL_SUM: not an average gradwire can reproduce
    gw.register(model, "int8")
    try:
        train(model, rank, 1)
    except ValueError as e:
        out["divide"] = str(e)
    return out


def test_bad_input_gets_clear_errors():
    for r in run_ranks(_bad_input, 2, timeout=300):
        assert "reduce-scatter" in r["powersgd"] and "replicate_group" in r["powersgd"]
        assert "fully_shard" in r["unsharded"]
        assert "PREMUL_SUM" in r["divide"]
        assert "set_reduce_scatter_unused_params(True)" in r["unused"] and "'<root>'" in r["unused"]
        assert len(r["unused_fixed"]) == 2


def _hsdp_mismatch(rank: int, world: int) -> str:
    from torch.distributed.device_mesh import init_device_mesh

    from gradwire.errors import ConfigMismatchError
    from gradwire.hooks import fsdp as gw

    mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("replicate", "shard"))
    model = build(mesh["shard"])
    gw.register(model, "int8", seed=1 if rank == 3 else 0, replicate_group=mesh["replicate"].get_group())
    try:
        train(model, rank, 1)
    except ConfigMismatchError as e:
        return str(e)
    return "no error"


def test_hsdp_config_mismatch_on_one_rank_raises_on_all_four():
    # rank 3 shares neither a shard group nor a replicate group with rank 0: the check needs both hops
    for msg in run_ranks(_hsdp_mismatch, 4, timeout=300):
        assert "differ across ranks" in msg and "seed=1" in msg and "rank 0:" in msg
