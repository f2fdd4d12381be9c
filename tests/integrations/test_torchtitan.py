"""gradwire.integrations.torchtitan on torchtitan's own llama3 model, ParallelDims and FSDP
application (`apply_fsdp_to_decoder`), 2 gloo ranks, a few training steps by hand.

What runs on CPU is torchtitan's FSDP step, wrapped in a `parallelize_fn` of torchtitan's
signature (`parallelize_on_cpu`); torchtitan's own `parallelize_llama` and `Trainer` do not run on
a CPU-only torch: torchtitan builds its meshes for "cuda" when it finds no accelerator
(`torchtitan.tools.utils.device_type`), so `fully_shard` fails ("Torch not compiled with CUDA
enabled") and the trainer's `torch.cuda.set_device` too. On a GPU machine the recipe wraps
`parallelize_llama` itself (see /tmp/docs_torchtitan.md or docs/integrations.md).

Needs torchtitan 0.3 and triton (its models import triton, which torchtitan does not declare):
    pip install "torchtitan==0.3.0" triton    # or: pip install -e ".[torchtitan]"
    python -m pytest -q tests/integrations/test_torchtitan.py
"""

from __future__ import annotations

import copy
import dataclasses
import importlib
import importlib.util
import sys
from typing import Any

import pytest
import torch
import torch.nn as nn

from frameworks import require  # noqa: E402

require("torchtitan", "triton", extra="torchtitan")  # (torchtitan's models import triton)

from multiproc import run_ranks  # noqa: E402

STEPS = 4
SEQ = 32
BATCH = 2


def _tiny_llama() -> Any:
    """torchtitan's llama3 debug model cut to 2 layers, with SDPA (its flex attention compiles with
    inductor's max-autotune, far too slow on CPU) and RoPE sized to the test's sequence."""
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.llama3 import llama3_configs

    config = llama3_configs["debugmodel"]("flex")
    config.layers = config.layers[:2]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
        layer.attention.rope = dataclasses.replace(layer.attention.rope, max_seq_len=SEQ)
    return config


def parallelize_on_cpu(model: nn.Module, *, parallel_dims: Any, training: Any, parallelism: Any,
                       compile_config: Any, ac_config: Any, dump_folder: str) -> nn.Module:
    """`parallelize_llama`'s FSDP step (no TP, CP, AC or compile) with torchtitan's signature, on a
    CPU view of torchtitan's own "fsdp" mesh (same process group)."""
    from torch.distributed.device_mesh import DeviceMesh
    from torchtitan.config import TORCH_DTYPE_MAP
    from torchtitan.distributed.fsdp import apply_fsdp_to_decoder

    group = parallel_dims.get_mesh("fsdp").get_group()
    mesh = DeviceMesh.from_group(group, "cpu", mesh_dim_names=("fsdp",))
    apply_fsdp_to_decoder(model, mesh, param_dtype=TORCH_DTYPE_MAP[training.mixed_precision_param],
                          reduce_dtype=TORCH_DTYPE_MAP[training.mixed_precision_reduce],
                          pp_enabled=parallel_dims.pp_enabled)
    return model


def _force_sum(model: nn.Module) -> None:
    """gloo has no PREMUL_SUM, which torchtitan's divide factor 1.0 asks for; FSDP then sums (the
    same as NCCL's PREMUL_SUM(1.0)), as the recipe has it do."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.set_force_sum_reduction_for_comms(True)


def _train(parallelize_fn: Any, parallel_dims: Any, init: dict[str, torch.Tensor] | None, rank: int, world: int,
           force_sum: bool = False) -> dict[str, Any]:
    """Build, parallelize and train the tiny llama for STEPS steps on this rank's fixed batch, with
    torchtitan's loss scaling (local sum over the global token count: FSDP sums the gradients)."""
    from torchtitan.config import CompileConfig, ParallelismConfig, TrainingConfig

    with torch.device("meta"):
        model = _tiny_llama().build()
    model = parallelize_fn(model, parallel_dims=parallel_dims, training=TrainingConfig(mixed_precision_param="float32"),
                           parallelism=ParallelismConfig(spmd_backend="partial_dtensor"),
                           compile_config=CompileConfig(), ac_config=None, dump_folder="")
    if force_sum:
        _force_sum(model)
    model.to_empty(device="cpu")
    with torch.no_grad():
        model.init_weights(buffer_device=None)
        for name, p in model.named_parameters():
            if init is not None:  # every run starts where the first did
                p.to_local().copy_(init[name])
    start = {n: p.to_local().detach().clone() for n, p in model.named_parameters()}
    optimizer = torch.optim.AdamW(model.parameters(), lr=3e-3)
    tokens = torch.randint(0, 2048, (BATCH, SEQ + 1), generator=torch.Generator().manual_seed(rank))
    losses, first_grads = [], {}
    for step in range(STEPS):
        logits = model(tokens[:, :-1])
        loss = nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten(), reduction="sum")
        (loss / (BATCH * SEQ * world)).backward()
        if step == 0:
            first_grads = {n: p.grad.to_local().clone() for n, p in model.named_parameters()}
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.item() / (BATCH * SEQ))
    return {"start": start, "params": {n: p.to_local().detach().clone() for n, p in model.named_parameters()},
            "losses": losses, "first_grads": first_grads}


def _hook_record(fn: Any) -> dict[str, Any]:
    state = fn.state
    return {"last_stats": state.last_stats, "calls": {name: unit.calls for name, unit in state.units.items()},
            "totals": state.take_stats().as_dict()}


def _scenarios(rank: int, world: int) -> dict[str, Any]:
    from torchtitan.config import ParallelismConfig
    from torchtitan.distributed import ParallelDims
    from torchtitan.models.llama3 import model_registry, parallelize_llama

    from gradwire.integrations.torchtitan import compressed

    fsdp_dims = ParallelDims.from_config(ParallelismConfig(spmd_backend="partial_dtensor"), world)
    out: dict[str, Any] = {}

    base = _train(parallelize_on_cpu, fsdp_dims, None, rank, world, force_sum=True)
    init = base["start"]
    out["uncompressed"] = base
    for spec in ("none", "int8"):
        fn = compressed(parallelize_on_cpu, spec)
        out[spec] = _train(fn, fsdp_dims, init, rank, world)
        out[spec]["hook"] = _hook_record(fn)

    called: list[bool] = []

    def records_call(model: nn.Module, **kwargs: Any) -> nn.Module:
        called.append(True)
        return model

    hsdp_dims = ParallelDims(dp_replicate=2, dp_shard=1, cp=1, tp=1, pp=1, ep=1, world_size=world)
    try:
        compressed(records_call, "int8")(nn.Linear(2, 2), parallel_dims=hsdp_dims)
        out["hsdp"] = None
    except NotImplementedError as exc:
        out["hsdp"] = str(exc)
    out["hsdp_called_original"] = bool(called)

    tp_only = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=2, pp=1, ep=1, world_size=world)
    fn, model = compressed(records_call, "int8"), nn.Linear(2, 2)
    out["no_dp"] = {"same_model": fn(model, parallel_dims=tp_only) is model, "states": len(fn.states),
                    "called": len(called)}

    spec = model_registry("debugmodel")
    fn = compressed(spec.parallelize_fn, "int8")
    titan_spec = dataclasses.replace(spec, parallelize_fn=fn)
    out["spec"] = {"copied_is_same": copy.deepcopy(titan_spec).parallelize_fn is fn,
                   "wraps": fn.parallelize_fn is parallelize_llama, "repr": repr(fn)}

    # torchtitan's FSDP as it is (gradient divide factor 1.0 -> PREMUL_SUM) on gloo; last, as it fails mid-backward
    try:
        _train(parallelize_on_cpu, fsdp_dims, init, rank, world)
        out["stock_gloo"] = None
    except RuntimeError as exc:
        out["stock_gloo"] = str(exc)
    return out


@pytest.fixture(scope="module")
def ranks() -> list[dict[str, Any]]:
    return run_ranks(_scenarios, 2, timeout=240)


def test_none_equals_uncompressed_bit_for_bit(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        base, none = r["uncompressed"], r["none"]
        assert none["losses"] == base["losses"]
        for name, p in base["params"].items():
            assert torch.equal(none["start"][name], base["start"][name]), name
            assert torch.equal(none["first_grads"][name], base["first_grads"][name]), name
            assert torch.equal(none["params"][name], p), name


def test_int8_trains_through_the_hook(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        run, base = r["int8"], r["uncompressed"]
        assert run["losses"][-1] < run["losses"][0] - 0.5, run["losses"]
        calls = run["hook"]["calls"]  # 4 FSDP groups: tok_embeddings, 2 layers, [norm, lm_head] (one group)
        assert sum(c == STEPS for c in calls.values()) == 4 and set(calls.values()) <= {0, STEPS}, calls
        assert abs(run["losses"][-1] - base["losses"][-1]) < 0.1, (run["losses"], base["losses"])
        # the summed gradient FSDP left on each shard (torchtitan's scaling: a sum, not a mean), up to int8's error
        for name, g in base["first_grads"].items():
            error = (run["first_grads"][name] - g).norm() / g.norm()
            assert 0 < error < 0.05, (name, error)


def test_int8_sends_fewer_bytes_than_none(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        int8, none = r["int8"]["hook"]["totals"], r["none"]["hook"]["totals"]
        assert 0 < int8["bytes_sent"] < 0.3 * none["bytes_sent"], (int8["bytes_sent"], none["bytes_sent"])


def test_last_stats_close_every_step(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        hook = r["int8"]["hook"]
        assert 0 not in hook["calls"].values(), hook["calls"]
        assert hook["last_stats"] is not None and hook["last_stats"]["step"] == STEPS - 1


def test_stock_fsdp_sum_needs_force_sum_on_gloo(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["stock_gloo"] is not None and "PREMUL_SUM" in r["stock_gloo"]


def test_hsdp_is_refused_before_parallelizing(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["hsdp"] is not None and "data_parallel_replicate_degree=2" in r["hsdp"]
        assert not r["hsdp_called_original"]


def test_no_sharded_data_parallelism_registers_nothing(ranks: list[dict[str, Any]]) -> None:
    for r in ranks:
        assert r["no_dp"] == {"same_model": True, "states": 0, "called": 1}


def test_model_spec_keeps_the_recipe_through_copies(ranks: list[dict[str, Any]]) -> None:
    assert ranks[0]["spec"] == {"copied_is_same": True, "wraps": True,
                                "repr": "compressed(parallelize_llama, 'int8')"}


def test_bad_options_raise_when_wrapping() -> None:
    from gradwire.integrations.torchtitan import compressed

    with pytest.raises(ValueError):
        compressed(parallelize_on_cpu, "no-such-compressor")
    with pytest.raises(ValueError):
        compressed(parallelize_on_cpu, "int8", strategy="no-such-strategy")
    with pytest.raises(ValueError, match="replicate_group"):
        compressed(parallelize_on_cpu, "int8", replicate_group=None)
    with pytest.raises(ValueError, match="has not run yet"):
        compressed(parallelize_on_cpu, "int8").state


def test_import_without_torchtitan_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delitem(sys.modules, "gradwire.integrations.torchtitan", raising=False)
    monkeypatch.setitem(sys.modules, "torchtitan.distributed", None)  # as if torchtitan were absent
    with pytest.raises(ImportError, match=r'pip install "gradwire\[torchtitan\]"'):
        importlib.import_module("gradwire.integrations.torchtitan")
