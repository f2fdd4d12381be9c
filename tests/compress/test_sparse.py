"""Sparsifiers: topk, randomk, threshold, dgc (gradwire.compress.sparse, gradwire.compress.select)."""

from __future__ import annotations

import math

import pytest
import torch

import gradwire
from gradwire import WireFormatError
from gradwire.compress import Ctx, indexcodec, select
from gradwire.compress.sparse import RandomK, dgc, randomk
from gradwire.compress.wire import Kind, Packet, Section

DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SPECS = ["topk:ratio=0.05", "topk:k=7,indices=raw", "topk:ratio=0.02,indices=packed",
         "topk:ratio=0.05,chunk=64", "topk:k=3,chunk=1000,indices=raw",
         "dgc:ratio=0.05", "dgc:ratio=0.02,indices=raw,sample_ratio=0.05",
         "randomk:ratio=0.1", "randomk:k=9",
         "threshold:threshold=1.5", "threshold:threshold=0.5,indices=raw"]
RAW_SPECS = ["topk:ratio=0.03,indices=raw", "topk:k=7,indices=raw", "dgc:ratio=0.02,indices=raw"]
SHAPES = [(0,), (1,), (5,), (3, 4), (2, 3, 5, 7), (40_000,)]


def _x(shape, dtype=torch.float32, seed=0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(shape, generator=g).to(dtype)


def ref_order(x: torch.Tensor) -> torch.Tensor:
    """All indices by decreasing |x| (NaN > Inf > finite), ties to the lowest index."""
    a = x.reshape(-1).double().abs()
    a[torch.isinf(a)] = 1e300
    a[torch.isnan(a)] = math.inf
    return torch.sort(-a, stable=True).indices


def ref_topk(x: torch.Tensor, k: int) -> torch.Tensor:
    """Sort-based reference top-k, indices ascending."""
    return torch.sort(ref_order(x)[:k]).values


def _indices(c, p: Packet) -> torch.Tensor:
    if c.name == "randomk":  # none on the wire: drawn again from the packet's key
        return c._indices(p)
    sec = p.sections[0]
    if sec.kind == Kind.INDICES:
        return sec.data.long()
    return indexcodec.decode(sec.data, p.sections[1].data.numel(), p.numel)


# ---- round trips ----------------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_round_trip(spec: str, dtype: torch.dtype) -> None:
    c = gradwire.compressor(spec)
    for shape in SHAPES:
        x = _x(shape, dtype, seed=len(shape))
        p = c.encode(x, Ctx(seed=1, step=2, key=3))
        y = c.decode(p.tensor())
        assert y.shape == x.shape and y.dtype == x.dtype
        assert torch.equal(c.decode(p), y)  # Packet object or bytes
        out = torch.full_like(x, 7.0)
        assert c.decode(p.tensor(), out=out) is out and torch.equal(out, y)
        idx = _indices(c, p)
        flat_x, flat_y = x.reshape(-1), y.reshape(-1)
        k = c.value_count(x.numel())
        if k is not None:
            assert idx.numel() == k
        assert idx.numel() == p.section(Kind.VALUES).numel()
        if idx.numel() > 1:
            assert bool((idx[1:] > idx[:-1]).all())
        rest = torch.ones(x.numel(), dtype=torch.bool)
        rest[idx] = False
        assert not bool(flat_y[rest].any())
        if c.name == "randomk":
            _, length = c._strata(x.numel(), idx.numel(), "cpu")
            want = (flat_x[idx].float() * length).to(dtype)
            assert torch.equal(flat_y[idx], want)
        else:
            assert torch.equal(flat_y[idx], flat_x[idx])
        if c.name == "threshold":
            assert torch.equal(idx, torch.nonzero(flat_x.float().abs() >= c.threshold).view(-1))
        if c.name in ("topk", "dgc") and not getattr(c, "chunk", 0):  # (chunked: its own test, below)
            assert torch.equal(idx, ref_topk(x, k))


@pytest.mark.parametrize("spec", RAW_SPECS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_static_size_matches_packet(spec: str, dtype: torch.dtype) -> None:
    c = gradwire.compressor(spec)
    for shape in SHAPES + [(1000, 3)]:
        x = _x(shape, dtype)
        p = c.encode(x)
        numel = x.numel()
        k = c.value_count(numel)
        isz = torch.empty((), dtype=dtype).element_size()
        sizes = [k * 4, k * isz]
        header = 24 + 8 * len(shape) + 16 * len(sizes)
        formula = header + sum((s + 7) // 8 * 8 for s in sizes)
        assert c.static_size(numel, dtype, shape) == formula == p.nbytes == p.tensor().numel()


def test_static_size_unknown_when_data_dependent() -> None:
    assert gradwire.compressor("topk").static_size(1000) is None  # indices=auto
    assert gradwire.compressor("topk:indices=packed").static_size(1000) is None
    assert gradwire.compressor("threshold:indices=raw").static_size(1000) is None
    assert gradwire.compressor("threshold").value_count(1000) is None


def test_value_count_formula() -> None:
    c = gradwire.compressor("topk:ratio=0.07")
    assert c.value_count(100) == 7  # 0.07 * 100 == 7.000000000000001 in floats
    assert c.value_count(101) == 8
    assert c.value_count(1) == 1 and c.value_count(0) == 0
    assert gradwire.compressor("topk").value_count(25_000_000) == 250_000
    assert gradwire.compressor("topk:ratio=1.0").value_count(9) == 9
    assert gradwire.compressor("topk:k=5").value_count(3) == 3
    assert gradwire.compressor("topk:k=5,ratio=0.5").value_count(100) == 5
    assert gradwire.compressor("randomk:ratio=0.25").value_count(10) == 3


# ---- topk / dgc exactness ----------------------------------------------------------------

def _exact_cases():
    g = torch.Generator().manual_seed(11)
    n = 200_000  # above the exact-only size: exercises sampling, candidates and selection
    yield "randn", torch.randn(n, generator=g)
    yield "ties", torch.randint(-3, 4, (n,), generator=g).float()
    yield "all_equal", torch.full((n,), -2.5)
    yield "zeros", torch.zeros(n)
    yield "one_big", torch.zeros(n).index_fill_(0, torch.tensor([n - 1]), 1.0)
    x = torch.randn(n, generator=g)
    x[[5, 70_000, 123_456]] = torch.tensor([math.nan, math.inf, -math.inf])
    x[[9, 10]] = torch.tensor([-math.nan, math.nan])
    yield "nonfinite", x
    yield "all_nan", torch.full((n,), math.nan)
    yield "tiny", torch.randn(n, generator=g) * 1e-40  # subnormals
    yield "fp16_ties", torch.randn(n, generator=g).half()
    yield "bf16", torch.randn(n, generator=g).bfloat16()
    # Sampled rows (every 97th run of 16) hold huge values: the sample overestimates the
    # threshold, so selection must retry and finally fall back to every element.
    x = torch.randn(n, generator=g) * 1e-3
    x.view(-1, 16)[::97] = 5.0
    yield "adversarial_sample", x
    # Clustered: one block of big values and sparse noise elsewhere.
    x = torch.randn(n, generator=g) * 1e-2
    x[50_000:52_000] = torch.randn(2000, generator=g) * 10
    yield "clustered", x


@pytest.mark.parametrize("name,x", list(_exact_cases()), ids=[n for n, _ in _exact_cases()])
def test_topk_and_dgc_match_sort_reference(name: str, x: torch.Tensor, cpu_path) -> None:
    """On both CPU paths: the candidate scan in NumPy, and compiled (one torch thread)."""
    n = x.numel()
    order = ref_order(x)
    for k in (1, 37, 2_000, 60_000, n - 1):
        want = torch.sort(order[:k]).values
        for fn in (lambda: select.topk(x, k), lambda: dgc._dgc(x, k, 0.01)):
            idx, vals = fn()
            assert torch.equal(idx, want), (name, k)
            assert torch.equal(vals.view(torch.uint8), x[want].view(torch.uint8)), (name, k)


@pytest.mark.parametrize("name,x", [c for c in _exact_cases() if c[0] in ("ties", "nonfinite", "clustered", "fp16_ties")],
                         ids=["ties", "nonfinite", "clustered", "fp16_ties"])
def test_chunked_topk_keeps_each_chunks_largest(name: str, x: torch.Tensor) -> None:
    """chunk=C: every run of C elements keeps its own ceil(ratio * C) largest (the last,
    shorter run from its own length; `k` per chunk when given), NaN > Inf > finite, ties to the
    lowest index; the count is exact in the packet and the values are the input's."""
    n = x.numel()
    for spec, chunk, per in (("topk:ratio=0.01,chunk=4096", 4096, lambda m: math.ceil(0.01 * m)),
                             ("topk:k=5,chunk=1000", 1000, lambda m: min(5, m)),
                             ("topk:ratio=0.3,chunk=7", 7, lambda m: math.ceil(0.3 * m))):
        c = gradwire.compressor(spec)
        want = torch.cat([ref_topk(x[s: s + chunk], per(min(chunk, n - s))) + s for s in range(0, n, chunk)])
        p = c.encode(x)
        assert c.value_count(n) == want.numel() == p.sections[1].data.numel(), spec
        assert torch.equal(_indices(c, p), want), (name, spec)
        assert torch.equal(c.decode(p).view(-1)[want].view(torch.uint8), x[want].view(torch.uint8)), (name, spec)


def test_chunked_topk_is_refused_by_the_strategies_that_select_from_the_sum() -> None:
    from gradwire.comm.artopk import ARTopK
    from gradwire.comm.oktopk import OkTopK

    for cls in (OkTopK, ARTopK):
        with pytest.raises(ValueError, match="plain topk compressor"):
            cls(None, "topk:ratio=0.01,chunk=4096")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="chunk"):
        gradwire.compressor("topk:chunk=-1")


def test_device_path_matches_host_path(monkeypatch) -> None:
    # CPU tensors finish selection in NumPy; other devices use torch ops throughout. Run the
    # torch path on the CPU and require identical packets.
    cases = [dict(_exact_cases())[name] for name in ("ties", "nonfinite", "adversarial_sample", "bf16")]
    specs = ["topk:ratio=0.01", "topk:ratio=0.3", "dgc:ratio=0.02", "threshold:threshold=1.0", "randomk:ratio=0.01"]
    host = {(i, s): gradwire.compressor(s).encode(x, Ctx(seed=1)).tensor() for i, x in enumerate(cases) for s in specs}
    monkeypatch.setattr(select, "on_host", lambda t: False)
    for (i, spec), want in host.items():
        assert torch.equal(gradwire.compressor(spec).encode(cases[i], Ctx(seed=1)).tensor(), want), (i, spec)
    small = _x(1000)
    assert torch.equal(select.topk(small, 10)[0], ref_topk(small, 10))


def test_topk_small_and_retry_paths(cpu_path) -> None:
    g = torch.Generator().manual_seed(12)
    for n in (2, 3, 100, 1000, 32_768, 32_769, 99_999):
        x = torch.randn(n, generator=g)
        x[torch.randint(0, n, (n // 3,), generator=g)] = 0.5  # many ties
        for k in (1, max(1, n // 100), n // 2, n - 1):
            assert torch.equal(select.topk(x, k)[0], ref_topk(x, k)), (n, k)


def test_topk_encode_does_not_run_torch_topk(monkeypatch) -> None:
    def boom(*a, **kw):
        raise AssertionError("torch.topk on the full tensor")

    monkeypatch.setattr(torch, "topk", boom)
    monkeypatch.setattr(torch.Tensor, "topk", boom)
    x = _x(300_000)
    for spec in ("topk:ratio=0.01", "dgc:ratio=0.01"):
        c = gradwire.compressor(spec)
        idx = _indices(c, c.encode(x))
        assert idx.numel() == 3000


def test_nonfinite_survive_topk_dgc_threshold(cpu_path) -> None:
    x = _x(50_000)
    x[[3, 400, 40_000, 49_999]] = torch.tensor([math.nan, math.inf, -math.inf, -math.nan])
    for spec in ("topk:ratio=0.001", "topk:k=4", "dgc:ratio=0.001", "threshold:threshold=100.0"):
        c = gradwire.compressor(spec)
        for dtype in DTYPES:
            xd = x.to(dtype)
            y = c.decode(c.encode(xd).tensor())
            assert torch.isnan(y[[3, 49_999]]).all(), spec
            assert y[400] == math.inf and y[40_000] == -math.inf, spec


def test_threshold_boundary_is_exact(cpu_path) -> None:
    # |x| >= t in real numbers, whatever the dtype's rounding of t: float32(0.7) < 0.7 and
    # bfloat16(0.7) < 0.7 are dropped, float16(0.7) > 0.7 is kept.
    for t in (0.7, 0.3, 1.0, 1e-30, 70000.0):
        c = gradwire.compressor(f"threshold:threshold={t}")
        for dtype in DTYPES:
            info = torch.finfo(dtype)
            near = torch.tensor([t], dtype=torch.float64).to(dtype)
            up = torch.nextafter(near, torch.tensor([info.max], dtype=dtype))
            down = torch.nextafter(near, torch.tensor([0.0], dtype=dtype))
            x = torch.cat([near, up, down, -near, -up, -down,
                           torch.tensor([0.0, info.max, math.inf, math.nan], dtype=dtype)])
            keep = (x.double().abs() >= t) | torch.isnan(x)
            y = c.decode(c.encode(x))
            assert torch.equal((y != 0) | torch.isnan(y), keep), (t, dtype, x, y)
    x32 = torch.tensor([0.7], dtype=torch.float32)
    assert float(x32) < 0.7 and not bool(gradwire.compressor("threshold:threshold=0.7").decode(
        gradwire.compressor("threshold:threshold=0.7").encode(x32)).any())


# ---- randomk ---------------------------------------------------------------------------

def test_randomk_one_per_stratum_and_unbiased() -> None:
    x = _x(64, seed=5)
    c = gradwire.compressor("randomk:ratio=0.25")  # 16 strata of 4: decode = 4 * sampled value
    total = torch.zeros(64, dtype=torch.float64)
    trials = 500
    for seed in range(trials):
        p = c.encode(x, Ctx(seed=seed, step=3, key=1))
        idx = _indices(c, p)
        assert torch.equal(idx // 4, torch.arange(16))
        total += c.decode(p).double()
    mean = total / trials
    # Each element is kept w.p. 1/4 and scaled by 4: the per-element std of the mean is
    # |x| * sqrt(3 / trials) ~ 0.077 |x|, so the relative error norm is ~0.077 (+-10%);
    # a missing scale would give 0.75, a stratum edge never drawn ~0.5.
    rel = float((mean - x.double()).norm() / x.double().norm())
    assert rel < 0.15, rel


def test_randomk_uneven_strata_unbiased() -> None:
    x = _x(10, seed=6)
    c = gradwire.compressor("randomk:k=3")  # strata of 3, 3, 4
    total = torch.zeros(10, dtype=torch.float64)
    for seed in range(600):
        total += c.decode(c.encode(x, Ctx(seed=seed))).double()
    assert float(((total / 600) - x.double()).norm() / x.double().norm()) < 0.2


def test_randomk_summable_across_ranks() -> None:
    c = gradwire.compressor("randomk:ratio=0.05")
    assert c.summable and c.stochastic
    like = _x((30, 40), seed=0)
    xs = [_x((30, 40), seed=r + 10) for r in range(3)]
    payload = sum(c.to_summable(x, Ctx(seed=4, step=5, rank=r, key=6)) for r, x in enumerate(xs))
    assert payload.shape == (c.value_count(1200),)
    got = c.from_summable(payload, like, Ctx(seed=4, step=5, rank=0, key=6))
    want = sum(c.decode(c.encode(x, Ctx(seed=4, step=5, rank=r, key=6))) for r, x in enumerate(xs))
    assert got.shape == like.shape
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
    # Indices do not depend on the rank; they do on seed, step and key.
    idx = [_indices(c, c.encode(xs[0], Ctx(seed=4, step=5, rank=r, key=6))) for r in range(3)]
    assert torch.equal(idx[0], idx[1]) and torch.equal(idx[0], idx[2])
    for ctx in (Ctx(seed=5, step=5, key=6), Ctx(seed=4, step=6, key=6), Ctx(seed=4, step=5, key=7)):
        assert not torch.equal(idx[0], _indices(c, c.encode(xs[0], ctx)))


def test_randomk_summable_nonfinite_poisons_result() -> None:
    c = gradwire.compressor("randomk:ratio=0.01")
    xs = [_x(1000, seed=r) for r in range(2)]
    xs[1][777] = math.inf  # almost surely not sampled
    payload = sum(c.to_summable(x, Ctx(rank=r)) for r, x in enumerate(xs))
    assert not torch.isfinite(c.from_summable(payload, xs[0])).any()


def test_randomk_nonfinite_anywhere_decodes_nonfinite() -> None:
    c = gradwire.compressor("randomk:ratio=0.01")
    for dtype in DTYPES:
        for bad in (math.nan, math.inf, -math.inf):
            x = _x(10_000, dtype)
            x[4321] = bad
            y = c.decode(c.encode(x).tensor())
            assert not torch.isfinite(y).any()
        y = c.decode(c.encode(_x(10_000, dtype)))
        assert torch.isfinite(y).all()


def test_randomk_large_strata() -> None:
    # Strata longer than 2**24 use two 24-bit draws; indices still one per stratum.
    c = gradwire.compressor("randomk:k=2")
    start, length = c._strata(40_000_000, 2, "cpu")
    idx = c._sample(40_000_000, 2, Ctx(seed=1), "cpu")
    assert bool(((idx >= start) & (idx < start + length)).all())


def test_randomk_chain_summable() -> None:
    c = gradwire.compressor("randomk:ratio=0.1+fp16")
    assert c.summable
    xs = [_x(500, seed=r) for r in range(3)]
    payload = sum(c.to_summable(x, Ctx(seed=2, rank=r)) for r, x in enumerate(xs))
    assert payload.dtype == torch.float16
    got = c.from_summable(payload, xs[0], Ctx(seed=2))
    want = sum(c.decode(c.encode(x, Ctx(seed=2, rank=r))) for r, x in enumerate(xs))
    torch.testing.assert_close(got, want, rtol=1e-2, atol=3e-2)  # fp16 sums of 10x-scaled values



def test_randomk_packet_has_no_indices_and_exact_size() -> None:
    c = gradwire.compressor("randomk:ratio=0.1")
    x = _x((1000, 3))
    ctx = Ctx(seed=1, step=2, rank=5, key=3)
    p = c.encode(x, ctx)
    assert p.kinds() == [Kind.META, Kind.VALUES, Kind.SENTINEL]
    k0, k1 = gradwire.compress.rng.stream_key(1, 2, 0, 3, stream=c.codec_id)  # rank-free
    assert int(p.section(Kind.META)[0]) & (2**64 - 1) == k0 | k1 << 32
    # header 24 + 8 * ndim 2 + 16 * 3 sections = 88; META 8; VALUES 300 fp32 = 1200; SENTINEL 4 -> 8
    assert p.nbytes == p.tensor().numel() == c.static_size(3000, torch.float32, (1000, 3)) == 88 + 8 + 1200 + 8
    for dtype in DTYPES:
        for shape in SHAPES + [(1000, 3)]:
            n = math.prod(shape)
            k = c.value_count(n)
            want = 24 + 8 * len(shape) + 48 + 8 + -(-k * _x(1, dtype).element_size() // 8) * 8 + 8
            p = c.encode(_x(shape, dtype))
            assert p.tensor().numel() == c.static_size(n, dtype, shape) == want, (dtype, shape)
    # 25M fp32 at 1%: the values and 96 bytes, a fifth less than with packed indices
    assert c.static_size(25_000_000) is not None
    assert gradwire.compressor("randomk:ratio=0.01").static_size(25_000_000) == 1_000_000 + 96


def test_randomk_has_no_indices_option() -> None:
    for spec in ("randomk:indices=raw", "randomk:indices=packed", "randomk:ratio=0.1,indices=auto"):
        with pytest.raises(ValueError, match="indices"):
            gradwire.compressor(spec)


def test_randomk_strata_match_the_formula() -> None:
    for numel, k in [(10, 3), (1000, 7), (12345, 1000), (100, 100), ((1 << 33) + 7, 12345), (25_000_017, 250_000)]:
        start, length = RandomK._strata(numel, k, "cpu")
        i = torch.arange(k + 1, dtype=torch.int64)
        edges = i * (numel // k) + (i * (numel % k)) // k  # the torch formula (other devices)
        assert torch.equal(start, edges[:-1]) and torch.equal(length, edges[1:] - edges[:-1]), (numel, k)
        for j in (0, k // 2, k - 1):  # and exact integers
            assert int(start[j]) == j * numel // k and int(length[j]) == (j + 1) * numel // k - j * numel // k


def test_randomk_forged_key_moves_values_within_their_strata() -> None:
    c = gradwire.compressor("randomk:k=40")
    x = _x(1000, seed=8)
    p = c.encode(x, Ctx(seed=3))
    start, length = c._strata(1000, 40, "cpu")
    seen = set()
    for word in (0, -1, 1, 2**63 - 1, -(2**63), 0x1234_5678_9ABC_DEF0):
        buf = _forge(p, 0, torch.tensor([word], dtype=torch.int64))
        y = c.decode(buf)
        idx = torch.nonzero(y).view(-1)
        # the values land elsewhere, but one per stratum and nowhere else
        assert idx.numel() == 40 and bool(((idx >= start) & (idx < start + length)).all()), word
        assert torch.equal(y[idx], p.section(Kind.VALUES) * length.float())
        assert torch.equal(idx, c._draw(1000, 40, randomk._key_of(word), "cpu")[0])
        assert torch.equal(c.add_decoded(buf, torch.zeros(1000)), y)
        seen.add(tuple(idx.tolist()))
    assert len(seen) > 1


def test_randomk_decode_on_another_process_draws_the_same_positions() -> None:
    import subprocess
    import sys

    c = gradwire.compressor("randomk:ratio=0.01")
    x = _x(100_000, seed=4)
    p = c.encode(x, Ctx(seed=7, step=11, rank=0, key="layer.weight"))
    code = ("import sys, torch, gradwire; c = gradwire.compressor('randomk:ratio=0.01'); "
            "b = torch.frombuffer(bytearray(sys.stdin.buffer.read()), dtype=torch.uint8); "
            "y = c.decode(b, shape=(100000,), dtype=torch.float32); "
            "sys.stdout.write(' '.join(map(str, torch.nonzero(y).view(-1).tolist())))")
    got = subprocess.run([sys.executable, "-c", code], input=bytes(p.tensor().numpy()), capture_output=True,
                         check=True).stdout.decode().split()
    want = c._sample(100_000, 1000, Ctx(seed=7, step=11, rank=3, key="layer.weight"), "cpu")  # any rank
    assert [int(i) for i in got] == want.tolist()


# ---- determinism, configs ----------------------------------------------------------------

@pytest.mark.parametrize("spec", SPECS)
def test_same_ctx_same_bytes(spec: str) -> None:
    c = gradwire.compressor(spec)
    x = _x((50, 60))
    a = c.encode(x, Ctx(seed=1, step=2, rank=3, key=4)).tensor()
    b = c.encode(x.clone(), Ctx(seed=1, step=2, rank=3, key=4)).tensor()
    assert torch.equal(a, b)
    other = c.encode(x, Ctx(seed=2, step=2, rank=3, key=4)).tensor()
    if c.stochastic:
        assert not torch.equal(a, other)
    else:
        assert torch.equal(a, other)


@pytest.mark.parametrize("spec", SPECS + ["topk", "dgc", "randomk", "threshold", "topk:k=100,ratio=0.5",
                                          "dgc:sample_ratio=0.2", "threshold:threshold=2.5e-07"])
def test_config_round_trip(spec: str) -> None:
    c = gradwire.compressor(spec)
    assert gradwire.compressor(str(c)) == c
    assert gradwire.from_config(c.get_config()) == c
    assert type(c).from_config(c.get_config()) == c
    assert c.role == "sparse"


def test_registry_ids() -> None:
    ids = {name: gradwire.compressor(name).codec_id for name in ("topk", "randomk", "threshold", "dgc")}
    assert ids == {"topk": 6, "randomk": 7, "threshold": 8, "dgc": 9}
    assert str(gradwire.compressor("topk:ratio=0.01")) == "topk"


@pytest.mark.parametrize("spec", ["topk:ratio=0", "topk:ratio=1.5", "topk:k=0", "topk:indices=zip",
                                  "randomk:ratio=-1", "threshold:threshold=0", "threshold:threshold=-1",
                                  "dgc:sample_ratio=0", "dgc:ratio=nan", "topk:bogus=1", "threshold:ratio=0.1"])
def test_bad_configs(spec: str) -> None:
    with pytest.raises(ValueError):
        gradwire.compressor(spec)


# ---- edge cases ------------------------------------------------------------------------

@pytest.mark.parametrize("spec", ["topk", "dgc", "randomk", "threshold", "topk:indices=raw"])
def test_edge_cases(spec: str) -> None:
    c = gradwire.compressor(spec)
    for dtype in DTYPES:
        empty = torch.empty(0, 3, dtype=dtype)
        assert c.decode(c.encode(empty).tensor()).shape == (0, 3)
        one = torch.tensor([-2.5], dtype=dtype)
        assert torch.equal(c.decode(c.encode(one).tensor()), one)
        zeros = torch.zeros(4, 5, dtype=dtype)
        assert torch.equal(c.decode(c.encode(zeros).tensor()), zeros)
    # non-contiguous input
    base = _x((300, 200))
    for x in (base.t(), base[:, ::3], base[::2, 1::2].t()):
        assert not x.is_contiguous()
        y = c.decode(c.encode(x).tensor())
        want = c.decode(c.encode(x.contiguous()).tensor())
        assert torch.equal(y, want)


def test_k_at_least_numel_keeps_everything() -> None:
    x = _x((7, 3))
    for spec in ("topk:k=21", "topk:k=1000", "topk:ratio=1.0", "dgc:k=50", "randomk:k=30"):
        c = gradwire.compressor(spec)
        assert torch.equal(c.decode(c.encode(x).tensor()), x), spec


def test_all_zeros_picks_lowest_indices() -> None:
    c = gradwire.compressor("topk:k=5,indices=raw")
    p = c.encode(torch.zeros(100_000))
    assert torch.equal(p.sections[0].data, torch.arange(5, dtype=torch.int32))


def test_encode_does_not_alias_input() -> None:
    x = _x(100)
    sent = x.clone()
    c = gradwire.compressor("topk:ratio=1.0")
    p = c.encode(x)
    x.zero_()
    assert torch.equal(c.decode(p), sent)  # every element was kept, and the packet owns its values


# ---- chains and wire efficiency ----------------------------------------------------------

def test_topk_fp16_chain() -> None:
    x = _x((100, 100))
    c = gradwire.compressor("topk:ratio=0.01+fp16")
    p = c.encode(x)
    assert p.kinds()[1] == Kind.NESTED
    y = c.decode(p.tensor())
    idx = ref_topk(x, 100)
    assert torch.equal(y.reshape(-1)[idx], x.reshape(-1)[idx].half().float())
    assert int((y != 0).sum()) == 100
    raw = gradwire.compressor("topk:ratio=0.01,indices=raw+fp16")
    assert raw.static_size(10_000, torch.float32, (100, 100)) == raw.encode(x).nbytes


def _mlp_gradient() -> torch.Tensor:
    torch.manual_seed(0)
    net = torch.nn.Sequential(torch.nn.Linear(256, 256), torch.nn.ReLU(), torch.nn.Linear(256, 256),
                              torch.nn.ReLU(), torch.nn.Linear(256, 10))
    loss = torch.nn.functional.cross_entropy(net(torch.randn(64, 256)), torch.randint(0, 10, (64,)))
    loss.backward()
    return torch.cat([p.grad.reshape(-1) for p in net.parameters()])


def _bytes_per_kept(spec: str, x: torch.Tensor) -> float:
    c = gradwire.compressor(spec)
    first = c.stages[0] if hasattr(c, "stages") else c
    return c.encode(x).nbytes / first.value_count(x.numel())


def test_wire_efficiency_on_gradients() -> None:
    g = _mlp_gradient()
    assert _bytes_per_kept("topk:ratio=0.01", g) <= 5.0
    assert _bytes_per_kept("topk:ratio=0.01+fp16", g) <= 3.0
    # Uniformly random positions: the index entropy at 1% is ~8.08 bits, so ~1.02 bytes.
    x = _x(1_000_000)
    assert _bytes_per_kept("topk:ratio=0.01", x) <= 5.05
    assert _bytes_per_kept("topk:ratio=0.01+fp16", x) <= 3.05
    # auto never costs more than raw
    for spec in ("topk:ratio=0.3", "topk:ratio=0.01"):
        auto = gradwire.compressor(spec).encode(x).nbytes
        raw = gradwire.compressor(spec + ",indices=raw").encode(x).nbytes
        assert auto <= raw


# ---- corrupted packets -----------------------------------------------------------------

def _forge(p: Packet, i: int, data: torch.Tensor, kind: Kind | None = None) -> torch.Tensor:
    sections = list(p.sections)
    sections[i] = Section(kind or sections[i].kind, data)
    return Packet(p.codec, p.dtype, p.shape, sections, p.config, p.flags).tensor()


def test_corrupt_raw_indices() -> None:
    c = gradwire.compressor("topk:k=4,indices=raw")
    x = _x(100)
    p = c.encode(x)
    idx, vals = p.sections[0].data, p.sections[1].data
    cases = {
        "out of range": idx.clone().index_fill_(0, torch.tensor([3]), 100),
        "negative": idx.clone().index_fill_(0, torch.tensor([0]), -1),
        "ascending": idx.flip(0).contiguous(),
        "ascending ": torch.tensor([1, 5, 5, 9], dtype=torch.int32),
    }
    for match, bad in cases.items():
        with pytest.raises(WireFormatError, match=match.strip()):
            c.decode(_forge(p, 0, bad))
    with pytest.raises(WireFormatError, match="INDICES count"):
        c.decode(_forge(p, 0, idx[:3].clone()))
    with pytest.raises(WireFormatError, match="VALUES count"):
        c.decode(_forge(_forge_packet(p, 0, idx[:3].clone()), 1, vals[:3].clone()))
    with pytest.raises(WireFormatError, match="INDICES dtype"):
        c.decode(_forge(p, 0, idx.long()))
    with pytest.raises(WireFormatError, match="VALUES dtype"):
        c.decode(_forge(p, 1, vals.double()))
    with pytest.raises(WireFormatError, match="INDICES_PACKED"):
        c.decode(_forge(p, 0, indexcodec.encode(idx.long()), Kind.INDICES_PACKED))  # raw config


def _forge_packet(p: Packet, i: int, data: torch.Tensor) -> Packet:
    sections = list(p.sections)
    sections[i] = Section(sections[i].kind, data)
    return Packet(p.codec, p.dtype, p.shape, sections, p.config, p.flags)


def test_corrupt_packed_indices() -> None:
    c = gradwire.compressor("topk:ratio=0.01,indices=packed")
    x = _x(100_000)
    p = c.encode(x)
    packed = p.sections[0].data
    assert p.sections[0].kind == Kind.INDICES_PACKED
    with pytest.raises(WireFormatError, match="INDICES_PACKED"):
        c.decode(_forge(p, 0, packed[:-3].clone()))  # truncated
    with pytest.raises(WireFormatError, match="INDICES_PACKED"):
        c.decode(_forge(p, 0, packed[:2].clone()))
    bad = packed.clone()
    bad[0] = 40  # width > 32
    with pytest.raises(WireFormatError, match="width 40 exceeds 32"):
        c.decode(_forge(p, 0, bad))
    huge = indexcodec.encode(torch.tensor([0, 5, 10**6]))  # count mismatch and range
    with pytest.raises(WireFormatError):
        c.decode(_forge(p, 0, huge))
    # the right count, but the last index is past numel
    k = c.value_count(100_000)
    far = torch.cat([torch.arange(k - 1), torch.tensor([100_000])])
    with pytest.raises(WireFormatError, match="out of range"):
        c.decode(_forge(p, 0, indexcodec.encode(far)))


def test_corrupt_fixed_k_and_sections() -> None:
    c = gradwire.compressor("topk:k=4")
    p = c.encode(_x(100))
    small = gradwire.compressor("topk:k=3").encode(_x(100))
    small.config = p.config  # right checksum, wrong k
    with pytest.raises(WireFormatError, match="k=4"):
        c.decode(small.tensor())
    with pytest.raises(WireFormatError, match="sections"):
        c.decode(Packet(p.codec, p.dtype, p.shape, p.sections[:1], p.config).tensor())
    with pytest.raises(WireFormatError, match="VALUES"):
        c.decode(Packet(p.codec, p.dtype, p.shape, [p.sections[0], Section(Kind.DATA, p.sections[1].data)],
                        p.config).tensor())
    with pytest.raises(WireFormatError, match="codec"):
        gradwire.compressor("dgc:k=4").decode(p.tensor())


def test_corrupt_randomk() -> None:
    c = gradwire.compressor("randomk:k=4")
    x = _x(100)
    p = c.encode(x, Ctx(seed=3))
    key, vals, sentinel = (sec.data for sec in p.sections)
    with pytest.raises(WireFormatError, match="k=4"):  # wrong k
        c.decode(_forge(p, 1, vals[:3].clone()))
    with pytest.raises(WireFormatError, match="k=4"):
        c.decode(_forge(p, 1, torch.cat([vals, vals])))
    small = gradwire.compressor("randomk:k=3").encode(x, Ctx(seed=3))
    small.config = p.config  # right checksum, wrong k
    with pytest.raises(WireFormatError, match="k=4"):
        c.decode(small.tensor())
    with pytest.raises(WireFormatError, match="META"):
        c.decode(_forge(p, 0, key.view(torch.int32).clone()))
    with pytest.raises(WireFormatError, match="META"):
        c.decode(_forge(p, 0, torch.cat([key, key])))
    with pytest.raises(WireFormatError, match="META"):
        c.decode(_forge(p, 0, key.new_empty(0)))
    with pytest.raises(WireFormatError, match="VALUES dtype"):
        c.decode(_forge(p, 1, vals.double()))
    with pytest.raises(WireFormatError, match="SENTINEL"):
        c.decode(_forge(p, 2, torch.zeros(2)))
    with pytest.raises(WireFormatError, match="SENTINEL"):
        c.decode(_forge(p, 2, torch.zeros(1), Kind.META))
    with pytest.raises(WireFormatError, match="sections"):
        c.decode(Packet(p.codec, p.dtype, p.shape, p.sections[:2], p.config).tensor())
    # the old layout (indices instead of a key) is refused, not misread
    old = [Section(Kind.INDICES, torch.tensor([3, 30, 60, 90], dtype=torch.int32)), p.sections[1], p.sections[2]]
    with pytest.raises(WireFormatError, match="no indices"):
        c.decode(Packet(p.codec, p.dtype, p.shape, old, p.config).tensor())
    buf = p.tensor()
    for cut in (1, 4, 8, 16, buf.numel() - 24):  # truncated anywhere
        with pytest.raises(WireFormatError):
            c.decode(buf[:-cut].clone())
    with pytest.raises(WireFormatError):
        c.decode(torch.cat([buf, torch.zeros(8, dtype=torch.uint8)]))  # trailing bytes
    with pytest.raises(WireFormatError, match="shape"):  # a packet for another tensor
        c.decode(buf, shape=(101,))


def test_threshold_variable_count_checks() -> None:
    c = gradwire.compressor("threshold:threshold=1.0,indices=raw")
    p = c.encode(_x(1000))
    idx, vals = p.sections[0].data, p.sections[1].data
    assert idx.numel() == vals.numel() > 0
    with pytest.raises(WireFormatError, match="INDICES count"):
        c.decode(_forge(p, 1, vals[:-1].clone()))
    with pytest.raises(WireFormatError, match="exceeds numel"):
        c.decode(_forge(_forge_packet(p, 0, torch.arange(1001, dtype=torch.int32)), 1, torch.ones(1001)))
