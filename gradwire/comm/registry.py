"""Strategies by name: the one table that maps a `strategy=` string to its class and options.

Each strategy lives in its own module; adding one is one entry here (the cost model only
compares strategies, it does not build them).
"""

from __future__ import annotations

from typing import Any, Callable

from ..compress import Compressor, compressor as make_compressor
from .backend import Backend
from .strategies import Allgather, Allreduce, ARTopK, DenseAllreduce, Strategy

POWERSGD_OPTIONS = ("rank", "min_compression_rate", "warm_start", "orthogonalization_epsilon", "seed")


def _powersgd(backend: Backend, c: Compressor, error_feedback: bool, **options: Any) -> Strategy:
    from .powersgd import PowerSGD  # the compressor is ignored: PowerSGD is its own compression

    return PowerSGD(backend, error_feedback=error_feedback, **options)


def _auto(backend: Backend, c: Compressor, error_feedback: bool, **options: Any) -> Strategy:
    from .cost import Auto

    return Auto(backend, c, error_feedback, **options)


def _hierarchical(backend: Backend, c: Compressor, error_feedback: bool, **options: Any) -> Strategy:
    from .hierarchical import Hierarchical

    return Hierarchical(backend, c, error_feedback, **options)


def _oktopk(backend: Backend, c: Compressor, error_feedback: bool, **options: Any) -> Strategy:
    from .oktopk import OkTopK

    return OkTopK(backend, c, error_feedback, **options)


# name -> (factory(backend, compressor, error_feedback, **options), accepted options; None: the class checks)
_STRATEGIES: dict[str, tuple[Callable[..., Strategy], frozenset[str] | None]] = {
    "auto": (_auto, frozenset({"alpha", "beta", "gamma_encode", "gamma_decode", "min_numel", "ranks_per_node", "trials",
                               "settle", "intra_alpha", "intra_beta", "inner", *POWERSGD_OPTIONS})),
    "allreduce": (lambda b, c, ef: Allreduce(b, c, ef), frozenset()),
    "allgather": (lambda b, c, ef, **o: Allgather(b, c, ef, **o), frozenset({"min_numel"})),
    "artopk": (lambda b, c, ef: ARTopK(b, c, ef), frozenset()),
    "oktopk": (_oktopk, frozenset({"boundary_every", "threshold_every", "min_numel"})),
    "hierarchical": (_hierarchical, None),  # inner=..., ranks_per_node=..., then the inner strategy's options
    "powersgd": (_powersgd, None),
    "dense": (lambda b, c, ef: DenseAllreduce(b), frozenset()),
}
STRATEGIES = tuple(_STRATEGIES)


def make_strategy(name: str, backend: Backend, compressor: Compressor | str = "none", error_feedback: bool = True,
                  **options: Any) -> Strategy:
    """Build a strategy by name; unknown names or options raise ValueError."""
    if name not in _STRATEGIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(STRATEGIES)}")
    build, accepted = _STRATEGIES[name]
    c = make_compressor(compressor)
    if accepted is not None and set(options) - accepted:
        takes = f"takes {', '.join(sorted(accepted))}" if accepted else "takes no options"
        raise ValueError(f"strategy {name!r} {takes}, got {sorted(set(options) - accepted)}")
    return build(backend, c, error_feedback, **options)
