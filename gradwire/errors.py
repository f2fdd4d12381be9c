"""Exceptions gradwire raises on purpose."""


class WireFormatError(ValueError):
    """A packet or message does not match the wire format, the decoder's config or what the
    receiver expects.

    Raised before anything is allocated or written, so a peer that sends garbage
    gets an error naming the bad field, never an out-of-bounds write. `peer` is the rank that
    sent the bad bytes, when known.
    """

    def __init__(self, message: str, peer: int | None = None) -> None:
        super().__init__(message)
        self.peer = peer


class ConfigMismatchError(RuntimeError):
    """Ranks were set up with different gradwire configs; raised on every rank, so none hangs."""


class CollectiveError(RuntimeError):
    """A collective did not complete: a peer died, froze past the group's timeout, or its
    connection broke. Raised instead of returning a buffer that was never filled; the message
    names the operation, the group and what the transport reported (for gloo, the peer's
    address)."""
