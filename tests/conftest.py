"""Shared helpers for the tests, and the deselection of GPU-only tests where no GPU is."""

from __future__ import annotations

import pytest
import torch
from torch import nn


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of a few hundred elements, so small tensors take the multi-tile paths."""
    from gradwire.compress import casts, feedback, quantize

    monkeypatch.setattr(quantize, "TILE", 512)
    monkeypatch.setattr(casts, "_TILE", 300)
    monkeypatch.setattr(feedback, "_TILE", 256)


@pytest.fixture(params=["torch", "compiled"])
def cpu_path(request, monkeypatch):
    """Both CPU paths of error feedback: torch ops, and the compiled loops (`compiled`),
    which run when torch uses one thread."""
    from gradwire.compress import compiled

    if request.param == "compiled" and compiled.loops() is None:
        pytest.fail("numba is a dependency of gradwire: the compiled loops must import")
    monkeypatch.setenv("GRADWIRE_COMPILED", "1" if request.param == "compiled" else "0")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert compiled.enabled() == (request.param == "compiled")
        yield request.param
    finally:
        torch.set_num_threads(threads)


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


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook signature
    """Tests of what only a GPU can show (streams, nvCOMP) are deselected, not skipped, where no
    GPU is: every kernel still runs on the CPU emulator (tests/test_cuda_parity.py), and
    scripts/gpu_check.sh runs the `gpu` tests on a lent GPU."""
    if torch.cuda.is_available():
        return
    gpu_only = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_only:
        config.hook.pytest_deselected(items=gpu_only)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
