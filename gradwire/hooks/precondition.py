"""Adam inside the DDP hook, the optimizer plain SGD: `precondition="adam"` and `"global_adam"`.

Each rank turns its own gradient into Adam's step direction ``m_hat / (sqrt(v_hat) + eps)``, with
moments of its local gradients, and the hook compresses and averages that direction; the optimizer
is then plain SGD (no momentum) at Adam's learning rate. Why: with error feedback on the gradient,
Adam sees a coordinate only when the sparsifier sends it, as one spike that carries many steps of
gradient; the second moment grows with the spike's square, so over T steps the coordinate moves
about sqrt(T) times less than under dense Adam (on the 0.47M-parameter charlm transformer, top-k
1% ended 21% worse in perplexity). Normalized first, every step's direction has Adam's scale, and
error feedback delays it without shrinking it. The moments never travel: they are per rank, and the
parameters stay identical because every rank applies the same averaged direction.

`"global_adam"` (`GlobalAdam`) shares the moments instead: v is built in the uncompressed first
steps and frozen, and each rank sends its momentum through the compressor (1-bit Adam's
structure). Per-rank moments see each rank's own noise, which costs quality as the world grows;
shared ones see the whole batch. With `"sign"` this is the LM setting at 20x fewer bytes.

Clipping (both): the optimizer sees Adam's averaged direction, whose norm is about sqrt(#parameters), so
`clip_grad_norm_(1.0)` (the Hugging Face Trainer's default) would shrink every step by that factor.
`clip=C` clips the true gradient instead, before the moments: each rank scales its own gradient (the
norm over the whole model, as `clip_grad_norm_` computes it) to at most C. The hook then waits for
the step's last bucket before it preconditions and sends any (the norm needs them all), so
`clip=` gives up overlapping the exchange with the backward pass.
"""

from __future__ import annotations

from typing import Any

import torch

#: uncompressed steps whose averaged gradients build `global_adam`'s second moment by default
GLOBAL_DENSE_STEPS = 12


class AdamPreconditioner:
    """Per-parameter Adam moments (keyed by parameter name) that map a gradient to Adam's direction."""

    #: whether the moments are the same on every rank, updated after the exchange (`after_` does work)
    shares_moments = False
    #: the cast the uncompressed first steps travel in (None: a dense fp32 allreduce)
    uncompressed: str | None = None

    def __init__(self, beta1: float = 0.9, beta2: float = 0.999, eps: float = 1e-8, clip: float | None = None) -> None:
        if not (0.0 <= beta1 < 1.0 and 0.0 <= beta2 < 1.0 and eps > 0.0):
            raise ValueError(f"adam preconditioner needs 0 <= beta1, beta2 < 1 and eps > 0, got {beta1}, {beta2}, {eps}")
        if clip is not None and not clip > 0.0:
            raise ValueError(f"adam preconditioner's clip must be > 0 (the largest gradient norm), got {clip}")
        self.beta1, self.beta2, self.eps = float(beta1), float(beta2), float(eps)
        self.clip = float(clip) if clip is not None else None
        self.m: dict[str, torch.Tensor] = {}
        self.v: dict[str, torch.Tensor] = {}
        self.steps: dict[str, int] = {}

    def __str__(self) -> str:
        text = f"adam:beta1={self.beta1:g},beta2={self.beta2:g},eps={self.eps:g}"
        return text + (f",clip={self.clip:g}" if self.clip is not None else "")

    @staticmethod
    def clip_scale(norm: float, clip: float) -> float:
        """The factor `clip_grad_norm_` applies to gradients of total norm `norm` (at most 1)."""
        return min(1.0, clip / (norm + 1e-6))

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

    def before_(self, g: torch.Tensor, key: str, compressed: bool) -> None:
        """Before the exchange: this rank's gradient becomes its own Adam direction."""
        self.apply_(g, key)

    def after_(self, avg: torch.Tensor, key: str, compressed: bool) -> None:
        """After the exchange: the average of the directions is the step; nothing to do."""

    def state_dict(self) -> dict[str, Any]:
        return {"m": dict(self.m), "v": dict(self.v), "steps": dict(self.steps)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.m, self.v, self.steps = dict(state["m"]), dict(state["v"]), dict(state["steps"])


class GlobalAdam(AdamPreconditioner):
    """Adam with moments every rank shares, the momentum compressed (`precondition="global_adam"`).

    The structure of 1-bit Adam (Tang et al., 2021): the second moment v is built from the averaged
    gradients of the uncompressed first steps (`start_iter`, 12 by default, sent in bf16: half the
    bytes, and 8 bits of mantissa are plenty for the moments) and then frozen; from
    then on each rank sends its own momentum ``beta1 * m + (1 - beta1) * g_i`` through the
    compressor with error feedback, and the average becomes the shared m. The step is
    ``m_hat / (sqrt(v_hat) + eps)``, as dense Adam's, with no learning-rate factor for the world
    size: unlike `adam` (each rank's own moments), the moments see the whole batch. Momentum is
    smooth from step to step, so error feedback's delay costs little, which is why this keeps
    quality at 4 ranks where per-rank moments do not (docs/benchmarks.md, issue 29).
    """

    shares_moments = True
    uncompressed = "bf16"  # the dense first steps only build the moments: 8 bits of mantissa are plenty

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.frozen: dict[str, int] = {}  # per key: how many dense steps built v
        self._denoms: dict[str, torch.Tensor] = {}  # per key: the frozen v's denominator (derived, not saved)

    def __str__(self) -> str:
        return "global_" + super().__str__()

    def before_(self, g: torch.Tensor, key: str, compressed: bool) -> None:
        """Compressed steps send this rank's momentum (dense steps send the gradient as it is)."""
        if compressed:
            m = self.m.get(key)
            if m is None:
                raise RuntimeError(f"global_adam: no momentum for {key!r}: compression started before a dense step")
            g.mul_(1 - self.beta1).add_(m, alpha=self.beta1)

    def after_(self, avg: torch.Tensor, key: str, compressed: bool) -> None:
        """Update the shared moments from the average and replace it by Adam's direction."""
        t = self.steps[key] = self.steps.get(key, 0) + 1
        if compressed:
            if key not in self.v:
                raise RuntimeError(f"global_adam: no second moment for {key!r}")
            m = self.m[key]
            m.copy_(avg)
        else:
            m = self.m.get(key)
            if m is None:
                m = self.m[key] = torch.zeros_like(avg)
                self.v[key] = torch.zeros_like(avg)
                self.frozen[key] = 0
            m.mul_(self.beta1).add_(avg, alpha=1 - self.beta1)
            self.v[key].mul_(self.beta2).addcmul_(avg, avg, value=1 - self.beta2)
            self.frozen[key] += 1
        torch.div(m, self._denominator(key, compressed), out=avg).div_(1 - self.beta1 ** t)
        if compressed and self.max_step is not None:
            avg.clamp_(-self.max_step, self.max_step)

    def _denominator(self, key: str, frozen: bool) -> torch.Tensor:
        """sqrt(v_hat) + eps; once v is frozen it never changes, so it is computed once per key."""
        cached = self._denoms.get(key) if frozen else None
        if cached is None:
            cached = (self.v[key] / (1 - self.beta2 ** self.frozen[key])).sqrt_().add_(self.eps)
            if frozen:
                self._denoms[key] = cached
        return cached

    @property
    def max_step(self) -> float | None:
        """The largest |m / sqrt(v)| any gradient sequence gives dense Adam (Cauchy-Schwarz over the two
        EMAs; needs beta1**2 < beta2). With v frozen, a coordinate that was ~0 in the dense steps would
        otherwise step by m / eps: compressed steps are clamped to this bound, which dense Adam's never exceed."""
        ratio = self.beta1 ** 2 / self.beta2
        if ratio >= 1.0:
            return None
        return (1 - self.beta1) / ((1 - self.beta2) * (1 - ratio)) ** 0.5

    def state_dict(self) -> dict[str, Any]:
        return {**super().state_dict(), "frozen": dict(self.frozen)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        self.frozen = dict(state["frozen"])
        self._denoms = {}


def sgd_like(optimizer: torch.optim.Optimizer) -> torch.optim.SGD:
    """The optimizer `precondition="adam"` needs in place of the user's Adam/AdamW: plain SGD (no
    momentum) over the same parameter groups, learning rates and weight decay. SGD's weight decay
    on Adam's direction, ``p -= lr * (d + wd * p)``, is exactly AdamW's decoupled decay. Build LR
    schedulers on the returned optimizer."""
    groups = [{"params": g["params"], "lr": g["lr"], "weight_decay": g.get("weight_decay", 0.0)}
              for g in optimizer.param_groups]
    return torch.optim.SGD(groups, lr=optimizer.defaults.get("lr", groups[0]["lr"]), momentum=0.0)


def adam_spec(optimizer: torch.optim.Optimizer, clip: float | None = None, *, shared: bool = False) -> str:
    """`precondition=` matching an Adam/AdamW optimizer's betas and eps (and `clip=`, the largest
    gradient norm, where the user clipped with clip_grad_norm_); `shared=True` gives `global_adam`
    (moments shared by every rank, the momentum compressed)."""
    beta1, beta2 = optimizer.defaults.get("betas", (0.9, 0.999))
    name = "global_adam" if shared else "adam"
    spec = f"{name}:beta1={beta1:g},beta2={beta2:g},eps={optimizer.defaults.get('eps', 1e-8):g}"
    return spec + (f",clip={clip:g}" if clip is not None else "")


def plain_sgd(optimizer: torch.optim.Optimizer) -> bool:
    """Whether `optimizer` applies the gradient as it is (SGD without momentum or Nesterov)."""
    return type(optimizer) is torch.optim.SGD and all(not g.get("momentum") for g in optimizer.param_groups)


_KINDS = {"adam": AdamPreconditioner, "global_adam": GlobalAdam}


def make_preconditioner(spec: str | None) -> AdamPreconditioner | None:
    """None or "" (off), "adam" / "global_adam", optionally with ":beta1=0.9,beta2=0.999,eps=1e-8,clip=1.0"
    (clip: none by default)."""
    if not spec:
        return None
    name, _, args = spec.partition(":")
    if name not in _KINDS:
        raise ValueError(f"precondition must be 'adam' or 'global_adam' (optionally followed by "
                         f":beta1=..,beta2=..,eps=..,clip=..), got {spec!r}")
    options: dict[str, float] = {}
    for item in filter(None, args.split(",")):
        key, _, value = item.partition("=")
        if key not in ("beta1", "beta2", "eps", "clip"):
            raise ValueError(f"{name} preconditioner takes beta1, beta2, eps, clip; got {item!r}")
        try:
            options[key] = float(value)
        except ValueError:
            raise ValueError(f"adam preconditioner's {key} must be a number, got {item!r}") from None
    return _KINDS[name](**options)
