"""What an exchange needs from a communication library, and a handle for pending work.

Backends (torch.distributed, MPI) implement `Backend`; strategies only call these methods,
so every strategy runs on every backend.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Callable, Generic, TypeVar

import torch

T = TypeVar("T")
U = TypeVar("U")


class Work(Generic[T]):
    """A pending result. Wraps a torch Future (then `then` stays asynchronous) or a
    wait function (then `then` runs when the result is first waited for)."""

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
            self._value = self._future.wait() if self._future is not None else self._wait()  # type: ignore[misc]
            self._done = True
        if isinstance(self._value, _Raised):
            raise self._value.error
        return self._value

    def then(self, fn: Callable[[T], U]) -> "Work[U]":
        if self._future is not None:
            return Work(future=self._future.then(lambda f: _call(fn, f.value())))
        return Work(wait=lambda: fn(self.wait()))

    def future(self) -> torch.futures.Future:
        """A torch Future of the result (completed now when the work has no native future)."""
        if self._future is not None:
            return self._future.then(lambda f: _unwrap(f.value()))
        fut: torch.futures.Future = torch.futures.Future()
        fut.set_result(self.wait())
        return fut


class _Raised:
    """An exception carried as a future's value: torch turns an exception raised in a Future
    callback into RuntimeError, and `wait()` must raise the original (WireFormatError)."""

    def __init__(self, error: Exception) -> None:
        self.error = error


def _call(fn: Callable[[Any], Any], value: Any) -> Any:
    if isinstance(value, _Raised):
        return value
    try:
        return fn(value)
    except Exception as e:  # noqa: BLE001 - handed to wait(), which raises it
        return _Raised(e)


def _unwrap(value: Any) -> Any:
    if isinstance(value, _Raised):
        raise value.error
    return value


class Backend(ABC):
    """Collectives over one group of ranks. Tensors are 1-D and contiguous."""

    rank: int
    world_size: int
    #: Whether allreduce leaves bit-identical sums on every rank (gloo and NCCL rings do; MPI
    #: implementations need not), so strategies may use it where replicas must agree exactly.
    allreduce_identical: bool = False

    @abstractmethod
    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        """Element-wise sum over ranks (the result may reuse t's memory)."""

    @abstractmethod
    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor, in rank order; all ranks pass the same numel and dtype."""

    @abstractmethod
    def allgatherv(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor in rank order; lengths may differ (they are exchanged first)."""

    @abstractmethod
    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        """src's tensor on every rank (written into t)."""

    @abstractmethod
    def allgather_object(self, obj: Any) -> list[Any]:
        """Small picklable objects from every rank (blocking; for setup and checks)."""

    def gather_packets(self, packet: torch.Tensor, static_size: int | None) -> Work[list[torch.Tensor]]:
        """Allgather uint8 packets; skips the size exchange when the size is static."""
        if static_size is not None:
            if packet.numel() != static_size:
                raise ValueError(f"packet of {packet.numel()} bytes, but the compressor promised {static_size}")
            return self.allgather(packet)
        return self.allgatherv(packet)
