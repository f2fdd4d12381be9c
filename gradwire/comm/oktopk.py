"""`oktopk`: a sparse allreduce of top-k gradients whose traffic per rank stays O(k) at any P.

After Ok-Topk (Li & Hoefler, PPoPP'22). Allgathered top-k moves k(P-1) pairs into every rank;
here each bucket's index space is split into P regions, region j owned by rank j:

1. every rank selects its exact top-k of each segment (the compressor's rule) and sends the
   pairs in region j to rank j: one variable-size all-to-all, at most k pairs out;
2. each owner sums what it received, in rank order, and keeps the entries whose magnitude
   reaches a global threshold chosen so that about k entries survive over all regions (at
   most k per region, the largest, should a stale threshold let more through);
3. one allgatherv of the kept (index, sum) pairs: about k/P out, about k in.

So a rank sends at most k + k/P pairs and receives about 2k per step, at any P. Indices travel
as bit-packed gaps relative to their region (gradwire's index codec, about 1-2 bytes each).

Region boundaries balance the kept entries: after a bucket's first step and every
`boundary_every` steps they move to the quantiles of that step's kept indices, which every rank holds, so all agree without a
message. The threshold is re-estimated from a histogram of the owners' summed magnitudes
(one allreduce of integers: exact on every backend) at a bucket's first step, every
`threshold_every` steps, and after a step that kept under 2k/3 or over 3k/2 entries; between,
it is reused, as in Ok-Topk. Segments under `min_numel` elements (biases) are sent whole and
always kept, outside the k budget: a 1% top-k would starve them.

Error feedback keeps, per rank, everything it did not contribute to the result: unselected
entries and selected ones whose index the owners dropped. Every sum is computed once, by its
owner, in rank order, and copied to every rank, so replicas are bit-identical. Each rank's
step-3 message also carries sum(x) and a status word: a NaN/Inf anywhere makes every rank's
result non-finite (AMP's GradScaler then skips the step everywhere), and a malformed chunk
seen by one owner makes every rank raise `WireFormatError`, none hangs.

Tests: tests/comm/test_oktopk.py (gloo, P = 2, 3, 4, 8) and tests/comm/mpi_programs/oktopk.py (mpiexec),
both running the oracle checks of tests/support/oktopk_checks.py; hostile chunks in
tests/comm/test_hostile_peers.py.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..compress import Compressor, Ctx, indexcodec
from ..compress.select import topk
from ..errors import WireFormatError
from .backend import Backend, Work
from .base import Strategy, StrategyTraits, Workload, accumulation_dtype, segments_of
from .links import CostModel, Links

_BIN_SHIFT = 20  # histogram bins: a magnitude's float32 bits >> 20 (8 exponent + 3 mantissa bits)
_BINS = 1 << (31 - _BIN_SHIFT)
_HEADER = 12  # step-3 message: int32 status, int32 bad source rank, float32 sum(x)


@dataclass
class _BucketState:
    """What one bucket carries across steps (the same on every rank)."""

    bounds: list[int]  # P + 1 region edges
    threshold_bits: int | None = None  # float32 bits of the global magnitude threshold
    steps: int = 0
    last_kept: int = -1


def _pairs(idx: torch.Tensor, values: torch.Tensor, lo: int, hi: int) -> torch.Tensor:
    """Ascending indices in [lo, hi) and their values as one uint8 buffer: int32 count and
    packed length, the indices' gaps bit-packed by the index codec (about 1 byte each at 1%
    density instead of 4), then the values."""
    packed = indexcodec.encode(idx - lo, hi - lo) if idx.numel() else torch.empty(0, dtype=torch.uint8)
    head = torch.tensor([idx.numel(), packed.numel()], dtype=torch.int32).view(torch.uint8)
    return torch.cat([head, packed.to(values.device), values.contiguous().view(torch.uint8)])


def pairs_bound(count: int, lo: int, hi: int, item: int) -> int:
    """The most bytes `_pairs` writes for at most `count` pairs in region [lo, hi)."""
    n = max(min(count, hi - lo), 0)
    return 8 + indexcodec.max_size(n, hi - lo) + n * item


def _unpairs(buf: torch.Tensor, dtype: torch.dtype, lo: int, hi: int, what: str,
             cap: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Split a pair buffer; WireFormatError unless its lengths add up, it holds at most `cap`
    pairs (what the sender's k allows) and its indices ascend strictly inside [lo, hi). Nothing
    larger than the buffer is allocated before the checks."""
    item = dtype.itemsize
    if buf.numel() < 8:
        raise WireFormatError(f"{what}: {buf.numel()} bytes cannot hold its 8-byte header")
    n, packed_len = buf[:8].clone().view(torch.int32).tolist()
    if not 0 <= n <= hi - lo or packed_len < 0 or 8 + packed_len + n * item != buf.numel():
        raise WireFormatError(f"{what}: header (count {n}, packed {packed_len} bytes) does not match its "
                              f"{buf.numel()} bytes for region [{lo}, {hi})")
    if cap is not None and n > cap:
        raise WireFormatError(f"{what}: {n} pairs, more than the {cap} its top-k allows in region [{lo}, {hi})")
    if n == 0:
        return torch.empty(0, dtype=torch.int64), torch.empty(0, dtype=dtype)
    packed = buf[8: 8 + packed_len].cpu()
    indexcodec.check(packed, n)
    idx = indexcodec.decode(packed, n, hi - lo).to(buf.device) + lo  # ascending, unique, in range
    values = buf[8 + packed_len:].clone().view(dtype)
    return idx, values


def magnitude_bits(values: torch.Tensor) -> torch.Tensor:
    """float32 bit patterns of |values| as int32: ordered like the magnitudes (NaN largest)."""
    return values.float().abs().view(torch.int32)


def threshold_from_histogram(hist: torch.Tensor, k: int) -> int:
    """float32 bits of a magnitude threshold that keeps about k entries (0, keep all, if there
    are fewer): inside the bin holding the k-th largest, entries are taken as evenly spread
    over its bit patterns (about evenly in log-magnitude), so only the needed share passes."""
    from_top = hist.long().flip(0).cumsum(0)
    reached = (from_top >= k).nonzero()
    if k <= 0 or reached.numel() == 0:
        return 0
    j = int(reached[0, 0])
    b = _BINS - 1 - j
    in_bin = int(hist[b])
    need = k - (int(from_top[j]) - in_bin)  # 1..in_bin entries of this bin
    width = 1 << _BIN_SHIFT
    return (b << _BIN_SHIFT) + width - (width * need) // in_bin


def keep_largest(positions: torch.Tensor, bits: torch.Tensor, threshold_bits: int, cap: int) -> torch.Tensor:
    """Ascending positions whose magnitude bits reach the threshold, at most `cap` of them (the
    largest; ties to the lowest position)."""
    keep = positions[bits >= threshold_bits]
    if keep.numel() <= cap:
        return keep
    kb = bits[bits >= threshold_bits]
    order = torch.argsort(kb, descending=True, stable=True)[:cap]  # stable: ties to the lowest position
    return keep[order].sort().values


def oktopk_seconds(m: CostModel, k: int, item: int, world: int) -> float:
    """Modelled `oktopk` exchange of k pairs: (P-1)/P of them out by all-to-all, then an
    allgatherv of about k/P kept pairs each (a value and a bit-packed index, ~2 bytes)."""
    pair = 2 + item
    return m.alltoall(k * pair * (world - 1) // world, world) + m.allgather(k * pair // world + 12, world, sized=False)


class OkTopK(Strategy):
    """Top-k sparse allreduce with O(k) traffic per rank (see the module docstring)."""

    name = "oktopk"
    TRAITS = StrategyTraits("oktopk", frozenset({"boundary_every", "threshold_every", "min_numel"}), stateful=True)

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True,
                 boundary_every: int = 256, threshold_every: int = 32, min_numel: int = 0) -> None:
        super().__init__(backend, compressor, error_feedback, min_numel)
        if not self.compressor.selects_global_topk:
            raise ValueError(f"oktopk needs a plain topk compressor (it selects from the sum over ranks, "
                             f"not per chunk), got {self.compressor}")
        if int(boundary_every) < 1 or int(threshold_every) < 1:
            raise ValueError(f"boundary_every and threshold_every must be >= 1, got {boundary_every}, "
                             f"{threshold_every}")
        self.boundary_every = int(boundary_every)
        self.threshold_every = int(threshold_every)
        self.buckets: dict[str, _BucketState] = {}

    def _bucket(self, name: str, numel: int) -> _BucketState:
        world = self.backend.world_size
        state = self.buckets.get(name)
        if state is None or state.bounds[-1] != numel:
            state = self.buckets[name] = _BucketState([numel * j // world for j in range(world + 1)])
        return state

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        world, rank = self.backend.world_size, self.backend.rank
        segs = segments_of(x, key, shapes, keys)
        state = self._bucket("|".join(s.key for s in segs), x.numel())
        corrected = [self._correct(seg.of(x), seg.key) for seg in segs]
        flat = torch.cat(corrected) if len(corrected) > 1 else corrected[0]
        # segments under min_numel (biases) are sent whole and always kept, outside the k budget
        small = [seg.numel < self.min_numel for seg in segs]
        ks = [self.compressor.value_count(seg.numel) or 0 for seg in segs]  # type: ignore[attr-defined]
        k = sum(n for n, s in zip(ks, small) if not s)
        picked = [torch.arange(seg.offset, seg.offset + seg.numel, device=x.device) if s else topk(c, n)[0] + seg.offset
                  for seg, c, n, s in zip(segs, corrected, ks, small)]
        idx = torch.cat(picked) if picked else torch.empty(0, dtype=torch.int64)
        bounds = state.bounds
        cuts = torch.searchsorted(idx, torch.tensor(bounds, dtype=torch.int64)).tolist()
        chunks = [_pairs(idx[cuts[j]: cuts[j + 1]], flat[idx[cuts[j]: cuts[j + 1]]], bounds[j], bounds[j + 1])
                  for j in range(world)]
        t1 = time.perf_counter()
        # What a rank may send to region j: its top-k pairs there plus the region's small segments whole.
        item = x.element_size()
        small_in = [sum(max(min(seg.offset + seg.numel, bounds[j + 1]) - max(seg.offset, bounds[j]), 0)
                        for seg, s in zip(segs, small) if s) for j in range(world)]
        caps = [k + small_in[j] for j in range(world)]
        limits = [pairs_bound(caps[j], bounds[j], bounds[j + 1], item) for j in range(world)]
        bad_src = -1
        try:  # stage 1: region j's pairs to rank j (a claim over the limit raises on every rank here)
            received = self.backend.alltoall(chunks, max_recv=limits).wait()
        except WireFormatError as e:  # a chunk to this rank alone arrived short: told to all in stage 3
            received, bad_src = [], e.peer if e.peer is not None else rank
        t2 = time.perf_counter()

        # stage 2: this rank's region, summed in rank order
        lo, hi = bounds[rank], bounds[rank + 1]
        region = torch.zeros(hi - lo, dtype=accumulation_dtype(x.dtype), device=x.device)
        touched = torch.zeros(hi - lo, dtype=torch.bool, device=x.device)
        for src, buf in enumerate(received):
            try:
                ridx, rval = _unpairs(buf, x.dtype, lo, hi, f"oktopk: rank {src}'s chunk for rank {rank}",
                                      cap=caps[rank])
            except WireFormatError:
                bad_src = src  # reported to every rank in stage 3, so no rank goes on alone
                break
            pos = ridx - lo
            region.index_add_(0, pos, rval.to(region.dtype))
            touched[pos] = True
        forced = torch.zeros(hi - lo, dtype=torch.bool, device=x.device)
        for seg, s in zip(segs, small):
            if s:
                forced[max(seg.offset - lo, 0): max(min(seg.offset + seg.numel, hi) - lo, 0)] = True
        positions = touched.nonzero().view(-1)
        always = positions[forced[positions]]
        positions = positions[~forced[positions]]
        bits = magnitude_bits(region[positions])
        estimate = (state.threshold_bits is None or state.steps % self.threshold_every == 0
                    or not 2 * k / 3 <= state.last_kept <= 3 * k / 2)
        hist_bytes = 0
        if estimate:  # every rank takes this branch in the same steps: the state is shared
            hist = torch.bincount((bits >> _BIN_SHIFT).long(), minlength=_BINS).to(torch.int32)
            self.backend.allreduce(hist).wait()
            state.threshold_bits = threshold_from_histogram(hist, k)
            hist_bytes = 2 * (world - 1) * hist.numel() * hist.element_size() // world  # a ring allreduce, each way
        keep = keep_largest(positions, bits, state.threshold_bits, max(k, 0))  # type: ignore[arg-type]
        if always.numel():
            keep = torch.cat([keep, always]).sort().values
        values = region[keep]
        if average:
            values.div_(world)
        head = torch.tensor([0 if bad_src < 0 else 1, bad_src], dtype=torch.int32).view(torch.uint8)
        total = torch.tensor([float(flat.float().sum()) if flat.numel() else 0.0], dtype=torch.float32)
        message = torch.cat([head, total.view(torch.uint8), _pairs(keep + lo, values.to(x.dtype), lo, hi)])
        t3 = time.perf_counter()
        self.stats.encode_s += (t1 - t0) + (t3 - t2)
        self.stats.exchange_s += t2 - t1
        sent = sum(c.numel() for j, c in enumerate(chunks) if j != rank) + 16 * (world - 1)
        got = sum(b.numel() for j, b in enumerate(received) if j != rank) + 16 * (world - 1)

        def finish(messages: list[torch.Tensor]) -> torch.Tensor:
            t4 = time.perf_counter()
            self.stats.exchange_s += t4 - t3
            self._count(key, x, sent + message.numel() + 8 + hist_bytes,
                        got + sum(m.numel() for m in messages) - message.numel() + 8 * (world - 1) + hist_bytes)
            out = torch.zeros_like(x)
            kept, nonfinite = [], 0.0
            for owner, m in enumerate(messages):  # every rank reads the same bytes: all agree
                if m.numel() < _HEADER:
                    raise WireFormatError(f"oktopk: rank {owner}'s result of {m.numel()} bytes has no header",
                                          peer=owner)
                status, culprit = m[:8].clone().view(torch.int32).tolist()
                if status != 0:
                    raise WireFormatError(f"oktopk: rank {culprit} sent rank {owner} a malformed chunk", peer=culprit)
                nonfinite += float(m[8:12].clone().view(torch.float32))
                oidx, oval = _unpairs(m[_HEADER:], x.dtype, bounds[owner], bounds[owner + 1],
                                      f"oktopk: rank {owner}'s result", cap=caps[owner])
                out[oidx] = oval
                kept.append(oidx)
            if not math.isfinite(nonfinite):
                out.add_(nonfinite)  # NaN/Inf on any rank reaches every rank
            everything = torch.cat(kept)
            if self.feedback is not None:  # a rank keeps all it did not contribute to the result
                contributed = torch.zeros_like(flat)
                mine = idx[torch.isin(idx, everything)]
                contributed[mine] = flat[mine]
                for seg, c in zip(segs, corrected):
                    self._remember(seg.key, c, seg.of(contributed))
            state.steps += 1
            state.last_kept = everything.numel() - sum(seg.numel for seg, s in zip(segs, small) if s)
            rebalance = state.steps == 1 or state.steps % self.boundary_every == 0  # first: regions start equal
            if rebalance and everything.numel() >= world:
                state.bounds = [0] + [int(everything[everything.numel() * j // world]) for j in range(1, world)] \
                    + [x.numel()]
            self.stats.decode_s += time.perf_counter() - t4
            return out

        most = _HEADER + max(limits)  # an owner's result: at most its region's cap of pairs
        return self.backend.allgatherv(message, max_numel=most).then(finish)

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float:
        k = sum(self.compressor.value_count(n) for n in work.sizes)  # type: ignore[attr-defined]
        return oktopk_seconds(links.flat, k // work.share, work.dtype.itemsize, world)

    def compute_seconds(self, work: Workload, world: int) -> float:
        """One encode (the selection), one decode of the owners' results."""
        return work.numel // work.share * (work.encode_s + work.decode_s)

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "buckets": {n: vars(s).copy() for n, s in self.buckets.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.buckets = {n: _BucketState(**s) for n, s in state.get("buckets", {}).items()}
