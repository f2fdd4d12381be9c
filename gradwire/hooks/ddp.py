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
so error feedback delays Adam's steps instead of shrinking them. `precondition="global_adam"`
shares the moments instead (1-bit Adam's structure): the first `start_iter` steps (12) are
uncompressed (bf16) and build the second moment, which then freezes, and each rank sends its
momentum through the compressor; with `"sign"` that is the setting for Adam-trained LMs at 20x
fewer bytes.
Buckets whose packet would not be smaller than dense are allreduced; error feedback is kept
per parameter. At the first call the ranks compare a fingerprint of their config and all raise
if they differ, instead of hanging or silently diverging.

The settings are `state.config` (a `DDPConfig`: the rules it shares with the FSDP hook and
`GradientExchanger` live in gradwire/comm/config.py; `state.get_config()` as plain data). A bad
compressor spec, an unknown strategy or an option the strategy does not take raise ValueError
in `register`. Statistics: `state.last_stats` (the last completed step; its "step" key, and
"iter" for one more release), `state.history` (every step's) and `state.take_stats()` (totals
since its last call), as on the FSDP hook and `GradientExchanger`.

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


from dataclasses import dataclass
from functools import partial
from typing import Any  # no "from __future__ import annotations": DDP inspects the hook's real annotations

import torch
import torch.distributed as dist

from ..comm.backend import Work
from ..comm.config import EntryPoint, ExchangeConfig, check_rank, config_field, strategy_names
from ..comm.base import ExchangeStats, Strategy, segments_of
from ..comm.dense import Allreduce, DenseAllreduce
from ..comm.torch_dist import TorchDistBackend
from ..compress import Compressor, Ctx
from ..compress.schedule import ratio_of, warmup_ratio, with_ratio
from .precondition import GLOBAL_DENSE_STEPS, make_preconditioner
from .ranks import PerRankState, own_state, where
from .watchdog import DirectionWatch, NeverCalled, ResumedWithoutState


DEFAULT_COMPRESSOR = "topk:ratio=0.01"
DEFAULT_STRATEGY = "auto"
#: strategies that take a new compressor every step, so DGC's density warm-up can run on them
WARMUP_STRATEGIES = tuple(strategy_names(lambda t: t.swaps_compressor))
#: why a registered DDP hook may never run (the never-called warning names them)
NEVER_CALLED_CAUSES = (
    "a framework accepted the hook but did not register it (Lightning's DDPStrategy(ddp_comm_hook=...) registers "
    "hooks on CUDA only; Accelerate's DistributedDataParallelKwargs(comm_hook=...) ignores callables): use "
    "gradwire.integrations.lightning, .accelerate or .hf_trainer, or call gradwire.hooks.ddp.register(ddp_model, ...) "
    "on the model once the framework has wrapped it in DistributedDataParallel; the model trains without its DDP "
    "wrapper or inside no_sync(); or the job has a single process.")
#: the first step at which per-bucket state is keyed reliably: DDP rebuilds its buckets after the first iteration
SETTLED_STEP = 2


def ddp_bucket_count(nbytes: list[int], cap: int, first: int = dist._DEFAULT_FIRST_BUCKET_BYTES) -> int:
    """How many buckets DDP groups parameters of these sizes into once it has rebuilt them after
    the first step: in reverse order, a bucket closes when it reaches `first` bytes (the first
    bucket) or `cap` (the others). An estimate: DDP also splits by dtype and device."""
    buckets, filled, limit = 0, 0, first
    for n in reversed(nbytes):
        filled += n
        if filled >= limit:
            buckets, filled, limit = buckets + 1, 0, cap
    return max(buckets + (filled > 0), 1)


class DDPConfig(ExchangeConfig):
    """The DDP hook's config: the shared rules (`gradwire.comm.config`), plus when compression
    starts (`start_iter`), DGC's density warm-up (`warmup`, `warmup_ratio`) and Adam before the
    exchange (`precondition`)."""

    ENTRY_POINT = "gradwire hook"

    def __init__(self, compressor: Compressor | str = DEFAULT_COMPRESSOR, strategy: str | None = None, *,
                 error_feedback: bool | str = "auto", start_iter: int | None = None, seed: int = 0,
                 warmup: int = 0, warmup_ratio: float = 0.25, precondition: str | None = None,
                 strategy_options: dict[str, Any] | None = None, **options: Any) -> None:
        super().__init__(compressor, strategy, error_feedback=error_feedback, seed=seed,
                         strategy_options=strategy_options, **options)
        preconditioner = make_preconditioner(precondition)
        self.precondition = str(preconditioner) if preconditioner is not None else ""
        self.warmup, self.warmup_ratio = int(warmup), float(warmup_ratio)
        if self.warmup < 0 or not 0.0 < self.warmup_ratio <= 1.0:
            raise ValueError(f"warmup must be >= 0 and 0 < warmup_ratio <= 1, got {warmup}, {warmup_ratio}")
        if self.warmup:
            with_ratio(self.parsed_compressor, 1.0)  # a sparsifier with ratio=, or raise
            if not self.traits.swaps_compressor:
                raise ValueError(f"warmup works on the {', '.join(WARMUP_STRATEGIES)} strategies, not {self.strategy!r}")
        earliest = SETTLED_STEP if self.keeps_state else 0
        shared = preconditioner is not None and preconditioner.shares_moments
        default = max(earliest, GLOBAL_DENSE_STEPS) if shared else earliest
        self.start_iter = default if start_iter is None else int(start_iter)
        if shared and self.start_iter < 1:
            raise ValueError("precondition='global_adam' builds Adam's second moment from the dense steps before "
                             "start_iter: start_iter must be >= 1 (default 12)")
        if self.start_iter < earliest:
            raise ValueError(f"start_iter must be >= {SETTLED_STEP} when error feedback or per-bucket state is used: "
                             "DDP rebuilds its buckets after the first iteration")

    def default_strategy(self) -> str:
        return DEFAULT_STRATEGY

    def _own_fields(self) -> dict[str, Any]:
        return {"start_iter": self.start_iter, "warmup": self.warmup, "warmup_ratio": self.warmup_ratio,
                "precondition": self.precondition}

    def fingerprint_text(self) -> str:
        """The text saved states have been stamped with since the first release: kept as it is, so
        their fingerprints (and whether they load) do not change."""
        text = (f"{self.compressor}|{self.strategy}|{self.error_feedback}|{self.start_iter}|{self.seed}|"
                f"{sorted(self.strategy_options.items())}")
        if self.warmup:  # (only then: fingerprints of states saved before warm-up existed stay valid)
            text += f"|warmup={self.warmup},{self.warmup_ratio}"
        if self.precondition:
            text += f"|precondition={self.precondition}"
        return text


class GradwireState(PerRankState, EntryPoint):
    """Everything the hook keeps between calls; pickles without its process group.

    compressor: a spec string (default ``"topk:ratio=0.01"``). strategy: default ``"auto"``.
    Unknown strategy names, options a strategy does not take and bad compressor specs raise
    ValueError here, naming the valid ones. `config` holds the settings (`get_config()` as plain
    data); `last_stats` is the last completed step's statistics (with "step"; its "iter" key is
    the same number, kept for one release), `history` every step's, `take_stats()` the totals
    since its last call."""

    def __init__(self, compressor: Compressor | str = DEFAULT_COMPRESSOR, strategy: str | None = None,
                 process_group: dist.ProcessGroup | None = None, error_feedback: bool | str = "auto",
                 start_iter: int | None = None, seed: int = 0, model: torch.nn.Module | None = None,
                 warmup: int = 0, warmup_ratio: float = 0.25, precondition: str | None = None,
                 **strategy_options: Any) -> None:
        self.config = DDPConfig(compressor, strategy, error_feedback=error_feedback, start_iter=start_iter,
                                seed=seed, warmup=warmup, warmup_ratio=warmup_ratio, precondition=precondition,
                                **strategy_options)
        self.preconditioner = make_preconditioner(self.config.precondition)
        self._tuned = -1  # the step whose warm-up compressor the strategy holds
        self.process_group = process_group
        self.iter = 0
        self.last_stats: dict[str, Any] | None = None
        self.history: list[dict[str, Any]] = []
        self._untaken = ExchangeStats()  # totals since the last take_stats()
        self._strategy: Strategy | None = None
        self._dense: Strategy | None = None
        self._pending_state: dict[str, Any] | None = None
        self._checked = False
        self._in_flight: list[torch.futures.Future] = []  # this step's bucket results so far
        self._param_names: dict[int, str] = {}
        self._param_sizes: list[int] | None = None
        self._param_shapes: list[torch.Size] | None = None
        self._param_buckets: int | None = None  # how many buckets DDP makes of them (auto prices each's rounds)
        self._held: list[tuple[_Bucket, torch.futures.Future | None]] = []  # buckets `clip=` holds back
        self._grad_norm: float | None = None  # this rank's gradient norm before clipping (with `clip=`)
        self._loaded = False  # whether a saved state was loaded (a resumed run without one warns)
        self._start_watches()
        if model is not None:
            self.attach(model)

    def _start_watches(self) -> None:
        self._never_called = NeverCalled(self, lambda s: s.iter > 0 or bool(s._in_flight), "the gradwire DDP hook",
                                         NEVER_CALLED_CAUSES)
        self._direction = DirectionWatch(self) if self.preconditioner is not None else None
        self._fresh = ResumedWithoutState(self, lambda s: s._loaded, "the gradwire DDP hook")

    def _close(self, step: int, result: torch.Tensor, first: torch.Tensor | None) -> torch.Tensor:
        """The step's last bucket is done: record its statistics, and (precondition=) note what the
        optimizer must receive as the watched parameter's gradient."""
        self._record(step)
        if self._direction is not None and first is not None:
            self._direction.expect(first, result[: first.numel()])
        return result

    compressor = config_field("compressor")
    start_iter = config_field("start_iter")
    warmup = config_field("warmup")
    warmup_ratio = config_field("warmup_ratio")
    precondition = config_field("precondition")

    def attach(self, model: torch.nn.Module) -> None:
        """Learn the model's parameter names: the stable keys of per-parameter state."""
        module = getattr(model, "module", model)
        named = [(n, p) for n, p in module.named_parameters() if p.requires_grad]
        if named:
            self._never_called.scope(named[0][1])
            self._fresh.scope(named[0][1])
        self._param_names = {id(p): n for n, p in named}
        self._param_sizes = [p.numel() for _, p in named]
        self._param_shapes = [p.shape for _, p in named]
        cap = getattr(model, "bucket_bytes_cap", None)
        if cap:
            self._param_buckets = ddp_bucket_count([p.numel() * p.element_size() for _, p in named], int(cap))

    def keys_of(self, bucket: dist.GradBucket) -> list[str] | None:
        """Stable names of the bucket's parameters, or None when no model is attached."""
        if not self._param_names:
            return None
        return [self._param_names[id(p)] for p in bucket.parameters()]

    # ---- lazily built pieces -------------------------------------------------------
    @property
    def backend(self) -> TorchDistBackend:
        return self.strategy.backend  # type: ignore[return-value]

    @property
    def strategy(self) -> Strategy:
        if self._strategy is None:
            backend = TorchDistBackend(self.process_group)
            self._strategy = self.config.build_strategy(backend)
            self._strategy.into_input = True  # the bucket buffer may hold the result, as in torch's hooks
            if self._strategy.warmup_strategy is not None:
                self._strategy.warmup_strategy.into_input = True
            cast = self.preconditioner.uncompressed if self.preconditioner is not None else None
            self._dense = Allreduce(backend, cast, error_feedback=False) if cast else DenseAllreduce(backend)
            self._dense.into_input = True
            if hasattr(self._strategy, "plan_sizes"):
                self._strategy.plan_sizes = self._param_sizes
                self._strategy.plan_shapes = self._param_shapes
                self._strategy.plan_buckets = self.__dict__.get("_param_buckets")
            if self._pending_state is not None:
                self._strategy.load_state_dict(self._pending_state)
                self._pending_state = None
        return self._strategy

    @property
    def dense(self) -> Strategy:
        """How the uncompressed first steps travel: a dense allreduce, or the preconditioner's cast
        (`global_adam`: bf16, as those steps only build Adam's moments)."""
        self.strategy  # noqa: B018  (builds both)
        assert self._dense is not None
        return self._dense

    def _check_config(self) -> None:
        """Every rank's config must match, checked over a fresh backend *before* the strategy is
        built (`ExchangeConfig.check_across_ranks`)."""
        self.config.check_across_ranks([TorchDistBackend(self.process_group)], self.describe())
        self._checked = True

    # ---- per-step bookkeeping --------------------------------------------------------
    def _record(self, step: int) -> None:
        """Close one step's statistics (runs when all of its buckets' exchanges have completed)."""
        stats = self.strategy.take_stats().merge(self.dense.take_stats())
        self._untaken = self._untaken.merge(stats)
        merged = {**stats.as_dict(), "step": step, "iter": step}  # ("iter": the old name, kept for one release)
        if step >= self.start_iter and ratio_of(self.config.parsed_compressor) is not None:
            merged["density"] = self.density(step)
        if self._grad_norm is not None:  # (precondition with clip=): the norm clip_grad_norm_ would return
            merged["grad_norm"] = self._grad_norm
        self.last_stats = merged
        self.history.append(merged)

    def density(self, step: int) -> float:
        """The sparsifier's ratio at hook step `step` (the warm-up's, then the compressor's own)."""
        final = ratio_of(self.config.parsed_compressor)
        assert final is not None
        return warmup_ratio(final, step - self.start_iter, self.warmup, self.warmup_ratio) if self.warmup else final

    def _tune(self, step: int) -> None:
        """During the warm-up, give the strategy this step's compressor (once per step)."""
        if self.warmup and step <= self.start_iter + self.warmup and self._tuned != step:
            self.strategy.set_compressor(with_ratio(self.config.parsed_compressor, self.density(step)))
            self._tuned = step

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        strategy_state = self._strategy.state_dict() if self._strategy is not None else self._pending_state
        pre = self.preconditioner.state_dict() if self.preconditioner is not None else None
        rank, world = where()
        return {"fingerprint": self.fingerprint(), "iter": self.iter, "strategy": strategy_state, "precondition": pre,
                "config": self.get_config(), "rank": rank, "world_size": world}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """This rank's state, or an all-ranks one (`all_ranks_state_dict()`), from which it takes its own
        entry. Another rank's state, or one from a job of another size, raises ValueError."""
        state = own_state(state, self.config.ENTRY_POINT)
        self.config.check_saved(state)
        check_rank(state, *where(), self.config.ENTRY_POINT)
        self._loaded = True
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
                          "_in_flight", "_held", "_never_called", "_direction", "_fresh")}
        d["_pending_state"] = self.state_dict()["strategy"]
        return d

    def __setstate__(self, d: dict[str, Any]) -> None:
        if "config" not in d:  # pickled before the config object: its fields were the state's own
            d = _with_config(d)
        self.__dict__.update(d)
        self.__dict__.setdefault("_param_shapes", None)  # (states pickled before auto's low-rank candidates)
        self.__dict__.setdefault("_untaken", ExchangeStats())
        self.process_group = None  # set it again if a non-default group is used
        self._strategy = None
        self._dense = None
        self._checked = False
        self._param_names = {}
        self._in_flight = []
        self._held = []
        self.__dict__.setdefault("_grad_norm", None)
        self._loaded = True  # (an unpickled state carries its own)
        self._tuned = -1
        self._start_watches()


_PICKLED_FIELDS = ("compressor", "strategy_name", "error_feedback", "start_iter", "seed", "warmup", "warmup_ratio",
                   "precondition", "strategy_options", "_final")


def _with_config(d: dict[str, Any]) -> dict[str, Any]:
    """A state pickled before `config` existed, its settings moved into a `DDPConfig`."""
    config = DDPConfig(d["compressor"], d["strategy_name"], error_feedback=d["error_feedback"],
                       start_iter=d["start_iter"], seed=d["seed"], warmup=d.get("warmup", 0),
                       warmup_ratio=d.get("warmup_ratio", 0.25), precondition=d.get("precondition") or None,
                       strategy_options=d["strategy_options"])
    return {**{k: v for k, v in d.items() if k not in _PICKLED_FIELDS}, "config": config}


@dataclass
class _Bucket:
    """What the hook needs of a `dist.GradBucket`, kept when `clip=` holds buckets back."""

    buffer: torch.Tensor
    index: int
    shapes: list[torch.Size]
    keys: list[str] | None
    last: bool
    first: torch.Tensor | None = None  # (the last bucket's first parameter, watched under precondition=)


def gradwire_hook(state: GradwireState, bucket: dist.GradBucket) -> torch.futures.Future[torch.Tensor]:
    """The DDP comm hook: returns a future of the averaged bucket."""
    if not state._checked:  # first call, before any collective: configs may differ even in start_iter
        state._check_config()
    params = bucket.parameters()
    held = _Bucket(bucket.buffer(), bucket.index(), [p.shape for p in params], state.keys_of(bucket),
                   bucket.is_last(), params[0] if state.preconditioner is not None else None)
    if state.preconditioner is not None:
        if held.keys is None:
            raise ValueError("precondition= keeps Adam moments per parameter: register the hook with register() "
                             "or GradwireState(..., model=ddp)")
        if state.preconditioner.clip is not None:
            return _clip_then_exchange(state, held)
        _precondition(state, held)  # every step, dense ones too: the optimizer is plain SGD
    return _exchange(state, held)


def _precondition(state: GradwireState, b: _Bucket) -> None:
    assert state.preconditioner is not None and b.keys is not None
    compressed = state.iter >= state.start_iter
    for seg in segments_of(b.buffer, b.index, b.shapes, b.keys):
        state.preconditioner.before_(seg.of(b.buffer), seg.key, compressed)


def _finish_precondition(state: GradwireState, b: _Bucket, compressed: bool,
                         done: torch.futures.Future[torch.Tensor]) -> torch.Tensor:
    """After the exchange: the preconditioner turns the averaged bucket into the step (global_adam)."""
    avg = done.value()
    assert state.preconditioner is not None and b.keys is not None
    for seg in segments_of(avg, b.index, b.shapes, b.keys):
        state.preconditioner.after_(seg.of(avg), seg.key, compressed)
    return avg


def _clip_then_exchange(state: GradwireState, b: _Bucket) -> torch.futures.Future[torch.Tensor]:
    """Hold the step's buckets until the last, clip this rank's whole gradient to the preconditioner's
    `clip`, precondition and send them all; the held buckets' futures follow their exchanges."""
    if b.index == 0:
        state._held = []
    if not b.last:
        waiting: torch.futures.Future[torch.Tensor] = torch.futures.Future()
        state._held.append((b, waiting))
        return waiting
    held, state._held = state._held + [(b, None)], []
    assert state.preconditioner is not None and state.preconditioner.clip is not None
    norm = float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(h.buffer) for h, _ in held])))
    scale = state.preconditioner.clip_scale(norm, state.preconditioner.clip)
    state._grad_norm = norm
    try:
        for h, waiting in held:
            if scale < 1.0:
                h.buffer.mul_(scale)
            _precondition(state, h)
            result = _exchange(state, h)
            if waiting is None:
                return result
            result.add_done_callback(partial(_relay, waiting))
    except Exception as e:  # the held buckets not sent yet fail with it, instead of waiting for ever
        for _, waiting in held:
            if waiting is not None and not waiting.done():
                waiting.set_exception(e)
        raise
    raise AssertionError("unreachable: the last bucket returns")


def _relay(to: torch.futures.Future[torch.Tensor], done: torch.futures.Future[torch.Tensor]) -> None:
    try:
        to.set_result(done.value())
    except Exception as e:  # noqa: BLE001 - the held bucket's future fails as its exchange did
        to.set_exception(e)


def _exchange(state: GradwireState, b: _Bucket) -> torch.futures.Future[torch.Tensor]:
    buffer, key = b.buffer, b.index
    warmup = state.strategy.warmup_strategy
    if state.iter < state.start_iter and (warmup is None or state.iter < 2):  # (buckets settle after 2 steps)
        work: Work[torch.Tensor] = state.dense.exchange(buffer, key, Ctx(), average=True)
    elif state.iter < state.start_iter:  # the strategy's own choice of uncompressed exchange (auto's)
        ctx = Ctx(seed=state.seed, step=state.iter, rank=state.backend.rank, key=key)
        work = warmup.exchange(buffer, key, ctx, average=True)
    else:
        state._tune(state.iter)
        ctx = Ctx(seed=state.seed, step=state.iter, rank=state.backend.rank, key=key)
        work = state.strategy.exchange(buffer, key, ctx, average=True, shapes=b.shapes, keys=b.keys)
    if key == 0:  # DDP calls the buckets in index order: a new step (and nothing left from a failed one)
        state._in_flight = []
    future = work.future()
    if state.preconditioner is not None and state.preconditioner.shares_moments:
        future = future.then(partial(_finish_precondition, state, b, state.iter >= state.start_iter))
    state._in_flight.append(future)
    if b.last:  # the step's record waits for all its buckets, which may finish in any order
        step, pending = state.iter, state._in_flight
        state.iter, state._in_flight = state.iter + 1, []
        last = future
        return torch.futures.collect_all(pending).then(lambda _: state._close(step, last.value(), b.first))
    return future


def register(model: torch.nn.parallel.DistributedDataParallel, compressor: Compressor | str = DEFAULT_COMPRESSOR, *,
             state: GradwireState | None = None, **options: Any) -> GradwireState:
    """One line: build the state (or re-attach a given one, `state=`), register the hook, return
    the state. `options` are `GradwireState`'s (defaults: compressor ``"topk:ratio=0.01"``,
    strategy ``"auto"``); unknown strategies and options raise ValueError here, not at the
    first backward."""
    if not hasattr(model, "register_comm_hook"):
        raise TypeError(f"gradwire.hooks.ddp.register takes the DistributedDataParallel-wrapped model "
                        f"(DDP(model, ...)), got a {type(model).__name__}; for FSDP2 (fully_shard) use "
                        "gradwire.hooks.fsdp.register")
    if state is None:
        state = GradwireState(compressor, process_group=getattr(model, "process_group", None), **options)
    elif options:
        raise ValueError("pass either an existing state or options for a new one, not both")
    state.attach(model)
    model.register_comm_hook(state, gradwire_hook)
    return state
