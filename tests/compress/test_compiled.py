"""The compiled CPU loops (numba): when they run, and that they change nothing but speed.

Bit-for-bit parity of whole encodes with the torch path is in test_feedback.py (the oracle
tests run on both paths through the `cpu_path` fixture); here: the loops on their own and
DGC's in-place update, including its fallback when the overflow bound does not hold."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire import Ctx, DGCMomentum, ErrorFeedback
from gradwire.compress import compiled

from tensors import bits, randn


def test_loops_run_only_with_one_torch_thread(monkeypatch):
    assert compiled.loops() is not None, "numba is a dependency: the compiled loops must import"
    threads = torch.get_num_threads()
    try:
        monkeypatch.setenv("GRADWIRE_COMPILED", "1")
        torch.set_num_threads(2)
        assert not compiled.enabled()
        torch.set_num_threads(1)
        assert compiled.enabled()
        monkeypatch.setenv("GRADWIRE_COMPILED", "0")
        assert not compiled.enabled()
    finally:
        torch.set_num_threads(threads)


def test_absbits_max_sees_nan_inf_and_magnitudes():
    f = compiled.loops().absbits_max
    x = torch.tensor([0.5, -3.0, 2.0, -0.0])
    assert f(x.view(torch.int32).numpy()) == torch.tensor([3.0]).view(torch.int32).item()
    for bad in (float("nan"), float("inf"), float("-inf")):
        y = x.clone()
        y[1] = bad
        assert f(y.view(torch.int32).numpy()) >= 0x7F800000
    assert f(torch.zeros(0, dtype=torch.int32).numpy()) == 0


@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_updates_in_place_on_the_compiled_path(cpu_path, nesterov):
    """Compiled: u and v keep their memory and no spare buffer is made; torch: each step
    writes into spare buffers."""
    d = DGCMomentum("topk:ratio=0.1", 0.9, nesterov)
    ptrs = set()
    for t in range(5):
        d.encode(randn(3000, seed=t), "w", Ctx(step=t))
        ptrs.add((d.u["w"].data_ptr(), d.v["w"].data_ptr()))
    if cpu_path == "compiled":
        assert len(ptrs) == 1 and not d._spares._free
    else:
        assert len(ptrs) > 1


@pytest.mark.parametrize("big", [1e38, 4.2e37, -3e38])
def test_dgc_in_place_falls_back_where_the_bound_fails(cpu_path, big, small_tiles):
    """A finite gradient above FLT_MAX / 8 (which may overflow u or v) takes the spare-buffer
    path, which keeps the old state if the step overflows; afterwards the bounds are
    recomputed and the in-place path resumes. Every step matches the plain formulas."""
    from feedback_oracle import OracleDGCMomentum

    c = gradwire.compressor("dgc:ratio=0.05")
    new, old = DGCMomentum(c, 0.9), OracleDGCMomentum(c, 0.9)
    for t in range(8):
        g = randn(1500, seed=t)
        if t in (2, 3):
            g[10] = big
            g[11] = big
        pn = new.encode(g, "w", Ctx(step=t))
        po, _ = old.encode_decode(g, "w", Ctx(step=t))
        assert torch.equal(pn.tensor(), po.tensor()), f"step {t}: packets differ"
        assert torch.equal(bits(new.u["w"]), bits(old.u["w"])), f"step {t}: u differs"
        assert torch.equal(bits(new.v["w"]), bits(old.v["w"])), f"step {t}: v differs"
    assert torch.isfinite(new.v["w"]).all()


@pytest.mark.parametrize("spec", ["int8", "qsgd:bits=4", "terngrad", "terngrad:bucket=0", "qsgd:bits=8,bucket=7",
                                  "sign:chunk=100", "onebit:chunk=24"])
def test_quantizer_residuals_are_the_same_on_both_paths(spec, monkeypatch, small_tiles):
    """Odd sizes (partial chunks, partial tiles), several steps, the residual carried over."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        results = {}
        for path in ("0", "1"):
            monkeypatch.setenv("GRADWIRE_COMPILED", path)
            ef = ErrorFeedback(spec)
            out = []
            for t in range(4):
                p = ef.encode(randn(2053, seed=t) * (10.0 ** t), "w", Ctx(step=t, seed=5))
                out.append((p.tensor(), bits(ef.residual("w")).clone()))
            results[path] = out
        for (pa, ra), (pb, rb) in zip(results["0"], results["1"]):
            assert torch.equal(pa, pb) and torch.equal(ra, rb)
        assert (results["1"][-1][1] != 0).any()
    finally:
        torch.set_num_threads(threads)


@pytest.mark.parametrize("bad", [float("inf"), float("nan")])
@pytest.mark.parametrize("spec", ["int8:chunk=16", "sign:chunk=16", "onebit:chunk=16", "none"])
def test_non_finite_input_is_a_skipped_step(cpu_path, bad, spec):
    """int8, sign, onebit and none (lossless) judge finiteness from what they computed (the
    compiled loops' flags, the torch path's sums): a non-finite input is flagged and keeps the
    old residual, bit for bit."""
    ef = ErrorFeedback(spec)
    ef.encode(randn(64, seed=1), "w", Ctx(step=0))
    before = ef.residual("w").clone()
    x = randn(64, seed=2)
    x[40] = bad
    assert not bool(ef.compressor.encode_residual(x, before, torch.empty_like(x))[1])
    assert bool(ef.compressor.encode_residual(randn(64, seed=3), before, torch.empty_like(x))[1])
    ef.encode(x, "w", Ctx(step=1))
    assert torch.equal(bits(ef.residual("w")), bits(before))
    ef.encode(randn(64, seed=3), "w", Ctx(step=2))
    assert not torch.equal(bits(ef.residual("w")), bits(before)) or spec == "none"  # (none's residual: 0)


def test_dgc_with_several_keys_taking_turns(cpu_path, small_tiles):
    """Several buckets take turns, each with its own bounds and state; the state read in
    between matches the plain formulas."""
    from feedback_oracle import OracleDGCMomentum

    c = gradwire.compressor("topk:ratio=0.05")
    new, old = DGCMomentum(c, 0.9), OracleDGCMomentum(c, 0.9)
    for t in range(6):
        for key, n in (("a", 4000), ("b", 1500), ("c", 4000)):
            g = randn(n, seed=100 * t + n + len(key))
            pn = new.encode(g, key, Ctx(step=t, key=key))
            po, _ = old.encode_decode(g, key, Ctx(step=t, key=key))
            assert torch.equal(pn.tensor(), po.tensor())
        for key in "abc":
            assert torch.equal(bits(new.u[key]), bits(old.u[key]))
            assert torch.equal(bits(new.v[key]), bits(old.v[key]))
    state = new.state_dict()
    for key in "abc":
        assert torch.equal(bits(state["v"][key]), bits(old.v[key]))



def _scan_oracle(x: torch.Tensor, key: int) -> torch.Tensor:
    """The definition: ascending indices whose magnitude bits are >= key (NaN's are above Inf's)."""
    return torch.nonzero((x.view(torch.int32) & 0x7FFFFFFF) >= key).view(-1)


@pytest.mark.parametrize("n", [0, 1, 127, 128, 129, 100_003])
@pytest.mark.parametrize("threshold", [1e-3, 1.0, 2.6, 4.5, 1e30])
def test_compiled_scan_finds_what_the_numpy_scan_finds(cpu_path, n, threshold):
    """Candidates on both paths at densities from ~all to none (the compiled scan turns
    branch-free past 1/16), with NaN, +-Inf and -0.0 among them."""
    from gradwire.compress import select

    x = randn(n, seed=n)
    for i, special in zip(range(0, n, 997), (float("nan"), float("inf"), float("-inf"), -0.0, -float("nan"))):
        x[i] = special
    key = select.ceil_key(threshold, torch.float32)
    got = select.candidates(x, key)
    assert got.dtype == torch.int64 and torch.equal(got, _scan_oracle(x, key))


def test_compiled_scan_with_more_candidates_than_its_buffer():
    """Over a quarter passing overflows the scratch buffer: counted, then found again into a
    buffer of their size."""
    from gradwire.compress import select

    fast = compiled.loops()
    x = randn(5000, seed=3)
    key = select.ceil_key(0.5, torch.float32)
    out = select.candidate_buffer(0)[:100]
    count = fast.at_least(x.view(torch.int32).numpy(), key, out)
    want = _scan_oracle(x, key)
    assert count == want.numel() > 100
    assert torch.equal(select.found_indices(out, count, x, key), want)


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.02", "topk:ratio=0.05", "topk:ratio=0.3"])
@pytest.mark.parametrize("sampled_large", [False, True])
def test_dgc_pass_finds_the_candidates(cpu_path, nesterov, spec, sampled_large, monkeypatch):
    """Above the small-tensor size topk and dgc take their candidates from DGC momentum's
    compiled pass, not from a scan: packets, u and v equal the plain formulas' bit for bit.
    `sampled_large`: the sampled rows hold the largest values, so the first threshold
    finds too few candidates and the selection lowers it (scans of its own after the pass)."""
    from feedback_oracle import OracleDGCMomentum
    from gradwire.compress import select

    fast = compiled.loops()
    calls = []
    real = fast.dgc_inplace_at_least
    monkeypatch.setattr(fast, "dgc_inplace_at_least", lambda *a: calls.append(1) or real(*a))
    c = gradwire.compressor(spec)
    new, old = DGCMomentum(c, 0.9, nesterov), OracleDGCMomentum(c, 0.9, nesterov)
    n = 70_001
    for t in range(5):
        g = randn(n, seed=t)
        if sampled_large:
            g.mul_(0.01)
            select.sample_view(g, c._stride(n)).fill_(100.0 + t)
        pn = new.encode(g, "w", Ctx(step=t))
        po, _ = old.encode_decode(g, "w", Ctx(step=t))
        assert torch.equal(pn.tensor(), po.tensor()), f"step {t}: packets differ"
        assert torch.equal(bits(new.u["w"]), bits(old.u["w"])), f"step {t}: u differs"
        assert torch.equal(bits(new.v["w"]), bits(old.v["w"])), f"step {t}: v differs"
        if cpu_path == "compiled":  # the next step's overflow proof rests on these bounds
            ub, vb = new._bounds["w"]
            assert ub >= fast.absbits_max(new.u["w"].view(torch.int32).numpy()) > 0
            assert vb >= fast.absbits_max(new.v["w"].view(torch.int32).numpy()) > 0
    assert len(calls) == (5 if cpu_path == "compiled" else 0)


@pytest.mark.parametrize("spec", ["topk:ratio=0.01", "dgc:ratio=0.02", "topk:ratio=0.05,indices=packed",
                                  "threshold:threshold=1.5", "threshold:threshold=0.05"])
@pytest.mark.parametrize("sampled_large", [False, True])
def test_error_feedback_sum_finds_the_candidates(cpu_path, spec, sampled_large, monkeypatch):
    """Under error feedback, topk, dgc (above the small-tensor size) and threshold take their
    candidates from the pass that writes x + e, not from a scan: packets and residuals equal
    the plain formulas' bit for bit, through non-finite steps (kept state) and, with
    `sampled_large`, a first threshold that finds too few (the selection lowers it)."""
    from feedback_oracle import OracleErrorFeedback
    from gradwire.compress import select

    fast = compiled.loops()
    calls = []
    real = fast.sum_at_least
    monkeypatch.setattr(fast, "sum_at_least", lambda *a: calls.append(1) or real(*a))
    c = gradwire.compressor(spec)
    new, old = ErrorFeedback(c), OracleErrorFeedback(c)
    n = 70_001
    for t in range(6):
        x = randn(n, seed=t)
        if sampled_large and hasattr(c, "_stride"):
            x.mul_(0.01)
            select.sample_view(x, c._stride(n)).fill_(100.0 + t)
        if t == 2:
            x[777] = float("nan")
        if t == 3:
            x[70_000] = float("-inf")
        pn = new.encode(x, "w", Ctx(step=t))
        po, _ = old.encode_decode(x, "w", Ctx(step=t))
        assert torch.equal(pn.tensor(), po.tensor()), f"step {t}: packets differ"
        assert torch.equal(bits(new.residual("w")), bits(old.residuals["w"])), f"step {t}: residuals differ"
    assert len(calls) == (6 if cpu_path == "compiled" else 0)


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
def test_fp8_residual_loop_decodes_every_code_as_the_torch_path(fmt):
    """All 256 codes (subnormals, both zeros, the largest, NaN/Inf), two chunks with different
    factors: c - w * factor equals the torch path's bit for bit where the code is finite, and
    is finite where the torch path's is (e4m3's NaN codes decode finite there: only a chunk with
    a non-finite scale holds them)."""
    from gradwire.compress.quantize import fp8

    dtype = {"e4m3": torch.float8_e4m3fn, "e5m2": torch.float8_e5m2}[fmt]
    codes = torch.arange(256, dtype=torch.int16).to(torch.uint8).repeat(2).view(dtype)
    c = randn(512, seed=9) * 100
    factor = torch.tensor([3.0e-3, 7.5e2])
    lift = 1.0 if fmt == "e5m2" else 256.0
    w = torch.empty(512)
    got_lift = fp8._fp8_as_half(codes, fmt, torch.empty(512, dtype=torch.int32), w)
    assert got_lift == lift
    want = c - w * factor.repeat_interleave(256)
    out = torch.empty(512)
    compiled.loops().residual_fp8(c.numpy(), codes.view(torch.int8).numpy(), factor.numpy(), 256, fmt == "e5m2",
                                  out.numpy())
    finite = torch.isfinite(codes.float())
    assert finite.sum() >= 2 * 240
    assert torch.equal(bits(out[finite]), bits(want[finite]))
    assert torch.equal(torch.isfinite(out[~finite]), torch.isfinite(want[~finite]))
