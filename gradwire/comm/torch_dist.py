"""Backend over torch.distributed (gloo on CPU, NCCL on CUDA). Asynchronous: every
collective returns a Work wrapping the collective's torch Future.

A collective that fails (a peer died, froze past the group's timeout, or reset its connection)
turns into `CollectiveError` at `wait()`: every callback reads the collective's own result
first, so a failed allreduce never hands back its unreduced buffer. Gathered and all-to-all
chunks are framed (framing.py) and sizes travel as fixed-layout int64 tensors: nothing a peer
sends is unpickled. Sub-groups inherit the group's timeout.

Striping (`stripes=K`, or `GRADWIRE_GLOO_STRIPES=K` as NCCL_NSOCKS_PERTHREAD is for NCCL): gloo
moves a collective over one TCP connection per peer and waits on its peer at every ring step, so
one allreduce cannot fill a link with a long round trip (docs/benchmarks.md, "Round-trip time
between emulated nodes", measures by how much). With K stripes, an allreduce of at least `STRIPE_MIN_BYTES` is cut into K contiguous
pieces allreduced at once over K groups of the same ranks (K connections). Every rank still gets
the same sums (each piece is one ring's), so replicas stay identical. The extra groups are made
at the first striped allreduce, which every rank reaches at the same point; ranks that were told
different K raise ConfigMismatchError there, together.
"""

from __future__ import annotations

import datetime
import os
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..errors import CollectiveError, ConfigMismatchError
from .backend import Backend, Work, _Failed, check_alltoall_claims, check_same_dtype, dtype_code
from .framing import TRAILER, as_bytes, check_claims, check_frames, framed


def group_timeout(group: dist.ProcessGroup | None) -> datetime.timedelta | None:
    """The timeout the group's collectives run under (None when torch does not say)."""
    pg = group if group is not None else dist.distributed_c10d._get_default_group()
    for device in ("cpu", "cuda"):
        try:
            return pg._get_backend(torch.device(device)).options._timeout
        except Exception:  # noqa: BLE001 - no backend for that device, or no options exposed
            continue
    return None


def dense_reduce_scatter(out: torch.Tensor, x: torch.Tensor, group: dist.ProcessGroup | None,
                         op: dist.ReduceOp.RedOpType) -> None:
    """torch.distributed's own reduce-scatter (what FSDP2 calls by default), into `out`."""
    dist.reduce_scatter_tensor(out, x, op=op, group=group)


# Every group this module makes lives until the process exits (destroy_process_group shuts it
# down). A gloo group's destructor joins its worker threads, and a collective's callback runs on
# one of them holding the backend through its closure: were the backend's reference the group's
# last, that thread could drop it, join itself, and abort the process ("Resource deadlock avoided").
_GROUPS_MADE: list[dist.ProcessGroup] = []


def _new_group(ranks: list[int], timeout: datetime.timedelta | None, sort_ranks: bool = True) -> dist.ProcessGroup:
    """A group of `ranks` made by them alone, kept alive for the process (see _GROUPS_MADE)."""
    group = dist.new_group(ranks=ranks, timeout=timeout, use_local_synchronization=True, sort_ranks=sort_ranks)
    _GROUPS_MADE.append(group)
    return group


STRIPE_MIN_BYTES = 256 * 1024  # smaller allreduces are round-trip bound: one connection is as fast
STRIPES_ENV = "GRADWIRE_GLOO_STRIPES"


def stripes_from_env() -> int:
    """K of GRADWIRE_GLOO_STRIPES (1 when unset); anything but a positive integer raises ValueError."""
    text = os.environ.get(STRIPES_ENV, "1").strip()
    if not text.isdigit() or int(text) < 1:
        raise ValueError(f"{STRIPES_ENV} must be a positive integer (connections per peer), got {text!r}")
    return int(text)


class TorchDistBackend(Backend):
    allreduce_identical = True  # ring reduce-scatter then allgather: one sum per element, copied
    issue_from_any_thread = True  # process groups are thread-safe; each collective keeps its issue order

    def __init__(self, group: dist.ProcessGroup | None = None, stripes: int | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first")
        self.stripes = stripes_from_env() if stripes is None else int(stripes)
        if self.stripes < 1:
            raise ValueError(f"stripes must be >= 1, got {stripes}")
        self._stripe_groups: list[dist.ProcessGroup | None] | None = None  # made at the first striped allreduce
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)
        self.timeout = group_timeout(group)
        # where small host-side exchanges (sizes, checks) live: NCCL moves device memory only
        self.small_device = torch.device("cuda", torch.cuda.current_device()) \
            if dist.get_backend(group) == "nccl" else torch.device("cpu")

    def __repr__(self) -> str:
        return f"TorchDistBackend(rank={self.rank}, world_size={self.world_size})"

    # ---- failures ------------------------------------------------------------------
    def _error(self, op: str, e: BaseException) -> CollectiveError:
        return CollectiveError(f"{op} over a {self.world_size}-rank group failed on its rank {self.rank} "
                               f"(global rank {dist.get_rank()}): {e}")

    def _async(self, op: str, issue: Callable[[], Any], result: Callable[[], Any]) -> Work[Any]:
        """Issue a collective; the Work holds `result()` once the collective succeeded, else the
        CollectiveError (a step that raises, e.g. a frame check, hands its own error on)."""
        try:
            fut = issue().get_future()
        except RuntimeError as e:  # the connection was already gone
            raise self._error(op, e) from e

        def step(f: torch.futures.Future) -> Any:
            try:
                f.value()
            except Exception as e:  # noqa: BLE001 - the transport's error, named
                return _Failed(self._error(op, e))
            try:
                return result()
            except Exception as e:  # noqa: BLE001 - handed on unchanged to wait()
                return _Failed(e)

        return Work(future=fut.then(step))

    # ---- collectives ---------------------------------------------------------------
    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        if self.stripes > 1 and self.world_size > 1 and t.numel() * t.element_size() >= STRIPE_MIN_BYTES \
                and t.is_contiguous():
            return self._striped_allreduce(t)
        return self._async("allreduce", lambda: dist.all_reduce(t, group=self.group, async_op=True), lambda: t)

    def _striped_allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        """t's K contiguous pieces allreduced at once, each over its own group (connection)."""
        groups = self._stripes()
        pieces = t.view(-1).chunk(len(groups))
        try:
            futs = [dist.all_reduce(p, group=g, async_op=True).get_future() for p, g in zip(pieces, groups)]
        except RuntimeError as e:  # the connection was already gone
            raise self._error("allreduce", e) from e

        def step(all_done: torch.futures.Future) -> Any:
            for f in all_done.value():
                try:
                    f.value()
                except Exception as e:  # noqa: BLE001 - the transport's error, named
                    return _Failed(self._error("allreduce", e))
            return t

        return Work(future=torch.futures.collect_all(futs).then(step))

    def _stripes(self) -> list[dist.ProcessGroup | None]:
        if self._stripe_groups is None:
            told = {row[0] for row in self.allgather_ints([self.stripes])}
            if len(told) > 1:
                raise ConfigMismatchError(f"ranks were told different numbers of gloo stripes ({STRIPES_ENV} or "
                                          f"stripes=): {sorted(told)}; every rank must use the same")
            ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r
                     for r in range(self.world_size)]
            extra = [_new_group(ranks, self.timeout) for _ in range(self.stripes - 1)]
            self._stripe_groups = [self.group, *extra]
        return self._stripe_groups

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        payload = as_bytes(t)
        n = payload.numel()
        send = framed(payload)
        outs = [torch.zeros_like(send) for _ in range(self.world_size)]

        def result() -> list[torch.Tensor]:
            check_frames("allgather", outs, [n] * self.world_size)
            return [o[:n].view(t.dtype) for o in outs]

        return self._async("allgather", lambda: dist.all_gather(outs, send, group=self.group, async_op=True), result)

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        # Sizes and dtypes first (one small blocking exchange), checked, then a padded allgather.
        info = self.allgather_ints([t.numel(), dtype_code(t.dtype)])
        check_same_dtype("allgatherv", [c for _, c in info])
        counts = [n for n, _ in info]
        check_claims("allgatherv", counts, int(max_numel))
        item = t.element_size()
        longest = max(counts) * item
        send = framed(as_bytes(t), padded=longest)
        outs = [torch.zeros_like(send) for _ in range(self.world_size)]

        def result() -> list[torch.Tensor]:
            check_frames("allgatherv", outs, [n * item for n in counts])
            return [o[: n * item].view(t.dtype) for o, n in zip(outs, counts)]

        return self._async("allgatherv", lambda: dist.all_gather(outs, send, group=self.group, async_op=True), result)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        dtype = self._check_chunks(chunks)
        device = chunks[0].device
        send_counts = [c.numel() for c in chunks]
        if recv_counts is None:
            if max_recv is None:
                raise ValueError("alltoall without recv_counts needs max_recv, the most elements a rank may send")
            matrix = self.allgather_ints(send_counts + [dtype_code(dtype)])
            check_alltoall_claims("alltoall", matrix, self.world_size, max_recv)
            recv_counts = [row[self.rank] for row in matrix]
        elif len(recv_counts) != self.world_size:
            raise ValueError(f"alltoall needs one receive count per rank ({self.world_size}), got {len(recv_counts)}")
        item = dtype.itemsize
        send = torch.cat([framed(as_bytes(c)) for c in chunks])
        in_splits = [n * item + TRAILER for n in recv_counts]
        out = torch.zeros(sum(in_splits), dtype=torch.uint8, device=device)
        out_splits = [n * item + TRAILER for n in send_counts]
        counts = list(recv_counts)

        def result() -> list[torch.Tensor]:
            slots = list(torch.split(out, in_splits))
            check_frames("alltoall", slots, [n * item for n in counts])
            return [s[: n * item].view(dtype) for s, n in zip(slots, counts)]

        return self._async("alltoall", lambda: dist.all_to_all_single(out, send, in_splits, out_splits,
                                                                      group=self.group, async_op=True), result)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        payload = as_bytes(t)
        n = payload.numel()
        buf = framed(payload) if self.rank == src else torch.zeros(n + TRAILER, dtype=torch.uint8, device=t.device)
        root = dist.get_global_rank(self.group, src) if self.group else src

        def result() -> torch.Tensor:
            check_frames("broadcast", [buf], [n], ranks=[src])
            if self.rank != src:
                with torch.no_grad():
                    t.copy_(buf[:n].view(t.dtype).view(t.shape))
            return t

        return self._async("broadcast", lambda: dist.broadcast(buf, src=root, group=self.group, async_op=True), result)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64, device=self.small_device)
        return [o.tolist() for o in self.allgather(mine).wait()]

    def split(self, color: int, key: int) -> "TorchDistBackend":
        pairs = self.allgather_ints([int(color), int(key)])
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == int(color))
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r for _, r in members]
        # only the members create their group, so the groups of other colors need not exist here;
        # the sub-group fails within the parent's timeout, not torch's 30-minute default
        group = _new_group(ranks, self.timeout, sort_ranks=False)
        return TorchDistBackend(group, stripes=self.stripes)
