"""Tensors the tests share: seeded random input, raw bit patterns, a real MLP gradient."""

from __future__ import annotations

import torch
from torch import nn


def randn(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def bits(t: torch.Tensor) -> torch.Tensor:
    """The raw bit patterns of a float tensor, for bit-exact (NaN payload) comparisons."""
    ints = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()]
    return t.contiguous().view(ints)


def mlp_gradient(seed: int = 0, dtype: torch.dtype = torch.float32, steps: int = 5) -> torch.Tensor:
    """One flat gradient of a small MLP after a few SGD steps on random data (~110k elements)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 320), nn.ReLU(), nn.Linear(320, 64), nn.ReLU(), nn.Linear(64, 10))
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    teacher = torch.randn(256, 10, generator=gen)
    for step in range(steps + 1):
        x = torch.randn(128, 256, generator=gen)
        y = (x @ teacher).argmax(1)
        opt.zero_grad()
        nn.functional.cross_entropy(model(x), y).backward()
        if step < steps:
            opt.step()
    return torch.cat([p.grad.reshape(-1) for p in model.parameters()]).to(dtype)
