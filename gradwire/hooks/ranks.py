"""Every rank's hook state in one object, for checkpointers that save from one rank only.

A hook's state is per rank (each rank's error-feedback residuals and Adam moments differ), but
Lightning, Accelerate and the Hugging Face Trainer write what rank 0 hands them. `gather_states`
collects each rank's `state_dict()` on the saving rank; `own_state` picks this rank's entry back
out when every rank loads that file, so a rank-0-only checkpoint resumes every rank exactly.
States travel as `torch.save` bytes and are read with `torch.load(weights_only=True)`: tensors and
plain data only, nothing a peer sends is unpickled into code.
"""

from __future__ import annotations

import io
from typing import Any, Mapping

import torch
import torch.distributed as dist

from ..errors import WireFormatError

ALL_RANKS = "gradwire-all-ranks"
VERSION = 1


def where() -> tuple[int, int]:
    """(global rank, world size) of this process; (0, 1) without a process group."""
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


def is_all_ranks(saved: Mapping[str, Any]) -> bool:
    return isinstance(saved, Mapping) and saved.get("format") == ALL_RANKS


def _to_bytes(state: Mapping[str, Any]) -> torch.Tensor:
    buf = io.BytesIO()
    torch.save(dict(state), buf)
    return torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8)


def _from_bytes(blob: torch.Tensor) -> dict[str, Any]:
    return torch.load(io.BytesIO(blob.numpy().tobytes()), weights_only=True)


def _device() -> torch.device:
    """Where the default group's collectives take their tensors (NCCL: the current GPU)."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def ranks_with(flag: bool) -> list[int]:
    """Collective over the default group: the ranks whose `flag` is true (e.g. the ones a framework
    writes checkpoints from). Plain ints travel, nothing pickled."""
    device = _device()
    flags = [torch.zeros(1, dtype=torch.int32, device=device) for _ in range(dist.get_world_size())]
    dist.all_gather(flags, torch.tensor([int(bool(flag))], dtype=torch.int32, device=device))
    return [r for r, f in enumerate(flags) if int(f)]


def gather_states(local: Mapping[str, Any], dst: int = 0) -> dict[str, Any]:
    """Collective over the default group: every rank must call it. Returns, on `dst`, every rank's
    state in rank order; on the other ranks a marker that holds none (their framework does not
    write it)."""
    rank, world = where()
    if world == 1:
        return {"format": ALL_RANKS, "version": VERSION, "world_size": 1, "ranks": [dict(local)]}
    blob, device = _to_bytes(local), _device()
    sizes = [torch.zeros(1, dtype=torch.int64, device=device) for _ in range(world)]
    dist.all_gather(sizes, torch.tensor([blob.numel()], dtype=torch.int64, device=device))
    lengths = [int(s) for s in sizes]
    # every rank's state has the same shapes (same config, same model): a size far above the smallest is
    # a lie; every rank sees the same sizes, so all decide alike and refuse before allocating anything
    limit = 2 * min(lengths) + (1 << 20)
    if max(lengths) > limit or min(lengths) < 0:
        raise WireFormatError(f"gather_states: ranks announced states of {lengths} bytes; one more than twice the "
                              "smallest (+1 MiB) cannot be a state of the same config and model")
    longest = max(lengths)
    padded = torch.zeros(longest, dtype=torch.uint8)
    padded[: blob.numel()] = blob
    received = [torch.empty(longest, dtype=torch.uint8, device=device) for _ in range(world)] if rank == dst else None
    dist.gather(padded.to(device), received, dst=dst)
    if received is None:
        return {"format": ALL_RANKS, "version": VERSION, "world_size": world, "ranks": None, "held_by": dst}
    states = [_from_bytes(r[:n].cpu()) for r, n in zip(received, lengths)]
    return {"format": ALL_RANKS, "version": VERSION, "world_size": world, "ranks": states}


def own_state(saved: Mapping[str, Any], entry_point: str = "gradwire hook") -> dict[str, Any]:
    """This rank's state: `saved` itself when it is one rank's, else this rank's entry of an
    all-ranks state. ValueError when the world size differs or the object holds no states."""
    if not is_all_ranks(saved):
        return dict(saved)
    rank, world = where()
    if saved.get("version", VERSION) > VERSION:
        raise ValueError(f"this all-ranks {entry_point} state has format version {saved['version']}; "
                         f"this gradwire reads up to {VERSION}")
    if saved["world_size"] != world:
        raise ValueError(f"this {entry_point} state was saved by {saved['world_size']} ranks; this job has {world}: "
                         "error-feedback residuals and moments are per rank and cannot be regrouped")
    if saved["ranks"] is None:
        raise ValueError(f"this all-ranks {entry_point} state is the empty marker of a rank that did not save; "
                         f"load the one rank {saved.get('held_by', 0)} saved")
    if len(saved["ranks"]) != world:
        raise ValueError(f"this all-ranks {entry_point} state says {world} ranks but holds {len(saved['ranks'])}")
    return dict(saved["ranks"][rank])


class PerRankState:
    """What the hook states share: `state_dict()` is this rank's; `all_ranks_state_dict()` every
    rank's (a collective), the form to hand a checkpointer that saves from one rank."""

    def state_dict(self) -> dict[str, Any]:
        raise NotImplementedError

    def all_ranks_state_dict(self, dst: int = 0) -> dict[str, Any]:
        """Every rank's `state_dict()` gathered on `dst` (all ranks must call this; the others get
        a marker holding none). `load_state_dict` takes it on every rank and keeps its own entry."""
        return gather_states(self.state_dict(), dst)
