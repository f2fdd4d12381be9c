"""DiLoCo checkpoints through torch.distributed.checkpoint (DCP), beside the user's own state.

What every replica holds alike (the global weights, the outer optimizers' momentum, the
inner-step count that fixes the fragment schedule) is saved once, as DCP saves any
replicated tensor; what each process holds alone (its error-feedback residuals, the rest of
its exchangers' state) is saved under its own rank, so a resumed process gets back exactly
its own. So is what the caller passes beside it (`more`: the model's and the inner
optimizer's state): between syncs every replica's weights and inner moments are its own, and
DCP would keep one copy of a key that every rank saves. `load` checks the outer settings, the
ranks and the layout as `DiLoCo.load_state_dict` does. No exchange may be in flight at `save` (call `DiLoCo.finish()`, or save right after a
sync has applied).

    >>> checkpoint.save(outer, "ckpt/step-300", model=model.state_dict(), optim=opt.state_dict())
    >>> checkpoint.load(outer, "ckpt/step-300", model=model.state_dict(), optim=opt.state_dict())

(`model=` and `optim=` are loaded in place, as `dcp.load` does; call the modules'
`load_state_dict` with them afterwards where they copy, e.g. an optimizer's.)

Tests: tests/outer/test_checkpoint.py (real gloo ranks).
"""

from __future__ import annotations

import io
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from .diloco import DiLoCo


def _process_rank(outer: DiLoCo) -> int:
    """The key of this process's own state: its rank in the default group (a replica may be a
    group of ranks, each with its own residuals), else the replicas' backend rank."""
    return dist.get_rank() if dist.is_available() and dist.is_initialized() else outer.backend.rank


def _pack(obj: Any) -> bytes:
    """State whose tensors appear only after training started (momentum buffers, residuals), as
    one opaque value: DCP loads only the keys its template already has."""
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


def _unpack(blob: bytes) -> Any:
    return torch.load(io.BytesIO(blob), weights_only=True)  # (tensors, numbers and strings only)


def _split(outer: DiLoCo) -> dict[str, Any]:
    state = outer.state_dict()
    shared = {"globals": {str(i): g for i, g in enumerate(state["globals"])},
              "rest": _pack({k: state[k] for k in ("version", "config", "inner_step", "syncs", "outer")})}
    return {"shared": shared, _own_key(outer): _pack(state["exchangers"])}


def save(outer: DiLoCo, path: str, **more: Any) -> None:
    """Save the outer loop's state (and `more`: this process's model and inner optimizer state)
    to `path`. A collective: every process of the default group calls it."""
    dcp.save({"diloco": _split(outer), "own": {_own_key(outer): more}}, checkpoint_id=path)


def _own_key(outer: DiLoCo) -> str:
    return f"rank{_process_rank(outer)}"


def load(outer: DiLoCo, path: str, **more: Any) -> None:
    """Restore what `save` wrote into `outer` (and into `more`, in place). A collective."""
    template = _split(outer)
    own = _own_key(outer)
    saved_ranks = {key.split(".")[1] for key in dcp.FileSystemReader(path).read_metadata().state_dict_metadata
                   if key.startswith("diloco.rank")}
    if own not in saved_ranks:
        raise ValueError(f"{path} holds the DiLoCo state of {sorted(saved_ranks)}, not of this process ({own}): "
                         "resume with the same ranks")
    state = {"diloco": template, "own": {own: more}}
    dcp.load(state, checkpoint_id=path)  # (into `more`'s tensors in place, and its other values into its dicts)
    loaded = state["diloco"]
    rest = _unpack(loaded["shared"]["rest"])
    outer.load_state_dict({**rest, "globals": [loaded["shared"]["globals"][str(i)] for i in range(len(outer.globals))],
                           "exchangers": _unpack(loaded[own])})
