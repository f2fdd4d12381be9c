"""Shared helpers for the tests, and the deselection of GPU-only tests where no GPU is."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

# shared helpers (multiproc, adversary, tensors, ...) import by name from every test folder and
# from the ranks the tests spawn (which inherit sys.path); tools/ holds development tools that are
# not in the wheel (the CUDA emulator)
_ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(_ROOT / "tools"))
sys.path.insert(0, str(_ROOT / "tests" / "support"))


@pytest.fixture
def small_tiles(monkeypatch):
    """Tiles of a few hundred elements, so small tensors take the multi-tile paths."""
    from gradwire.compress import casts, feedback
    from gradwire.compress.quantize import tiles

    monkeypatch.setattr(tiles, "TILE", 512)
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


def pytest_collection_modifyitems(config, items) -> None:  # noqa: ANN001 - pytest's hook signature
    """Tests of what only a GPU can show (streams, nvCOMP) are deselected, not skipped, where no
    GPU is: every kernel still runs on the CPU emulator (tests/cuda/test_cuda_parity.py), and
    scripts/gpu_check.sh runs the `gpu` tests on a lent GPU."""
    if torch.cuda.is_available():
        return
    gpu_only = [item for item in items if item.get_closest_marker("gpu") is not None]
    if gpu_only:
        config.hook.pytest_deselected(items=gpu_only)
        items[:] = [item for item in items if item.get_closest_marker("gpu") is None]
