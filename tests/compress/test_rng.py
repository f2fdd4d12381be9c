"""The counter RNG: bit-exact against the pure-Python spec, whatever the block size or out=."""

from __future__ import annotations

import hashlib

import pytest
import torch

from gradwire.compress import rng

KEYS = [(0, 0), (123, 456), rng.stream_key(1, 2, 3, 4, 10), (0xFFFFFFFF, 0xFFFFFFFF), (0x80000000, 0x7FFFFFFF),
        (0xFFFFFF00, 7)]


@pytest.mark.parametrize("key", KEYS)
@pytest.mark.parametrize("start", [0, 5, 12345, (1 << 31) - 10, (1 << 32) - 300])
def test_bits24_matches_the_python_reference(key, start):
    n = 300
    got = rng.bits24(key, n, start=start).tolist()
    assert got == [rng.reference_bits24(key, start + j) for j in range(n)]


def test_reference_spells_out_the_docstring_recipe():
    # one value worked by hand from the recipe in rng's docstring
    m = 0xFFFFFFFF
    x = (7 + 123) & m
    x ^= x >> 16
    x = (x * 0x21F0AAAD) & m
    x ^= x >> 15
    x = (x * 0x735A2D97) & m
    x ^= x >> 15
    x ^= 456
    assert rng.reference_bits24((123, 456), 7) == x >> 8


def test_known_answers_did_not_change():
    """sha256 of outputs from the original (unblocked) implementation: the bits are frozen."""
    h = hashlib.sha256()
    cases = [((0, 0), 1000, 0), ((123, 456), 5000, 0), (rng.stream_key(1, 2, 3, 4, 10), 3000, 0),
             ((0xFFFFFFFF, 0xFFFFFFFF), 777, 5), ((0xFFFFFF00, 7), 600, 0), ((5, 9), 100, (1 << 32) - 100),
             ((0x80000000, 0x7FFFFFFF), 1024, 12345)]
    for key, n, start in cases:
        h.update(rng.bits24(key, n, start=start).numpy().tobytes())
    assert h.hexdigest() == "a5ba55a2ec9f2ab9f43d7e34542db348a1c09c2d84d8412eee9a449532836bf7"
    u = rng.uniform((1, 2), 1000)
    assert hashlib.sha256(u.numpy().tobytes()).hexdigest() == \
        "5d325eea9add4017f1ac27f44cd55b4517b596b1ecdedffe147ce88ad4c57ace"
    r = rng.randbelow((3, 4), torch.arange(1, 1001))
    assert hashlib.sha256(r.numpy().tobytes()).hexdigest() == \
        "38e0acf7f1066ce2859f8fd99987b3d43fc035f421902a8b9cbcb5d99c4ebc9f"
    assert rng.stream_key(1, 2, 3, 4, 10) == (2473769867, 3531551558)


@pytest.mark.parametrize("block", [7, 1000, 1 << 20])
def test_block_size_does_not_change_the_bits(block, monkeypatch):
    key, n, start = (0xDEADBEEF, 0x12345678), 5003, 77
    ref = torch.tensor([rng.reference_bits24(key, start + j) for j in range(n)], dtype=torch.int32)
    monkeypatch.setattr(rng, "BLOCK", block)
    assert torch.equal(rng.bits24(key, n, start=start), ref)
    assert torch.equal(rng.uniform(key, n, start=start), ref.float() * 2.0 ** -24)


def test_out_and_slices_agree_with_one_call():
    key = (11, 22)
    whole = rng.bits24(key, 1000)
    buf = torch.full((1000,), -1, dtype=torch.int32)
    assert rng.bits24(key, 600, out=buf[:600]) is not None
    rng.bits24(key, 400, start=600, out=buf[600:])
    assert torch.equal(buf, whole)
    f = torch.empty(1000)
    assert rng.uniform(key, 1000, out=f).data_ptr() == f.data_ptr()
    assert torch.equal(f, whole.float() * 2.0 ** -24)
    assert f.min() >= 0 and f.max() < 1


def test_bad_arguments():
    with pytest.raises(ValueError):
        rng.bits24((1, 2), 10, start=(1 << 32) - 5)
    with pytest.raises(ValueError):
        rng.bits24((1, 2), 10, out=torch.empty(10))  # not int32
    with pytest.raises(ValueError):
        rng.uniform((1, 2), 10, out=torch.empty(9))
    with pytest.raises(ValueError):
        rng.bits24((1, 2), -1)
    assert rng.bits24((1, 2), 0).numel() == 0 and rng.uniform((1, 2), 0).numel() == 0


def test_streams_differ_and_look_uniform():
    keys = {rng.stream_key(*fields) for fields in [(0, 0, 0, 0, 0), (1, 0, 0, 0, 0), (0, 1, 0, 0, 0),
                                                   (0, 0, 1, 0, 0), (0, 0, 0, 1, 0), (0, 0, 0, 0, 1)]}
    assert len(keys) == 6
    u = rng.uniform(rng.stream_key(5, 6, 7, 8, 9), 200_000).double()
    assert abs(u.mean().item() - 0.5) < 0.005 and abs(u.var().item() - 1 / 12) < 0.002
    hist = torch.histc(u, bins=16, min=0, max=1)
    assert (hist - 12500).abs().max() < 600
    b = rng.bits24((3, 3), 100_000)
    ones = torch.stack([(b >> i) & 1 for i in range(24)]).double().mean(1)
    assert ((ones - 0.5).abs() < 0.01).all()


def test_randbelow_is_in_range_and_follows_the_formula():
    bounds = torch.tensor([1, 2, 3, 1000, (1 << 24) - 1] * 200)
    r = rng.randbelow((9, 9), bounds)
    assert (r >= 0).all() and (r < bounds).all()
    u = rng.bits24((9, 9), bounds.numel()).to(torch.int64)
    assert torch.equal(r, (u * bounds) >> 24)
