"""Spec strings <-> compressors: ``"topk:ratio=0.01+qsgd:bits=4+zstd"``.

Grammar: ``stage ('+' stage)*``, ``stage = name [':' key '=' value (',' key '=' value)*]``.
`str(compressor)` prints the canonical spec, which parses back to an equal compressor.
"""

from __future__ import annotations

import re
from typing import Any

from .base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}
_STAGE_SPLIT = re.compile(r"\+(?=\s*[A-Za-z_])")  # '+' before a name, not inside 1e+3


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make a compressor reachable by its spec name."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is registered twice")
    ids = {c.codec_id: c.name for c in _REGISTRY.values() if c is not cls}
    if cls.codec_id in ids:
        raise ValueError(f"codec id {cls.codec_id} of {cls.name!r} is taken by {ids[cls.codec_id]!r}")
    _REGISTRY[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered compressor."""
    return sorted(_REGISTRY)


def lookup(name: str) -> type[Compressor]:
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(available())}")
    return cls


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
    from .chain import Chain

    return Chain(stages)


def from_config(config: dict[str, Any]) -> Compressor:
    """Inverse of `Compressor.get_config()`."""
    if not isinstance(config, dict) or "name" not in config:
        raise ValueError(f"a compressor config is a dict with a 'name', got {config!r}")
    cfg = dict(config)
    name = cfg.pop("name")
    if name == "chain":
        from .chain import Chain

        return Chain([from_config(c) for c in cfg.pop("stages")])
    return lookup(name)(**cfg)
