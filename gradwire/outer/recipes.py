"""Named outer-loop recipes: a compressor and the outer settings that go with it.

SparseLoCo (Sarfi et al., arXiv 2508.15706): the pseudo-gradient goes into an error-feedback
accumulator that decays (``e = beta * e + delta``), whose chunked top-k (1-3% of entries in
the paper; 1.56% in its 72B run) is sent as 2-bit values, and the mean is applied by plain
SGD: the decaying accumulator stands in for DiLoCo's outer momentum, so there is none. Here:
`topk:chunk=4096` keeps 1% of each chunk of 4096 (the density at which the packet is about
150x smaller than bf16's), values as TernGrad's two bits (sign and nonzero, times the
chunk's largest |value|), beta = 0.95, outer lr 1. The chunks cover the flattened model
(`per_tensor=False`), not each tensor: a model's many small tensors (norms, biases) would each
add a packet and a kept entry per chunk (docs/benchmarks.md, "The larger LM across the WAN",
has what that cost on a GPT). Every part is an ordinary gradwire compressor, DiLoCo or exchange option and can be
given instead (`DiLoCo(compressor=..., momentum=0, feedback_decay=..., per_tensor=...)`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class Recipe:
    """A compressor spelling, the DiLoCo settings and the exchange options it is meant with
    (explicit ones win)."""

    compressor: str
    settings: dict[str, Any] = field(default_factory=dict)
    exchange: dict[str, Any] = field(default_factory=dict)


RECIPES: dict[str, Recipe] = {
    "sparseloco": Recipe("topk:ratio=0.01,chunk=4096+terngrad",
                         {"momentum": 0.0, "nesterov": False, "outer_lr": 1.0, "feedback_decay": 0.95},
                         {"per_tensor": False}),
}


def recipe(name: Any) -> Recipe | None:
    """The recipe called `name`, None when `name` is a compressor (or anything else)."""
    return RECIPES.get(name) if isinstance(name, str) else None
