"""Hugging Face Accelerate: gradwire's DDP hook on the model `accelerator.prepare` returned, and its
state in `accelerator.save_state` / `load_state`.

    accelerator = Accelerator(gradient_accumulation_steps=2)
    model, optimizer, loader = accelerator.prepare(model, optimizer, loader)
    state = gradwire.integrations.accelerate.register(accelerator, model, "topk:ratio=0.01")
    for batch in loader:
        with accelerator.accumulate(model):        # the hook runs on sync steps only
            accelerator.backward(loss_fn(model, batch))
            optimizer.step()
            optimizer.zero_grad()
    accelerator.save_state("ckpt")                 # every rank's gradwire state, in one file
    accelerator.load_state("ckpt")                 # (after register, in a resumed process) each rank its own

Why a helper: `DistributedDataParallelKwargs(comm_hook=...)` takes only Accelerate's own
`DDPCommunicationHookType` values and silently ignores anything else (a subclass of the kwargs
raises KeyError), so the hook is registered on the DDP model after `prepare`. And Accelerate writes
registered objects from the main process only, while error-feedback residuals differ per rank:
the object `register` hands `accelerator.register_for_checkpointing` gathers every rank's state
into that file (Accelerate calls its `state_dict()` on every process, so the gather is a
collective: call `save_state` on every process, as Accelerate asks), and on load each rank keeps
its own entry. With `ProjectConfiguration(save_on_each_node=True)` each node's first process gets
the gathered states. The gathered file holds world size x one rank's state (residuals are the
size of the model's gradients): for large models on many ranks, `checkpoint="per_rank"` has each
rank write its own file into the folder instead, through Accelerate's save/load pre-hooks.

One process (`python train.py`): nothing to exchange, so nothing is registered; `register` warns
and returns an unregistered state (its config checked), so one script runs with and without
`accelerate launch`. FSDP (the plugin needs accelerator devices: on CPU Accelerate ignores it and
wraps the model in DDP, which this supports), DeepSpeed, Megatron-LM and XLA raise
NotImplementedError.
"""

from __future__ import annotations

import os
import warnings
from typing import Any, Literal

import torch
from torch.nn.parallel import DistributedDataParallel

try:
    from accelerate import Accelerator
    from accelerate.utils import DDPCommunicationHookType, DistributedType
except ImportError as exc:  # an optional extra
    raise ImportError('gradwire.integrations.accelerate needs Hugging Face Accelerate: '
                      'pip install "gradwire[accelerate]"') from exc

from ..compress import Compressor
from ..hooks import ddp as ddp_hooks
from ..hooks.ddp import DEFAULT_COMPRESSOR, GradwireState
from ..hooks.ranks import ranks_with

__all__ = ["AllRanksCheckpoint", "PerRankFiles", "register"]


class AllRanksCheckpoint:
    """The object `register` hands `accelerator.register_for_checkpointing`: `state_dict()` is
    every rank's hook state gathered on the process(es) Accelerate writes from (a collective:
    Accelerate's `save_state` calls it on every process); `load_state_dict` keeps this rank's."""

    def __init__(self, state: GradwireState, accelerator: Accelerator) -> None:
        self.state = state
        self.accelerator = accelerator

    def _writers(self) -> list[int]:
        """Global ranks whose copy Accelerate writes: the main process, or each node's first."""
        if not self.accelerator.project_configuration.save_on_each_node:
            return [0]
        return ranks_with(self.accelerator.is_local_main_process)

    def state_dict(self) -> dict[str, Any]:
        rank = self.accelerator.process_index
        kept: dict[str, Any] | None = None
        for dst in self._writers():  # every rank runs the same gathers in the same order
            gathered = self.state.all_ranks_state_dict(dst=dst)
            if dst == rank or kept is None:
                kept = gathered
        assert kept is not None
        return kept

    def load_state_dict(self, saved: dict[str, Any]) -> None:
        self.state.load_state_dict(saved)


class PerRankFiles:
    """`checkpoint="per_rank"`: each rank writes its own state to `gradwire_rank<r>.pt` in the
    `save_state` folder and reads it back in `load_state`, through Accelerate's save/load pre-hooks
    (called on every process): no gather, nothing held on one rank. Every rank must see its file
    when resuming (a shared filesystem, or the same ranks on the same nodes)."""

    def __init__(self, state: GradwireState, accelerator: Accelerator) -> None:
        self.state = state
        self.accelerator = accelerator
        self.handles = (accelerator.register_save_state_pre_hook(self._save),
                        accelerator.register_load_state_pre_hook(self._load))

    def path(self, folder: str) -> str:
        return os.path.join(folder, f"gradwire_rank{self.accelerator.process_index}.pt")

    def _save(self, models: list[torch.nn.Module], weights: list[dict[str, Any]], folder: str) -> None:
        torch.save(self.state.state_dict(), self.path(folder))

    def _load(self, models: list[torch.nn.Module], folder: str) -> None:
        path = self.path(folder)
        if not os.path.exists(path):
            raise FileNotFoundError(f"{path}: no gradwire state for rank {self.accelerator.process_index} in this "
                                    "checkpoint (saved without checkpoint='per_rank', or by fewer ranks)")
        self.state.load_state_dict(torch.load(path, weights_only=True))


def _check_ddp_kwargs(accelerator: Accelerator) -> None:
    """A comm hook in `DistributedDataParallelKwargs`: Accelerate ignored it (not one of its own)
    or registered it (then DDP would refuse a second)."""
    handler = accelerator.ddp_handler
    if handler is None:
        return
    try:
        kind = DDPCommunicationHookType(handler.comm_hook)
    except (ValueError, TypeError):
        warnings.warn(f"DistributedDataParallelKwargs(comm_hook={handler.comm_hook!r}) was ignored by Accelerate, "
                      "which takes only its DDPCommunicationHookType values; gradwire's hook is registered by "
                      "gradwire.integrations.accelerate.register: drop comm_hook= from the kwargs", stacklevel=3)
        return
    if kind != DDPCommunicationHookType.NO:
        raise ValueError(f"Accelerate has registered its {kind.value!r} comm hook on the model "
                         f"(DistributedDataParallelKwargs(comm_hook={kind})) and DDP takes one hook: drop comm_hook= "
                         "to use gradwire's")


def register(accelerator: Accelerator, model: torch.nn.Module, compressor: Compressor | str = DEFAULT_COMPRESSOR, *,
             checkpoint: Literal["all_ranks", "per_rank"] | None = "all_ranks", **options: Any) -> GradwireState:
    """Register gradwire's DDP hook on `model` (what `accelerator.prepare` returned) and join its
    state to `save_state`/`load_state` (register before `load_state` when resuming): "all_ranks"
    gathers every rank's into Accelerate's file of registered objects (`AllRanksCheckpoint`),
    "per_rank" writes one file per rank (`PerRankFiles`), None leaves it out. `options` are
    `gradwire.hooks.ddp.register`'s. Returns the hook's state."""
    if checkpoint not in ("all_ranks", "per_rank", None):
        raise ValueError(f"checkpoint must be 'all_ranks', 'per_rank' or None, got {checkpoint!r}")
    if accelerator.num_processes == 1:
        warnings.warn("gradwire: one process, so no gradients are exchanged and nothing is compressed; the hook is "
                      "not registered (launch N processes to use it: `accelerate launch --num_processes N`, "
                      "or torchrun on CPU)", stacklevel=2)
        given = options.pop("state", None)
        return given if given is not None else GradwireState(compressor, **options)
    kind = accelerator.distributed_type
    if kind == DistributedType.FSDP:
        raise NotImplementedError("gradwire.integrations.accelerate supports DDP only: Accelerate's FSDP plugin is not "
                                  "supported yet (on CPU Accelerate ignores the plugin and wraps in DDP). For FSDP2, "
                                  "gradwire.hooks.fsdp.register(model, ...) installs gradwire on a fully_shard model")
    if not isinstance(model, DistributedDataParallel):
        if kind in (DistributedType.DEEPSPEED, DistributedType.MEGATRON_LM, DistributedType.XLA):
            raise NotImplementedError(f"gradwire.integrations.accelerate supports DDP only, not {kind.value}, "
                                      "which exchanges gradients its own way")
        raise TypeError(f"register takes the model accelerator.prepare returned (DistributedDataParallel with "
                        f"{accelerator.num_processes} processes), got a {type(model).__name__}")
    _check_ddp_kwargs(accelerator)
    state = ddp_hooks.register(model, compressor, **options)
    if checkpoint == "all_ranks":
        accelerator.register_for_checkpointing(AllRanksCheckpoint(state, accelerator))
    elif checkpoint == "per_rank":
        PerRankFiles(state, accelerator)
    return state
