"""`topk` (codec id 6): the k largest magnitudes, sent exactly.

With `chunk=C` the tensor is cut into runs of C elements and each keeps its own largest
(ceil(ratio * C), or `k` each): SparseLoCo's chunked top-k (arXiv 2508.15706), which spreads
what is sent over the whole tensor and selects with one sort per chunk on any device
(`select.chunked_topk`). The packet is the same as topk's; only the selection differs.

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
from ..base import Ctx, Param
from ..registry import register
from .base import _INDICES, _K, _RATIO, _count_from, _FixedK


@register
class TopK(_FixedK):
    """The k largest magnitudes, exactly (NaN/Inf count as largest; ties to the lowest index).

    k = min(numel, max(1, ceil(ratio * numel))), or the `k` parameter when given; with
    `chunk`, that count per chunk of `chunk` elements (the last chunk's from its own length).
    """

    name = "topk"
    codec_id = 6
    params = (_RATIO, _K, _INDICES,
              Param("chunk", int, 0, lambda v: v >= 0, "0 (one selection over the tensor) or the elements per chunk, "
                    "each keeping its own largest"))

    @property
    def selects_global_topk(self) -> bool:  # type: ignore[override]
        return not self.chunk

    def value_count(self, numel: int) -> int | None:
        if not self.chunk:
            return super().value_count(numel)
        full, rest = divmod(numel, self.chunk)
        return full * _count_from(self.ratio, self.k, self.chunk) + _count_from(self.ratio, self.k, rest)

    def _select(self, flat: torch.Tensor, k: int, ctx: Ctx) -> tuple[torch.Tensor, torch.Tensor]:
        if self.chunk:
            rest = flat.numel() % self.chunk
            return select.chunked_topk(flat, self.chunk, _count_from(self.ratio, self.k, self.chunk),
                                       _count_from(self.ratio, self.k, rest))
        return select.topk(flat, k)

    def scan_plan(self, x: torch.Tensor) -> int | None:
        return None if self.chunk else super().scan_plan(x)  # (chunks select by sorting: no sampled scan)

    def _stride(self, n: int) -> int:
        return select.TOPK_STRIDE

    def first_key(self, skeys, n: int) -> int:
        return select.kth_largest(skeys, select.topk_rank(skeys.shape[0], n, self.value_count(n)))

    def _select_from(self, flat: torch.Tensor, k: int, skeys, key: int,
                     idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return select.topk_from(flat, k, skeys, idx)
