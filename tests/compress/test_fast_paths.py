"""Speed paths that must not change results: add_decoded (out += decode(packet), bit for bit
but NaN payloads, validated like decode) and casts encoding straight into the packet buffer."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import Ctx, WireFormatError

from tensors import bits, randn
from test_feedback import ORACLE_SPECS


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ORACLE_SPECS)
def test_add_decoded_is_a_dense_add_of_the_decode(spec, dtype, small_tiles):
    c = gradwire.compressor(spec)
    for n in (1, 37, 3000):
        x = randn(n, seed=n).to(dtype)
        base = randn(n, seed=n + 1).to(dtype)
        base[: n // 3] = 0.0  # an untouched +0 must stay +0 (and -0 + 0 would not)
        if n > 10:
            x[7] = float("nan")  # non-finite input: the positions it decodes to must match too
        for t in range(2):
            packet = c.encode(x if t else x.nan_to_num(), Ctx(step=t, seed=1))
            want = base + c.decode(packet.tensor())
            got = c.add_decoded(packet.tensor(), base.clone())
            nan = want.isnan()
            assert torch.equal(got.isnan(), nan)  # NaN payloads may differ (kernels differ), positions not
            assert torch.equal(bits(got)[~nan], bits(want)[~nan])


@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "randomk:ratio=0.1", "int8", "fp16", "topk:ratio=0.1+fp16"])
def test_add_decoded_validates_like_decode(spec):
    c = gradwire.compressor(spec)
    packet = c.encode(randn(500)).tensor()
    other = gradwire.compressor("qsgd:bits=3").encode(randn(500)).tensor()
    with pytest.raises(WireFormatError):
        c.add_decoded(other, torch.zeros(500))
    with pytest.raises(WireFormatError):
        c.add_decoded(packet, torch.zeros(499))
    out = torch.zeros(500)
    c.add_decoded(packet, out)
    assert torch.equal(out, c.decode(packet))


@pytest.mark.parametrize("spec", ["none", "fp16", "bf16"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_casts_write_into_the_packet_the_bytes_of_the_generic_encode(spec, dtype):
    from gradwire.compress.base import Compressor

    c = gradwire.compressor(spec)
    x = (randn(1001) * 1e5).to(dtype)  # overflows fp16
    x[3], x[5] = float("nan"), float("-inf")
    for t in (x.view(7, 143), x.view(7, 143).t(), x[:0]):
        assert torch.equal(c.encode(t).tensor(), Compressor.encode(c, t).tensor())


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ["fp8", "fp8:format=e5m2", "int8:chunk=100", "qsgd:bits=3", "qsgd", "terngrad",
                                  "terngrad:bucket=0", "sign", "onebit:chunk=96"])
def test_tiled_quantizer_decode_matches_the_whole_tensor_decode(spec, dtype, small_tiles):
    from gradwire.compress.base import Compressor

    c = gradwire.compressor(spec)
    x = randn(3001, seed=4).to(dtype)
    x[10], x[2000], x[2500] = float("nan"), float("inf"), -0.0
    for packet in (c.encode(x, Ctx(step=1)), c.encode(x.nan_to_num(posinf=1.0), Ctx(step=2))):
        assert torch.equal(bits(c.decode(packet.tensor())), bits(Compressor.decode(c, packet.tensor())))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ORACLE_SPECS)
def test_decode_into_out_and_into_fresh_mappings_matches_the_plain_decode(spec, dtype, small_tiles, monkeypatch):
    """decode(out=buf) writes the result into buf itself where it fits (and through a copy
    into a strided one); fresh outputs from huge-page mappings hold the same bits."""
    from gradwire.compress import alloc

    c = gradwire.compressor(spec)
    x = randn(3000, seed=5).to(dtype)
    x[11] = float("nan")
    for t, inp in enumerate((x.nan_to_num(), x)):
        packet = c.encode(inp, Ctx(step=t, seed=2)).tensor()
        monkeypatch.setattr(alloc, "ENABLED", False)
        want = c.decode(packet)
        buf = torch.full((3000,), 7.0, dtype=dtype)
        assert c.decode(packet, out=buf) is buf and torch.equal(bits(buf), bits(want))
        strided = torch.full((6000,), 7.0, dtype=dtype)[::2]
        c.decode(packet, out=strided)
        assert torch.equal(bits(strided.contiguous()), bits(want))
        monkeypatch.setattr(alloc, "ENABLED", True)
        monkeypatch.setattr(alloc, "MIN_BYTES", 1024)
        fresh = c.decode(packet)
        assert fresh.shape == want.shape and torch.equal(bits(fresh), bits(want))
