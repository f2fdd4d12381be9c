"""Dense casts: `none` (raw), `fp16`, `bf16`. Summable: allreduce the cast tensor."""

from __future__ import annotations

import torch

from .base import Compressor, Ctx, expect
from .registry import register
from .wire import Kind, Packet, Section


class _Cast(Compressor):
    wire_dtype: torch.dtype | None = None  # None: keep the input dtype
    summable = True
    feedback_helps = False

    def _dtype(self, dtype: torch.dtype) -> torch.dtype:
        return self.wire_dtype or dtype

    def _section_sizes(self, numel: int, dtype: torch.dtype) -> list[int]:
        return [numel * torch.empty((), dtype=self._dtype(dtype)).element_size()]

    def _encode(self, flat: torch.Tensor, ctx: Ctx) -> list[Section]:
        return [Section(Kind.DATA, _to(flat, self._dtype(flat.dtype)))]  # encode() copies it into the packet

    def _check(self, pk: Packet) -> None:
        expect(pk, (Kind.DATA, self._dtype(pk.dtype), pk.numel))

    def _decode(self, pk: Packet) -> torch.Tensor:
        return _to(pk.section(Kind.DATA), pk.dtype)

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
