"""Backend over torch.distributed (gloo on CPU, NCCL on CUDA). Asynchronous: every
collective returns a Work wrapping the collective's torch Future."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from .backend import Backend, Work, check_same_dtype, dtype_code


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

    def alltoall(self, chunks: list[torch.Tensor], recv_counts: list[int] | None = None) -> Work[list[torch.Tensor]]:
        dtype = self._check_chunks(chunks)
        device = chunks[0].device
        send_counts = [c.numel() for c in chunks]
        if recv_counts is None:  # (count, dtype) to every rank, one small blocking all-to-all
            code = dtype_code(dtype)
            mine = torch.tensor([[n, code] for n in send_counts], dtype=torch.int64, device=device).view(-1)
            theirs = torch.empty_like(mine)
            dist.all_to_all_single(theirs, mine, group=self.group)
            pairs = theirs.view(-1, 2).tolist()
            check_same_dtype("alltoall", [c for _, c in pairs])
            recv_counts = [n for n, _ in pairs]
        elif len(recv_counts) != self.world_size:
            raise ValueError(f"alltoall needs one receive count per rank ({self.world_size}), got {len(recv_counts)}")
        send = torch.cat([c.reshape(-1) for c in chunks])
        out = torch.empty(sum(recv_counts), dtype=dtype, device=device)
        fut = dist.all_to_all_single(out, send, list(recv_counts), send_counts, group=self.group,
                                     async_op=True).get_future()
        counts = list(recv_counts)
        return Work(future=fut.then(lambda f: list(torch.split(out, counts))))

    def broadcast(self, t: torch.Tensor, src: int) -> Work[torch.Tensor]:
        fut = dist.broadcast(t, src=dist.get_global_rank(self.group, src) if self.group else src,
                             group=self.group, async_op=True).get_future()
        return Work(future=fut.then(lambda f: t))

    def split(self, color: int, key: int) -> "TorchDistBackend":
        pairs = self.allgather_object((int(color), int(key)))
        members = sorted((k, r) for r, (c, k) in enumerate(pairs) if c == int(color))
        ranks = [dist.get_global_rank(self.group, r) if self.group is not None else r for _, r in members]
        # only the members create their group, so the groups of other colors need not exist here
        group = dist.new_group(ranks=ranks, use_local_synchronization=True, sort_ranks=False)
        return TorchDistBackend(group)

    def allgather_object(self, obj: Any) -> list[Any]:
        out: list[Any] = [None] * self.world_size
        dist.all_gather_object(out, obj, group=self.group)
        return out
