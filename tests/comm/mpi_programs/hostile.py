"""A hostile or frozen peer over MPI: the last rank lies in the fixed-layout size exchange or
stops answering; every honest rank raises a clean error, allocates nothing the lie asked for,
and never waits past the backend's timeout.
mpiexec -n 2 python tests/comm/mpi_programs/hostile.py"""

from __future__ import annotations

import os
import resource
import sys
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import check, main  # noqa: E402

from gradwire import CollectiveError, Ctx, WireFormatError  # noqa: E402
from gradwire.comm.mpi import MPIBackend  # noqa: E402
from gradwire.comm.registry import make_strategy  # noqa: E402


def _peak_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class _Claiming(MPIBackend):
    """The attacker's MPIBackend: its allgatherv size declaration claims `claim` elements."""

    claim = 0

    def _ints(self, op: str, values: list[int]) -> list[list[int]]:
        if op == "allgatherv":
            values = [self.claim, values[1]]
        return super()._ints(op, values)


def _expect(error: type, fn, what: str) -> str:
    try:
        fn()
    except error as e:
        return str(e)
    raise AssertionError(f"{what}: expected {error.__name__}")


@check
def size_claims_are_bounded_before_allocation(b) -> None:
    evil = b.rank == b.world_size - 1
    x = torch.randn(4000, generator=torch.Generator().manual_seed(b.rank))
    for claim in (64 << 30, 256 << 20):  # 64 GiB, and 256 MiB (old: padded to on every rank)
        backend = MPIBackend(b.comm)
        if evil:
            backend = _Claiming(b.comm)
            backend.claim = claim
        s = make_strategy("allgather", backend, "topk:ratio=0.01+zstd")
        before = _peak_mb()
        message = _expect(WireFormatError, lambda: s.exchange(x.clone(), "w", Ctx(rank=b.rank)).wait(),
                          f"a {claim}-byte claim")
        assert _peak_mb() - before < 64, f"peak memory grew {_peak_mb() - before:.0f} MiB"
        assert f"rank {b.world_size - 1} declares {claim}" in message, message


@check
def a_frozen_peer_fails_within_the_timeout(b) -> None:
    victim = b.rank == b.world_size - 1
    comm = b.comm.Dup()
    backend = MPIBackend(comm, timeout=2.0)
    if victim:
        time.sleep(6.0)  # frozen past the survivors' timeout, then back
        backend.allreduce(torch.ones(8)).wait()
    else:
        start = time.monotonic()
        message = _expect(CollectiveError, lambda: backend.allreduce(torch.ones(8)).wait(), "a frozen peer")
        took = time.monotonic() - start
        assert 1.9 < took < 5.0, f"raised after {took:.1f} s, timeout 2 s"
        assert "did not complete within 2 s" in message, message
        # MPI cannot cancel the abandoned allreduce: its buffer must stay held, or the victim's late
        # allreduce below writes into freed memory (the heap corruption this once caused at exit)
        assert len(backend._held) == 1 and backend._held[0][1][0].numel() == 8, backend._held
    comm.Barrier()  # (the late allreduce matches the survivors' abandoned one; the job goes on)
    if not victim:
        late = backend._held[0][1][0]
        deadline = time.monotonic() + 5.0
        while not backend._held[0][0].Test() and time.monotonic() < deadline:
            time.sleep(0.01)
        assert torch.equal(late, torch.full((8,), float(b.world_size))), late  # written into the held buffer
    backend.barrier()  # a new request releases the finished one
    req = backend._issue("barrier", comm.Ibarrier)
    assert all(not bufs for _, bufs in backend._held), backend._held
    backend._complete("barrier", req)


if __name__ == "__main__":
    main(__name__)
