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


def _sparse_stage(config: dict) -> dict | None:
    """The config of the ratio-based sparsifier in `config` (itself, or a chain's stage), else None."""
    stages = config.get("stages", [config])
    found = [st for st in stages if "ratio" in st and st.get("k") is None]
    return found[0] if found else None


def ratio_of(c: Compressor) -> float | None:
    """The kept fraction of a ratio-based sparsifier (alone or first in a chain such as topk+fp16), else None."""
    stage = _sparse_stage(c.get_config())
    return None if stage is None else float(stage["ratio"])


def with_ratio(c: Compressor, ratio: float) -> Compressor:
    """The same compressor keeping `ratio` of the elements; only ratio-based sparsifiers have one."""
    config = c.get_config()
    stage = _sparse_stage(config)
    if stage is None:
        raise ValueError(f"a density warm-up needs a sparsifier with ratio= (topk, randomk, dgc), got {c}")
    stage["ratio"] = ratio  # (get_config returns fresh dicts)
    return from_config(config)
