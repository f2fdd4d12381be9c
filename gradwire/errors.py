"""Exceptions gradwire raises on purpose."""


class WireFormatError(ValueError):
    """A packet does not match the wire format or the decoder's config.

    Raised before anything is allocated or written, so a peer that sends garbage
    gets an error naming the bad field, never an out-of-bounds write.
    """


class ConfigMismatchError(RuntimeError):
    """Ranks were set up with different gradwire configs; raised on every rank, so none hangs."""
