"""Error feedback and DGC momentum on CUDA tensors: the fused kernels (kernels/feedback.cu).

Each test runs on the backends of tests/cuda/test_cuda_parity.py (a GPU where there is one, the
CPU emulator under two schedules). Over several steps -- a non-finite first step, an Inf,
an fp16 overflow, clean steps between -- the CUDA state must equal the CPU path's bit for
bit wherever the CPU encode is bit-exact on a GPU (casts, fp8, int8, terngrad, the
sparsifiers), and the unfused device steps (tests/support/feedback_oracle.py on the device: the
plain encode and decode kernels) for every compressor, qsgd/sign/onebit included. On the
emulator, a step must also allocate no full-size tensor and launch exactly the fused kernels.
"""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import Ctx, DGCMomentum, ErrorFeedback

from tensors import bits
from feedback_oracle import OracleErrorFeedback
from test_cuda_parity import cases, dev  # noqa: F401 - dev is the backend fixture

EXACT = ["none", "fp16", "bf16", "fp8", "fp8:format=e5m2,chunk=100", "fp4:chunk=37", "int8", "int8:chunk=37", "terngrad",
         "terngrad:bucket=0", "topk:ratio=0.05", "topk:ratio=0.05,indices=raw", "dgc:ratio=0.05",
         "threshold:threshold=1.0"]
APPROX = ["qsgd", "qsgd:bits=4,bucket=100", "sign:chunk=333", "onebit", "onebit:chunk=100"]
DTYPES = [torch.float32, torch.float16, torch.bfloat16]
SIZES = [7, 4097, 65537]  # none a multiple of a block, a group of 8 or a chunk


def clean(n: int, seed: int, count: int) -> list[torch.Tensor]:
    """Finite fp32 inputs of a wide dynamic range."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(n, generator=g) * torch.exp(torch.randn(n, generator=g)) for _ in range(count)]


def steps(n: int, dtype: torch.dtype, seed: int = 0, count: int = 6) -> list[torch.Tensor]:
    """Steps with a NaN (the first step), an Inf, an fp16 overflow and clean steps between."""
    xs = clean(n, seed, count)
    xs[0][3 % n] = float("nan")
    xs[2][n // 2] = float("inf")
    xs[4] *= 1e5  # finite, but overflows fp16
    return [x.to(dtype) for x in xs]


def _finite(x: torch.Tensor) -> bool:
    return bool(torch.isfinite(x).all())


def _keep_size(backend: str, spec: str, n: int, dtype: torch.dtype) -> bool:
    return n < 65537 or dtype == torch.float32


@pytest.mark.parametrize("dev,spec,n,dtype", cases(EXACT, SIZES, DTYPES, keep=_keep_size), indirect=["dev"])
def test_error_feedback_matches_cpu_bit_for_bit(dev, spec, n, dtype):
    cpu, gpu = ErrorFeedback(spec), ErrorFeedback(spec)
    before = None
    for t, x in enumerate(steps(n, dtype, seed=n)):
        ctx = Ctx(seed=3, step=t, rank=1, key=n)
        keep = x.clone()
        xg = x.cuda()
        pc, pg = cpu.encode(x, "w", ctx), gpu.encode(xg, "w", ctx)
        got = gpu.residual("w").cpu()
        assert torch.equal(bits(got), bits(cpu.residual("w"))), f"step {t}: residuals differ"
        if _finite(x):  # NaN chunks may hold other codes (docs/cuda.md); the step is skipped anyway
            assert torch.equal(pg.tensor().cpu(), pc.tensor()), f"step {t}: packets differ"
        else:  # state untouched (zeros on a first step)
            assert torch.equal(bits(got), bits(before if before is not None else torch.zeros_like(x)))
        assert torch.equal(bits(xg.cpu()), bits(keep))  # the input is not modified
        before = got
    assert _finite(before)
    if spec not in ("fp16", "bf16"):  # (a cast may hold every element exactly)
        assert (before != 0).any() != (spec == "none")


@pytest.mark.parametrize("dev,spec,dtype", cases(APPROX + ["int8:chunk=37", "fp16", "topk:ratio=0.05", "dgc:ratio=0.05"],
                                                 DTYPES), indirect=["dev"])
def test_error_feedback_matches_the_unfused_device_steps(dev, spec, dtype):
    """Against x + e, the plain CUDA encode, its CUDA decode, the subtraction and
    torch.where(isfinite(.).all()): bit for bit, also where the CPU differs in last bits."""
    comp = gradwire.compressor(spec)
    fused, plain = ErrorFeedback(comp), OracleErrorFeedback(comp)
    n = 4097
    for t, x in enumerate(steps(n, dtype, seed=1)):
        ctx = Ctx(seed=3, step=t, rank=1, key=9)
        xg = x.cuda()
        pf = fused.encode(xg, "w", ctx)
        pp, _ = plain.encode_decode(xg, "w", ctx)
        assert torch.equal(bits(fused.residual("w").cpu()), bits(plain.residuals["w"].cpu())), f"step {t}"
        if _finite(x):
            assert torch.equal(pf.tensor().cpu(), pp.tensor().cpu()), f"step {t}: packets differ"


@pytest.mark.parametrize("dev,spec,nesterov,dtype", cases(
    ["topk:ratio=0.05", "dgc:ratio=0.05", "threshold:threshold=1.0", "topk:ratio=0.05+fp16", "int8"], [False, True],
    DTYPES, keep=lambda b, s, nes, d: d != torch.bfloat16 or s == "topk:ratio=0.05"), indirect=["dev"])
def test_dgc_momentum_matches_cpu_bit_for_bit(dev, spec, nesterov, dtype):
    cpu, gpu = DGCMomentum(spec, 0.8, nesterov), DGCMomentum(spec, 0.8, nesterov)
    for t, g in enumerate(steps(4097, dtype, seed=2)):
        ctx = Ctx(step=t)
        pc, pg = cpu.encode(g, "w", ctx), gpu.encode(g.cuda(), "w", ctx)
        if _finite(g):
            assert torch.equal(pg.tensor().cpu(), pc.tensor()), f"step {t}: packets differ"
        assert torch.equal(bits(gpu.u["w"].cpu()), bits(cpu.u["w"])), f"step {t}: u differs"
        assert torch.equal(bits(gpu.v["w"].cpu()), bits(cpu.v["w"])), f"step {t}: v differs"
    assert (gpu.v["w"].cpu() != 0).any()


# ---- one step: which kernels, which allocations (emulator only: it sees every allocation) ------
FE = "feedback.cu:"
STEADY = {  # spec -> the launches of one error-feedback step on fp32 (after the sparsifier's selection)
    "none": [FE + "ef_cast<0, 0>"],
    "fp16": [FE + "ef_cast<0, 1>"],
    "bf16": [FE + "ef_cast<0, 2>"],
    "fp8": [FE + "ef_seg_reduce<0, 0>", "elementwise.cu:seg_finish<0, 0>", FE + "ef_fp8<0, 0>"],
    "fp4:chunk=37": [FE + "ef_seg_reduce<0, 0>", "elementwise.cu:seg_finish<0, 0>", FE + "ef_fp4<0>"],
    "int8:chunk=37": [FE + "ef_seg_reduce<0, 1>", "elementwise.cu:seg_finish<1, 1>", FE + "ef_int8<0>"],
    "qsgd:bits=4": [FE + "ef_seg_reduce<0, 3>", "elementwise.cu:seg_finish<3, 2>", FE + "ef_stochastic<0>"],
    "terngrad:bucket=0": [FE + "ef_seg_reduce<0, 0>", "elementwise.cu:seg_finish<0, 3>", FE + "ef_stochastic<0>"],
    "sign": [FE + "ef_seg_reduce<0, 2>", "elementwise.cu:seg_finish<2, 4>", FE + "ef_sign<0, 0>"],
    "onebit": [FE + "ef_seg_reduce<0, 4>", "elementwise.cu:seg_finish<4, 5>", FE + "ef_sign<0, 1>"],
    "topk:ratio=0.01,indices=raw": [FE + "ef_sub_sent<0, long long>"],
    "dgc:ratio=0.01": [FE + "ef_sub_sent<0, long long>"],
    "threshold:threshold=8.0,indices=raw": [FE + "ef_sub_sent<0, long long>"],
}
_DECODERS = ("decode", "scatter", "cast_kernel", "fill_sentinel")


def host(t: torch.Tensor) -> torch.Tensor:
    """The CPU tensor holding an emulated tensor's bytes (its data_ptr is the device pointer's stand-in)."""
    from cuda_emulator.device import host as emu_host

    return emu_host(t)


def _step(dev, run, syncs: int) -> tuple[list[str], list[int]]:
    """The launches and the device allocations (bytes) of run(), which must read from the
    device exactly `syncs` times."""
    dev.emu.launcher.names.clear()
    with dev.emu.count_allocations() as sizes, dev.emu.count_host_reads() as reads:
        run()
    assert reads[0] == syncs
    return list(dev.emu.launcher.names), sizes


@pytest.mark.parametrize("dev,spec", cases(list(STEADY)), indirect=["dev"])
def test_error_feedback_step_is_fused_and_allocates_no_full_size_tensor(dev, spec):
    if dev.emu is None:
        pytest.skip("allocations and launches are listed by the emulator")
    n = 65537
    ef = ErrorFeedback(spec)
    xs = [x.cuda() for x in clean(n, 4, 5)]
    ptrs, packets = set(), []
    for t, x in enumerate(xs[:2]):
        ef.encode(x, "w", Ctx(step=t))
    for t, x in enumerate(xs[2:], start=2):
        syncs = 1 if spec.startswith(("dgc", "threshold")) else 0  # their data-dependent count
        names, sizes = _step(dev, lambda: packets.append(ef.encode(x, "w", Ctx(step=t))), syncs)
        ptrs.add(host(ef.residual("w")).data_ptr())
        assert names[-1] == FE + "ef_keep<u32>", names  # the state choice moves nothing on a finite step
        if gradwire.compressor(spec).role == "sparse":  # its selection kernels first, then ours
            assert [m for m in names if m.startswith(FE)] == STEADY[spec] + [FE + "ef_keep<u32>"], names
        else:
            assert names == STEADY[spec] + [FE + "ef_keep<u32>"], names
        assert not any(d in m for m in names for d in _DECODERS), names  # nothing decodes a dense tensor
        big = [s for s in sizes if s >= n]  # a full-size fp32 tensor is 4n bytes; a quarter of it is n
        assert big in ([], [packets[-1].nbytes]), (big, packets[-1].nbytes)  # only the packet itself
    assert len(ptrs) == 2  # the residual flips between two persistent buffers


@pytest.mark.parametrize("dev,nesterov", cases([False, True]), indirect=["dev"])
def test_dgc_momentum_step_is_fused_and_allocates_no_full_size_tensor(dev, nesterov):
    if dev.emu is None:
        pytest.skip("allocations and launches are listed by the emulator")
    n = 65537
    dgc = DGCMomentum("topk:ratio=0.01,indices=raw", 0.9, nesterov)
    gs = [g.cuda() for g in clean(n, 5, 3)]
    for t, g in enumerate(gs[:2]):
        dgc.encode(g, "w", Ctx(step=t))
    names, sizes = _step(dev, lambda: dgc.encode(gs[2], "w", Ctx(step=2)), 0)
    assert names[0] == FE + "dgc_accumulate<0>", names
    assert [m for m in names if m.startswith(FE)] == [FE + "dgc_accumulate<0>", FE + "dgc_sent<0, long long>",
                                                      FE + "ef_keep<u32>", FE + "ef_keep<u32>"], names
    assert not any(d in m for m in names for d in _DECODERS), names
    assert [s for s in sizes if s >= n] == [], sizes  # the packet of 1% is small too
