"""torchft's DiLoCo as an outside anchor for gradwire's (issue 28).

gradwire.outer.DiLoCo is checked against equations its own authors wrote down; running PyTorch's
fault-tolerant implementation (pytorch/torchft, ``pip install torchft``) on the same model, data,
H and seed gives numbers nobody here wrote. This module sets torchft up inside processes that are
already running (rank r of W, e.g. gradwire's gloo ranks) on CPU: every process is its own replica
group of one, joined over gloo on loopback; rank 0 hosts the lighthouse.

    >>> with TorchftDiLoCo(model, inner_opt, rank=r, world=w, sync_every=H) as anchor:
    ...     for x, y in data:
    ...         loss_fn(model(x), y).backward(); inner_opt.step(); inner_opt.zero_grad()
    >>> anchor.close()

torchft drives the sync from hooks on ``inner_opt.step()``, so the loop has no ``outer.step()``.

Matching gradwire's settings: the outer optimizer is SGD(lr 0.7, momentum 0.9, Nesterov) per
fragment (torchft steps it on the model's own parameters, so one optimizer over all of them would
also step the fragments not being synced with their inner gradients); fragments are cut with
gradwire's `split_fragments`; ``init_sync=False`` because every replica starts from the same seed
(torchft's default would have replicas 1.. load replica 0's weights at the first quorum, which
comes after H steps, and so drop their own first H steps). Two conventions differ from gradwire:
torchft averages as sum then divide (gradwire divides first; the same bits for W a power of 2), and
with ``delay=tau`` torchft issues a fragment's exchange tau steps before its sync step and applies
it at that step, where gradwire issues it at that step and applies it tau steps later.
No CUDA: streams, pinned memory and quantization (Triton) stay off on CPU tensors.
"""

from __future__ import annotations

import copy
import re
from datetime import timedelta
from types import TracebackType
from typing import Any, Callable

import torch
import torch.distributed as dist

from ..outer import split_fragments


_ADDRESS_BYTES = 256
_ADDRESS = re.compile(r"http://[A-Za-z0-9.\-]+:[0-9]{1,5}")


def _fragment_modules(model: torch.nn.Module, fragments: int) -> list[torch.nn.Module]:
    """The model's trainable parameters in gradwire's fragments, each held (not copied) by a module,
    the unit torchft syncs."""
    params = [p for p in model.parameters() if p.requires_grad]
    which = split_fragments([p.numel() for p in params], fragments)
    modules = []
    for k in range(fragments):
        holder = torch.nn.Module()
        holder.params = torch.nn.ParameterList([p for p, f in zip(params, which) if f == k])
        modules.append(holder)
    return modules


class TorchftDiLoCo:
    """torchft's DiLoCo around `model` and `inner_opt` for this replica (one process).

    `lighthouse`: ``host:port`` that rank 0 binds and the others reach; None: rank 0 binds a free
    port on `host` and sends the address over the default torch.distributed group. `stats` holds
    one record per fragment sync issued: the pseudo-gradient bytes this replica put into the
    allreduce (gradwire's ``bytes_sent`` convention: the payload, not the ring's traffic).
    """

    def __init__(self, model: torch.nn.Module, inner_opt: torch.optim.Optimizer, *, rank: int, world: int,
                 sync_every: int, fragments: int = 1, delay: int = 0, mix: float = 0.0, outer_lr: float = 0.7,
                 momentum: float = 0.9, nesterov: bool = True, lighthouse: str | None = None,
                 host: str = "127.0.0.1", timeout_s: float = 60.0) -> None:
        from torchft.coordination import LighthouseServer
        from torchft.local_sgd import DiLoCo
        from torchft.manager import Manager
        from torchft.process_group import ProcessGroupGloo

        self.model, self.inner_opt, self.rank = model, inner_opt, rank
        self._lighthouse: Any = None
        if rank == 0:
            self._lighthouse = LighthouseServer(bind=lighthouse or f"{host}:0", min_replicas=world)
        address = self._share_address(lighthouse, host)
        timeout = timedelta(seconds=timeout_s)
        # this replica group's own store: its rank 0 (the only one) publishes its manager's address there
        self._store = dist.TCPStore(host, 0, is_master=True, wait_for_workers=False, timeout=timeout)
        self.fragments = _fragment_modules(model, fragments)
        self.outer_opts = [torch.optim.SGD(f.parameters(), lr=outer_lr, momentum=momentum,
                                           nesterov=nesterov and momentum > 0) for f in self.fragments]
        self.manager = Manager(
            pg=ProcessGroupGloo(timeout=timeout), min_replica_size=world, use_async_quorum=False,
            load_state_dict=self._load, state_dict=self._save, rank=0, world_size=1,
            store_addr=host, store_port=self._store.port, lighthouse_addr=address, replica_id=f"replica_{rank}",
            hostname=host, init_sync=False, timeout=timeout, quorum_timeout=timeout, connect_timeout=timeout)
        self.stats: list[dict[str, Any]] = []
        self.inner_step = 0
        self._unsent = 0  # bytes allreduced since the last inner step ended
        self._count_allreduce()
        self.diloco = DiLoCo(self.manager, self.fragments, inner_opt, self.outer_opts, sync_every=sync_every,
                             backup_device=torch.device("cpu"), pin_memory=False, should_quantize=False,
                             fragment_sync_delay=delay, fragment_update_alpha=mix)
        self._hook: Any = None

    def _share_address(self, lighthouse: str | None, host: str) -> str:
        if lighthouse is not None:
            return f"http://{lighthouse}"
        if not dist.is_initialized():
            if self._lighthouse is None:
                raise ValueError("give `lighthouse` (host:port) or initialize torch.distributed to share it")
            return f"http://{host}:{self._port()}"
        # as bytes in a fixed-size tensor: nothing a peer sends is unpickled
        box = torch.zeros(_ADDRESS_BYTES, dtype=torch.uint8)
        if self._lighthouse is not None:
            raw = f"http://{host}:{self._port()}".encode("ascii")
            box[: len(raw)] = torch.frombuffer(bytearray(raw), dtype=torch.uint8)
        dist.broadcast(box, src=0)
        address = bytes(box.tolist()).rstrip(b"\0").decode("ascii", errors="replace")
        if not _ADDRESS.fullmatch(address):
            raise ValueError(f"rank 0 sent {address!r} as torchft's lighthouse address, not http://host:port")
        return address

    def _port(self) -> int:
        # address() names the machine's hostname; the port is what the others need
        return int(self._lighthouse.address().rstrip("/").rsplit(":", 1)[1])

    def _count_allreduce(self) -> None:
        """Count what goes into torchft's allreduce: its own bucketing (TORCHFT_USE_BUCKETIZATION)
        or not, the bytes are those of the tensors it reduces."""
        allreduce: Callable[..., Any] = self.manager.allreduce

        def counted(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            self._unsent += tensor.numel() * tensor.element_size()
            return allreduce(tensor, *args, **kwargs)

        self.manager.allreduce = counted  # type: ignore[method-assign]

    def _after_step(self, *_: Any) -> None:
        # registered after torchft's hook, so an exchange issued in this step has been counted
        self.inner_step += 1
        if self._unsent:
            self.stats.append({"step": self.inner_step, "bytes_sent": self._unsent, "dense_bytes": self._unsent})
            self._unsent = 0

    def _save(self) -> dict[str, Any]:
        return {"model": self.model.state_dict(), "inner": self.inner_opt.state_dict()}

    def _load(self, state: dict[str, Any]) -> None:
        self.model.load_state_dict(state["model"])
        self.inner_opt.load_state_dict(state["inner"])

    def __enter__(self) -> TorchftDiLoCo:
        self.diloco.__enter__()
        self._hook = self.inner_opt.register_step_post_hook(self._after_step)
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> bool:
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        return self.diloco.__exit__(exc_type, exc, tb)

    def global_weights(self) -> list[torch.Tensor]:
        """The weights of the last sync, in model.parameters() order (what DiLoCo evaluates)."""
        saved = [t for f in self.diloco._fragments for t in f.original_parameters.values()]
        return [t.detach().clone() for t in saved]

    def global_model(self) -> torch.nn.Module:
        """A copy of the model holding the weights of the last sync (the replica trains on)."""
        out = copy.deepcopy(self.model)
        with torch.no_grad():
            for p, g in zip((p for p in out.parameters() if p.requires_grad), self.global_weights()):
                p.copy_(g)
        return out

    def close(self) -> None:
        """Stop this replica's manager; rank 0's lighthouse and store stop only after every rank
        is here (a barrier on the default group, when there is one)."""
        if dist.is_initialized():
            dist.barrier()
        self.manager.shutdown(wait=False)
        if self._lighthouse is not None:
            self._lighthouse.shutdown()
            self._lighthouse = None

