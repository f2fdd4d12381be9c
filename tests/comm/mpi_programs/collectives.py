"""MPIBackend collectives: every rank checks the result against a reference built from
all ranks' known inputs.  mpiexec -n 4 python tests/comm/mpi_programs/collectives.py"""

from __future__ import annotations

import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _harness import bits_equal, check, main, same_on_all_ranks  # noqa: E402

FLOATS = (torch.float32, torch.float64, torch.float16, torch.bfloat16)
INTS = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def contribution(rank: int, n: int, dtype: torch.dtype) -> torch.Tensor:
    """rank's input: multiples of 1/16 (floats) so every partial sum is exact in float32."""
    g = torch.Generator().manual_seed(1000 + rank)
    if dtype.is_floating_point:
        x = torch.randint(-64, 64, (n,), generator=g).double() / 16
        if n:
            x[0] = 2048.0 if rank == 0 else 1.5  # half accumulation would round; float32 must not
        return x.to(dtype)
    if dtype in (torch.uint8, torch.int8, torch.int16):  # sums overflow: they must wrap, not saturate
        info = torch.iinfo(dtype)
        return torch.randint(max(info.min, -30000), info.max, (n,), generator=g).to(dtype)
    return torch.randint(-100, 100, (n,), generator=g).to(dtype)


@check
def allreduce_dtypes(b) -> None:
    for dtype in FLOATS + INTS:
        for n in (0, 1, 37, 100):  # >= 32: Open MPI's vectorized (AVX) reduction path
            t = contribution(b.rank, n, dtype)
            out = b.allreduce(t).wait()
            assert out.data_ptr() == t.data_ptr() or n == 0, "allreduce must write into its input"
            parts = [contribution(r, n, dtype) for r in range(b.world_size)]
            if dtype.is_floating_point:  # exact sum (float64), rounded once
                ref = torch.stack([p.double() for p in parts]).sum(0).to(dtype)
            else:  # C integer arithmetic: wraps
                ref = torch.stack([p.long() for p in parts]).sum(0)
                info = torch.iinfo(dtype)
                span = info.max - info.min + 1
                if info.bits < 64:
                    ref = (ref - info.min) % span + info.min  # exact modular wrap-around
                ref = ref.to(dtype)
            bits_equal(out, ref, f"allreduce {dtype} n={n}")
            same_on_all_ranks(b, f"allreduce {dtype}", out)


@check
def allreduce_rejects_bool(b) -> None:
    try:
        b.allreduce(torch.ones(3, dtype=torch.bool))
    except TypeError:
        return
    raise AssertionError("allreduce of bool should raise TypeError")


@check
def allgatherv_unequal_counts(b) -> None:
    world = b.world_size
    for dtype in (torch.float32, torch.bfloat16, torch.float16, torch.uint8, torch.int64):
        for counts in ([3 * r for r in range(world)],               # rank 0 sends nothing
                       [0] * world,                                   # nobody sends anything
                       [5 if r == world - 1 else 0 for r in range(world)],
                       [7 - r for r in range(world)]):                # odd byte offsets
            mine = contribution(b.rank, counts[b.rank], dtype)
            parts = b.allgatherv(mine, max(counts)).wait()
            assert len(parts) == world
            for r, p in enumerate(parts):
                bits_equal(p, contribution(r, counts[r], dtype), f"allgatherv {dtype} counts={counts} part {r}")


@check
def allgatherv_dtype_mismatch_raises_everywhere(b) -> None:
    t = torch.zeros(2, dtype=torch.float32 if b.rank == 0 else torch.float16)
    try:
        b.allgatherv(t, 2)
    except ValueError as e:
        assert "dtype" in str(e), e
        return
    raise AssertionError("allgatherv with different dtypes should raise on every rank")


def alltoall_count(src: int, dst: int) -> int:
    """How many elements src sends to dst: zeros, odd byte offsets and one large chunk."""
    return 0 if (src + dst) % 3 == 0 else 1000 if src == dst == 1 else 2 * src + dst + 1


def alltoall_chunk(src: int, dst: int, dtype: torch.dtype) -> torch.Tensor:
    return contribution(100 * src + dst, alltoall_count(src, dst), dtype)


@check
def alltoall_unequal_counts(b) -> None:
    world = b.world_size
    for dtype in (torch.float32, torch.bfloat16, torch.uint8, torch.int64):
        chunks = [alltoall_chunk(b.rank, dst, dtype) for dst in range(world)]
        for recv_counts in (None, [alltoall_count(src, b.rank) for src in range(world)]):  # exchanged, static
            parts = b.alltoall(chunks, recv_counts, max_recv=1000).wait()
            assert len(parts) == world
            for src, p in enumerate(parts):
                bits_equal(p, alltoall_chunk(src, b.rank, dtype), f"alltoall {dtype} from {src}")


@check
def alltoall_dtype_mismatch_raises_everywhere(b) -> None:
    dtype = torch.float32 if b.rank == 0 else torch.float16
    try:
        b.alltoall([torch.zeros(2, dtype=dtype) for _ in range(b.world_size)], max_recv=2)
    except ValueError as e:
        assert "dtype" in str(e), e
        return
    raise AssertionError("alltoall with different dtypes should raise on every rank")


@check
def allgather_equal_counts(b) -> None:
    for dtype in (torch.float16, torch.int32):
        parts = b.allgather(contribution(b.rank, 11, dtype)).wait()
        for r, p in enumerate(parts):
            bits_equal(p, contribution(r, 11, dtype), f"allgather {dtype} part {r}")


@check
def broadcast_basics(b) -> None:
    src = b.world_size - 1
    for dtype in (torch.float32, torch.bfloat16, torch.int64, torch.uint8):
        for n in (0, 1, 29):
            t = contribution(b.rank, n, dtype)
            out = b.broadcast(t, src).wait()
            assert out is t
            bits_equal(t, contribution(src, n, dtype), f"broadcast {dtype} n={n}")
    m = contribution(b.rank, 12, torch.float32).view(3, 4).t()  # not contiguous
    b.broadcast(m, 0).wait()
    bits_equal(m, contribution(0, 12, torch.float32).view(3, 4).t(), "broadcast non-contiguous")


@check
def nonblocking_waits_in_any_order(b) -> None:
    """Issue three collectives before waiting; wait for them in reverse order."""
    world = b.world_size
    x = torch.full((1000,), float(b.rank + 1))
    y = contribution(b.rank, b.rank, torch.float32)
    z = torch.arange(8, dtype=torch.int64) * (b.rank + 1)
    wx, wy, wz = b.allreduce(x), b.allgatherv(y, 1 << 20), b.broadcast(z, 0)
    bits_equal(wz.wait(), torch.arange(8, dtype=torch.int64), "broadcast (waited first)")
    for r, p in enumerate(wy.wait()):
        bits_equal(p, contribution(r, r, torch.float32), f"allgatherv part {r}")
    bits_equal(wx.wait(), torch.full((1000,), float(world * (world + 1) // 2)), "allreduce (waited last)")
    w = b.allreduce(torch.ones(4)).then(lambda t: t * 2)
    bits_equal(w.wait(), torch.full((4,), 2.0 * world), "Work.then")


if __name__ == "__main__":
    main(__name__)


@check
def compressed_reduce_scatter(b) -> None:
    """gradwire.comm.reduce_scatter over MPI: rank j's chunk is the fp32 rank-order sum of every
    rank's packets for it, decoded (the same exchange the FSDP hook runs over gloo/NCCL)."""
    from dataclasses import replace

    from gradwire.comm.reduce_scatter import AlltoallReduceScatter
    from gradwire.comm.base import Segment
    from gradwire.compress import Ctx, compressor

    segs = [Segment("w", 0, 96), Segment("v", 96, 200)]
    chunk = 296

    def grad(rank: int) -> torch.Tensor:
        return torch.randn(b.world_size * chunk, generator=torch.Generator().manual_seed(50 + rank))

    for spec in ("int8", "topk:ratio=0.05"):  # static sizes, then sizes exchanged first
        got = AlltoallReduceScatter(b, spec, error_feedback=False).reduce_scatter(
            grad(b.rank), segs, Ctx(seed=1, rank=b.rank), average=True).wait()
        c, want = compressor(spec), torch.zeros(chunk)
        for r in range(b.world_size):
            part = grad(r).view(b.world_size, chunk)[b.rank]
            for s in segs:
                ctx = replace(Ctx(seed=1, rank=r), key=Ctx.key_of(f"{s.key}/{b.rank}"))
                s.of(want).add_(c.decode(c.encode(s.of(part), ctx)))
        bits_equal(got, want.div_(b.world_size), f"{spec} reduce-scatter")
