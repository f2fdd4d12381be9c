"""Backend over torch.distributed (gloo on CPU, NCCL on CUDA). Asynchronous: every
collective returns a Work wrapping the collective's torch Future."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .backend import Backend, Work


class TorchDistBackend(Backend):
    allreduce_identical = True  # ring reduce-scatter then allgather: one sum per element, copied

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        if not dist.is_initialized():
            raise RuntimeError("torch.distributed is not initialized; call dist.init_process_group first")
        self.group = group
        self.rank = dist.get_rank(group)
        self.world_size = dist.get_world_size(group)

    def allreduce(self, t: torch.Tensor) -> Work[torch.Tensor]:
        fut = dist.all_reduce(t, group=self.group, async_op=True).get_future()
        return Work(future=fut.then(lambda f: t))

    def allgather(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        outs = [torch.empty_like(t) for _ in range(self.world_size)]
        fut = dist.all_gather(outs, t, group=self.group, async_op=True).get_future()
        return Work(future=fut.then(lambda f: outs))

    def allgatherv(self, t: torch.Tensor) -> Work[list[torch.Tensor]]:
        # Sizes first (one small blocking exchange), then a padded allgather.
        size = torch.tensor([t.numel()], dtype=torch.int64, device=t.device)
        sizes = [torch.empty_like(size) for _ in range(self.world_size)]
        dist.all_gather(sizes, size, group=self.group)
        counts = [int(s.item()) for s in sizes]
        longest = max(counts)
        padded = t if t.numel() == longest else torch.cat([t, t.new_zeros(longest - t.numel())])
        return self.allgather(padded).then(lambda outs: [o[:n] for o, n in zip(outs, counts)])

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        fut = dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group else src,
                             group=self.group, async_op=True).get_future()
        return Work(future=fut.then(lambda f: t))

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
