"""Backend over Horovod's PyTorch collectives (horovod.torch), so gradwire's strategies run in
Horovod jobs exactly as they run over torch.distributed and MPI.

Horovod matches collectives across ranks by *name*, not by the order they were issued in: a
Horovod job may start its exchanges from gradient hooks, in whatever order each rank's backward
reaches them. Ops issued inside ``with backend.named(scope):`` are named after the scope (the
same on every rank whatever the order); ops issued outside get a process-wide sequence number,
so those must be issued in the same order on every rank, as over MPI.

Every op is asynchronous: it returns a `Work` around Horovod's handle. As in the other backends,
gathered and all-to-all chunks carry an end marker (framing.py), sizes travel as fixed-layout
int64s, nothing is unpickled, and a failed op (Horovod shut down because a peer died, or it
rejected the op) is a `CollectiveError` at issue or at ``wait()``.

Horovod sizes every allgather and all-to-all receive buffer from what the *senders* declare,
so `allgatherv` exchanges the sizes first, as fixed int64s, and checks them against the
caller's bound before the data phase is issued: a claim beyond it makes every rank raise
`WireFormatError` and no rank allocates for it. The data phase starts once the sizes have
arrived: whenever this backend issues another op (so it overlaps with the rest of a backward
pass) and at the latest before this backend blocks. No rank blocks while it owes its peers a
data phase, so ranks that issue exchanges in different orders do not deadlock.

dtypes: allreduce sums float16/32/64 and int32/64 natively; bfloat16 is summed in float32 and
8/16-bit integers in int32, rounded (or wrapped) back once, as in the MPI backend. The gathers,
the broadcast and the all-to-all move raw bytes, so any dtype works.

Horovod is optional: importing this module without it only fails when a backend is created.
"""

from __future__ import annotations

import contextlib
import itertools
import threading
from typing import Any, Callable, Iterator

import torch

from ..errors import CollectiveError, WireFormatError
from .backend import Backend, Work, check_alltoall_claims, check_same_dtype, dtype_code
from .framing import TRAILER, as_bytes, check_claims, check_frames, framed

try:  # optional dependency: see scripts/install-horovod.sh
    import horovod.torch as hvd
    from horovod.torch import mpi_ops as _mpi_ops
except ImportError:  # pragma: no cover - exercised only where horovod is missing
    hvd = None
    _mpi_ops = None

_INT_MARK = 0x47574854  # ends each rank's integers (xor their count): a short or altered row is seen
_SEQ = itertools.count()  # names of ops issued outside a scope: one sequence for every backend here

# dtypes Horovod 0.28 cannot sum -> the dtype they are summed in
_WIDENED = {torch.bfloat16: torch.float32, torch.uint8: torch.int32, torch.int8: torch.int32,
            torch.int16: torch.int32}


def need_horovod() -> Any:
    """horovod.torch, or an ImportError saying how to get it."""
    if hvd is None:
        raise ImportError("gradwire's Horovod support needs Horovod with PyTorch support "
                          "(see scripts/install-horovod.sh)")
    return hvd


def horovod_sums(t: torch.Tensor) -> bool:
    """Whether Horovod's torch extension allreduces tensors like t natively (0.28.1 has no
    bfloat16 and no 8/16-bit integers)."""
    try:
        return hasattr(_mpi_ops.mpi_lib, "horovod_torch_allreduce_async_" + t.type().replace(".", "_"))
    except Exception:  # noqa: BLE001 - private interface changed: assume the classic dtypes
        return t.dtype in (torch.float16, torch.float32, torch.float64, torch.int32, torch.int64)


class _Gatherv:
    """An allgatherv between its two phases: the sizes are in flight, the data phase waits for them."""

    def __init__(self, sizes_handle: Any, sizes: Callable[[], list[list[int]]], send: torch.Tensor, max_numel: int,
                 name: str) -> None:
        self.sizes_handle, self.sizes = sizes_handle, sizes
        self.send, self.max_numel, self.name = send, max_numel, name
        self.counts: list[int] = []
        self.handle: Any = None
        self.error: BaseException | None = None


class HorovodBackend(Backend):
    """Collectives over every rank of a Horovod job (call ``hvd.init()`` first).

    ``average=True`` makes `allreduce` return Horovod's mean (``hvd.Average``: the sum scaled
    once by 1/size inside Horovod, in the tensor's dtype) instead of the sum, for callers that
    must match ``hvd.DistributedOptimizer`` bit for bit."""

    # MPI controllers need not give bit-identical sums on every rank (Gloo's ring does)
    allreduce_identical = False

    def __init__(self, average: bool = False) -> None:
        h = need_horovod()
        if not h.is_initialized():
            raise RuntimeError("Horovod is not initialized; call hvd.init() first")
        self.rank = h.rank()
        self.world_size = h.size()
        self.average = bool(average)
        self._scope = threading.local()
        self._lock = threading.RLock()
        self._pending: list[_Gatherv] = []  # allgathervs whose data phase is not issued yet

    def __repr__(self) -> str:
        return f"HorovodBackend(rank={self.rank}, world_size={self.world_size}, average={self.average})"

    # ---- names ---------------------------------------------------------------------
    @contextlib.contextmanager
    def named(self, scope: str) -> Iterator[None]:
        """Name the ops issued inside after `scope` (``{scope}.{op}.{n}``, n counting from 0
        for each entry): one scope per exchange lets ranks issue exchanges in any order.
        A scope's names must not be in use by an unfinished op."""
        previous = getattr(self._scope, "current", None)
        self._scope.current = [scope, 0]
        try:
            yield
        finally:
            self._scope.current = previous

    def _name(self, op: str) -> str:
        scope = getattr(self._scope, "current", None)
        if scope is None:
            return f"gradwire.{op}.{next(_SEQ)}"
        scope[1] += 1
        return f"{scope[0]}.{op}.{scope[1] - 1}"

    # ---- issuing and waiting -------------------------------------------------------
    def _error(self, op: str, e: BaseException) -> CollectiveError:
        return CollectiveError(f"Horovod {op} failed on rank {self.rank} of {self.world_size}: {e}")

    def _call(self, op: str, issue: Callable[[], Any]) -> Any:
        """Issue an op; Horovod's refusal (it is shut down: a peer died) becomes a CollectiveError."""
        try:
            return issue()
        except RuntimeError as e:  # HorovodInternalError, or the extension's own error
            raise self._error(op, e) from e

    def _finish(self, op: str, handle: Any) -> Any:
        """Wait for handle's result, without first issuing pending data phases."""
        try:
            return hvd.synchronize(handle)
        except RuntimeError as e:
            raise self._error(op, e) from e

    def _wait(self, op: str, handle: Any) -> Any:
        """Wait for handle's result; every data phase this rank owes its peers is issued first."""
        self._advance(block=True)
        return self._finish(op, handle)

    def _advance(self, block: bool) -> None:
        """Issue the data phase of each pending allgatherv whose sizes have arrived (of all of
        them when `block`, waiting for their sizes), in the order they were requested."""
        with self._lock:
            for g in list(self._pending):
                if not block:
                    try:
                        if not hvd.poll(g.sizes_handle):
                            continue
                    except RuntimeError:
                        pass  # the sizes phase failed: `_start` records why
                self._pending.remove(g)
                self._start(g)

    def _start(self, g: _Gatherv) -> None:
        """Check an allgatherv's sizes and issue its data phase; a failure is kept for its wait()."""
        try:
            info = g.sizes()
            check_same_dtype("allgatherv", [c for _, c in info])
            g.counts = [n for n, _ in info]
            check_claims("allgatherv", g.counts, g.max_numel)
            send = g.send
            g.handle = self._call("allgatherv", lambda: hvd.allgather_async(send, name=g.name))
        except (WireFormatError, CollectiveError) as e:
            g.error = e

    def _rows(self, op: str, values: list[int]) -> tuple[Any, Callable[[], list[list[int]]]]:
        """Issue an allgather of every rank's int64 values (the same count everywhere): the
        handle, and a function that waits for the rows and checks their layout and markers."""
        count = len(values)
        mine = torch.tensor([[*values, _INT_MARK ^ count]], dtype=torch.int64)
        handle = self._call(op, lambda: hvd.allgather_async(mine, name=self._name(op)))

        def rows() -> list[list[int]]:
            out = self._finish(op, handle)
            if tuple(out.shape) != (self.world_size, count + 1):
                raise WireFormatError(f"{op}: received integers of shape {tuple(out.shape)}, expected "
                                      f"{self.world_size} rows of {count + 1}")
            table = out.tolist()
            for src, row in enumerate(table):
                if row[-1] != _INT_MARK ^ count:
                    raise WireFormatError(f"{op}: rank {src}'s integers arrived short or altered", peer=src)
            return [row[:-1] for row in table]

        return handle, rows

    def _split(self, op: str, out: torch.Tensor, nbytes: list[int], dtype: torch.dtype) -> list[torch.Tensor]:
        """The framed chunks of a gathered buffer, checked, as tensors of dtype (views)."""
        sizes = [n + TRAILER for n in nbytes]
        if out.numel() != sum(sizes):
            raise WireFormatError(f"{op}: received {out.numel()} bytes, the ranks' sizes add up to {sum(sizes)}")
        slots = list(torch.split(out.reshape(-1), sizes))
        check_frames(op, slots, nbytes)
        return [s[:n].view(dtype) for s, n in zip(slots, nbytes)]

    # ---- collectives ---------------------------------------------------------------
    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        """Sum (or, with average=True, Horovod's mean) over ranks, written into t (and returned)."""
        if t.dtype not in _WIDENED and not horovod_sums(t):
            raise TypeError(f"Horovod cannot allreduce {t.dtype} tensors")
        if t.numel() == 0:  # (the same numel on every rank: none of them issues anything)
            return Work.done(t)
        self._advance(block=False)
        flat = t.detach().view(-1) if t.is_contiguous() else t.detach().contiguous().view(-1)
        work = flat if horovod_sums(flat) else flat.to(_WIDENED[t.dtype])
        op = hvd.Average if self.average else hvd.Sum
        handle = self._call("allreduce", lambda: hvd.allreduce_async_(work, name=self._name("allreduce"), op=op))

        def finish() -> torch.Tensor:
            self._wait("allreduce", handle)
            if work.data_ptr() != t.data_ptr() or work.dtype != t.dtype:
                with torch.no_grad():
                    t.copy_(work.view(t.shape))  # rounded (or wrapped) back once
            return t

        return Work(wait=finish)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        """Every rank's tensor (same numel and dtype everywhere), in rank order. Horovod sizes
        the result from the peers' declarations: a rank that passed another size is detected
        after the transfer (WireFormatError on every rank)."""
        self._advance(block=False)
        payload = as_bytes(t)
        n = payload.numel()
        send = framed(payload)
        handle = self._call("allgather", lambda: hvd.allgather_async(send, name=self._name("allgather")))
        return Work(wait=lambda: self._split("allgather", self._wait("allgather", handle), [n] * self.world_size,
                                             t.dtype))

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        """Every rank's tensor in rank order; numels may differ. Sizes and dtypes go first (a
        non-blocking allgather of int64s); a claim over `max_numel` or another dtype makes every
        rank raise WireFormatError, and no rank issues (or allocates for) the data phase."""
        self._advance(block=False)
        sizes_handle, sizes = self._rows("allgatherv", [t.numel(), dtype_code(t.dtype)])
        g = _Gatherv(sizes_handle, sizes, framed(as_bytes(t)), int(max_numel), self._name("allgatherv"))
        with self._lock:
            self._pending.append(g)
        item = t.element_size()

        def finish() -> list[torch.Tensor]:
            self._advance(block=True)  # issues g's data phase (and every earlier one)
            if g.error is not None:
                raise g.error
            out = self._finish("allgatherv", g.handle)
            return self._split("allgatherv", out, [n * item for n in g.counts], t.dtype)

        return Work(wait=finish)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        """chunks[j] to rank j, as raw bytes; what every rank sent here, in rank order. Horovod
        sizes receive buffers from the senders' splits, so the plan is always allgathered
        first (blocking): every rank checks every claim against `max_recv` and against the
        `recv_counts` its receiver expects, and all raise WireFormatError alike."""
        dtype = self._check_chunks(chunks)
        if recv_counts is None and max_recv is None:
            raise ValueError("alltoall without recv_counts needs max_recv, the most elements a rank may send")
        if recv_counts is not None and len(recv_counts) != self.world_size:
            raise ValueError(f"alltoall needs one receive count per rank ({self.world_size}), got {len(recv_counts)}")
        world = self.world_size
        send_counts = [c.numel() for c in chunks]
        expects = [int(n) for n in recv_counts] if recv_counts is not None else [-1] * world
        table = self.allgather_ints(send_counts + [dtype_code(dtype)] + expects)
        plan = [row[: world + 1] for row in table]
        if max_recv is not None:
            check_alltoall_claims("alltoall", plan, world, max_recv)
        else:
            check_same_dtype("alltoall", [row[world] for row in plan])
        for dst, row in enumerate(table):
            for src, wanted in enumerate(row[world + 1:]):
                if wanted >= 0 and plan[src][dst] != wanted:
                    raise WireFormatError(f"alltoall: rank {src} sends {plan[src][dst]} elements to rank {dst}, "
                                          f"which expects {wanted}", peer=src)
        counts = [plan[src][self.rank] for src in range(world)]
        item = dtype.itemsize
        send = torch.cat([framed(as_bytes(c)) for c in chunks])
        splits = [n * item + TRAILER for n in send_counts]
        self._advance(block=False)
        handle = self._call("alltoall", lambda: hvd.alltoall_async(send, splits=splits, name=self._name("alltoall")))

        def finish() -> list[torch.Tensor]:
            out, received = self._wait("alltoall", handle)
            for src, (got, n) in enumerate(zip(received.tolist(), counts)):
                if got != n * item + TRAILER:
                    raise WireFormatError(f"alltoall: rank {src} sent {got} bytes here, its plan said "
                                          f"{n * item + TRAILER}", peer=src)
            return self._split("alltoall", out, [n * item for n in counts], dtype)

        return Work(wait=finish)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        """src's tensor on every rank, written into t (and returned)."""
        if not 0 <= src < self.world_size:
            raise ValueError(f"broadcast src {src} is not a rank of this {self.world_size}-rank job")
        self._advance(block=False)
        payload = as_bytes(t)
        n = payload.numel()
        buf = framed(payload) if self.rank == src else torch.zeros(n + TRAILER, dtype=torch.uint8, device=t.device)
        handle = self._call("broadcast", lambda: hvd.broadcast_async_(buf, root_rank=src,
                                                                        name=self._name("broadcast")))

        def finish() -> torch.Tensor:
            self._wait("broadcast", handle)
            check_frames("broadcast", [buf], [n], ranks=[src])
            if self.rank != src:
                with torch.no_grad():
                    t.copy_(buf[:n].view(t.dtype).view(t.shape))
            return t

        return Work(wait=finish)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        self._advance(block=False)
        _, rows = self._rows("allgather_ints", [int(v) for v in values])
        self._advance(block=True)
        return rows()
