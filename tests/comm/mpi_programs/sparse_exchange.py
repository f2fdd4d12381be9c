"""sparse_allgather over MPI: unequal counts (a rank sending nothing, one sending every
index), dense and merged results equal to a reference built from all ranks' known inputs,
bit-identical on every rank; bad input raises on every rank.
mpiexec -n 4 python tests/comm/mpi_programs/sparse_exchange.py"""

from __future__ import annotations

import os
import sys

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import bits_equal, check, main, same_on_all_ranks  # noqa: E402

from gradwire import WireFormatError  # noqa: E402
from gradwire.comm.sparse_exchange import sparse_allgather  # noqa: E402

NUMEL = 1000
DTYPES = (torch.float32, torch.float16, torch.bfloat16, torch.float64)


def pairs(scenario: str, rank: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """rank's (indices, values) in a scenario; any rank can rebuild any other rank's."""
    g = torch.Generator().manual_seed(sum(map(ord, scenario)) * 131 + rank)
    if scenario == "edge":  # rank 0: nothing; rank 1: every index; others: duplicates, odd counts
        if rank == 0:
            idx = torch.empty(0, dtype=torch.int64)
        elif rank == 1:
            idx = torch.randperm(NUMEL, generator=g)
        else:
            idx = torch.randint(0, NUMEL, (37 * rank + 1,), generator=g)
    elif scenario == "overlap":  # many ranks and repeats on few indices: multi-pass merging
        idx = torch.randint(0, 50, (53 * rank + 11,), generator=g)
    elif scenario == "empty":
        idx = torch.empty(0, dtype=torch.int64)
    else:
        raise ValueError(scenario)
    scale = 10.0 ** torch.randint(-3, 4, (idx.numel(),), generator=g)
    values = (torch.randn(idx.numel(), generator=g, dtype=torch.float64) * scale).to(dtype)
    return idx.to(torch.int32 if rank % 2 else torch.int64), values


def reference(scenario: str, world: int, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Dense sum, unique indices and their sums: a plain left-to-right loop in (rank, position)
    order, float32 accumulation for half types."""
    acc_np = np.float64 if dtype == torch.float64 else np.float32
    acc = np.zeros(NUMEL, dtype=acc_np)
    seen = set()
    for r in range(world):
        idx, val = pairs(scenario, r, dtype)
        for i, v in zip(idx.tolist(), val.to(torch.float64 if dtype == torch.float64 else torch.float32).tolist()):
            acc[i] = acc_np(acc[i] + acc_np(v))
            seen.add(i)
    dense = torch.from_numpy(acc).to(dtype)
    unique = torch.tensor(sorted(seen), dtype=torch.int64)
    return dense, unique, dense[unique]


@check
def sparse_allgather_matches_reference(b) -> None:
    for scenario in ("edge", "overlap", "empty"):
        for dtype in DTYPES:
            idx, val = pairs(scenario, b.rank, dtype)
            dense = sparse_allgather(b, idx, val, NUMEL).wait()
            unique, summed = sparse_allgather(b, idx, val, NUMEL, dense=False).wait()
            ref_dense, ref_unique, ref_summed = reference(scenario, b.world_size, dtype)
            what = f"{scenario} {dtype}"
            bits_equal(dense, ref_dense, f"dense {what}")
            bits_equal(unique, ref_unique, f"sparse indices {what}")
            bits_equal(summed, ref_summed, f"sparse values {what}")
            same_on_all_ranks(b, f"sparse_allgather {what}", dense, unique, summed)


@check
def sparse_allgather_nonblocking_pair(b) -> None:
    """Two exchanges in flight at once, waited in reverse order."""
    i1, v1 = pairs("edge", b.rank, torch.float32)
    i2, v2 = pairs("overlap", b.rank, torch.bfloat16)
    w1 = sparse_allgather(b, i1, v1, NUMEL)
    w2 = sparse_allgather(b, i2, v2, NUMEL, dense=False)
    u2, s2 = w2.wait()
    d1 = w1.wait()
    bits_equal(d1, reference("edge", b.world_size, torch.float32)[0], "edge float32 (waited second)")
    _, ru, rs = reference("overlap", b.world_size, torch.bfloat16)
    bits_equal(u2, ru, "overlap indices")
    bits_equal(s2, rs, "overlap values")


def _raises_everywhere(b, what: str, fn, *needles: str) -> None:
    try:
        fn()
    except WireFormatError as e:  # a peer's bad bytes raise this, and only this, on every rank
        for needle in needles:
            assert needle in str(e), f"{what}: {needle!r} not in {e}"
        return
    raise AssertionError(f"{what}: no WireFormatError on rank {b.rank}")


@check
def out_of_range_indices_raise_everywhere(b) -> None:
    last = b.world_size - 1
    idx = torch.tensor([0, 5, NUMEL if b.rank == last else 7])
    _raises_everywhere(b, "index == numel", lambda: sparse_allgather(b, idx, torch.ones(3), NUMEL).wait(),
                       f"rank {last}", f"index {NUMEL}", "out of range")
    idx = torch.tensor([-1 if b.rank == 0 else 3])
    _raises_everywhere(b, "negative index", lambda: sparse_allgather(b, idx, torch.ones(1), NUMEL, dense=False).wait(),
                       "rank 0", "index -1")


@check
def disagreements_raise_everywhere(b) -> None:
    numel = NUMEL + (1 if b.rank == b.world_size - 1 else 0)
    _raises_everywhere(b, "numel", lambda: sparse_allgather(b, torch.tensor([1]), torch.ones(1), numel).wait(),
                       "numel")
    dtype = torch.float16 if b.rank == 0 else torch.float32
    _raises_everywhere(b, "dtype", lambda: sparse_allgather(b, torch.tensor([1]), torch.ones(1, dtype=dtype),
                                                            NUMEL).wait(), "values of")


if __name__ == "__main__":
    main(__name__)
