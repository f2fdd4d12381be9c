"""GPU packets against the CPU reference (marker `gpu`; skipped without CUDA and CuPy).

Byte-identical: every compressor whose arithmetic has no floating-point reduction (casts,
fp8, int8, terngrad, the sparsifiers, byte planes, zstd frames). Within tolerance: qsgd
(L2 norms), sign and onebit (means) -- their sums run in another order on the GPU, so
scales may differ in the last bits; the bits that do not depend on a sum (signs) must
still match exactly, and qsgd levels may move by one step where a scale's last-bit
difference crosses a rounding point. Tolerances are in docs/cuda.md.
"""

from __future__ import annotations

import warnings

import pytest
import torch

import gradwire
from gradwire.compress import lossless
from gradwire.compress.base import Ctx
from gradwire.compress.wire import Kind, parse
from gradwire.errors import WireFormatError

from conftest import bits


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available() or not _has_cupy(), reason="needs CUDA and CuPy")]

SIZES = [0, 1, 7, 1000, 4097, 65537, 1_000_003]
BIG = (1 << 24) + 3  # > 2**24 elements: index and RNG arithmetic past 24 bits
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CTX = Ctx(seed=3, step=5, rank=1, key=77)
EXACT = ["none", "fp16", "bf16", "fp8", "fp8:format=e5m2,chunk=100", "int8", "int8:chunk=37",
         "terngrad", "terngrad:bucket=0", "topk:ratio=0.01,indices=raw", "topk:ratio=0.01",
         "topk:k=1", "dgc:ratio=0.01", "randomk:ratio=0.01,indices=raw", "threshold:threshold=0.5,indices=raw",
         "threshold:threshold=2.5", "topk:ratio=0.01,indices=raw+fp16", "topk:ratio=0.05,indices=raw+int8"]
APPROX = ["qsgd", "qsgd:bits=4,bucket=100", "qsgd:bits=1", "sign", "sign:chunk=333", "onebit", "onebit:chunk=100"]


def data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))  # wide dynamic range
    if n > 10:
        x[n // 3] = x[n // 5]  # an exact tie
    return x.to(dtype)


def packets(spec: str, x: torch.Tensor):
    comp = gradwire.compressor(spec)
    return comp, comp.encode(x, CTX), comp.encode(x.cuda(), CTX)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("spec", EXACT)
def test_byte_identical(spec, n, dtype):
    x = data(n, dtype, seed=n)
    comp, cpu, gpu = packets(spec, x)
    assert torch.equal(gpu.tensor().cpu(), cpu.tensor()), spec
    want = comp.decode(cpu)
    got = comp.decode(gpu)
    assert got.is_cuda and torch.equal(bits(got.cpu()), bits(want))
    assert torch.equal(bits(comp.decode(gpu.tensor().cpu())), bits(want))  # a CPU peer reads it


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01,indices=raw", "dgc:ratio=0.001", "fp8", "int8", "terngrad",
                                  "randomk:ratio=0.001,indices=raw", "bf16"])
def test_byte_identical_past_2_24(spec, dtype):
    x = data(BIG, dtype, seed=1)
    _, cpu, gpu = packets(spec, x)
    assert torch.equal(gpu.tensor().cpu(), cpu.tensor()), spec


def _sections(p):
    return {i: s.data.cpu() for i, s in enumerate(p.sections)}


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", SIZES[1:] + [BIG])
@pytest.mark.parametrize("spec", APPROX)
def test_within_tolerance(spec, n, dtype):
    if n == BIG and dtype == torch.float16:
        pytest.skip("one 16-bit dtype is enough at this size")
    x = data(n, dtype, seed=n)
    comp, cpu, gpu = packets(spec, x)
    c, g = _sections(cpu), _sections(gpu)
    assert [s.kind for s in gpu.sections] == [s.kind for s in cpu.sections]
    torch.testing.assert_close(g[0], c[0], rtol=2e-5, atol=0)  # scales: another summation order
    assert torch.equal(g[1], c[1])  # sign bits: no reduction involved
    want, got = comp.decode(cpu).float(), comp.decode(gpu).cpu().float()
    ulp = {torch.float32: 2e-5, torch.float16: 1e-3, torch.bfloat16: 8e-3}[dtype]  # output rounding may flip
    if spec.startswith("qsgd"):
        cfg = comp.get_config()
        step = c[0].repeat_interleave(cfg["bucket"])[:n] / ((1 << cfg["bits"]) - 1)
        # a level may move by one step where the scale's last bits cross a rounding point
        assert bool(((got - want).abs() <= step * 1.01 + ulp * want.abs() + 1e-30).all())
        assert (got != want).float().mean().item() < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=ulp, atol=0)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("spec", ["fp8", "int8", "qsgd", "terngrad", "sign", "onebit", "topk:ratio=0.01",
                                  "randomk:ratio=0.01", "threshold:threshold=1.0", "fp16"])
def test_nonfinite_stays_nonfinite(spec, dtype):
    x = data(10_000, dtype, seed=2)
    x[1234] = float("nan")
    x[5000] = float("inf")
    comp, cpu, gpu = packets(spec, x)
    want, got = comp.decode(cpu), comp.decode(gpu).cpu()
    assert torch.equal(~torch.isfinite(got), ~torch.isfinite(want))


def test_randomk_sentinel_and_strata_on_device():
    comp = gradwire.compressor("randomk:ratio=0.01,indices=raw")
    x = data(100_000, torch.float32)
    p = comp.encode(x.cuda(), CTX)
    assert p.section(Kind.SENTINEL).item() == 0
    idx = p.section(Kind.INDICES).clone()
    idx[5], idx[6] = idx[6], idx[5]  # two strata swapped: each index now outside its stratum
    forged = gradwire.compress.wire.Packet(p.codec, p.dtype, p.shape,
                                           [gradwire.compress.wire.Section(Kind.INDICES, idx)] + p.sections[1:],
                                           p.config).freeze()
    with pytest.raises(WireFormatError):
        comp.decode(forged)


@pytest.mark.parametrize("index", [-1, 10**6, None])
def test_forged_indices_raise_without_writing_out_of_bounds(index):
    comp = gradwire.compressor("topk:ratio=0.01,indices=raw")
    p = comp.encode(data(100_000, torch.float32).cuda(), CTX)
    buf = p.tensor().clone()
    pk = parse(buf)
    idx = pk.section(Kind.INDICES)
    if index is None:
        idx[3] = idx[2]  # not strictly ascending
    else:
        idx[-1] = index
    with pytest.raises(WireFormatError):
        comp.decode(buf)
    torch.cuda.synchronize()  # the device is still healthy (no illegal address)


def test_runs_on_the_current_stream():
    comp = gradwire.compressor("topk:ratio=0.01,indices=raw")
    x = data(1_000_003, torch.float32).cuda()
    want = comp.encode(x, CTX).tensor().cpu()
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        y = x * 1.0  # produced on s: a kernel on another stream would race it
        got = comp.encode(y, CTX).tensor()
    torch.cuda.synchronize()
    assert torch.equal(got.cpu(), want)


@pytest.mark.parametrize("spec", ["fp16", "fp8", "int8", "qsgd", "terngrad", "sign", "onebit",
                                  "topk:ratio=0.01,indices=raw", "randomk:ratio=0.01,indices=raw"])
def test_static_size_encode_never_syncs(spec):
    comp = gradwire.compressor(spec)
    x = data(1_000_003, torch.float32).cuda()
    comp.encode(x, CTX)  # compile and warm caches first
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        p = comp.encode(x, CTX)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert p.nbytes == comp.static_size(x.numel(), x.dtype)


@pytest.mark.parametrize("spec", ["threshold:threshold=1.0,indices=raw", "dgc:ratio=0.01"])
def test_data_dependent_size_syncs_once(spec):
    comp = gradwire.compressor(spec)
    x = data(1_000_003, torch.float32).cuda()
    comp.encode(x, CTX)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("warn")
    try:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            comp.encode(x, CTX)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 65537])
def test_byte_planes_identical(dtype, n):
    x = data(n, dtype)
    want = lossless.split_planes(x)
    got = lossless.split_planes(x.cuda())
    assert torch.equal(got.cpu(), want)
    back = lossless.merge_planes(got, dtype)
    assert torch.equal(bits(back.cpu()), bits(x))


@pytest.mark.parametrize("spec", ["zstd", "topk:ratio=0.01+zstd", "fp8+zstd", "topk:ratio=0.01,indices=raw+fp16+zstd"])
def test_lossless_host_zstd_identical(spec, monkeypatch):
    monkeypatch.setenv("GRADWIRE_GPU_ENTROPY", "zstd")
    x = data(65537, torch.float32)
    comp, cpu, gpu = packets(spec, x)
    assert torch.equal(gpu.tensor().cpu(), cpu.tensor())
    assert torch.equal(bits(comp.decode(gpu).cpu()), bits(comp.decode(cpu)))


@pytest.mark.parametrize("spec", ["zstd", "topk:ratio=0.01+zstd", "int8+zstd"])
def test_lossless_nvcomp_round_trip(spec, monkeypatch):
    pytest.importorskip("nvidia.nvcomp")
    monkeypatch.setenv("GRADWIRE_GPU_ENTROPY", "ans")
    x = data(1_000_003, torch.bfloat16)
    comp, cpu, gpu = packets(spec, x)
    assert gpu.flags == lossless.FLAG_NVCOMP_ANS
    assert torch.equal(bits(comp.decode(gpu.tensor()).cpu()), bits(comp.decode(cpu)))
    with pytest.raises(WireFormatError):
        comp.decode(gpu.tensor().cpu())  # a CPU peer cannot read ANS frames, and says so
