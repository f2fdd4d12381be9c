"""Strategies by name: the one table that maps a `strategy=` string to its class, its options and
its traits.

Each strategy lives in its own module and declares its traits there (`TRAITS`, a
`StrategyTraits`); the registry collects them, so adding a strategy is its module and one entry
here. The registry sits on top of comm/: it imports every strategy and nothing imports it,
except the entry points (hooks, api.py).

Tests: tests/comm/test_strategies.py, tests/comm/test_hierarchical.py (options and inner strategies).
"""

from __future__ import annotations

from dataclasses import replace
from typing import Any, Callable

from ..compress import Compressor, compressor as make_compressor
from .allgather import Allgather
from .artopk import ARTopK
from .auto import Auto
from .backend import Backend
from .base import CompressingExchange, Strategy, StrategyTraits
from .dense import Allreduce, DenseAllreduce
from .hierarchical import Hierarchical
from .oktopk import OkTopK
from .powersgd import POWERSGD_OPTIONS, PowerSGD
from .reduce_scatter import AlltoallReduceScatter, ReduceScatter

__all__ = ["DEFAULT_INNER", "KNOWN", "POWERSGD_OPTIONS", "STRATEGIES", "StrategyTraits", "make_strategy", "traits"]

#: the strategy `hierarchical` runs between nodes when no `inner=` is given
DEFAULT_INNER = "allgather"


def _hierarchical(backend: Backend, c: Compressor, error_feedback: bool, inner: str = DEFAULT_INNER,
                  ranks_per_node: int | None = None, **inner_options: Any) -> Hierarchical:
    """`hierarchical` with the inner strategy named by `inner=`, built over the between-node group."""
    if inner == "hierarchical":
        raise ValueError("hierarchical cannot nest itself")
    if inner in _ENTRIES and _ENTRIES[inner][0].TRAITS.reduce_scatter:  # type: ignore[union-attr]
        raise ValueError(f"hierarchical takes an all-reduce strategy between nodes, got the reduce-scatter {inner!r}")

    def between_nodes(inter: Backend) -> Strategy:
        return make_strategy(inner, inter, c, error_feedback, **inner_options)  # type: ignore[return-value]

    return Hierarchical(backend, between_nodes, ranks_per_node)


# name -> (class, build(backend, compressor, error_feedback, **options)); the class declares the traits
_ENTRIES: dict[str, tuple[type[CompressingExchange], Callable[..., CompressingExchange]]] = {
    "auto": (Auto, lambda b, c, ef, **o: Auto(b, c, ef, **o)),
    "allreduce": (Allreduce, lambda b, c, ef: Allreduce(b, c, ef)),
    "allgather": (Allgather, lambda b, c, ef, **o: Allgather(b, c, ef, **o)),
    "artopk": (ARTopK, lambda b, c, ef: ARTopK(b, c, ef)),
    "oktopk": (OkTopK, lambda b, c, ef, **o: OkTopK(b, c, ef, **o)),
    "hierarchical": (Hierarchical, _hierarchical),  # inner=..., ranks_per_node=..., then the inner strategy's options
    # (PowerSGD ignores the compressor: it is its own compression)
    "powersgd": (PowerSGD, lambda b, c, ef, **o: PowerSGD(b, error_feedback=ef, **o)),
    "dense": (DenseAllreduce, lambda b, c, ef: DenseAllreduce(b)),
    "alltoall": (AlltoallReduceScatter, lambda b, c, ef, **o: AlltoallReduceScatter(b, c, ef, **o)),
}


def _collect_traits() -> dict[str, StrategyTraits]:
    out = {}
    for name, (cls, _) in _ENTRIES.items():
        declared = cls.TRAITS
        if declared is None or declared.name != name:
            raise RuntimeError(f"{cls.__name__} declares traits {declared}, not the registry's name {name!r}")
        out[name] = declared
    return out


_TRAITS: dict[str, StrategyTraits] = _collect_traits()
#: strategies whose constructor checks the options itself: PowerSGD's (an unknown one is Python's
#: TypeError, as with torch's PowerSGDState); `hierarchical` declares none and hands them on
_OWN_OPTION_CHECK = frozenset({"powersgd"})
#: the all-reduce strategies a `strategy=` may name (the reduce-scatter "alltoall" is built by
#: make_strategy too, for the FSDP hook, but is not one of them)
STRATEGIES = tuple(name for name, t in _TRAITS.items() if not t.reduce_scatter)
#: every name `traits()` and `make_strategy` know, the reduce-scatter included
KNOWN = tuple(_TRAITS)


def traits(name: str, options: dict[str, Any] | None = None) -> StrategyTraits:
    """The traits of strategy `name` with `options`; a strategy that wraps an inner one (`inner=`)
    compresses by itself when its inner one does. Unknown names raise ValueError listing the valid ones."""
    if name not in _TRAITS:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(_TRAITS)}")
    found = _TRAITS[name]
    inner = (options or {}).get("inner")
    if found.wraps_inner and inner is not None:
        if inner not in _TRAITS or _TRAITS[inner].wraps_inner or _TRAITS[inner].reduce_scatter:
            raise ValueError(f"strategy {name!r} takes inner= one of "
                             f"{', '.join(n for n, t in _TRAITS.items() if not t.wraps_inner and not t.reduce_scatter)}"
                             f", got {inner!r}")
        found = replace(found, own_compression=_TRAITS[inner].own_compression)
    return found


def make_strategy(name: str, backend: Backend, compressor: Compressor | str = "none", error_feedback: bool = True,
                  **options: Any) -> Strategy | ReduceScatter:
    """Build a strategy by name ("alltoall": the FSDP hook's reduce-scatter); unknown names or
    options raise ValueError."""
    if name not in _ENTRIES:
        raise ValueError(f"unknown strategy {name!r}; valid: {', '.join(_ENTRIES)}")
    _, build = _ENTRIES[name]
    accepted = None if name in _OWN_OPTION_CHECK else _TRAITS[name].options
    c = make_compressor(compressor)
    if accepted is not None and set(options) - accepted:
        takes = f"takes {', '.join(sorted(accepted))}" if accepted else "takes no options"
        raise ValueError(f"strategy {name!r} {takes}, got {sorted(set(options) - accepted)}")
    return build(backend, c, error_feedback, **options)  # type: ignore[return-value]
