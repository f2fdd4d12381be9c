"""The original (pre-#12) error feedback and DGC momentum updates, kept as an oracle.

They allocate fresh full-size tensors at every step; the library's in-place versions
must produce the same packets and state bit for bit (tests/compress/test_feedback.py).
"""

from __future__ import annotations

import torch

from gradwire import Ctx
from gradwire.compress import Compressor, Packet


def _all_finite(t: torch.Tensor) -> torch.Tensor:
    return torch.isfinite(t).all()


class OracleErrorFeedback:
    def __init__(self, compressor: Compressor) -> None:
        self.compressor = compressor
        self.residuals: dict[str, torch.Tensor] = {}

    def encode_decode(self, x: torch.Tensor, key: str, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        e = self.residuals.get(key)
        corrected = x.clone() if e is None else x + e
        packet = self.compressor.encode(corrected, ctx)
        sent = self.compressor.decode(packet)
        residual = corrected.sub_(sent)
        old = self.residuals.get(key)
        self.residuals[key] = torch.where(_all_finite(residual), residual,
                                          old if old is not None else torch.zeros_like(residual))
        return packet, sent


class OracleDGCMomentum:
    def __init__(self, compressor: Compressor, momentum: float = 0.9, nesterov: bool = False) -> None:
        self.compressor = compressor
        self.momentum = momentum
        self.nesterov = nesterov
        self.u: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}

    def encode_decode(self, grad: torch.Tensor, key: str, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        u_old = self.u.get(key)
        v_old = self.v.get(key)
        if u_old is None or v_old is None:
            u_old = torch.zeros_like(grad)
            v_old = torch.zeros_like(grad)
        u = u_old * self.momentum + grad
        v = v_old + (u * self.momentum + grad if self.nesterov else u)
        packet = self.compressor.encode(v, ctx)
        sent = self.compressor.decode(packet)
        keep = sent == 0
        v.sub_(sent)
        u.mul_(keep)
        ok = _all_finite(v)
        self.u[key] = torch.where(ok, u, u_old)
        self.v[key] = torch.where(ok, v, v_old)
        return packet, sent
