"""DiLoCo: replicas train alone for H inner steps, then exchange their pseudo-gradients.

Between datacenters a per-step exchange pays the round trip every step; DiLoCo (Douillard et al.
2023) pays it every H steps. Each replica keeps the weights of the last sync (the "global"
weights); at a sync its pseudo-gradient is global - local, the replicas average it through any
gradwire compressor and strategy (a `GradientExchanger`, so error feedback, int8, top-k, ...),
and an outer optimizer (Nesterov SGD, lr 0.7, momentum 0.9 by default, as DiLoCo) steps the global
weights with the mean, which then replace the local ones.

Streaming (Streaming DiLoCo, arXiv 2501.18512): with `fragments=F` the parameters are cut into F
fragments (in order, about equal in size) that sync in turn, fragment f every H steps at offset
f*H/F, so each sync moves 1/F of the model; with `delay=tau` a fragment's exchange is issued at
its sync step and applied tau inner steps later, the replicas training on meanwhile, and the
fragment's local weights become
(1 - alpha) * new global + alpha * local (`mix=alpha`; 0: take the global weights). With
`carry=True` the tau local steps taken while the exchange was in flight are kept instead: the
fragment becomes new global + (local now - local at launch), so a delayed sync costs no local
progress (with outer lr 1 and no momentum: each replica moves by the mean of the replicas' launch
weights minus its own). Which of the two trains better depends on the run; docs/benchmarks.md
measures both.

A delayed exchange is encoded, exchanged and decoded on a thread of its own, so the training
thread only takes the pseudo-gradient at a sync and the outer step when it lands. That thread
issues its collectives over a private copy of the replicas' group (`Backend.split`): the training
thread's own collectives on `backend` cannot meet them in another order on another rank. Backends
that cannot be called from two threads at once (`Backend.issue_from_any_thread` false: Horovod,
MPI below MPI_THREAD_MULTIPLE) exchange on the training thread instead.

A replica is one process here, or one rank of a group that trains with DDP or FSDP2 inside:
give `backend` over the ranks that hold the same part of the model in every replica (for DDP
inside a node: the ranks with the same local rank), as HSDP's replicate group.

Every rank must pass the same model layout and the same H, F, tau, outer settings and exchange
config: the constructor checks (before any exchange is built) and raises ConfigMismatchError on
every rank otherwise.

`compressor="sparseloco"` is SparseLoCo's recipe (recipes.py): chunked top-k, 2-bit values,
error feedback that decays by `feedback_decay` at every sync in place of outer momentum.

Tests: tests/outer/test_diloco.py (real gloo ranks).
"""

from __future__ import annotations

import ast
import dataclasses
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from ..comm.api import GradientExchanger
from ..comm.backend import Backend, Work
from ..comm.framing import check_same_config
from ..comm.torch_dist import TorchDistBackend
from .recipes import recipe


@dataclass(frozen=True)
class OuterConfig:
    """How often replicas sync and how the outer step is taken."""

    sync_every: int = 100
    fragments: int = 1
    delay: int = 0
    mix: float = 0.0
    outer_lr: float = 0.7
    momentum: float = 0.9
    nesterov: bool = True
    feedback_decay: float = 1.0  # error feedback's residual is scaled by this before each sync (SparseLoCo)
    carry: bool = False  # keep the local steps taken while a delayed exchange was in flight (last: positional order)

    def __post_init__(self) -> None:
        if self.sync_every < 1 or self.fragments < 1:
            raise ValueError(f"sync_every and fragments must be >= 1, got {self.sync_every}, {self.fragments}")
        if self.fragments > self.sync_every:
            raise ValueError(f"{self.fragments} fragments cannot take turns within sync_every={self.sync_every} steps")
        if not 0 <= self.delay < self.sync_every // self.fragments or self.delay < 0:
            raise ValueError(f"delay must be >= 0 and below sync_every / fragments "
                             f"({self.sync_every // self.fragments}): a fragment's exchange must land before its "
                             f"next one, got {self.delay}")
        if not 0.0 <= self.mix < 1.0:
            raise ValueError(f"mix must be in [0, 1), got {self.mix}")
        if self.carry and not self.delay:
            raise ValueError("carry keeps the local steps taken while an exchange is in flight; with delay=0 "
                             "there are none: give delay >= 1")
        if self.carry and self.mix:
            raise ValueError(f"carry and mix={self.mix} are two ways to keep local progress: give one")
        if not 0.0 <= self.feedback_decay <= 1.0:
            raise ValueError(f"feedback_decay must be in [0, 1], got {self.feedback_decay}")

    def offset(self, fragment: int) -> int:
        """The inner step (mod sync_every) at which `fragment` syncs: staggered evenly, the last
        fragment at sync_every, as DiLoCo's single sync."""
        return (self.sync_every * (fragment + 1)) // self.fragments % self.sync_every


_SETTING_TYPES = {"outer_lr": float, "momentum": float, "nesterov": bool, "feedback_decay": float}


class DiLoCo:
    """Wraps a replica's model for DiLoCo; call `step()` after every inner optimizer step.

        >>> outer = DiLoCo(model, sync_every=100, compressor="int8")
        >>> for x, y in data:
        ...     loss_fn(model(x), y).backward(); inner_opt.step(); inner_opt.zero_grad()
        ...     outer.step()

    compressor / strategy / error_feedback / exchange options: as `GradientExchanger` (default:
    ``"none"`` over ``"allreduce"``, the uncompressed mean). backend: the replicas' group (default:
    the default torch.distributed group). `stats` holds the bytes each sync sent.
    """

    def __init__(self, model: torch.nn.Module, sync_every: int = 100, compressor: Any = "none",
                 strategy: str | None = None, *, backend: Backend | None = None, fragments: int = 1,
                 delay: int = 0, mix: float = 0.0, carry: bool = False, outer_lr: float | None = None,
                 momentum: float | None = None,
                 nesterov: bool | None = None, feedback_decay: float | None = None,
                 error_feedback: bool | str = "auto", **exchange_options: Any) -> None:
        named_recipe = recipe(compressor)
        given = {"outer_lr": outer_lr, "momentum": momentum, "nesterov": nesterov, "feedback_decay": feedback_decay}
        settings = {**(named_recipe.settings if named_recipe else {}), **{k: v for k, v in given.items() if v is not None}}
        if named_recipe is not None:
            compressor = named_recipe.compressor
            exchange_options = {**named_recipe.exchange, **exchange_options}
        self.config = OuterConfig(int(sync_every), int(fragments), int(delay), float(mix), carry=bool(carry),
                                  **{k: _SETTING_TYPES[k](v) for k, v in settings.items()})
        self.model = model
        self.backend = backend if backend is not None else TorchDistBackend()
        named = [(n, p) for n, p in getattr(model, "module", model).named_parameters() if p.requires_grad]
        if not named:
            raise ValueError("the model has no trainable parameters")
        self.names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self.fragment_of = split_fragments([p.numel() for p in self.params], self.config.fragments)
        strategy = strategy or ("allreduce" if str(compressor) in ("none", "fp16", "bf16") else "allgather")
        exchange = f"compressor={compressor} strategy={strategy} error_feedback={error_feedback} {exchange_options}"
        # a delayed exchange runs on its own thread, over its own copy of the group (module docstring);
        # checked with the rest, so no rank splits the group (a collective) while another does not
        background = self.config.delay > 0 and self.backend.issue_from_any_thread
        # (first: the exchangers below each run their own check, as many as there are fragments)
        check_same_config(self.backend, f"{self.describe_outer()} {exchange} exchange_thread={background}",
                          "DiLoCo configs")
        with torch.no_grad():
            self.globals = [torch.nn.Parameter(_local(p).detach().clone()) for p in self.params]
        self.outer_opts = [torch.optim.SGD([g for g, f in zip(self.globals, self.fragment_of) if f == k],
                                           lr=self.config.outer_lr, momentum=self.config.momentum,
                                           nesterov=self.config.nesterov and self.config.momentum > 0)
                           for k in range(self.config.fragments)]
        exchange_backend = self.backend.split(0, self.backend.rank) if background else self.backend
        self._thread = ThreadPoolExecutor(1, thread_name_prefix="gradwire-diloco") if background else None
        self.exchangers = [GradientExchanger(compressor, exchange_backend, strategy=strategy,
                                             error_feedback=error_feedback, **exchange_options)
                           for _ in range(self.config.fragments)]
        if self.config.feedback_decay != 1.0 and self.exchangers[0].strategy.feedback is None:
            raise ValueError(f"feedback_decay={self.config.feedback_decay} decays error feedback, which is off for "
                             f"{compressor} over {strategy} (error_feedback={error_feedback!r})")
        self.inner_step = 0
        self.syncs = 0
        self._pending: dict[int, tuple[int, Work[dict[str, Any]]]] = {}  # fragment -> (apply at, exchange)
        self._launched: dict[int, tuple[int, float]] = {}  # fragment -> (launch step, seconds the launch took)
        self._at_launch: dict[int, list[torch.Tensor]] = {}  # fragment -> its local weights at launch (carry)
        self.stats: list[dict[str, Any]] = []  # one record per sync: fragment, step, bytes sent

    def describe_outer(self) -> str:
        """The outer settings and the model's layout (what every replica must share)."""
        layout = ",".join(f"{n}:{tuple(p.shape)}:{f}" for n, p, f in zip(self.names, self.params, self.fragment_of))
        return f"diloco {self.config} layout={layout}"

    def describe(self) -> str:
        return f"{self.describe_outer()} exchange=({self.exchangers[0].describe()})"

    # ---- the loop ------------------------------------------------------------------
    def step(self) -> None:
        """Count one inner step; sync the fragments due now, and apply exchanges due now."""
        self.inner_step += 1
        for k, (due, work) in list(self._pending.items()):
            if due <= self.inner_step:
                self._apply(k, work)
        for k in range(self.config.fragments):
            if self.inner_step % self.config.sync_every == self.config.offset(k):
                self._launch(k)
                if self.config.delay == 0:
                    self._apply(k, self._pending[k][1])

    def _launch(self, k: int) -> None:
        started = time.perf_counter()
        feedback = self.exchangers[k].strategy.feedback
        if feedback is not None and self.config.feedback_decay != 1.0:
            feedback.decay(self.config.feedback_decay)  # e = decay * e, then + this pseudo-gradient
        members = [i for i, f in enumerate(self.fragment_of) if f == k]
        with torch.no_grad():
            for i in members:  # the pseudo-gradient: where the replica went since the last sync, reversed
                self.globals[i].grad = self.globals[i].detach() - _local(self.params[i]).detach()
            if self.config.carry:
                self._at_launch[k] = [_local(self.params[i]).detach().clone() for i in members]
        named = [(self.names[i], self.globals[i]) for i in members]
        if self._thread is not None:  # one thread: exchanges issue in launch order on every rank
            work: Work[dict[str, Any]] = Work(wait=self._thread.submit(_exchange, self.exchangers[k], named).result)
        else:
            work = self.exchangers[k].exchange_async_(named)
        self._pending[k] = (self.inner_step + self.config.delay, work)
        self._launched[k] = (self.inner_step, time.perf_counter() - started)

    def _apply(self, k: int, work: Work[dict[str, Any]]) -> None:
        started = time.perf_counter()
        stats = work.wait()  # the mean pseudo-gradient is now in the fragment's global .grad
        waited = time.perf_counter() - started
        del self._pending[k]
        launched, launch_s = self._launched.pop(k)
        self.outer_opts[k].step()
        alpha = self.config.mix
        at_launch = iter(self._at_launch.pop(k, []))
        with torch.no_grad():
            for i, f in enumerate(self.fragment_of):
                if f != k:
                    continue
                self.globals[i].grad = None
                local = _local(self.params[i])
                if self.config.carry:  # new global + the steps taken since the launch
                    local.sub_(next(at_launch)).add_(self.globals[i].detach())
                elif alpha:
                    local.mul_(alpha).add_(self.globals[i].detach(), alpha=1 - alpha)
                else:
                    local.copy_(self.globals[i].detach())
        self.syncs += 1
        # launch_s + wait_s: the communication the inner steps did not hide (encoding included)
        self.stats.append({"fragment": k, "launched": launched, "step": self.inner_step,
                           "bytes_sent": stats["bytes_sent"], "dense_bytes": stats["dense_bytes"],
                           "launch_s": launch_s, "wait_s": waited})

    def peak_bytes_in_flight(self) -> int:
        """The most bytes this replica had in exchanges at once: a sync is in flight from the
        step it launched through the step it applied (streamed fragments may overlap)."""
        return max((sum(o["bytes_sent"] for o in self.stats if o["launched"] <= s["launched"] <= o["step"])
                    for s in self.stats), default=0)

    def finish(self) -> None:
        """Apply every exchange still in flight (before evaluating or saving)."""
        for k, (_, work) in list(self._pending.items()):
            self._apply(k, work)

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Inner step, global weights, outer optimizers and the exchangers' error feedback; no
        exchange may be in flight (call `finish()` or save right after a sync has applied)."""
        if self._pending:
            raise RuntimeError(f"fragments {sorted(self._pending)} are still being exchanged: call finish() first, "
                               "or save at a step where no exchange is in flight")
        return {"version": 1, "config": repr(self.config), "inner_step": self.inner_step, "syncs": self.syncs,
                "globals": [g.detach().clone() for g in self.globals],
                "outer": [o.state_dict() for o in self.outer_opts],
                "exchangers": [e.state_dict() for e in self.exchangers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown DiLoCo state version {state.get('version')!r}")
        if saved_config(state["config"]) != self.config:
            raise ValueError(f"the saved DiLoCo ran with {state['config']}, this one with {self.config!r}")
        if len(state["globals"]) != len(self.globals):
            raise ValueError(f"the saved DiLoCo has {len(state['globals'])} parameters, this model {len(self.globals)}")
        with torch.no_grad():
            for g, saved in zip(self.globals, state["globals"]):
                if g.shape != saved.shape:
                    raise ValueError(f"saved global weights of shape {tuple(saved.shape)} do not fit {tuple(g.shape)}")
                g.copy_(saved)
        for o, s in zip(self.outer_opts, state["outer"]):
            o.load_state_dict(s)
        for e, s in zip(self.exchangers, state["exchangers"]):
            e.load_state_dict(s)
        self.inner_step, self.syncs = int(state["inner_step"]), int(state["syncs"])


def saved_config(text: str) -> OuterConfig:
    """The OuterConfig a checkpoint saved as its repr; a field added since then takes its default
    (what the saving version did), so older checkpoints load; a field this version does not know
    is refused."""
    try:
        call = ast.parse(text, mode="eval").body
        if not (isinstance(call, ast.Call) and isinstance(call.func, ast.Name) and call.func.id == "OuterConfig"
                and not call.args):
            raise ValueError("not an OuterConfig(...)")
        fields = {kw.arg: ast.literal_eval(kw.value) for kw in call.keywords}
    except (SyntaxError, ValueError) as e:
        raise ValueError(f"the saved DiLoCo config {text!r} cannot be read: {e}") from e
    known = {f.name for f in dataclasses.fields(OuterConfig)}
    if set(fields) - known:
        raise ValueError(f"the saved DiLoCo config has settings this gradwire does not know: "
                         f"{sorted(set(fields) - known)} (saved by a newer version?)")
    try:
        return OuterConfig(**fields)
    except TypeError as e:  # a value of the wrong type (ValueError: out of range, said as such)
        raise ValueError(f"the saved DiLoCo config {text!r} cannot be read: {e}") from e


def _exchange(exchanger: GradientExchanger, named: list[tuple[str, torch.Tensor]]) -> dict[str, Any]:
    """Encode, exchange and decode one fragment's pseudo-gradient (on DiLoCo's exchange thread)."""
    return exchanger.exchange_async_(named).wait()


def split_fragments(numels: list[int], fragments: int) -> list[int]:
    """Fragment index of each tensor: consecutive tensors, cut near each 1/fragments of the total
    size, every fragment non-empty (ValueError when there are fewer tensors than fragments)."""
    n = len(numels)
    if fragments > n:
        raise ValueError(f"{fragments} fragments need at least as many parameter tensors, the model has {n}")
    total, before, out = max(sum(numels), 1), 0, []
    for i, size in enumerate(numels):
        by_size = min(before * fragments // total, fragments - 1)
        low = max(out[-1] if out else 0, fragments - (n - i))  # enough tensors left for the rest
        high = min(out[-1] + 1 if out else 0, fragments - 1)  # no fragment skipped
        out.append(min(max(by_size, low), high))
        before += size
    return out


def _local(p: torch.Tensor) -> torch.Tensor:
    """A parameter's local values (an FSDP2 shard's own part of a DTensor)."""
    return p.to_local() if hasattr(p, "to_local") else p
