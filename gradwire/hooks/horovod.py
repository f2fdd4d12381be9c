"""Horovod integration: gradwire compressors inside Horovod's PyTorch training loop.

Two objects:

- `Compression(spec)`: Horovod's compressor interface (`compress(tensor) -> (tensor, ctx)`,
  `decompress(tensor, ctx)`) for gradwire compressors whose payloads Horovod can allreduce
  (summable: `none`, `fp16`, `bf16`, `randomk`, and chains of those)::

      opt = hvd.DistributedOptimizer(opt, named_parameters=model.named_parameters(),
                                     compression=gradwire.hooks.horovod.Compression.fp16)

- `DistributedOptimizer(optimizer, named_parameters, compression="topk:ratio=0.01", ...)`:
  a drop-in for `hvd.DistributedOptimizer` taking any gradwire compressor, with error
  feedback. Summable payloads go through Horovod's allreduce; all others are serialized to
  uint8 packets and exchanged by Horovod's allgather, then every rank decodes every packet
  and sums them in rank order, so all ranks hold bit-identical gradients.

Exchanges start from gradient hooks as soon as a parameter's gradient is accumulated and
finish in `step()` / `synchronize()`, as in Horovod's own optimizer. `state_dict()` of the
returned optimizer carries a ``"gradwire"`` entry (compressor, step counter, error-feedback
residuals keyed by parameter name), so a checkpoint resumes bit-identically.
"""

from __future__ import annotations

import contextlib
import warnings
from collections import defaultdict
from typing import Any, ClassVar, Iterable

import torch

from ..compress import Compressor, Ctx, ErrorFeedback, compressor as make_compressor, resolve_error_feedback
from ..errors import WireFormatError

try:  # Horovod is optional: importing this module without it only fails on use
    import horovod.torch as hvd
except ImportError:  # pragma: no cover - exercised only where horovod is missing
    hvd = None


def _need_hvd() -> Any:
    if hvd is None:
        raise ImportError("gradwire.hooks.horovod needs Horovod with PyTorch support "
                          "(see scripts/install-horovod.sh)")
    return hvd


def _allreducible(t: torch.Tensor) -> bool:
    """Whether Horovod's torch extension can allreduce tensors like t (0.28.1 has no bfloat16)."""
    try:
        from horovod.torch import mpi_ops

        return hasattr(mpi_ops.mpi_lib, "horovod_torch_allreduce_async_" + t.type().replace(".", "_"))
    except Exception:  # noqa: BLE001 - private interface changed: assume the classic dtypes
        return t.dtype in (torch.float16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------
# Compression: Horovod's own compressor interface
# ---------------------------------------------------------------------------------------

class Compression:
    """A gradwire summable compressor in Horovod's compressor interface.

    Horovod calls ``compression.compress(grad)`` before its allreduce and
    ``compression.decompress(output, ctx)`` after it. The payload is the compressor's
    `to_summable` tensor, so the allreduced payload decodes to the sum (or average) of the
    ranks' gradients.

    Stochastic summable compressors (`randomk`) must pick the same elements on every rank:
    Horovod passes no tensor name, so the randomness is keyed by the tensor's shape and how
    many tensors of that shape this object has compressed so far. That is identical on all
    ranks as long as they compress same-shaped gradients in the same order, which holds for
    gradient hooks of the same model. For exact per-parameter keys (and error feedback) use
    `gradwire.hooks.horovod.DistributedOptimizer`.

    ``Compression.none``, ``Compression.fp16`` and ``Compression.bf16`` are ready instances,
    spelled as Horovod's own ``hvd.Compression.fp16``, so Horovod code changes only its import.
    """

    none: ClassVar[Compression]
    fp16: ClassVar[Compression]
    bf16: ClassVar[Compression]

    def __init__(self, spec: str | Compressor = "fp16", seed: int = 0) -> None:
        c = make_compressor(spec)
        if not c.summable:
            raise ValueError(
                f"gradwire compressor {str(c)!r} is not summable, so Horovod cannot allreduce its payloads; "
                "Compression supports summable specs only (none, fp16, bf16, randomk and chains of them). "
                f"Use gradwire.hooks.horovod.DistributedOptimizer(optimizer, named_parameters, "
                f"compression={str(c)!r}) instead, which exchanges its packets by allgather.")
        self.compressor = c
        self.seed = int(seed)
        self._calls: dict[tuple, int] = defaultdict(int)
        self._warned = False

    def __repr__(self) -> str:
        return f"gradwire.hooks.horovod.Compression({str(self.compressor)!r})"

    def _ctx(self, tensor: torch.Tensor) -> Ctx:
        if not self.compressor.stochastic:
            return Ctx(self.seed)
        shape = (tuple(tensor.shape), str(tensor.dtype))
        n = self._calls[shape]
        self._calls[shape] = n + 1
        return Ctx(self.seed, n, 0, Ctx.key_of(repr(shape)))

    def compress(self, tensor: torch.Tensor) -> tuple[torch.Tensor, Any]:
        if not tensor.dtype.is_floating_point or tensor.dtype == torch.float64:
            return tensor, None  # what Horovod's own compressors leave alone (and float64)
        ctx = self._ctx(tensor)
        payload = self.compressor.to_summable(tensor, ctx)
        if not _allreducible(payload):
            # Horovod cannot allreduce this dtype (bfloat16): carry the rounded values in fp32.
            if not self._warned:
                warnings.warn(f"Horovod cannot allreduce {payload.dtype} tensors; {self.compressor} payloads "
                              "travel as float32 (same rounding, no bandwidth saving). gradwire's "
                              "DistributedOptimizer sends them as 16-bit packets instead.")
                self._warned = True
            payload = payload.float()
        return payload, (ctx, tensor)

    def decompress(self, tensor: torch.Tensor, ctx: Any) -> torch.Tensor:
        if ctx is None:
            return tensor
        c, like = ctx
        return self.compressor.from_summable(tensor, like, c)


Compression.none = Compression("none")
Compression.fp16 = Compression("fp16")
Compression.bf16 = Compression("bf16")


# ---------------------------------------------------------------------------------------
# DistributedOptimizer: any gradwire compressor, with error feedback
# ---------------------------------------------------------------------------------------

_SUBCLASSES: dict[type, type] = {}
_LENGTH_BYTES = 8  # each rank's allgather message starts with its packet length (int64)


def split_allgathered(out: torch.Tensor, world: int, name: str) -> list[tuple[int, int]]:
    """(start, end) of each rank's packet in a Horovod allgather of `world` length-prefixed
    packets; a missing, overlong or trailing byte raises WireFormatError."""
    spans, pos = [], 0
    for r in range(world):
        if pos + _LENGTH_BYTES > out.numel():
            raise WireFormatError(f"allgather of {name!r}: rank {r}'s message is missing")
        n = int(out[pos: pos + _LENGTH_BYTES].clone().view(torch.int64))
        pos += _LENGTH_BYTES
        if n < 0 or pos + n > out.numel():
            raise WireFormatError(f"allgather of {name!r}: rank {r} declares {n} bytes, {out.numel() - pos} remain")
        spans.append((pos, pos + n))
        pos += n
    if pos != out.numel():
        raise WireFormatError(f"allgather of {name!r}: {out.numel()} bytes, the length prefixes describe {pos}")
    return spans


class DistributedOptimizer(torch.optim.Optimizer):
    """Horovod's DistributedOptimizer with gradwire compression.

    ``DistributedOptimizer(opt, named_parameters, ...)`` returns an instance of a subclass
    of both this class and ``type(opt)`` (Horovod's own trick), sharing ``opt``'s param
    groups, so `hvd.broadcast_optimizer_state`, LR schedulers and ``isinstance`` work.

    Arguments:
        optimizer: the torch optimizer to wrap.
        named_parameters: ``model.named_parameters()``: names key the error feedback and the
            compressors' randomness, and must be the same on every rank.
        compression: a gradwire spec or Compressor (any, summable or not); also accepts a
            `Compression` object.
        error_feedback: keep what compression dropped and send it later; ``"auto"`` (default)
            is on for biased compressors and off for casts and unbiased ones (`randomk`,
            `qsgd`, `terngrad`), see `Compressor.feedback_helps`.
        backward_passes_per_step: local accumulation passes before each exchange.
        op: ``hvd.Average`` or ``hvd.Sum``.
        seed: seed of the compressors' randomness (the same on every rank).
    """

    def __new__(cls, optimizer: torch.optim.Optimizer, *args: Any, **kwargs: Any) -> "DistributedOptimizer":
        if cls is not DistributedOptimizer:
            return super().__new__(cls)
        base = type(optimizer)
        if isinstance(optimizer, DistributedOptimizer):
            raise ValueError("the optimizer is already a gradwire DistributedOptimizer")
        sub = _SUBCLASSES.get(base)
        if sub is None:
            sub = type(base.__name__, (DistributedOptimizer, base), {"__module__": __name__})
            _SUBCLASSES[base] = sub
        return super().__new__(sub)

    def __init__(self, optimizer: torch.optim.Optimizer, named_parameters: Iterable[tuple[str, torch.Tensor]] | None = None,
                 compression: str | Compressor | Compression = "topk:ratio=0.01", error_feedback: bool | str = "auto",
                 backward_passes_per_step: int = 1, op: Any = None, seed: int = 0) -> None:
        h = _need_hvd()
        super().__init__(optimizer.param_groups)  # the wrapped class's __init__, on shared groups
        self.defaults = optimizer.defaults
        if isinstance(compression, Compression):
            compression = compression.compressor
        self._gw_compressor = make_compressor(compression)
        self._gw_raw = make_compressor("none")
        wanted = resolve_error_feedback(error_feedback, self._gw_compressor)
        self._gw_feedback = ErrorFeedback(self._gw_compressor) if wanted else None
        self._gw_seed = int(seed)
        self._gw_step = 0
        self._gw_ar_ok: dict[tuple, bool] = {}
        op = h.Average if op is None else op
        if op not in (h.Average, h.Sum):
            raise ValueError("gradwire DistributedOptimizer supports op=hvd.Average or hvd.Sum")
        self.op = op
        if int(backward_passes_per_step) < 1:
            raise ValueError("backward_passes_per_step must be >= 1")
        self.backward_passes_per_step = int(backward_passes_per_step)

        params = [p for group in self.param_groups for p in group["params"]]
        if named_parameters is None:
            named = [(f"gradwire.noname.{i}.{j}", p) for i, g in enumerate(self.param_groups)
                     for j, p in enumerate(g["params"])]
        else:
            named = list(named_parameters)
            if any(not isinstance(x, tuple) or len(x) != 2 for x in named):
                raise ValueError("named_parameters should be a sequence of (name, parameter) tuples, "
                                 "usually model.named_parameters()")
        names = [n for n, _ in named]
        dups = sorted({n for n in names if names.count(n) > 1})
        if dups:
            raise ValueError(f"parameter names must be unique; duplicates: {', '.join(dups)}")
        by_id = {id(p): n for n, p in named}
        unnamed = [p for p in params if id(p) not in by_id]
        if unnamed:
            raise ValueError(f"{len(unnamed)} optimizer parameter(s) are not in named_parameters")
        self._gw_names: dict[torch.Tensor, str] = {p: by_id[id(p)] for p in params}
        self._gw_delay = {p: self.backward_passes_per_step for p in params}
        self._gw_handles: dict[torch.Tensor, tuple[Any, Any]] = {}
        self._gw_requires_update = [p for p in params if p.requires_grad]
        self._gw_synchronized = False
        self._gw_should_synchronize = True
        self._gw_hooks = []
        if h.size() > 1:
            for p in self._gw_requires_update:
                self._gw_hooks.append(p.register_post_accumulate_grad_hook(self._gw_hook))

    # ---- launching ------------------------------------------------------------------
    def _gw_hook(self, p: torch.Tensor) -> None:
        if p in self._gw_handles and self._gw_delay[p] <= 0:
            raise AssertionError("gradients were computed more than backward_passes_per_step times before "
                                 "step(); increase backward_passes_per_step to accumulate locally")
        self._gw_delay[p] -= 1
        if self._gw_delay[p] == 0:
            self._gw_handles[p] = self._gw_launch(p)

    def _gw_ctx(self, name: str) -> Ctx:
        return Ctx(self._gw_seed, self._gw_step, hvd.rank(), Ctx.key_of(name))

    def _gw_compresses(self, grad: torch.Tensor) -> bool:
        from ..comm.cost import worth_compressing

        return worth_compressing(self._gw_compressor, grad.numel(), grad.dtype)

    def _gw_allreduces(self, grad: torch.Tensor) -> bool:
        """Summable payloads Horovod can allreduce go by allreduce; others as packets by allgather."""
        key = (grad.dtype, grad.device.type)
        ok = self._gw_ar_ok.get(key)
        if ok is None:
            c = self._gw_compressor
            ok = self._gw_ar_ok[key] = c.summable and _allreducible(c.to_summable(grad.new_zeros(8)))
        return ok

    def _gw_launch(self, p: torch.Tensor) -> tuple[Any, Any]:
        if p.grad is None:  # unused on this rank: still take part (others may have a gradient)
            p.grad = torch.zeros_like(p)
        grad = p.grad
        if grad.is_sparse:
            raise ValueError("sparse gradients are not supported by gradwire's DistributedOptimizer")
        name = self._gw_names[p]
        c, fb = self._gw_compressor, self._gw_feedback
        ctx = self._gw_ctx(name)
        op_name = f"gradwire.{name}"
        if self._gw_allreduces(grad):
            corrected = fb.correct(grad, name) if fb is not None else grad
            payload = c.to_summable(corrected, ctx)
            if fb is not None:
                fb.update(name, corrected, c.from_summable(payload.clone(), corrected, ctx))
            handle = hvd.allreduce_async_(payload, name=op_name, op=self.op)
            return handle, ("allreduce", ctx)
        if not self._gw_compresses(grad):
            codec, sent = self._gw_raw, grad.detach().clone()
            packet = codec.encode(sent).tensor()
        else:
            codec = c
            corrected = fb.correct(grad, name) if fb is not None else grad.detach()
            packet = c.encode(corrected, ctx).tensor()
            try:
                sent = c.decode(packet, shape=grad.shape, dtype=grad.dtype).clone()
            except WireFormatError as e:  # every peer rejects it too: raise with them after the allgather
                sent = e  # type: ignore[assignment]
            if fb is not None and isinstance(sent, torch.Tensor):
                fb.update(name, corrected, sent)
        length = torch.tensor([packet.numel()], dtype=torch.int64).view(torch.uint8).to(packet.device)
        message = torch.cat([length, packet])
        handle = hvd.allgather_async(message, name=op_name)
        return handle, ("allgather", codec, sent, message)

    # ---- finishing ------------------------------------------------------------------
    def _gw_finish(self, p: torch.Tensor, handle: Any, info: tuple) -> None:
        out = hvd.synchronize(handle)
        grad = p.grad
        if info[0] == "allreduce":
            result = self._gw_compressor.from_summable(out, grad, info[1])
        else:
            _, codec, sent, message = info
            if isinstance(sent, WireFormatError):
                raise sent
            result = torch.zeros_like(grad)
            me, name = hvd.rank(), self._gw_names[p]
            # Every rank checks every message (its own too) against its own gradient, so bad
            # bytes make all ranks raise WireFormatError here and none goes on.
            for r, (start, end) in enumerate(split_allgathered(out, hvd.size(), name)):  # rank order
                if r == me:
                    if not torch.equal(out[start - _LENGTH_BYTES: end], message):
                        raise WireFormatError(f"allgather of {name!r}: this rank's message came back altered")
                    result.add_(sent)
                else:
                    result.add_(codec.decode(out[start: end], shape=grad.shape, dtype=grad.dtype))
            if self.op == hvd.Average:
                result.div_(hvd.size())
        grad.copy_(result.reshape(grad.shape))

    def synchronize(self) -> None:
        """Finish every exchange (launching those whose hooks did not fire) and write the
        averaged gradients into `.grad`."""
        if hvd.size() > 1:
            for p in self._gw_requires_update:
                if p not in self._gw_handles:
                    self._gw_handles[p] = self._gw_launch(p)
            errors = []
            for p, (handle, info) in self._gw_handles.items():
                try:
                    self._gw_finish(p, handle, info)
                except WireFormatError as e:  # finish the other exchanges first: no handle left behind
                    errors.append(e)
                self._gw_delay[p] = self.backward_passes_per_step
            self._gw_handles.clear()
            self._gw_step += 1
            if errors:
                raise errors[0]
        self._gw_synchronized = True

    @contextlib.contextmanager
    def skip_synchronize(self):
        """``optimizer.synchronize(); with optimizer.skip_synchronize(): optimizer.step()``"""
        self._gw_should_synchronize = False
        try:
            yield
        finally:
            self._gw_should_synchronize = True

    def step(self, closure: Any = None) -> Any:
        if self._gw_should_synchronize:
            if self._gw_synchronized:
                warnings.warn("optimizer.step() called after optimizer.synchronize() without "
                              "optimizer.skip_synchronize(): the gradients are exchanged again")
            self.synchronize()
        self._gw_synchronized = False
        return super().step(closure)

    def zero_grad(self, set_to_none: bool = True) -> None:
        if self._gw_handles:
            raise AssertionError("optimizer.zero_grad() was called after loss.backward() but before "
                                 "optimizer.step() or optimizer.synchronize()")
        return super().zero_grad(set_to_none)

    # ---- state ----------------------------------------------------------------------
    def gradwire_state_dict(self) -> dict[str, Any]:
        """The gradwire part of the state: compressor, step counter, error-feedback residuals."""
        return {"compressor": str(self._gw_compressor), "step": self._gw_step,
                "feedback": self._gw_feedback.state_dict() if self._gw_feedback is not None else None}

    def load_gradwire_state_dict(self, state: dict[str, Any]) -> None:
        if state.get("compressor") != str(self._gw_compressor):
            raise ValueError(f"state was saved for compressor {state.get('compressor')!r}, "
                             f"this optimizer uses {str(self._gw_compressor)!r}")
        if (state.get("feedback") is None) != (self._gw_feedback is None):
            raise ValueError("checkpoint and optimizer disagree on whether error feedback is on")
        if self._gw_feedback is not None:
            self._gw_feedback.load_state_dict(state["feedback"])
        self._gw_step = int(state["step"])

    def state_dict(self) -> dict[str, Any]:
        sd = super().state_dict()
        sd["gradwire"] = self.gradwire_state_dict()
        return sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        state_dict = dict(state_dict)
        gw = state_dict.pop("gradwire", None)
        self._gw_handles.clear()
        self._gw_synchronized = False
        self._gw_should_synchronize = True
        for p in self._gw_delay:
            self._gw_delay[p] = self.backward_passes_per_step
        super().load_state_dict(state_dict)
        if gw is not None:
            self.load_gradwire_state_dict(gw)
