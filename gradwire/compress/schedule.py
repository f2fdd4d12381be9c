"""Density warm-up (DGC, Lin et al. 2018): a sparsifier keeps more of the gradient in the first
compressed steps, while gradients change fastest and the residual of error feedback is young, then
decays exponentially to its own ratio, so early training is not starved of signal."""

from __future__ import annotations

from .base import Compressor
from .registry import from_config


def warmup_ratio(final: float, step: int, steps: int, start: float = 0.25) -> float:
    """The ratio at compressed step `step` (0-based) of a `steps`-long warm-up from `start` to `final`:
    start * (final / start) ** (step / steps), and `final` from `steps` on (or when start <= final)."""
    if step >= steps or start <= final:
        return final
    return start * (final / start) ** (step / steps)


def with_ratio(c: Compressor, ratio: float) -> Compressor:
    """The same compressor keeping `ratio` of the elements; only ratio-based sparsifiers have one."""
    config = c.get_config()
    if "ratio" not in config or config.get("k") is not None:
        raise ValueError(f"a density warm-up needs a sparsifier with ratio= (topk, randomk, dgc), got {c}")
    return from_config(dict(config, ratio=ratio))
