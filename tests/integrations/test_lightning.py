"""The Lightning callback with the real Lightning: 2 CPU ranks over gloo, Lightning initialising the
process group itself (env://, as under torchrun).

Every multi-rank scenario runs in one 2-rank job (`results`, module-scoped: each process pays
Lightning's import once); the tests assert on what it returns.
"""

from __future__ import annotations

import importlib
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

from frameworks import require
from lightning_launch import run_lightning_ranks

require("lightning", extra="lightning")

DDP_SPEC = {"compressor": "topk:ratio=0.1", "strategy": "allgather"}
STEPS = 6  # two epochs of 3 steps
SAVED_AT = 3  # the last step of the first epoch: Lightning resumes a non-resumable DataLoader exactly there


# ---- what each rank runs (module level: the ranks unpickle it) -------------------------------
def _module(shard_dim: str | None = None) -> Any:
    import lightning.pytorch as pl

    class Tiny(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            torch.manual_seed(0)
            self.net = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 1))

        def configure_model(self) -> None:
            from torch.distributed.fsdp import FSDPModule, fully_shard

            if shard_dim is None or isinstance(self.net, FSDPModule):
                return
            mesh = self.device_mesh[shard_dim]
            fully_shard(self.net[0], mesh=mesh)
            fully_shard(self.net, mesh=mesh)

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            return torch.nn.functional.mse_loss(self.net(x), y)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1, momentum=0.9)

        def train_dataloader(self) -> Any:
            g = torch.Generator().manual_seed(1)
            x = torch.randn(12, 16, generator=g)
            data = torch.utils.data.TensorDataset(x, torch.sin(x.sum(1, keepdim=True)))
            return torch.utils.data.DataLoader(data, batch_size=2)  # 3 batches per rank and epoch at 2 ranks

    return Tiny()


def _hand_registered() -> Any:
    """What the issue's users did by hand: register on the wrapped model in on_fit_start."""
    import lightning.pytorch as pl

    from gradwire.hooks import ddp

    class Hand(pl.Callback):
        def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
            self.state = ddp.register(trainer.strategy.model, **DDP_SPEC)

    return Hand()


def _fsdp1_on_cpu() -> Any:
    """FSDP1 (which gradwire does not serve). Lightning refuses `FSDPStrategy` itself on CPU, a
    user's subclass of it is let through."""
    from lightning.pytorch.strategies import FSDPStrategy

    class CPUFSDPStrategy(FSDPStrategy):
        pass

    return CPUFSDPStrategy()


def _fit(callback: Any, strategy: Any = "ddp", *, devices: int = 2, shard_dim: str | None = None,
         save_to: Path | None = None, ckpt_path: Path | None = None, steps: int = STEPS) -> dict[str, Any]:
    """One fit; returns the parameters (full tensors), the callback and the gradwire warnings, or
    the exception it raised."""
    import warnings

    import lightning.pytorch as pl
    from torch.distributed.tensor import DTensor

    callbacks = [callback]
    if save_to is not None:
        callbacks.append(pl.callbacks.ModelCheckpoint(dirpath=save_to, every_n_train_steps=SAVED_AT, save_top_k=-1))
    trainer = pl.Trainer(accelerator="cpu", devices=devices, strategy=strategy, max_steps=steps, logger=False,
                         callbacks=callbacks, enable_checkpointing=save_to is not None, enable_progress_bar=False,
                         enable_model_summary=False, default_root_dir=save_to)
    model = _module(shard_dim)
    out: dict[str, Any] = {"callback": callback, "error": None}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, ckpt_path=ckpt_path)
        except Exception as e:  # noqa: BLE001 - the scenario reports it
            out["error"] = (type(e).__name__, str(e))
    out["warnings"] = [str(w.message) for w in caught if "GradwireCallback" in str(w.message) or "gradwire" in str(w.message)]
    if out["error"] is None:
        out["params"] = {k: (v.full_tensor() if isinstance(v, DTensor) else v).detach().clone()
                         for k, v in model.state_dict().items()}
        out["trainer"] = trainer
    return out


def _summary(run: dict[str, Any]) -> dict[str, Any]:
    """The picklable part of a fit's outcome."""
    own = vars(run["callback"])
    state = own.get("_state") or own.get("state")  # GradwireCallback's, or the hand-registered one
    history = getattr(state, "history", None)
    return {"params": run.get("params"), "error": run["error"], "warnings": run["warnings"],
            "last_stats": None if state is None else state.last_stats,
            "history": None if history is None else [(h["step"], h["bytes_sent"], h["dense_bytes"],
                                                       sorted(set(h["buckets"].values()))) for h in history]}


def _scenarios(rank: int, world: int, tmp: str) -> dict[str, Any]:
    import logging

    from lightning.pytorch.strategies import DDPStrategy, ModelParallelStrategy

    from gradwire.integrations.lightning import GradwireCallback

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    root = Path(tmp)
    ckpt = f"epoch=0-step={SAVED_AT}.ckpt"
    out: dict[str, Any] = {}

    # -- DDPStrategy on CPU: the callback, by hand, resumed, resumed without gradwire's state, changed config
    full = _fit(GradwireCallback(**DDP_SPEC), DDPStrategy(), save_to=root / "ddp")
    full["trainer"].save_checkpoint(root / "end.ckpt")  # on every rank, as Lightning asks
    out["ddp"] = _summary(full)
    if rank == 0:
        saved = torch.load(root / "end.ckpt", weights_only=False)["callbacks"]["GradwireCallback"]
        out["saved_ranks"] = [s["rank"] for s in saved["ranks"]]
    out["hand"] = _summary(_fit(_hand_registered(), DDPStrategy(), save_to=root / "hand"))
    out["resumed"] = _summary(_fit(GradwireCallback(**DDP_SPEC), DDPStrategy(), ckpt_path=root / "ddp" / ckpt))
    out["resumed_without_state"] = _summary(_fit(GradwireCallback(**DDP_SPEC), DDPStrategy(),
                                                 ckpt_path=root / "hand" / ckpt))
    out["changed_config"] = _summary(_fit(GradwireCallback("topk:ratio=0.2", strategy="allgather"), DDPStrategy(),
                                          ckpt_path=root / "ddp" / ckpt))

    # -- ModelParallelStrategy (FSDP2): data-parallel size 2, resumed, size 1, HSDP through gradwire
    dp2 = {"data_parallel_size": 2, "tensor_parallel_size": 1}
    out["fsdp"] = _summary(_fit(GradwireCallback("topk:ratio=0.1"), ModelParallelStrategy(**dp2),
                                shard_dim="data_parallel", save_to=root / "fsdp"))
    out["fsdp_resumed"] = _summary(_fit(GradwireCallback("topk:ratio=0.1"), ModelParallelStrategy(**dp2),
                                        shard_dim="data_parallel", ckpt_path=root / "fsdp" / ckpt))
    out["fsdp_dp1"] = _summary(_fit(GradwireCallback(), ModelParallelStrategy(), shard_dim="data_parallel", steps=2))
    out["hsdp"] = _summary(_fit(GradwireCallback("topk:ratio=0.1", replicate_dim="data_parallel"),
                                ModelParallelStrategy(**dp2), shard_dim="tensor_parallel", steps=4))

    # -- strategies gradwire does not serve
    out["single"] = _summary(_fit(GradwireCallback(), "auto", devices=1, steps=1))
    out["fsdp1"] = _summary(_fit(GradwireCallback(), _fsdp1_on_cpu(), steps=1))
    return out


# ---- the tests ----------------------------------------------------------------------------
@pytest.fixture(scope="module")
def results(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    return run_lightning_ranks(_scenarios, 2, str(tmp_path_factory.mktemp("lightning")), timeout=300)


def _same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_ddp_on_cpu_calls_the_hook_every_step(results: list[dict[str, Any]]) -> None:
    for r in results:
        run = r["ddp"]
        assert run["error"] is None
        steps = [h[0] for h in run["history"]]
        assert steps == list(range(STEPS))  # the hook ran at every step, on CPU
        for step, sent, dense, used in run["history"][2:]:  # after the two dense steps DDP needs
            assert used == ["allgather"] and 0 < sent < dense / 2, (step, sent, dense, used)


def test_callback_equals_registering_by_hand(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["hand"]["error"] is None
        assert _same(r["ddp"]["params"], r["hand"]["params"])
    assert _same(results[0]["ddp"]["params"], results[1]["ddp"]["params"])


def test_checkpoints_hold_every_ranks_state(results: list[dict[str, Any]]) -> None:
    assert results[0]["saved_ranks"] == [0, 1]


def test_resume_continues_bit_identically(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["resumed"]["error"] is None and r["resumed"]["warnings"] == []
        assert _same(r["resumed"]["params"], r["ddp"]["params"])
        assert [h[0] for h in r["resumed"]["history"]] == list(range(SAVED_AT, STEPS))


def test_resume_without_gradwire_state_warns_and_differs(results: list[dict[str, Any]]) -> None:
    for r in results:
        run = r["resumed_without_state"]
        assert run["error"] is None
        assert any("without gradwire's state" in w for w in run["warnings"])
        assert not _same(run["params"], r["ddp"]["params"])  # so the resume test is not vacuous


def test_resume_with_other_settings_is_refused(results: list[dict[str, Any]]) -> None:
    for r in results:
        kind, message = r["changed_config"]["error"]
        assert kind == "ValueError" and "checkpoint was saved with" in message


def test_fsdp2_data_parallel_2_calls_the_hook(results: list[dict[str, Any]]) -> None:
    for r in results:
        run = r["fsdp"]
        assert run["error"] is None and run["warnings"] == []
        stats = run["last_stats"]
        assert stats["step"] == STEPS - 1 and 0 < stats["bytes_sent"] < stats["dense_bytes"]
    assert _same(results[0]["fsdp"]["params"], results[1]["fsdp"]["params"])  # (full tensors)


def test_fsdp2_resume_continues_bit_identically(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["fsdp_resumed"]["error"] is None
        assert r["fsdp_resumed"]["last_stats"]["step"] == STEPS - 1
        assert _same(r["fsdp_resumed"]["params"], r["fsdp"]["params"])


def test_fsdp2_data_parallel_1_warns(results: list[dict[str, Any]]) -> None:
    for r in results:
        run = r["fsdp_dp1"]
        assert run["error"] is None and run["last_stats"] is None  # registered, never called
        said = [w for w in run["warnings"] if "data-parallel size 1" in w or "has not been called" in w]
        assert len(said) == 1 and "ModelParallelStrategy(data_parallel_size=N)" in said[0], run["warnings"]


def test_hsdp_through_gradwire_averages_replicas(results: list[dict[str, Any]]) -> None:
    for r in results:
        run = r["hsdp"]
        assert run["error"] is None and run["warnings"] == []
        stats = run["last_stats"]
        assert stats["step"] == 3 and 0 < stats["bytes_sent"] < stats["dense_bytes"]
    assert _same(results[0]["hsdp"]["params"], results[1]["hsdp"]["params"])  # replicas stay identical


def test_single_device_warns_and_other_strategies_raise(results: list[dict[str, Any]]) -> None:
    for r in results:
        assert r["single"]["error"] is None
        assert any("one device" in w for w in r["single"]["warnings"])
        kind, message = r["fsdp1"]["error"]
        assert kind == "TypeError" and "does not support CPUFSDPStrategy" in message


def test_import_without_lightning_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "lightning", None)
    monkeypatch.setitem(sys.modules, "lightning.pytorch", None)
    monkeypatch.delitem(sys.modules, "gradwire.integrations.lightning", raising=False)
    with pytest.raises(ImportError, match=r'pip install "gradwire\[lightning\]"'):
        importlib.import_module("gradwire.integrations.lightning")
