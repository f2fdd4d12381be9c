"""Lightning adapter: a `Callback` that installs gradwire when the model is wrapped, on any device.

    from gradwire.integrations.lightning import GradwireCallback

    gradwire = GradwireCallback("topk:ratio=0.01", strategy="allgather")
    trainer = Trainer(strategy="ddp", callbacks=[gradwire], ...)   # or ModelParallelStrategy(...)
    trainer.fit(model)                        # resume: trainer.fit(model, ckpt_path=...)
    gradwire.state.last_stats                 # the hook state, once fit has started

Why a callback: `DDPStrategy(ddp_comm_hook=...)` registers the hook on CUDA only (elsewhere it is
silently dropped), and a callback's `setup()` still sees the unwrapped model. The callback
registers in `on_fit_start`, when `trainer.strategy.model` is the wrapped one:

- `DDPStrategy` (CPU or GPU): `gradwire.hooks.ddp.register` on the `DistributedDataParallel` model.
- `ModelParallelStrategy` with `fully_shard` applied in `configure_model`: `gradwire.hooks.fsdp.register`
  on the sharded module. For HSDP through gradwire (`fully_shard` on one mesh dimension, gradwire
  averaging over another), name the replica dimension of `trainer.strategy.device_mesh`:
  ``GradwireCallback("int8", replicate_dim="data_parallel")``. A data-parallel size of 1 warns
  (the FSDP hook's register does): there is no gradient exchange to compress.
- A single device warns (nothing to exchange); any other strategy (DeepSpeed, FSDP1, XLA) raises.

Checkpoints: each rank's hook state differs (error-feedback residuals), but Lightning writes what
rank 0 holds, so `state_dict()` gathers every rank's state (a collective: Lightning calls it on every
rank when any checkpoint is saved) and `load_state_dict()` gives each rank its own entry, kept
pending until the hook is registered. A resumed fit with the same settings continues exactly as an
uninterrupted one (bit for bit with ``strategy="allgather"``); other settings raise ValueError.
"""

from __future__ import annotations

import warnings
from typing import Any, Union

import torch
from torch.distributed.fsdp import FSDPModule

try:
    from lightning.pytorch import LightningModule, Trainer
    from lightning.pytorch.callbacks import Callback
    from lightning.pytorch.strategies import (DDPStrategy, DeepSpeedStrategy, ModelParallelStrategy,
                                              SingleDeviceStrategy, XLAStrategy)
except ImportError as exc:  # pragma: no cover - exercised by a test that hides lightning
    raise ImportError('gradwire.integrations.lightning needs Lightning 2.x (lightning.pytorch): '
                      'pip install "gradwire[lightning]"') from exc

from ..compress import Compressor
from ..hooks import ddp as ddp_hook
from ..hooks import fsdp as fsdp_hook

HookState = Union[ddp_hook.GradwireState, fsdp_hook.FSDPGradwireState]

SUPPORTED = ("DDPStrategy (any device) and ModelParallelStrategy with fully_shard (FSDP2) applied in "
             "configure_model")


class GradwireCallback(Callback):
    """Install gradwire's DDP or FSDP2 hook when fit starts, and keep every rank's hook state in
    Lightning's checkpoints.

    compressor: a spec string or Compressor; default: the hook's own (``"topk:ratio=0.01"`` for DDP, ``"int8"``
    for FSDP2). replicate_dim: ModelParallelStrategy only, the `device_mesh` dimension gradwire
    averages over (HSDP through gradwire). options: the hook's (`strategy=`, `error_feedback=`, ...)."""

    def __init__(self, compressor: Compressor | str | None = None, *, replicate_dim: str | None = None, **options: Any) -> None:
        self.compressor = compressor
        self.replicate_dim = replicate_dim
        self.options = options
        self._state: HookState | None = None
        self._pending: dict[str, Any] | None = None  # restored before the hook existed

    @property
    def state(self) -> HookState:
        """The hook state (statistics, `state_dict()`); there is one once fit has started."""
        if self._state is None:
            raise RuntimeError("GradwireCallback has no hook state yet: it registers the hook when fit starts "
                               "(and only on " + SUPPORTED + ")")
        return self._state

    # ---- installing the hook ---------------------------------------------------------
    def setup(self, trainer: Trainer, pl_module: LightningModule, stage: str) -> None:
        """Refuse a strategy gradwire cannot serve before anything runs."""
        if stage == "fit":
            _kind(trainer)

    def on_fit_start(self, trainer: Trainer, pl_module: LightningModule) -> None:
        kind = _kind(trainer)
        if kind == "single":
            warnings.warn(f"GradwireCallback: {type(trainer.strategy).__name__} trains on one device, so there is "
                          f"no gradient exchange to compress; gradwire is not installed (it serves {SUPPORTED})",
                          RuntimeWarning, stacklevel=2)
            return
        if self.replicate_dim is not None and kind != "fsdp2":
            raise ValueError("GradwireCallback(replicate_dim=...) is for ModelParallelStrategy (HSDP); "
                             f"this trainer uses {type(trainer.strategy).__name__}")
        self._state = self._register_ddp(trainer) if kind == "ddp" else self._register_fsdp(trainer)
        if self._pending is not None:  # Lightning restored callbacks before the hook existed
            pending, self._pending = self._pending, None
            self._state.load_state_dict(pending)

    def _settings(self, state_type: type) -> dict[str, Any]:
        """The hook's options; the existing state (a second fit) when it is of the right kind."""
        if isinstance(self._state, state_type):
            return {"state": self._state}
        return {**({"compressor": self.compressor} if self.compressor is not None else {}), **self.options}

    def _register_ddp(self, trainer: Trainer) -> ddp_hook.GradwireState:
        model = trainer.strategy.model
        if not isinstance(model, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"GradwireCallback: {type(trainer.strategy).__name__} did not wrap the model in "
                            f"DistributedDataParallel (got {type(model).__name__}); gradwire serves {SUPPORTED}")
        try:
            return ddp_hook.register(model, **self._settings(ddp_hook.GradwireState))
        except RuntimeError as e:
            if "only be called once" not in str(e):
                raise
            raise RuntimeError("GradwireCallback: this DDP model already has a communication hook; pass gradwire "
                               "either as the callback or as DDPStrategy(ddp_comm_hook=...) (CUDA only), "
                               "not both") from e

    def _register_fsdp(self, trainer: Trainer) -> fsdp_hook.FSDPGradwireState:
        model = trainer.strategy.model
        if model is None or not any(isinstance(m, FSDPModule) for m in model.modules()):
            raise TypeError("GradwireCallback with ModelParallelStrategy needs fully_shard (FSDP2) applied to the "
                            "model in LightningModule.configure_model(); found no FSDP2 module")
        settings = self._settings(fsdp_hook.FSDPGradwireState)
        if self.replicate_dim is not None:
            group = _mesh_group(trainer, self.replicate_dim)
            if "state" not in settings:
                settings["replicate_group"] = group
        state = fsdp_hook.register(model, **settings)  # (it warns when the data-parallel size is 1)
        return state

    # ---- checkpoints -----------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Every rank's hook state, gathered on rank 0 (a collective: Lightning calls it on every rank
        while saving; rank 0's copy is the one written). Empty before fit starts."""
        if self._state is None:
            return {}
        return self._state.all_ranks_state_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """This rank's entry goes to the hook state, now or when the hook is registered. A state saved
        with other settings, or by a job of another size, raises ValueError."""
        if self._state is None:
            self._pending = state_dict
        else:
            self._state.load_state_dict(state_dict)

    def on_load_checkpoint(self, trainer: Trainer, pl_module: LightningModule, checkpoint: dict[str, Any]) -> None:
        """Warn when resuming from a full checkpoint that holds no gradwire state."""
        callbacks = checkpoint.get("callbacks")
        if callbacks is not None and self.state_key not in callbacks:
            warnings.warn("GradwireCallback: resuming from a checkpoint without gradwire's state (saved without "
                          "this callback): error-feedback residuals restart from zero, so training does not "
                          "continue exactly as the saved run would have", RuntimeWarning, stacklevel=2)


def _kind(trainer: Trainer) -> str:
    """'ddp', 'fsdp2' or 'single'; TypeError for a strategy gradwire cannot serve."""
    strategy = trainer.strategy
    if isinstance(strategy, ModelParallelStrategy):
        return "fsdp2"
    if isinstance(strategy, DDPStrategy) and not isinstance(strategy, (DeepSpeedStrategy, XLAStrategy)):
        return "ddp"
    if isinstance(strategy, SingleDeviceStrategy):
        return "single"
    raise TypeError(f"GradwireCallback does not support {type(strategy).__name__}: gradwire serves {SUPPORTED}")


def _mesh_group(trainer: Trainer, dim: str) -> torch.distributed.ProcessGroup:
    mesh = trainer.strategy.device_mesh  # type: ignore[attr-defined]
    names = mesh.mesh_dim_names or ()
    if dim not in names:
        raise ValueError(f"GradwireCallback(replicate_dim={dim!r}): the strategy's device mesh has dimensions "
                         f"{list(names)}")
    return mesh[dim].get_group()
