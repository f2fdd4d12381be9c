"""`terngrad` (codec id 11): TernGrad (Wen et al., 2017), unbiased stochastic {-1, 0, +1}
times the bucket's (or the whole tensor's) max |x|.

Two bits per element (a sign and a nonzero bit) and one scale: qsgd's stochastic rounding
with a single level and max |x| as the scale. Per bucket (or per tensor, bucket = 0):
``scale = max |x|``, ``level = min(floor(|x| * min(1 / scale, FLT_MAX) + u), 1)``; decode
``(-1)**sign * level * scale``. Unbiased; max never overflows, so the scale stays finite
up to FLT_MAX.

Kernels: gradwire/cuda/kernels/elementwise.cu (`ops.stochastic_encode`,
`ops.stochastic_decode`), feedback.cu (`ops.ef_stochastic`). Compiled CPU loops:
gradwire/compress/compiled.py (`residual_levels`). Stochastic rounding, CPU tile loop and
decode: gradwire/compress/quantize/stochastic.py. Tests: tests/compress/test_quantize.py,
tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import torch

from ..registry import register
from ..wire import Kind
from .stochastic import _Stochastic
from .tiles import _absmax_rows, _chunk_param


@register
class TernGrad(_Stochastic):
    """TernGrad: scale = max |x| per bucket (bucket=0: per tensor), unbiased stochastic {-1, 0, 1}."""

    name = "terngrad"
    codec_id = 11
    params = (_chunk_param("bucket", 512, allow_zero=True),)
    levels = 1
    level_bits = 1
    level_kind = Kind.BITS
    by_norm = False

    def _scale_rows(self, p: torch.Tensor, out: torch.Tensor) -> None:
        """max |x| of each bucket (in fp32 for fp16/bf16 input too)."""
        if p.dtype == torch.float32:
            _absmax_rows(p, out)
        else:
            out.copy_(torch.maximum(torch.amax(p, 1), torch.amin(p, 1).neg_()))
