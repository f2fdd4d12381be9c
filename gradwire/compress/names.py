"""Compressor names -> classes: the table `register` fills and `lookup` reads.

It imports nothing of gradwire, so `base.Compressor.from_config` can find the class a
config names without an import circle; spec strings are parsed in `registry`, above it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from .base import Compressor

_REGISTRY: dict[str, type[Compressor]] = {}
#: names only a config carries, never a spec stage: "chain" (`chain.Chain`)
_COMPOSITES: dict[str, type[Compressor]] = {}


def register(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: make a compressor reachable by its spec name."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"compressor name {cls.name!r} is registered twice")
    ids = {c.codec_id: c.name for c in _REGISTRY.values() if c is not cls}
    if cls.codec_id in ids:
        raise ValueError(f"codec id {cls.codec_id} of {cls.name!r} is taken by {ids[cls.codec_id]!r}")
    _REGISTRY[cls.name] = cls
    return cls


def register_composite(cls: type[Compressor]) -> type[Compressor]:
    """Class decorator: a compressor built from other compressors' configs (the chain),
    reachable by its config name only (`config_class`), not as a spec stage."""
    _COMPOSITES[cls.name] = cls
    return cls


def available() -> list[str]:
    """Names of every registered compressor."""
    return sorted(_REGISTRY)


def lookup(name: str) -> type[Compressor]:
    """The registered compressor of a spec stage name (ValueError when there is none)."""
    cls = _REGISTRY.get(name)
    if cls is None:
        raise ValueError(f"unknown compressor {name!r}; valid names: {', '.join(available())}")
    return cls


def config_class(name: str) -> type[Compressor]:
    """The class a config's "name" names: a composite ("chain") or a registered compressor."""
    return _COMPOSITES.get(name) or lookup(name)
