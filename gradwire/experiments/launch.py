"""Start the ranks of one run as separate processes and wait for all of them.

A rank that fails stops the whole run: the others are killed after a short grace period and
the failing rank's log tail is raised. Logs go to RUN_DIR/rank<N>.log.
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import sysconfig
import time
from pathlib import Path
from typing import Callable

import gradwire

from .cluster import EmulatedCluster
from .config import RunConfig


class RunFailed(RuntimeError):
    pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def source_root() -> str | None:
    """The folder this gradwire was imported from when that is a source tree (a checkout on
    PYTHONPATH, an editable install), which rank processes must import from too; None for an
    installed package, which they find in site-packages as the parent did."""
    root = Path(gradwire.__file__).resolve().parent.parent
    installed = {Path(sysconfig.get_paths()[k]).resolve() for k in ("purelib", "platlib")}
    return None if root in installed else str(root)


def finished_ranks(run_dir: Path, world: int) -> set[int]:
    """Ranks that passed the final barrier. Under load, gloo sometimes aborts a rank whose peer
    tore its connections down first ("terminate called without an active exception"); a rank
    that dies that way after its marker has lost nothing, so it does not fail the run."""
    return {r for r in range(world) if (run_dir / f"rank{r}.done").exists()}


def _tail(path: Path, lines: int = 25) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


class _StepCounter:
    """Counts the step records rank 0 has written so far (for a progress display)."""

    def __init__(self, path: Path) -> None:
        self.path, self.offset, self.steps = path, 0, 0

    def poll(self) -> int:
        try:
            with open(self.path, "rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except OSError:
            return self.steps
        complete = chunk[: chunk.rfind(b"\n") + 1]
        self.offset += len(complete)
        self.steps += complete.count(b'"type": "step"')
        return self.steps


def launch(cfg: RunConfig, run_dir: Path, cluster: EmulatedCluster | None = None, timeout: float = 1800.0,
           on_step: Callable[[int], None] | None = None) -> dict:
    """Run `cfg` on cfg.world ranks (in `cluster`'s namespaces when given); return rank 0's summary.
    `on_step(n)` is called about once a second with the number of steps done so far."""
    run_dir = run_dir.resolve()  # ranks run in run_dir: nothing may depend on the caller's folder
    run_dir.mkdir(parents=True, exist_ok=True)
    (run_dir / "config.json").write_text(json.dumps(cfg.to_dict(), indent=1))
    (run_dir / "summary.json").unlink(missing_ok=True)
    for r in range(cfg.world):
        (run_dir / f"rank{r}.done").unlink(missing_ok=True)
    if cluster is not None:
        addr, port = cluster.address(0), 29500
    else:
        addr, port = "127.0.0.1", free_port()
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    root = source_root()
    if root is not None:
        env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    if cfg.ranks_per_node > 1:  # what torchrun tells a node's ranks; gradwire's node detection reads it
        env["LOCAL_WORLD_SIZE"] = str(cfg.ranks_per_node)
    if env.get("GRADWIRE_DATA_CACHE"):
        env["GRADWIRE_DATA_CACHE"] = str(Path(env["GRADWIRE_DATA_CACHE"]).resolve())
    procs: list[subprocess.Popen] = []
    logs = []
    try:
        for r in range(cfg.world):
            cmd = [sys.executable, "-m", "gradwire.experiments.worker", str(run_dir), str(r), addr, str(port)]
            rank_env = dict(env, GLOO_SOCKET_IFNAME=cluster.iface(r) if cluster is not None else "lo")
            if cluster is not None:
                cmd = cluster.prefix(r) + cmd
            log = open(run_dir / f"rank{r}.log", "w")
            logs.append(log)
            procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=rank_env, cwd=run_dir))
        deadline = time.monotonic() + timeout
        failed: int | None = None
        counter = _StepCounter(run_dir / "steps.jsonl")
        ticks = 0
        while any(p.poll() is None for p in procs):
            ticks += 1
            if on_step is not None and ticks % 5 == 0:
                on_step(counter.poll())
            bad = [r for r, p in enumerate(procs) if p.poll() not in (None, 0)
                   and r not in finished_ranks(run_dir, cfg.world)]
            if bad:
                failed = bad[0]
                grace = time.monotonic() + 10
                while time.monotonic() < grace and any(p.poll() is None for p in procs):
                    time.sleep(0.2)
                break
            if time.monotonic() > deadline:
                raise RunFailed(f"run {cfg.run_id} did not finish within {timeout:.0f} s; logs in {run_dir}")
            time.sleep(0.2)
        if failed is None:
            done = finished_ranks(run_dir, cfg.world)
            bad = [r for r, p in enumerate(procs) if p.returncode != 0 and r not in done]
            failed = bad[0] if bad else None
        if failed is not None:
            raise RunFailed(f"run {cfg.run_id}: rank {failed} exited with {procs[failed].returncode}:\n"
                            f"{_tail(run_dir / f'rank{failed}.log')}")
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for log in logs:
            log.close()
    return json.loads((run_dir / "summary.json").read_text())
