"""The compressed reduce-scatter (gradwire.comm.reduce_scatter) on real gloo ranks, for every
kind of compressor: each rank's chunk equals the fp32 rank-order sum of what every rank's packet
for it decodes to, error feedback keeps what was not sent, non-finite input stays non-finite."""

from __future__ import annotations

import math

import torch

from multiproc import run_ranks

SPECS = ["fp16", "bf16", "fp8", "int8", "qsgd:bits=4", "terngrad", "sign", "topk:ratio=0.05",
         "topk:ratio=0.05,indices=raw", "dgc:ratio=0.05", "threshold:threshold=0.5", "randomk:ratio=0.1",
         "topk:ratio=0.05+int8", "int8+zstd"]
SIZES = [(40, 3), (7,), (300,)]  # per-destination shard shapes: a matrix, a tiny bias, a vector


def _segments():
    from gradwire.comm.base import Segment

    out, offset = [], 0
    for i, shape in enumerate(SIZES):
        n = math.prod(shape)
        out.append(Segment(f"p{i}", offset, n))
        offset += n
    return out, offset


def _inputs(rank: int, world: int, chunk: int, step: int, dtype: torch.dtype) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 * step + rank)
    return torch.randn(world * chunk, generator=g).to(dtype)


def _expected(spec: str, world: int, rank: int, chunk: int, segs, step: int, dtype) -> torch.Tensor:
    """What rank `rank` must get without error feedback: every sender's packets, decoded, fp32, in rank order."""
    from dataclasses import replace

    from gradwire.comm.base import worth_compressing
    from gradwire.compress import Ctx, compressor

    c, raw = compressor(spec), compressor("none")
    total = torch.zeros(chunk, dtype=torch.float32)
    for r in range(world):
        part = _inputs(r, world, chunk, step, dtype).view(world, chunk)[rank]
        for seg in segs:
            key = f"{seg.key}/{rank}"
            use = c if worth_compressing(c, seg.numel, dtype) else raw
            ctx = replace(Ctx(seed=3, step=step, rank=r), key=Ctx.key_of(key))
            seg.of(total).add_(use.decode(use.encode(seg.of(part), ctx)).float())
    return total


def _exact(rank: int, world: int) -> dict:
    from gradwire.comm.reduce_scatter import AlltoallReduceScatter
    from gradwire.comm.torch_dist import TorchDistBackend
    from gradwire.compress import Ctx

    segs, chunk = _segments()
    backend = TorchDistBackend()
    bad = []
    for dtype in (torch.float32, torch.bfloat16):
        for spec in SPECS:
            rs = AlltoallReduceScatter(backend, spec, error_feedback=False)
            for step in range(2):
                x = _inputs(rank, world, chunk, step, dtype)
                got = rs.reduce_scatter(x, segs, Ctx(seed=3, step=step, rank=rank), average=True).wait()
                want = _expected(spec, world, rank, chunk, segs, step, dtype).div_(world)
                if got.dtype != torch.float32 or not torch.equal(got, want):
                    bad.append((spec, str(dtype), step))
            stats = rs.take_stats()
            if stats.bytes_sent <= 0 or stats.bytes_received <= 0:
                bad.append((spec, "stats"))
    return {"bad": bad}


def test_every_compressor_sums_decoded_packets_in_rank_order():
    for r in run_ranks(_exact, 3, timeout=300):
        assert r["bad"] == []


def _feedback(rank: int, world: int) -> dict:
    """With error feedback, what was sent plus what is kept equals everything that came in."""
    from gradwire.comm.reduce_scatter import AlltoallReduceScatter
    from gradwire.comm.torch_dist import TorchDistBackend
    from gradwire.compress import Ctx

    segs, chunk = _segments()
    rs = AlltoallReduceScatter(TorchDistBackend(), "topk:ratio=0.05", error_feedback=True)
    sent = torch.zeros(chunk, dtype=torch.float64)
    mine = torch.zeros(world * chunk, dtype=torch.float64)
    for step in range(3):
        x = _inputs(rank, world, chunk, step, torch.float32)
        mine += x.double()
        sent += rs.reduce_scatter(x, segs, Ctx(step=step, rank=rank)).wait().double()
    residuals = rs.state_dict()["feedback"]["residuals"]
    kept = torch.zeros(world * chunk, dtype=torch.float64).view(world, chunk)
    for j in range(world):
        for seg in segs:
            if f"{seg.key}/{j}" in residuals:
                seg.of(kept[j]).copy_(residuals[f"{seg.key}/{j}"].double())
    nan_x = _inputs(rank, world, chunk, 9, torch.float32)
    if rank == 1:
        nan_x[0] = float("nan")  # rank 0's chunk, first (compressed) segment
    nan_out = rs.reduce_scatter(nan_x, segs, Ctx(step=9, rank=rank)).wait()
    return {"sent": sent, "mine": mine, "kept": kept.reshape(-1), "keys": sorted(residuals),
            "nonfinite": not bool(torch.isfinite(nan_out).all())}


def test_error_feedback_keeps_what_was_not_sent_and_nan_reaches_its_chunk():
    results = run_ranks(_feedback, 2, timeout=300)
    world, (_, chunk) = 2, _segments()
    total_in = sum(r["mine"] for r in results).view(world, chunk)
    total_kept = sum(r["kept"] for r in results).view(world, chunk)
    for j, r in enumerate(results):
        assert torch.allclose(r["sent"] + total_kept[j], total_in[j], atol=1e-4)
        assert not torch.allclose(r["sent"], total_in[j], atol=1e-2)  # top-k really dropped something
        assert r["keys"] == [f"p{i}/{d}" for i in (0, 2) for d in range(world)]  # the 7-element bias goes raw
    assert results[0]["nonfinite"] and not results[1]["nonfinite"]


def _bad(rank: int, world: int) -> str:
    from gradwire.comm.reduce_scatter import AlltoallReduceScatter
    from gradwire.comm.torch_dist import TorchDistBackend
    from gradwire.compress import Ctx

    segs, chunk = _segments()
    rs = AlltoallReduceScatter(TorchDistBackend(), "int8")
    try:
        rs.reduce_scatter(torch.zeros(world * chunk + 1), segs, Ctx())
    except ValueError as e:
        return str(e)
    return "no error"


def test_input_that_is_not_world_chunks_is_refused():
    for msg in run_ranks(_bad, 2, timeout=120):
        assert "is not 2 chunks" in msg
