"""Error feedback and DGC momentum correction, wrapping any compressor.

Error feedback: ``x' = x + e;  p = C(x');  e = x' - D(p)``, so what a compressor drops
is sent later instead of lost. DGC (Lin et al., 2018) accumulates momentum locally,
``u = m*u + g;  v = v + u``, sends C(v), and clears u and v where values were sent.

State is keyed by bucket index or parameter name. A step whose input is not finite
(an AMP overflow that GradScaler will skip) leaves the state untouched, so one bad
step cannot poison every later one.
"""

from __future__ import annotations

from typing import Any

import torch

from .base import Compressor, Ctx
from .registry import compressor as make_compressor
from .wire import Packet



def _all_finite(t: torch.Tensor) -> torch.Tensor:
    """A 0-d bool tensor on t's device (no host sync)."""
    return torch.isfinite(t).all()


class ErrorFeedback:
    """Residual memory around a compressor; `encode` returns the packet to send."""

    def __init__(self, compressor: Compressor | str) -> None:
        self.compressor = make_compressor(compressor)
        self.residuals: dict[str, torch.Tensor] = {}

    def encode(self, x: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> Packet:
        return self.encode_decode(x, key, ctx)[0]

    def encode_decode(self, x: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """Compress x plus the stored residual; return the packet and what it decodes to."""
        corrected = self.correct(x, key)
        packet = self.compressor.encode(corrected, ctx)
        sent = self.compressor.decode(packet, shape=corrected.shape)
        self.update(key, corrected, sent)
        return packet, sent

    def correct(self, x: torch.Tensor, key: int | str) -> torch.Tensor:
        """x plus the residual stored under key (a new tensor; x is not modified)."""
        e = self.residuals.get(str(key))
        if e is None:
            return x.clone()
        if e.shape != x.shape or e.dtype != x.dtype or e.device != x.device:
            raise ValueError(f"error feedback key {str(key)!r}: tensor is {tuple(x.shape)} {x.dtype} on {x.device}, "
                             f"but its residual is {tuple(e.shape)} {e.dtype} on {e.device}")
        return x + e

    def update(self, key: int | str, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep corrected - sent as the new residual, unless it is not finite (then keep the old).
        Consumes `corrected` (it becomes the residual)."""
        name = str(key)
        residual = corrected.sub_(sent)
        old = self.residuals.get(name)
        self.residuals[name] = torch.where(_all_finite(residual), residual,
                                           old if old is not None else torch.zeros_like(residual))

    def residual(self, key: int | str) -> torch.Tensor | None:
        return self.residuals.get(str(key))

    def reset(self) -> None:
        self.residuals.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"compressor": str(self.compressor),
                "residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_spec(self.compressor, state)
        self.residuals = {str(k): v.clone() for k, v in state["residuals"].items()}


class DGCMomentum:
    """DGC momentum correction with momentum-factor masking around a (sparse) compressor.

    Feed raw gradients and set the optimizer's momentum to 0: the momentum lives here.
    """

    def __init__(self, compressor: Compressor | str, momentum: float = 0.9, nesterov: bool = False) -> None:
        if not 0.0 <= momentum < 1.0:
            raise ValueError(f"momentum must be in [0, 1), got {momentum}")
        self.compressor = make_compressor(compressor)
        self.momentum = float(momentum)
        self.nesterov = bool(nesterov)
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def encode(self, grad: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> Packet:
        return self.encode_decode(grad, key, ctx)[0]

    def encode_decode(self, grad: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        name = str(key)
        u_old = self.u.get(name)
        v_old = self.v.get(name)
        if u_old is None or v_old is None:
            u_old = torch.zeros_like(grad)
            v_old = torch.zeros_like(grad)
        elif u_old.shape != grad.shape or u_old.dtype != grad.dtype or u_old.device != grad.device:
            raise ValueError(f"DGC key {name!r}: tensor is {tuple(grad.shape)} {grad.dtype}, "
                             f"but its momentum is {tuple(u_old.shape)} {u_old.dtype}")
        u = u_old * self.momentum + grad
        v = v_old + (u * self.momentum + grad if self.nesterov else u)
        packet = self.compressor.encode(v, ctx)
        sent = self.compressor.decode(packet, shape=v.shape)
        keep = sent == 0  # momentum-factor masking: clear u where a value went out
        v.sub_(sent)
        u.mul_(keep)
        ok = _all_finite(v)
        self.u[name] = torch.where(ok, u, u_old)
        self.v[name] = torch.where(ok, v, v_old)
        return packet, sent

    def reset(self) -> None:
        self.u.clear()
        self.v.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"compressor": str(self.compressor), "momentum": self.momentum, "nesterov": self.nesterov,
                "u": {k: t.detach().clone() for k, t in self.u.items()},
                "v": {k: t.detach().clone() for k, t in self.v.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_spec(self.compressor, state)
        self.momentum = float(state["momentum"])
        self.nesterov = bool(state["nesterov"])
        self.u = {str(k): t.clone() for k, t in state["u"].items()}
        self.v = {str(k): t.clone() for k, t in state["v"].items()}


def _check_spec(c: Compressor, state: dict[str, Any]) -> None:
    if state.get("compressor") != str(c):
        raise ValueError(f"state was saved for compressor {state.get('compressor')!r}, this one is {str(c)!r}")


def resolve_error_feedback(setting: bool | str, compressor: Compressor | str) -> bool:
    """`error_feedback=` as users give it: True/False, "on"/"off", or "auto" (the default):
    on exactly where the compressor's `feedback_helps` says it pays off."""
    if isinstance(setting, bool):
        return setting
    if setting == "auto":
        return make_compressor(compressor).feedback_helps
    if setting in ("on", "off"):
        return setting == "on"
    raise ValueError(f"error_feedback must be True, False, 'on', 'off' or 'auto', got {setting!r}")
