"""gradwire on the Hugging Face Trainer: a `TrainerCallback` that installs the DDP hook and keeps its
state in the Trainer's checkpoints.

Why an adapter: the Trainer has no option for a DDP comm hook, and a callback's `model=` argument is
the unwrapped model, so the hook must go on `trainer.model_wrapped` once the Trainer has wrapped it
(at `on_train_begin`). The Trainer saves checkpoints from rank 0, but each rank's hook state
(error-feedback residuals, Adam moments) differs: the callback gathers every rank's state into the
checkpoint folder the Trainer has just written, and every rank takes its own entry back on resume.
With `precondition="adam"` it also moves the Trainer's gradient clipping into the hook, where it
clips the true gradient instead of Adam's direction::

    trainer = Trainer(model=model, args=args, train_dataset=data)
    gradwire.integrations.hf_trainer.register(trainer, "topk:ratio=0.01")
    trainer.train()                                   # or train(resume_from_checkpoint=...)

    # Adam-trained LMs: Adam before compression, the optimizer plain SGD without momentum
    args = TrainingArguments(..., optim="sgd", learning_rate=3e-4)   # max_grad_norm=1.0 is moved into the hook
    register(trainer, "topk:ratio=0.01", precondition="adam")

Checkpoints: `on_save` (every rank; a collective) writes `gradwire_state.pt` into
`<output_dir>/checkpoint-<step>` from the rank(s) the Trainer saves from. On resume `on_train_begin`
reads it from `<output_dir>/checkpoint-<global_step>` (the folder `resume_from_checkpoint=True` and a
path under `output_dir` name), or from `register(..., resume_from=folder)` for a checkpoint moved
elsewhere. The file records the model weights it was saved with, so a folder holding another run's
state is refused. A missing file raises FileNotFoundError (`missing_state="warn"`: log and start the
hook afresh, e.g. for checkpoints written before the adapter was added).

DDP only: FSDP and DeepSpeed through the Trainer raise ValueError in `register` (on CPU, Accelerate
ignores `fsdp=` and trains DDP: it enables FSDP only for accelerator devices).
"""

from __future__ import annotations

import logging
import os
from typing import Any

import torch
import torch.distributed as dist

from ..hooks import ddp as gw_ddp
from ..hooks.precondition import make_preconditioner, plain_sgd
from ..hooks.ranks import ranks_with

try:
    from transformers import Trainer, TrainerCallback, TrainerControl, TrainerState, TrainingArguments
except ImportError as e:  # pragma: no cover - depends on the environment
    raise ImportError('gradwire.integrations.hf_trainer needs transformers: pip install "gradwire[transformers]"') from e

log = logging.getLogger("gradwire")

STATE_FILE = "gradwire_state.pt"
FORMAT = "gradwire-hf-trainer"
MISSING_STATE = ("error", "warn")


def register(trainer: Trainer, compressor: str = gw_ddp.DEFAULT_COMPRESSOR, *, missing_state: str = "error",
             resume_from: str | None = None, **options: Any) -> GradwireCallback:
    """Add a `GradwireCallback` to `trainer` and return it (`.state`: the hook state, from train
    begin). `options` are the DDP hook's (`gradwire.hooks.ddp.register`); bad ones raise ValueError
    here."""
    callback = GradwireCallback(trainer, compressor, missing_state=missing_state, resume_from=resume_from, **options)
    trainer.add_callback(callback)
    return callback


class GradwireCallback(TrainerCallback):
    """Installs the gradwire DDP hook on `trainer.model_wrapped` at `on_train_begin` and keeps its
    every-rank state in the Trainer's checkpoints. `state` is the hook's `GradwireState` once
    training has begun (None before, and on one process, where there is nothing to compress)."""

    def __init__(self, trainer: Trainer, compressor: str = gw_ddp.DEFAULT_COMPRESSOR, *,
                 missing_state: str = "error", resume_from: str | None = None, **options: Any) -> None:
        if missing_state not in MISSING_STATE:
            raise ValueError(f"missing_state must be one of {MISSING_STATE}, got {missing_state!r}")
        _check_parallelism(trainer)
        self.trainer, self.missing_state, self.resume_from = trainer, missing_state, resume_from
        self.compressor, self.options = compressor, options
        self.active = trainer.args.world_size > 1
        self.state: gw_ddp.GradwireState | None = None  # built when the hook is installed
        self._ddp: torch.nn.Module | None = None
        if not self.active:
            if options.get("precondition"):
                raise ValueError("precondition= runs in the DDP hook, and a single-process Trainer has no DDP: the "
                                 "optimizer (optim='sgd') would get raw gradients. On one process train with "
                                 "optim='adamw_torch' and without gradwire")
            log.warning("gradwire: the Trainer runs a single process: there is no gradient exchange to compress, "
                        "and the hook is not installed")
            return
        if options.get("precondition"):
            options["precondition"] = _take_clipping(str(options["precondition"]), trainer.args)
        gw_ddp.DDPConfig(compressor, **options)  # bad specs and options raise here, not at train begin

    # ---- training --------------------------------------------------------------------
    def on_train_begin(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                       **kwargs: Any) -> None:
        """Install the hook on the DDP model (after loading the resumed checkpoint's hook state)."""
        if not self.active:
            return
        ddp = self.trainer.model_wrapped
        if not isinstance(ddp, torch.nn.parallel.DistributedDataParallel):
            raise TypeError(f"gradwire.integrations.hf_trainer installs a DDP hook, but the Trainer wrapped the "
                            f"model in {type(ddp).__name__}")
        if self.options.get("precondition"):
            _check_optimizer(self.trainer.optimizer)
            if (args.max_grad_norm or 0) > 0:
                raise ValueError(f"TrainingArguments.max_grad_norm was set back to {args.max_grad_norm} after "
                                 "register(): with precondition= the Trainer would clip Adam's direction; clip in "
                                 "the hook (precondition='adam:clip=C') and keep max_grad_norm=0")
        saved = self._saved(args, state) if state.global_step > 0 else None
        fresh = self.state is None  # (a second train() on the same Trainer keeps its state, DDP and hook)
        if fresh:
            self.state = gw_ddp.GradwireState(self.compressor, **self.options)
        assert self.state is not None
        try:
            if saved is not None:
                self.state.load_state_dict(saved)
            if ddp is not self._ddp:
                gw_ddp.register(ddp, state=self.state)
                self._ddp = ddp
        except Exception:
            if fresh:  # (a state that never got its hook would warn that it is never called)
                self.state = None
            raise

    # ---- checkpoints -----------------------------------------------------------------
    def on_save(self, args: TrainingArguments, state: TrainerState, control: TrainerControl,
                **kwargs: Any) -> None:
        """Every rank runs this after the Trainer wrote checkpoint-<step>: gather every rank's hook
        state on the rank(s) that saved it, write it there, and wait until it is written."""
        if self.state is None:
            return
        rank = dist.get_rank()
        folder = os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        for saver in _savers(args):
            every_rank = self.state.all_ranks_state_dict(dst=saver)
            if saver == rank:
                if not os.path.isfile(os.path.join(folder, "trainer_state.json")):
                    raise FileNotFoundError(f"gradwire: the Trainer's checkpoint is not at {folder} (hyperparameter "
                                            "search runs save elsewhere; this adapter does not support them)")
                _write(os.path.join(folder, STATE_FILE), {"format": FORMAT, "global_step": state.global_step,
                                                          "weights": _weights(self.trainer.model), "hook": every_rank})
        dist.barrier()  # the file exists on return, on every rank (a resume may read it at once)

    def _saved(self, args: TrainingArguments, state: TrainerState) -> dict[str, Any] | None:
        """The every-rank hook state saved with the checkpoint being resumed (None: missing, and
        `missing_state="warn"`)."""
        folder = self.resume_from or os.path.join(args.output_dir, f"checkpoint-{state.global_step}")
        path = os.path.join(folder, STATE_FILE)
        if not os.path.isfile(path):
            message = (f"gradwire: the Trainer resumes at step {state.global_step}, but {folder} holds no "
                       f"{STATE_FILE}: the hook's error-feedback residuals (and Adam moments) of that checkpoint "
                       "are lost")
            if self.missing_state == "error":
                raise FileNotFoundError(f"{message}. If the checkpoint was moved, pass register(..., resume_from="
                                        "<its folder>); to restart the hook's state, register(..., "
                                        "missing_state='warn')")
            log.warning("%s; the hook starts afresh (missing_state='warn')", message)
            return None
        saved = torch.load(path, weights_only=True)
        if saved.get("format") != FORMAT or saved["global_step"] != state.global_step:
            raise ValueError(f"gradwire: {path} was saved at step {saved.get('global_step')}, but the Trainer resumes "
                             f"at step {state.global_step}")
        if not _same_weights(saved["weights"], _weights(self.trainer.model)):
            raise ValueError(f"gradwire: {path} was saved with other model weights than the checkpoint the Trainer "
                             "resumed: it belongs to another run. Pass register(..., resume_from=<the folder given to "
                             "resume_from_checkpoint>)")
        return saved["hook"]


def _check_parallelism(trainer: Trainer) -> None:
    if trainer.args.fsdp or trainer.is_fsdp_enabled:
        raise ValueError("gradwire.integrations.hf_trainer supports DDP only, not FSDP: on CPU Accelerate ignores "
                         "fsdp= and trains DDP (it enables FSDP only for accelerator devices), and FSDP through the "
                         "Trainer is not supported yet. Drop fsdp= to train DDP with gradwire, or use "
                         "gradwire.hooks.fsdp.register on a fully_shard-ed model in your own loop")
    if trainer.is_deepspeed_enabled:
        raise ValueError("gradwire.integrations.hf_trainer supports DDP only, not DeepSpeed (which runs its own "
                         "gradient exchange)")


def _take_clipping(spec: str, args: TrainingArguments) -> str:
    """The precondition spec with Adam's betas and eps taken from `args` where the spec gives none,
    and the Trainer's clipping moved into it: `args.max_grad_norm` becomes the hook's `clip` (unless
    the spec has one) and is set to 0, so the Trainer no longer clips Adam's direction."""
    make_preconditioner(spec)  # a bad spec raises here
    name, _, rest = spec.partition(":")
    given = dict(item.partition("=")[::2] for item in rest.split(",") if item)
    defaults = {"beta1": args.adam_beta1, "beta2": args.adam_beta2, "eps": args.adam_epsilon}
    values = {**{k: repr(float(v)) for k, v in defaults.items()}, **given}
    clipped = args.max_grad_norm
    if clipped and clipped > 0:
        values.setdefault("clip", repr(float(clipped)))
    full = str(make_preconditioner(f"{name}:" + ",".join(f"{k}={v}" for k, v in values.items())))
    if clipped and clipped > 0:
        args.max_grad_norm = 0.0
        source = "your clip=" if "clip" in given else "max_grad_norm"
        log.warning("gradwire: precondition=%r hands the optimizer Adam's direction (norm about sqrt(#parameters)), "
                    "which the Trainer's clipping (max_grad_norm=%g) would shrink; gradwire set "
                    "TrainingArguments.max_grad_norm=0 and the hook clips each rank's true gradient to %g (from %s) "
                    "before Adam's moments: precondition=%r", spec, clipped, float(values["clip"]), source, full)
    return full


def _check_optimizer(optimizer: torch.optim.Optimizer | None) -> None:
    """precondition= sends Adam's direction: the optimizer must apply it as it is (SGD, no momentum)."""
    inner = getattr(optimizer, "optimizer", optimizer)  # (Accelerate wraps it)
    if inner is None or not plain_sgd(inner):
        raise ValueError(f"precondition='adam' applies Adam in the hook, so the optimizer must be plain SGD without "
                         f"momentum (TrainingArguments(optim='sgd')), got {type(inner).__name__}")


def _savers(args: TrainingArguments) -> list[int]:
    """The ranks the Trainer writes checkpoints from (rank 0, or each node's first with save_on_each_node)."""
    return ranks_with(bool(args.should_save)) if args.save_on_each_node else [0]


def _weights(model: torch.nn.Module) -> torch.Tensor:
    """A fingerprint of the trainable weights: per parameter, its sum and sum of squares in float64."""
    sums = [torch.stack([p.detach().double().sum(), p.detach().double().square().sum()])
            for p in model.parameters() if p.requires_grad]
    return torch.stack(sums).cpu() if sums else torch.zeros(0, 2, dtype=torch.float64)


def _same_weights(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.shape == b.shape and torch.allclose(a, b, rtol=1e-9, atol=1e-12)


def _write(path: str, obj: dict[str, Any]) -> None:
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)
