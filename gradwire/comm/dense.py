"""`dense` and `allreduce`: one allreduce per bucket, of the gradient itself or of a summable payload.

- `dense`: the bucket as it is, divided by world size first exactly as torch's allreduce_hook does.
- `allreduce`: summable compressors (none, fp16, bf16, randomk): each segment's payload (a cast,
  or values at indices every rank shares), allreduced in one message and decoded back; divided
  before the sum as torch's hooks do, so `none` and `fp16` match them bit for bit.

Tests: tests/comm/test_strategies.py (and every hook test that compares with torch's hooks).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from ..compress import Compressor, Ctx
from .backend import Backend, Work
from .base import Strategy, StrategyTraits, Workload, segment_ctx, segments_of
from .links import Links


class DenseAllreduce(Strategy):
    """Plain allreduce, divided by world size first exactly as torch's allreduce_hook does."""

    name = "dense"
    TRAITS = StrategyTraits("dense", frozenset(), never_waits=True, one_linear_allreduce=True)

    def __init__(self, backend: Backend) -> None:
        super().__init__(backend, "none", error_feedback=False)

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t = x if self.into_input else x.clone()
        if average:
            t.div_(self.backend.world_size)
        nbytes = t.numel() * t.element_size()
        self._count(key, x, nbytes, nbytes * (self.backend.world_size - 1))
        return self._timed_allreduce(t)

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float:
        return links.flat.allreduce(work.dense_bytes // work.share, world)


class Allreduce(Strategy):
    """Summable payloads (casts, shared-index values), one allreduce per bucket, divided
    before the sum as torch's hooks do."""

    name = "allreduce"
    TRAITS = StrategyTraits("allreduce", frozenset(), swaps_compressor=True, never_waits=True,
                             one_linear_allreduce=True)

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True) -> None:
        super().__init__(backend, compressor, error_feedback)
        if not self.compressor.summable:
            raise ValueError(f"{self.compressor} payloads are not summable; use the allgather strategy")

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        if self.feedback is None and getattr(self.compressor, "elementwise", False):
            return self._whole(x, key, ctx, average, t0)
        segs = segments_of(x, key, shapes, keys)
        payloads = []
        fused = self.feedback is not None and getattr(self.compressor, "elementwise", False)
        for seg in segs:
            part, sctx = seg.of(x), segment_ctx(ctx, seg)
            if fused:  # a cast's payload is its packet's data: error feedback in place, in one pass
                payloads.append(self.feedback.encode(part, seg.key, sctx).sections[0].data)  # type: ignore[union-attr]
                continue
            corrected = self._correct(part, seg.key)
            payload = self.compressor.to_summable(corrected, sctx)
            if self.feedback is not None:
                self._remember(seg.key, corrected, self.compressor.from_summable(payload.clone(), corrected, sctx))
            payloads.append(payload)
        sizes = [p.numel() for p in payloads]

        def decode(summed: torch.Tensor) -> torch.Tensor:
            out = torch.empty_like(x)
            for seg, part in zip(segs, torch.split(summed, sizes)):
                seg.of(out).copy_(self.compressor.from_summable(part, seg.of(x), segment_ctx(ctx, seg)))
            return out

        return self._send(x, key, payloads[0] if len(payloads) == 1 else torch.cat(payloads), average, t0, decode)

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float | None:
        """A cast's payload is its wire dtype, element for element (the cast itself is taken as
        free); other payloads are not modelled."""
        if not getattr(self.compressor, "elementwise", False):
            return None
        wire_dtype = getattr(self.compressor, "wire_dtype", None) or work.dtype
        return links.flat.allreduce(work.numel * wire_dtype.itemsize // work.share, world)

    def _whole(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool, t0: float) -> Work[torch.Tensor]:
        """An elementwise cast without error feedback: the bucket converted at once (the same
        bits as segment by segment), as torch's fp16 hook does, and widened into x's memory
        on the way back: no per-segment work, no concatenation, no fresh output."""

        def decode(summed: torch.Tensor) -> torch.Tensor:
            if self.into_input and not x.is_cuda:  # (CUDA: gradwire's cast kernel sets NaN bits)
                return x.copy_(summed.view(x.shape))
            return self.compressor.from_summable(summed, x, ctx)

        return self._send(x, key, self.compressor.to_summable(x, ctx), average, t0, decode)

    def _send(self, x: torch.Tensor, key: int | str, payload: torch.Tensor, average: bool, t0: float,
              decode: Callable[[torch.Tensor], torch.Tensor]) -> Work[torch.Tensor]:
        """Divide the payload first (as torch's hooks do), allreduce it, `decode` the sum; timed and counted."""
        if average:
            payload.div_(self.backend.world_size)
        t1 = time.perf_counter()
        self.stats.encode_s += t1 - t0
        nbytes = payload.numel() * payload.element_size()
        self._count(key, x, nbytes, nbytes * (self.backend.world_size - 1))

        def finish(summed: torch.Tensor) -> torch.Tensor:
            t2 = time.perf_counter()
            self.stats.exchange_s += t2 - t1
            out = decode(summed)
            self.stats.decode_s += time.perf_counter() - t2
            return out

        return self.backend.allreduce(payload).then(finish)
