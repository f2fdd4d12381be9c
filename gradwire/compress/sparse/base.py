"""What every sparsifier shares: its params, the packet's sections, index packing, the
residual paths of error feedback and the validated decode.

Packet: an index section -- INDICES (raw ascending int32, int64 when numel >= 2**31) or
INDICES_PACKED (uint8, see `indexcodec`) -- then VALUES (the kept elements, input dtype).
Decode validates counts, order, range and the packed layout before it allocates the
output, then scatters the values into zeros. (`randomk` sends no indices: randomk.py.)

Kernels: gradwire/cuda/kernels/scatter.cu (`ops.scatter_sorted`), feedback.cu
(`ops.ef_sub_sent`). Compiled CPU loops: gradwire/compress/compiled.py (`sum_at_least`).
Tests: tests/compress/test_sparse.py, tests/compress/test_feedback.py.
"""

from __future__ import annotations

import math
from fractions import Fraction
from typing import Iterator

import numpy as np
import torch

from ...errors import WireFormatError
from .. import alloc, compiled, indexcodec, select, wire
from ..base import Compressor, Ctx, Param, Piece, check_input
from ..finite import parts_finite
from ..wire import Kind, Packet, Section

_NP_INT = {torch.int32: np.int32, torch.int16: np.int16, torch.int64: np.int64}
_PACK_MIN = 64

_RATIO = Param("ratio", float, 0.01, lambda v: 0.0 < v <= 1.0, "0 < ratio <= 1")
_K = Param("k", int, None, lambda v: v >= 1, "k >= 1; overrides ratio")
_INDICES = Param("indices", str, "auto", lambda v: v in ("auto", "raw", "packed"), "auto, raw or packed")


def _count_from(ratio: float, k: int | None, numel: int) -> int:
    if numel <= 0:
        return 0
    if k is not None:
        return min(numel, k)
    # ceil(ratio * numel) on the ratio's decimal spelling, so float noise
    # (0.07 * 100 == 7.000000000000001) never adds an element.
    return min(numel, max(1, math.ceil(Fraction(repr(ratio)) * numel)))


def _raise_if(err: torch.Tensor, message: str) -> None:
    """Raise WireFormatError when a device-side check flagged the packet: the one host read
    of a sparse decode on CUDA (the writes themselves were already bounds-checked)."""
    if int(err.item()):
        raise WireFormatError(message)


def _compiled_sum(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> bool:
    """Whether `compiled` ``sum_at_least`` can write out = x + residual."""
    return (out.device.type == "cpu" and out.is_contiguous() and x.is_contiguous() and out.numel() > 0
            and x.dtype == out.dtype == torch.float32 and compiled.enabled()
            and (residual is None or (residual.dtype == torch.float32 and residual.is_contiguous())))


class _Sparse(Compressor):
    role = "sparse"

    # ---- sizes --------------------------------------------------------------------
    def value_count(self, numel: int) -> int | None:
        """Elements kept for a tensor of `numel` elements, None when data-dependent."""
        return _count_from(self.ratio, self.k, numel)

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int] | None:
        k = self.value_count(numel)
        if k is None or self.indices != "raw":
            return None
        return [k * indexcodec.raw_dtype(numel).itemsize, k * dtype.itemsize]

    def max_section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        k = self.value_count(numel)
        k = numel if k is None else k
        index = k * indexcodec.raw_dtype(numel).itemsize
        if self.indices == "packed":  # "auto" packs only when that is smaller than raw
            index = max(index, indexcodec.max_size(k, numel))
        return [index, k * dtype.itemsize]

    # ---- encode -------------------------------------------------------------------
    def _index_section(self, idx: torch.Tensor, numel: int) -> Section:
        mode = self.indices
        raw_dt = indexcodec.raw_dtype(numel)
        # auto: pack when that is smaller; below 64 indices (<= 256 raw bytes) keep raw and
        # skip the packing work (a small tensor is latency-bound, not bandwidth-bound).
        if mode == "packed" or (mode == "auto" and idx.numel() >= _PACK_MIN):
            packed = indexcodec.encode(idx, numel)
            raw_bytes = idx.numel() * raw_dt.itemsize
            if mode == "packed" or wire.align(packed.numel()) < wire.align(raw_bytes):
                return Section(Kind.INDICES_PACKED, packed)
        if select.on_host(idx):
            return Section(Kind.INDICES, torch.from_numpy(idx.numpy().astype(_NP_INT[raw_dt])))
        return Section(Kind.INDICES, idx.to(raw_dt))

    def _sections(self, numel: int, idx: torch.Tensor, values: torch.Tensor) -> list[Section]:
        return [self._index_section(idx, numel), Section(Kind.VALUES, values)]

    def _encode(self, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        return self._selected(flat, ctx)[0]

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        """The packet's sections and the ascending int64 indices they carry."""
        raise NotImplementedError

    def encode_sent(self, x: torch.Tensor, ctx: Ctx | None = None) -> tuple[Packet, Iterator[Piece]]:
        """One piece: the sent indices (as selected, never unpacked) and their decoded values."""
        pk, idx = self.encode_selected(x, ctx)
        return pk, self.pieces(pk, idx, pk.section(Kind.VALUES))

    #: VALUES are the input's own elements (topk, dgc, threshold; not randomk, which scales them)
    sends_input_values = True

    def encode_residual(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """Where the values are the input's own, the residual there is v - v = +0 for every
        finite v: one scatter of zeros, no gather. Every NaN/Inf is among the sent values
        (largest magnitudes / at least the threshold), so they alone decide finiteness."""
        if self.sends_input_values and out.is_cuda:
            return self._encode_residual_cuda(x, residual, out, ctx)
        if not self.sends_input_values or out.is_cuda:
            return super().encode_residual(x, residual, out, ctx)
        packet, idx = self._sum_and_select(x, residual, out, ctx)
        values = packet.section(Kind.VALUES)
        self._zero_sent(out.view(-1), idx)
        return packet, parts_finite([values.sum()], [values])

    def _sum_and_select(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None) -> tuple[Packet, torch.Tensor]:
        """out = x + residual (x when None), then `encode_selected(out)`. Where the compiled
        loops run and the selection's first scan is for a key known before out is written
        (`_scan_key`), the sum's pass writes the candidates down and that scan is skipped."""
        found = self._scan_key(x, residual) if _compiled_sum(x, residual, out) else None
        if found is None:
            if residual is None:
                out.copy_(x)
            else:
                torch.add(x, residual, out=out)
            return self.encode_selected(out, ctx)
        skeys, key = found
        n, flat = compiled.np_view, out.view(-1)
        buf = select.candidate_buffer(flat.numel(), self.value_count(flat.numel()) or 0)
        e = None if residual is None else n(residual.view(-1))
        count = compiled.loops().sum_at_least(n(x.detach().view(-1)), e, n(flat), key, buf)
        return self.encode_found(out, ctx, skeys, key, select.found_indices(buf, count, flat, key))

    def _scan_key(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[object, int] | None:
        """(the sample keys of x + residual or None, the key of the selection's first scan of
        it) when that key can be known before the sum is written; else None."""
        return None

    def encode_found(self, x: torch.Tensor, ctx: Ctx | None, skeys, key: int,
                     idx: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """`encode_selected(x, ctx)`, given what `_scan_key` gave and the candidates of key."""
        raise NotImplementedError

    def _zero_sent(self, flat: torch.Tensor, idx: torch.Tensor) -> None:
        """The residual at the sent positions: +0."""
        flat.index_fill_(0, idx, 0.0)

    def _encode_residual_cuda(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                              ctx: Ctx | None) -> tuple[Packet, torch.Tensor]:
        """out = x + residual (one pass into the spare buffer: the old state must survive a
        non-finite step), select from it, then one kernel at the k sent positions only:
        out[idx] -= values (+0 for finite values) and the finiteness flag."""
        ops = select.cuda_ops(out)
        if residual is None:
            out.copy_(x)
        else:
            torch.add(x, residual, out=out)
        packet, idx = self.encode_selected(out, ctx)
        return packet, ops.ok(ops.ef_sub_sent(out.view(-1), idx, packet.section(Kind.VALUES)))

    def encode_selected(self, x: torch.Tensor, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """encode(x) and the ascending int64 indices it selected."""
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        if not flat.is_contiguous():
            flat = flat.contiguous()
        sections, idx = self._selected(flat, ctx if ctx is not None else Ctx())
        return self._packet(x, sections), idx

    def _packet(self, x: torch.Tensor, sections: list[Section]) -> Packet:
        return Packet(self.codec_id, x.dtype, tuple(x.shape), sections, self.crc).freeze()

    def pieces(self, pk: Packet, idx: torch.Tensor, values: torch.Tensor) -> Iterator[Piece]:
        """What a packet with these indices and (decoded) VALUES decodes to, as pieces."""
        yield idx, values

    # ---- decode -------------------------------------------------------------------
    def _check(self, pk: Packet) -> None:
        kinds = pk.kinds()
        if len(kinds) != 2:
            raise WireFormatError(f"{self.name}: expected 2 sections, packet has "
                                  f"[{', '.join(k.name for k in kinds)}]")
        isec, vsec = pk.sections[0], pk.sections[1]
        allowed = {"raw": (Kind.INDICES,), "packed": (Kind.INDICES_PACKED,)}.get(
            self.indices, (Kind.INDICES, Kind.INDICES_PACKED))
        if isec.kind not in allowed:
            raise WireFormatError(f"{self.name}: first section is {isec.kind.name}, expected "
                                  f"{' or '.join(k.name for k in allowed)} (indices={self.indices})")
        if vsec.kind != Kind.VALUES:
            raise WireFormatError(f"{self.name}: second section is {vsec.kind.name}, expected VALUES")
        values = vsec.data
        if values.dtype != pk.dtype:
            raise WireFormatError(f"{self.name}: VALUES dtype {values.dtype} is not the tensor dtype {pk.dtype}")
        count = values.numel()
        numel = pk.numel
        k = self.value_count(numel)
        if k is not None and count != k:
            raise WireFormatError(f"{self.name}: VALUES count {count} does not match k={k} "
                                  f"for {numel} elements ({self})")
        if count > numel:
            raise WireFormatError(f"{self.name}: VALUES count {count} exceeds numel {numel}")
        if isec.kind == Kind.INDICES:
            idx = isec.data
            want_dt = indexcodec.raw_dtype(numel)
            if idx.dtype != want_dt:
                raise WireFormatError(f"{self.name}: INDICES dtype {idx.dtype}, expected {want_dt} for numel {numel}")
            if idx.numel() != count:
                raise WireFormatError(f"{self.name}: INDICES count {idx.numel()} != VALUES count {count}")
            if not idx.is_cuda:  # CUDA: checked by the decode scatter on the device (docs/cuda.md)
                self._check_indices(idx, numel)
        else:
            indexcodec.check(isec.data, count)

    def _check_indices(self, idx: torch.Tensor, numel: int) -> None:
        """Ascending, unique and in range (raises WireFormatError)."""
        if idx.numel() == 0:
            return
        first, last = int(idx[0]), int(idx[-1])
        if first < 0:
            raise WireFormatError(f"{self.name}: INDICES has a negative index {first}")
        if last >= numel:
            raise WireFormatError(f"{self.name}: INDICES index {last} is out of range for {numel} elements")
        if idx.numel() > 1 and not bool((idx[1:] > idx[:-1]).all()):
            raise WireFormatError(f"{self.name}: INDICES are not strictly ascending")

    def _indices(self, pk: Packet) -> torch.Tensor:
        isec = pk.sections[0]
        count = pk.sections[1].data.numel()
        if isec.kind == Kind.INDICES:
            return isec.data.to(torch.int64)
        idx = indexcodec.decode(isec.data, count, pk.numel)
        self._check_indices(idx, pk.numel)
        return idx

    def _received(self, pk: Packet) -> Iterator[Piece]:
        """The validated indices and their values (CUDA: the checked scatter, densely)."""
        values = pk.sections[1].data
        if values.is_cuda:
            return super()._received(pk)
        return self.pieces(pk, self._indices(pk), values)

    def _raw_or_decoded(self, pk: Packet) -> torch.Tensor:
        """CUDA: raw indices as they are (the scatter kernel checks them), packed ones decoded."""
        isec = pk.sections[0]
        return isec.data if isec.kind == Kind.INDICES else self._indices(pk)

    def _decode(self, pk: Packet) -> torch.Tensor:
        values = pk.sections[1].data
        ops = select.cuda_ops(values)
        if ops is not None:
            out, err = ops.scatter_sorted(self._raw_or_decoded(pk), values, pk.numel)
            _raise_if(err, f"{self.name}: INDICES are out of range for {pk.numel} elements or not strictly ascending")
            return out
        idx = self._indices(pk)  # validated before the output exists
        out = alloc.zeros(pk.numel, pk.dtype) if values.device.type == "cpu" else \
            torch.zeros(pk.numel, dtype=pk.dtype, device=values.device)
        return out.index_copy_(0, idx, values)

    def decode(self, packet: Packet | torch.Tensor, out: torch.Tensor | None = None, *,
               shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
               max_numel: int | None = None) -> torch.Tensor:
        """On the CPU, where the values are the input's own (a plain scatter), straight into
        `out` when it can take the result as it is: zeroed, then the values scattered."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        into = alloc.direct(out, pk.numel, pk.dtype) if self.sends_input_values else None
        if into is None or pk.device.type != "cpu":
            return super().decode(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        self.check_header(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        idx = self._indices(pk)  # validated before out is touched
        into.zero_().index_copy_(0, idx, pk.sections[1].data)
        return out


class _FixedK(_Sparse):
    """A sparsifier of k elements that samples its input for a first threshold, then scans
    it for the candidates at or above it. A caller that writes the input itself (DGC
    momentum's pass) can find those candidates while writing, with no scan of its own:
    `scan_plan`, the sample's keys (`select.sample_view`, `select.sample_keys_of`) from the
    values about to be written, `first_key`, the candidates written down in the same pass
    (as `compiled` ``at_least`` does), then `encode_found`. The result is `encode_selected`'s."""

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        idx, values = self._select(flat, self.value_count(flat.numel()), ctx)
        return self._sections(flat.numel(), idx, values), idx

    def _select(self, flat: torch.Tensor, k: int, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        """(ascending int64 indices, their values as a new tensor)."""
        raise NotImplementedError

    def scan_plan(self, x: torch.Tensor) -> int | None:
        """The sample stride when encoding x samples and then scans it in compiled code
        (topk, dgc; float32 on the CPU, `compiled.enabled()`, k < numel, not small), else None."""
        n = x.numel()
        k = self.value_count(n)
        if x.device.type != "cpu" or x.dtype != torch.float32 or not 0 < k < n or n <= select.SMALL \
                or not compiled.enabled():
            return None
        return self._stride(n)

    def _stride(self, n: int) -> int | None:
        """The sample stride of a selection that samples and scans (randomk does not)."""
        return None

    def _scan_key(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[object, int] | None:
        stride = self.scan_plan(x)
        if stride is None:
            return None
        n = compiled.np_view
        sample = select.sample_view(n(x.detach().view(-1)), stride)
        if residual is not None:  # float32 sums, as the pass (and torch.add) makes them
            sample = sample + select.sample_view(n(residual.view(-1)), stride)
        skeys = select.sample_keys_of(np.ascontiguousarray(sample).view(np.int32), torch.float32)
        return skeys, self.first_key(skeys, x.numel())

    def first_key(self, skeys, n: int) -> int:
        """The first threshold key, from the keys of the sample of an n-element input."""
        raise NotImplementedError

    def encode_found(self, x: torch.Tensor, ctx: Ctx | None, skeys, key: int,
                     idx: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """`encode_selected(x, ctx)`, given x's sample keys, the first key and its candidates."""
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        n = flat.numel()
        idx, values = self._select_from(flat, self.value_count(n), skeys, key, idx)
        return self._packet(x, self._sections(n, idx, values)), idx

    def _select_from(self, flat: torch.Tensor, k: int, skeys, key: int,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        raise NotImplementedError
