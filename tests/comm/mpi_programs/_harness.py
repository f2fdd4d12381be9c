"""Runs check functions on every rank of an mpiexec job and reports each one on stdout.

A check is ``fn(backend)``; it passes when it returns on every rank. Each rank prints
``CHECK <name> OK rank=<r> <seconds>s`` after a check returns (and ``PID rank=<r> <pid>`` first). Any exception prints the rank's
traceback to stderr and aborts the whole job (the peers may be blocked in a collective
that will never match), so a failure can never hang the run.
"""

from __future__ import annotations

import hashlib
import os
import sys
import time
import traceback
from typing import Any, Callable

import torch

Check = Callable[[Any], None]
REGISTRY: dict[str, list[tuple[str, Check]]] = {}


def check(fn: Check) -> Check:
    """Register fn as a check of the module that defines it (in definition order)."""
    REGISTRY.setdefault(fn.__module__, []).append((fn.__name__, fn))
    return fn


def digest(*tensors: torch.Tensor) -> str:
    """sha256 of the tensors' dtypes, shapes and raw bytes (bit-exact comparisons)."""
    h = hashlib.sha256()
    for t in tensors:
        t = t.detach().cpu().contiguous()
        h.update(f"{t.dtype}{tuple(t.shape)}".encode())
        h.update(t.view(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def same_on_all_ranks(backend: Any, what: str, *tensors: torch.Tensor) -> None:
    """Assert the tensors are bit-identical on every rank."""
    digests = backend.allgather_text(digest(*tensors))
    assert len(set(digests)) == 1, f"{what} differs across ranks: {digests}"


def bits_equal(a: torch.Tensor, b: torch.Tensor, what: str) -> None:
    assert a.dtype == b.dtype and a.shape == b.shape, f"{what}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
    if not torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8)):
        bad = (a != b).nonzero().reshape(-1)[:5].tolist()
        raise AssertionError(f"{what}: not bit-identical, first differences at {bad}: "
                             f"{a.view(-1)[bad].tolist()} vs {b.view(-1)[bad].tolist()}")


def run(checks: list[tuple[str, Check]]) -> None:
    os.environ.setdefault("GRADWIRE_MPI_CUDA_AWARE", "0")
    torch.set_num_threads(1)
    from mpi4py import MPI

    from gradwire.comm.mpi import MPIBackend

    backend = MPIBackend(MPI.COMM_WORLD)
    print(f"PID rank={backend.rank} {os.getpid()}", flush=True)  # lets a timed-out test kill leftovers
    for name, fn in checks:
        start = time.perf_counter()
        try:
            fn(backend)
        except BaseException:  # noqa: BLE001 - report, then take the whole job down
            sys.stdout.flush()
            sys.stderr.write(f"CHECK {name} FAILED rank={backend.rank}\n{traceback.format_exc()}\n")
            sys.stderr.flush()
            MPI.COMM_WORLD.Abort(1)
        print(f"CHECK {name} OK rank={backend.rank} {time.perf_counter() - start:.2f}s", flush=True)
    backend.comm.Barrier()


def main(module: str) -> None:
    run(REGISTRY[module])
