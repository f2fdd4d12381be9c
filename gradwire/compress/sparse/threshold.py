"""`threshold` (codec id 8): every element with |x| >= threshold, NaN included.

No sample and no sort: one candidate scan at a fixed key, so it is the cheapest selection,
but the count (and the packet size) follows the data.

Kernels: gradwire/cuda/kernels/select.cu (`ops.at_least`). Compiled CPU loops:
gradwire/compress/compiled.py (`at_least`, `sum_at_least`, `zero_at_least`). Candidates:
gradwire/compress/select.py (`candidates`, `ceil_key`). Tests: tests/compress/test_sparse.py,
tests/compress/test_feedback.py, tests/cuda/test_cuda_parity.py.
"""

from __future__ import annotations

import torch

from .. import compiled, select
from ..base import Ctx, Param, check_input
from ..registry import register
from ..wire import Packet, Section
from .base import _INDICES, _Sparse


@register
class Threshold(_Sparse):
    """Every element with |x| >= threshold (NaN too); the count varies with the data."""

    name = "threshold"
    codec_id = 8
    params = (Param("threshold", float, 1e-3, lambda v: v > 0.0, "threshold > 0"), _INDICES)

    def value_count(self, numel: int) -> int | None:
        return None

    def _selected(self, flat: torch.Tensor, ctx: Ctx) -> tuple[list[Section], torch.Tensor]:
        key = select.ceil_key(self.threshold, flat.dtype)
        ops = select.cuda_ops(flat)
        if ops is not None and flat.numel():
            idx, vals = ops.at_least(flat, key)  # one host sync: the count
            return self._sections(flat.numel(), idx, vals), idx
        idx = select.candidates(flat, key)
        return self._sections(flat.numel(), idx, select.gather(flat, idx)), idx

    def _scan_key(self, x: torch.Tensor, residual: torch.Tensor | None) -> tuple[object, int] | None:
        return None, select.ceil_key(self.threshold, torch.float32)

    def encode_found(self, x: torch.Tensor, ctx: Ctx | None, skeys, key: int,
                     idx: torch.Tensor) -> tuple[Packet, torch.Tensor]:
        check_input(self.name, x)
        flat = x.detach().reshape(-1)
        return self._packet(x, self._sections(flat.numel(), idx, select.gather(flat, idx))), idx

    def _zero_sent(self, flat: torch.Tensor, idx: torch.Tensor) -> None:
        """Under error feedback the count follows the residual and can pass half the tensor;
        above 1/16 of it, one compiled pass zeroing the elements that pass the threshold
        (the same test as `select.candidates`) costs less than a scatter to each."""
        if idx.numel() * 16 > flat.numel() and flat.dtype == torch.float32 and compiled.enabled():
            compiled.loops().zero_at_least(compiled.np_view(flat.view(torch.int32)),
                                           select.ceil_key(self.threshold, flat.dtype))
        else:
            flat.index_fill_(0, idx, 0.0)
