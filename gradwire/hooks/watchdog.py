"""Warnings for the two silent failures a hook cannot see from inside: never being called, and the
optimizer receiving something other than what the hook sent.

Both listen to every optimizer's steps through torch's global optimizer step hooks
(`torch.optim.optimizer.register_optimizer_step_{pre,post}_hook`), so they work whoever drives
training (a plain loop, Lightning, Accelerate, the Trainer) without touching the framework. One pair
of global hooks serves every watch (torch iterates its hooks while calling them, so a watch cannot
remove its own); watches hold the hook state weakly and retire once they have warned, or once the
state is gone. Parameters are held strongly, never weakly: a weak reference on a parameter makes
`torch.utils.swap_tensors` (FSDP2, `module.to_empty`) refuse it.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from typing import Any, Callable

import torch
from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

from .precondition import plain_sgd

log = logging.getLogger("gradwire")
_WATCHES: "weakref.WeakSet[NeverCalled | DirectionWatch]" = weakref.WeakSet()
_installed = False


def _watch(w: "NeverCalled | DirectionWatch") -> None:
    global _installed
    if not _installed:
        register_optimizer_step_pre_hook(lambda opt, args, kwargs: _each("before_step", opt))
        register_optimizer_step_post_hook(lambda opt, args, kwargs: _each("after_step", opt))
        _installed = True
    _WATCHES.add(w)


def _each(event: str, optimizer: torch.optim.Optimizer) -> None:
    for w in list(_WATCHES):
        if getattr(w, event)(optimizer):
            _WATCHES.discard(w)

#: optimizer steps without a single hook call after which a registered hook warns
SILENT_STEPS = 3


def _distributed() -> bool:
    return torch.distributed.is_available() and torch.distributed.is_initialized() \
        and torch.distributed.get_world_size() > 1


def _holds(optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
    return any(p is param for g in optimizer.param_groups for p in g["params"])


class NeverCalled:
    """Warn once when `ran(state)` is still False after `SILENT_STEPS` optimizer steps taken since
    the state was created: a hook that was registered (or handed to a framework) but never runs.
    Once the hook knows its model (`scope`), only steps of optimizers that hold the model's
    parameters count, so a state left over from a failed run does not blame the next one."""

    def __init__(self, state: Any, ran: Callable[[Any], bool], what: str, causes: str) -> None:
        self._state = weakref.ref(state)
        self._ran, self._what, self._causes = ran, what, causes
        self.steps = 0
        self._param: torch.Tensor | None = None
        self._counts: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        _watch(self)

    def scope(self, param: torch.Tensor) -> None:
        """Count only the steps of optimizers that hold `param` (one of the hooked model's)."""
        self._param = param
        self._counts = weakref.WeakKeyDictionary()

    def _counted(self, optimizer: torch.optim.Optimizer) -> bool:
        if self._param is None:
            return True
        if optimizer not in self._counts:
            self._counts[optimizer] = _holds(optimizer, self._param)
        return self._counts[optimizer]

    def before_step(self, optimizer: torch.optim.Optimizer) -> bool:
        return False

    def after_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Count one optimizer step; True once this watch is done."""
        state = self._state()
        if state is None or self._ran(state):
            return True
        if not self._counted(optimizer) or not _distributed():
            return False  # (one process: no exchange to skip; the adapters say so themselves)
        self.steps += 1
        if self.steps < SILENT_STEPS:
            return False
        warnings.warn(f"{self._what} has not been called in the {self.steps} optimizer steps since it was "
                          f"created: gradients are exchanged without it (uncompressed, or not at all). "
                      f"Likely causes: {self._causes}", RuntimeWarning, stacklevel=2)
        return True


class DirectionWatch:
    """With `precondition="adam"` the optimizer must apply the averaged Adam direction the hook sent.
    Checks one parameter per step: if its gradient was rescaled between the exchange and the
    optimizer's step (gradient clipping, AMP's unscaling), warn once with what to change."""

    def __init__(self, state: Any) -> None:
        self._state = weakref.ref(state)
        self.param: torch.Tensor | None = None
        self.sent_norm: float | None = None
        self._optimizers: weakref.WeakKeyDictionary[torch.optim.Optimizer, bool] = weakref.WeakKeyDictionary()
        _watch(self)

    def expect(self, param: torch.Tensor, sent: torch.Tensor) -> None:
        """The hook sent `sent` as `param`'s averaged direction this step."""
        self.param, self.sent_norm = param, float(torch.linalg.vector_norm(sent))

    def _holds(self, optimizer: torch.optim.Optimizer, param: torch.Tensor) -> bool:
        if optimizer not in self._optimizers:
            self._optimizers[optimizer] = _holds(optimizer, param)
            if self._optimizers[optimizer] and not plain_sgd(optimizer):
                self._wrong_optimizer(optimizer, self._kind())
        return self._optimizers[optimizer]

    def _kind(self) -> str:
        """The preconditioner's name as the user spelled it ("adam" or "global_adam")."""
        state = self._state()
        return state.config.precondition.partition(":")[0] if state is not None else "adam"

    @staticmethod
    def _wrong_optimizer(optimizer: torch.optim.Optimizer, kind: str) -> None:
        """Once per optimizer: Adam applied twice, or momentum on top of Adam's direction."""
        name = type(optimizer).__name__
        warnings.warn(
            f"gradwire: precondition='{kind}' applies Adam in the hook, and the optimizer is {name}"
            + (" with momentum" if name == "SGD" else "") + ", so the step is not Adam's. Use plain SGD over the "
            "same parameter groups: opt = gradwire.hooks.precondition.sgd_like(opt) (same lr and weight decay: "
            "SGD's decay on Adam's direction is AdamW's decoupled decay; build LR schedulers on it), and give the "
            "hook Adam's betas: precondition=gradwire.hooks.precondition.adam_spec(old_opt, clip=1.0"
            + (", shared=True)" if kind == "global_adam" else ")"),
            RuntimeWarning, stacklevel=3)

    def after_step(self, optimizer: torch.optim.Optimizer) -> bool:
        return False

    def before_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Compare the watched gradient with what the hook sent; True once this watch is done."""
        if self._state() is None:
            return True
        param = self.param
        if param is None or param.grad is None or not self.sent_norm or not self._holds(optimizer, param):
            return False
        ratio = float(torch.linalg.vector_norm(param.grad)) / self.sent_norm
        self.sent_norm = None  # once per exchange
        if abs(ratio - 1.0) <= 1e-3:
            return False
        warnings.warn(
            f"gradwire: precondition='{self._kind()}' hands the optimizer Adam's averaged direction, and something "
            f"scaled it by {ratio:.3g} before the optimizer step (gradient clipping, or AMP's unscale). "
            "Clipping Adam's direction (norm about sqrt(#parameters)) shrinks every step. Clip the true "
            f"gradient in the hook instead, precondition='{self._kind()}:clip=1.0', and turn the framework's clipping "
            "off (your loop: drop clip_grad_norm_; Hugging Face Trainer: max_grad_norm=0, or use "
            "gradwire.integrations.hf_trainer, which moves it; Lightning: gradient_clip_val=None)",
            RuntimeWarning, stacklevel=2)
        return True


class ResumedWithoutState:
    """At the first optimizer step of the hooked model: if the optimizer already has state (its
    own checkpoint was loaded) while the hook's was not, warn once that the hook restarts from zero
    (residuals, warm-up position, `precondition`'s moments) and how to keep it."""

    def __init__(self, state: Any, loaded: Callable[[Any], bool], what: str) -> None:
        self._state = weakref.ref(state)
        self._loaded, self._what = loaded, what
        self._param: torch.Tensor | None = None
        _watch(self)

    def scope(self, param: torch.Tensor) -> None:
        self._param = param

    def after_step(self, optimizer: torch.optim.Optimizer) -> bool:
        return False

    def before_step(self, optimizer: torch.optim.Optimizer) -> bool:
        """True (done) at the first step of an optimizer holding the watched parameter."""
        state, param = self._state(), self._param
        if state is None:
            return True
        if param is None or not _holds(optimizer, param):
            return False
        saved = optimizer.state.get(param)
        if saved and not self._loaded(state):
            step = saved.get("step")
            at = f" (at step {int(step)})" if step is not None else ""
            warnings.warn(f"{self._what}: the optimizer resumes from a checkpoint{at}, but the hook's own state was "
                          "not loaded, so it restarts from zero: error-feedback residuals, the warm-up and dense "
                          "first steps, precondition's Adam moments. Keep it with your checkpoint: "
                          "ckpt['gradwire'] = state.state_dict() when saving (each rank, or "
                          "state.all_ranks_state_dict() for one file), state.load_state_dict(ckpt['gradwire']) "
                          "after registering on resume", RuntimeWarning, stacklevel=2)
        return True
