"""The mutation check in CI: each bug planted by tools/cuda_emulator/mutations.py (in a copy of
the kernel sources) must make the emulated suite fail. Each case runs the emulated parity
tests (or the TSan pass) against its copy in a subprocess, until the first failure."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest
import torch

import cuda_emulator
from cuda_emulator import mutations

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not cuda_emulator.available() or torch.backends.cuda.is_built(),
                                 reason="emulator: needs g++ on x86-64 and CPU-only torch")]


@pytest.mark.parametrize("name,file,old,new,select", mutations.MUTATIONS, ids=[m[0] for m in mutations.MUTATIONS])
def test_planted_bug_fails_the_emulated_suite(name, file, old, new, select):
    if select.startswith("tsan:"):
        from cuda_emulator import tsan

        if not tsan.available():
            pytest.skip("ThreadSanitizer unavailable")
    with tempfile.TemporaryDirectory() as tmp:
        mutations.plant(Path(tmp), file, old, new)
        failed, first, _ = mutations.run(Path(tmp), select)
    assert failed, f"{name} survived: {first}"
