"""ErrorFeedback and DGCMomentum: conservation, resumable state, non-finite steps."""

from __future__ import annotations

import io

import pytest
import torch

import gradwire
from gradwire import Ctx, DGCMomentum, ErrorFeedback

from conftest import bits, randn

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
