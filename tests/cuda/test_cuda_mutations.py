"""The mutation check in CI: each bug planted by scripts/cuda_mutations.py (in a copy of the
kernel sources) must make the emulated suite fail. Each case runs the emulated parity
tests (or the TSan pass) against its copy in a subprocess, until the first failure."""

from __future__ import annotations

import importlib.util
import tempfile
from pathlib import Path

import pytest
import torch

from gradwire.cuda import emulator

_SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "cuda_mutations.py"
_spec = importlib.util.spec_from_file_location("cuda_mutations", _SCRIPT)
mutations = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(mutations)

pytestmark = [pytest.mark.slow,
              pytest.mark.skipif(not emulator.available() or torch.backends.cuda.is_built(),
                                 reason="emulator: needs g++ on x86-64 and CPU-only torch")]


@pytest.mark.parametrize("name,file,old,new,select", mutations.MUTATIONS, ids=[m[0] for m in mutations.MUTATIONS])
def test_planted_bug_fails_the_emulated_suite(name, file, old, new, select):
    if select.startswith("tsan:"):
        from gradwire.cuda.emulator import tsan

        if not tsan.available():
            pytest.skip("ThreadSanitizer unavailable")
    with tempfile.TemporaryDirectory() as tmp:
        mutations.plant(Path(tmp), file, old, new)
        failed, first, _ = mutations.run(Path(tmp), select)
    assert failed, f"{name} survived: {first}"
