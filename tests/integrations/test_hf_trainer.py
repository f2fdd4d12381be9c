"""gradwire.integrations.hf_trainer with the real Hugging Face Trainer: 2 CPU ranks over gloo, a
one-layer GPT-2 on random tokens. Every multi-rank scenario runs in one 2-rank job (a module fixture;
importing transformers.trainer costs ~7 s a process), and one 1-rank job checks the single-process
case; the tests assert on what they return."""

from __future__ import annotations

import importlib
import logging
import os
import shutil
import sys
import tempfile
import warnings
from typing import Any

import pytest
import torch

from multiproc import run_ranks

from frameworks import require  # noqa: E402

require("transformers", "accelerate", extra="transformers")

SPEC = "topk:ratio=0.1"
HOOK = {"strategy": "allgather"}  # a resumed run is bit-identical to an uninterrupted one with allgather
STEPS, SAVE_AT = 6, 3
ADAM_STEPS = 20


# ---- what every rank runs ------------------------------------------------------------
def _join(rank: int, world: int) -> None:
    """Environment for Accelerate: it reads the ranks from it and uses the gloo group run_ranks made
    (with none, it sees a single process)."""
    os.environ.update(OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1")
    if world > 1:
        os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                          MASTER_ADDR="127.0.0.1")
    import transformers

    transformers.logging.set_verbosity_error()


def _model() -> torch.nn.Module:
    from transformers import GPT2Config, GPT2LMHeadModel

    torch.manual_seed(0)  # (no dropout: the runs compared bit for bit need no RNG)
    return GPT2LMHeadModel(GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=64, n_positions=32,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0))


def _data(n: int = 64) -> list[dict[str, torch.Tensor]]:
    tokens = torch.randint(0, 64, (n, 16), generator=torch.Generator().manual_seed(1))
    return [{"input_ids": t, "labels": t} for t in tokens]


def _trainer(out: str, callbacks: list | None = None, data_size: int = 64, **kw: Any) -> Any:
    from transformers import Trainer, TrainingArguments

    settings: dict[str, Any] = {"max_steps": STEPS, "learning_rate": 1e-2, "save_strategy": "no", "logging_steps": 1}
    settings.update(kw)
    args = TrainingArguments(output_dir=out, use_cpu=True, report_to=[], per_device_train_batch_size=4, seed=0,
                             disable_tqdm=True, **settings)
    return Trainer(model=_model(), args=args, train_dataset=_data(data_size), callbacks=callbacks)


def _params(trainer: Any) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in trainer.model.named_parameters()}


def _losses(trainer: Any) -> list[float]:
    return [h["loss"] for h in trainer.state.log_history if "loss" in h]


class _Logs(logging.Handler):
    """The gradwire logger's messages while it is attached."""

    def __init__(self) -> None:
        super().__init__(logging.WARNING)
        self.messages: list[str] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.messages.append(record.getMessage())

    def __enter__(self) -> _Logs:
        logging.getLogger("gradwire").addHandler(self)
        return self

    def __exit__(self, *exc: Any) -> None:
        logging.getLogger("gradwire").removeHandler(self)


def _callbacks() -> tuple[type, type]:
    from transformers import TrainerCallback

    class Probe(TrainerCallback):
        """Records the hook's step count after every optimizer step, and the steps saved."""

        def __init__(self) -> None:
            self.gradwire: Any = None  # the adapter's callback
            self.iters: list[int] = []
            self.saves: list[int] = []

        def on_step_end(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.iters.append(self.gradwire.state.iter)

        def on_save(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            self.saves.append(state.global_step)

    class ByHand(TrainerCallback):
        """What a user without the adapter writes: register on the DDP model at train begin."""

        def __init__(self, **options: Any) -> None:
            self.trainer: Any = None
            self.options = options
            self.state: Any = None

        def on_train_begin(self, args: Any, state: Any, control: Any, **kw: Any) -> None:
            from gradwire.hooks import ddp as gw_ddp

            self.state = gw_ddp.register(self.trainer.model_wrapped, **self.options)

    return Probe, ByHand


def _adapted(out: str, *, probe: Any = None, **kw: Any) -> tuple[Any, Any]:
    from gradwire.integrations import hf_trainer

    options = {k: kw.pop(k) for k in ("missing_state", "resume_from", "precondition") if k in kw}
    trainer = _trainer(out, callbacks=[probe] if probe is not None else None, **kw)
    callback = hf_trainer.register(trainer, SPEC, **HOOK, **options)
    if probe is not None:
        probe.gradwire = callback
    return trainer, callback


def _by_hand(out: str, **kw: Any) -> tuple[Any, Any]:
    _, ByHand = _callbacks()
    options = {"compressor": SPEC, **HOOK}
    if "precondition" in kw:
        options["precondition"] = kw.pop("precondition")
    callback = ByHand(**options)
    trainer = _trainer(out, callbacks=[callback], **kw)
    callback.trainer = trainer
    return trainer, callback


def _error(fn: Any) -> str:
    try:
        fn()
    except Exception as e:  # noqa: BLE001 - the scenario reports what was raised
        return f"{type(e).__name__}: {e}"
    return ""


def _barrier_copy(rank: int, src: str, dst: str, state_from: str | None = None) -> None:
    """Rank 0 copies a checkpoint folder without gradwire's file (or with another folder's), then all wait."""
    import torch.distributed as dist

    if rank == 0:
        shutil.copytree(src, dst, ignore=shutil.ignore_patterns("gradwire_state.pt"))
        if state_from is not None:
            shutil.copy(os.path.join(state_from, "gradwire_state.pt"), dst)
    dist.barrier()


def _scenarios(rank: int, world: int, root: str) -> dict[str, Any]:
    _join(rank, world)
    import torch.distributed as dist

    Probe, _ = _callbacks()
    r: dict[str, Any] = {}
    a, d, e = (os.path.join(root, x) for x in ("a", "d", "e"))

    # the adapter, saving every SAVE_AT steps; and the same run with the hook registered by hand
    probe = Probe()
    trainer, callback = _adapted(a, probe=probe, save_strategy="steps", save_steps=SAVE_AT)
    trainer.train()
    r["adapter"] = _params(trainer)
    r["iters"], r["saves"] = probe.iters, probe.saves
    r["history"] = [(h["step"], h["bytes_sent"]) for h in callback.state.history]
    r["dense_bytes"] = 4 * sum(p.numel() for p in trainer.model.parameters())
    r["files"] = {s: sorted(os.listdir(os.path.join(a, f"checkpoint-{s}"))) for s in (SAVE_AT, STEPS)}
    dist.barrier()  # (rank 1 listed the folders only once rank 0's files are there)
    trainer, _ = _by_hand(os.path.join(root, "hand"))
    trainer.train()
    r["by_hand"] = _params(trainer)
    probe = Probe()  # gradient accumulation: DDP exchanges (and the hook runs) once per optimizer step
    trainer, _ = _adapted(os.path.join(root, "accumulate"), probe=probe, max_steps=3, gradient_accumulation_steps=2)
    trainer.train()
    r["accumulated_iters"] = probe.iters

    # resume from checkpoint-SAVE_AT: found under output_dir, and given explicitly for a moved folder
    probe = Probe()
    trainer, _ = _adapted(a, probe=probe)
    trainer.train(resume_from_checkpoint=os.path.join(a, f"checkpoint-{SAVE_AT}"))
    r["resumed"], r["resumed_iters"] = _params(trainer), probe.iters
    trainer, _ = _adapted(os.path.join(root, "elsewhere"), resume_from=os.path.join(a, f"checkpoint-{SAVE_AT}"))
    trainer.train(resume_from_checkpoint=os.path.join(a, f"checkpoint-{SAVE_AT}"))
    r["resumed_from"] = _params(trainer)

    # a checkpoint without gradwire's file: an error by default, a warning (and a fresh hook) on request
    _barrier_copy(rank, os.path.join(a, f"checkpoint-{SAVE_AT}"), os.path.join(d, f"checkpoint-{SAVE_AT}"))
    trainer, _ = _adapted(d)
    r["missing_error"] = _error(lambda: trainer.train(resume_from_checkpoint=True))
    with _Logs() as logs:
        trainer, _ = _adapted(d, missing_state="warn", save_strategy="steps", save_steps=SAVE_AT,
                              save_on_each_node=True)
        trainer.train(resume_from_checkpoint=True)
    r["missing_warned"], r["missing_params"] = logs.messages, _params(trainer)
    # another run's state (same step, other weights; written with save_on_each_node) where it resumes: refused
    _barrier_copy(rank, os.path.join(a, f"checkpoint-{STEPS}"), os.path.join(e, f"checkpoint-{STEPS}"),
                  state_from=os.path.join(d, f"checkpoint-{STEPS}"))
    trainer, _ = _adapted(e, max_steps=STEPS + 1)
    r["foreign_error"] = _error(lambda: trainer.train(resume_from_checkpoint=True))

    # Adam before the exchange under the Trainer's default max_grad_norm=1.0: the adapter moves the clip
    adam = {"optim": "sgd", "max_steps": ADAM_STEPS, "learning_rate": 3e-3, "lr_scheduler_type": "constant",
            "adam_beta2": 0.95, "weight_decay": 0.01, "data_size": 16}
    with _Logs() as logs, warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, callback = _adapted(os.path.join(root, "p"), precondition="adam", **adam)
        r["p_max_grad_norm"] = trainer.args.max_grad_norm
        trainer.train()
    r["p_spec"] = callback.state.precondition
    r["p_logs"], r["p_warnings"] = logs.messages, [str(w.message) for w in caught if w.category is RuntimeWarning]
    r["p_losses"], r["p_grad_norm"] = _losses(trainer), callback.state.last_stats.get("grad_norm")
    inner = trainer.optimizer.optimizer
    r["p_optimizer"] = (type(inner).__name__, [(g["momentum"], g["weight_decay"]) for g in inner.param_groups])
    trainer, _ = _by_hand(os.path.join(root, "q"), precondition="adam:beta2=0.95", max_grad_norm=0.0, **adam)
    trainer.train()
    r["noclip_losses"] = _losses(trainer)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer, _ = _by_hand(os.path.join(root, "s"), precondition="adam:beta2=0.95", **adam)
        trainer.train()
    r["stalled_losses"] = _losses(trainer)
    r["stalled_warnings"] = [str(w.message) for w in caught if w.category is RuntimeWarning]
    trainer, _ = _adapted(os.path.join(root, "t"), precondition="adam", max_steps=1)
    r["adamw_error"] = _error(trainer.train)  # the default optimizer (AdamW) with precondition=

    r["fsdp_error"] = _error(lambda: _adapted(os.path.join(root, "f"), fsdp=True))
    return r


def _single(rank: int, world: int, root: str) -> dict[str, Any]:
    _join(rank, world)
    with _Logs() as logs:
        trainer, callback = _adapted(os.path.join(root, "one"), max_steps=2)
        trainer.train()
    error = _error(lambda: _adapted(os.path.join(root, "two"), precondition="adam", optim="sgd"))
    return {"logs": logs.messages, "state": callback.state, "trained": trainer.state.global_step, "error": error}


@pytest.fixture(scope="module")
def runs() -> list[dict[str, Any]]:
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_scenarios, 2, root, timeout=300)


@pytest.fixture(scope="module")
def single() -> dict[str, Any]:
    with tempfile.TemporaryDirectory() as root:
        return run_ranks(_single, 1, root, timeout=120)[0]


def _equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


# ---- the tests -----------------------------------------------------------------------
def test_adapter_trains_with_the_hook_called_every_step(runs):
    for r in runs:
        assert r["iters"] == list(range(1, STEPS + 1))  # the hook ran once in each optimizer step
        assert [s for s, _ in r["history"]] == list(range(STEPS))
        compressed = [b for s, b in r["history"] if s >= 2]  # (two dense steps while DDP settles its buckets)
        assert compressed and all(0 < b < r["dense_bytes"] / 3 for b in compressed)
        assert r["accumulated_iters"] == [1, 2, 3]
    assert _equal(runs[0]["adapter"], runs[1]["adapter"])
    assert not _equal(runs[0]["adapter"], {n: p * 0 for n, p in runs[0]["adapter"].items()})


def test_adapter_equals_registering_by_hand(runs):
    for r in runs:
        assert _equal(r["adapter"], r["by_hand"])


def test_on_save_runs_on_every_rank_and_rank_0_writes_every_ranks_state(runs):
    for r in runs:
        assert r["saves"] == [SAVE_AT, STEPS]
    for step in (SAVE_AT, STEPS):
        assert "gradwire_state.pt" in runs[0]["files"][step]
        assert "trainer_state.json" in runs[0]["files"][step]


def test_resume_is_bit_identical_to_the_uninterrupted_run(runs):
    for r in runs:
        assert r["resumed_iters"] == list(range(SAVE_AT + 1, STEPS + 1))  # the hook continued from the saved step
        assert _equal(r["resumed"], r["adapter"])
        assert _equal(r["resumed_from"], r["adapter"])  # a checkpoint folder given with resume_from=


def test_resume_without_gradwire_state_is_loud_and_differs(runs):
    for r in runs:
        assert r["missing_error"].startswith("FileNotFoundError")
        assert f"checkpoint-{SAVE_AT} holds no gradwire_state.pt" in r["missing_error"]
        assert any(f"checkpoint-{SAVE_AT} holds no gradwire_state.pt" in m for m in r["missing_warned"])
        assert not _equal(r["missing_params"], r["adapter"])  # so the resume test above needs the hook's state


def test_another_runs_state_in_the_resumed_folder_is_refused(runs):
    for r in runs:
        assert r["foreign_error"].startswith("ValueError") and "other model weights" in r["foreign_error"]


def test_preconditioned_recipe_trains_under_the_default_max_grad_norm(runs):
    for r in runs:
        assert r["p_max_grad_norm"] == 0.0
        assert r["p_spec"] == "adam:beta1=0.9,beta2=0.95,eps=1e-08,clip=1"  # betas from TrainingArguments
        assert len(r["p_logs"]) == 1 and "max_grad_norm=1" in r["p_logs"][0]
        assert "set TrainingArguments.max_grad_norm=0" in r["p_logs"][0] and "gradient to 1 " in r["p_logs"][0]
        assert f"precondition='{r['p_spec']}'" in r["p_logs"][0]
        assert r["p_grad_norm"] is not None  # the hook measured (and clipped) the true gradient
        assert r["p_optimizer"] == ("SGD", [(0, 0.01), (0, 0.0)])  # optim="sgd": no momentum, decay groups kept
        drop = {k: r[k][0] - min(r[k][-3:]) for k in ("p_losses", "noclip_losses", "stalled_losses")}
        assert drop["noclip_losses"] > 0.3
        assert drop["p_losses"] > 0.7 * drop["noclip_losses"]
        assert drop["stalled_losses"] < 0.2 * drop["noclip_losses"]  # the Trainer clipping Adam's direction
        assert any("scaled it by" in w for w in r["stalled_warnings"])
        assert r["p_warnings"] == []  # (neither "scaled it by" nor "not been called")


def test_preconditioning_needs_plain_sgd(runs):
    for r in runs:
        assert r["adamw_error"].startswith("ValueError") and "optim='sgd'" in r["adamw_error"]


def test_fsdp_through_the_trainer_is_refused(runs):
    for r in runs:
        assert r["fsdp_error"].startswith("ValueError") and "FSDP" in r["fsdp_error"]


def test_single_process_warns_and_trains_without_the_hook(single):
    assert single["state"] is None and single["trained"] == 2
    assert any("single process" in m for m in single["logs"])
    assert single["error"].startswith("ValueError") and "single-process" in single["error"]


def test_import_without_transformers_names_the_extra(monkeypatch):
    monkeypatch.setitem(sys.modules, "transformers", None)
    monkeypatch.delitem(sys.modules, "gradwire.integrations.hf_trainer", raising=False)
    with pytest.raises(ImportError, match=r'pip install "gradwire\[transformers\]"'):
        importlib.import_module("gradwire.integrations.hf_trainer")
