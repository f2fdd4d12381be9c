"""The contract every registered compressor (and a few chains) must keep."""

from __future__ import annotations

import math

import pytest
import torch

import gradwire
from gradwire.compress.wire import FLOAT_DTYPES

CHAINS = ["topk:ratio=0.1+fp16", "topk:ratio=0.1+qsgd:bits=4+zstd", "fp16+zstd", "randomk:ratio=0.2+bf16"]
SPECS = gradwire.available() + CHAINS


def _x(shape, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", FLOAT_DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (7, 3), (2, 3, 5), (1001,)])
def test_round_trip_keeps_shape_and_dtype(spec, dtype, shape):
    c = gradwire.compressor(spec)
    x = _x(shape, dtype)
    packet = c.encode(x, gradwire.Ctx(seed=3))
    raw = packet.tensor()
    assert raw.dtype == torch.uint8 and raw.dim() == 1 and raw.numel() == packet.nbytes
    y = c.decode(raw)
    assert y.shape == x.shape and y.dtype == x.dtype
    assert torch.isfinite(y).all()
    size = c.static_size(x.numel(), dtype, shape)
    if size is not None:
        assert size == raw.numel()


@pytest.mark.parametrize("spec", SPECS)
def test_decode_into_out(spec):
    c = gradwire.compressor(spec)
    x = _x((64, 8), torch.float32)
    out = torch.full((64, 8), 7.0)
    y = c.decode(c.encode(x), out=out)
    assert y is out
    assert torch.equal(out, c.decode(c.encode(x)))


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_input_equals_contiguous(spec):
    c = gradwire.compressor(spec)
    base = _x((40, 30), torch.float32)
    view = base.t()  # non-contiguous
    assert not view.is_contiguous()
    ctx = gradwire.Ctx(seed=5, step=2)
    assert torch.equal(c.encode(view, ctx).tensor(), c.encode(view.contiguous(), ctx).tensor())
    assert c.decode(c.encode(view, ctx)).shape == view.shape


@pytest.mark.parametrize("spec", SPECS)
def test_same_ctx_same_bytes(spec):
    c = gradwire.compressor(spec)
    x = _x((3000,), torch.float32)
    ctx = gradwire.Ctx(seed=1, step=4, rank=2, key=9)
    assert torch.equal(c.encode(x, ctx).tensor(), c.encode(x.clone(), ctx).tensor())


@pytest.mark.parametrize("spec", [s for s in SPECS if gradwire.compressor(s).stochastic])
def test_seed_changes_bytes(spec):
    c = gradwire.compressor(spec)
    x = _x((3000,), torch.float32)
    a = c.encode(x, gradwire.Ctx(seed=1)).tensor()
    b = c.encode(x, gradwire.Ctx(seed=2)).tensor()
    assert not torch.equal(a, b)


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_survives(spec, bad):
    c = gradwire.compressor(spec)
    x = _x((2048,), torch.float32)
    x[1234] = bad
    y = c.decode(c.encode(x, gradwire.Ctx(seed=1)))
    assert not torch.isfinite(y).all(), f"{spec} hid a {bad} from the decoded output"


@pytest.mark.parametrize("spec", SPECS)
def test_all_zeros_decode_to_zeros(spec):
    c = gradwire.compressor(spec)
    x = torch.zeros(777)
    y = c.decode(c.encode(x, gradwire.Ctx(seed=1)))
    assert torch.equal(y, torch.zeros(777))


@pytest.mark.parametrize("spec", SPECS)
def test_config_round_trip(spec):
    c = gradwire.compressor(spec)
    assert gradwire.compressor(str(c)) == c
    assert gradwire.from_config(c.get_config()) == c
    assert str(gradwire.from_config(c.get_config())) == str(c)


@pytest.mark.parametrize("spec", SPECS)
def test_other_config_is_rejected(spec):
    c = gradwire.compressor(spec)
    other = gradwire.compressor("none" if spec != "none" else "fp16")
    with pytest.raises(gradwire.WireFormatError):
        other.decode(c.encode(_x((100,), torch.float32)).tensor())


@pytest.mark.parametrize("spec", [s for s in SPECS if gradwire.compressor(s).summable])
def test_summable_payloads_sum_to_sum_of_decodes(spec):
    c = gradwire.compressor(spec)
    ctxs = [gradwire.Ctx(seed=7, step=1, rank=r, key=3) for r in range(3)]
    xs = [_x((500,), torch.float32, seed=r) for r in range(3)]
    payload = sum(c.to_summable(x, ctx) for x, ctx in zip(xs, ctxs))
    total = c.from_summable(payload, xs[0], ctxs[0])
    expected = sum(c.decode(c.encode(x, ctx)) for x, ctx in zip(xs, ctxs))
    assert torch.allclose(total.float(), expected.float(), rtol=1e-2, atol=1e-2)


def test_rejects_non_tensors_and_integer_tensors():
    c = gradwire.compressor("fp16")
    with pytest.raises(TypeError, match="torch.Tensor"):
        c.encode([1.0, 2.0])
    with pytest.raises(TypeError, match="float32"):
        c.encode(torch.arange(4))


def test_ctx_takes_a_string_key_hashed_like_key_of():
    ctx = gradwire.Ctx(seed=7, key="layer1.weight")
    assert ctx == gradwire.Ctx(seed=7, key=gradwire.Ctx.key_of("layer1.weight"))
    assert isinstance(ctx.key, int)
    c = gradwire.compressor("randomk:ratio=0.1")  # stochastic: the bytes depend on the key
    x = _x((1000,), torch.float32)
    assert torch.equal(c.encode(x, ctx).tensor(), c.encode(x, gradwire.Ctx(seed=7, key=ctx.key)).tensor())
    assert not torch.equal(c.encode(x, ctx).tensor(), c.encode(x, gradwire.Ctx(seed=7, key="layer2.weight")).tensor())
    import numpy as np

    assert gradwire.Ctx(step=np.int64(3), key=torch.tensor(5)) == gradwire.Ctx(step=3, key=5)


@pytest.mark.parametrize("field, value", [("key", 1.5), ("key", None), ("key", True), ("seed", "7"),
                                          ("step", 2.0), ("rank", torch.ones(2))])
def test_ctx_rejects_other_types_naming_the_field(field, value):
    with pytest.raises(TypeError, match=rf"Ctx\.{field} must be"):
        gradwire.Ctx(**{field: value})
