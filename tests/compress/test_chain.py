"""Chains: `sparsifier [+ value stage] [+ lossless]` and `dense [+ lossless]`."""

from __future__ import annotations

import json

import pytest
import torch
import zstandard

import gradwire
from gradwire import Ctx, WireFormatError
from gradwire.compress import wire
from gradwire.compress.chain import Chain
from gradwire.compress.lossless import frame_content
from gradwire.compress.wire import FLOAT_DTYPES, Kind

from tensors import bits, randn

CTX = Ctx(seed=11, step=3, rank=1, key=5)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(1000,), (40, 25), (3,), (0,)])
def test_topk_plus_fp16(dtype, shape):
    chain = gradwire.compressor("topk:ratio=0.01+fp16")
    topk = gradwire.compressor("topk:ratio=0.01")
    x = randn(shape, dtype, seed=1)
    packet = chain.encode(x, CTX)
    assert packet.codec == topk.codec_id and packet.config == chain.crc
    assert Kind.NESTED in packet.kinds() and Kind.VALUES not in packet.kinds()
    nested = wire.parse(packet.section(Kind.NESTED))
    assert nested.codec == 2 and nested.dtype == dtype and nested.config == gradwire.compressor("fp16").crc
    y = chain.decode(packet.tensor())
    assert y.shape == x.shape and y.dtype == dtype
    want = topk.decode(topk.encode(x, CTX))
    assert torch.equal(y, want.to(torch.float16).to(dtype)), "values are the top-k values cast through fp16"
    k = topk.value_count(x.numel())
    assert nested.numel == k and int((y != 0).sum()) <= k
    size = chain.static_size(x.numel(), dtype, shape)
    if size is not None:
        assert size == packet.nbytes
    # the VALUES section is replaced by a whole fp16 packet of the k values
    plain = topk.encode(x, CTX)
    values_fp16 = gradwire.compressor("fp16").encode(plain.section(Kind.VALUES))
    assert packet.nbytes == plain.nbytes - wire.align(plain.section(Kind.VALUES).numel() * x.element_size()) \
        + values_fp16.nbytes
    assert torch.equal(packet.section(Kind.NESTED), values_fp16.tensor())


def test_topk_qsgd_zstd_is_the_lossless_wrap_of_topk_qsgd():
    chain = gradwire.compressor("topk:ratio=0.05+qsgd:bits=4+zstd")
    plain = gradwire.compressor("topk:ratio=0.05+qsgd:bits=4")
    x = randn((64, 50), seed=2)
    packet = chain.encode(x, CTX)
    assert packet.codec == 14 and packet.kinds() == [Kind.FRAME] and packet.config == chain.crc
    assert packet.shape == x.shape and packet.dtype == x.dtype
    inner = chain.lossless.unwrap(wire.parse(packet.tensor()))
    reference = plain.encode(x, CTX)
    # zstd is lossless: the wrapped packet is the topk+qsgd packet, under the first stage's checksum
    assert inner.config == chain.first.crc and reference.config == plain.crc
    inner.config = plain.crc
    inner._buffer = None
    assert torch.equal(inner.tensor(), reference.tensor())
    y = chain.decode(packet.tensor())
    assert torch.equal(bits(y), bits(plain.decode(reference.tensor())))
    support = gradwire.compressor("topk:ratio=0.05").decode(gradwire.compressor("topk:ratio=0.05").encode(x)) != 0
    assert not (y != 0)[~support].any(), "qsgd may zero values, never invent positions"
    assert (y != 0).sum() > 0
    out = torch.full(x.shape, 9.0)
    assert chain.decode(packet.tensor(), out=out) is out and torch.equal(out, y)


@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
def test_fp16_plus_zstd(dtype):
    chain = gradwire.compressor("fp16+zstd")
    assert isinstance(chain, Chain) and chain.lossless is not None and chain.value_stage is None
    x = randn((33, 7), dtype, seed=3)
    x[0, 0] = float("nan")
    packet = chain.encode(x)
    assert packet.codec == 14 and packet.config == chain.crc and packet.shape == (33, 7)
    y = chain.decode(packet.tensor())
    assert y.dtype == dtype and torch.equal(bits(y), bits(gradwire.compressor("fp16").decode(
        gradwire.compressor("fp16").encode(x))))
    assert chain.static_size(x.numel(), dtype) is None and not chain.summable
    with pytest.raises(TypeError, match="not summable"):
        chain.to_summable(x)


def test_randomk_plus_fp16_is_summable():
    chain = gradwire.compressor("randomk:ratio=0.1+fp16")
    randomk = gradwire.compressor("randomk:ratio=0.1")
    assert chain.summable and randomk.summable
    x = randn(2000, seed=4)
    y = chain.decode(chain.encode(x, CTX).tensor())
    plain = randomk.encode(x, CTX)  # the same samples, with their values cast through fp16 before scaling
    cast = [wire.Section(s.kind, s.data.half().float() if s.kind == Kind.VALUES else s.data) for s in plain.sections]
    want = randomk.decode(wire.Packet(plain.codec, plain.dtype, plain.shape, cast, plain.config))
    assert torch.equal(y, want)
    assert 150 <= int((y != 0).sum()) <= 200
    # allreduce: the element-wise sum of every rank's payload decodes to the sum of what each sent
    ranks = [randn(2000, seed=10 + r) for r in range(4)]
    payloads = [chain.to_summable(g, Ctx(seed=11, step=3, rank=r, key=5)) for r, g in enumerate(ranks)]
    assert all(p.dtype == torch.float16 and p.shape == payloads[0].shape for p in payloads)
    total = chain.from_summable(torch.stack(payloads).sum(0), ranks[0], Ctx(seed=11, step=3, rank=0, key=5))
    decoded = [chain.decode(chain.encode(g, Ctx(seed=11, step=3, rank=r, key=5))) for r, g in enumerate(ranks)]
    assert total.shape == ranks[0].shape
    torch.testing.assert_close(total, torch.stack(decoded).sum(0), atol=1e-2, rtol=1e-3)
    positions = [d != 0 for d in decoded]
    assert all(torch.equal(p, positions[0]) for p in positions), "summable randomk shares indices across ranks"


@pytest.mark.parametrize("spec, message", [
    ("zstd+topk", "zstd is lossless and must be the last stage"),
    ("zstd+fp16", "zstd is lossless and must be the last stage"),
    ("qsgd+topk", "topk can only follow a sparsifier .* not qsgd"),
    ("fp16+int8", "int8 can only follow a sparsifier .* not fp16"),
    ("topk+randomk", "randomk cannot quantize a sparsifier's values"),
    ("topk+fp16+bf16", "one value stage after a sparsifier"),
    ("topk+fp16+bf16+zstd", "one value stage after a sparsifier"),
])
def test_invalid_chains(spec, message):
    with pytest.raises(ValueError, match=message):
        gradwire.compressor(spec)


def test_a_chain_needs_two_stages():
    with pytest.raises(ValueError, match="at least two stages"):
        Chain([gradwire.compressor("fp16")])


@pytest.mark.parametrize("sender, receiver", [
    ("topk:ratio=0.01+fp16", "topk:ratio=0.02+fp16"),
    ("topk:ratio=0.01+fp16", "topk:ratio=0.01+bf16"),
    ("topk:ratio=0.01+fp16", "topk:ratio=0.01"),
    ("topk:ratio=0.01", "topk:ratio=0.01+fp16"),
    ("topk:ratio=0.01+fp16", "randomk:ratio=0.01+fp16"),
    ("topk:ratio=0.05+qsgd:bits=4+zstd", "topk:ratio=0.05+qsgd:bits=8+zstd"),
    ("topk:ratio=0.05+qsgd:bits=4+zstd", "topk:ratio=0.05+qsgd:bits=4+zstd:level=9"),
    ("topk:ratio=0.05+qsgd:bits=4+zstd", "topk:ratio=0.05+qsgd:bits=4"),
    ("topk:ratio=0.05+qsgd:bits=4", "topk:ratio=0.05+qsgd:bits=4+zstd"),
    ("fp16+zstd", "fp16+zstd:level=5"),
    ("fp16+zstd", "bf16+zstd"),
    ("fp16+zstd", "zstd"),
    ("zstd", "fp16+zstd"),
    ("fp16+zstd", "fp16"),
    ("fp16", "fp16+zstd"),
    ("none", "zstd"),
])
def test_packets_from_another_config_are_rejected(sender, receiver):
    a, b = gradwire.compressor(sender), gradwire.compressor(receiver)
    packet = a.encode(randn(500, seed=5), CTX)
    with pytest.raises(WireFormatError):
        b.decode(packet.tensor())
    assert a.decode(packet.tensor()).shape == (500,)


def test_inner_stage_checksums_are_checked():
    """A frame or nested packet whose inner config is not the chain's stage is rejected."""
    chain = gradwire.compressor("fp16+zstd")
    foreign = chain.lossless.wrap(gradwire.compressor("bf16").encode(randn(10)))  # right outer, wrong inner
    foreign.config, foreign._buffer = chain.crc, None
    with pytest.raises(WireFormatError, match="codec id"):
        chain.decode(foreign.tensor())
    inner = gradwire.compressor("fp16").encode(randn(10))
    inner.config, inner._buffer = 12345, None
    forged = chain.lossless.wrap(inner)
    forged.config, forged._buffer = chain.crc, None
    with pytest.raises(WireFormatError, match="config checksum"):
        chain.decode(forged.tensor())
    reshaped = chain.lossless.wrap(gradwire.compressor("fp16").encode(randn(10)))
    reshaped.shape, reshaped.config, reshaped._buffer = (2, 5), chain.crc, None
    with pytest.raises(WireFormatError, match="declares|disagrees"):
        chain.decode(reshaped.tensor())


def test_nested_values_are_checked():
    chain = gradwire.compressor("topk:ratio=0.1+fp16")
    x = randn(100, seed=6)
    packet = chain.encode(x)
    sections = list(packet.sections)
    i = packet.kinds().index(Kind.NESTED)
    for bad_inner in (gradwire.compressor("bf16").encode(randn(10)),           # another value stage
                      gradwire.compressor("fp16").encode(randn(11)),           # wrong count
                      gradwire.compressor("fp16").encode(randn((2, 5))),       # not 1-D
                      gradwire.compressor("fp16").encode(randn(10, torch.bfloat16))):  # wrong dtype
        sections[i] = wire.Section(Kind.NESTED, bad_inner.tensor())
        forged = wire.Packet(packet.codec, packet.dtype, packet.shape, sections, packet.config)
        with pytest.raises(WireFormatError):
            chain.decode(forged.tensor())


@pytest.mark.parametrize("spec, count", [("topk:ratio=0.1+fp16", 11), ("topk:ratio=0.1+qsgd:bits=4", 1000),
                                         ("threshold:threshold=0.5+int8", 101)])
def test_nested_count_is_checked_before_the_value_stage_decodes(spec, count, monkeypatch):
    """A forged nested packet may not make the value stage allocate more than the tensor holds."""
    chain = gradwire.compressor(spec)
    packet = chain.encode(randn(100, seed=8), CTX)
    sections = list(packet.sections)
    i = packet.kinds().index(Kind.NESTED)
    inner = chain.value_stage.encode(randn(count, seed=9), CTX)
    sections[i] = wire.Section(Kind.NESTED, inner.tensor())
    forged = wire.Packet(packet.codec, packet.dtype, packet.shape, sections, packet.config)
    calls = []
    monkeypatch.setattr(type(chain.value_stage), "_decode", lambda self, pk: calls.append(pk.numel))
    with pytest.raises(WireFormatError, match="nested"):
        chain.decode(forged.tensor())
    assert calls == [], "the nested packet was decoded before its count was checked"


@pytest.mark.parametrize("spec", ["topk:ratio=0.1+fp16", "threshold:threshold=0.5+int8", "randomk:ratio=0.1+fp16"])
def test_outer_packet_is_checked_before_the_value_stage_decodes(spec, monkeypatch):
    """An out-of-range outer index (randomk: a malformed key), unknown flags or a wrong shape
    fail before the nested stage runs."""
    chain = gradwire.compressor(spec)
    packet = chain.encode(randn(100, seed=8), CTX)
    sections = list(packet.sections)
    if chain.first.name == "randomk":  # no indices: any int64 key is valid, two are not
        idx, message = torch.cat([sections[0].data, sections[0].data]), "META"
    else:
        idx, message = sections[0].data.clone(), "INDICES"
        idx[-1] = 100
    bad_index = wire.Packet(packet.codec, packet.dtype, packet.shape, [wire.Section(sections[0].kind, idx)] +
                            sections[1:], packet.config)
    flagged = wire.Packet(packet.codec, packet.dtype, packet.shape, sections, packet.config, flags=0x40)
    calls = []
    monkeypatch.setattr(type(chain.value_stage), "_decode", lambda self, pk: calls.append(pk.numel))
    for bad, message in ((bad_index, message), (flagged, "flag bits")):
        with pytest.raises(WireFormatError, match=message):
            chain.decode(bad.tensor())
    with pytest.raises(WireFormatError, match="receiver expects"):
        chain.decode(packet.tensor(), shape=(10, 10))
    assert calls == [], "the nested packet was decoded before the outer one was checked"


@pytest.mark.parametrize("spec, exact", [("topk:k=5,indices=raw+zstd", True), ("topk:k=5,indices=raw+fp16+zstd", True),
                                         ("threshold:threshold=0.5+zstd", False), ("topk:k=5+int8+zstd", False),
                                         ("fp16+zstd", True), ("int8+zstd", True)])
def test_lossless_content_limit_is_the_largest_inner_packet(spec, exact):
    chain = gradwire.compressor(spec)
    for shape in ((100,), (10, 10), (3,)):
        x = randn(shape, seed=2)
        limit, is_exact = chain.content_limit(x.numel(), x.dtype, len(shape))
        assert is_exact == exact
        p = chain.encode(x, CTX)
        inner = chain.lossless.unwrap(p)
        content = frame_content(inner).numel()
        assert content == limit if exact else content <= limit
        if exact:  # one byte more declared than the stages write: rejected from the frame header
            frame = zstandard.ZstdCompressor(write_checksum=True).compress(
                bytes(frame_content(inner).numpy()) + b"\0")
            forged = wire.Packet(p.codec, p.dtype, p.shape, [wire.Section(Kind.FRAME, torch.frombuffer(
                bytearray(frame), dtype=torch.uint8))], p.config)
            with pytest.raises(WireFormatError, match="declares"):
                chain.decode(forged.tensor())
    # the worst case of a data-dependent count: every element kept
    thr = gradwire.compressor("threshold:threshold=1e-9,indices=packed+zstd")
    x = randn(1000, seed=3)
    content = frame_content(thr.lossless.unwrap(thr.encode(x))).numel()
    assert content <= thr.content_limit(1000, x.dtype, 1)[0]


SPECS = {"topk:ratio=0.01+fp16": "topk+fp16", "topk:ratio=0.05+qsgd:bits=4+zstd": None, "fp16+zstd": None,
         "randomk:ratio=0.1+fp16": None, "bf16+zstd:level=7": None, "topk:ratio=1e-3+zstd:level=3": "topk:ratio=0.001+zstd",
         "topk:k=10+fp16": None}


@pytest.mark.parametrize("spec", list(SPECS))
def test_spec_and_config_round_trip(spec):
    chain = gradwire.compressor(spec)
    assert isinstance(chain, Chain) and str(chain) == (SPECS[spec] or spec), "str() is the canonical spec"
    assert gradwire.compressor(str(chain)) == chain and hash(gradwire.compressor(spec)) == hash(chain)
    config = chain.get_config()
    assert config["name"] == "chain" and [s["name"] for s in config["stages"]] == [s.name for s in chain.stages]
    again = gradwire.from_config(json.loads(json.dumps(config)))
    assert isinstance(again, Chain) and again == chain and again.crc == chain.crc
    assert gradwire.compressor(config) == chain
    x = randn(300, seed=7)
    assert torch.equal(again.encode(x, CTX).tensor(), chain.encode(x, CTX).tensor())
    assert torch.equal(bits(again.decode(chain.encode(x, CTX).tensor())), bits(chain.decode(chain.encode(x, CTX))))
    assert chain.stochastic == any(s.stochastic for s in chain.stages)


def test_canonical_chain_spec():
    chain = gradwire.compressor(" fp16 +zstd:level=3")
    assert str(chain) == "fp16+zstd" and chain == gradwire.compressor("fp16+zstd")
    assert gradwire.compressor("fp16+zstd:level=4") != chain
