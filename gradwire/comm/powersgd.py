"""PowerSGD (Vogels, Karimireddy & Jaggi, 2019): rank-r gradient approximation by one power
iteration per step, exchanged with two small allreduces.

Each segment of a bucket (a parameter) is viewed as a matrix M of shape (shape[0], -1).
Matrices worth it, ``(n + m) * r * min_compression_rate < n * m`` with ``r = min(n, m, rank)``,
are compressed:

    P = M Q;  P = sum over ranks;  orthogonalize P;  Q = M^T P;  Q = sum over ranks / world;  M ~ P Q^T

the rest are concatenated and allreduced dense (summed, then divided). The arithmetic follows
torch's ``powerSGD_hook`` step by step (the same matmuls, orthogonalization, division points,
Q seeding and grouping of matrices by shape), so results agree with it, normally bit for bit:

- error feedback: ``x += e`` first, then ``e = x - (averaged result)`` for every segment (dense
  ones too, which keep ``local - mean``, as in torch);
- warm start keeps each matrix's averaged Q for the next step;
- a fresh Q is drawn on the CPU from a torch seed that ``numpy.random.RandomState(seed)`` hands
  out: one draw for each bucket that holds segments not exchanged before (every bucket, every
  step, without warm start), in the order buckets arrive, so identical on every rank;
- orthogonalization: Gram-Schmidt for r <= 2 or half precision (with ``orthogonalization_epsilon``),
  QR otherwise (torch's rule).

State (error, P and Q memories) is kept per segment key — the parameter name when the DDP hook
passes `keys`, else "<bucket key>/<i>" — so a process that resumes with DDP's initial bucket
grouping continues where the checkpoint left off.

Deliberate differences from torch's hook, none of which changes a finite, nonzero step:
- a column of exact zeros (an unused layer, epsilon 0) stays zero instead of turning into NaN;
- a non-finite step (AMP overflow) gives a non-finite result, but neither the error memory nor
  the warm-start Q is overwritten by it (decided on the device, no host sync);
- a matrix whose gradient is exactly zero on every rank keeps its previous warm-start Q (torch
  stores Q = 0, after which P = M Q stays 0 however the gradient changes);
- 0-d tensors count as 1 x 1 matrices and empty tensors are skipped (torch's hook fails on both);
- all collectives of a bucket are issued from the calling thread (the P allreduce is awaited
  inside `exchange`), so every rank issues them in the same order however many buckets there
  are. (torch's hook issues them from future callbacks; with several buckets on gloo that order
  can differ between ranks and the collectives mismatch.)

Tests: tests/comm/test_powersgd.py (against torch's powerSGD_hook, on real gloo ranks).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from ..compress import Ctx
from .backend import Backend, Work
from .base import Strategy, StrategyTraits, Workload
from .links import Links

_HALF = (torch.float16, torch.bfloat16)
#: PowerSGD's options (torch's PowerSGDState's names), by make_strategy and by auto's inner="powersgd"
POWERSGD_OPTIONS = ("rank", "min_compression_rate", "warm_start", "orthogonalization_epsilon", "seed")


@dataclass(frozen=True)
class _Mat:
    key: str  # the segment's stable key
    offset: int
    n: int
    m: int
    r: int


@dataclass(frozen=True)
class _Layout:
    """Where each piece of a bucket goes; the same on every rank for the same shapes and keys."""

    keys: tuple[str, ...]  # every segment, in bucket order
    sizes: tuple[int, ...]
    dense: tuple[tuple[int, int], ...]  # (offset, numel) of segments allreduced as they are
    dense_numel: int
    mats: tuple[_Mat, ...]  # compressed segments, in torch's shape-grouped order
    p_numel: int
    q_numel: int


def _layout(numel: int, shapes: list, keys: list[str], rank: int, min_rate: float) -> _Layout:
    if len(shapes) != len(keys):
        raise ValueError(f"powersgd: {len(keys)} segment keys for {len(shapes)} shapes")
    dense: list[tuple[int, int]] = []
    sizes: list[int] = []
    groups: dict[tuple[int, int], list[_Mat]] = {}
    offset = 0
    for shape, key in zip(shapes, keys):
        shape = tuple(int(s) for s in shape)
        size = 1
        for s in shape:
            size *= s
        sizes.append(size)
        if size > 0:
            n = shape[0] if shape else 1
            m = size // n
            r = min(n, m, rank)
            if (n + m) * r * min_rate < n * m:
                groups.setdefault((n, m), []).append(_Mat(str(key), offset, n, m, r))
            else:
                dense.append((offset, size))
        offset += size
    if offset != numel:
        raise ValueError(f"powersgd: the shapes hold {offset} elements, but the bucket has {numel}")
    if len(set(keys)) != len(keys):
        raise ValueError("powersgd: segment keys repeat within a bucket")
    mats = tuple(entry for group in groups.values() for entry in group)
    return _Layout(tuple(str(k) for k in keys), tuple(sizes), tuple(dense), sum(c for _, c in dense), mats,
                   sum(t.n * t.r for t in mats), sum(t.m * t.r for t in mats))


def sent_numels(shapes: list, rank: int, min_rate: float = 2.0) -> tuple[int, int, int]:
    """Elements PowerSGD allreduces for tensors of these shapes: (dense part, P, Q), one
    allreduce each; what its wire time is modelled from."""
    numel = sum(math.prod(int(d) for d in s) for s in shapes)
    plan = _layout(numel, list(shapes), [str(i) for i in range(len(shapes))], rank, min_rate)
    return plan.dense_numel, plan.p_numel, plan.q_numel


def _views(flat: torch.Tensor, dims: list[tuple[int, int]]) -> list[torch.Tensor]:
    """Consecutive (1, a, b) views of flat."""
    out, at = [], 0
    for a, b in dims:
        out.append(flat[at:at + a * b].view(1, a, b))
        at += a * b
    return out


def _gram_schmidt(mats: torch.Tensor, epsilon: float) -> None:
    """Orthonormalize the columns of each (batch, rows, cols) matrix in place."""
    for i in range(mats.shape[2]):
        col = mats[:, :, i:i + 1]
        norm = torch.linalg.vector_norm(col, ord=2, dim=1, keepdim=True)
        if epsilon == 0:
            # An all-zero column stays zero; a non-finite one stays non-finite.
            col.div_(torch.where(norm == 0, torch.ones_like(norm), norm))
        else:
            col.div_(norm + epsilon)
        if i + 1 < mats.shape[2]:
            rest = mats[:, :, i + 1:]
            rest.sub_(torch.sum(col * rest, dim=1, keepdim=True) * col)


def orthogonalize(mats: torch.Tensor, epsilon: float = 0.0) -> None:
    """Orthonormal columns in place: Gram-Schmidt for <= 2 columns or half precision, else QR."""
    if mats.dim() != 3 or mats.shape[2] > mats.shape[1]:
        raise ValueError(f"orthogonalize wants (batch, rows, cols) with cols <= rows, got {tuple(mats.shape)}")
    if mats.shape[2] <= 2 or mats.dtype in _HALF:
        _gram_schmidt(mats, epsilon)
    else:
        q, _ = torch.linalg.qr(mats)
        mats.copy_(q)


class PowerSGD(Strategy):
    """Low-rank (rank r) approximation of each large enough matrix in a bucket; see the module doc."""

    name = "powersgd"
    TRAITS = StrategyTraits("powersgd", frozenset(POWERSGD_OPTIONS), own_compression=True, stateful=True)

    def __init__(self, backend: Backend, error_feedback: bool = True, rank: int = 1,
                 min_compression_rate: float = 2.0, warm_start: bool = True,
                 orthogonalization_epsilon: float = 0.0, seed: int = 0) -> None:
        super().__init__(backend, "none", error_feedback)
        if int(rank) < 1:
            raise ValueError(f"powersgd: rank must be >= 1, got {rank}")
        if not float(min_compression_rate) >= 0:
            raise ValueError(f"powersgd: min_compression_rate must be >= 0, got {min_compression_rate}")
        if not float(orthogonalization_epsilon) >= 0:
            raise ValueError(f"powersgd: orthogonalization_epsilon must be >= 0, got {orthogonalization_epsilon}")
        self.rank = int(rank)
        self.min_compression_rate = float(min_compression_rate)
        self.warm_start = bool(warm_start)
        self.epsilon = float(orthogonalization_epsilon)
        self.seed = int(seed)
        self._rng = np.random.RandomState(self.seed)
        self.p_memory: dict[str, torch.Tensor] = {}  # per segment key: last P (n x r), for inspection
        self.q_memory: dict[str, torch.Tensor] = {}  # per segment key: last averaged Q (m x r), the warm start
        self.seen: set[str] = set()  # segment keys already exchanged (a bucket of new ones draws a seed)
        self._layouts: dict[str, tuple[tuple, _Layout]] = {}
        self._buffers: dict[str, list[torch.Tensor]] = {}  # per bucket: corrected-gradient buffers

    # ---- helpers -------------------------------------------------------------------
    def layout(self, key: int | str, numel: int, shapes: list | None, keys: list[str] | None) -> _Layout:
        """The bucket's plan. Without keys, segments are named "<bucket key>/<i>" (state then
        follows the bucket index, as in torch's hook); without shapes, x is one 1-D segment."""
        if shapes is None:
            if keys is not None:
                raise ValueError("powersgd: segment keys need shapes")
            shapes = [(numel,)]
        if keys is None:
            keys = [str(key)] if len(shapes) == 1 else [f"{key}/{i}" for i in range(len(shapes))]
        sig = (numel, tuple(tuple(s) for s in shapes), tuple(keys))
        name = str(key)
        cached = self._layouts.get(name)
        if cached is None or cached[0] != sig:
            cached = (sig, _layout(numel, shapes, keys, self.rank, self.min_compression_rate))
            self._layouts[name] = cached
        return cached[1]

    def take_leftover(self, x: torch.Tensor, key: int | str, shapes: list[torch.Size] | None = None,
                      keys: list[str] | None = None) -> torch.Tensor | None:
        """Each segment's stored error, laid out as the bucket and removed (see Strategy)."""
        if self.feedback is None:
            return None
        lay = self.layout(key, x.numel(), shapes, keys)
        out, offset, found = torch.zeros_like(x), 0, False
        for k, size in zip(lay.keys, lay.sizes):
            e = self.feedback.residuals.pop(k, None)
            if e is not None and e.numel() == size:
                out[offset:offset + size].copy_(e.reshape(-1))
                found = True
            offset += size
        return out if found else None

    def _corrected(self, x: torch.Tensor, key: int | str, lay: _Layout) -> torch.Tensor:
        """x plus each segment's stored error (another tensor; x is not modified)."""
        if self.feedback is None:
            return x
        out = self._spare(x, str(key), lay).copy_(x)
        offset = 0
        for k, size in zip(lay.keys, lay.sizes):
            e = self.feedback.residual(k)
            if e is not None:
                if e.numel() != size or e.dtype != x.dtype or e.device != x.device:
                    raise ValueError(f"powersgd: error feedback for {k!r} holds {e.numel()} x {e.dtype} on {e.device},"
                                     f" but the segment is {size} x {x.dtype} on {x.device}")
                out[offset:offset + size].add_(e)
            offset += size
        return out

    def _spare(self, x: torch.Tensor, key: str, lay: _Layout) -> torch.Tensor:
        """A bucket-sized buffer no stored error lives in. The errors are views of the last
        corrected bucket (normally), so two buffers per bucket take turns; a fresh one only
        when a non-finite step left errors in both."""
        live = {e.untyped_storage().data_ptr() for e in map(self.feedback.residual, lay.keys)  # type: ignore[union-attr]
                if e is not None}
        pair = self._buffers.setdefault(key, [])
        for buf in pair:
            if buf.shape == x.shape and buf.dtype == x.dtype and buf.device == x.device \
                    and buf.untyped_storage().data_ptr() not in live:
                return buf
        buf = torch.empty_like(x)
        pair[:] = (pair + [buf])[-2:]
        return buf

    def _start_q(self, lay: _Layout, like: torch.Tensor) -> tuple[torch.Tensor, list[torch.Tensor | None]]:
        """This step's orthonormal Qs (one flat buffer) and, per matrix, the memory it came from."""
        q = torch.empty(lay.q_numel, dtype=like.dtype, device=like.device)
        views = _views(q, [(t.m, t.r) for t in lay.mats])
        olds: list[torch.Tensor | None] = []
        for t, v in zip(lay.mats, views):
            old = self.q_memory.get(t.key) if self.warm_start else None
            if old is not None and (old.shape != (t.m, t.r) or old.dtype != like.dtype or old.device != like.device):
                old = None
            olds.append(old)
        draw = not self.warm_start or any(k not in self.seen for k in lay.keys) or any(o is None for o in olds)
        if draw:
            # One seed per bucket that holds new segments, drawn in bucket order on every rank.
            seed = int(self._rng.randint(1_000_000_000))
            with torch.random.fork_rng(devices=[]):
                torch.manual_seed(seed)
                for v, old in zip(views, olds):
                    if old is None:
                        v.copy_(torch.randn(*v.shape, device="cpu", dtype=like.dtype))
        for v, old in zip(views, olds):
            if old is not None:
                v.copy_(old.view(v.shape))
            orthogonalize(v, self.epsilon)
        return q, olds

    # ---- the exchange ----------------------------------------------------------------
    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        if x.dim() != 1:
            raise ValueError(f"powersgd exchanges flat buckets, got shape {tuple(x.shape)}")
        world = self.backend.world_size
        lay = self.layout(key, x.numel(), shapes, keys)
        corrected = self._corrected(x, key, lay)

        q, q_olds = self._start_q(lay, x)
        mats = [corrected[t.offset:t.offset + t.n * t.m].view(1, t.n, t.m) for t in lay.mats]
        p = torch.empty(lay.p_numel, dtype=x.dtype, device=x.device)
        for mat, qv, pv in zip(mats, _views(q, [(t.m, t.r) for t in lay.mats]),
                               _views(p, [(t.n, t.r) for t in lay.mats])):
            torch.bmm(mat, qv, out=pv)
        dense = torch.cat([corrected[o:o + c] for o, c in lay.dense]) if lay.dense else x.new_empty(0)

        sent = (lay.dense_numel + lay.p_numel + lay.q_numel) * x.element_size()
        self._count(key, x, sent, sent * (world - 1))

        dense_work = self.backend.allreduce(dense) if lay.dense_numel else Work.done(dense)
        t1 = time.perf_counter()
        self.stats.encode_s += t1 - t0
        if not lay.mats:
            return dense_work.then(lambda d: self._finish(x, corrected, lay, average, d, None, None, q, q_olds, t1))

        p = self.backend.allreduce(p).wait()  # issued and awaited here: the same collective order on every rank
        t2 = time.perf_counter()
        self.stats.exchange_s += t2 - t1
        pvs = _views(p, [(t.n, t.r) for t in lay.mats])
        for pv in pvs:
            orthogonalize(pv, self.epsilon)
        q_new = torch.empty_like(q)
        for mat, pv, qv in zip(mats, pvs, _views(q_new, [(t.m, t.r) for t in lay.mats])):
            torch.bmm(mat.transpose(1, 2), pv, out=qv)
        q_work = self.backend.allreduce(q_new)
        t3 = time.perf_counter()
        self.stats.encode_s += t3 - t2
        return q_work.then(lambda qs: self._finish(x, corrected, lay, average, dense_work.wait(), p, qs,
                                                   q, q_olds, t3))

    def _finish(self, x: torch.Tensor, corrected: torch.Tensor, lay: _Layout, average: bool,
                dense: torch.Tensor, p: torch.Tensor | None, q_sum: torch.Tensor | None, q_start: torch.Tensor,
                q_olds: list[torch.Tensor | None], launched: float) -> torch.Tensor:
        t0 = time.perf_counter()
        self.stats.exchange_s += t0 - launched
        world = self.backend.world_size
        out = x if self.into_input else torch.empty_like(x)  # x is not read again
        if lay.dense_numel:
            if average:
                dense.div_(world)
            at = 0
            for o, c in lay.dense:
                out[o:o + c].copy_(dense[at:at + c])
                at += c
        if p is not None and q_sum is not None:
            q_avg = q_sum.div_(world) if average else q_sum / world
            q_use = q_avg if average else q_sum
            pvs = _views(p, [(t.n, t.r) for t in lay.mats])
            for t, pv, qv in zip(lay.mats, pvs, _views(q_use, [(t.m, t.r) for t in lay.mats])):
                torch.bmm(pv, qv.transpose(1, 2), out=out[t.offset:t.offset + t.n * t.m].view(1, t.n, t.m))
            if self.warm_start:
                qs = _views(q_avg, [(t.m, t.r) for t in lay.mats])
                starts = _views(q_start, [(t.m, t.r) for t in lay.mats])
                for t, pv, qv, start, old in zip(lay.mats, pvs, qs, starts, q_olds):
                    # A non-finite step must not poison every later warm start, and an all-zero
                    # gradient must not leave Q = 0 (then P = M Q = 0 for good): keep what was there.
                    keep = old if old is not None else start[0]
                    usable = torch.isfinite(qv).all() & qv.ne(0).any()
                    self.q_memory[t.key] = torch.where(usable, qv[0], keep)
                    self.p_memory[t.key] = pv[0]
        self.seen.update(lay.keys)
        if self.feedback is not None:
            avg = out if average else out / world
            offset = 0
            for k, size in zip(lay.keys, lay.sizes):
                self._remember(k, corrected[offset:offset + size], avg[offset:offset + size])
                offset += size
        self.stats.decode_s += time.perf_counter() - t0
        return out

    # ---- its cost, for `auto` ----------------------------------------------------------
    def wire_seconds(self, links: Links, work: Workload, world: int) -> float | None:
        """Three allreduces, of the dense part, of P and of Q, sized from the matrices' shapes;
        None without shapes that cover the tensors. Its compute is not modelled (auto's timed
        trial measures it)."""
        if work.shapes is None or sum(math.prod(s) for s in work.shapes) != work.numel:
            return None
        item = work.dtype.itemsize
        parts = [n * item for n in sent_numels(work.shapes, self.rank, self.min_compression_rate) if n]
        return sum(links.flat.allreduce(n // work.share, world) for n in parts)

    # ---- checkpointing ---------------------------------------------------------------
    def _config(self) -> dict[str, Any]:
        return {"rank": self.rank, "min_compression_rate": self.min_compression_rate, "warm_start": self.warm_start,
                "orthogonalization_epsilon": self.epsilon, "seed": self.seed}

    def state_dict(self) -> dict[str, Any]:
        kind, keys, pos, has_gauss, gauss = self._rng.get_state()
        state = super().state_dict()
        state["powersgd"] = {
            "config": self._config(),
            "rng": {"kind": str(kind), "keys": torch.from_numpy(np.asarray(keys, dtype=np.int64)), "pos": int(pos),
                    "has_gauss": int(has_gauss), "gauss": float(gauss)},
            "seen": sorted(self.seen),
            "p": {k: v.detach().clone() for k, v in self.p_memory.items()},
            "q": {k: v.detach().clone() for k, v in self.q_memory.items()},
        }
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        mine = state.get("powersgd")
        if mine is None:
            raise ValueError("not a powersgd state (no 'powersgd' entry)")
        if mine["config"] != self._config():
            raise ValueError(f"powersgd state was saved with {mine['config']}, this strategy has {self._config()}")
        super().load_state_dict(state)
        rng = mine["rng"]
        self._rng.set_state((rng["kind"], rng["keys"].numpy().astype(np.uint32), int(rng["pos"]),
                             int(rng["has_gauss"]), float(rng["gauss"])))
        self.seen = {str(k) for k in mine["seen"]}
        self.p_memory = {str(k): v.clone() for k, v in mine["p"].items()}
        self.q_memory = {str(k): v.clone() for k, v in mine["q"].items()}
