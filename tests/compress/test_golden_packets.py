"""Packets are byte-identical to release 0.1.0's for every compressor, chain and input dtype, with
and without error feedback and DGC momentum (digests in golden_packets.json, written by
tests/support/golden_packets.py before the issue-25 refactor)."""

from __future__ import annotations

import json

import pytest
import torch

from golden_packets import GOLDEN, packets

EXPECTED: dict[str, str] = json.loads(GOLDEN.read_text())


@pytest.fixture(scope="module")
def encoded() -> dict[str, str]:
    return packets()


def test_every_case_is_pinned(encoded: dict[str, str]) -> None:
    assert sorted(encoded) == sorted(EXPECTED)
    assert len(EXPECTED) > 400


@pytest.mark.parametrize("case", sorted(EXPECTED))
def test_packet_is_byte_identical_to_the_release(case: str, encoded: dict[str, str]) -> None:
    assert encoded[case] == EXPECTED[case], f"{case}: the packet's bytes changed"


@pytest.mark.parametrize("compiled", ["1", "0"])
def test_both_cpu_paths_send_the_release_bytes(compiled: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """One torch thread (the compiled loops where GRADWIRE_COMPILED=1) gives the same bytes."""
    monkeypatch.setenv("GRADWIRE_COMPILED", compiled)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        assert packets() == EXPECTED
    finally:
        torch.set_num_threads(threads)
