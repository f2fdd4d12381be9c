"""What a rank checks before it trusts a message from a peer: bounds, end markers, agreement.

A peer can declare any size, deliver fewer bytes than it declared, or lie to one rank only.
The backends therefore

- bound every declared size by what the receiver itself expects *before* allocating
  (`check_claims`): a claim beyond it is a `WireFormatError` naming the peer, and since every rank
  sees the same declarations (they are allgathered), every rank raises the same error;
- end every chunk they gather or send all-to-all with an 8-byte end marker (magic and payload
  length) and receive into zeroed memory (`framed`, `check_frames`): gloo completes a short
  receive silently, but then the marker is missing at the end of the slot, so a short or
  altered delivery is detected instead of decoding the zeros or stale bytes behind it;
- make ranks that read different bytes (an all-to-all) agree on success with one tiny allreduce
  (`agree`): a rank that detects a lie tells the others, so nobody waits alone for a peer that
  has stopped.

The markers are transport framing: packets and their wire format are unchanged by them.
"""

from __future__ import annotations

import hashlib
import struct
from typing import Sequence

import torch

from ..errors import ConfigMismatchError, WireFormatError

TRAILER = 8  # bytes at the end of every framed chunk
_MAGIC = 0x52465747  # "GWFR" in little-endian bytes


def _marker(nbytes: int) -> bytes:
    return struct.pack("<II", _MAGIC, nbytes & 0xFFFFFFFF)


def framed(payload: torch.Tensor, padded: int | None = None) -> torch.Tensor:
    """payload (1-D uint8) followed by its end marker, then zeros up to `padded` bytes of payload
    room (allgatherv pads every rank to the longest)."""
    marker = torch.frombuffer(bytearray(_marker(payload.numel())), dtype=torch.uint8).to(payload.device)
    parts = [payload, marker]
    if padded is not None and padded > payload.numel():
        parts.append(payload.new_zeros(padded - payload.numel()))
    return torch.cat(parts)


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """t's memory as a 1-D uint8 tensor (a copy only when t is not contiguous)."""
    return t.detach().reshape(-1).contiguous().view(torch.uint8)


def check_frames(op: str, slots: Sequence[torch.Tensor], nbytes: Sequence[int],
                 ranks: Sequence[int] | None = None) -> None:
    """WireFormatError naming the first peer whose slot does not end its `nbytes` payload bytes
    with the end marker (one device-to-host copy for all slots). Slot i came from rank i, or
    from ranks[i]."""
    for i, (slot, n) in enumerate(zip(slots, nbytes)):
        if slot.numel() < n + TRAILER:
            src = ranks[i] if ranks is not None else i
            raise WireFormatError(f"{op}: rank {src}'s slot of {slot.numel()} bytes cannot hold its {n} bytes and "
                                  "end marker", peer=src)
    marks = torch.cat([s[n: n + TRAILER] for s, n in zip(slots, nbytes)]).cpu().numpy().tobytes()
    for i, n in enumerate(nbytes):
        if marks[i * TRAILER: (i + 1) * TRAILER] != _marker(n):
            src = ranks[i] if ranks is not None else i
            raise WireFormatError(f"{op}: rank {src}'s message arrived short or altered (no end marker after "
                                  f"its {n} bytes)", peer=src)


def check_claims(op: str, counts: Sequence[int], limit: int, unit: str = "elements") -> None:
    """Every rank's declared count must lie in [0, limit] (the receiver's own bound)."""
    for src, n in enumerate(counts):
        if not 0 <= n <= limit:
            raise WireFormatError(f"{op}: rank {src} declares {n} {unit}, outside the 0..{limit} this rank "
                                  "accepts", peer=src)


def agree(backend, error: WireFormatError | None, op: str, device: torch.device | str = "cpu") -> None:
    """Raise on every rank if any rank saw a malformed message (one allreduce of world int64s):
    the detecting rank raises its own error, the others one naming it and the sender."""
    flags = torch.zeros(backend.world_size, dtype=torch.int64, device=device)
    if error is not None:
        flags[backend.rank] = (error.peer if error.peer is not None else backend.rank) + 1
    backend.allreduce(flags).wait()
    if error is not None:
        raise error
    bad = [(r, int(f) - 1) for r, f in enumerate(flags.tolist()) if f]
    if bad:
        receiver, sender = bad[0]
        raise WireFormatError(f"{op}: rank {receiver} received a malformed message from rank {sender}", peer=sender)


def config_digest(description: str) -> int:
    """A config's 64-bit digest, as a signed int64 (what ranks compare before any text)."""
    return int.from_bytes(hashlib.blake2b(description.encode(), digest_size=8).digest(), "little", signed=True)


def check_same_config(backend, description: str, what: str) -> None:
    """ConfigMismatchError on every rank unless every rank's `description` is the same: a
    64-bit digest per rank first, then (only on a mismatch, which every rank sees alike) the
    descriptions as text for the message. Nothing is unpickled."""
    if len({row[0] for row in backend.allgather_ints([config_digest(description)])}) == 1:
        return
    texts = backend.allgather_text(description)
    lines = "\n".join(f"  rank {r}: {d}" for r, d in enumerate(texts))
    raise ConfigMismatchError(f"{what} differ across ranks:\n{lines}")


def packet_bound(c, numel: int, dtype: torch.dtype) -> int:
    """The most bytes a peer's packet of compressor `c` for `numel` elements may have: its static
    size, else its declared section bounds, else (lossless chains, data-dependent codecs) every
    element as an int64 index and a value, plus 1/64 and 4 KiB of slack for a lossless frame."""
    static = c.static_size(numel, dtype)
    if static is not None:
        return static
    item = dtype.itemsize
    slack = numel * (item + 8) // 64 + 4096
    try:
        return sum(c.max_section_sizes(numel, dtype)) + 64 * 8 + slack
    except NotImplementedError:
        return numel * (item + 8) + slack
