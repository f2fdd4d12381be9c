"""gradwire's kernels under the ThreadSanitizer pass of the emulator (tools/cuda_emulator/tsan.py).

The top-k, quantizer, cast, scatter, byte-plane and fused error-feedback kernels run
under TSan through the compressors' CUDA paths (the emulated device), and must be
race-free and still byte-identical to the CPU. That the pass reports what no fiber
schedule shows is the emulator's own test (tools/cuda_emulator/tests/test_emulator_tsan.py).
"""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire.compress import lossless
from gradwire.compress.base import Ctx

import cuda_emulator
from cuda_emulator import tsan

pytestmark = pytest.mark.skipif(not (cuda_emulator.available() and not torch.backends.cuda.is_built() and tsan.available()),
                                reason="needs g++ with ThreadSanitizer on x86-64 and CPU-only torch")


CTX = Ctx(seed=3, step=5, rank=1, key=77)
SPECS = ["topk:ratio=0.01,indices=raw", "topk:ratio=0.01", "dgc:ratio=0.01", "threshold:threshold=1.0,indices=raw",
         "randomk:ratio=0.01", "int8", "fp8", "qsgd", "terngrad", "sign", "onebit", "fp16", "zstd"]


@pytest.mark.parametrize("spec", SPECS)
def test_kernels_are_race_free_under_tsan(spec, monkeypatch):
    from cuda_emulator.device import EmulatedDevice

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
    from cuda_emulator.device import EmulatedDevice

    x = torch.randn(10_007).to(torch.bfloat16)
    with EmulatedDevice("lowest", tsan=True):
        planes = lossless.split_planes(x.cuda())
        back = lossless.merge_planes(planes, torch.bfloat16).cpu()
        planes = planes.cpu()
    assert torch.equal(planes, lossless.split_planes(x))
    assert torch.equal(back.view(torch.int16), x.view(torch.int16))


EF_SPECS = ["fp16", "fp8", "fp4:chunk=37", "int8:chunk=37", "qsgd:bits=4", "terngrad:bucket=0", "sign", "onebit",
            "topk:ratio=0.01,indices=raw"]


@pytest.mark.parametrize("spec", EF_SPECS)
def test_feedback_kernels_are_race_free_under_tsan(spec):
    """The fused error-feedback kernels (feedback.cu), with a step where many threads flag a
    non-finite residual at once; DGC momentum's for the sparsifier. The state stays the CPU's."""
    from gradwire import DGCMomentum, ErrorFeedback
    from cuda_emulator.device import EmulatedDevice

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
