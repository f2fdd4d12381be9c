"""The `oktopk` sparse allreduce on real gloo process groups at P = 2, 3, 4 and 8 (the same
checks run under mpiexec: tests/comm/mpi_programs/oktopk.py)."""

from __future__ import annotations

import pytest

import oktopk_checks
from gradwire.comm.torch_dist import TorchDistBackend
from multiproc import run_ranks


def _run(rank: int, world: int) -> list[str]:
    backend = TorchDistBackend()
    done = []
    for check in oktopk_checks.CHECKS:  # a failing check raises with its rank's traceback
        check(backend)
        done.append(check.__name__)
    return done


@pytest.mark.parametrize("world", [2, 3, 4, 8])
def test_oktopk_on_gloo(world: int) -> None:
    """Oracle equality, ranks bit-identical, the 6k-pair bound, empty and all-selected ranks,
    NaN/Inf, error feedback, a hostile chunk: see oktopk_checks.CHECKS."""
    for done in run_ranks(_run, world, timeout=600):
        assert done == [c.__name__ for c in oktopk_checks.CHECKS]


def test_options_are_checked() -> None:
    from gradwire.comm.registry import make_strategy

    with pytest.raises(ValueError, match="plain topk"):
        make_strategy("oktopk", None, "qsgd")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="boundary_every"):
        make_strategy("oktopk", None, "topk", boundary_every=0)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes boundary_every, min_numel, threshold_every"):
        make_strategy("oktopk", None, "topk", rank=3)  # type: ignore[arg-type]
