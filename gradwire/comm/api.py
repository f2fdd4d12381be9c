"""Gradient exchange for hand-written data-parallel loops (mpi4py or any `Backend`).

    >>> from mpi4py import MPI
    >>> from gradwire.comm.api import GradientExchanger
    >>> ex = GradientExchanger("topk:ratio=0.01", strategy="allgather")
    >>> ex.broadcast_(model.parameters())          # same initial weights everywhere
    >>> for x, y in shard:
    ...     opt.zero_grad(); loss_fn(model(x), y).backward()
    ...     ex.exchange_(model.parameters())        # grads := compressed mean over ranks
    ...     opt.step()

Buckets and keys: the gradients are flattened, in the order given, into one bucket per
(device, dtype) — usually a single bucket, so one collective per step — or, with ``bucket_mb``,
into consecutive buckets of about that size (a tensor is never split; a larger one gets a bucket
of its own). Inside a bucket every tensor is compressed on its own (``per_tensor=True``,
the default: top-k keeps ``ratio`` of each tensor, a tensor too small to gain is sent raw)
under a stable key — its name when you pass ``model.named_parameters()``, else its position
in the sequence — which also keys its error-feedback residual and its randomness, so state
does not depend on ``bucket_mb``. With ``per_tensor=False`` each bucket is compressed whole
(global top-k over the bucket) under the key ``"bucket<i>"``.

Every rank must pass the same tensors, in the same order, every step. The first exchange
checks that the ranks agree on the config and the layout and raises `ConfigMismatchError` on
every rank if not; a rank whose layout changes later checks again, which works only when all
ranks change together (a one-sided change after the first step is not detected).

All ranks receive bit-identical gradients — allgather-based strategies decode and sum in rank
order; allreduce-based ones get one sum from MPI (Open MPI's algorithms hand every rank the
same bits) — so with the same optimizer they keep bit-identical parameters.
"""

from __future__ import annotations

import warnings
from typing import Any, Iterable

import torch

from ..compress import Compressor, Ctx
from ..errors import ConfigMismatchError, WireFormatError  # noqa: F401 (ConfigMismatchError: raised by the check)
from .backend import Backend, Work
from .base import ExchangeStats, Strategy
from .config import EntryPoint, ExchangeConfig, check_rank, config_field
from .mpi import MPIBackend


_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_COMPRESSOR = "topk:ratio=0.01"
DEFAULT_STRATEGY = "allgather"


class ExchangerConfig(ExchangeConfig):
    """`GradientExchanger`'s config: the shared rules (`gradwire.comm.config`), plus how gradients
    are bucketed (`bucket_mb`) and compressed (`per_tensor`)."""

    ENTRY_POINT = "gradwire exchanger"

    def __init__(self, compressor: Compressor | str = DEFAULT_COMPRESSOR, strategy: str | None = None, *,
                 error_feedback: bool | str = "auto", seed: int = 0, bucket_mb: float | None = None,
                 per_tensor: bool = True, strategy_options: dict[str, Any] | None = None, **options: Any) -> None:
        if bucket_mb is not None and not bucket_mb > 0:
            raise ValueError(f"bucket_mb must be > 0, got {bucket_mb}")
        super().__init__(compressor, strategy, error_feedback=error_feedback, seed=seed,
                         strategy_options=strategy_options, **options)
        self.bucket_mb = bucket_mb
        self.per_tensor = bool(per_tensor)

    def default_strategy(self) -> str:
        return DEFAULT_STRATEGY

    def _own_fields(self) -> dict[str, Any]:
        return {"bucket_mb": self.bucket_mb, "per_tensor": self.per_tensor}

    def __call__(self) -> dict[str, Any]:
        """Deprecated: `GradientExchanger.config()` was a method; `config` is now this object."""
        warnings.warn("GradientExchanger.config() is deprecated and will be removed in the next release; use "
                      "get_config() (config is now the config object)", DeprecationWarning, stacklevel=2)
        return self.get_config()


def _named(tensors: Iterable[Any]) -> list[tuple[str, torch.Tensor]]:
    """(key, tensor) for tensors or (name, tensor) pairs; positions become keys "#<i>"."""
    out = []
    for i, item in enumerate(tensors):
        if isinstance(item, tuple) and len(item) == 2 and isinstance(item[0], str):
            out.append(item)
        elif isinstance(item, torch.Tensor):
            out.append((f"#{i}", item))
        else:
            raise TypeError(f"expected tensors or (name, tensor) pairs, got {type(item).__name__} at position {i}")
    names = [n for n, _ in out]
    if len(set(names)) != len(names):
        raise ValueError("tensor names must be unique")
    return out


def _gradient_of(t: torch.Tensor) -> torch.Tensor | None:
    """The tensor to exchange for t: a parameter's .grad (zeros when None; None for frozen
    parameters), else t itself."""
    if isinstance(t, torch.nn.Parameter) or t.requires_grad:
        if not t.requires_grad:
            return None  # frozen parameter: nothing to exchange
        if t.grad is None:
            t.grad = torch.zeros_like(t)  # unused this step: contribute zeros, keep the layout
        return t.grad
    return t


class GradientExchanger(EntryPoint):
    """Compress, exchange and average gradients over every rank of `backend`.

    compressor: a spec string (default ``"topk:ratio=0.01"``; ``"fp16"``, ...) or a `Compressor`.
    backend: a `Backend`; default `MPIBackend` over ``MPI.COMM_WORLD``.
    strategy: ``"allgather"`` (the default; any compressor), ``"allreduce"`` (summable ones),
        ``"artopk"``, ``"oktopk"``, ``"dense"``, ``"powersgd"``, ``"hierarchical"``, or ``"auto"``
        (chosen per bucket by a measured cost model; construction then runs timed collectives on
        every rank); extra keyword arguments go to the strategy (e.g. ``alpha``/``beta`` for auto).
        Unknown strategies and options raise ValueError here, naming the valid ones.
    error_feedback: keep what the compressor dropped and add it to the next step's gradient;
        ``"auto"`` (default): on for biased compressors, off for casts and unbiased ones
        (`Compressor.feedback_helps`); a strategy that compresses by itself (PowerSGD) keeps its
        own, on unless False.
    seed: for stochastic compressors (randomness is keyed by seed, step, rank and bucket) and
        PowerSGD's shared random init.
    bucket_mb: split the flat gradient into buckets of about this many MiB (default: one
        bucket per device and dtype).
    per_tensor: compress each tensor separately under its own key (default), else each
        bucket as a whole.

    The settings are `config` (an `ExchangerConfig`, with the rules it shares with the DDP and
    FSDP hooks; `get_config()` as plain data). `last_stats` is the last exchange's statistics
    (with "step"), `take_stats()` the totals since its last call, `totals` since construction.
    """

    def __init__(self, compressor: Compressor | str = DEFAULT_COMPRESSOR, backend: Backend | None = None,
                 strategy: str | None = None, error_feedback: bool | str = "auto", seed: int = 0,
                 bucket_mb: float | None = None, per_tensor: bool = True, **strategy_options: Any) -> None:
        self.config = ExchangerConfig(compressor, strategy, error_feedback=error_feedback, seed=seed,
                                      bucket_mb=bucket_mb, per_tensor=per_tensor, **strategy_options)
        if backend is None:
            backend = MPIBackend()  # (mpi4py itself is imported only here, when it is the backend)
        self.backend = backend
        # Before the strategy exists: building auto or hierarchical runs collectives already.
        self.config.check_across_ranks([backend])
        self.strategy: Strategy = self.config.build_strategy(backend)
        self.step = 0
        self.last_stats: dict[str, Any] | None = None
        self.totals = ExchangeStats()
        self._untaken = ExchangeStats()  # totals since the last take_stats()
        self._checked_layout: tuple | None = None

    compressor = config_field("parsed_compressor", "the `Compressor` in use (read-only)")
    bucket_mb = config_field("bucket_mb")
    per_tensor = config_field("per_tensor")

    # ---- identity ------------------------------------------------------------------
    @property
    def rank(self) -> int:
        return self.backend.rank

    @property
    def world_size(self) -> int:
        return self.backend.world_size

    def __repr__(self) -> str:
        return f"GradientExchanger({self.get_config()}, backend={self.backend!r}, step={self.step})"

    # ---- bucketing -----------------------------------------------------------------
    def _buckets(self, grads: list[torch.Tensor]) -> list[list[int]]:
        """Indices of grads per bucket: grouped by (device, dtype) in order of first appearance,
        then cut at about bucket_mb."""
        groups: dict[tuple[torch.device, torch.dtype], list[int]] = {}
        for i, g in enumerate(grads):
            groups.setdefault((g.device, g.dtype), []).append(i)
        if self.bucket_mb is None:
            return list(groups.values())
        cap = self.bucket_mb * (1 << 20)
        buckets: list[list[int]] = []
        for members in groups.values():
            current: list[int] = []
            size = 0
            for i in members:
                nbytes = grads[i].numel() * grads[i].element_size()
                if current and size + nbytes > cap:
                    buckets.append(current)
                    current, size = [], 0
                current.append(i)
                size += nbytes
            if current:
                buckets.append(current)
        return buckets

    def _check_layout(self, layout: tuple) -> None:
        """Every rank must agree on the config and the bucket layout (blocking; first step only,
        or when this rank's layout changes)."""
        self.config.check_across_ranks([self.backend], f"{self.describe()} layout={layout!r}")
        self._checked_layout = layout

    # ---- exchange ------------------------------------------------------------------
    def exchange_(self, tensors: Iterable[Any], average: bool = True) -> dict[str, Any]:
        """Replace every gradient by its compressed mean (sum with average=False) over ranks,
        in place, and return this step's stats.

        `tensors`: parameters (their .grad is exchanged; a missing .grad becomes zeros, frozen
        parameters are skipped), gradient tensors, or (name, tensor) pairs of either kind,
        e.g. ``model.named_parameters()``."""
        self.exchange_async_(tensors, average).wait()
        assert self.last_stats is not None
        return self.last_stats

    def exchange_async_(self, tensors: Iterable[Any], average: bool = True) -> Work[dict[str, Any]]:
        """Like `exchange_`, but returns once the collectives are issued: the gradients are
        written (and the stats returned) when the returned Work is waited for. Wait for it
        before the next exchange and before reading the gradients."""
        named = [(k, g) for k, g in ((k, _gradient_of(t)) for k, t in _named(tensors)) if g is not None]
        keys = [k for k, _ in named]
        grads = [g for _, g in named]
        for k, g in named:
            if g.dtype not in _DTYPES:
                raise TypeError(f"gradient {k!r} is {g.dtype}; compressors take float32, float16 or bfloat16")
        buckets = self._buckets(grads)
        layout = tuple((str(grads[b[0]].dtype), tuple((keys[i], tuple(grads[i].shape)) for i in b))
                       for b in buckets)
        if layout != self._checked_layout:
            self._check_layout(layout)
        step = self.step
        self.step += 1
        works: list[tuple[list[int], Work[torch.Tensor]]] = []
        for b, members in enumerate(buckets):
            flat = torch.cat([grads[i].detach().reshape(-1) for i in members])
            ctx = Ctx(seed=self.seed, step=step, rank=self.backend.rank, key=b)
            if self.per_tensor:
                shapes = [grads[i].shape for i in members]
                work = self.strategy.exchange(flat, b, ctx, average=average, shapes=shapes,
                                              keys=[keys[i] for i in members])
            else:
                work = self.strategy.exchange(flat, f"bucket{b}", ctx, average=average)
            works.append((members, work))

        def finish() -> dict[str, Any]:
            # Wait for every bucket before writing any: a peer's bad packet in one bucket
            # (WireFormatError, raised on every rank) leaves all gradients as they were and
            # no collective unfinished.
            results, error = [], None
            for members, work in works:
                try:
                    results.append((members, work.wait()))
                except WireFormatError as e:
                    error = error or e
            if error is not None:
                self.strategy.take_stats()  # this step's record ends here
                raise error
            with torch.no_grad():
                for members, result in results:
                    out = result.reshape(-1)
                    offset = 0
                    for i in members:
                        n = grads[i].numel()
                        grads[i].copy_(out[offset: offset + n].view_as(grads[i]))
                        offset += n
            stats = self.strategy.take_stats()
            self.totals = self.totals.merge(stats)
            self._untaken = self._untaken.merge(stats)
            self.last_stats = {**stats.as_dict(), "step": step}
            return self.last_stats

        return Work(wait=finish)

    def broadcast_(self, tensors: Iterable[Any], src: int = 0) -> None:
        """Copy src's tensors (e.g. ``model.parameters()`` or ``model.state_dict().values()``)
        to every rank, in place. Accepts (name, tensor) pairs too."""
        with torch.no_grad():
            tensors = [t for _, t in _named(tensors)]
            works = []
            for t in tensors:
                buf = t.detach() if t.is_contiguous() else t.detach().contiguous()
                works.append((t, buf, self.backend.broadcast(buf.view(-1), src)))
            for t, buf, work in works:
                work.wait()
                if buf.data_ptr() != t.data_ptr():
                    t.copy_(buf)

    # ---- checkpointing ---------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """Step, config and the strategy's state (error-feedback residuals, auto's choices)."""
        return {"version": 1, "step": self.step, "config": self.get_config(), "strategy": self.strategy.state_dict(),
                "rank": self.backend.rank, "world_size": self.backend.world_size}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("version") != 1:
            raise ValueError(f"unknown GradientExchanger state version {state.get('version')!r}")
        self.config.check_saved(state)
        check_rank(state, self.backend.rank, self.backend.world_size, self.config.ENTRY_POINT)
        self.strategy.load_state_dict(state["strategy"])
        self.step = int(state["step"])
