"""Backend over MPI (mpi4py): non-blocking collectives on torch tensors.

Every collective is issued at once (``Iallreduce``, ``Iallgatherv``, ``Ibcast``) and returns a
`Work` whose ``wait()`` completes the request and delivers the result. All ranks must issue
the same collectives in the same order (MPI matches them by order on a communicator).

CUDA tensors go to MPI directly when the MPI library is CUDA-aware (Open MPI's
``MPIX_Query_cuda_support``, or ``GRADWIRE_MPI_CUDA_AWARE=1``; ``=0`` forces staging), as
torch tensors through ``__cuda_array_interface__``; otherwise they are staged through pinned
host memory and the result is copied back. Either way the current CUDA stream is
synchronized before MPI touches the memory (MPI knows nothing of streams).

dtypes: allreduce sums float32/float64 and integer types natively; float16 and bfloat16 are
summed in float32 (MPI has no half types) and rounded back once; 8/16-bit integers are summed
in int32 and wrap around like torch's own integer sums. The gathers and broadcast
move raw bytes, so any dtype works. Empty tensors and unequal counts (allgatherv) are fine.

Nothing a peer sends is unpickled: sizes travel as int64 arrays, checked against the
caller's bounds before allocation, and gathered or all-to-all chunks carry an end marker
(framing.py). MPI itself has no timeout: every request is waited for with a deadline
(`timeout`, default ``GRADWIRE_MPI_TIMEOUT`` seconds or 1800, as torch.distributed's default),
after which `CollectiveError` is raised instead of waiting forever for a frozen peer; a failed
MPI call (mpi4py raises ``MPI.Exception``) is a `CollectiveError` too.

mpi4py is an optional dependency (``pip install 'gradwire[mpi]'``).
"""

from __future__ import annotations

import ctypes
import os
import time
from typing import Any

import numpy as np
import torch

from ..errors import CollectiveError, WireFormatError
from .backend import Backend, Work, check_alltoall_claims, check_same_dtype, dtype_code
from .framing import TRAILER, check_claims, check_frames, framed


def _mpi() -> Any:
    try:
        from mpi4py import MPI
    except ImportError as e:  # pragma: no cover - exercised only without mpi4py
        raise RuntimeError("the MPI backend needs mpi4py: pip install 'gradwire[mpi]'") from e
    return MPI


def mpi_cuda_aware() -> bool:
    """Whether MPI accepts device pointers (env override first, then the library's own answer)."""
    env = os.environ.get("GRADWIRE_MPI_CUDA_AWARE")
    if env is not None:
        return env.strip().lower() in ("1", "true", "yes")
    _mpi()  # loads libmpi into the process
    try:
        with open("/proc/self/maps") as f:
            libs = sorted({p for p in f.read().split() if "/libmpi.so" in p})
    except OSError:
        return False
    for lib in libs:
        try:
            query = ctypes.CDLL(lib).MPIX_Query_cuda_support
        except (OSError, AttributeError):
            continue
        query.restype = ctypes.c_int
        return bool(query())
    return False


# dtype -> (MPI datatype name for the sum, dtype the sum runs in).
# 8- and 16-bit integers are summed in int32 and wrapped back (torch's own wrap-around):
# Open MPI 5's AVX reduction kernels (op/avx) use *saturating* adds for 8/16-bit MPI_SUM on
# vectorized chunks (>= 32 elements) and wrapping adds on the scalar tail, so one allreduce of
# uint8 returns 255 in some elements and (a + b) mod 256 in others.
_SUM_TYPES: dict[torch.dtype, tuple[str, torch.dtype]] = {
    torch.float32: ("FLOAT", torch.float32),
    torch.float64: ("DOUBLE", torch.float64),
    torch.float16: ("FLOAT", torch.float32),
    torch.bfloat16: ("FLOAT", torch.float32),
    torch.uint8: ("INT32_T", torch.int32),
    torch.int8: ("INT32_T", torch.int32),
    torch.int16: ("INT32_T", torch.int32),
    torch.int32: ("INT32_T", torch.int32),
    torch.int64: ("INT64_T", torch.int64),
}


def _flat(t: torch.Tensor) -> torch.Tensor:
    """A 1-D contiguous, autograd-free view of t (a copy only when t is not contiguous)."""
    return t.detach().contiguous().view(-1)


def _displacements(counts: list[int]) -> list[int]:
    """Where each rank's part starts in a packed buffer."""
    out = [0] * len(counts)
    for r in range(1, len(counts)):
        out[r] = out[r - 1] + counts[r - 1]
    return out


def _bytes(t: torch.Tensor) -> torch.Tensor:
    """t's memory as uint8 (1-D contiguous)."""
    return _flat(t).view(torch.uint8)


class MPIBackend(Backend):
    """Collectives over an mpi4py communicator (COMM_WORLD by default)."""

    def __init__(self, comm: Any = None, cuda_aware: bool | None = None, timeout: float | None = None) -> None:
        MPI = _mpi()
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise RuntimeError("MPI is not initialized (import mpi4py.MPI first) or already finalized")
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.cuda_aware = mpi_cuda_aware() if cuda_aware is None else bool(cuda_aware)
        self.issue_from_any_thread = MPI.Query_thread() == MPI.THREAD_MULTIPLE
        self.timeout = float(timeout if timeout is not None else os.environ.get("GRADWIRE_MPI_TIMEOUT", 1800))
        if not self.timeout > 0:
            raise ValueError(f"MPI timeout must be > 0 seconds, got {self.timeout}")
        # Buffers of requests MPI may still write into: MPI cannot cancel a collective, so after a
        # timeout (or a Work dropped unwaited) a late peer's data still lands in them. They are
        # released only when their request has completed, never to the allocator before.
        self._held: list[tuple[Any, tuple[Any, ...]]] = []

    def __repr__(self) -> str:
        return f"MPIBackend(rank={self.rank}, world_size={self.world_size}, cuda_aware={self.cuda_aware})"

    # ---- waiting -------------------------------------------------------------------
    def _call(self, op: str, fn: Any) -> Any:
        """Issue an MPI call; an MPI error becomes a CollectiveError naming the operation."""
        try:
            return fn()
        except self.MPI.Exception as e:
            raise CollectiveError(f"MPI {op} failed on rank {self.rank} of {self.world_size}: {e}") from e

    def _issue(self, op: str, fn: Any, *buffers: Any) -> Any:
        """Issue a non-blocking MPI call whose `buffers` MPI reads or writes until it completes:
        they are held here until then, whatever happens to the caller's references."""
        self._held = [(r, b) for r, b in self._held if not self._call(op, r.Test)]  # release the finished
        req = self._call(op, fn)
        self._held.append((req, buffers))
        return req

    def _complete(self, op: str, req: Any) -> None:
        """Wait for req, at most `timeout` seconds (MPI's own wait has no deadline). On a timeout
        the request's buffers stay held (`_issue`): a late peer may still write into them."""
        deadline = time.monotonic() + self.timeout
        spins = 0
        while not self._call(op, req.Test):
            if time.monotonic() > deadline:
                raise CollectiveError(f"MPI {op} on rank {self.rank} of {self.world_size} did not complete within "
                                      f"{self.timeout:g} s: a peer died, froze or never joined")
            spins += 1
            if spins > 1000:  # a fast collective completes while spinning; a slow one yields the core
                time.sleep(0.0002)

    def _ints(self, op: str, values: list[int]) -> list[list[int]]:
        """Every rank's int64 values (the same count everywhere), blocking, with the deadline."""
        mine = np.asarray(values, dtype=np.int64)
        out = np.zeros((self.world_size, mine.size + 1), dtype=np.int64)
        send = np.concatenate([mine, np.asarray([_INT_MARK ^ mine.size], dtype=np.int64)])
        req = self._issue(op, lambda: self.comm.Iallgather([send, self.MPI.INT64_T], [out, self.MPI.INT64_T]),
                          send, out)
        self._complete(op, req)
        for src, row in enumerate(out):
            if int(row[-1]) != _INT_MARK ^ mine.size:
                raise WireFormatError(f"{op}: rank {src}'s integers arrived short or altered", peer=src)
        return [[int(v) for v in row[:-1]] for row in out]

    # ---- staging -------------------------------------------------------------------
    def _direct(self, t: torch.Tensor) -> bool:
        return not t.is_cuda or self.cuda_aware

    def _buf(self, t: torch.Tensor) -> Any:
        """What mpi4py reads/writes: a numpy view on the host, the tensor itself on a device
        (``__cuda_array_interface__``). t is detached and contiguous."""
        return t if t.is_cuda else t.numpy()

    def _stage_in(self, t: torch.Tensor) -> torch.Tensor:
        """The memory MPI will read: t itself when MPI can use it, else a pinned host copy.
        Synchronizes t's stream first: MPI must not read before the kernels that wrote t finish."""
        if not t.is_cuda:
            return t
        torch.cuda.current_stream(t.device).synchronize()
        if self.cuda_aware:
            return t
        host = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
        host.copy_(t)  # synchronous device -> host copy
        return host

    def _zeros_for_mpi(self, nbytes: int, like: torch.Tensor) -> torch.Tensor:
        """A zeroed uint8 receive buffer MPI can write (a short delivery then leaves no stale end
        marker): on like's device when direct, else pinned host memory."""
        if self._direct(like):
            return torch.zeros(nbytes, dtype=torch.uint8, device=like.device)
        return torch.zeros(nbytes, dtype=torch.uint8, pin_memory=True)

    # ---- collectives ---------------------------------------------------------------
    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        """Sum over ranks, written into t (and returned). Half types are summed in float32."""
        if t.dtype not in _SUM_TYPES:
            raise TypeError(f"MPI allreduce cannot sum {t.dtype}; supported: "
                            f"{', '.join(str(d) for d in _SUM_TYPES)}")
        type_name, sum_dtype = _SUM_TYPES[t.dtype]
        flat = _flat(t)
        work = flat if sum_dtype == t.dtype else flat.to(sum_dtype)
        buf = self._stage_in(work)
        req = self._issue("allreduce", lambda: self.comm.Iallreduce(
            self.MPI.IN_PLACE, [self._buf(buf), getattr(self.MPI, type_name)], op=self.MPI.SUM), buf)

        def finish() -> torch.Tensor:
            self._complete("allreduce", req)
            if buf.data_ptr() != t.data_ptr() or buf.dtype != t.dtype or buf.numel() != t.numel():
                with torch.no_grad():
                    t.copy_(buf.view(t.shape))  # device copy and/or rounding back to the half type
            return t

        return Work(wait=finish)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor (same numel and dtype everywhere), in rank order."""
        return self._gather("allgather", t, [t.numel()] * self.world_size)

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        """Every rank's tensor in rank order; numels may differ (0 included). The counts and
        dtypes are exchanged first (one small blocking allgather of integers) and checked:
        a count over `max_numel` or another dtype makes every rank raise WireFormatError."""
        info = self._ints("allgatherv", [t.numel(), dtype_code(t.dtype)])
        check_same_dtype("allgatherv", [c for _, c in info])
        counts = [n for n, _ in info]
        check_claims("allgatherv", counts, int(max_numel))
        return self._gather("allgatherv", t, counts)

    def _gather(self, op: str, t: torch.Tensor, counts: list[int]) -> Work[list[torch.Tensor]]:
        item = t.element_size()
        send = self._stage_in(framed(_bytes(t)))  # bytes: any dtype, no MPI type table
        byte_counts = [c * item + TRAILER for c in counts]
        recv = self._zeros_for_mpi(sum(byte_counts), t)
        req = self._issue(op, lambda: self.comm.Iallgatherv(
            [self._buf(send), self.MPI.BYTE], [self._buf(recv), byte_counts, _displacements(byte_counts), self.MPI.BYTE]),
            send, recv)

        def finish() -> list[torch.Tensor]:
            self._complete(op, req)
            whole = recv if recv.device == t.device else recv.to(t.device)
            slots = list(torch.split(whole, byte_counts))
            check_frames(op, slots, [c * item for c in counts])
            return [s[: c * item].view(t.dtype) for s, c in zip(slots, counts)]

        return Work(wait=finish)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        """chunks[j] to rank j, as raw bytes (any dtype); what every rank sent here, in rank order."""
        dtype = self._check_chunks(chunks)
        send_counts = [c.numel() for c in chunks]
        if recv_counts is None:
            if max_recv is None:
                raise ValueError("alltoall without recv_counts needs max_recv, the most elements a rank may send")
            matrix = self._ints("alltoall", send_counts + [dtype_code(dtype)])
            check_alltoall_claims("alltoall", matrix, self.world_size, max_recv)
            recv_counts = [row[self.rank] for row in matrix]
        elif len(recv_counts) != self.world_size:
            raise ValueError(f"alltoall needs one receive count per rank ({self.world_size}), got {len(recv_counts)}")
        item = dtype.itemsize
        like = chunks[0]
        send = self._stage_in(torch.cat([framed(_bytes(c)) for c in chunks]))
        sb, rb = [n * item + TRAILER for n in send_counts], [n * item + TRAILER for n in recv_counts]
        recv = self._zeros_for_mpi(sum(rb), like)
        req = self._issue("alltoall", lambda: self.comm.Ialltoallv(
            [self._buf(send), sb, _displacements(sb), self.MPI.BYTE], [self._buf(recv), rb, _displacements(rb), self.MPI.BYTE]),
            send, recv)
        counts = list(recv_counts)

        def finish() -> list[torch.Tensor]:
            self._complete("alltoall", req)
            whole = recv if recv.device == like.device else recv.to(like.device)
            slots = list(torch.split(whole, rb))
            check_frames("alltoall", slots, [n * item for n in counts])
            return [s[: n * item].view(dtype) for s, n in zip(slots, counts)]

        return Work(wait=finish)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        """src's tensor on every rank, written into t (and returned)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} is not a rank of this {self.world_size}-rank communicator")
        raw = _bytes(t)
        n = raw.numel()
        buf = self._stage_in(framed(raw)) if self.rank == src else self._zeros_for_mpi(n + TRAILER, t)
        req = self._issue("broadcast", lambda: self.comm.Ibcast([self._buf(buf), self.MPI.BYTE], root=src), buf)

        def finish() -> torch.Tensor:
            self._complete("broadcast", req)
            check_frames("broadcast", [buf], [n], ranks=[src])
            if self.rank != src:
                with torch.no_grad():
                    t.copy_(buf[:n].to(t.device).view(t.dtype).view(t.shape))
            return t

        return Work(wait=finish)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        return self._ints("allgather_ints", [int(v) for v in values])

    def split(self, color: int, key: int) -> "MPIBackend":
        comm = self._call("split", lambda: self.comm.Split(int(color), int(key)))
        return MPIBackend(comm, cuda_aware=self.cuda_aware, timeout=self.timeout)

    def barrier(self) -> None:
        self._complete("barrier", self._call("barrier", self.comm.Ibarrier))


_INT_MARK = 0x47574E54  # ends each rank's integers (xor its count): a short delivery is seen
