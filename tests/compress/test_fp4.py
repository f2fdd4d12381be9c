"""fp4 (e2m1 with per-block fp32 scales): codes against a brute-force nearest-value oracle,
ties to even, the packed layout, error bounds, error feedback."""

from __future__ import annotations

import pytest
import torch

import gradwire
from gradwire.compress import ErrorFeedback
from gradwire.compress.quantize.fp4 import VALUES, e2m1_codes
from gradwire.compress.wire import Kind

MAGNITUDES = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def _oracle(v: float) -> int:
    """The nearest e2m1 magnitude by exhaustive search; a tie goes to the even code."""
    a = min(abs(v), 6.0)
    best = min(range(8), key=lambda c: (abs(MAGNITUDES[c] - a), c % 2))
    return best | (8 if torch.tensor(v).signbit() else 0)


def test_codes_match_the_nearest_value_oracle_on_ties_and_random_values() -> None:
    ties = [(MAGNITUDES[i] + MAGNITUDES[i + 1]) / 2 for i in range(7)]
    g = torch.Generator().manual_seed(0)
    vs = ties + [-t for t in ties] + MAGNITUDES + [-m for m in MAGNITUDES] + [6.0000005, -0.0]
    vs += (torch.rand(5000, generator=g) * 12 - 6).tolist()
    v = torch.tensor(vs, dtype=torch.float32)
    got = e2m1_codes(v, torch.empty(v.numel(), dtype=torch.int32)).tolist()
    assert got == [_oracle(x) for x in v.tolist()]
    # the ties land on even codes: 0.25 -> 0, 0.75 -> 1.0 (code 2), 1.25 -> 1.0, 1.75 -> 2.0, 2.5 -> 2.0, 3.5 -> 4, 5 -> 4
    assert [VALUES[c].item() for c in got[:7]] == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]


def test_nan_gets_code_zero_whatever_its_sign_bit() -> None:
    v = torch.tensor([float("nan"), -float("nan")])
    assert e2m1_codes(v, torch.empty(2, dtype=torch.int32)).tolist() == [0, 0]


def test_absmax_maps_to_six_and_codes_pack_two_per_byte_low_nibble_first() -> None:
    c = gradwire.compressor("fp4:chunk=4")
    x = torch.tensor([3.0, -1.5, 0.0, 0.5, 8.0, 2.0, -8.0, 1.0, 6.0])  # scales 0.5, 8/6, 1
    pk = c.encode(x)
    scales, data = pk.section(Kind.SCALES), pk.section(Kind.DATA)
    assert scales.tolist() == pytest.approx([0.5, 8 / 6, 1.0])
    # chunk 0: 3/0.5 = 6 -> 7, -3 -> 8|5 = 13, 0 -> 0, 1 -> 2 ; chunk 1: 6 -> 7, 1.5 -> 3, -6 -> 15, 0.75 -> 2 ; 6 -> 7
    codes = [7, 13, 0, 2, 7, 3, 15, 2, 7]
    want = [codes[i] | (codes[i + 1] << 4) if i + 1 < len(codes) else codes[i] for i in range(0, len(codes), 2)]
    assert data.tolist()[:5] == want and data.tolist()[5:] == [0, 0, 0]  # 4 bytes per group of 8, zero padding
    assert c.decode(pk).tolist() == pytest.approx([3.0, -1.5, 0.0, 0.5, 8.0, 2.0, -8.0, 8 / 6 * 0.5 * 2, 6.0])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
@pytest.mark.parametrize("chunk", [32, 7, 1000])
def test_error_is_at_most_half_a_gap_of_the_block_scale(dtype, chunk) -> None:
    g = torch.Generator().manual_seed(chunk)
    n = 10_007
    x = (torch.randn(n, generator=g) * torch.logspace(-3, 3, n)).to(dtype)
    c = gradwire.compressor(f"fp4:chunk={chunk}")
    pk = c.encode(x)
    y = c.decode(pk)
    assert y.dtype == dtype and y.shape == x.shape
    scale = pk.section(Kind.SCALES).repeat_interleave(chunk)[:n]
    xf, yf = x.float(), y.float()
    v = (xf / scale).abs()
    half_gap = torch.where(v < 2, 0.25, torch.where(v < 4, 0.5, 1.0))
    slack = 1e-6 * xf.abs() + (0 if dtype == torch.float32 else 2 ** -7 * yf.abs())  # the result's own rounding
    assert ((yf - xf).abs() <= half_gap * scale * (1 + 1e-6) + slack).all()
    blocks = xf.abs()[: n // chunk * chunk].view(-1, chunk).amax(1)
    assert torch.allclose(yf.abs()[: n // chunk * chunk].view(-1, chunk).amax(1), blocks, rtol=1e-2)  # absmax kept


def test_bytes_are_an_eighth_of_fp32_plus_a_scale_per_block() -> None:
    n = 1 << 20
    for chunk, bits in [(32, 5.0), (128, 4.25)]:
        got = 8 * gradwire.compressor(f"fp4:chunk={chunk}").static_size(n) / n
        assert bits <= got < bits + 0.01


def test_error_feedback_residual_is_the_input_minus_what_was_sent() -> None:
    """With error feedback the residual carries exactly corrected - decoded, and the sum of what was
    sent over steps tracks the sum of the inputs (the error stays bounded by one step's)."""
    ef = ErrorFeedback(gradwire.compressor("fp4"))
    g = torch.Generator().manual_seed(1)
    total_in, total_out = torch.zeros(4096), torch.zeros(4096)
    for _ in range(20):
        x = torch.randn(4096, generator=g)
        pk = ef.encode(x, key="w")
        total_in += x
        total_out += ef.compressor.decode(pk)
    assert torch.allclose(total_in - total_out, ef.residual("w"), atol=1e-4)
    assert ef.residual("w").abs().max() < 1.0  # bounded: a single step's rounding, not 20 steps'
