"""ErrorFeedback and DGCMomentum: conservation, resumable state, non-finite steps."""

from __future__ import annotations

import io

import pytest
import torch

import gradwire
from gradwire import Ctx, DGCMomentum, ErrorFeedback

from tensors import bits, randn

LOSSY = ["bf16", "fp16", "topk:ratio=0.1", "topk:ratio=0.05+fp16", "qsgd:bits=2", "sign", "randomk:ratio=0.1"]


def _inputs(steps: int, shape=(3, 50), seed=0, scale=1.0):
    return [randn(shape, seed=seed + t) * scale for t in range(steps)]


def _roundtrip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf)


@pytest.mark.parametrize("spec", LOSSY)
def test_sent_plus_residual_equals_inputs(spec):
    ef = ErrorFeedback(gradwire.compressor(spec))
    xs = _inputs(60, seed=1)
    sent_total = torch.zeros(xs[0].shape, dtype=torch.float64)
    scale = torch.zeros(xs[0].shape, dtype=torch.float64)  # what fp32 rounding error can be relative to
    lossy = False
    for t, x in enumerate(xs):
        packet, sent = ef.encode_decode(x, key="w", ctx=Ctx(seed=4, step=t))
        assert torch.equal(sent, ef.compressor.decode(packet.tensor()))
        lossy |= not torch.equal(sent, x)
        sent_total += sent.double()
        scale += sent.double().abs() + x.double().abs() + ef.residual("w").double().abs()
    assert lossy
    residual = ef.residual("w").double()
    total = torch.stack(xs).double().sum(0)
    tol = scale * 2.0 ** -22  # two fp32 roundings per step
    assert (residual.abs() > 10 * tol).any(), "the residual must matter at this tolerance"
    err = (sent_total + residual - total).abs()
    assert (err <= tol).all(), f"max error {err.max():.3g}, tolerance there {tol.flatten()[err.argmax()]:.3g}"


def test_feedback_actually_feeds_back():
    """A value too small to survive one cast is sent once enough of it has built up."""
    ef = ErrorFeedback("bf16")
    x = torch.full((4,), 1.0 + 2 ** -10)  # bf16 keeps 8 bits: 1 + 2^-10 rounds to 1
    sent = [ef.encode_decode(x, 0)[1] for _ in range(8)]
    assert torch.equal(sent[0], torch.ones(4))
    assert any(s[0] > 1.0 for s in sent)
    torch.testing.assert_close(torch.stack(sent).sum(0) + ef.residual(0), x * 8)


@pytest.mark.parametrize("spec", ["bf16", "topk:ratio=0.1", "qsgd:bits=2", "topk:ratio=0.05+fp16"])
def test_state_dict_resumes_identically(spec):
    c = gradwire.compressor(spec)
    xs = _inputs(12, seed=3)
    a = ErrorFeedback(c)
    for t in range(6):
        a.encode(xs[t], "w", Ctx(seed=1, step=t))
        a.encode(xs[t][0], 7, Ctx(seed=1, step=t, key=7))
    state = a.state_dict()
    saved = {k: v.clone() for k, v in state["residuals"].items()}
    assert set(saved) == {"w", "7"} and state["compressor"] == str(c)
    b = ErrorFeedback(str(c))
    b.load_state_dict(_roundtrip(state))
    for t in range(6, 12):
        pa = a.encode(xs[t], "w", Ctx(seed=1, step=t))
        pb = b.encode(xs[t], "w", Ctx(seed=1, step=t))
        assert torch.equal(pa.tensor(), pb.tensor())
        qa = a.encode(xs[t][0], 7, Ctx(seed=1, step=t, key=7))
        qb = b.encode(xs[t][0], "7", Ctx(seed=1, step=t, key=7))
        assert torch.equal(qa.tensor(), qb.tensor())
    assert torch.equal(bits(a.residual("w")), bits(b.residual("w")))
    for k, v in saved.items():  # the state dict was a copy, untouched by later steps
        assert torch.equal(bits(state["residuals"][k]), bits(v))
    assert not torch.equal(a.residual("w"), saved["w"])


def test_load_state_dict_checks_the_compressor():
    a = ErrorFeedback("bf16")
    a.encode(randn(5), 0)
    with pytest.raises(ValueError, match="saved for compressor 'bf16'"):
        ErrorFeedback("fp16").load_state_dict(a.state_dict())


@pytest.mark.parametrize("spec", ["bf16", "fp16", "topk:ratio=0.1", "qsgd:bits=4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_non_finite_step_keeps_the_old_residual(spec, bad):
    c = gradwire.compressor(spec)
    xs = _inputs(5, shape=(200,), seed=7)
    skip = ErrorFeedback(c)
    clean = ErrorFeedback(c)
    for t in range(3):
        skip.encode(xs[t], "k", Ctx(step=t))
        clean.encode(xs[t], "k", Ctx(step=t))
    before = skip.residual("k").clone()
    assert before.abs().max() > 0
    poisoned = xs[3].clone()
    poisoned[17] = bad
    _, sent = skip.encode_decode(poisoned, "k", Ctx(step=3))
    assert not torch.isfinite(sent).all(), "an overflow step must decode non-finite (GradScaler must see it)"
    assert torch.equal(bits(skip.residual("k")), bits(before))
    # the skipped step leaves no trace: the next step is as if it never happened
    assert torch.equal(skip.encode(xs[4], "k", Ctx(step=4)).tensor(), clean.encode(xs[4], "k", Ctx(step=4)).tensor())


def test_non_finite_first_step_leaves_a_zero_residual():
    ef = ErrorFeedback("fp16")
    x = randn(10)
    x[3] = float("nan")
    ef.encode(x, "a")
    assert torch.equal(ef.residual("a"), torch.zeros(10))
    x = torch.full((10,), 1e6)  # overflows fp16: the residual would be -inf
    ef.encode(x, "a")
    assert torch.equal(ef.residual("a"), torch.zeros(10))


def test_keys_shapes_and_dtypes():
    ef = ErrorFeedback("bf16")
    ef.encode(randn((4, 5)), "a")
    ef.encode(randn(3, seed=1), "b")
    ef.encode(randn(3, seed=2), 5)
    assert ef.residual("5") is not None and ef.residual(5) is ef.residual("5")
    assert sorted(ef.state_dict()["residuals"]) == ["5", "a", "b"]
    with pytest.raises(ValueError, match="'a'.*\\(20,\\).*\\(4, 5\\)"):
        ef.encode(randn(20), "a")
    with pytest.raises(ValueError, match="'a'"):
        ef.encode(randn((5, 4)), "a")
    with pytest.raises(ValueError, match="float16"):
        ef.encode(randn((4, 5), torch.float16), "a")
    x = randn(3, seed=9)
    before = ef.residual("b").clone()
    with pytest.raises(ValueError):
        ef.encode(randn(4), "b")
    assert torch.equal(ef.residual("b"), before)
    ef.encode(x, "b")  # still usable
    ef.reset()
    assert ef.residual("a") is None and ef.state_dict()["residuals"] == {}


def test_input_is_not_modified():
    ef = ErrorFeedback("bf16")
    x = randn(50)
    keep = x.clone()
    for _ in range(3):
        ef.encode(x, 0)
    assert torch.equal(x, keep)


# ---- DGC momentum correction ---------------------------------------------------------------

@pytest.mark.parametrize("nesterov", [False, True])
def test_dgc_momentum_matches_the_reference_and_masks(nesterov):
    c = gradwire.compressor("topk:ratio=0.1")
    m = 0.9
    dgc = DGCMomentum(c, momentum=m, nesterov=nesterov)
    u = torch.zeros(300)
    v = torch.zeros(300)
    for t, g in enumerate(_inputs(15, shape=(300,), seed=11)):
        packet, sent = dgc.encode_decode(g, "layer", Ctx(step=t))
        u = u * m + g
        v = v + (u * m + g if nesterov else u)
        want = c.decode(c.encode(v, Ctx(step=t)))
        assert torch.equal(sent, want) and torch.equal(packet.tensor(), c.encode(v, Ctx(step=t)).tensor())
        hit = sent != 0
        assert hit.sum() == 30
        v = torch.where(hit, 0.0, v - sent)
        u = torch.where(hit, 0.0, u)
        assert torch.equal(dgc.u["layer"][hit], torch.zeros(30)) and torch.equal(dgc.v["layer"][hit], torch.zeros(30))
        torch.testing.assert_close(dgc.u["layer"], u, rtol=0, atol=0)
        torch.testing.assert_close(dgc.v["layer"], v, rtol=0, atol=0)
    assert (dgc.u["layer"] != 0).sum() > 200  # momentum kept where nothing was sent


def test_dgc_state_round_trip():
    c = gradwire.compressor("topk:ratio=0.05")
    xs = _inputs(10, shape=(400,), seed=5)
    a = DGCMomentum(c, momentum=0.8, nesterov=True)
    for t in range(5):
        a.encode(xs[t], 0, Ctx(step=t))
    state = _roundtrip(a.state_dict())
    b = DGCMomentum(str(c))  # other momentum/nesterov: the state carries them
    b.load_state_dict(state)
    assert b.momentum == 0.8 and b.nesterov is True
    for t in range(5, 10):
        assert torch.equal(a.encode(xs[t], 0, Ctx(step=t)).tensor(), b.encode(xs[t], "0", Ctx(step=t)).tensor())
    assert torch.equal(a.u["0"], b.u["0"]) and torch.equal(a.v["0"], b.v["0"])
    with pytest.raises(ValueError, match="saved for compressor"):
        DGCMomentum("topk:ratio=0.5").load_state_dict(state)


def test_dgc_non_finite_step_and_checks():
    c = gradwire.compressor("topk:ratio=0.1")
    dgc = DGCMomentum(c)
    for t in range(3):
        dgc.encode(randn(100, seed=t), "x", Ctx(step=t))
    u, v = dgc.u["x"].clone(), dgc.v["x"].clone()
    g = randn(100, seed=4)
    g[50] = float("inf")
    dgc.encode(g, "x", Ctx(step=3))
    assert torch.equal(dgc.u["x"], u) and torch.equal(dgc.v["x"], v)
    with pytest.raises(ValueError, match="'x'"):
        dgc.encode(randn(99), "x")
    for bad in (-0.1, 1.0, 1.5):
        with pytest.raises(ValueError, match="momentum"):
            DGCMomentum(c, momentum=bad)
    dgc.reset()
    assert dgc.u == {} and dgc.v == {}


# ---- the in-place updates against the original formulas (tests/support/feedback_oracle.py) ---------

ORACLE_SPECS = ["none", "fp16", "bf16", "fp8", "fp8:format=e5m2", "int8", "int8:chunk=100", "qsgd:bits=2",
                "qsgd:bits=4", "qsgd", "terngrad", "terngrad:bucket=0", "sign", "onebit:chunk=96",
                "topk:ratio=0.1", "topk:ratio=0.1,indices=raw", "dgc:ratio=0.05", "threshold:threshold=1.0",
                "randomk:ratio=0.1", "topk:ratio=0.1+fp16", "topk:ratio=0.1+qsgd:bits=4", "randomk:ratio=0.1+bf16",
                "dgc:ratio=0.1+int8", "topk:ratio=0.1+zstd", "int8+zstd"]


def _oracle_steps(dtype, n, seed):
    """Steps with a NaN, an Inf, an fp16 overflow and a clean recovery between them."""
    xs = _inputs(9, shape=(n,), seed=seed)
    xs[0][5] = float("nan")  # a non-finite first step
    xs[3][n // 2] = float("inf")
    xs[5][n - 1] = float("-inf")
    xs[7] *= 1e5  # overflows fp16 (and bf16 / fp8 stay finite)
    return [x.to(dtype) for x in xs]


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
@pytest.mark.parametrize("spec", ORACLE_SPECS)
def test_in_place_error_feedback_matches_the_original_bit_for_bit(spec, dtype, small_tiles, cpu_path):
    from feedback_oracle import OracleErrorFeedback

    c = gradwire.compressor(spec)
    new, old = ErrorFeedback(c), OracleErrorFeedback(c)
    for n, key in ((2000, "big"), (37, "small")):
        for t, x in enumerate(_oracle_steps(dtype, n, seed=n)):
            ctx = Ctx(seed=3, step=t, rank=1, key=n)
            keep = x.clone()
            pn, sn = new.encode_decode(x, key, ctx)
            po, so = old.encode_decode(x, key, ctx)
            assert torch.equal(pn.tensor(), po.tensor()), f"step {t}: packets differ"
            assert torch.equal(bits(sn), bits(so))
            assert torch.equal(bits(new.residual(key)), bits(old.residuals[key])), f"step {t}: residuals differ"
            assert torch.equal(bits(x), bits(keep))
    assert torch.isfinite(new.residual("big")).all()
    lossless = spec == "none" or (spec == "fp16" and dtype == torch.float16)
    assert (new.residual("big").abs().max() > 0) != lossless


@pytest.mark.parametrize("nesterov", [False, True])
@pytest.mark.parametrize("spec", ["topk:ratio=0.1", "dgc:ratio=0.05", "randomk:ratio=0.1", "threshold:threshold=1.0",
                                  "topk:ratio=0.1+fp16", "int8", "fp16"])
def test_in_place_dgc_momentum_matches_the_original_bit_for_bit(spec, nesterov, small_tiles, cpu_path):
    from feedback_oracle import OracleDGCMomentum

    c = gradwire.compressor(spec)
    new, old = DGCMomentum(c, 0.8, nesterov), OracleDGCMomentum(c, 0.8, nesterov)
    for t, g in enumerate(_oracle_steps(torch.float32, 1500, seed=2)):
        pn = new.encode(g, "w", Ctx(step=t))
        po, _ = old.encode_decode(g, "w", Ctx(step=t))
        assert torch.equal(pn.tensor(), po.tensor()), f"step {t}: packets differ"
        assert torch.equal(bits(new.u["w"]), bits(old.u["w"])), f"step {t}: u differs"
        assert torch.equal(bits(new.v["w"]), bits(old.v["w"])), f"step {t}: v differs"
    assert (new.v["w"] != 0).any()
    assert (new.u["w"] != 0).any() == (c.role == "sparse" or spec.startswith("topk"))  # dense: all masked


def test_error_feedback_reuses_its_buffers():
    """After two steps a key's state flips between two buffers: no fresh full-size tensors."""
    ef = ErrorFeedback("topk:ratio=0.1")
    seen = set()
    for t in range(6):
        ef.encode(randn(1000, seed=t), "w", Ctx(step=t))
        if t >= 1:
            seen.add(ef.residual("w").data_ptr())
    assert len(seen) == 2


@pytest.mark.parametrize("spec", ["fp8", "fp8:format=e5m2", "qsgd:bits=4", "terngrad", "terngrad:bucket=0"])
def test_finiteness_judged_from_the_scales_matches_the_original(spec, small_tiles, cpu_path):
    """Quantizers that judge the residual's finiteness from their chunk scales: chunks near
    FLT_MAX (the fallback check) and an overflowing norm (a skipped step)."""
    from feedback_oracle import OracleErrorFeedback

    c = gradwire.compressor(spec)
    new, old = ErrorFeedback(c), OracleErrorFeedback(c)
    steps = []
    for t, big in enumerate([0.0, 3e38, 3.3e38, 0.0, 3e19, 0.0, -2e38, -3.3e38, 0.0]):
        x = randn(1500, seed=t)
        if big:
            x[700] = big  # fp8 / terngrad: a scale above the limit (or a corrected input that overflows)
            x[701] = big / 3
        steps.append(x)
    for t, x in enumerate(steps):
        pn, _ = new.encode_decode(x, "w", Ctx(step=t))
        po, _ = old.encode_decode(x, "w", Ctx(step=t))
        assert torch.equal(pn.tensor(), po.tensor()), f"step {t}: packets differ"
        assert torch.equal(bits(new.residual("w")), bits(old.residuals["w"])), f"step {t}: residuals differ"
    assert torch.isfinite(new.residual("w")).all()
