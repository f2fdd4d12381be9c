"""`hierarchical`: dense inside a node, compressed between nodes (BytePS, ZeRO++ hpZ, Bagua).

Real clusters are nodes of several GPUs with fast links inside and slow links between, so
only the traffic between nodes is worth compressing. For each bucket of a node of G ranks:

1. reduce-scatter inside the node, dense: local rank j gets the node's sum of chunk j of the
   bucket (one all-to-all, summed in local-rank order, fp32 for half types);
2. local rank j of every node exchanges its chunk with the same local rank of the other
   nodes through any inner strategy and compressor (`allgather`, `allreduce`, `oktopk`, ...),
   keyed per chunk, so error feedback and randomness follow the chunk;
3. allgather inside the node: every rank has every chunk.

Each node's chunks therefore cross the slow links once, compressed, from G ranks in parallel.
Replicas stay bit-identical: each chunk's sum comes from the inner strategy (identical on the
nodes' local rank j) and is copied to the node's other ranks. `last_stats` counts the bytes of
steps 1 and 3 as `intra_bytes_*`; the rest is inter-node traffic.

Nodes come from `ranks_per_node` when given (contiguous blocks of ranks), else from the
launcher (`LOCAL_WORLD_SIZE` of torchrun, `OMPI_COMM_WORLD_LOCAL_SIZE` of Open MPI; contiguous
blocks too), else from the hostnames; every rank must agree, or all raise ValueError.

The inner strategy runs over the between-node sub-group, which exists only once the nodes are
known, so `Hierarchical` takes a factory for it (`make_inner(backend)`: the registry builds one
by name, `auto` builds its candidates directly).

Tests: tests/comm/test_hierarchical.py (4 gloo ranks as 2 nodes of 2), tests/comm/test_faults.py.
"""

from __future__ import annotations

import os
import socket
import time
import zlib
from dataclasses import replace
from typing import Any, Callable

import torch

from ..compress import Compressor, Ctx
from ..errors import WireFormatError
from .backend import Backend, Work
from .base import ExchangeStats, Strategy, StrategyTraits, Workload, accumulation_dtype, segments_of
from .framing import agree
from .links import Links


def launcher_ranks_per_node() -> int | None:
    """Ranks per node as the launcher says (torchrun's LOCAL_WORLD_SIZE, Open MPI's local size)."""
    value = os.environ.get("LOCAL_WORLD_SIZE") or os.environ.get("OMPI_COMM_WORLD_LOCAL_SIZE")
    return int(value) if value else None


def node_layout(backend: Backend, ranks_per_node: int | None = None) -> tuple[int, int, int]:
    """(node index, local rank, ranks per node) of this rank, the same view on every rank.

    Every rank sends the same fixed-layout record whatever it was told (its ranks per node, or
    -1, and its hostname), so ranks that disagree all raise ValueError instead of mismatching."""
    world, rank = backend.world_size, backend.rank
    size = ranks_per_node if ranks_per_node is not None else launcher_ranks_per_node()
    views = [row[0] for row in backend.allgather_ints([int(size) if size is not None else -1])]
    if len(set(views)) > 1:
        told = ", ".join(f"rank {r}: {v if v >= 0 else 'none'}" for r, v in enumerate(views))
        raise ValueError(f"ranks disagree on the ranks per node (ranks_per_node= or the launcher's "
                         f"LOCAL_WORLD_SIZE / OMPI_COMM_WORLD_LOCAL_SIZE): {told}")
    if size is not None:
        if size < 1 or world % size:
            raise ValueError(f"{world} ranks do not split into nodes of {size}")
        return rank // size, rank % size, size
    hosts = backend.allgather_text(socket.gethostname(), limit=256)
    names = sorted(set(hosts))
    members = [[r for r, h in enumerate(hosts) if h == n] for n in names]
    sizes = {len(m) for m in members}
    if len(sizes) > 1:
        raise ValueError(f"nodes have different numbers of ranks: {dict(zip(names, map(len, members)))}; "
                         "pass ranks_per_node=")
    node = names.index(hosts[rank])
    return node, members[node].index(rank), sizes.pop()


def node_chunks(numel: int, parts: int, shapes: list[torch.Size] | None = None, keys: list[str] | None = None,
                key: int | str = 0) -> list[tuple[int, int, list[torch.Size] | None, list[str] | None]]:
    """The bucket cut into `parts` chunks of about equal size: (start, end, shapes, keys) each.

    With the bucket's tensor shapes, cuts fall on row boundaries (dim 0) of the tensor they
    land in, so each chunk is a list of whole tensors or row blocks that keep their matrix
    shape: per-tensor compressors (PowerSGD's matrices, `min_numel`'s small tensors, per-tensor
    top-k) see tensors, not arbitrary slices. A row block's key is the tensor's key + "@<first
    row>"; the same on every rank, step after step."""
    cuts = [numel * j // parts for j in range(parts + 1)]
    if shapes is None or keys is None or numel == 0:
        return [(cuts[j], cuts[j + 1], None, None) for j in range(parts)]
    segs = segments_of(torch.empty(numel, device="meta"), key, shapes, keys)

    def row_of(i: int) -> int:
        shape = shapes[i]
        return max(segs[i].numel // shape[0], 1) if len(shape) and shape[0] else max(segs[i].numel, 1)

    snapped = [0]
    for c in cuts[1:-1]:
        i = next(i for i, g in enumerate(segs) if g.offset <= c < g.offset + g.numel)
        row = row_of(i)
        snapped.append(max(snapped[-1], segs[i].offset + round((c - segs[i].offset) / row) * row))
    snapped.append(numel)
    out = []
    for a, b in zip(snapped, snapped[1:]):
        piece_shapes: list[torch.Size] = []
        piece_keys: list[str] = []
        for i, g in enumerate(segs):
            lo, hi = max(a, g.offset), min(b, g.offset + g.numel)
            if lo >= hi:
                continue
            if (lo, hi) == (g.offset, g.offset + g.numel):
                piece_shapes.append(torch.Size(shapes[i]))
                piece_keys.append(g.key)
            else:
                row = row_of(i)
                piece_shapes.append(torch.Size(((hi - lo) // row, *shapes[i][1:])))
                piece_keys.append(f"{g.key}@{(lo - g.offset) // row}")
        out.append((a, b, piece_shapes, piece_keys))
    return out


class Hierarchical(Strategy):
    """Dense reduce-scatter in the node, an inner strategy between nodes, allgather in the node.

    `make_inner` builds the inner strategy over the between-node backend it is given; its
    compressor is this strategy's, and its error feedback is the only one kept."""

    name = "hierarchical"
    TRAITS = StrategyTraits("hierarchical", None, stateful=True, swaps_compressor=True, wraps_inner=True)

    def __init__(self, backend: Backend, make_inner: Callable[[Backend], Strategy],
                 ranks_per_node: int | None = None) -> None:
        self.node, self.local, self.ranks_per_node = node_layout(backend, ranks_per_node)
        self.intra = backend.split(self.node, self.local)
        self.inter = backend.split(self.local, self.node)
        self.node_ranks = [row[0] for row in self.intra.allgather_ints([backend.rank])]  # local -> global rank
        self.inner = make_inner(self.inter)
        super().__init__(backend, self.inner.compressor, error_feedback=False)  # the inner strategy keeps it

    @classmethod
    def beside(cls, other: "Hierarchical", make_inner: Callable[[Backend], Strategy]) -> "Hierarchical":
        """Another inner strategy over `other`'s nodes and sub-groups (no new groups: creating
        them is a collective that costs round trips on a slow network)."""
        self = cls.__new__(cls)
        self.node, self.local, self.ranks_per_node = other.node, other.local, other.ranks_per_node
        self.intra, self.inter, self.node_ranks = other.intra, other.inter, other.node_ranks
        self.inner = make_inner(self.inter)
        Strategy.__init__(self, other.backend, self.inner.compressor, error_feedback=False)
        return self

    def set_compressor(self, c: Compressor) -> None:
        super().set_compressor(c)
        self.inner.set_compressor(c)

    def take_leftover(self, x: torch.Tensor, key: int | str, shapes: list[torch.Size] | None = None,
                      keys: list[str] | None = None) -> torch.Tensor | None:
        """The inner strategy's stored error for this rank's chunk, at the chunk's place in the
        bucket (zeros elsewhere). It is kept in units of the node's sum, which every rank's
        gradient enters once: added to this rank's next gradient it is counted exactly once."""
        a, b, part_shapes, part_keys = node_chunks(x.numel(), self.intra.world_size, shapes, keys, key)[self.local]
        if a == b:
            return None
        e = self.inner.take_leftover(x[a:b], self._chunk_key(x, key, shapes, keys), part_shapes, part_keys)
        if e is None:
            return None
        out = torch.zeros_like(x)
        out[a:b].copy_(e)
        return out

    def _chunk_key(self, x: torch.Tensor, key: int | str, shapes: list[torch.Size] | None,
                   keys: list[str] | None) -> str:
        """The key this rank's chunk is exchanged under between nodes: the bucket's segments and the chunk."""
        names = "|".join(s.key for s in segments_of(x, key, shapes, keys))
        return f"{zlib.crc32(names.encode()):08x}/{self.local}"

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        t0 = time.perf_counter()
        size, local = self.intra.world_size, self.local
        layout = node_chunks(x.numel(), size, shapes, keys, key)
        chunks = [x[a:b] for a, b, _, _ in layout]
        mine = chunks[local].numel()
        acc = accumulation_dtype(x.dtype)
        # A malformed share or chunk is remembered, not raised at once: this rank still takes part
        # in every collective of the bucket, and all ranks agree on failure at the end.
        error: WireFormatError | None = None
        try:  # 1: the node's parts of chunk `local`, exactly as long as this rank's layout says
            received = self.intra.alltoall(chunks, recv_counts=[mine] * size).wait()
        except WireFormatError as e:
            error, received = self._in_node(e), [x.new_zeros(mine)] * size
        part = torch.zeros(mine, dtype=acc, device=x.device)
        for r in received:  # local-rank order: the same sum on every node's local rank j
            part.add_(r)
        part = part.to(x.dtype)
        t1 = time.perf_counter()
        # 2: between nodes, under a key naming the bucket's segments and the chunk
        chunk_key = self._chunk_key(x, key, shapes, keys)
        _, _, part_shapes, part_keys = layout[local]
        summed = part
        if part.numel():  # (more local ranks than rows: this chunk is empty on every node)
            try:
                summed = self.inner.exchange(part, chunk_key, replace(ctx, key=chunk_key), average=False,
                                             shapes=part_shapes, keys=part_keys).wait()
            except WireFormatError as e:  # (the inner strategy names its peer by node)
                error, summed = error or WireFormatError(f"hierarchical, between nodes: {e}"), part
        if average:
            summed.div_(self.backend.world_size)
        t2 = time.perf_counter()
        item = x.element_size()
        intra_sent = (x.numel() - mine + (summed.numel() if size > 1 else 0)) * item
        intra_received = sum(r.numel() for j, r in enumerate(received) if j != local) * item
        lengths = [c.numel() for c in chunks]

        def finish() -> torch.Tensor:  # 3: every chunk on every rank, each as long as the layout says
            nonlocal error
            parts: list[torch.Tensor] = []
            try:
                parts = self.intra.allgatherv(summed, max_numel=max(lengths)).wait()
                for j, (got, want) in enumerate(zip(parts, lengths)):
                    if got.numel() != want:
                        raise WireFormatError(f"hierarchical: local rank {j} sent a chunk of {got.numel()} elements, "
                                              f"the bucket's layout has {want}", peer=j)
            except WireFormatError as e:
                error = error or self._in_node(e)
            agree(self.backend, error, "hierarchical", device=self.backend_device(x))
            out = torch.cat(parts)
            got = intra_received + (out.numel() - summed.numel()) * item
            inner = self.inner.take_stats()
            mine_stats = ExchangeStats(intra_sent, got, x.numel() * item,
                                       exchange_s=(t1 - t0) + (time.perf_counter() - t2),
                                       buckets={str(key): self.name}, intra_bytes_sent=intra_sent,
                                       intra_bytes_received=got)
            self.stats = self.stats.merge(inner).merge(mine_stats)
            self.stats.dense_bytes -= inner.dense_bytes  # the bucket counts once
            return out

        return Work(wait=finish)

    def wire_seconds(self, links: Links, work: Workload, world: int) -> float | None:
        """Dense inside a node (an all-to-all out, an allgather back); between nodes only a
        node's share crosses the slow links, priced by the inner strategy on `links.inter`.
        None without both link models, or when the inner strategy cannot tell."""
        if links.intra is None or links.inter is None:
            return None
        g = self.intra.world_size
        inner = self.inner.wire_seconds(Links(links.inter), self._chunk_of(work), world // g)
        if inner is None:
            return None
        dense = work.dense_bytes // work.share
        return links.intra.alltoall(dense * (g - 1) // g, g) + links.intra.allgather(dense // g, g) + inner

    def compute_seconds(self, work: Workload, world: int) -> float:
        g = self.intra.world_size
        return self.inner.compute_seconds(self._chunk_of(work), world // g)

    def _chunk_of(self, work: Workload) -> Workload:
        """What a rank exchanges between nodes: its 1/G chunk of the node's sum."""
        return replace(work, share=work.share * self.intra.world_size)

    def _in_node(self, e: WireFormatError) -> WireFormatError:
        """An error of the node's group, its peer named by global rank."""
        peer = self.node_ranks[e.peer] if e.peer is not None and 0 <= e.peer < len(self.node_ranks) else None
        return WireFormatError(f"hierarchical, inside node {self.node} (local ranks): {e}", peer=peer)

    def backend_device(self, x: torch.Tensor) -> torch.device:
        """Where the agreement's flags live: the backend's small-exchange device, else x's."""
        return getattr(self.backend, "small_device", x.device)

    def state_dict(self) -> dict[str, Any]:
        return {"inner": self.inner.state_dict()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.inner.load_state_dict(state["inner"])
