"""Run a function on N real processes joined in a gloo process group (no mocks).

Each rank calls ``fn(rank, world, *args)``; its return value (picklable) comes back in
rank order. A rank that raises fails the caller with that rank's traceback; a rank that
hangs fails it after `timeout` seconds. Ranks in `may_die` (fault tests kill or freeze them on
purpose) may exit or stay silent: their result is None once every other rank has reported.
Every child is killed on the way out.

Ranks fork from multiprocessing's forkserver, which imports torch (and the torch._dynamo that
DDP loads) once per test session: a rank starts in a fraction of a second instead of importing
torch again (1-2 s of CPU per rank, most of a short test's time on a 2-core machine). Each rank
takes the caller's environment as it is at the call (a forkserver's children would otherwise
keep the server's); gradwire itself is not preloaded, so env settings read at its import hold.
"""

from __future__ import annotations

import datetime
import os
import pickle
import queue as queue_module
import tempfile
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


PRELOAD = ["torch", "torch.distributed", "torch._dynamo"]


def _child(fn: Callable, rank: int, world: int, store_path: str, queue: Any, args: tuple,
           pg_timeout: float | None, env: dict[str, str]) -> None:
    os.environ.clear()
    os.environ.update(env)
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    try:
        extra = {"timeout": datetime.timedelta(seconds=pg_timeout)} if pg_timeout is not None else {}
        dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank, world_size=world, **extra)
        try:
            # plain pickle bytes: tensors sent through mp queues as shared memory die with the child
            queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_ranks(fn: Callable, world: int, *args: Any, timeout: float = 120.0,
              may_die: tuple[int, ...] = (), pg_timeout: float | None = None) -> list[Any]:
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(PRELOAD)  # (takes effect when the server starts, at the first call)
    queue = ctx.Queue()
    env = dict(os.environ)
    with tempfile.TemporaryDirectory() as tmp:
        store = os.path.join(tmp, "store")
        procs = [ctx.Process(target=_child, args=(fn, r, world, store, queue, args, pg_timeout, env), daemon=True)
                 for r in range(world)]
        for p in procs:
            p.start()
        return collect(procs, queue, world, timeout, may_die)


def collect(procs: list, queue: Any, world: int, timeout: float, may_die: tuple[int, ...] = ()) -> list[Any]:
    """Wait for the started ranks' results (rank order); a failing rank fails the caller with its
    traceback, silence past `timeout` raises TimeoutError; every child is killed on the way out."""
    results: dict[int, Any] = {}
    errors: list[str] = []
    failed_at = 0.0
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            if may_die and all(r in results for r in range(world) if r not in may_die):
                break  # the ranks that were to survive have reported
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                now = time.monotonic()
                if errors and now > failed_at + 20:
                    break  # a failed rank explains the hang of its peers
                if all(not p.is_alive() for r, p in enumerate(procs) if r not in may_die):
                    silent = [r for r in range(world) if r not in results and r not in may_die]
                    errors.append(f"ranks {silent} exited without reporting "
                                  f"(exit codes {[procs[r].exitcode for r in silent]})")
                    break
                if now > deadline:
                    raise TimeoutError(f"ranks {sorted(set(range(world)) - set(results))} did not finish "
                                       f"within {timeout:.0f} s") from None
                continue
            if ok:
                results[rank] = pickle.loads(value)
            else:
                errors.append(f"rank {rank} failed:\n{value}")
                failed_at = time.monotonic()
    finally:
        for p in procs:
            p.join(timeout=5)
            if p.is_alive():
                p.kill()
    if errors:
        raise AssertionError("\n".join(errors))
    return [results.get(r) for r in range(world)]
