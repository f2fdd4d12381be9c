"""Run a function on N processes that Lightning joins itself, as under `torchrun`.

Each child gets MASTER_ADDR, a free MASTER_PORT, RANK, WORLD_SIZE, LOCAL_RANK and NODE_RANK, so
Lightning's `LightningEnvironment` sees externally created processes (it then neither re-launches
the script nor spawns) and its strategy initialises the gloo process group over env://. Same
contract as `multiproc.run_ranks`: ``fn(rank, world, *args)`` runs on every rank, the (picklable)
results come back in rank order, a rank that raises fails the caller with its traceback, a hang
fails it after `timeout` seconds, and every child is killed on the way out.
"""

from __future__ import annotations

import os
import pickle
import queue as queue_module
import socket
import time
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _child(fn: Callable, rank: int, world: int, port: int, queue: Any, args: tuple) -> None:
    os.environ.update({"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port), "RANK": str(rank),
                       "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank), "NODE_RANK": "0", "OMP_NUM_THREADS": "1"})
    try:
        import torch
        import torch.distributed as dist

        torch.set_num_threads(1)
        try:
            queue.put((rank, True, pickle.dumps(fn(rank, world, *args))))
        finally:
            if dist.is_initialized():
                dist.destroy_process_group()
    except BaseException:  # noqa: BLE001 - report anything to the parent
        queue.put((rank, False, traceback.format_exc()))


def run_lightning_ranks(fn: Callable, world: int, *args: Any, timeout: float = 180.0) -> list[Any]:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    port = free_port()
    procs = [ctx.Process(target=_child, args=(fn, r, world, port, queue, args), daemon=True) for r in range(world)]
    for p in procs:
        p.start()
    results: dict[int, Any] = {}
    errors: list[str] = []
    failed_at = 0.0
    deadline = time.monotonic() + timeout
    try:
        while len(results) + len(errors) < world:
            try:
                rank, ok, value = queue.get(timeout=1.0)
            except queue_module.Empty:
                now = time.monotonic()
                if errors and now > failed_at + 20:
                    break  # a failed rank explains the hang of its peers
                if all(not p.is_alive() for p in procs):
                    silent = [r for r in range(world) if r not in results]
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
                p.join(timeout=5)
    if errors:
        raise AssertionError("\n".join(errors))
    return [results[r] for r in range(world)]
