"""gradwire.integrations.accelerate with the real Accelerate: 2 CPU ranks over gloo, a tiny model,
gradient accumulation over 2 micro-steps.

One 2-rank job (the module fixture) runs every scenario: the helper's run (saving at a sync step),
the hand-registered run, resumes from the checkpoints (all ranks' states in one file, as written
with save_on_each_node, one file per rank, and without gradwire's state) and the misuses; a
1-process job runs next to it. The tests assert on what they return.
"""

from __future__ import annotations

import importlib
import os
import shutil
import sys
import tempfile
import warnings
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import pytest
import torch

from frameworks import require  # noqa: E402

require("accelerate", extra="accelerate")

from multiproc import run_ranks  # noqa: E402  (tests/support, on sys.path from conftest)

SPEC = "topk:ratio=0.1"
OPTIONS = {"strategy": "allgather"}  # bit-identical resumes
ACCUM = 2
STEPS = 12  # micro-steps: 6 sync steps, compressed from the third
SAVE_AT = 8  # saved after this many micro-steps (a sync step, after 2 compressed ones)


# ---- what the ranks run ----------------------------------------------------------------------
def _setup(**accelerator_options: Any) -> tuple[Any, Any, Any]:
    from accelerate import Accelerator

    accelerator = Accelerator(cpu=True, gradient_accumulation_steps=ACCUM, **accelerator_options)
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))
    optimizer = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
    model, optimizer = accelerator.prepare(net, optimizer)
    return accelerator, model, optimizer


def _train(accelerator: Any, model: Any, optimizer: Any, rank: int, start: int, stop: int, state: Any = None,
           after: Callable[[int], None] | None = None) -> list[tuple[bool, int | None]]:
    """Micro-steps [start, stop) on this rank's fixed batches; (sync step?, hook steps done) after each."""
    trace = []
    for step in range(start, stop):
        g = torch.Generator().manual_seed(1000 * step + rank)
        x, y = torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)
        with accelerator.accumulate(model):
            accelerator.backward(torch.nn.functional.mse_loss(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
        trace.append((accelerator.sync_gradients, state.iter if state is not None else None))
        if after is not None:
            after(step + 1)
    return trace


def _params(model: Any) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.module.parameters()]


def _two_ranks(rank: int, world: int, tmp: str) -> dict[str, Any]:
    # what `accelerate launch` sets; Accelerate takes the process group run_ranks has initialized
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))
    import torch.distributed as dist
    from accelerate.utils import DDPCommunicationHookType, DistributedDataParallelKwargs

    from gradwire.hooks import ddp as ddp_hooks
    from gradwire.integrations import accelerate as gw_accelerate

    ckpt, per_node, per_rank, bare = (os.path.join(tmp, name)
                                      for name in ("ckpt", "ckpt_per_node", "ckpt_per_rank", "ckpt_bare"))
    out: dict[str, Any] = {}

    # the helper, uninterrupted; it saves at SAVE_AT (also as save_on_each_node would) and goes on
    accelerator, model, optimizer = _setup()
    state = gw_accelerate.register(accelerator, model, SPEC, **OPTIONS)

    def save(done: int) -> None:
        if done == SAVE_AT:
            accelerator.save_state(ckpt)
            accelerator.project_configuration.save_on_each_node = True
            accelerator.save_state(per_node)
            accelerator.project_configuration.save_on_each_node = False

    out["trace"] = _train(accelerator, model, optimizer, rank, 0, STEPS, state, after=save)
    out["history"] = [(h["step"], h.get("density")) for h in state.history]
    out["helper"] = _params(model)

    # the hook registered by hand on the prepared model
    accelerator, model, optimizer = _setup()
    ddp_hooks.register(model, SPEC, **OPTIONS)
    _train(accelerator, model, optimizer, rank, 0, STEPS)
    out["hand"] = _params(model)

    # fresh objects resumed from each checkpoint
    for name, folder in (("resumed", ckpt), ("resumed_per_node", per_node)):
        accelerator, model, optimizer = _setup()
        state = gw_accelerate.register(accelerator, model, SPEC, **OPTIONS)
        accelerator.load_state(folder)
        out[f"{name}_iter"] = state.iter
        _train(accelerator, model, optimizer, rank, SAVE_AT, STEPS)
        out[name] = _params(model)

    # checkpoint="per_rank": each rank writes and reads its own file, through Accelerate's pre-hooks
    accelerator, model, optimizer = _setup()
    gw_accelerate.register(accelerator, model, SPEC, checkpoint="per_rank", **OPTIONS)
    _train(accelerator, model, optimizer, rank, 0, SAVE_AT)
    accelerator.save_state(per_rank)
    accelerator, model, optimizer = _setup()
    state = gw_accelerate.register(accelerator, model, SPEC, checkpoint="per_rank", **OPTIONS)
    accelerator.load_state(per_rank)
    out["resumed_per_rank_iter"] = state.iter
    _train(accelerator, model, optimizer, rank, SAVE_AT, STEPS)
    out["resumed_per_rank"] = _params(model)
    out["per_rank_files"] = sorted(f for f in os.listdir(per_rank) if f.startswith(("gradwire", "custom_")))
    try:
        accelerator.load_state(ckpt)  # one saved the other way
        out["per_rank_missing"] = None
    except FileNotFoundError as exc:
        out["per_rank_missing"] = str(exc)

    # resumed with everything but gradwire's state: must differ, or the resume test proves nothing
    if rank == 0:
        shutil.copytree(ckpt, bare)
        os.remove(os.path.join(bare, "custom_checkpoint_0.pkl"))
    dist.barrier()
    accelerator, model, optimizer = _setup()
    ddp_hooks.register(model, SPEC, **OPTIONS)
    accelerator.load_state(bare)
    _train(accelerator, model, optimizer, rank, SAVE_AT, STEPS)
    out["bare"] = _params(model)

    # what users try first: the hook in DistributedDataParallelKwargs (Accelerate ignores it)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        accelerator, model, optimizer = _setup(
            kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=ddp_hooks.gradwire_hook)])
        state = gw_accelerate.register(accelerator, model, SPEC, **OPTIONS)
    out["kwargs_warnings"] = [str(w.message) for w in caught if "comm_hook" in str(w.message)]
    out["kwargs_trace"] = _train(accelerator, model, optimizer, rank, 0, 2 * ACCUM, state)

    # Accelerate's own hook already registered; and the model before prepare
    accelerator, model, optimizer = _setup(
        kwargs_handlers=[DistributedDataParallelKwargs(comm_hook=DDPCommunicationHookType.FP16)])
    for key, target in (("own_hook_error", model), ("unprepared_error", model.module)):
        try:
            gw_accelerate.register(accelerator, target, SPEC)
            out[key] = None
        except (ValueError, TypeError) as exc:
            out[key] = f"{type(exc).__name__}: {exc}"
    return out


def _one_process(rank: int, world: int) -> dict[str, Any]:
    """`python train.py`: no launcher variables, so Accelerate runs one process without DDP."""
    from gradwire.integrations import accelerate as gw_accelerate

    accelerator, model, optimizer = _setup()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        state = gw_accelerate.register(accelerator, model, SPEC, **OPTIONS)
    trace = _train(accelerator, model, optimizer, rank, 0, 2 * ACCUM, state)
    try:
        gw_accelerate.register(accelerator, model, SPEC, checkpoint="all")
        bad_checkpoint = None
    except ValueError as exc:
        bad_checkpoint = str(exc)
    with tempfile.TemporaryDirectory() as tmp:
        accelerator.save_state(tmp)
        saved = sorted(f for f in os.listdir(tmp) if f.startswith(("gradwire", "custom_")))
    return {"bad_checkpoint": bad_checkpoint, "trace": trace, "wrapped": type(model).__name__, "saved": saved,
            "warnings": [str(w.message) for w in caught if "gradwire" in str(w.message)], "state": type(state).__name__}


# ---- the jobs, run once -----------------------------------------------------------------------
@pytest.fixture(scope="module")
def runs() -> Any:
    with tempfile.TemporaryDirectory() as tmp, ThreadPoolExecutor(2) as pool:
        two = pool.submit(run_ranks, _two_ranks, 2, tmp, timeout=240.0)
        one = pool.submit(run_ranks, _one_process, 1, timeout=240.0)
        ranks = two.result()
        saved = torch.load(os.path.join(tmp, "ckpt", "custom_checkpoint_0.pkl"), weights_only=False)
        yield {"ranks": ranks, "one": one.result()[0], "saved": saved}


def _equal(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


# ---- the tests --------------------------------------------------------------------------------
def test_hook_runs_on_every_sync_step_only(runs: Any) -> None:
    for out in runs["ranks"]:
        syncs = [sync for sync, _ in out["trace"]]
        assert syncs == [(i + 1) % ACCUM == 0 for i in range(STEPS)]
        done = [i for _, i in out["trace"]]
        assert done == [(i + 1) // ACCUM for i in range(STEPS)], "the hook must run once per sync step, never between"
        assert out["history"] == [(s, 0.1 if s >= 2 else None) for s in range(STEPS // ACCUM)]


def test_helper_equals_hand_registered(runs: Any) -> None:
    for out in runs["ranks"]:
        assert _equal(out["helper"], out["hand"])


def test_ranks_hold_the_same_parameters(runs: Any) -> None:
    first, second = runs["ranks"]
    for key in ("helper", "resumed", "resumed_per_node", "resumed_per_rank"):
        assert _equal(first[key], second[key]), key


def test_checkpoint_holds_every_ranks_state(runs: Any) -> None:
    saved = runs["saved"]
    assert saved["format"] == "gradwire-all-ranks" and saved["world_size"] == 2
    assert [s["rank"] for s in saved["ranks"]] == [0, 1]
    assert [s["iter"] for s in saved["ranks"]] == [SAVE_AT // ACCUM] * 2


def test_resume_is_bit_identical(runs: Any) -> None:
    for out in runs["ranks"]:
        assert out["resumed_iter"] == out["resumed_per_node_iter"] == SAVE_AT // ACCUM
        assert _equal(out["resumed"], out["helper"])
        assert _equal(out["resumed_per_node"], out["helper"])


def test_resume_from_per_rank_files_is_bit_identical(runs: Any) -> None:
    for rank, out in enumerate(runs["ranks"]):
        assert out["per_rank_files"] == ["gradwire_rank0.pt", "gradwire_rank1.pt"]
        assert out["resumed_per_rank_iter"] == SAVE_AT // ACCUM
        assert _equal(out["resumed_per_rank"], out["helper"])
        assert f"gradwire_rank{rank}.pt: no gradwire state for rank {rank}" in out["per_rank_missing"]


def test_resume_without_gradwire_state_differs(runs: Any) -> None:
    for out in runs["ranks"]:
        assert not _equal(out["bare"], out["helper"])


def test_hook_in_ddp_kwargs_warns_and_the_helper_runs(runs: Any) -> None:
    for out in runs["ranks"]:
        assert len(out["kwargs_warnings"]) == 1 and "ignored by Accelerate" in out["kwargs_warnings"][0]
        assert [i for _, i in out["kwargs_trace"]] == [0, 1, 1, 2]


def test_misuse_raises(runs: Any) -> None:
    for out in runs["ranks"]:
        assert out["own_hook_error"].startswith("ValueError") and "'fp16'" in out["own_hook_error"]
        assert out["unprepared_error"].startswith("TypeError") and "accelerator.prepare" in out["unprepared_error"]


def test_one_process_warns_and_registers_nothing(runs: Any) -> None:
    one = runs["one"]
    assert one["wrapped"] != "DistributedDataParallel" and one["saved"] == []
    assert len(one["warnings"]) == 1 and "nothing is compressed" in one["warnings"][0]
    assert one["state"] == "GradwireState" and [i for _, i in one["trace"]] == [0, 0, 0, 0]
    assert "checkpoint must be 'all_ranks', 'per_rank' or None" in one["bad_checkpoint"]


def test_import_without_accelerate_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "accelerate", None)  # what `import accelerate` finds when it is absent
    monkeypatch.delitem(sys.modules, "gradwire.integrations.accelerate", raising=False)
    with pytest.raises(ImportError, match=r'pip install "gradwire\[accelerate\]"'):
        importlib.import_module("gradwire.integrations.accelerate")
