"""Horovod integration: gradwire compressors inside Horovod's PyTorch training loop.

Two objects:

- `Compression(spec)`: Horovod's compressor interface (`compress(tensor) -> (tensor, ctx)`,
  `decompress(tensor, ctx)`) for gradwire compressors whose payloads Horovod can allreduce
  (summable: `none`, `fp16`, `bf16`, `randomk`, and chains of those)::

      opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     compression=gradwire.hooks.horovod.Compression.fp16)

- `DistributedOptimizer(optimizer, named_parameters, compression="topk:ratio=0.01", ...)`:
  a drop-in for `hvd.DistributedOptimizer` taking any gradwire compressor, with error
  feedback. Each parameter's gradient is exchanged by one of gradwire's shared strategies
  over a `HorovodBackend` (gradwire/comm/horovod.py): by default summable payloads Horovod
  can sum go through the `allreduce` strategy, all others through `allgather` (packets
  decoded and summed in rank order on every rank, so all ranks hold bit-identical gradients);
  ``strategy=`` picks any other registered strategy.

Exchanges start from gradient hooks as soon as a parameter's gradient is accumulated and
finish in `step()` / `synchronize()`, as in Horovod's own optimizer. `state_dict()` of the
returned optimizer carries a ``"gradwire"`` entry (compressor, step counter, error-feedback
residuals keyed by parameter name), so a checkpoint resumes bit-identically.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Any, ClassVar, Iterable

import torch

from ..comm.backend import Work
from ..comm.config import check_rank
from ..comm.horovod import HorovodBackend, horovod_sums, hvd, need_horovod
from ..comm.registry import STRATEGIES, make_strategy, traits
from ..comm.base import ExchangeStats, Strategy, StrategyTraits, take_stats_of
from ..compress import Compressor, Ctx, ErrorFeedback, compressor as make_compressor, resolve_error_feedback
from ..errors import WireFormatError


# ---------------------------------------------------------------------------------------
# Compression: Horovod's own compressor interface
# ---------------------------------------------------------------------------------------

class Compression:
    """A gradwire summable compressor in Horovod's compressor interface.

    Horovod calls ``compression.compress(grad)`` before its allreduce and
    ``compression.decompress(output, ctx)`` after it. The payload is the compressor's
    `to_summable` tensor, so the allreduced payload decodes to the sum (or average) of the
    ranks' gradients.

    Stochastic summable compressors (`randomk`) must pick the same elements on every rank:
    Horovod passes no tensor name, so the randomness is keyed by the tensor's shape and how
    many tensors of that shape this object has compressed so far. That is identical on all
    ranks as long as they compress same-shaped gradients in the same order, which holds for
    gradient hooks of the same model. For exact per-parameter keys (and error feedback) use
    `gradwire.hooks.horovod.DistributedOptimizer`.

    ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16`` are ready instances,
    spelled as Horovod's own ``hvd.Compression.fp16``, so Horovod code changes only its import.
    """

    none: ClassVar[Compression]
    fp16: ClassVar[Compression]
    bf16: ClassVar[Compression]

    def __init__(self, spec: str | Compressor = "fp16", seed: int = 0) -> None:
        c = make_compressor(spec)
        if not c.summable:
            raise ValueError(
                f"gradwire compressor {str(c)!r} is not summable, so Horovod cannot allreduce its payloads; "
                "Compression supports summable specs only (none, fp16, bf16, randomk and chains of them). "
                f"Use gradwire.hooks.horovod.DistributedOptimizer(optimizer, named_parameters, "
                f"compression={str(c)!r}) instead, which exchanges its packets by allgather.")
        self.compressor = c
        self.seed = int(seed)
        self._calls: dict[tuple, int] = defaultdict(int)
        self._warned = False

    def __repr__(self) -> str:
        return f"gradwire.hooks.horovod.Compression({str(self.compressor)!r})"

    def _ctx(self, tensor: torch.Tensor) -> Ctx:
        if not self.compressor.stochastic:
            return Ctx(self.seed)
        shape = (tuple(tensor.shape), str(tensor.dtype))
        n = self._calls[shape]
        self._calls[shape] = n + 1
        return Ctx(self.seed, n, 0, Ctx.key_of(repr(shape)))

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not tensor.dtype.is_floating_point or tensor.dtype == torch.float64:
            return tensor, None  # what Horovod's own compressors leave alone (and float64)
        ctx = self._ctx(tensor)
        payload = self.compressor.to_summable(tensor, ctx)
        if not horovod_sums(payload):
            # Horovod cannot allreduce this dtype (bfloat16): carry the rounded values in fp32.
            if not self._warned:
                warnings.warn(f"Horovod cannot allreduce {payload.dtype} tensors; {self.compressor} payloads "
                              "travel as float32 (same rounding, no bandwidth saving). gradwire's "
                              "DistributedOptimizer sends them as 16-bit packets instead.")
                self._warned = True
            payload = payload.float()
        return payload, (ctx, tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return tensor
        c, like = ctx
        return self.compressor.from_summable(tensor, like, c)


Compression.none = Compression("none")
Compression.fp16 = Compression("fp16")
Compression.bf16 = Compression("bf16")


# ---------------------------------------------------------------------------------------
# DistributedOptimizer: any gradwire compressor, with error feedback
# ---------------------------------------------------------------------------------------

_SUBCLASSES: dict[type, type] = {}

def _traits_of(strategy: Strategy) -> StrategyTraits:
    """A built strategy's declared traits (a strategy built by hand without them: none apply)."""
    return type(strategy).TRAITS or StrategyTraits(strategy.name, None)


class DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's DistributedOptimizer with gradwire compression.

    ``DistributedOptimizer(opt, named_parameters, ...)`` returns an instance of a subclass
    of both this class and ``type(opt)`` (Horovod's own trick), sharing ``opt``'s param
    groups, so `hvd.broadcast_optimizer_state`, LR schedulers and ``isinstance`` work.

    Arguments:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``: names key the error feedback and the
            compressors' randomness, and must be the same on every rank.
        compression: a gradwire spec or Compressor (any, summable or not); also accepts a
            `Compression` object.
        error_feedback: keep what compression dropped and send it later; ``"auto"`` (default)
            is on for biased compressors and off for casts and unbiased ones (`randomk`,
            `qsgd`, `terngrad`), see `Compressor.feedback_helps`.
        backward_passes_per_step: local accumulation passes before each exchange.
        op: ``hvd.Average`` or ``hvd.Sum``.
        seed: seed of the compressors' randomness (the same on every rank).
        strategy: a registered strategy name (`gradwire.comm.registry.STRATEGIES`) for every
            parameter; None (default): `allreduce` for payloads Horovod can sum, else `allgather`.
        strategy_options: options of that strategy (e.g. ``{"min_numel": 1024}`` for allgather).
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> "DistributedOptimizer":
        if cls is not DistributedOptimizer:
            return super().__new__(cls)
        base = type(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already a gradwire DistributedOptimizer")
        sub = _SUBCLASSES.get(base)
        if sub is None:
            sub = type(base.__name__, (DistributedOptimizer, base), {"__module__": __name__})
            _SUBCLASSES[base] = sub
        return super().__new__(sub)

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: str | Compressor | Compression = "topk:ratio=0.01", error_feedback: bool | str = "auto",
                 backward_passes_per_step: int = 1, op: Any = None, seed: int = 0, strategy: str | None = None,
                 strategy_options: dict[str, Any] | None = None) -> None:
        h = need_horovod()
        super().__init__(optimizer.param_groups)  # the wrapped class's __init__, on shared groups
        self.defaults = optimizer.defaults
        if isinstance(compression, Compression):
            compression = compression.compressor
        self._gw_compressor = make_compressor(compression)
        op = h.Average if op is None else op
        if op not in (h.Average, h.Sum):
            raise ValueError("gradwire DistributedOptimizer supports op=hvd.Average or hvd.Sum")
        self.op = op
        if int(backward_passes_per_step) < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.backward_passes_per_step = int(backward_passes_per_step)
        self._gw_seed = int(seed)
        self._gw_step = 0
        self._gw_error_feedback = error_feedback
        self._gw_options = dict(strategy_options or {})
        self._gw_untaken = ExchangeStats()  # totals since the last take_stats()
        self.last_stats: dict[str, Any] | None = None  # the last synchronized step's record
        self._gw_setup_strategies(strategy, dict(strategy_options or {}), error_feedback)

        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            named = [(f"gradwire.noname.{i}.{j}", p) for i, g in enumerate(self.param_groups)
                     for j, p in enumerate(g["params"])]
        else:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                                 "usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names must be unique; duplicates: {', '.join(dups)}")
        by_id = {id(p): n for n, p in named}
        unnamed = [p for p in params if id(p) not in by_id]
        if unnamed:
            raise ValueError(f"{len(unnamed)} optimizer parameter(s) are not in named_parameters")
        self._gw_names: dict[torch.Tensor, str] = {p: by_id[id(p)] for p in params}
        self._gw_delay = {p: self.backward_passes_per_step for p in params}
        self._gw_handles: dict[torch.Tensor, Work[torch.Tensor]] = {}  # parameter -> its exchanged gradient
        self._gw_requires_update = [p for p in params if p.requires_grad]
        self._gw_synchronized = False
        self._gw_should_synchronize = True
        self._gw_hooks = []
        if h.size() > 1:
            for p in self._gw_requires_update:
                self._gw_hooks.append(p.register_post_accumulate_grad_hook(self._gw_hook))

    # ---- strategies -----------------------------------------------------------------
    def _gw_setup_strategies(self, name: str | None, options: dict[str, Any], error_feedback: bool | str) -> None:
        """The named strategy now (so a bad name or option fails here), or the default pair's
        shared error feedback (keyed by parameter name: one residual table, as checkpoints hold)."""
        c = self._gw_compressor
        self._gw_backends: dict[bool, HorovodBackend] = {}
        self._gw_strategies: dict[str, Strategy] = {}
        self._gw_strategy_name = name
        self._gw_default_by_dtype: dict[tuple, str] = {}
        if name is None:
            if options:
                raise ValueError("strategy_options need strategy=")
            wanted = resolve_error_feedback(error_feedback, c)
            self._gw_feedback = ErrorFeedback(c) if wanted else None
            return
        if name not in STRATEGIES:
            raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
        if traits(name, options).own_compression and error_feedback == "auto":
            error_feedback = True  # e.g. PowerSGD's own error feedback, on by default
        self._gw_feedback = None
        strategy = make_strategy(name, self._gw_backend(False), c, resolve_error_feedback(error_feedback, c),
                                 **options)
        self._gw_strategies[name] = self._gw_placed(strategy)

    def _gw_backend(self, average: bool) -> HorovodBackend:
        if average not in self._gw_backends:
            self._gw_backends[average] = HorovodBackend(average=average)
        return self._gw_backends[average]

    def _gw_placed(self, strategy: Strategy) -> Strategy:
        """Move a strategy whose sum is one allreduce onto the averaging backend under hvd.Average."""
        if self.op == hvd.Average and _traits_of(strategy).one_linear_allreduce:
            strategy.backend = self._gw_backend(True)
        return strategy

    def _gw_strategy_for(self, grad: torch.Tensor) -> Strategy:
        """The strategy that exchanges gradients like `grad`."""
        if self._gw_strategy_name is not None:
            return self._gw_strategies[self._gw_strategy_name]
        key = (grad.dtype, grad.device.type)
        name = self._gw_default_by_dtype.get(key)
        if name is None:
            c = self._gw_compressor
            summable = c.summable and horovod_sums(c.to_summable(grad.new_zeros(8)))
            name = self._gw_default_by_dtype[key] = "allreduce" if summable else "allgather"
        if name not in self._gw_strategies:
            strategy = make_strategy(name, self._gw_backend(False), self._gw_compressor, False)
            strategy.feedback = self._gw_feedback
            self._gw_strategies[name] = self._gw_placed(strategy)
        return self._gw_strategies[name]

    def gradwire_strategy(self, name: str) -> Strategy:
        """The strategy (and, as its `.backend`, the HorovodBackend) exchanging parameter `name`."""
        for p, n in self._gw_names.items():
            if n == name:
                return self._gw_strategy_for(p.grad if p.grad is not None else p.detach())
        raise KeyError(f"no parameter named {name!r}")

    # ---- the API every entry point shares -----------------------------------------------
    def take_stats(self) -> ExchangeStats:
        """Totals (bytes, seconds) of the steps synchronized since the last call."""
        stats, self._gw_untaken = self._gw_untaken, ExchangeStats()
        return stats

    def get_config(self) -> dict[str, Any]:
        """The gradwire settings as plain data (the keyword arguments that rebuild them)."""
        return {"compression": str(self._gw_compressor), "error_feedback": self._gw_error_feedback,
                "backward_passes_per_step": self.backward_passes_per_step,
                "op": "Average" if self.op == hvd.Average else "Sum", "seed": self._gw_seed,
                "strategy": self._gw_strategy_name, "strategy_options": dict(self._gw_options)}

    # ---- launching ------------------------------------------------------------------
    def _gw_hook(self, p: torch.Tensor) -> None:
        if self._gw_delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step times before "
                                 "step(); increase backward_passes_per_step to accumulate locally")
        self._gw_delay[p] -= 1
        if self._gw_delay[p] == 0 and _traits_of(self._gw_strategy_for(p.grad)).never_waits:
            self._gw_handles[p] = self._gw_launch(p)

    def _gw_launch(self, p: torch.Tensor) -> Work[torch.Tensor]:
        """Start the exchange of p's gradient: a Work of the flat sum (or mean) over ranks."""
        if p.grad is None:  # unused on this rank: still take part (others may have a gradient)
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            raise ValueError("sparse gradients are not supported by gradwire's DistributedOptimizer")
        name = self._gw_names[p]
        strategy = self._gw_strategy_for(grad)
        average = self.op == hvd.Average and not strategy.backend.average  # else Horovod averages
        ctx = Ctx(self._gw_seed, self._gw_step, hvd.rank(), Ctx.key_of(name))
        with strategy.backend.named(f"gradwire.{name}"):  # Horovod matches ops by name, not order
            return strategy.exchange(grad.detach().reshape(-1), name, ctx, average=average)

    # ---- finishing ------------------------------------------------------------------
    def synchronize(self) -> None:
        """Finish every exchange (launching those whose hooks did not start one) and write the
        averaged gradients into `.grad`."""
        if hvd.size() > 1:
            for p in self._gw_requires_update:  # parameter order: the same on every rank
                if p not in self._gw_handles:
                    self._gw_handles[p] = self._gw_launch(p)
            errors = []
            try:
                for p, work in self._gw_handles.items():
                    try:
                        result = work.wait()
                    except WireFormatError as e:  # finish the other exchanges first: no handle left behind
                        errors.append(e)
                        continue
                    p.grad.copy_(result.reshape(p.grad.shape))
            finally:
                self._gw_handles.clear()
                for p in self._gw_delay:
                    self._gw_delay[p] = self.backward_passes_per_step
            stats = take_stats_of(self._gw_strategies.values())
            if errors:  # the failed step's record ends here
                self._gw_step += 1
                raise errors[0]
            self._gw_untaken = self._gw_untaken.merge(stats)
            self.last_stats = {**stats.as_dict(), "step": self._gw_step}
            self._gw_step += 1
        self._gw_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``"""
        self._gw_should_synchronize = False
        try:
            yield
        finally:
            self._gw_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._gw_should_synchronize:
            if self._gw_synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients are exchanged again")
            self.synchronize()
        self._gw_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gw_handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        return super().zero_grad(set_to_none)

    # ---- state ----------------------------------------------------------------------
    def gradwire_state_dict(self) -> dict[str, Any]:
        """The gradwire part of the state: compressor, step counter, error-feedback residuals
        (the default strategies'), or a named strategy's own state."""
        state: dict[str, Any] = {"compressor": str(self._gw_compressor), "step": self._gw_step,
                                 "feedback": self._gw_feedback.state_dict() if self._gw_feedback is not None else None,
                                 "rank": hvd.rank(), "world_size": hvd.size()}
        if self._gw_strategy_name is not None:
            state["strategy"] = self._gw_strategy_name
            state["strategy_state"] = self._gw_strategies[self._gw_strategy_name].state_dict()
        return state

    def load_gradwire_state_dict(self, state: dict[str, Any]) -> None:
        if not isinstance(state, dict) or "compressor" not in state or "step" not in state:
            raise ValueError("not a gradwire DistributedOptimizer state (no compressor and step entries)")
        check_rank(state, hvd.rank(), hvd.size(), "gradwire DistributedOptimizer")
        if state["compressor"] != str(self._gw_compressor):
            raise ValueError(f"state was saved for compressor {state['compressor']!r}, "
                             f"this optimizer uses {str(self._gw_compressor)!r}")
        saved = state.get("strategy")  # absent before strategy= existed: the default pair
        if saved != self._gw_strategy_name:
            raise ValueError(f"state was saved with strategy {saved or 'default (allreduce/allgather)'}, "
                             f"this optimizer uses {self._gw_strategy_name or 'the default (allreduce/allgather)'}")
        if saved is not None:
            self._gw_strategies[saved].load_state_dict(state["strategy_state"])
        else:
            if (state.get("feedback") is None) != (self._gw_feedback is None):
                raise ValueError("checkpoint and optimizer disagree on whether error feedback is on")
            if self._gw_feedback is not None:
                self._gw_feedback.load_state_dict(state["feedback"])
        self._gw_step = int(state["step"])

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["gradwire"] = self.gradwire_state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        gw = state_dict.pop("gradwire", None)
        self._gw_handles.clear()
        self._gw_synchronized = False
        self._gw_should_synchronize = True
        for p in self._gw_delay:
            self._gw_delay[p] = self.backward_passes_per_step
        super().load_state_dict(state_dict)
        if gw is not None:
            self.load_gradwire_state_dict(gw)
