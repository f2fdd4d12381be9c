"""`topk` (codec id 6): the k largest magnitudes, sent exactly.

The selection is the engine's own `select.topk` (a sampled threshold, a candidate scan,
the exact k among the candidates), which the `oktopk` strategy and DGC momentum's pass
use too; this module holds the codec: its params and the first threshold of the scan
that DGC momentum's pass can take over (`_FixedK`).

Kernels: gradwire/cuda/kernels/select.cu (`ops.topk`: radix select). Compiled CPU loops:
gradwire/compress/compiled.py (`at_least`, `sum_at_least`, `dgc_inplace_at_least`).
Selection: gradwire/compress/select.py (`topk`, `topk_rank`, `topk_from`). Tests:
tests/compress/test_sparse.py, tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import torch

from .. import select
from ..base import Ctx
from ..registry import register
from .base import _INDICES, _K, _RATIO, _FixedK


@register
class TopK(_FixedK):
    """The k largest magnitudes, exactly (NaN/Inf count as largest; ties to the lowest index).

    k = min(numel, max(1, ceil(ratio * numel))), or the `k` parameter when given.
    """

    name = "topk"
    codec_id = 6
    params = (_RATIO, _K, _INDICES)

    def _select(self, flat: torch.Tensor, k: int, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        return select.topk(flat, k)

    def _stride(self, n: int) -> int:
        return select.TOPK_STRIDE

    def first_key(self, skeys, n: int) -> int:
        return select.kth_largest(skeys, select.topk_rank(skeys.shape[0], n, self.value_count(n)))

    def _select_from(self, flat: torch.Tensor, k: int, skeys, key: int,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select.topk_from(flat, k, skeys, idx)
