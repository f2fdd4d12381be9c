"""GPU packets against the CPU reference, on a GPU and under the CPU emulator of the kernels.

Every test runs on each backend: `gpu` (marker `gpu`; needs CUDA and CuPy) and the
emulator (tools/cuda_emulator: the same kernel text compiled by g++, the same
`gradwire.cuda.ops` launch sequence, grids and arguments, on an emulated `cuda:0` whose
bytes live in CPU memory) under two thread/block schedules, lowest-first and seeded
random (which also splits `__activemask()` sets). The emulator runs on CPU-only torch
builds with g++ on x86-64, so CI executes every kernel; sizes are trimmed there (no
2^24 + 3 element top-k or within-tolerance runs, 1,000,003 elements for fp32 only) to
keep CI time in bounds.

Byte-identical: every compressor whose arithmetic has no floating-point reduction (casts,
fp8, fp4, int8, terngrad, the sparsifiers, byte planes, zstd frames). Within tolerance: qsgd
(L2 norms), sign and onebit (means) -- their sums run in another order on the GPU, so
scales may differ in the last bits; the bits that do not depend on a sum (signs) must
still match exactly, and qsgd levels may move by one step where a scale's last-bit
difference crosses a rounding point. Tolerances are in docs/cuda.md.
"""

from __future__ import annotations

import contextlib
import warnings
import zlib

import pytest
import torch

import gradwire
from gradwire.compress import lossless
from gradwire.compress.base import Ctx
from gradwire.compress.wire import Kind, parse
from gradwire.errors import WireFormatError

import cuda_emulator
from tensors import bits


def _has_cupy() -> bool:
    try:
        import cupy  # noqa: F401
    except Exception:
        return False
    return True


GPU = torch.cuda.is_available() and _has_cupy()
EMU = cuda_emulator.available() and not torch.backends.cuda.is_built()
# GPU rows exist only where they can run, so a CI machine lists no skipped GPU copies
BACKENDS = (("gpu",) if GPU else ()) + ("emu-lowest", "emu-random")
_MARKS = {"gpu": [pytest.mark.gpu, pytest.mark.skipif(not GPU, reason="needs CUDA and CuPy")],
          "emu-lowest": [pytest.mark.skipif(not EMU, reason="emulator: needs g++ on x86-64 and CPU-only torch")],
          "emu-random": [pytest.mark.skipif(not EMU, reason="emulator: needs g++ on x86-64 and CPU-only torch")]}

SIZES = [0, 1, 7, 1000, 4097, 65537, 1_000_003]
BIG = (1 << 24) + 3  # > 2**24 elements: index and RNG arithmetic past 24 bits
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
CTX = Ctx(seed=3, step=5, rank=1, key=77)
EXACT = ["none", "fp16", "bf16", "fp8", "fp8:format=e5m2,chunk=100", "fp4:chunk=37", "int8", "int8:chunk=37",
         "terngrad", "terngrad:bucket=0", "topk:ratio=0.01,indices=raw", "topk:ratio=0.01",
         "topk:k=1", "topk:ratio=0.01,chunk=1000", "dgc:ratio=0.01", "randomk:ratio=0.01", "threshold:threshold=0.5,indices=raw",
         "threshold:threshold=2.5", "topk:ratio=0.01,indices=raw+fp16", "topk:ratio=0.05,indices=raw+int8"]
APPROX = ["qsgd", "qsgd:bits=4,bucket=100", "qsgd:bits=1", "sign", "sign:chunk=333", "onebit", "onebit:chunk=100"]
BIG_SPECS = ["topk:ratio=0.01,indices=raw", "dgc:ratio=0.001", "fp8", "fp4", "int8", "terngrad",
             "randomk:ratio=0.001", "bf16"]
BIG_EMU = {"terngrad", "randomk:ratio=0.001", "bf16"}  # the rest: GPU only (CI time)


def cases(*axes, keep=lambda backend, *values: True) -> list:
    """pytest params (backend, *values) for every combination `keep` accepts."""
    import itertools

    out = []
    for backend in BACKENDS:
        for combo in itertools.product(*axes):
            if backend == "gpu" or keep(backend, *combo):
                ident = "-".join([backend, *(str(c).removeprefix("torch.") for c in combo)])
                out.append(pytest.param(backend, *combo, marks=_MARKS[backend], id=ident))
    return out


def emu_size(n: int, dtype: torch.dtype = torch.float32) -> bool:
    """Sizes the emulator runs: all up to 65537, 1,000,003 for fp32, nothing past 2^24."""
    return n <= 65537 or (n <= 1_000_003 and dtype == torch.float32)


class Backend:
    """What a test needs from the device beyond `.cuda()`: counting host synchronizations."""

    def __init__(self, emu: "cuda_emulator.device.EmulatedDevice | None"):
        self.emu = emu

    @contextlib.contextmanager
    def syncs(self):
        """Yields a one-element list: the block's host synchronizations (GPU: torch's sync
        debug mode warnings; emulator: device-to-host transfers, which are what syncs)."""
        box = [0]
        if self.emu is not None:
            with self.emu.count_host_reads() as got:
                yield box
            box[0] = got[0]
            return
        torch.cuda.set_sync_debug_mode("warn")
        try:
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                yield box
        finally:
            torch.cuda.set_sync_debug_mode(0)
        box[0] = len([w for w in caught if "synchroniz" in str(w.message).lower()])


@pytest.fixture
def dev(request):
    backend = request.param
    if backend == "gpu":
        yield Backend(None)
        return
    from cuda_emulator.device import EmulatedDevice

    schedule = "lowest" if backend == "emu-lowest" else f"random:{zlib.crc32(request.node.nodeid.encode())}"
    with EmulatedDevice(schedule) as d:
        yield Backend(d)


def data(n: int, dtype: torch.dtype, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g))  # wide dynamic range
    if n > 10:
        x[n // 3] = x[n // 5]  # an exact tie
    return x.to(dtype)


def packets(spec: str, x: torch.Tensor):
    comp = gradwire.compressor(spec)
    return comp, comp.encode(x, CTX), comp.encode(x.cuda(), CTX)


@pytest.mark.parametrize("dev,spec,n,dtype", cases(EXACT, SIZES, DTYPES, keep=lambda b, s, n, d: emu_size(n, d)),
                         indirect=["dev"])
def test_byte_identical(dev, spec, n, dtype):
    x = data(n, dtype, seed=n)
    comp, cpu, gpu = packets(spec, x)
    assert torch.equal(gpu.tensor().cpu(), cpu.tensor()), spec
    want = comp.decode(cpu)
    got = comp.decode(gpu)
    assert got.is_cuda and torch.equal(bits(got.cpu()), bits(want))
    assert torch.equal(bits(comp.decode(gpu.tensor().cpu())), bits(want))  # a CPU peer reads it


@pytest.mark.parametrize("dev,spec,dtype", cases(BIG_SPECS, [torch.float32, torch.bfloat16],
                                                 keep=lambda b, s, d: s in BIG_EMU and d == torch.float32),
                         indirect=["dev"])
def test_byte_identical_past_2_24(dev, spec, dtype):
    x = data(BIG, dtype, seed=1)
    _, cpu, gpu = packets(spec, x)
    assert torch.equal(gpu.tensor().cpu(), cpu.tensor()), spec


def _sections(p):
    return {i: s.data.cpu() for i, s in enumerate(p.sections)}


@pytest.mark.parametrize("dev,spec,n,dtype", cases(APPROX, SIZES[1:] + [BIG], DTYPES,
                                                   keep=lambda b, s, n, d: emu_size(n, d)), indirect=["dev"])
def test_within_tolerance(dev, spec, n, dtype):
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
        # moved levels are rare; every value of a chunk differs in its last bits when the
        # chunk's scale does, so count only differences beyond the scale's tolerance
        moved = (got - want).abs() > 2 * ulp * want.abs() + 1e-30
        assert moved.float().mean().item() < 1e-3
    else:
        torch.testing.assert_close(got, want, rtol=ulp, atol=0)


@pytest.mark.parametrize("dev,spec,dtype", cases(["fp8", "int8", "qsgd", "terngrad", "sign", "onebit", "topk:ratio=0.01",
                                                  "randomk:ratio=0.01", "threshold:threshold=1.0", "fp16"], DTYPES),
                         indirect=["dev"])
def test_nonfinite_stays_nonfinite(dev, spec, dtype):
    x = data(10_000, dtype, seed=2)
    x[1234] = float("nan")
    x[5000] = float("inf")
    comp, cpu, gpu = packets(spec, x)
    want, got = comp.decode(cpu), comp.decode(gpu).cpu()
    assert torch.equal(~torch.isfinite(got), ~torch.isfinite(want))


@pytest.mark.parametrize("dev", cases(), indirect=True)
def test_randomk_sentinel_and_forged_key_on_device(dev):
    comp = gradwire.compressor("randomk:ratio=0.01")
    x = data(100_000, torch.float32)
    p = comp.encode(x.cuda(), CTX)
    assert p.kinds() == [Kind.META, Kind.VALUES, Kind.SENTINEL]  # no indices on the device either
    assert p.section(Kind.SENTINEL).item() == 0
    start, length = comp._strata(100_000, 1000, "cpu")
    for word in (0, -1, 2**63 - 1, 0x0123_4567_89AB_CDEF):  # a forged key: other positions, never out of range
        forged = p.tensor().clone()
        parse(forged).section(Kind.META).fill_(word)
        got = comp.decode(forged).cpu()
        want = comp.decode(forged.cpu())
        assert torch.equal(bits(got), bits(want)), word
        idx = torch.nonzero(got).view(-1)
        assert idx.numel() == 1000 and bool(((idx >= start) & (idx < start + length)).all())
    torch.cuda.synchronize()  # the device is still healthy


@pytest.mark.parametrize("dev,index", cases([-1, 10**6, None]), indirect=["dev"])
def test_forged_indices_raise_without_writing_out_of_bounds(dev, index):
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
        comp.decode(buf)  # emulator: a write outside any buffer would raise EmulatorError instead
    torch.cuda.synchronize()  # the device is still healthy (no illegal address)


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="streams exist only on a GPU (the emulator runs launches in program order)")
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


def _sync_size(dev: Backend) -> int:
    return 65537 if dev.emu is not None else 1_000_003  # the count does not depend on the size


@pytest.mark.parametrize("dev,spec", cases(["fp16", "fp8", "int8", "qsgd", "terngrad", "sign", "onebit",
                                            "topk:ratio=0.01,indices=raw", "randomk:ratio=0.01"]),
                         indirect=["dev"])
def test_static_size_encode_never_syncs(dev, spec):
    comp = gradwire.compressor(spec)
    x = data(_sync_size(dev), torch.float32).cuda()
    comp.encode(x, CTX)  # compile and warm caches first
    torch.cuda.synchronize()
    if dev.emu is None:
        torch.cuda.set_sync_debug_mode("error")
        try:
            p = comp.encode(x, CTX)
        finally:
            torch.cuda.set_sync_debug_mode(0)
    else:
        with dev.syncs() as n:
            p = comp.encode(x, CTX)
        assert n[0] == 0
    assert p.nbytes == comp.static_size(x.numel(), x.dtype)


@pytest.mark.parametrize("dev,spec", cases(["threshold:threshold=1.0,indices=raw", "dgc:ratio=0.01"]),
                         indirect=["dev"])
def test_data_dependent_size_syncs_once(dev, spec):
    comp = gradwire.compressor(spec)
    x = data(_sync_size(dev), torch.float32).cuda()
    comp.encode(x, CTX)
    torch.cuda.synchronize()
    with dev.syncs() as n:
        comp.encode(x, CTX)
    assert n[0] == 1


@pytest.mark.parametrize("dev,dtype,n", cases(DTYPES, [0, 1, 7, 65537]), indirect=["dev"])
def test_byte_planes_identical(dev, dtype, n):
    x = data(n, dtype)
    want = lossless.split_planes(x)
    got = lossless.split_planes(x.cuda())
    assert torch.equal(got.cpu(), want)
    back = lossless.merge_planes(got, dtype)
    assert torch.equal(bits(back.cpu()), bits(x))


@pytest.mark.parametrize("dev,spec", cases(["zstd", "topk:ratio=0.01+zstd", "fp8+zstd",
                                            "topk:ratio=0.01,indices=raw+fp16+zstd"]), indirect=["dev"])
def test_lossless_host_zstd_identical(dev, spec, monkeypatch):
    monkeypatch.setenv("GRADWIRE_GPU_ENTROPY", "zstd")
    x = data(65537, torch.float32)
    comp, cpu, gpu = packets(spec, x)
    assert torch.equal(gpu.tensor().cpu(), cpu.tensor())
    assert torch.equal(bits(comp.decode(gpu).cpu()), bits(comp.decode(cpu)))


@pytest.mark.gpu
@pytest.mark.skipif(not GPU, reason="nvCOMP runs only on a GPU")
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
