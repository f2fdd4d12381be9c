"""Adam before compression ("error feedback after Adam"), for the DDP hook's `precondition="adam"`.

Each rank turns its own gradient into Adam's step direction ``m_hat / (sqrt(v_hat) + eps)``, with
moments of its local gradients, and the hook compresses and averages that direction; the optimizer
is then plain SGD (no momentum) at Adam's learning rate. Why: with error feedback on the gradient,
Adam sees a coordinate only when the sparsifier sends it, as one spike that carries many steps of
gradient; the second moment grows with the spike's square, so over T steps the coordinate moves
about sqrt(T) times less than under dense Adam (on the 0.47M-parameter charlm transformer, top-k
1% ended 21% worse in perplexity). Normalized first, every step's direction has Adam's scale, and
error feedback delays it without shrinking it. The moments never travel: they are per rank, and the
parameters stay identical because every rank applies the same averaged direction.
"""

from __future__ import annotations

from typing import Any

import torch


class AdamPreconditioner:
    """Per-parameter Adam moments (keyed by parameter name) that map a gradient to Adam's direction."""

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8) -> None:
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps > 0.0):
            raise ValueError(f"adam preconditioner needs 0 <= beta1, beta2 < 1 and eps > 0, got {beta1}, {beta2}, {eps}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}

    def __str__(self) -> str:
        return f"adam:beta1={self.beta1:g},beta2={self.beta2:g},eps={self.eps:g}"

    def apply_(self, g: torch.Tensor, key: str) -> None:
        """Replace g (in place) by Adam's bias-corrected direction after updating key's moments with g."""
        m = self.m.get(key)
        if m is None:
            m = self.m[key] = torch.zeros_like(g)
            self.v[key] = torch.zeros_like(g)
        v = self.v[key]
        t = self.steps[key] = self.steps.get(key, 0) + 1
        m.mul_(self.beta1).add_(g, alpha=1 - self.beta1)
        v.mul_(self.beta2).addcmul_(g, g, value=1 - self.beta2)
        denom = (v / (1 - self.beta2 ** t)).sqrt_().add_(self.eps)
        torch.div(m, denom, out=g).div_(1 - self.beta1 ** t)

    def state_dict(self) -> dict[str, Any]:
        return {"m": dict(self.m), "v": dict(self.v), "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.v, self.steps = dict(state["m"]), dict(state["v"]), dict(state["steps"])


def make_preconditioner(spec: str | None) -> AdamPreconditioner | None:
    """None or "" (off), "adam", or "adam:beta1=0.9,beta2=0.999,eps=1e-8"."""
    if not spec:
        return None
    name, _, args = spec.partition(":")
    if name != "adam":
        raise ValueError(f"precondition must be 'adam' (optionally adam:beta1=..,beta2=..,eps=..), got {spec!r}")
    options: dict[str, float] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in ("beta1", "beta2", "eps"):
            raise ValueError(f"adam preconditioner takes beta1, beta2, eps; got {item!r}")
        options[key] = float(value)
    return AdamPreconditioner(**options)
