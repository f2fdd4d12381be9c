"""What an exchange needs from a communication library, and a handle for pending work.

Backends (torch.distributed, MPI) implement `Backend`; strategies only call these methods,
so every strategy runs on every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
import struct
from typing import Any, Callable, Generic, TypeVar

import torch

from ..errors import CollectiveError, WireFormatError

T = TypeVar("T")
U = TypeVar("U")


class _Failed:
    """An exception carried through a torch Future as its value: torch would wrap it in a
    RuntimeError, and callers must see the original (e.g. WireFormatError)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error


class Work(Generic[T]):
    """A pending result. Wraps a torch Future (then `then` stays asynchronous) or a
    wait function (then `then` runs when the result is first waited for). An exception in a
    `then` step reaches `wait()` as itself."""

    def __init__(self, wait: Callable[[], T] | None = None, future: torch.futures.Future | None = None) -> None:
        if (wait is None) == (future is None):
            raise ValueError("Work takes exactly one of wait or future")
        self._wait = wait
        self._future = future
        self._done = False
        self._value: Any = None

    @staticmethod
    def done(value: T) -> "Work[T]":
        w: Work[T] = Work(wait=lambda: value)
        return w

    def wait(self) -> T:
        if not self._done:
            if self._future is not None:
                try:
                    self._value = self._future.wait()
                except Exception as e:  # noqa: BLE001 - a future failed outside gradwire's own steps
                    self._value = _Failed(_as_collective_error(e))
            else:
                self._value = self._wait()  # type: ignore[misc]
            self._done = True
        if isinstance(self._value, _Failed):
            raise self._value.error
        return self._value

    def then(self, fn: Callable[[T], U]) -> "Work[U]":
        if self._future is not None:
            def step(f: torch.futures.Future) -> Any:
                try:
                    value = f.value()
                except Exception as e:  # noqa: BLE001 - the collective itself failed
                    return _Failed(_as_collective_error(e))
                if isinstance(value, _Failed):
                    return value
                try:
                    return fn(value)
                except Exception as e:  # noqa: BLE001 - handed on unchanged to wait()
                    return _Failed(e)

            return Work(future=self._future.then(step))
        return Work(wait=lambda: fn(self.wait()))

    def future(self) -> torch.futures.Future:
        """A torch Future of the result (completed now when the work has no native future);
        a failed step raises its exception there (torch reports it as a RuntimeError)."""
        if self._future is not None:
            return self._future.then(lambda f: _unwrap(f.value()))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.wait())
        return fut


def _as_collective_error(e: BaseException) -> BaseException:
    """gradwire's own errors as they are; anything the transport raised as a CollectiveError."""
    if isinstance(e, (CollectiveError, WireFormatError)):
        return e
    return CollectiveError(f"a collective failed: {e}")


def _unwrap(value: Any) -> Any:
    if isinstance(value, _Failed):
        raise value.error
    return value


class Backend(ABC):
    """Collectives over one group of ranks. Tensors are 1-D and contiguous.

    Nothing a peer sends is unpickled, and every size a peer declares is checked against the
    caller's bound before anything is allocated for it (framing.py). A collective that fails
    (a peer died or froze past the timeout) raises `CollectiveError` from `wait()`, never hands
    back a buffer that was not filled."""

    rank: int
    world_size: int
    #: Whether allreduce leaves bit-identical sums on every rank (gloo and NCCL rings do; MPI
    #: implementations need not), so strategies may use it where replicas must agree exactly.
    allreduce_identical: bool = False
    #: Whether collectives may be issued from a thread other than the training thread while that
    #: thread runs collectives of its own on other groups (gloo does; MPI only at
    #: MPI_THREAD_MULTIPLE), so a caller may move encoding and decoding off the training thread.
    issue_from_any_thread: bool = False

    @abstractmethod
    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        """Element-wise sum over ranks (the result may reuse t's memory)."""

    @abstractmethod
    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor, in rank order; all ranks pass the same numel and dtype."""

    @abstractmethod
    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        """Every rank's tensor in rank order; lengths may differ (they are exchanged first, as
        fixed-layout integers). A rank declaring more than `max_numel` elements, or another
        dtype, makes every rank raise WireFormatError naming it, before any allocation."""

    @abstractmethod
    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        """chunks[j] goes to rank j; the result is what every rank sent to this one, in rank order.
        Chunks share one dtype and may differ in length (0 included). Without `recv_counts` (the
        numel each rank sends here, when the caller knows it) every rank's counts and dtype are
        allgathered first (one small blocking exchange) and checked against `max_recv` (the most
        elements one rank may send to destination j: one bound for all, or one per destination,
        the same on every rank), so a claim beyond it or a dtype mismatch makes every rank raise
        WireFormatError. A chunk that arrives short raises WireFormatError on its receiver only:
        callers make the ranks agree (framing.agree)."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        """src's tensor on every rank (written into t)."""

    @abstractmethod
    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        """Every rank's int64 values (the same count on every rank), blocking; for setup and
        checks. Fixed layout: nothing is unpickled."""

    def allgather_text(self, text: str, limit: int = 2048) -> list[str]:
        """Every rank's text, cut to `limit` UTF-8 bytes (for error messages; blocking)."""
        raw = text.encode()[:limit]
        words = [len(raw)] + list(struct.unpack(f"<{limit // 8 + 1}q", raw.ljust(8 * (limit // 8 + 1), b"\0")))
        out = []
        for row in self.allgather_ints(words):
            n = min(max(row[0], 0), limit)
            out.append(struct.pack(f"<{len(row) - 1}q", *row[1:])[:n].decode(errors="replace"))
        return out

    def split(self, color: int, key: int) -> "Backend":
        """A backend over the ranks passing the same `color`, ordered by `key` (then rank); every
        rank of this backend must call it (MPI_Comm_split's contract)."""
        raise NotImplementedError(f"{type(self).__name__} cannot split into sub-groups")

    def _check_chunks(self, chunks: list[torch.Tensor]) -> torch.dtype:
        """The common dtype of an alltoall's chunks (one per rank)."""
        if len(chunks) != self.world_size:
            raise ValueError(f"alltoall needs one chunk per rank ({self.world_size}), got {len(chunks)}")
        dtypes = {c.dtype for c in chunks}
        if len(dtypes) != 1:
            raise ValueError(f"alltoall chunks must share one dtype, got {sorted(map(str, dtypes))}")
        return chunks[0].dtype

    def gather_packets(self, packet: torch.Tensor, static_size: int | None, max_size: int) -> Work[list[torch.Tensor]]:
        """Allgather uint8 packets; skips the size exchange when the size is static, else
        accepts at most `max_size` bytes from each rank."""
        if static_size is not None:
            if packet.numel() != static_size:
                raise ValueError(f"packet of {packet.numel()} bytes, but the compressor promised {static_size}")
            return self.allgather(packet)
        return self.allgatherv(packet, max_size)


def dtype_code(dtype: torch.dtype) -> int:
    """A small integer naming dtype, the same on every rank (for size/dtype exchanges)."""
    if dtype not in _DTYPE_CODES:
        raise TypeError(f"cannot exchange {dtype} tensors; supported: {', '.join(map(str, _DTYPE_CODES))}")
    return _DTYPE_CODES.index(dtype)


def check_same_dtype(op: str, codes: list[int]) -> None:
    """Raise WireFormatError (on every rank, since every rank sees the same codes) if ranks disagree."""
    if len(set(codes)) > 1:
        names = [str(_DTYPE_CODES[c]) if 0 <= c < len(_DTYPE_CODES) else f"code {c}" for c in codes]
        odd = next(r for r, c in enumerate(codes) if codes.count(c) < max(codes.count(x) for x in codes)) \
            if len(codes) > 2 else None
        raise WireFormatError(f"{op}: ranks passed different dtypes: "
                              f"{', '.join(f'rank {r}: {n}' for r, n in enumerate(names))}", peer=odd)


def check_alltoall_claims(op: str, matrix: list[list[int]], world: int, max_recv: int | list[int]) -> list[int]:
    """Validate an allgathered all-to-all plan (row s: rank s's count to every rank, then its
    dtype code) on every rank alike; returns the dtype codes."""
    limits = [int(max_recv)] * world if isinstance(max_recv, int) else [int(m) for m in max_recv]
    if len(limits) != world:
        raise ValueError(f"{op}: max_recv needs one bound per rank ({world}), got {len(limits)}")
    for src, row in enumerate(matrix):
        if len(row) != world + 1:
            raise WireFormatError(f"{op}: rank {src} sent a plan of {len(row)} words, expected {world + 1}", peer=src)
        for dst, n in enumerate(row[:world]):
            if not 0 <= n <= limits[dst]:
                raise WireFormatError(f"{op}: rank {src} declares {n} elements for rank {dst}, outside the "
                                      f"0..{limits[dst]} it accepts", peer=src)
    codes = [row[world] for row in matrix]
    check_same_dtype(op, codes)
    return codes


_DTYPE_CODES = (torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.uint8, torch.int8,
                torch.int16, torch.int32, torch.int64, torch.bool, torch.float8_e4m3fn, torch.float8_e5m2)
