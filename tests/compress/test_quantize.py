"""fp8, int8, qsgd, terngrad, sign, onebit: formats, error bounds, unbiasedness, edge cases."""

from __future__ import annotations

import math

import pytest
import torch

import gradwire
from gradwire import Ctx, WireFormatError
from gradwire.compress.quantize import fp8, tiles
from gradwire.compress.wire import Kind, Packet, Section, align, header_size

from tensors import bits

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECS = ["fp8", "fp8:format=e5m2,chunk=100", "fp4", "fp4:chunk=7", "int8", "int8:chunk=7", "qsgd", "qsgd:bits=1,bucket=64",
         "qsgd:bits=3,bucket=100", "qsgd:bits=4", "qsgd:bits=7,bucket=13", "terngrad", "terngrad:bucket=0",
         "terngrad:bucket=33", "sign", "sign:chunk=10", "onebit", "onebit:chunk=9"]
STOCHASTIC = [s for s in SPECS if s.startswith(("qsgd", "terngrad"))]


def _x(n, dtype=torch.float32, seed=0, scale=1.0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(n, generator=g) * scale).to(dtype)


def _sections(c, x, ctx=None):
    pk = c.encode(x, ctx or Ctx(seed=1))
    return pk, [s.data for s in pk.sections]


def _per_elem(v, chunk, n):
    """Per-chunk values expanded to one per element."""
    return v.repeat_interleave(chunk)[:n]


# ---- shape, dtype, size ------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(0,), (1,), (5,), (8,), (3, 0, 2), (9, 7, 3), (4097,)])
def test_round_trip_shape_dtype_and_static_size(spec, dtype, shape):
    c = gradwire.compressor(spec)
    x = _x(math.prod(shape), dtype).reshape(shape)
    raw = c.encode(x, Ctx(seed=2)).tensor()
    y = c.decode(raw)
    assert y.shape == x.shape and y.dtype == dtype
    assert torch.isfinite(y).all()
    assert raw.numel() == c.static_size(x.numel(), dtype, shape)


def _formula(spec: str, n: int) -> list[int]:
    """Section bytes as documented in the quantize package's docstring."""
    c = gradwire.compressor(spec)
    g = -(-n // 8)
    chunk = getattr(c, "chunk", None) if c.name in ("fp8", "fp4", "int8", "sign", "onebit") else c.bucket
    nc = (1 if n else 0) if chunk == 0 else -(-n // chunk)
    if c.name == "qsgd":
        return [4 * nc, g, c.bits * g]
    return {"fp8": [4 * nc, n], "fp4": [4 * nc, 4 * g], "int8": [4 * nc, 4 * nc, n], "terngrad": [4 * nc, g, g], "sign": [4 * nc, g],
            "onebit": [8 * nc, g]}[c.name]


@pytest.mark.parametrize("spec", SPECS)
def test_packet_size_formula(spec):
    c = gradwire.compressor(spec)
    for n in (0, 1, 7, 8, 9, 63, 64, 65, 1000, 5003):
        sizes = _formula(spec, n)
        pk = c.encode(_x(n))
        assert [s.nbytes for s in pk.sections] == sizes
        assert pk.nbytes == header_size(1, len(sizes)) + sum(align(s) for s in sizes) == c.static_size(n)


@pytest.mark.parametrize("b", [1, 2, 3, 4, 5, 7, 8])
@pytest.mark.parametrize("n", [1, 8, 13, 4099])
def test_unpack_inverts_the_documented_bit_packing(b, n):
    """`_unpack` against the little-endian layout of `tiles`' docstring, on random bytes."""
    g = -(-n // 8)
    packed = torch.randint(0, 256, (g * b,), dtype=torch.uint8, generator=torch.Generator().manual_seed(n + b))
    words = [int.from_bytes(bytes(packed[j * b:(j + 1) * b].tolist()), "little") for j in range(g)]
    want = [(words[i // 8] >> (b * (i % 8))) & ((1 << b) - 1) for i in range(n)]
    assert tiles._unpack(packed, b, n).tolist() == want


def test_bits_per_element():
    n = 1 << 16
    for spec, want in [("qsgd:bits=8", 9), ("qsgd:bits=4", 5), ("qsgd:bits=1", 2), ("terngrad", 2),
                       ("sign", 1), ("onebit", 1), ("int8", 8), ("fp8", 8), ("fp4", 5)]:
        bits = 8 * gradwire.compressor(spec).static_size(n) / n
        assert want <= bits < want + 0.6, spec


# ---- what each format promises -------------------------------------------------------------

@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("chunk", [64, 100, 1024])
def test_int8_error_at_most_half_a_step(dtype, chunk):
    n = 5000
    x = _x(n, dtype, scale=3.0)
    x[:chunk] += 50.0  # chunks with very different ranges
    c = gradwire.compressor(f"int8:chunk={chunk}")
    _, (scales, offsets, codes) = _sections(c, x)
    xf = x.float()
    nc = -(-n // chunk)
    rows = torch.nn.functional.pad(xf, (0, nc * chunk - n), value=float("nan")).view(nc, chunk)
    assert torch.equal(offsets, torch.stack([r[~r.isnan()].min() for r in rows]))
    hi = torch.stack([r[~r.isnan()].max() for r in rows])
    assert torch.allclose(scales, (hi - offsets) / 255, rtol=1e-6)
    y = c.decode(c.encode(x)).float()
    ref = (codes.float() - 127.5) * _per_elem(scales, chunk, n) + _per_elem(offsets + scales * 127.5, chunk, n)
    assert torch.allclose(y, ref.to(dtype).float(), rtol=0, atol=0)
    bound = _per_elem(scales, chunk, n) * (0.5 + 1e-4) + 1e-6 * xf.abs().max()
    if dtype == torch.float32:
        assert ((y - xf).abs() <= bound).all()
    codes_max = codes.view(-1)[: n // chunk * chunk].view(-1, chunk).amax(1)
    assert (codes_max == 255).all() and (codes.view(-1)[: n // chunk * chunk].view(-1, chunk).amin(1) == 0).all()


def test_int8_constant_chunks_are_exact():
    x = torch.tensor([3.25] * 10 + [-1.5] * 10 + [0.0] * 5)
    c = gradwire.compressor("int8:chunk=10")
    assert torch.equal(c.decode(c.encode(x)), x)


@pytest.mark.parametrize("fmt,mant,emin", [("e4m3", 3, -9), ("e5m2", 2, -16)])
@pytest.mark.parametrize("chunk", [32, 1000])
def test_fp8_error_bound_and_absmax_maps_to_max(fmt, mant, emin, chunk):
    n = 4100
    x = _x(n, scale=0.01) * torch.logspace(-3, 3, n)  # wide dynamic range inside chunks
    c = gradwire.compressor(f"fp8:format={fmt},chunk={chunk}")
    _, (scales, codes) = _sections(c, x)
    fmax = torch.finfo(codes.dtype).max
    nc = -(-n // chunk)
    absmax = torch.nn.functional.pad(x.abs(), (0, nc * chunk - n)).view(nc, chunk).amax(1)
    assert torch.allclose(scales, absmax / fmax, rtol=1e-6)
    code_absmax = torch.nn.functional.pad(codes.float().abs(), (0, nc * chunk - n)).view(nc, chunk).amax(1)
    assert torch.equal(code_absmax, torch.full((nc,), fmax))
    y = c.decode(c.encode(x))
    scale = _per_elem(scales, chunk, n)
    bound = 2.0 ** -(mant + 1) * x.abs() + 2.0 ** (emin - 1) * scale + 1e-6 * x.abs()
    assert ((y - x).abs() <= bound).all()


def test_fp8_all_zero_chunk_is_exact():
    x = torch.cat([torch.zeros(100), _x(100)])
    c = gradwire.compressor("fp8:chunk=100")
    y = c.decode(c.encode(x))
    assert torch.equal(y[:100], torch.zeros(100)) and torch.isfinite(y).all()


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_codes_through_half_bits_decode_like_the_cast(fmt):
    """Error feedback's in-tile decode (`_fp8_as_half`) against torch's cast, every code
    times scales from subnormal to the largest an fp8 chunk can have, bit for bit."""
    dtype = fp8._FP8[fmt]
    codes = torch.arange(256, dtype=torch.uint8).repeat(3)[:-9].view(dtype)  # odd length: vector tails too
    value = codes.to(torch.float32)
    fmax = float(torch.finfo(dtype).max)
    scales = [2.0 ** -149, 3e-39, 1e-30, 1 / fmax, 0.37, 1.0, 3.3e3, 1e30, tiles.FLT_MAX / fmax]
    out = torch.empty(codes.numel())
    lift = fp8._fp8_as_half(codes, fmt, torch.empty(codes.numel(), dtype=torch.int32), out)
    real = ~torch.isnan(value)  # NaN codes come only from a non-finite chunk (its scale is non-finite)
    assert real.sum() >= 3 * 250 - 9 and torch.equal(out[real] * lift, value[real])
    for sc in scales:
        want = value * torch.tensor(sc)
        got = out * (torch.tensor([sc]) * lift)
        assert torch.equal(bits(got[real]), bits(want[real])), sc
    assert not torch.isfinite(out * (torch.tensor([math.inf]) * lift)).any()


@pytest.mark.parametrize("chunk", [10, 256, 1024])
def test_sign_reconstructs_plus_minus_mean_abs(chunk):
    n = 3001
    x = _x(n)
    c = gradwire.compressor(f"sign:chunk={chunk}")
    _, (scales, bits) = _sections(c, x)
    nc = -(-n // chunk)
    xd = x.double()
    mean_abs = torch.stack([xd[i * chunk: (i + 1) * chunk].abs().mean() for i in range(nc)])
    assert torch.allclose(scales.double(), mean_abs, rtol=1e-6)
    y = c.decode(c.encode(x))
    expect = torch.where(x < 0, -_per_elem(scales, chunk, n), _per_elem(scales, chunk, n))
    assert torch.equal(y, expect)
    # bit i of byte j is element 8j+i (LSB first)
    unpacked = ((bits.unsqueeze(1) >> torch.arange(8, dtype=torch.uint8)) & 1).view(-1)[:n]
    assert torch.equal(unpacked.bool(), x < 0)


@pytest.mark.parametrize("chunk", [9, 512])
def test_onebit_reconstructs_group_means(chunk):
    n = 2000
    x = _x(n) + 0.3
    x[:chunk] = x[:chunk].abs()  # a chunk without negative elements
    c = gradwire.compressor(f"onebit:chunk={chunk}")
    _, (scales, bits) = _sections(c, x)
    pairs = scales.view(-1, 2)
    nc = -(-n // chunk)
    for i in range(nc):
        seg = x[i * chunk: (i + 1) * chunk].double()
        pos, neg = seg[seg >= 0], seg[seg < 0]
        assert math.isclose(pairs[i, 0].item(), pos.mean().item() if len(pos) else 0.0, rel_tol=1e-6, abs_tol=1e-12)
        assert math.isclose(pairs[i, 1].item(), neg.mean().item() if len(neg) else 0.0, rel_tol=1e-6, abs_tol=1e-12)
    y = c.decode(c.encode(x))
    expect = torch.where(x < 0, _per_elem(pairs[:, 1], chunk, n), _per_elem(pairs[:, 0], chunk, n))
    assert torch.equal(y, expect)
    assert pairs[0, 1] == 0


@pytest.mark.parametrize("bits,bucket", [(8, 512), (4, 100), (3, 64), (1, 7)])
@pytest.mark.parametrize("dtype", DTYPES)
def test_qsgd_levels_norms_and_one_step_error(bits, bucket, dtype):
    n = 3000
    x = _x(n, dtype)
    c = gradwire.compressor(f"qsgd:bits={bits},bucket={bucket}")
    _, (norms, signs, levels) = _sections(c, x)
    s = 2 ** bits - 1
    xf = x.float()
    nb = -(-n // bucket)
    ref = torch.stack([xf[i * bucket: (i + 1) * bucket].double().norm() for i in range(nb)]).float()
    assert torch.allclose(norms, ref, rtol=1e-5)
    y = c.decode(c.encode(x, Ctx(seed=1))).float()
    step = _per_elem(norms / s, bucket, n)
    eps = torch.finfo(dtype).eps
    lv = y.abs() / step
    if dtype == torch.float32:
        assert torch.allclose(lv, lv.round(), atol=1e-3)
    assert (lv <= s * (1 + eps)).all()
    assert ((y - xf).abs() <= step * (1 + 1e-4) + eps * xf.abs()).all()  # moves by less than a step
    assert ((y == 0) | ((y < 0) == (xf < 0))).all()


@pytest.mark.parametrize("bucket", [0, 64, 512])
def test_terngrad_is_ternary_times_max(bucket):
    n = 1000
    x = _x(n)
    c = gradwire.compressor(f"terngrad:bucket={bucket}")
    _, (scales, signs, nonzero) = _sections(c, x)
    chunk = n if bucket == 0 else bucket
    nb = -(-n // chunk)
    ref = torch.stack([x[i * chunk: (i + 1) * chunk].abs().max() for i in range(nb)])
    assert torch.equal(scales, ref)
    y = c.decode(c.encode(x, Ctx(seed=4)))
    sc = _per_elem(scales, chunk, n)
    assert ((y == 0) | (y == sc * torch.sign(x))).all()
    assert (y[x.abs() == sc] == x[x.abs() == sc]).all()  # |x| = max always rounds up


# ---- randomness -------------------------------------------------------------------------

@pytest.mark.parametrize("spec,trials", [("qsgd:bits=2,bucket=64", 1500), ("terngrad:bucket=64", 1500),
                                         ("terngrad:bucket=0", 1500)])
def test_stochastic_rounding_is_unbiased(spec, trials):
    """mean over seeds -> x: each element within 5 standard errors (σ <= step/2 per draw)."""
    c = gradwire.compressor(spec)
    n = 192
    x = _x(n, seed=11)
    acc = torch.zeros(n, dtype=torch.float64)
    for seed in range(trials):
        acc += c.decode(c.encode(x, Ctx(seed=seed, step=3, key=5))).double()
    mean = acc / trials
    pk = c.encode(x)
    scales = pk.section(Kind.SCALES)
    chunk = n if c.bucket == 0 else c.bucket
    step = _per_elem(scales.double(), chunk, n) / c.levels
    tol = 5 * step / (2 * math.sqrt(trials))
    assert ((mean - x.double()).abs() <= tol).all()
    assert abs((mean - x.double()).mean().item()) < step.mean().item() / math.sqrt(trials * n) * 5


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_determinism_and_key_sensitivity(spec):
    c = gradwire.compressor(spec)
    x = _x(3000)
    base = Ctx(seed=1, step=2, rank=3, key=4)
    ref = c.encode(x, base).tensor()
    assert torch.equal(ref, c.encode(x.clone(), Ctx(seed=1, step=2, rank=3, key=4)).tensor())
    for other in (Ctx(2, 2, 3, 4), Ctx(1, 3, 3, 4), Ctx(1, 2, 0, 4), Ctx(1, 2, 3, 5)):
        assert not torch.equal(ref, c.encode(x, other).tensor())


@pytest.mark.parametrize("spec", STOCHASTIC)
def test_uses_the_documented_random_stream(spec):
    """Levels follow min(floor(|x| * min(s/scale, FLT_MAX) + u24 * 2**-24), s) with the codec's stream."""
    from gradwire.compress import rng

    c = gradwire.compressor(spec)
    n = 777
    x = _x(n, seed=3)
    ctx = Ctx(seed=9, step=8, rank=7, key=6)
    y = c.decode(c.encode(x, ctx))
    scales = c.encode(x, ctx).section(Kind.SCALES)
    chunk = n if c.bucket == 0 else c.bucket
    s = float(c.levels)
    f = _per_elem(torch.div(s, scales).clamp(max=torch.finfo(torch.float32).max), chunk, n)
    u = rng.uniform(rng.stream_key(9, 8, 7, 6, stream=c.codec_id), n)
    level = (x.abs() * f + u).floor().clamp(max=s)
    expect = level * _per_elem(scales / s, chunk, n) * torch.where(x < 0, -1.0, 1.0)
    assert torch.equal(y, expect)


@pytest.mark.parametrize("spec", SPECS)
def test_bytes_do_not_depend_on_the_tile_size(spec, monkeypatch):
    c = gradwire.compressor(spec)
    x = _x(3001, seed=5)
    x[2000] = 0.0
    ctx = Ctx(seed=3)
    ref = c.encode(x, ctx).tensor()
    ref16 = c.encode(x.to(torch.bfloat16), ctx).tensor()
    for tile in (8, 200, 1024):
        monkeypatch.setattr(tiles, "TILE", tile)
        assert torch.equal(c.encode(x, ctx).tensor(), ref), tile
        assert torch.equal(c.encode(x.to(torch.bfloat16), ctx).tensor(), ref16), tile


# ---- edge cases ---------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_all_zeros_and_single_elements(spec, dtype):
    c = gradwire.compressor(spec)
    for n in (1, 9, 1500):
        z = torch.zeros(n, dtype=dtype)
        y = c.decode(c.encode(z, Ctx(seed=1)).tensor())
        assert torch.equal(y, z) and not y.isnan().any()
    one = torch.tensor([-2.5], dtype=dtype)
    y = c.decode(c.encode(one, Ctx(seed=1)).tensor())
    assert y.dtype == dtype and torch.isfinite(y).all()
    if not spec.startswith("fp8"):  # fp8 rounds 2.5 to 2.5 exactly too, but only by luck of the format
        assert torch.allclose(y.float(), one.float(), rtol=1e-2)


@pytest.mark.parametrize("spec", SPECS)
def test_non_contiguous_and_nd_inputs(spec):
    c = gradwire.compressor(spec)
    base = _x(60 * 50).view(60, 50)
    view = base.t()[::2]
    ctx = Ctx(seed=5)
    assert torch.equal(c.encode(view, ctx).tensor(), c.encode(view.contiguous(), ctx).tensor())
    assert c.decode(c.encode(view, ctx)).shape == view.shape


@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bad", [math.nan, math.inf, -math.inf])
def test_non_finite_input_stays_non_finite_in_its_chunk(spec, dtype, bad):
    c = gradwire.compressor(spec)
    n, at = 3000, 1234
    x = _x(n, dtype)
    x[at] = bad
    y = c.decode(c.encode(x, Ctx(seed=1)).tensor())
    assert not torch.isfinite(y[at]), f"{spec} hid {bad} at its position"
    chunk = getattr(c, "chunk", None) if c.name in ("fp8", "fp4", "int8", "sign", "onebit") else c.bucket
    if chunk:  # the other chunks are unaffected
        lo = at // chunk * chunk
        assert torch.isfinite(y[:lo]).all() and torch.isfinite(y[lo + chunk:]).all()
    if c.name != "onebit":  # one scale per chunk: the whole chunk is non-finite
        lo, hi = (0, n) if not chunk else (at // chunk * chunk, min(n, at // chunk * chunk + chunk))
        assert not torch.isfinite(y[lo:hi]).any()


def test_huge_finite_values_stay_finite():
    """max/min-based formats cope with values near FLT_MAX (sums and norms would overflow)."""
    x = torch.tensor([3e38, -3e38, 1.0, 0.0] * 8)
    for spec in ["int8", "fp8", "fp8:format=e5m2", "fp4", "terngrad", "terngrad:bucket=0"]:
        c = gradwire.compressor(spec)
        assert torch.isfinite(c.decode(c.encode(x))).all(), spec


# ---- config -------------------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_config_round_trip(spec):
    c = gradwire.compressor(spec)
    assert gradwire.compressor(str(c)) == c
    assert gradwire.from_config(c.get_config()) == c
    assert c.role == "dense" and not c.summable


def test_defaults_and_canonical_specs():
    assert str(gradwire.compressor("qsgd:bits=8,bucket=512")) == "qsgd"
    assert str(gradwire.compressor("fp8:format=e5m2")) == "fp8:format=e5m2"
    assert gradwire.compressor("terngrad:bucket=0").get_config() == {"name": "terngrad", "bucket": 0}
    assert [gradwire.compressor(s).codec_id for s in ["fp8", "int8", "qsgd", "terngrad", "sign", "onebit"]] \
        == [4, 5, 10, 11, 12, 13]
    assert gradwire.compressor("qsgd").stochastic and not gradwire.compressor("int8").stochastic


@pytest.mark.parametrize("spec", ["qsgd:bits=9", "qsgd:bits=0", "qsgd:bucket=0", "qsgd:bits=2.5", "fp8:format=e3m4",
                                  "fp8:chunk=0", "fp4:chunk=0", "fp4:format=e3m0", "int8:chunk=-1", "terngrad:bucket=-1", "sign:chunk=0",
                                  "onebit:chunk=x", "int8:bits=4", "sign:chunk=4294967296"])
def test_bad_params_raise_value_error(spec):
    with pytest.raises(ValueError):
        gradwire.compressor(spec)


def test_a_different_config_is_rejected():
    x = _x(100)
    with pytest.raises(WireFormatError):
        gradwire.compressor("qsgd:bits=4").decode(gradwire.compressor("qsgd").encode(x).tensor())
    with pytest.raises(WireFormatError):
        gradwire.compressor("fp8").decode(gradwire.compressor("fp8:format=e5m2").encode(x).tensor())


# ---- corrupted packets ----------------------------------------------------------------------

def _with(pk: Packet, sections: list[Section]) -> Packet:
    return Packet(pk.codec, pk.dtype, pk.shape, sections, pk.config, pk.flags)


@pytest.mark.parametrize("spec", SPECS)
def test_corrupted_packets_raise_wire_format_error(spec):
    c = gradwire.compressor(spec)
    pk = c.encode(_x(1000), Ctx(seed=1))
    secs = list(pk.sections)
    bad = [
        secs[:-1],  # a section missing
        secs + [Section(Kind.META, torch.zeros(1, dtype=torch.int64))],  # an extra one
        [Section(Kind.META, secs[0].data)] + secs[1:],  # wrong kind
        [Section(secs[0].kind, secs[0].data.view(torch.uint8))] + secs[1:],  # wrong dtype
        [Section(secs[0].kind, secs[0].data[:-1])] + secs[1:],  # one scale short
        secs[:-1] + [Section(secs[-1].kind, torch.cat([secs[-1].data, secs[-1].data[:1]]))],  # one code too many
    ]
    for sections in bad:
        with pytest.raises(WireFormatError):
            c.decode(_with(pk, sections))
        with pytest.raises(WireFormatError):
            c.decode(_with(pk, sections).tensor())
    # the header's numel changed (shape too) while the sections stay
    for numel in (2000, 1, 0):
        forged = Packet(pk.codec, pk.dtype, (numel,), secs, pk.config, pk.flags)
        with pytest.raises(WireFormatError):
            c.decode(forged.tensor())
    raw = pk.tensor().clone()
    with pytest.raises(WireFormatError):
        c.decode(raw[:-8])


@pytest.mark.parametrize("spec", ["qsgd:bits=3", "terngrad", "int8", "fp8", "fp4", "onebit"])
def test_garbage_contents_decode_without_error(spec):
    """Any bytes in correctly sized sections decode to a tensor of the right shape."""
    c = gradwire.compressor(spec)
    pk = c.encode(_x(333), Ctx(seed=1))
    g = torch.Generator().manual_seed(0)
    secs = [Section(s.kind, torch.randint(0, 256, (s.nbytes,), dtype=torch.uint8, generator=g).view(s.data.dtype))
            for s in pk.sections]
    y = c.decode(_with(pk, secs).tensor())
    assert y.shape == (333,) and y.dtype == torch.float32


def _ref_unpack(packed: torch.Tensor, b: int, n: int) -> list[int]:
    """The documented layout, spelled out: 8 codes = one little-endian b-byte integer."""
    raw = bytes(packed.tolist())
    codes = []
    for j in range(-(-n // 8)):
        word = int.from_bytes(raw[b * j: b * j + b], "little")
        codes += [(word >> (b * k)) & ((1 << b) - 1) for k in range(8)]
    return codes[:n]


@pytest.mark.parametrize("bits", range(1, 9))
def test_qsgd_level_and_sign_packing_follow_the_documented_layout(bits):
    n = 1237
    x = _x(n, seed=bits)
    c = gradwire.compressor(f"qsgd:bits={bits},bucket=50")
    pk = c.encode(x, Ctx(seed=2))
    norms, signs, levels = (s.data for s in pk.sections)
    y = c.decode(pk)
    step = _per_elem(norms / (2 ** bits - 1), 50, n)
    assert _ref_unpack(levels, bits, n) == (y.abs() / step).round().to(torch.int64).tolist()
    assert _ref_unpack(signs, 1, n) == (x < 0).to(torch.int64).tolist()
    g = -(-n // 8)
    assert _ref_unpack(levels, bits, 8 * g)[n:] == [0] * (8 * g - n)  # the last group is zero padded
    assert _ref_unpack(signs, 1, 8 * g)[n:] == [0] * (8 * g - n)
