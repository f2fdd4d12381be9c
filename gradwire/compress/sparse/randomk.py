"""`randomk` (codec id 7): k random elements, one per stratum, scaled to be unbiased.

Every rank draws the same positions (the draw is keyed by seed, step and tensor, not by
rank), so payloads are summable and no indices travel: the packet's META holds the key,
and the receiver draws the positions again. Packet: META (the int64 stream key), VALUES
(the k unscaled elements, input dtype), SENTINEL (one float32: 0, or NaN when the input
held NaN/Inf).

Kernels: gradwire/cuda/kernels/select.cu (`ops.randomk`), scatter.cu
(`ops.scatter_randomk`), elementwise.cu (`ops.sentinel`). Random draws:
gradwire/compress/rng.py (`randbelow`, `bits24`). Tests: tests/compress/test_sparse.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np
import torch

from ...errors import WireFormatError
from .. import alloc, rng, select, wire
from ..base import Ctx, Piece
from ..registry import register
from ..wire import Kind, Packet, Section
from .base import _K, _RATIO, _FixedK


@register
class RandomK(_FixedK):
    """k random elements, one per stratum, scaled by the stratum length (unbiased).

    The tensor is cut into k strata ``[floor(i*n/k), floor((i+1)*n/k))``; stratum i sends
    one uniformly chosen element, decoded as ``value * len_i``, so E[decode] = x. The
    choice is a function of the 64-bit stream key of (seed, step, key) -- not of the rank,
    so every rank picks the same elements and payloads are summable. No indices travel:
    the packet's META holds that key and the receiver draws the positions again (a forged
    key can only move each value within its own stratum). VALUES hold the unscaled
    elements; the SENTINEL is 0, or NaN when the input held NaN/Inf, and is added (times 0)
    to the whole decoded tensor so an overflow is never hidden by sampling.
    """

    name = "randomk"
    codec_id = 7
    params = (_RATIO, _K)  # no `indices`: there are none on the wire
    stochastic = True
    summable = True
    feedback_helps = False  # scaled to be unbiased: residuals would grow, not shrink
    sends_input_values = False  # scaled by the stratum length on decode

    # ---- the draw ------------------------------------------------------------------
    @staticmethod
    def _strata(numel: int, k: int, device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(start, length) of each of the k strata, int64."""
        if k == 0:
            empty = torch.empty(0, dtype=torch.int64, device=device)
            return empty, empty
        q, r = divmod(numel, k)
        if torch.device(device).type == "cpu":  # NumPy divides by a scalar with libdivide: ~3x torch
            edges = np.arange(k + 1, dtype=np.int64)
            if r:
                extra = edges * r
                extra //= k
                edges *= q
                edges += extra
            else:
                edges *= q
            return torch.from_numpy(edges[:-1]), torch.from_numpy(np.diff(edges))
        i = torch.arange(k + 1, dtype=torch.int64, device=device)
        edges = i * q + (i * r) // k
        return edges[:-1], edges[1:] - edges[:-1]

    @staticmethod
    def _long(numel: int, k: int) -> bool:
        """Strata of 2**24 elements or more draw 48 bits (two 24-bit draws) instead of 24."""
        return k > 0 and -(-numel // k) >= 1 << 24

    def _key(self, ctx: Ctx) -> tuple[int, int]:
        return rng.stream_key(ctx.seed, ctx.step, 0, ctx.key, stream=self.codec_id)  # rank-free: summable

    def _draw(self, numel: int, k: int, key: tuple[int, int],
              device: torch.device | str) -> tuple[torch.Tensor, torch.Tensor]:
        """(the k drawn positions, ascending int64; the strata lengths): `rng.randbelow` of
        each length (floor(u24 * len / 2**24)), or floor(u48 * len / 2**48) from two 24-bit
        draws when strata reach 2**24 elements. The same integers as the CUDA kernels."""
        start, length = self._strata(numel, k, device)
        if k == 0:
            return start, length
        if not self._long(numel, k):
            off = rng.randbelow(key, length)
        else:
            hi = rng.bits24(key, k, device).to(torch.int64)
            lo = rng.bits24(key, k, device, start=k).to(torch.int64)
            off = hi.mul_(length).add_(lo.mul_(length).bitwise_right_shift_(24)).bitwise_right_shift_(24)
        return off.add_(start), length

    def _sample(self, numel: int, k: int, ctx: Ctx, device: torch.device | str) -> torch.Tensor:
        return self._draw(numel, k, self._key(ctx), device)[0]

    # ---- sizes and sections --------------------------------------------------------
    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        """META (the int64 stream key), VALUES[k], SENTINEL (one float32): always known."""
        return [8, self.value_count(numel) * dtype.itemsize, 4]

    def max_section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return self._section_sizes(numel, dtype)

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        numel = flat.numel()
        k = self.value_count(numel)
        key = self._key(ctx)
        ops = select.cuda_ops(flat)
        if ops is not None and k:
            idx, values = ops.randomk(flat, k, key, self._long(numel, k))
        else:
            idx = self._draw(numel, k, key, flat.device)[0]
            values = select.gather(flat, idx)
        sentinel = ops.sentinel(flat) if ops is not None else _sentinel(flat).reshape(1)
        return [Section(Kind.META, _key_section(key, flat.device)), Section(Kind.VALUES, values),
                Section(Kind.SENTINEL, sentinel)], idx

    def pieces(self, pk: Packet, idx: torch.Tensor, values: torch.Tensor) -> Iterator[Piece]:
        """Values scaled by their stratum length, as `_scatter` does; an overflow sentinel
        makes every element NaN (on the CPU a piece only then; on a GPU always, times 0)."""
        numel, k = pk.numel, idx.numel()
        if k:
            _, length = self._strata(numel, k, values.device)
            yield idx, (values.to(torch.float32) * length).to(pk.dtype)
        nonfinite = pk.sections[2].data[0]
        if nonfinite.is_cuda or not bool(torch.isfinite(nonfinite)):
            yield slice(0, numel), (nonfinite.float() * 0).to(pk.dtype).expand(numel)

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        kinds = pk.kinds()
        if kinds != [Kind.META, Kind.VALUES, Kind.SENTINEL]:
            raise WireFormatError(f"{self.name}: expected sections [META, VALUES, SENTINEL] (no indices: the "
                                  f"key in META draws them), packet has [{', '.join(k.name for k in kinds)}]")
        meta, values, sentinel = (s.data for s in pk.sections)
        if meta.dtype != torch.int64 or meta.numel() != 1:
            raise WireFormatError(f"{self.name}: META must be one int64 (the stream key), got "
                                  f"{meta.dtype} x{meta.numel()}")
        if values.dtype != pk.dtype:
            raise WireFormatError(f"{self.name}: VALUES dtype {values.dtype} is not the tensor dtype {pk.dtype}")
        k = self.value_count(pk.numel)
        if values.numel() != k:
            raise WireFormatError(f"{self.name}: VALUES count {values.numel()} does not match k={k} "
                                  f"for {pk.numel} elements ({self})")
        if sentinel.dtype != torch.float32 or sentinel.numel() != 1:
            raise WireFormatError(f"{self.name}: SENTINEL must be one float32, got "
                                  f"{sentinel.dtype} x{sentinel.numel()}")

    def _indices(self, pk: Packet) -> torch.Tensor:
        """The positions of a checked packet's values, drawn again from its key."""
        meta, values = pk.sections[0].data, pk.sections[1].data
        return self._draw(pk.numel, values.numel(), _key_of(int(meta[0])), values.device)[0]

    def _scatter(self, idx: torch.Tensor, values: torch.Tensor, numel: int, dtype: torch.dtype,
                 nonfinite: torch.Tensor) -> torch.Tensor:
        k = idx.numel()
        out = alloc.zeros(numel, dtype) if values.device.type == "cpu" else torch.zeros(numel, dtype=dtype, device=values.device)  # huge pages: 512x fewer faults
        if k:
            _, length = self._strata(numel, k, values.device)
            out.index_copy_(0, idx, (values.to(torch.float32) * length).to(dtype))
        # 0 * sentinel: NaN everywhere when any rank's input held NaN/Inf.
        if nonfinite.is_cuda or not bool(torch.isfinite(nonfinite).all()):
            out.add_((nonfinite.float() * 0).to(dtype))
        return out

    def _decode(self, pk: Packet) -> torch.Tensor:
        meta, values, sentinel = (s.data for s in pk.sections)
        ops = select.cuda_ops(values)
        if ops is not None:
            return ops.scatter_randomk(meta, values, pk.numel, sentinel, self._long(pk.numel, values.numel()))
        return self._scatter(self._indices(pk), values, pk.numel, pk.dtype, sentinel[0])

    # ---- summable --------------------------------------------------------------------
    def to_summable(self, x: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        """The k sampled (unscaled) elements; all NaN when x held NaN/Inf."""
        ctx = ctx if ctx is not None else Ctx()
        flat = x.detach().reshape(-1)
        k = self.value_count(flat.numel())
        vals = torch.index_select(flat, 0, self._sample(flat.numel(), k, ctx, flat.device))
        return vals.add_(_sentinel(flat).to(vals.dtype))

    def from_summable(self, payload: torch.Tensor, like: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        ctx = ctx if ctx is not None else Ctx()
        numel = like.numel()
        k = self.value_count(numel)
        if payload.dim() != 1 or payload.numel() != k:
            raise ValueError(f"{self.name}: summable payload has shape {tuple(payload.shape)}, expected ({k},)")
        idx = self._sample(numel, k, ctx, payload.device)
        return self._scatter(idx, payload, numel, like.dtype, _sentinel(payload)).reshape(like.shape)


def _key_section(key: tuple[int, int], device: torch.device) -> torch.Tensor:
    """randomk's META: the stream key (k0 + 2**32 * k1) as one int64, on `device`
    (a CUDA copy from pinned memory, asynchronous: an encode that never syncs)."""
    w = key[0] | key[1] << 32
    word = torch.tensor([w - (1 << 64) if w >= 1 << 63 else w], dtype=torch.int64)
    if device.type == "cpu":
        return word
    out = torch.empty(1, dtype=torch.int64, device=device)
    wire.copy_host_bytes(out.view(torch.uint8), word.numpy().tobytes())
    return out


def _key_of(word: int) -> tuple[int, int]:
    """The two 32-bit words of a META key (as `rng.stream_key` returns them)."""
    word &= (1 << 64) - 1
    return word & 0xFFFFFFFF, word >> 32


def _sentinel(flat: torch.Tensor) -> torch.Tensor:
    """A 0-d float32 tensor: 0 when flat is all finite, NaN otherwise (one read pass)."""
    if flat.numel() == 0:
        return torch.zeros((), dtype=torch.float32, device=flat.device)
    lo, hi = torch.aminmax(flat)
    return (lo.float() * 0).add_(hi.float() * 0)
