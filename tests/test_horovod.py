"""gradwire.hooks.horovod on real 2-rank Horovod jobs, with the Gloo and the MPI controller.

Each job runs every check of tests/horovod_programs/checks.py once (start-up with torch and
Horovod takes seconds, so checks share a job); each check is its own test here, passing
when every rank reported it. A job that hangs is killed after JOB_TIMEOUT seconds.
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

try:
    import horovod.torch as hvd  # noqa: F401

    HAVE_HOROVOD, WHY = True, ""
except Exception as e:  # noqa: BLE001 - ImportError, or a torch-ABI mismatch of the extension
    HAVE_HOROVOD, WHY = False, f"horovod.torch is not importable ({type(e).__name__}: {e}); run scripts/install-horovod.sh"

ROOT = Path(__file__).resolve().parent.parent
PROGRAM = Path(__file__).resolve().parent / "horovod_programs" / "checks.py"
WORLD = 2
JOB_TIMEOUT = 120.0  # a normal job takes 20-30 s

needs_horovod = pytest.mark.skipif(not HAVE_HOROVOD, reason=WHY)


def check_names() -> list[str]:
    tree = ast.parse(PROGRAM.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)]


def _command(controller: str) -> list[str] | None:
    if controller == "gloo":
        runner = shutil.which("horovodrun")
        if runner is None:
            return None
        return [runner, "--gloo", "-np", str(WORLD), "-H", f"localhost:{WORLD}", sys.executable, str(PROGRAM)]
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None or not hvd.mpi_built():
        return None
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    args = [mpiexec, "-n", str(WORLD)]
    if "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout + version.stderr:
        args += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return args + [sys.executable, str(PROGRAM)]


class Job:
    def __init__(self, controller: str, rc: int | None, out: str, err: str, seconds: float) -> None:
        self.controller, self.rc, self.out, self.err, self.seconds = controller, rc, out, err, seconds
        self.ok: dict[str, set[int]] = {}
        for line in out.splitlines():
            parts = line.split("CHECK ", 1)[-1].split() if "CHECK " in line else []
            if len(parts) >= 3 and parts[1] == "OK" and parts[2].startswith("rank="):
                self.ok.setdefault(parts[0], set()).add(int(parts[2][5:]))

    def failure(self, name: str) -> str | None:
        missing = set(range(WORLD)) - self.ok.get(name, set())
        if not missing:
            return None
        marker = f"CHECK {name} FAILED"
        text = self.out + self.err
        if marker in text:
            return text[text.index(marker):][:6000]
        why = "timed out (a hang)" if self.rc is None else f"exited with {self.rc}"
        return (f"ranks {sorted(missing)} did not finish {name}: the job {why} after {self.seconds:.0f} s\n"
                f"--- stdout tail ---\n{self.out[-2000:]}\n--- stderr tail ---\n{self.err[-4000:]}")


def _kill(proc: subprocess.Popen) -> None:
    """Stop the launcher we started and its process group."""
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


def _kill_leftover_ranks(out: str) -> None:
    """Kill ranks that outlived their launcher, by the pid each printed (if it still runs checks.py)."""
    for line in out.splitlines():
        parts = line.split("PID ", 1)[-1].split() if "PID rank=" in line else []
        if len(parts) == 2 and parts[1].isdigit():
            try:
                if "checks.py" in Path(f"/proc/{parts[1]}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(int(parts[1]), signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass


_JOBS: dict[str, Job] = {}


def job(controller: str) -> Job:
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
        _JOBS[controller] = Job(controller, rc, out, err, time.monotonic() - start)
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
    assert j.rc == 0, f"{controller}: rc={j.rc} after {j.seconds:.0f} s\n{j.err[-4000:]}"


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
