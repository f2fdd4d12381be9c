"""Real gradients from a small built-in model, for comparisons and benchmarks.

A small MLP (784-512-256-10, 535k parameters) is trained for a few SGD steps on a
synthetic, learnable task (labels from a fixed random linear teacher), then one backward
pass gives the gradients: structured like real training gradients (layer scales differ,
ReLU zeros appear), fully deterministic given the seed, nothing downloaded.
"""

from __future__ import annotations

import torch
from torch import nn


def small_mlp() -> nn.Module:
    return nn.Sequential(nn.Linear(784, 512), nn.ReLU(), nn.Linear(512, 256), nn.ReLU(), nn.Linear(256, 10))


def _batch(teacher: torch.Tensor, n: int, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    x = torch.randn(n, 784, generator=gen)
    return x, (x @ teacher).argmax(1)


def model_gradients(seed: int = 0, warmup_steps: int = 40, batch: int = 64,
                    dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """One flat gradient bucket (all parameters, concatenated) from the built-in model."""
    gen = torch.Generator().manual_seed(seed)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = small_mlp()
    teacher = torch.randn(784, 10, generator=gen)
    opt = torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
    loss_fn = nn.CrossEntropyLoss()
    for step in range(warmup_steps + 1):
        x, y = _batch(teacher, batch, gen)
        opt.zero_grad()
        loss_fn(model(x), y).backward()
        if step < warmup_steps:
            opt.step()
    flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])
    return flat.to(dtype)
