import pytest
import torch

import gradwire
from gradwire.compress.wire import header_size


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_none_is_bit_exact(dtype):
    x = torch.randn(1000).to(dtype)
    x[3] = float("nan")
    y = gradwire.compressor("none").decode(gradwire.compressor("none").encode(x).tensor())
    assert torch.equal(y.view(torch.uint8), x.view(torch.uint8))


@pytest.mark.parametrize("spec,wire", [("fp16", torch.float16), ("bf16", torch.bfloat16)])
def test_casts_equal_torch_casts(spec, wire):
    x = torch.randn(4096) * 1e3
    x[0] = 1e6  # overflows fp16 to inf, as torch's fp16 hook would
    c = gradwire.compressor(spec)
    y = c.decode(c.encode(x).tensor())
    assert torch.equal(y, x.to(wire).to(torch.float32))


@pytest.mark.parametrize("spec,itemsize", [("none", 4), ("fp16", 2), ("bf16", 2)])
def test_packet_size_formula(spec, itemsize):
    c = gradwire.compressor(spec)
    for n in (0, 1, 3, 1000):
        expected = header_size(1, 1) + (n * itemsize + 7) // 8 * 8
        assert c.encode(torch.randn(n)).nbytes == expected == c.static_size(n, torch.float32)


def test_packet_does_not_alias_the_input():
    x = torch.randn(100)
    sent = x.clone()
    c = gradwire.compressor("none")
    packet = c.encode(x)
    x.zero_()
    assert torch.equal(c.decode(packet), sent)  # the packet kept what was sent, not a view of x


def test_fp16_summable_matches_allreduce_of_halves():
    c = gradwire.compressor("fp16")
    xs = [torch.randn(300) for _ in range(4)]
    payload = sum(c.to_summable(x) for x in xs)
    assert payload.dtype == torch.float16
    assert torch.equal(c.from_summable(payload, xs[0]), payload.float())
