"""Finiteness checks without a full-size temporary or a host sync.

`torch.isfinite(t).all()` builds a bool tensor as large as t (on the CPU that costs more
than the arithmetic it guards). A sum is NaN/Inf whenever an element is, so a finite sum
proves every element finite; only a non-finite sum (a skipped AMP step, or a sum that
overflows on huge finite values) is looked at again with min and max, which are exact.
"""

from __future__ import annotations

import torch


def all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on t's device: every element of t is finite. On a GPU it is min
    and max straight away (no host sync); on the CPU the sum first."""
    return parts_finite([t.sum()] if t.device.type == "cpu" else [], [t])


def parts_finite(sums: list[torch.Tensor], parts: list[torch.Tensor]) -> torch.Tensor:
    """Like `all_finite` over all of `parts`, given their sums (computed while each part
    was in cache; none on a GPU): exact min and max only when some sum is not finite."""
    device = parts[0].device if parts else torch.device("cpu")
    ok = torch.ones((), dtype=torch.bool, device=device)
    if device.type == "cpu" and sums and bool(torch.isfinite(torch.stack(sums)).all()):
        return ok
    for p in parts:
        if p.numel():
            lo, hi = torch.aminmax(p.reshape(-1))
            ok = ok & torch.isfinite(lo) & torch.isfinite(hi)
    return ok
