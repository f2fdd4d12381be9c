"""Dense casts: `none` (raw), `fp16`, `bf16`. Summable: allreduce the cast tensor.

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.cast`), feedback.cu (`ops.ef_cast`: the
error-feedback step). Compiled CPU loops: gradwire/compress/compiled.py (`sum_into`). Tests:
tests/compress/test_casts.py, tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

from typing import Iterator

import torch

from . import alloc, compiled, wire
from .base import Compressor, Ctx, Piece, check_input, deliver, expect
from .finite import all_finite, parts_finite
from .registry import register
from .wire import Kind, Packet, Section


_TILE = 1 << 18  # elements widened per step when decoding one's own packet on the CPU


class _Cast(Compressor):
    wire_dtype: torch.dtype | None = None  # None: keep the input dtype
    summable = True
    elementwise = True  # each element is cast on its own: a bucket may be cast at once
    feedback_helps = False

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype or dtype

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return [numel * self._dtype(dtype).itemsize]

    def _encode(self, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        return [Section(Kind.DATA, _to(flat, self._dtype(flat.dtype)))]  # encode() copies it into the packet

    def encode(self, x: torch.Tensor, ctx: Ctx | None = None) -> Packet:
        """On the CPU the cast writes straight into the packet's buffer (no copy of the data)."""
        if not isinstance(x, torch.Tensor) or x.is_cuda:
            return super().encode(x, ctx)
        check_input(self.name, x)
        packet = wire.allocate(self.codec_id, x.dtype, tuple(x.shape), [(Kind.DATA, self._dtype(x.dtype), x.numel())],
                               self.crc)
        packet.sections[0].data.copy_(x.detach().reshape(-1))
        return packet

    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.DATA, self._dtype(pk.dtype), pk.numel))

    def _decode(self, pk: Packet) -> torch.Tensor:
        return _to(pk.section(Kind.DATA), pk.dtype)

    def decode(self, packet: Packet | torch.Tensor, out: torch.Tensor | None = None, *,
               shape: tuple[int, ...] | torch.Size | None = None, dtype: torch.dtype | None = None,
               max_numel: int | None = None) -> torch.Tensor:
        """On the CPU a widening cast writes straight into `out` when it can take the result
        as it is, else into a fresh tensor from `alloc` (one pass, no copy)."""
        pk = packet if isinstance(packet, Packet) else wire.parse(packet)
        if pk.device.type != "cpu" or not pk.numel:
            return super().decode(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        self.check_header(pk, out, shape=shape, dtype=dtype, max_numel=max_numel)
        data = pk.section(Kind.DATA)
        if data.dtype == pk.dtype:  # nothing to widen: the packet's own memory (or a copy into out)
            return deliver(data, pk, out)
        into = alloc.direct(out, pk.numel, pk.dtype)
        flat = into if into is not None else alloc.empty(pk.numel, pk.dtype)
        flat.copy_(data)
        return out if into is not None else deliver(flat, pk, out)

    def encode_residual(self, x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor,
                        ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """On the CPU, tile by tile while each is in cache: out = x + residual, cast it into
        the packet's data, widen that back and subtract it from out, sum out for the check.
        On a GPU all of that is one kernel (`ops.ef_cast`) writing the packet in place."""
        n, dtype = out.numel(), self._dtype(out.dtype)
        if out.is_cuda and out.is_contiguous() and n:
            return self._encode_residual_cuda(x, residual, out)
        if dtype == out.dtype and out.is_contiguous() and n:  # lossless: the residual is 0 (NaN is checked)
            if self._lossless_compiled(x, residual, out):
                return self._encode_lossless_compiled(x, residual, out)
            if residual is None:
                out.copy_(x)
            else:
                torch.add(x, residual, out=out)
            packet = self.encode(out, ctx)
            ok = all_finite(out)
            out.zero_()
            return packet, ok
        if out.is_cuda or not out.is_contiguous() or dtype == out.dtype or not n:
            return super().encode_residual(x, residual, out, ctx)
        check_input(self.name, out)
        flat, xs = out.detach().view(-1), x.detach().reshape(-1)
        es = None if residual is None else residual.reshape(-1)
        packet = wire.allocate(self.codec_id, out.dtype, tuple(out.shape), [(Kind.DATA, dtype, n)], self.crc)
        data = packet.sections[0].data
        step = min(n, _TILE)
        scratch = torch.empty(step, dtype=out.dtype)
        sums = []
        for s in range(0, n, step):
            e = min(n, s + step)
            o = flat[s:e]
            if es is None:
                o.copy_(xs[s:e])
            else:
                torch.add(xs[s:e], es[s:e], out=o)
            d = data[s:e]
            d.copy_(o)
            o.sub_(scratch[: e - s].copy_(d))
            sums.append(o.sum())
        return packet, parts_finite(sums, [flat])

    @staticmethod
    def _lossless_compiled(x: torch.Tensor, residual: torch.Tensor | None, out: torch.Tensor) -> bool:
        return (out.dtype == torch.float32 and x.device.type == "cpu" and x.is_contiguous()
                and (residual is None or residual.is_contiguous()) and compiled.enabled())

    def _encode_lossless_compiled(self, x: torch.Tensor, residual: torch.Tensor | None,
                                  out: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        """One compiled pass: x + residual straight into the packet, out zeroed (the new
        residual), finiteness from the sums' exponent bits: no corrected copy to read back."""
        n = out.numel()
        packet = wire.allocate(self.codec_id, out.dtype, tuple(out.shape), [(Kind.DATA, out.dtype, n)], self.crc)
        view = compiled.np_view
        e = view(residual.reshape(-1)) if residual is not None else None
        ok = compiled.loops().sum_into(view(x.reshape(-1)), e, view(packet.sections[0].data), view(out.view(-1)))
        return packet, torch.tensor(bool(ok))

    def _encode_residual_cuda(self, x: torch.Tensor, residual: torch.Tensor | None,
                              out: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        from ..cuda import ops

        check_input(self.name, out)
        n = out.numel()
        packet = wire.allocate(self.codec_id, out.dtype, tuple(out.shape), [(Kind.DATA, self._dtype(out.dtype), n)],
                               self.crc, device=out.device)
        bad = ops.ef_cast(x.detach().reshape(-1).contiguous(), None if residual is None else residual.view(-1),
                          out.view(-1), packet.sections[0].data)
        return packet, ops.ok(bad)

    def _sent(self, pk: Packet) -> Iterator[Piece]:
        """Widened tile by tile into one cache-sized scratch (no full-size decoded tensor)."""
        data, n = pk.section(Kind.DATA), pk.numel
        if data.dtype == pk.dtype or data.device.type != "cpu":
            yield slice(0, n), _to(data, pk.dtype)
            return
        step = min(n, _TILE)
        scratch = torch.empty(step, dtype=pk.dtype)
        for s in range(0, n, step):
            e = min(n, s + step)
            yield slice(s, e), scratch[: e - s].copy_(data[s:e])

    def to_summable(self, x: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        flat, dtype = x.reshape(-1), self._dtype(x.dtype)
        return _to(flat, dtype) if flat.is_cuda and flat.dtype != dtype else flat.to(dtype, copy=True)

    def from_summable(self, payload: torch.Tensor, like: torch.Tensor, ctx: Ctx | None = None) -> torch.Tensor:
        return _to(payload.reshape(-1), like.dtype).reshape(like.shape)


def _to(x: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """x.to(dtype); CUDA tensors use gradwire's cast kernel, whose rounding and NaN bits
    match the CPU's (torch's own CUDA fp16 cast writes a different NaN)."""
    if x.is_cuda and x.dtype != dtype and x.numel():
        from ..cuda import ops

        return ops.cast(x.contiguous(), dtype)
    return x.to(dtype)


@register
class NoCompression(_Cast):
    """The identity: raw elements in their own dtype (the dense baseline)."""

    name = "none"
    codec_id = 1


@register
class FP16(_Cast):
    """IEEE half precision; values beyond 65504 become inf, as torch's fp16 hook does."""

    name = "fp16"
    codec_id = 2
    wire_dtype = torch.float16


@register
class BF16(_Cast):
    """bfloat16: fp32's exponent range with 8 bits of mantissa."""

    name = "bf16"
    codec_id = 3
    wire_dtype = torch.bfloat16
