"""Outer-loop synchronization: replicas that train alone and sync every H steps (DiLoCo)."""

from . import checkpoint
from .diloco import DiLoCo, OuterConfig, split_fragments
from .recipes import RECIPES, Recipe

__all__ = ["DiLoCo", "OuterConfig", "RECIPES", "Recipe", "checkpoint", "split_fragments"]
