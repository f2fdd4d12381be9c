"""ThreadSanitizer pass over the kernels (gradwire/cuda/emulator/tsan.py).

The fiber schedules never interleave a read-modify-write, so a non-atomic shared-memory
add looks correct under every one of them; TSan reports it. Then the top-k, quantizer,
cast, scatter and byte-plane kernels run under TSan through the compressors' CUDA paths
(the emulated device), and must be race-free and still byte-identical to the CPU.
"""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire.compress import lossless
from gradwire.compress.base import Ctx
from gradwire.cuda import emulator
from gradwire.cuda.emulator import Schedule, tsan

pytestmark = pytest.mark.skipif(not (emulator.available() and not torch.backends.cuda.is_built() and tsan.available()),
                                reason="needs g++ with ThreadSanitizer on x86-64 and CPU-only torch")

RACY = r"""
typedef unsigned int u32;
__global__ void shared_add(u32* out) {
    __shared__ u32 total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    total += 1;  // bug: a non-atomic read-modify-write by every thread
    __syncthreads();
    if (threadIdx.x == 0) *out = total;
}
__global__ void shared_atomic_add(u32* out) {
    __shared__ u32 total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, 1u);
    __syncthreads();
    if (threadIdx.x == 0) *out = total;
}
__global__ void shared_missing_barrier(u32* out) {
    __shared__ u32 v[64];
    v[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = v[63 - threadIdx.x];  // bug: reads another thread's write, no barrier
}
__global__ void warp_exchange(u32* out) {
    __shared__ u32 v[32];
    v[threadIdx.x] = threadIdx.x * 3u;
    __syncwarp();
    out[threadIdx.x] = v[31 - threadIdx.x];
}
__global__ void warp_exchange_shfl_only(u32* out) {
    __shared__ u32 v[32];
    v[threadIdx.x] = threadIdx.x * 3u;
    (void)__shfl_sync(0xFFFFFFFFu, 0u, 0);  // a shuffle exchanges registers, it orders no memory
    out[threadIdx.x] = v[31 - threadIdx.x];
}
"""
NAMES = ("shared_add", "shared_atomic_add", "shared_missing_barrier", "warp_exchange", "warp_exchange_shfl_only")


def test_non_atomic_shared_add_passes_every_schedule_but_not_tsan():
    mod = emulator.load("tsan_probe", RACY, NAMES)
    for schedule in (Schedule("lowest"), Schedule("highest"), Schedule("random", 5)):
        out = torch.zeros(1, dtype=torch.int32)
        mod.get_function("shared_add")(1, 64, (out,), schedule)
        assert out.item() == 64  # run-to-block scheduling never interleaves the add
    host = tsan.host("tsan_probe", RACY, NAMES)
    races, report, err = host.replay("shared_add", 1, 64, (torch.zeros(1, dtype=torch.int32),), Schedule())
    assert races >= 1 and "data race" in report and not err
    races, report, _ = host.replay("shared_atomic_add", 1, 64, (torch.zeros(1, dtype=torch.int32),), Schedule())
    assert races == 0, report
    races, report, _ = host.replay("shared_missing_barrier", 1, 64, (torch.zeros(64, dtype=torch.int32),), Schedule())
    assert races >= 1, report


def test_syncwarp_orders_shared_memory_and_a_shuffle_does_not():
    host = tsan.host("tsan_probe", RACY, NAMES)
    races, report, err = host.replay("warp_exchange", 1, 32, (torch.zeros(32, dtype=torch.int32),), Schedule())
    assert races == 0 and not err, report
    races, report, _ = host.replay("warp_exchange_shfl_only", 1, 32, (torch.zeros(32, dtype=torch.int32),),
                                   Schedule("random", 4))
    assert races >= 1, report


CTX = Ctx(seed=3, step=5, rank=1, key=77)
SPECS = ["topk:ratio=0.01,indices=raw", "topk:ratio=0.01", "dgc:ratio=0.01", "threshold:threshold=1.0,indices=raw",
         "randomk:ratio=0.01", "int8", "fp8", "qsgd", "terngrad", "sign", "onebit", "fp16", "zstd"]


@pytest.mark.parametrize("spec", SPECS)
def test_kernels_are_race_free_under_tsan(spec, monkeypatch):
    from gradwire.cuda.emulator.device import EmulatedDevice

    monkeypatch.setenv("GRADWIRE_GPU_ENTROPY", "zstd")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(20_011, generator=g) * torch.exp(torch.randn(20_011, generator=g))  # several blocks and tiles
    comp = gradwire.compressor(spec)
    want = comp.encode(x, CTX)
    with EmulatedDevice("random:3", tsan=True) as dev:  # a race raises EmulatorError at its launch
        got = comp.encode(x.cuda(), CTX)
        packet = got.tensor().cpu()
        decoded = comp.decode(got).cpu()
        assert dev.launcher.launches > 0
    if spec in ("qsgd", "sign", "onebit"):
        torch.testing.assert_close(decoded, comp.decode(want), rtol=1e-4, atol=1e-6)
    else:
        assert torch.equal(packet, want.tensor())
        assert torch.equal(decoded, comp.decode(want))


def test_byte_planes_race_free_under_tsan():
    from gradwire.cuda.emulator.device import EmulatedDevice

    x = torch.randn(10_007).to(torch.bfloat16)
    with EmulatedDevice("lowest", tsan=True):
        planes = lossless.split_planes(x.cuda())
        back = lossless.merge_planes(planes, torch.bfloat16).cpu()
        planes = planes.cpu()
    assert torch.equal(planes, lossless.split_planes(x))
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


EF_SPECS = ["fp16", "fp8", "int8:chunk=37", "qsgd:bits=4", "terngrad:bucket=0", "sign", "onebit",
            "topk:ratio=0.01,indices=raw"]


@pytest.mark.parametrize("spec", EF_SPECS)
def test_feedback_kernels_are_race_free_under_tsan(spec):
    """The fused error-feedback kernels (feedback.cu), with a step where many threads flag a
    non-finite residual at once; DGC momentum's for the sparsifier. The state stays the CPU's."""
    from gradwire import DGCMomentum, ErrorFeedback
    from gradwire.cuda.emulator.device import EmulatedDevice

    g = torch.Generator().manual_seed(2)
    xs = [torch.randn(20_011, generator=g) * torch.exp(torch.randn(20_011, generator=g)) for _ in range(3)]
    xs[1][::7] = float("inf")  # thousands of non-finite residuals in one launch
    cpu = ErrorFeedback(spec)
    with EmulatedDevice("random:3", tsan=True):
        gpu = ErrorFeedback(spec)
        for t, x in enumerate(xs):
            cpu.encode(x, "w", Ctx(step=t))
            gpu.encode(x.cuda(), "w", Ctx(step=t))
            got = gpu.residual("w").cpu()
            if spec not in ("qsgd:bits=4", "sign", "onebit"):  # sums in another order (docs/cuda.md)
                assert torch.equal(got, cpu.residual("w")), f"step {t}"
        if spec.startswith("topk"):
            dgc = DGCMomentum(spec)
            for t, x in enumerate(xs):
                dgc.encode(x.cuda(), "w", Ctx(step=t))
            assert torch.isfinite(dgc.v["w"].cpu()).all()
