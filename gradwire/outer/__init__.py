"""Outer-loop synchronization: replicas that train alone and sync every H steps (DiLoCo)."""

from __future__ import annotations

import importlib
from types import ModuleType

from .diloco import DiLoCo, OuterConfig, split_fragments
from .recipes import RECIPES, Recipe

__all__ = ["DiLoCo", "OuterConfig", "RECIPES", "Recipe", "checkpoint", "split_fragments"]


def __getattr__(name: str) -> ModuleType:
    """`gradwire.outer.checkpoint` loads on first use: it imports torch.distributed.checkpoint
    (DTensor, sympy), about a second per process that every rank importing the outer loop
    (each experiment rank among them) would otherwise pay without ever saving."""
    if name == "checkpoint":
        return importlib.import_module(".checkpoint", __name__)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
