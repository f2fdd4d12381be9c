"""Spec strings <-> compressors: ``"topk:ratio=0.01+qsgd:bits=4+zstd"``.

Grammar: ``stage ('+' stage)*``, ``stage = name [':' key '=' value (',' key '=' value)*]``.
`str(compressor)` prints the canonical spec, which parses back to an equal compressor.
The name -> class table under it (`register`, `lookup`, `available`) is `names`.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Compressor
from .chain import Chain
from .names import available, lookup, register  # noqa: F401  (the registry's public names)

_STAGE_SPLIT = re.compile(r"\+(?=\s*[A-Za-z_])")  # '+' before a name, not inside 1e+3


def parse_stage(text: str) -> Compressor:
    text = text.strip()
    name, _, args = text.partition(":")
    cls = lookup(name.strip())
    kwargs: dict[str, str] = {}
    if args.strip():
        for item in args.split(","):
            key, eq, value = item.partition("=")
            key = key.strip()
            if not eq or not key or not value.strip():
                raise ValueError(f"bad parameter {item!r} in {text!r}; expected key=value")
            if key in kwargs:
                raise ValueError(f"parameter {key!r} given twice in {text!r}")
            kwargs[key] = value.strip()
    return cls(**kwargs)


def compressor(spec: "str | Compressor | dict[str, Any]") -> Compressor:
    """Build a compressor from a spec string, a config dict, or return it unchanged."""
    if isinstance(spec, Compressor):
        return spec
    if isinstance(spec, dict):
        return from_config(spec)
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a compressor spec must be a non-empty string, got {spec!r}")
    parts = _STAGE_SPLIT.split(spec.strip())
    stages = [parse_stage(p) for p in parts]
    if len(stages) == 1:
        return stages[0]
    return Chain(stages)


def from_config(config: dict[str, Any]) -> Compressor:
    """Inverse of `Compressor.get_config()`: whichever compressor (or chain) the config names."""
    return Compressor.from_config(config)
