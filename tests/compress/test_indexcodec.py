"""gradwire.compress.indexcodec: ascending indices <-> delta + per-block Rice bytes."""

from __future__ import annotations

import pytest
import torch

from gradwire import WireFormatError
from gradwire.compress import indexcodec as ic


def _random_set(n: int, m: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.sort(torch.randperm(n, generator=g)[:m]).values


@pytest.mark.parametrize("n,m", [(1, 1), (2, 1), (10, 3), (127, 127), (128, 128), (129, 129), (1000, 999),
                                 (5000, 1), (100_000, 1000), (100_000, 50_000), (1 << 20, 10_000)])
def test_round_trip(n: int, m: int) -> None:
    idx = _random_set(n, m, seed=n + m)
    data = ic.encode(idx, n)
    assert data.dtype == torch.uint8 and data.dim() == 1
    out = ic.decode(data, m, n)
    assert out.dtype == torch.int64
    assert torch.equal(out, idx)


def test_round_trip_many_small() -> None:
    g = torch.Generator().manual_seed(1)
    for _ in range(150):
        n = int(torch.randint(1, 3000, (1,), generator=g))
        m = int(torch.randint(1, n + 1, (1,), generator=g))
        idx = torch.sort(torch.randperm(n, generator=g)[:m]).values
        assert torch.equal(ic.decode(ic.encode(idx), m, n), idx), (n, m)


def test_edges_and_huge_gaps() -> None:
    assert ic.encode(torch.empty(0, dtype=torch.int64)).numel() == 0
    assert ic.decode(torch.empty(0, dtype=torch.uint8), 0, 10).numel() == 0
    for idx, n in [([0], 1), ([5], 6), ([0, 1, 2, 3, 2**31 - 5, 2**31 - 4, 2**32 + 7, 2**40], 2**41),
                   ([2**32 - 1], 2**32), (list(range(300)) + [10**9], 10**9 + 1),
                   ([0, 2**53 - 1, 2**53, 2**53 + 1, 2**55 + 3, 2**61], 2**62)]:
        t = torch.tensor(idx, dtype=torch.int64)
        assert torch.equal(ic.decode(ic.encode(t), len(idx), n), t)
    # int32 input works too
    t = torch.tensor([3, 9, 10], dtype=torch.int32)
    assert torch.equal(ic.decode(ic.encode(t), 3, 11), t.long())


def test_deterministic_bytes() -> None:
    idx = _random_set(100_000, 3000, seed=3)
    assert torch.equal(ic.encode(idx), ic.encode(idx.clone()))


def test_size_near_entropy_for_random_positions() -> None:
    # Uniformly random positions at 1% density: entropy ~8.08 bits/index; the per-block
    # Rice code (plus one width byte per 128) stays within ~0.15 bit of it.
    n, m = 2_000_000, 20_000
    bits = ic.encode(_random_set(n, m, seed=4)).numel() * 8 / m
    assert 8.0 < bits < 8.25, bits


def test_size_adapts_to_clustering() -> None:
    # Dense runs cost ~1 bit each (gap 0: b=0, a single unary one); a run far away costs
    # one wide block (~2.6 kbit for a 1e8 gap), not a wide code for every index.
    run = torch.arange(10_000)
    assert ic.encode(run).numel() * 8 / 10_000 < 1.1
    two = torch.cat([torch.arange(5_000), torch.arange(10**8, 10**8 + 5_000)])
    assert ic.encode(two).numel() * 8 < 10_000 * 1.1 + 2700
    # Clustered positions (bursts of 32 in 1% of 128-element rows) beat uniform ones.
    g = torch.Generator().manual_seed(5)
    rows = torch.sort(torch.randperm(20_000, generator=g)[:400]).values
    clustered = (rows[:, None] * 128 + torch.arange(0, 64, 2)[None, :]).reshape(-1)
    assert ic.encode(clustered).numel() * 8 / clustered.numel() < 3.0


def test_packed_smaller_than_raw_at_low_density() -> None:
    idx = _random_set(1 << 20, 10_000, seed=6)
    assert ic.encode(idx).numel() < idx.numel() * 4 / 3


# ---- corrupted input ----------------------------------------------------------------

def _sample_packet() -> tuple[torch.Tensor, int, int]:
    n, m = 50_000, 300
    return ic.encode(_random_set(n, m, seed=7)), m, n


def test_decode_rejects_width_over_32() -> None:
    data, m, n = _sample_packet()
    bad = data.clone()
    bad[0] = 33
    with pytest.raises(WireFormatError, match="width 33 exceeds 32"):
        ic.decode(bad, m, n)


def test_decode_rejects_truncation_and_padding() -> None:
    data, m, n = _sample_packet()
    with pytest.raises(WireFormatError, match="INDICES_PACKED"):
        ic.decode(data[:-1], m, n)
    with pytest.raises(WireFormatError, match="truncated"):
        ic.decode(data[:2], m, n)
    with pytest.raises(WireFormatError, match="truncated or padded"):
        ic.decode(torch.cat([data, torch.zeros(1, dtype=torch.uint8)]), m, n)
    with pytest.raises(WireFormatError, match="0 indices"):
        ic.decode(data, 0, n)


def test_decode_rejects_count_mismatch() -> None:
    data, m, n = _sample_packet()
    for count in (m - 1, m + 1):
        with pytest.raises(WireFormatError, match="INDICES_PACKED"):
            ic.decode(data, count, n)


def test_decode_rejects_out_of_range() -> None:
    idx = torch.tensor([1, 5, 99])
    data = ic.encode(idx)
    assert torch.equal(ic.decode(data, 3, 100), idx)
    with pytest.raises(WireFormatError, match="out of range"):
        ic.decode(data, 3, 99)


def test_decode_rejects_bad_unary() -> None:
    data, m, n = _sample_packet()
    bad = data.clone()
    bad[-1] = 0xFF  # stray ones in the pad bits (or garbage remainders)
    with pytest.raises(WireFormatError, match="pad bits|out of range"):
        ic.decode(bad, m, n)


def test_decode_rejects_unary_pad_bits() -> None:
    data = ic.encode(torch.tensor([0, 1, 2]))  # gaps 0: Rice b=0, unary 0b111
    assert data.tolist() == [0, 0b111]
    with pytest.raises(WireFormatError, match="pad bits after the unary"):
        ic.decode(torch.tensor([0, 0b1111], dtype=torch.uint8), 3, 10)
    with pytest.raises(WireFormatError, match="truncated"):
        ic.decode(torch.tensor([0, 0b11], dtype=torch.uint8), 3, 10)


def test_decode_rejects_reserved_param_bit() -> None:
    data, m, n = _sample_packet()
    bad = data.clone()
    bad[0] |= 0x40
    with pytest.raises(WireFormatError, match="reserved"):
        ic.decode(bad, m, n)


def test_decode_rejects_wrong_dtype() -> None:
    with pytest.raises(WireFormatError, match="uint8"):
        ic.decode(torch.zeros(4, dtype=torch.int32), 1, 10)


def test_decode_never_overflows_on_garbage() -> None:
    # Random bytes either decode to valid ascending in-range indices or raise WireFormatError.
    g = torch.Generator().manual_seed(8)
    for trial in range(300):
        length = int(torch.randint(1, 64, (1,), generator=g))
        data = torch.randint(0, 256, (length,), dtype=torch.uint8, generator=g)
        count = int(torch.randint(1, 40, (1,), generator=g))
        n = int(torch.randint(1, 1 << 40, (1,), generator=g))
        try:
            out = ic.decode(data, count, n)
        except WireFormatError:
            continue
        assert out.numel() == count
        assert int(out[0]) >= 0 and int(out[-1]) < n
        assert bool((out[1:] > out[:-1]).all())


def test_raw_dtype() -> None:
    assert ic.raw_dtype(2**31 - 1) == torch.int32
    assert ic.raw_dtype(2**31) == torch.int64
