"""`qsgd` (codec id 10): QSGD (Alistarh et al., 2017), unbiased stochastic quantization to
2**bits - 1 levels of the bucket's L2 norm.

Unbiased, so error feedback is not needed, and bits + 1 bits per element: the levels of
`bits` bits and a sign bit. Per bucket: ``norm = ||bucket||_2``, ``s = 2**bits - 1``;
each element's level is |x| * s / norm rounded up or down at random (`stochastic`), so
E[decode] = x; decode ``(-1)**sign * level * (norm / s)``. The norm overflows fp32 once
sum(x**2) passes FLT_MAX (|x| around 1e19), and the bucket then decodes non-finite.

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.stochastic_encode`,
`ops.stochastic_decode`), feedback.cu (`ops.ef_stochastic`). Compiled CPU loops:
gradwire/compress/compiled.py (`residual_levels`). Stochastic rounding, CPU tile loop and
decode: gradwire/compress/quantize/stochastic.py. Tests: tests/compress/test_quantize.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import torch

from ..base import Param
from ..registry import register
from .stochastic import _Stochastic
from .tiles import _chunk_param


@register
class QSGD(_Stochastic):
    """QSGD: per-bucket L2 norm, sign bit, level in [0, 2**bits - 1] by unbiased stochastic rounding."""

    name = "qsgd"
    codec_id = 10
    params = (Param("bits", int, 8, lambda v: 1 <= v <= 8, "1 <= bits <= 8"),
              _chunk_param("bucket", 512))

    @property
    def levels(self) -> int:
        return (1 << self.bits) - 1

    @property
    def level_bits(self) -> int:
        return self.bits

    def _scale_rows(self, p: torch.Tensor, out: torch.Tensor) -> None:
        """The L2 norm of each bucket (in fp32 for fp16/bf16 input too)."""
        if p.dtype == torch.float32:
            torch.linalg.vector_norm(p, dim=1, out=out)
        else:
            out.copy_(torch.linalg.vector_norm(p, dim=1, dtype=torch.float32))
