"""Run a multi-rank program under a launcher (mpiexec, horovodrun) and read its checks.

Programs print ``CHECK <name> OK rank=<r>`` for every check a rank passes, a
``CHECK <name> FAILED`` block for one it fails, and ``PID rank=<r> <pid>`` at start, so a
launcher that hangs can be killed with every rank that outlived it. Launchers may prefix
lines (horovodrun does), so markers are found anywhere in a line.
"""

from __future__ import annotations

import ast
import os
import shutil
import signal
import subprocess
import time
from pathlib import Path


def check_names(program: Path) -> list[str]:
    """The @check functions of a program, in order (read from its source: nothing imported)."""
    tree = ast.parse(program.read_text())
    return [node.name for node in tree.body if isinstance(node, ast.FunctionDef)
            and any(isinstance(d, ast.Name) and d.id == "check" for d in node.decorator_list)]


def mpiexec_args(world: int) -> list[str] | None:
    """`mpiexec -n world` plus what Open MPI needs here (oversubscription, root), or None."""
    mpiexec = shutil.which("mpiexec")
    if mpiexec is None:
        return None
    version = subprocess.run([mpiexec, "--version"], capture_output=True, text=True, timeout=30)
    args = [mpiexec, "-n", str(world)]
    if "Open MPI" in version.stdout + version.stderr or "OpenRTE" in version.stdout + version.stderr:
        args += ["--oversubscribe"] + (["--allow-run-as-root"] if os.geteuid() == 0 else [])
    return args


def _after(line: str, marker: str) -> list[str]:
    return line.split(marker, 1)[1].split() if marker in line else []


class Job:
    """The outcome of one launch: which checks each rank finished, and the output."""

    def __init__(self, world: int, rc: int | None, stdout: str, stderr: str, seconds: float) -> None:
        self.world, self.rc, self.stdout, self.stderr, self.seconds = world, rc, stdout, stderr, seconds
        self.ok: dict[str, set[int]] = {}
        for line in stdout.splitlines():
            parts = _after(line, "CHECK ")
            if len(parts) >= 3 and parts[1] == "OK" and parts[2].startswith("rank="):
                self.ok.setdefault(parts[0], set()).add(int(parts[2][5:]))

    def failure(self, name: str) -> str | None:
        """Why `name` did not pass on every rank, or None if it did."""
        missing = set(range(self.world)) - self.ok.get(name, set())
        if not missing:
            return None
        marker = f"CHECK {name} FAILED"
        text = self.stdout + self.stderr
        if marker in text:
            return text[text.index(marker):][:6000]
        why = "timed out (a hang)" if self.rc is None else f"exited with {self.rc}"
        return (f"ranks {sorted(missing)} did not finish {name}: the job {why} after {self.seconds:.0f} s\n"
                f"--- stdout tail ---\n{self.stdout[-2000:]}\n--- stderr tail ---\n{self.stderr[-4000:]}")


def run_job(cmd: list[str], world: int, env: dict[str, str], cwd: Path, timeout: float, program: str) -> Job:
    """Run the launcher in its own process group; on timeout kill it and its leftover ranks
    (those whose command line still names `program`)."""
    start = time.monotonic()
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
        rc: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        _kill(proc)
        out, err = proc.communicate()
        _kill_leftover_ranks(out, program)
        rc = None
    return Job(world, rc, out, err, time.monotonic() - start)


def _kill(proc: subprocess.Popen) -> None:
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


def _kill_leftover_ranks(stdout: str, program: str) -> None:
    for line in stdout.splitlines():
        parts = _after(line, "PID ")
        if len(parts) == 2 and parts[1].isdigit():
            pid = int(parts[1])
            try:
                if program in Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace"):
                    os.kill(pid, signal.SIGKILL)
            except (OSError, ProcessLookupError):
                pass
