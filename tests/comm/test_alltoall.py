"""`Backend.alltoall` over torch.distributed on real gloo process groups (MPI: mpi_programs/collectives.py)."""

from __future__ import annotations

import pytest
import torch

from gradwire.comm.torch_dist import TorchDistBackend
from multiproc import run_ranks


def count(src: int, dst: int) -> int:
    return 0 if (src + dst) % 3 == 0 else 1000 if src == dst == 1 else 2 * src + dst + 1


def chunk(src: int, dst: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(100 * src + dst)
    return (torch.randint(-50, 50, (count(src, dst),), generator=g)).to(dtype)


def _exchange(rank: int, world: int) -> dict:
    b = TorchDistBackend()
    out: dict = {}
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
        chunks = [chunk(rank, dst, dtype) for dst in range(world)]
        out[str(dtype)] = b.alltoall(chunks, max_recv=1000).wait()
        out[f"{dtype} static"] = b.alltoall(chunks, [count(src, rank) for src in range(world)]).wait()
    try:
        b.alltoall([torch.zeros(2)] * (world + 1))
    except ValueError as e:
        out["wrong chunk count"] = str(e)
    dtype = torch.float32 if rank == 0 else torch.float16
    try:
        b.alltoall([torch.zeros(2, dtype=dtype) for _ in range(world)], max_recv=2)
    except ValueError as e:
        out["dtype mismatch"] = str(e)
    return out


@pytest.mark.parametrize("world", [2, 3, 4])
def test_alltoall_delivers_every_chunk_and_rejects_bad_calls_on_every_rank(world: int) -> None:
    for rank, out in enumerate(run_ranks(_exchange, world)):
        for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
            for key in (str(dtype), f"{dtype} static"):
                parts = out[key]
                assert len(parts) == world
                for src, p in enumerate(parts):
                    assert p.dtype == dtype and torch.equal(p, chunk(src, rank, dtype)), (key, src)
        assert "one chunk per rank" in out["wrong chunk count"]
        assert "different dtypes" in out["dtype mismatch"]
