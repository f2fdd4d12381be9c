"""DDP communication hook: compressed gradient exchange for `DistributedDataParallel`.

    state = gradwire.hooks.ddp.register(model, "topk:ratio=0.01")   # or:
    model.register_comm_hook(GradwireState("qsgd:bits=4"), gradwire_hook)

Defaults follow the compressor: `error_feedback="auto"` is on for biased compressors
(sparsifiers, sign, onebit, fp8, int8) and off for casts and unbiased ones (none, fp16, bf16,
randomk, qsgd, terngrad); see `Compressor.feedback_helps`. Compression starts at `start_iter`,
by default at once when no per-parameter state is kept (so `register(ddp, "fp16")` is torch's
`fp16_compress_hook` bit for bit, and `"none"` DDP's own allreduce), else after two dense
iterations (DDP rebuilds its buckets after the first, so per-parameter state is keyed reliably
only from the second). Those uncompressed steps are dense allreduces, except with `auto` on
several nodes: from the third it takes dense or bf16, whichever it measures faster per bucket
(`Strategy.warmup_strategy`). `warmup=N` (sparsifiers with `ratio=`, on the allgather, allreduce and
hierarchical strategies) is DGC's density warm-up: the first N compressed steps keep a ratio decaying
exponentially from `warmup_ratio` (25%) to the compressor's own (`last_stats["density"]`).
`precondition="adam"` moves Adam before the exchange (hooks/precondition.py: each rank sends
Adam's direction from its own moments; pair it with `torch.optim.SGD(params, lr)`, no momentum),
so error feedback delays Adam's steps instead of shrinking them: the setting for Adam-trained LMs.
Buckets whose packet would not be smaller than dense are allreduced; error feedback is kept
per parameter. At the first call the ranks compare a fingerprint of their config and all raise
if they differ, instead of hanging or silently diverging.

Compression, randomness and error feedback work per parameter (keyed by its name), so
results do not depend on how DDP groups parameters into buckets — DDP regroups after its
first iteration, and a resumed process starts from the initial grouping again.

Checkpoint recipe (a resumed run continues bit-identically with the allgather strategy at any
world size, and with every strategy at 2 ranks; with more ranks, allreduce-based strategies
match up to fp32 rounding, because a ring allreduce adds each element in an order set by its
position in the buffer, and a resumed DDP starts from different buckets)::

    torch.save({"model": ddp.module.state_dict(), "opt": opt.state_dict(),
                "hook": state.state_dict()}, path)
    # resume: build DDP and the optimizer, load their states, then
    state = gradwire.hooks.ddp.register(ddp, "topk:ratio=0.01", ...)   # same config
    state.load_state_dict(ckpt["hook"])

The state also pickles (without its process group or model); re-attach it with
`register(ddp, state=unpickled_state)`. Registering by hand works too —
`ddp.register_comm_hook(GradwireState(..., model=ddp), gradwire_hook)` — but without
`model=` the state is keyed by bucket index, and a resumed process (whose first
iteration uses DDP's initial buckets) then fails with a residual-shape error.
"""


import zlib  # no "from __future__ import annotations": DDP inspects the hook's real annotations
from typing import Any

import torch
import torch.distributed as dist

from ..comm.backend import Work
from ..comm.framing import check_same_config
from ..comm.hierarchical import launcher_ranks_per_node
from ..comm.registry import make_strategy
from ..comm.strategies import DenseAllreduce, Strategy, segments_of
from ..comm.torch_dist import TorchDistBackend
from ..compress import Ctx, compressor as make_compressor, resolve_error_feedback
from ..compress.schedule import ratio_of, warmup_ratio, with_ratio
from .precondition import make_preconditioner


WARMUP_STRATEGIES = ("allgather", "allreduce", "hierarchical")  # strategies that swap their compressor per step


class GradwireState:
    """Everything the hook keeps between calls; pickles without its process group."""

    def __init__(self, compressor: str = "topk:ratio=0.01", strategy: str = "auto",
                 process_group: dist.ProcessGroup | None = None, error_feedback: bool | str = "auto",
                 start_iter: int | None = None, seed: int = 0, model: torch.nn.Module | None = None,
                 warmup: int = 0, warmup_ratio: float = 0.25, precondition: str | None = None,
                 **strategy_options: Any) -> None:
        c = make_compressor(compressor)
        self.preconditioner = make_preconditioner(precondition)
        self.precondition = str(self.preconditioner) if self.preconditioner is not None else ""
        self.warmup, self.warmup_ratio = int(warmup), float(warmup_ratio)
        if self.warmup < 0 or not 0.0 < self.warmup_ratio <= 1.0:
            raise ValueError(f"warmup must be >= 0 and 0 < warmup_ratio <= 1, got {warmup}, {warmup_ratio}")
        if self.warmup:
            with_ratio(c, 1.0)  # a sparsifier with ratio=, or raise
            if strategy not in WARMUP_STRATEGIES:
                raise ValueError(f"warmup works on the {', '.join(WARMUP_STRATEGIES)} strategies, not {strategy!r}")
        self._final = c
        self._tuned = -1  # the step whose warm-up compressor the strategy holds
        self.compressor = str(c)
        self.strategy_name = strategy
        powersgd = strategy == "powersgd" or (strategy in ("hierarchical", "auto")
                                              and strategy_options.get("inner") == "powersgd")
        if powersgd and error_feedback == "auto":
            error_feedback = True  # PowerSGD's own error feedback, on by default as in torch's powerSGD_hook
        self.error_feedback = resolve_error_feedback(error_feedback, c)
        stateful = (self.error_feedback or strategy in ("powersgd", "artopk", "oktopk", "hierarchical")
                    or (strategy == "auto" and not c.summable))
        self.start_iter = (2 if stateful else 0) if start_iter is None else int(start_iter)
        self.seed = int(seed)
        self.strategy_options = dict(strategy_options)
        if self.start_iter < 2 and stateful:
            raise ValueError("start_iter must be >= 2 when error feedback or per-bucket state is used: "
                             "DDP rebuilds its buckets after the first iteration")
        self.process_group = process_group
        self.iter = 0
        self.last_stats: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self._strategy: Strategy | None = None
        self._dense: DenseAllreduce | None = None
        self._pending_state: dict[str, Any] | None = None
        self._checked = False
        self._in_flight: list[torch.futures.Future] = []  # this step's bucket results so far
        self._param_names: dict[int, str] = {}
        self._param_sizes: list[int] | None = None
        self._param_shapes: list[torch.Size] | None = None
        if model is not None:
            self.attach(model)

    def attach(self, model: torch.nn.Module) -> None:
        """Learn the model's parameter names: the stable keys of per-parameter state."""
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        self._param_names = {id(p): n for n, p in named}
        self._param_sizes = [p.numel() for _, p in named]
        self._param_shapes = [p.shape for _, p in named]

    def keys_of(self, bucket: dist.GradBucket) -> list[str] | None:
        """Stable names of the bucket's parameters, or None when no model is attached."""
        if not self._param_names:
            return None
        return [self._param_names[id(p)] for p in bucket.parameters()]

    # ---- identity ------------------------------------------------------------------
    def fingerprint(self) -> int:
        desc = f"{self.compressor}|{self.strategy_name}|{self.error_feedback}|{self.start_iter}|{self.seed}|" \
               f"{sorted(self.strategy_options.items())}"
        if self.warmup:  # (only then: fingerprints of states saved before warm-up existed stay valid)
            desc += f"|warmup={self.warmup},{self.warmup_ratio}"
        if self.precondition:
            desc += f"|precondition={self.precondition}"
        return zlib.crc32(desc.encode())

    def describe(self) -> str:
        return (f"compressor={self.compressor!r} strategy={self.strategy_name!r} error_feedback={self.error_feedback} "
                f"start_iter={self.start_iter} seed={self.seed} warmup={self.warmup},{self.warmup_ratio} "
                f"precondition={self.precondition!r} "
                f"options={self.strategy_options}")

    # ---- lazily built pieces -------------------------------------------------------
    @property
    def backend(self) -> TorchDistBackend:
        return self.strategy.backend  # type: ignore[return-value]

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            backend = TorchDistBackend(self.process_group)
            options = dict(self.strategy_options)
            if self.strategy_name == "powersgd" or options.get("inner") == "powersgd":
                options.setdefault("seed", self.seed)  # PowerSGD's shared random init
            self._strategy = make_strategy(self.strategy_name, backend, self.compressor,
                                           error_feedback=self.error_feedback, **options)
            self._strategy.into_input = True  # the bucket buffer may hold the result, as in torch's hooks
            if self._strategy.warmup_strategy is not None:
                self._strategy.warmup_strategy.into_input = True
            self._dense = DenseAllreduce(backend)
            if hasattr(self._strategy, "plan_sizes"):
                self._strategy.plan_sizes = self._param_sizes
                self._strategy.plan_shapes = self._param_shapes
            if self._pending_state is not None:
                self._strategy.load_state_dict(self._pending_state)
                self._pending_state = None
        return self._strategy

    @property
    def dense(self) -> DenseAllreduce:
        self.strategy  # noqa: B018  (builds both)
        assert self._dense is not None
        return self._dense

    def _check_config(self) -> None:
        """Every rank's config (and the launcher's node size, which `auto` and `hierarchical`
        read) must match, checked over a fresh backend *before* the strategy is built: building
        `auto` or `hierarchical` already runs collectives that mismatched ranks would hang in."""
        check_same_config(TorchDistBackend(self.process_group),
                          f"{self.describe()} ranks_per_node(launcher)={launcher_ranks_per_node()}",
                          "gradwire hook configs")
        self._checked = True

    # ---- per-step bookkeeping --------------------------------------------------------
    def _record(self, step: int) -> None:
        """Close one step's statistics (runs when all of its buckets' exchanges have completed)."""
        merged = self.strategy.take_stats().merge(self.dense.take_stats()).as_dict()
        merged["iter"] = step
        if step >= self.start_iter and ratio_of(self._final) is not None:
            merged["density"] = self.density(step)
        self.last_stats = merged
        self.history.append(merged)

    def density(self, step: int) -> float:
        """The sparsifier's ratio at hook step `step` (the warm-up's, then the compressor's own)."""
        final = ratio_of(self._final)
        assert final is not None
        return warmup_ratio(final, step - self.start_iter, self.warmup, self.warmup_ratio) if self.warmup else final

    def _tune(self, step: int) -> None:
        """During the warm-up, give the strategy this step's compressor (once per step)."""
        if self.warmup and step <= self.start_iter + self.warmup and self._tuned != step:
            self.strategy.set_compressor(with_ratio(self._final, self.density(step)))
            self._tuned = step

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        strategy_state = self._strategy.state_dict() if self._strategy is not None else self._pending_state
        pre = self.preconditioner.state_dict() if self.preconditioner is not None else None
        return {"fingerprint": self.fingerprint(), "iter": self.iter, "strategy": strategy_state, "precondition": pre,
                "config": {"compressor": self.compressor, "strategy": self.strategy_name,
                           "error_feedback": self.error_feedback, "start_iter": self.start_iter,
                           "seed": self.seed, "warmup": self.warmup, "warmup_ratio": self.warmup_ratio,
                           "precondition": self.precondition,
                           "strategy_options": self.strategy_options}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["fingerprint"] != self.fingerprint():
            raise ValueError(f"checkpoint was saved with {state['config']}, this hook has {self.describe()}")
        self.iter = int(state["iter"])
        if self.preconditioner is not None:
            self.preconditioner.load_state_dict(state["precondition"])
        if state["strategy"] is not None:
            if self._strategy is not None:
                self._strategy.load_state_dict(state["strategy"])
            else:
                self._pending_state = state["strategy"]

    def __getstate__(self) -> dict[str, Any]:
        d = {k: v for k, v in self.__dict__.items()
             if k not in ("process_group", "_strategy", "_dense", "_pending_state", "_checked", "_param_names",
                          "_in_flight")}
        d["_pending_state"] = self.state_dict()["strategy"]
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        self.__dict__.update(d)
        self.__dict__.setdefault("_param_shapes", None)  # (states pickled before auto's low-rank candidates)
        self.process_group = None  # set it again if a non-default group is used
        self._strategy = None
        self._dense = None
        self._checked = False
        self._param_names = {}
        self._in_flight = []
        self._tuned = -1


def gradwire_hook(state: GradwireState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: returns a future of the averaged bucket."""
    buffer = bucket.buffer()
    key = bucket.index()
    if not state._checked:  # first call, before any collective: configs may differ even in start_iter
        state._check_config()
    if state.preconditioner is not None:  # every step, dense ones too: the optimizer is plain SGD
        keys = state.keys_of(bucket)
        if keys is None:
            raise ValueError("precondition= keeps Adam moments per parameter: register the hook with register() "
                             "or GradwireState(..., model=ddp)")
        for seg in segments_of(buffer, key, [p.shape for p in bucket.parameters()], keys):
            state.preconditioner.apply_(seg.of(buffer), seg.key)
    warmup = state.strategy.warmup_strategy
    if state.iter < state.start_iter and (warmup is None or state.iter < 2):  # (buckets settle after 2 steps)
        work: Work[torch.Tensor] = state.dense.exchange(buffer, key, Ctx(), average=True)
    elif state.iter < state.start_iter:  # the strategy's own choice of uncompressed exchange (auto's)
        ctx = Ctx(seed=state.seed, step=state.iter, rank=state.backend.rank, key=key)
        work = warmup.exchange(buffer, key, ctx, average=True)
    else:
        state._tune(state.iter)
        ctx = Ctx(seed=state.seed, step=state.iter, rank=state.backend.rank, key=key)
        shapes = [p.shape for p in bucket.parameters()]
        work = state.strategy.exchange(buffer, key, ctx, average=True, shapes=shapes, keys=state.keys_of(bucket))
    if key == 0:  # DDP calls the buckets in index order: a new step (and nothing left from a failed one)
        state._in_flight = []
    future = work.future()
    state._in_flight.append(future)
    if bucket.is_last():  # the step's record waits for all its buckets, which may finish in any order
        step, pending = state.iter, state._in_flight
        state.iter, state._in_flight = state.iter + 1, []
        last = future
        return torch.futures.collect_all(pending).then(lambda _: (state._record(step), last.value())[1])
    return future


def register(model: torch.nn.parallel.DistributedDataParallel, compressor: str = "topk:ratio=0.01",
             state: GradwireState | None = None, **options: Any) -> GradwireState:
    """One line: build the state (or re-attach a given one), register the hook, return the state."""
    if state is None:
        state = GradwireState(compressor, process_group=getattr(model, "process_group", None), **options)
    elif options:
        raise ValueError("pass either an existing state or options for a new one, not both")
    state.attach(model)
    model.register_comm_hook(state, gradwire_hook)
    return state
