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
import socket
import traceback
from typing import Any, Callable

import torch.multiprocessing as mp

from multiproc import collect


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
    return collect(procs, queue, world, timeout)
