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

mpi4py is an optional dependency (``pip install 'gradwire[mpi]'``).
"""

from __future__ import annotations

import ctypes
import os
from typing import Any

import torch

from .backend import Backend, Work, check_same_dtype, dtype_code


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

    def __init__(self, comm: Any = None, cuda_aware: bool | None = None) -> None:
        MPI = _mpi()
        if not MPI.Is_initialized() or MPI.Is_finalized():
            raise RuntimeError("MPI is not initialized (import mpi4py.MPI first) or already finalized")
        self.MPI = MPI
        self.comm = comm if comm is not None else MPI.COMM_WORLD
        self.rank = self.comm.Get_rank()
        self.world_size = self.comm.Get_size()
        self.cuda_aware = mpi_cuda_aware() if cuda_aware is None else bool(cuda_aware)

    def __repr__(self) -> str:
        return f"MPIBackend(rank={self.rank}, world_size={self.world_size}, cuda_aware={self.cuda_aware})"

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

    def _empty_like_for_mpi(self, n: int, dtype: torch.dtype, like: torch.Tensor) -> torch.Tensor:
        """A receive buffer MPI can write: on like's device when direct, else pinned host memory."""
        if self._direct(like):
            return torch.empty(n, dtype=dtype, device=like.device)
        return torch.empty(n, dtype=dtype, pin_memory=True)

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
        req = self.comm.Iallreduce(self.MPI.IN_PLACE, [self._buf(buf), getattr(self.MPI, type_name)],
                                   op=self.MPI.SUM)

        def finish() -> torch.Tensor:
            req.Wait()
            if buf.data_ptr() != t.data_ptr() or buf.dtype != t.dtype or buf.numel() != t.numel():
                with torch.no_grad():
                    t.copy_(buf.view(t.shape))  # device copy and/or rounding back to the half type
            return t

        return Work(wait=finish)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor (same numel and dtype everywhere), in rank order."""
        return self._gather(t, [t.numel()] * self.world_size)

    def allgatherv(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor in rank order; numels may differ (0 included). The counts and
        dtypes are exchanged first (one small blocking allgather); ranks disagreeing on the
        dtype all raise ValueError."""
        info = self.comm.allgather((t.numel(), str(t.dtype)))
        dtypes = {d for _, d in info}
        if len(dtypes) > 1:
            raise ValueError(f"allgatherv: ranks passed different dtypes: "
                             f"{', '.join(f'rank {r}: {d}' for r, (_, d) in enumerate(info))}")
        return self._gather(t, [n for n, _ in info])

    def _gather(self, t: torch.Tensor, counts: list[int]) -> Work[list[torch.Tensor]]:
        item = t.element_size()
        send = self._stage_in(_bytes(t))  # bytes: any dtype, no MPI type table
        recv = self._empty_like_for_mpi(sum(counts) * item, torch.uint8, t)
        byte_counts = [c * item for c in counts]
        req = self.comm.Iallgatherv([self._buf(send), self.MPI.BYTE],
                                    [self._buf(recv), byte_counts, _displacements(byte_counts), self.MPI.BYTE])

        def finish() -> list[torch.Tensor]:
            req.Wait()
            _ = send  # keep the send buffer alive until the request completes
            whole = recv if recv.device == t.device else recv.to(t.device)
            return list(torch.split(whole.view(t.dtype), counts))

        return Work(wait=finish)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None) -> Work[list[torch.Tensor]]:
        """chunks[j] to rank j, as raw bytes (any dtype); what every rank sent here, in rank order."""
        dtype = self._check_chunks(chunks)
        send_counts = [c.numel() for c in chunks]
        if recv_counts is None:
            pairs = self.comm.alltoall([(n, dtype_code(dtype)) for n in send_counts])
            check_same_dtype("alltoall", [c for _, c in pairs])
            recv_counts = [n for n, _ in pairs]
        elif len(recv_counts) != self.world_size:
            raise ValueError(f"alltoall needs one receive count per rank ({self.world_size}), got {len(recv_counts)}")
        item = torch.empty((), dtype=dtype).element_size()
        like = chunks[0]
        send = self._stage_in(_bytes(torch.cat([c.reshape(-1) for c in chunks])))
        recv = self._empty_like_for_mpi(sum(recv_counts) * item, torch.uint8, like)
        sb, rb = [n * item for n in send_counts], [n * item for n in recv_counts]
        req = self.comm.Ialltoallv([self._buf(send), sb, _displacements(sb), self.MPI.BYTE],
                                   [self._buf(recv), rb, _displacements(rb), self.MPI.BYTE])
        counts = list(recv_counts)

        def finish() -> list[torch.Tensor]:
            req.Wait()
            _ = send  # keep the send buffer alive until the request completes
            whole = recv if recv.device == like.device else recv.to(like.device)
            return list(torch.split(whole.view(dtype), counts))

        return Work(wait=finish)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        """src's tensor on every rank, written into t (and returned)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} is not a rank of this {self.world_size}-rank communicator")
        raw = _bytes(t)
        buf = self._stage_in(raw)
        req = self.comm.Ibcast([self._buf(buf), self.MPI.BYTE], root=src)

        def finish() -> torch.Tensor:
            req.Wait()
            if buf.data_ptr() != raw.data_ptr():
                raw.copy_(buf)  # pinned host -> device
            if not t.is_contiguous():  # raw was a contiguous copy of t
                with torch.no_grad():
                    t.copy_(raw.view(t.dtype).view(t.shape))
            return t

        return Work(wait=finish)

    def allgather_object(self, obj: Any) -> list[Any]:
        return self.comm.allgather(obj)

    def split(self, color: int, key: int) -> "MPIBackend":
        return MPIBackend(self.comm.Split(int(color), int(key)), cuda_aware=self.cuda_aware)

    def barrier(self) -> None:
        self.comm.Barrier()
