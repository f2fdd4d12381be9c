"""Error feedback and DGC momentum correction, wrapping any compressor.

Error feedback: ``x' = x + e;  p = C(x');  e = x' - D(p)``, so what a compressor drops
is sent later instead of lost. DGC (Lin et al., 2018) accumulates momentum locally,
``u = m*u + g;  v = v + u``, sends C(v), and clears u and v where values were sent.

State is keyed by bucket index or parameter name. A step whose input is not finite
(an AMP overflow that GradScaler will skip) leaves the state untouched, so one bad
step cannot poison every later one.

Speed: the state lives in persistent buffers, updated in place. Each step writes the new
state into a spare buffer of the same shape (the old one is still needed if the step
turns out non-finite) and the two swap, so after the first steps no full-size tensor is
allocated (on the CPU a fresh 100 MB tensor costs more page faults than the arithmetic).
What the packet decodes to is subtracted by the compressor (`encode_residual`, or the
pieces of `encode_sent` for DGC): only at the sent positions for sparsifiers, inside the
encode tiles for quantizers; finiteness is checked there too (`finite.py`). The results are
bit for bit those of the plain formulas above (tests/support/feedback_oracle.py keeps them). On
CUDA tensors the same steps are fused kernels (gradwire/cuda/kernels/feedback.cu). On the
CPU with one torch thread, compiled loops (`compiled`) do the quantizers' subtraction and
DGC's update in one pass each. DGC then updates u and v in place: a bound on |g|, |u| and
|v| proves beforehand that the step stays finite.
"""

from __future__ import annotations

from typing import Any, Iterator

import numpy as np
import torch

from . import compiled, select
from .base import Compressor, Ctx, Piece
from .finite import all_finite, parts_finite
from .registry import compressor as make_compressor
from .wire import Kind, Packet


class _Spares:
    """Spare state buffers by (shape, dtype, device): one step's new state is written into
    a spare and the old state becomes the next spare."""

    def __init__(self) -> None:
        self._free: dict[tuple, list[torch.Tensor]] = {}

    def take(self, like: torch.Tensor) -> torch.Tensor:
        free = self._free.get((like.shape, like.dtype, like.device))
        return free.pop() if free else torch.empty_like(like, memory_format=torch.contiguous_format)

    def give(self, t: torch.Tensor) -> None:
        self._free.setdefault((t.shape, t.dtype, t.device), []).append(t)

    def clear(self) -> None:
        self._free.clear()


def _keep(ok: torch.Tensor, new: torch.Tensor, old: torch.Tensor, spares: _Spares | None) -> torch.Tensor:
    """new where the step was finite, else old; the buffer not kept goes back to spares
    (if given). On the CPU the flag is already known (a pointer swap); on a GPU new is
    kept and, on the device, overwritten with old only when the flag says the step was
    not finite (`ops.keep`: no host sync, and no memory moved on a finite step)."""
    if ok.device.type == "cpu":
        keep, drop = (new, old) if bool(ok) else (old, new)
    elif new.is_contiguous() and old.is_contiguous():
        from ..cuda import ops

        ops.keep(ok, new, old)
        keep, drop = new, old
    else:
        keep, drop = torch.where(ok, new, old, out=old), new
    if spares is not None:
        spares.give(drop)
    return keep


#: Elements per step of DGC's momentum update on the CPU (u is reread from cache). 4 MiB
#: tiles measured faster than L2-sized ones, whose per-op Python overhead dominates.
_TILE = 1 << 20


def _check_like(what: str, name: str, x: torch.Tensor, state: torch.Tensor) -> None:
    if state.shape != x.shape or state.dtype != x.dtype or state.device != x.device:
        raise ValueError(f"{what} key {name!r}: tensor is {tuple(x.shape)} {x.dtype} on {x.device}, "
                         f"but its state is {tuple(state.shape)} {state.dtype} on {state.device}")


class ErrorFeedback:
    """Residual memory around a compressor; `encode` returns the packet to send.

    `residual(key)` is the live state: a later `encode` may reuse its memory."""

    def __init__(self, compressor: Compressor | str) -> None:
        self.compressor = make_compressor(compressor)
        self.residuals: dict[str, torch.Tensor] = {}
        self._spares = _Spares()

    def encode(self, x: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> Packet:
        """Compress x plus the stored residual and keep the new residual (in place)."""
        name = str(key)
        e = self.residuals.get(name)
        if e is not None:
            _check_like("error feedback", name, x, e)
        buf = self._spares.take(x)
        packet, ok = self.compressor.encode_residual(x, e, buf, ctx)
        if e is None:
            e = torch.zeros_like(buf)
        self.residuals[name] = _keep(ok, buf, e, self._spares)
        return packet

    def encode_decode(self, x: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        """`encode`, and what the packet decodes to (a dense tensor)."""
        packet = self.encode(x, key, ctx)
        return packet, self.compressor.decode(packet, shape=x.shape)

    def correct(self, x: torch.Tensor, key: int | str) -> torch.Tensor:
        """x plus the residual stored under key (a new tensor; x is not modified)."""
        e = self.residuals.get(str(key))
        if e is None:
            return x.clone()
        _check_like("error feedback", str(key), x, e)
        return x + e

    def update(self, key: int | str, corrected: torch.Tensor, sent: torch.Tensor) -> None:
        """Keep corrected - sent as the new residual, unless it is not finite (then keep the old).
        Consumes `corrected` (it becomes the residual). For callers that decode themselves
        (summable payloads); `encode` does both steps in place."""
        name = str(key)
        residual = corrected.sub_(sent)
        old = self.residuals.get(name)
        self.residuals[name] = _keep(all_finite(residual), residual,  # (foreign memory: no spares)
                                     old if old is not None else torch.zeros_like(residual), None)

    def residual(self, key: int | str) -> torch.Tensor | None:
        return self.residuals.get(str(key))

    def decay(self, factor: float) -> None:
        """Scale every residual by `factor` in place: an accumulator that forgets (SparseLoCo's
        outer loop, ``e = factor * e + delta``, where the next `encode` adds delta)."""
        for e in self.residuals.values():
            e.mul_(factor)

    def reset(self) -> None:
        self.residuals.clear()
        self._spares.clear()

    def state_dict(self) -> dict[str, Any]:
        return {"compressor": str(self.compressor),
                "residuals": {k: v.detach().clone() for k, v in self.residuals.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        _check_spec(self.compressor, state)
        self.residuals = {str(k): v.clone() for k, v in state["residuals"].items()}
        self._spares.clear()


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
        self._spares = _Spares()
        self._bounds: dict[str, tuple[int, int]] = {}  # bits of max |u|, max |v| (`_in_place`)

    def encode(self, grad: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> Packet:
        name = str(key)
        u_old = self.u.get(name)
        v_old = self.v.get(name)
        if u_old is None or v_old is None:
            u_old = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            v_old = torch.zeros_like(grad, memory_format=torch.contiguous_format)
            self._bounds[name] = (0, 0)
        else:
            _check_like("DGC", name, grad, u_old)
        fast = self._in_place(name, grad, u_old, v_old)
        if fast is not None:
            self.u[name], self.v[name] = u_old, v_old
            return self._encode_in_place(fast, name, grad, u_old, v_old, ctx)
        self._bounds.pop(name, None)
        u, v = self._spares.take(grad), self._spares.take(grad)
        self._accumulate(grad.detach().reshape(-1), u_old.view(-1), v_old.view(-1), u.view(-1), v.view(-1))
        packet, pieces = self.compressor.encode_sent(v, ctx)
        ok = _mask(u.view(-1), v.view(-1), pieces, getattr(self.compressor, "sends_input_values", False))
        self.u[name] = _keep(ok, u, u_old, self._spares)
        self.v[name] = _keep(ok, v, v_old, self._spares)
        return packet

    def _in_place(self, name: str, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor):
        """The compiled loops when this step may update u and v in place, else None.

        In place needs proof, before anything is written, that the step stays finite (a
        non-finite step must leave the state as it was): every |g|, |u| and |v| at most
        FLT_MAX / 8 makes every new u and v finite, so every sent value is too. The bounds
        of u and v come from the previous in-place step (or, once, from a pass over them);
        the one of g costs a read of g. The sent values must be v's own, so masking only
        zeroes elements and the bounds still hold afterwards."""
        if not (grad.device.type == "cpu" and grad.dtype == torch.float32 and grad.is_contiguous()
                and u.is_contiguous() and v.is_contiguous() and getattr(self.compressor, "sends_input_values", False)
                and compiled.enabled()):
            return None
        fast = compiled.loops()
        n = compiled.np_view
        bounds = self._bounds.get(name)
        if bounds is None:
            bounds = (int(fast.absbits_max(n(u.view(-1).view(torch.int32)))),
                      int(fast.absbits_max(n(v.view(-1).view(torch.int32)))))
            self._bounds[name] = bounds
        if max(bounds) > compiled.SAFE_BITS:
            return None
        if int(fast.absbits_max(n(grad.detach().view(-1).view(torch.int32)))) > compiled.SAFE_BITS:
            return None
        return fast

    def _encode_in_place(self, fast, name: str, grad: torch.Tensor, u: torch.Tensor, v: torch.Tensor,
                         ctx: Ctx | None) -> Packet:
        """One compiled pass for the momentum update, then masking at the sent positions (in
        ascending order, which the prefetcher follows; cheaper than doing it during the next
        step's pass). Where the compressor samples and
        then scans v (topk, dgc), the sample of the new v is computed first and the pass
        writes down the candidates too, which saves the compressor its scan of v."""
        n = compiled.np_view
        g, uf, vf = n(grad.detach().view(-1)), n(u.view(-1)), n(v.view(-1))
        m = np.float32(self.momentum)
        plan = getattr(self.compressor, "scan_plan", None)
        stride = plan(v) if plan is not None else None
        if stride is None:
            ub, vb = fast.dgc_inplace(g, uf, vf, m, self.nesterov)
            packet, pieces = self.compressor.encode_sent(v, ctx)
        else:
            sample = self._new_v(*(select.sample_view(a, stride) for a in (g, uf, vf)))
            skeys = select.sample_keys_of(sample.view(np.int32), torch.float32)
            key = self.compressor.first_key(skeys, v.numel())
            out = select.candidate_buffer(v.numel(), self.compressor.value_count(v.numel()))
            ub, vb, count = fast.dgc_inplace_at_least(g, uf, vf, m, self.nesterov, key, out)
            found = select.found_indices(out, count, v.view(-1), key)
            packet, idx = self.compressor.encode_found(v, ctx, skeys, key, found)
            pieces = self.compressor.pieces(packet, idx, packet.section(Kind.VALUES))
        for where, _sent in pieces:
            fast.mask_own(uf, vf, n(where))
        self._bounds[name] = (int(ub), int(vb))
        return packet

    def _new_v(self, g: np.ndarray, u: np.ndarray, v: np.ndarray) -> np.ndarray:
        """The v this step's update gives, for some elements (NumPy float32: the same
        operations in the same order as `dgc_inplace`, so the same bits)."""
        m = np.float32(self.momentum)
        t = u * m + g
        return (t * m + g) + v if self.nesterov else v + t

    def _accumulate(self, g: torch.Tensor, u_old: torch.Tensor, v_old: torch.Tensor, u: torch.Tensor,
                    v: torch.Tensor) -> None:
        """u = m*u_old + g;  v = v_old + u (Nesterov: v_old + (m*u + g), added in the other
        order: IEEE addition commutes). In cache-sized tiles on the CPU, so u is still in
        cache when v is made (one trip through memory for each tensor)."""
        m, n = self.momentum, g.numel()
        if g.is_cuda:  # one fused kernel (feedback.cu)
            from ..cuda import ops

            ops.dgc_accumulate(g.contiguous(), u_old, v_old, u, v, m, self.nesterov)
            return
        step = _TILE if g.device.type == "cpu" else max(n, 1)
        for s in range(0, n, step):
            e = min(n, s + step)
            ut, vt, gt = u[s:e], v[s:e], g[s:e]
            torch.mul(u_old[s:e], m, out=ut).add_(gt)
            if self.nesterov:
                torch.mul(ut, m, out=vt).add_(gt).add_(v_old[s:e])
            else:
                torch.add(v_old[s:e], ut, out=vt)

    def encode_decode(self, grad: torch.Tensor, key: int | str, ctx: Ctx | None = None) -> tuple[Packet, torch.Tensor]:
        packet = self.encode(grad, key, ctx)
        return packet, self.compressor.decode(packet, shape=grad.shape)

    def reset(self) -> None:
        self.u.clear()
        self.v.clear()
        self._spares.clear()
        self._bounds.clear()

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
        self._spares.clear()
        self._bounds.clear()


def _mask(u: torch.Tensor, v: torch.Tensor, pieces: Iterator[Piece], own_values: bool = False) -> torch.Tensor:
    """v -= sent; u *= (sent == 0) (momentum-factor masking), piece by piece; whether v is
    finite (checked where pieces are, as `Compressor.encode_residual` explains).

    `own_values`: the sent values are v's own elements (topk, dgc, threshold), so v - sent
    is +0 wherever it is finite: a scatter of zeros, no gather. A non-finite v there
    makes the sent value non-finite, which the check sees (the step is then dropped)."""
    sums, parts, bad = [], [], None
    for where, sent in pieces:
        if not isinstance(where, slice) and where.is_cuda:  # one kernel at the sent positions
            from ..cuda import ops

            bad = ops.dgc_sent(u, v, where, sent, bad)
            continue
        if isinstance(where, slice):
            part = v[where].sub_(sent)
            u[where].mul_(sent == 0)
        elif own_values and where.device.type == "cpu":
            part = sent
            v.index_fill_(0, where, 0.0)
            u.index_copy_(0, where, u.index_select(0, where).mul_(sent == 0))
        else:
            part = v.index_select(0, where).sub_(sent)
            v.index_copy_(0, where, part)
            u.index_copy_(0, where, u.index_select(0, where).mul_(sent == 0))
        if part.device.type == "cpu":
            sums.append(part.sum())
        parts.append(part)
    if bad is None:
        return parts_finite(sums, parts)
    from ..cuda import ops

    return ops.ok(bad) & parts_finite(sums, parts) if parts else ops.ok(bad)


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
