"""Outer-loop synchronization: replicas that train alone and sync every H steps (DiLoCo)."""

from .diloco import DiLoCo, OuterConfig, split_fragments

__all__ = ["DiLoCo", "OuterConfig", "split_fragments"]
