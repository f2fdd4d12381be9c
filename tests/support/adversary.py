"""The attacker's and the failing cluster's tools for the fault tests.

An attacker controls its own process, so it replaces its own backend: `Liar` is a real
TorchDistBackend whose rank sends what the scenario wants (lying size claims, short chunks,
forged records); `Saboteur` wraps any backend and kills or freezes its process at the n-th call
of one collective, mid-exchange. Honest ranks run the unmodified code and report what they
raised, how long it took and how much their peak memory grew.
"""

from __future__ import annotations

import os
import resource
import time
from typing import Any, Callable

import torch
import torch.distributed as dist

from gradwire.comm.backend import Backend, Work
from gradwire.comm.framing import framed, as_bytes
from gradwire.comm.torch_dist import TorchDistBackend


def peak_rss_mb() -> float:
    """This process's peak resident memory so far, in MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def outcome(fn: Callable[[], Any]) -> dict[str, Any]:
    """What fn did on this rank: the error's type and message (or 'ok'), seconds, peak-memory growth."""
    before, t0 = peak_rss_mb(), time.monotonic()
    try:
        fn()
        kind, message = "ok", ""
    except Exception as e:  # noqa: BLE001 - the test asserts the type
        kind, message = type(e).__name__, str(e)
    return {"kind": kind, "message": message, "seconds": time.monotonic() - t0,
            "grew_mb": peak_rss_mb() - before}


class Liar(TorchDistBackend):
    """A real gloo backend that lies where told: `ints(values) -> values` rewrites what it declares
    in fixed-layout exchanges (sizes, plans, configs); `chunk(dst, bytes) -> bytes` rewrites the
    framed all-to-all chunk it sends to rank dst (a short one included); `gather(bytes) -> bytes`
    rewrites its allgatherv payload after the sizes were declared."""

    def __init__(self, group: dist.ProcessGroup | None = None,
                 ints: Callable[[list[int]], list[int]] | None = None,
                 chunk: Callable[[int, torch.Tensor], torch.Tensor] | None = None,
                 gather: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 content: Callable[[int, torch.Tensor], torch.Tensor] | None = None) -> None:
        super().__init__(group)
        self.lie_ints, self.lie_chunk, self.lie_gather, self.lie_content = ints, chunk, gather, content

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        values = self.lie_ints(list(values)) if self.lie_ints else values
        mine = torch.tensor([int(v) for v in values], dtype=torch.int64)
        return [o.tolist() for o in TorchDistBackend.allgather(self, mine).wait()]  # (not the content lie)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        return super().allgather(self.lie_content(-1, t) if self.lie_content else t)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        if self.lie_content is not None:  # forged content, declared and framed honestly
            chunks = [self.lie_content(j, c) for j, c in enumerate(chunks)]
        if self.lie_chunk is None:
            return super().alltoall(chunks, recv_counts, max_recv)
        # The honest protocol up to the wire, then the forged bytes: what a modified process sends.
        dtype = chunks[0].dtype
        item = chunks[0].element_size()
        if recv_counts is None:
            matrix = self.allgather_ints([c.numel() for c in chunks] + [_code(dtype)])
            recv_counts = [row[self.rank] for row in matrix]
        sends = [self.lie_chunk(j, framed(as_bytes(c))) for j, c in enumerate(chunks)]
        in_splits = [n * item + 8 for n in recv_counts]
        out = torch.zeros(sum(in_splits), dtype=torch.uint8)
        dist.all_to_all_single(out, torch.cat(sends), in_splits, [s.numel() for s in sends], group=self.group)
        return Work.done([s[:-8].view(dtype) for s in torch.split(out, in_splits)])

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        if self.lie_content is not None:  # forged content, declared and framed honestly
            t = self.lie_content(-1, t)
        if self.lie_gather is None:
            return super().allgatherv(t, max_numel)
        # declare the honest size, then send a payload of another length (padded like the others)
        info = self.allgather_ints([t.numel(), _code(t.dtype)])
        longest = max(n for n, _ in info) * t.element_size()
        payload = self.lie_gather(as_bytes(t))
        send = framed(payload, padded=longest)[: longest + 8]
        outs = [torch.zeros(longest + 8, dtype=torch.uint8) for _ in range(self.world_size)]
        dist.all_gather(outs, send, group=self.group)
        return Work.done([o[: n * t.element_size()].view(t.dtype) for o, (n, _) in zip(outs, info)])


def _code(dtype: torch.dtype) -> int:
    from gradwire.comm.backend import dtype_code

    return dtype_code(dtype)


class Saboteur(Backend):
    """Wraps a backend; at the `at`-th call (1-based) of `op` ("any": of any collective) this
    process dies (os._exit) or freezes (sleeps `freeze_s`, then dies): a rank failing mid-exchange."""

    def __init__(self, inner: Backend, op: str, at: int, mode: str = "die", freeze_s: float = 600.0) -> None:
        self.inner, self.op, self.at, self.mode, self.freeze_s = inner, op, at, mode, freeze_s
        self.rank, self.world_size = inner.rank, inner.world_size
        self.allreduce_identical = inner.allreduce_identical
        self.calls = 0

    def _maybe_fail(self, op: str) -> None:
        if self.op not in (op, "any"):
            return
        self.calls += 1
        if self.calls >= self.at:
            if self.mode == "freeze":
                time.sleep(self.freeze_s)
            os._exit(17)

    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        self._maybe_fail("allreduce")
        return self.inner.allreduce(t)

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        self._maybe_fail("allgather")
        return self.inner.allgather(t)

    def allgatherv(self, t: torch.Tensor, max_numel: int) -> Work[list[torch.Tensor]]:
        self._maybe_fail("allgatherv")
        return self.inner.allgatherv(t, max_numel)

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None,
                 max_recv: int | list[int] | None = None) -> Work[list[torch.Tensor]]:
        self._maybe_fail("alltoall")
        return self.inner.alltoall(chunks, recv_counts, max_recv)

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        self._maybe_fail("broadcast")
        return self.inner.broadcast(t, src)

    def allgather_ints(self, values: list[int]) -> list[list[int]]:
        self._maybe_fail("allgather_ints")
        return self.inner.allgather_ints(values)

    def split(self, color: int, key: int) -> Backend:
        return self.inner.split(color, key)
