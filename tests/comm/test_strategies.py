"""Strategy details on a real 2-rank gloo group."""

import pytest
import torch

import gradwire
from gradwire import Ctx
from gradwire.comm.registry import make_strategy
from gradwire.comm.base import split_message
from gradwire.comm.torch_dist import TorchDistBackend
from multiproc import run_ranks


def _small_and_mixed(rank: int, world: int) -> dict:
    backend = TorchDistBackend()
    s = make_strategy("allgather", backend, "topk:ratio=0.1")
    tiny = torch.full((4,), float(rank + 1))  # a topk packet of 4 elements is bigger than 16 bytes
    out = {"tiny": s.exchange(tiny, "tiny", Ctx(rank=rank), average=True).wait()}
    out["tiny_stats"] = s.take_stats().as_dict()
    mixed = torch.randn(2000 + 4, generator=torch.Generator().manual_seed(rank))
    out["mixed"] = s.exchange(mixed, "m", Ctx(rank=rank), shapes=[torch.Size([2000]), torch.Size([4])],
                              keys=["w", "b"]).wait()
    out["mixed_input"] = mixed
    out["mixed_stats"] = s.take_stats().as_dict()
    return out


def test_uncompressible_bucket_is_allreduced_and_small_segments_travel_raw():
    a, b = run_ranks(_small_and_mixed, 2)
    assert torch.equal(a["tiny"], torch.full((4,), 1.5)) and torch.equal(a["tiny"], b["tiny"])
    assert a["tiny_stats"]["buckets"] == {"tiny": "dense"} and a["tiny_stats"]["bytes_sent"] == 16
    # the 4-element segment is summed exactly; the 2000-element one is compressed
    assert torch.equal(a["mixed"][2000:], a["mixed_input"][2000:] + b["mixed_input"][2000:])
    assert torch.equal(a["mixed"], b["mixed"])
    assert (a["mixed"][:2000] != 0).sum() <= 2 * 200
    assert a["mixed_stats"]["bytes_sent"] < a["mixed_stats"]["dense_bytes"] / 3


def test_split_message_rejects_bad_length_tables():
    packets = [torch.arange(5, dtype=torch.uint8), torch.arange(3, dtype=torch.uint8)]
    message = torch.cat([torch.tensor([5, 3]).view(torch.uint8)] + packets)
    assert [p.tolist() for p in split_message(message, 2)] == [p.tolist() for p in packets]
    with pytest.raises(gradwire.WireFormatError):
        split_message(message[:-1], 2)
    with pytest.raises(gradwire.WireFormatError):
        split_message(message[:10], 2)
    bad = message.clone()
    bad[:8] = torch.tensor([-1]).view(torch.uint8)
    with pytest.raises(gradwire.WireFormatError):
        split_message(bad, 2)


def _min_numel(rank: int, world: int) -> dict:
    s = make_strategy("allgather", TorchDistBackend(), "topk:ratio=0.01", min_numel=1000)
    x = torch.randn(5000 + 500, generator=torch.Generator().manual_seed(rank))
    out = s.exchange(x, "b", Ctx(rank=rank), shapes=[torch.Size([5000]), torch.Size([500])], keys=["w", "bias"]).wait()
    return {"x": x, "out": out, "stats": s.take_stats().as_dict()}


def test_segments_under_min_numel_travel_uncompressed():
    a, b = run_ranks(_min_numel, 2)
    # a 500-element segment would compress 1% top-k fine, but it is under min_numel: summed exactly
    assert torch.equal(a["out"][5000:], a["x"][5000:] + b["x"][5000:])
    assert (a["out"][:5000] != 0).sum() <= 2 * 50  # the big one still top-k'd
    assert torch.equal(a["out"], b["out"])
    assert 2000 < a["stats"]["bytes_sent"] < 2000 + 5000 * 4 / 10


def test_strategy_options_are_checked():
    # each check fails before the backend is touched
    with pytest.raises(ValueError, match="takes min_numel"):
        make_strategy("allgather", None, "topk", rank=2)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="min_numel must be >= 0"):
        make_strategy("allgather", None, "topk", min_numel=-1)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="takes no options"):
        make_strategy("allreduce", None, "fp16", min_numel=10)  # type: ignore[arg-type]


RANDOMK = "randomk:ratio=0.01"
RANDOMK_SEGMENTS = [("w", 30_000), ("b", 5_000)]


def _randomk_both_ways(rank: int, world: int) -> dict:
    backend = TorchDistBackend()
    x = torch.randn(35_000, generator=torch.Generator().manual_seed(rank))
    shapes, keys = [torch.Size([n]) for _, n in RANDOMK_SEGMENTS], [k for k, _ in RANDOMK_SEGMENTS]
    ctx = Ctx(seed=5, step=3, rank=rank)  # the rank differs, the drawn positions must not
    out = {"x": x}
    for name in ("allgather", "allreduce"):
        s = make_strategy(name, backend, RANDOMK, error_feedback=False)
        out[name] = s.exchange(x.clone(), "bucket", ctx, average=True, shapes=shapes, keys=keys).wait()
        out[name + "_stats"] = s.take_stats().as_dict()
    return out


def test_randomk_allgather_packets_carry_no_indices_and_decode_on_every_rank():
    ranks = run_ranks(_randomk_both_ways, 2)
    c = gradwire.compressor(RANDOMK)
    # The oracle, in this (third) process: every rank's packet decoded and summed in rank order.
    want = torch.zeros(35_000)
    offset = 0
    for key, n in RANDOMK_SEGMENTS:
        for r, got in enumerate(ranks):
            packet = c.encode(got["x"][offset: offset + n], Ctx(seed=5, step=3, rank=r, key=Ctx.key_of(key)))
            want[offset: offset + n] += c.decode(packet.tensor())
        offset += n
    want /= 2
    a, b = ranks
    assert torch.equal(a["allgather"], want) and torch.equal(b["allgather"], want)
    # the summable allreduce path draws the same positions (its sums round differently)
    assert torch.equal(a["allreduce"] != 0, want != 0) and int((want != 0).sum()) == 300 + 50
    torch.testing.assert_close(a["allreduce"], want, rtol=1e-6, atol=1e-4)  # values ~100: a few ulps
    # on the wire: a length table and each segment's key, values and sentinel; no indices
    sizes = [c.static_size(n, torch.float32) for _, n in RANDOMK_SEGMENTS]
    assert sizes == [80 + 8 + 1200 + 8, 80 + 8 + 200 + 8]
    assert a["allgather_stats"]["bytes_sent"] == 8 * 2 + sum(sizes)
    assert a["allreduce_stats"]["bytes_sent"] == 4 * (300 + 50)
