"""gradwire.hooks.horovod on real 2-rank Horovod jobs, with the Gloo and the MPI controller.

Each job runs every check of tests/hooks/horovod_programs/checks.py once (start-up with torch and
Horovod takes seconds, so checks share a job); each check is its own test here, passing
when every rank reported it. A job that hangs is killed after JOB_TIMEOUT seconds.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import warnings
from pathlib import Path

import pytest

import launcher

try:
    import horovod.torch as hvd  # noqa: F401

    HAVE_HOROVOD, WHY = True, ""
except Exception as e:  # noqa: BLE001 - ImportError, or a torch-ABI mismatch of the extension
    HAVE_HOROVOD, WHY = False, f"horovod.torch is not importable ({type(e).__name__}: {e}); run scripts/install-horovod.sh"

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = Path(__file__).resolve().parent / "horovod_programs" / "checks.py"
WORLD = 2
JOB_TIMEOUT = 120.0  # a normal job takes 20-30 s

needs_horovod = pytest.mark.skipif(not HAVE_HOROVOD, reason=WHY)


def check_names() -> list[str]:
    return launcher.check_names(PROGRAM)


def _command(controller: str) -> list[str] | None:
    if controller == "gloo":
        runner = shutil.which("horovodrun")
        if runner is None:
            return None
        return [runner, "--gloo", "-np", str(WORLD), "-H", f"localhost:{WORLD}", sys.executable, str(PROGRAM)]
    args = launcher.mpiexec_args(WORLD)
    if args is None or not hvd.mpi_built():
        return None
    return args + [sys.executable, str(PROGRAM)]


_JOBS: dict[str, launcher.Job] = {}


def job(controller: str) -> launcher.Job:
    if controller not in _JOBS:
        cmd = _command(controller)
        if cmd is None:
            pytest.skip(f"no launcher for the {controller} controller (horovodrun / mpiexec with Horovod MPI)")
        env = dict(os.environ)
        env.update({
            "PYTHONPATH": os.pathsep.join([str(ROOT)] + [p for p in [env.get("PYTHONPATH")] if p]),
            "OMP_NUM_THREADS": "1",
            "GRADWIRE_EXPECT_CONTROLLER": controller,
            "PYTHONWARNINGS": "ignore::UserWarning",
        })
        if controller == "mpi":
            env.update({"HOROVOD_CONTROLLER": "mpi", "HOROVOD_CPU_OPERATIONS": "mpi",
                        "OMPI_MCA_mpi_yield_when_idle": "1"})
        else:
            env.update({"HOROVOD_CONTROLLER": "gloo", "HOROVOD_CPU_OPERATIONS": "gloo"})
        _JOBS[controller] = launcher.run_job(cmd, WORLD, env, ROOT, JOB_TIMEOUT, "checks.py")
    return _JOBS[controller]


CHECKS = [(c, n) for c in ("gloo", "mpi") for n in check_names()]


@needs_horovod
@pytest.mark.parametrize("controller,name", CHECKS, ids=[f"{c}-{n}" for c, n in CHECKS])
def test_horovod_check(controller: str, name: str) -> None:
    why = job(controller).failure(name)
    if why is not None:
        pytest.fail(f"{controller} controller, {name}:\n{why}", pytrace=False)


@needs_horovod
@pytest.mark.parametrize("controller", ("gloo", "mpi"))
def test_horovod_job_exits_cleanly(controller: str) -> None:
    j = job(controller)
    assert j.rc == 0, f"{controller}: rc={j.rc} after {j.seconds:.0f} s\n{j.stderr[-4000:]}"


@needs_horovod
@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "fp16"])  # packets by allgather; a summable payload by allreduce
def test_survivor_stops_when_a_rank_dies(spec: str) -> None:
    """The last rank exits mid-training (tests/hooks/horovod_programs/dies.py): the survivor raises
    CollectiveError (HorovodBackend's name for Horovod's shutdown) and completes no optimizer step
    after the death."""
    runner = shutil.which("horovodrun")
    if runner is None:
        pytest.skip("no horovodrun")
    env = dict(os.environ, OMP_NUM_THREADS="1", HOROVOD_CONTROLLER="gloo", HOROVOD_CPU_OPERATIONS="gloo",
               PYTHONPATH=os.pathsep.join([str(ROOT)] + [p for p in [os.environ.get("PYTHONPATH")] if p]))
    program = Path(__file__).resolve().parent / "horovod_programs" / "dies.py"
    proc = subprocess.run([runner, "--gloo", "-np", "2", "-H", "localhost:2", sys.executable, str(program), spec],
                          env=env, cwd=ROOT, capture_output=True, text=True, timeout=JOB_TIMEOUT)
    steps = [int(m) for m in re.findall(r"STEP 0 (\d+)", proc.stdout)]
    assert max(steps) == 3, proc.stdout[-3000:]  # the victim died before step 4: none after it
    # the victim exits 0, so horovodrun leaves the survivor to notice the death by itself
    assert "RAISED 0 CollectiveError" in proc.stdout, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert proc.returncode != 0  # and the job fails loudly


def test_program_defines_checks() -> None:
    assert len(check_names()) >= 8


# ---- in-process (world size 1: no exchange) ---------------------------------------------------
@needs_horovod
def test_compression_api_in_process() -> None:
    import torch

    from gradwire.hooks.horovod import Compression

    x = torch.randn(1000, generator=torch.Generator().manual_seed(0))
    c = Compression("fp16")
    payload, ctx = c.compress(x)
    assert payload.dtype == torch.float16
    assert torch.equal(c.decompress(payload, ctx), x.half().float())
    ints = torch.arange(4)
    assert c.compress(ints) == (ints, None)
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        Compression("topk:ratio=0.1")
    with pytest.raises(ValueError, match="DistributedOptimizer"):
        Compression("fp16+zstd")


@needs_horovod
def test_compression_ready_instances_spelled_as_horovod() -> None:
    import torch

    from gradwire.hooks.horovod import Compression

    x = torch.randn(1000, generator=torch.Generator().manual_seed(1))
    for name, rounded in (("none", x), ("fp16", x.half().float()), ("bf16", x.bfloat16().float())):
        c = getattr(Compression, name)
        assert isinstance(c, Compression) and str(c.compressor) == name
        with warnings.catch_warnings():  # bf16: Horovod 0.28 cannot allreduce it (warned once)
            warnings.simplefilter("ignore")
            payload, ctx = c.compress(x)
        assert torch.equal(c.decompress(payload, ctx).float(), rounded), name
