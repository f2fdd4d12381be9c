"""One rank of one training run: DDP (or FSDP2 with `engine="fsdp"`) over gloo with the gradwire
hook, measured step by step.

Started by `gradwire.experiments.launch` as `python -m gradwire.experiments.worker RUN_DIR RANK MASTER_ADDR PORT`
(inside a network namespace when the cluster is emulated). Rank 0 writes `steps.jsonl`
(one record per step and one per evaluation) and `summary.json`; every rank's byte totals
are gathered into the summary at the end.
"""

from __future__ import annotations

import copy
import json
import logging
import math
import os
import statistics
import sys
import time
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F

import gradwire.hooks.ddp
from ..comm.torch_dist import TorchDistBackend
from ..outer import DiLoCo
from .config import RunConfig
from .tasks import Dataset, Task, digest, get_task


def evaluate(model: torch.nn.Module, task: Task, ds: Dataset, batch: int = 1000) -> dict[str, float]:
    """Held-out metrics: accuracy (next-byte accuracy for the LM), mean loss, and perplexity for the LM."""
    model.eval()
    correct = total = 0
    loss_sum = 0.0
    with torch.no_grad():
        for i in range(0, len(ds.x_test), batch):
            x, y = ds.x_test[i:i + batch], ds.y_test[i:i + batch]
            logits = model(x)
            if task.metric == "perplexity":
                logits, y = logits.reshape(-1, logits.shape[-1]), y.reshape(-1)
            loss_sum += F.cross_entropy(logits, y, reduction="sum").item()
            correct += int((logits.argmax(-1) == y).sum())
            total += y.numel()
    model.train()
    out = {"accuracy": 100.0 * correct / max(total, 1), "test_loss": loss_sum / max(total, 1)}
    if task.metric == "perplexity":
        out["perplexity"] = math.exp(min(out["test_loss"], 50.0))
    return out


def make_optimizer(task: Task, model: torch.nn.Module, lr: float, preconditioned: bool = False) -> torch.optim.Optimizer:
    """The task's optimizer; plain SGD when the hook already applies Adam (`precondition`)."""
    if preconditioned:
        return torch.optim.SGD(model.parameters(), lr=lr)
    if task.optimizer == "adam":
        return torch.optim.Adam(model.parameters(), lr=lr)
    return torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)


def batches(n: int, global_batch: int, rank: int, world: int, seed: int):
    """Per-rank index batches: a shared seeded permutation per epoch, each rank its stride of it."""
    epoch = 0
    while True:
        g = torch.Generator().manual_seed(seed * 1_000_003 + epoch)
        perm = torch.randperm(n, generator=g)
        for start in range(0, n - global_batch + 1, global_batch):
            yield perm[start + rank:start + global_batch:world]
        epoch += 1


def loss_of(task: Task, logits: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    if task.metric == "perplexity":
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1))
    return F.cross_entropy(logits, y)


def reference_compute(model: torch.nn.Module, task: Task, ds: Dataset, loader, repeats: int = 10) -> float:
    """Median seconds of forward + backward on the bare module (no DDP, no communication), run
    by every rank at once so CPU sharing matches training: the compute term of the projection."""
    model = copy.deepcopy(model)  # fresh parameters: DDP's autograd hooks stay out of it
    times = []
    for _ in range(repeats):
        idx = next(loader)
        t0 = time.perf_counter()
        model.zero_grad(set_to_none=True)
        loss_of(task, model(ds.x[idx]), ds.y[idx]).backward()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def shard(model: torch.nn.Module, mesh: Any = None) -> torch.nn.Module:
    """FSDP2 on every child with parameters (the elements of a ModuleList, which has no forward), then the root;
    over `mesh` (HSDP: the shard dimension of a node) when given."""
    from torch.distributed.fsdp import fully_shard

    for child in model.children():
        parts = list(child) if isinstance(child, torch.nn.ModuleList) else [child]
        for part in parts:
            if any(p.requires_grad for p in part.parameters()):
                fully_shard(part, mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model


def link_tx_bytes() -> int | None:
    """Bytes this rank's node has sent out of its network interface so far (`GLOO_SOCKET_IFNAME`
    in the emulated cluster: the node's one link to the switch, so exactly its inter-node traffic
    with TCP/IP headers), or None on loopback."""
    iface = os.environ.get("GLOO_SOCKET_IFNAME", "lo")
    if iface == "lo":
        return None
    try:
        return int(Path(f"/sys/class/net/{iface}/statistics/tx_bytes").read_text())
    except (OSError, ValueError):
        return None


class _OuterStats:
    """A DiLoCo replica's bytes per step, read like the DDP state's `last_stats`: the syncs that
    completed in the step (none on most steps), summed."""

    def __init__(self, outer: DiLoCo) -> None:
        self.outer = outer
        self.seen = 0

    @property
    def last_stats(self) -> dict[str, Any]:
        new, self.seen = self.outer.stats[self.seen:], len(self.outer.stats)
        if not new:
            return {}
        # exposed communication (launch + wait) counts as exchange time, so compute_s is what is left
        return {"bytes_sent": sum(s["bytes_sent"] for s in new), "dense_bytes": sum(s["dense_bytes"] for s in new),
                "exchange_s": sum(s["launch_s"] + s["wait_s"] for s in new)}

    def global_model(self) -> torch.nn.Module:
        """The weights of the last sync, as DiLoCo evaluates (a copy: the replica trains on)."""
        model = copy.deepcopy(self.outer.model)
        with torch.no_grad():
            for p, g in zip((p for p in model.parameters() if p.requires_grad), self.outer.globals):
                p.copy_(g)
        return model


class _NodeReplicaStats(_OuterStats):
    """A node as one DiLoCo replica: its ranks' DDP all-reduce every step (inside the node) and the
    syncs between nodes, read as one `last_stats`."""

    def __init__(self, outer: DiLoCo, inner: Any) -> None:
        super().__init__(outer)
        self.inner = inner

    @property
    def last_stats(self) -> dict[str, Any]:
        between, inside = super().last_stats, self.inner.last_stats or {}
        return {"bytes_sent": between.get("bytes_sent", 0) + inside.get("bytes_sent", 0),
                "intra_bytes_sent": inside.get("bytes_sent", 0),
                "dense_bytes": between.get("dense_bytes", 0) + inside.get("dense_bytes", 0),
                "exchange_s": between.get("exchange_s", 0.0) + inside.get("encode_s", 0.0)
                + inside.get("exchange_s", 0.0) + inside.get("decode_s", 0.0)}


class _TorchftStats:
    """torchft's DiLoCo (the outside reference) read like `_OuterStats`: the syncs it issued in the
    step; built once the inner optimizer exists (torchft hooks its step)."""

    def __init__(self, method: Any, rank: int, world: int, addr: str) -> None:
        self.method, self.rank, self.world, self.addr = method, rank, world, addr
        self.anchor: Any = None
        self.seen = 0

    def start(self, model: torch.nn.Module, opt: torch.optim.Optimizer) -> None:
        from .torchft_anchor import TorchftDiLoCo

        self.anchor = TorchftDiLoCo(model, opt, rank=self.rank, world=self.world, host=own_address(self.addr),
                                    **self.method.outer)
        self.anchor.__enter__()

    def close(self) -> None:
        self.anchor.__exit__(None, None, None)
        self.anchor.close()

    @property
    def last_stats(self) -> dict[str, Any]:
        new, self.seen = self.anchor.stats[self.seen:], len(self.anchor.stats)
        return {"bytes_sent": sum(s["bytes_sent"] for s in new), "dense_bytes": sum(s["dense_bytes"] for s in new)} \
            if new else {}

    def global_model(self) -> torch.nn.Module:
        return self.anchor.global_model()


def own_address(peer: str) -> str:
    """This process's IP address on the route to `peer` (its namespace's link in the emulated
    cluster, loopback otherwise): where torchft's servers bind so the other replicas reach them."""
    import socket

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((peer, 9))  # (UDP: no packet is sent)
        return str(s.getsockname()[0])


class _FSDPStats:
    """The DDP state's `last_stats`, read from the FSDP hook's per-step totals."""

    def __init__(self, state: Any) -> None:
        self.state = state

    @property
    def last_stats(self) -> dict[str, Any]:
        return self.state.take_stats().as_dict()


def train(cfg: RunConfig, run_dir: Path, rank: int, world: int, addr: str = "127.0.0.1") -> dict[str, Any] | None:
    task = get_task(cfg.task)
    cache = Path(os.environ.get("GRADWIRE_DATA_CACHE", Path.home() / ".cache" / "gradwire" / "data"))
    ds = task.load(Path(cfg.data_dir) if cfg.data_dir else None, cache)
    torch.manual_seed(cfg.seed)
    model = task.model(cfg.arch, cfg.width)
    method = cfg.resolved()
    state: Any
    if cfg.engine == "fsdp":
        bare = copy.deepcopy(model)  # for the reference compute time, without FSDP's hooks
        from gradwire.hooks import fsdp as fsdp_hook  # needs FSDP2; DDP runs do not import it
        ddp = model = shard(model)
        state = _FSDPStats(fsdp_hook.register(model, method.compressor, error_feedback=method.error_feedback,
                                              seed=cfg.seed, min_numel=method.options.get("min_numel", 0)))
    elif cfg.engine == "hsdp":  # shard inside a node (dense reduce-scatter), compressed all-reduce across nodes
        bare = copy.deepcopy(model)
        from torch.distributed.device_mesh import init_device_mesh

        from gradwire.hooks import fsdp as fsdp_hook

        mesh = init_device_mesh("cpu", (world // cfg.ranks_per_node, cfg.ranks_per_node),
                                mesh_dim_names=("replicate", "shard"))
        ddp = model = shard(model, mesh["shard"])
        strategy = None if method.strategy in ("dense", "allreduce", "allgather") else method.strategy
        compressor = method.compressor if method.strategy != "dense" else "none"
        state = _FSDPStats(fsdp_hook.register(model, compressor, strategy=strategy,
                                              replicate_group=mesh["replicate"].get_group(),
                                              error_feedback=method.error_feedback, seed=cfg.seed,
                                              **method.options))
    elif method.strategy == "torchft":  # torchft's DiLoCo: started below, once the optimizer exists
        ddp = model
        state = _TorchftStats(method, rank, world, addr)
    elif method.outer and method.replica == "node":  # DDP inside each node, DiLoCo between the nodes
        from torch.distributed.device_mesh import init_device_mesh

        mesh = init_device_mesh("cpu", (world // cfg.ranks_per_node, cfg.ranks_per_node),
                                mesh_dim_names=("replicate", "node"))
        ddp = torch.nn.parallel.DistributedDataParallel(model, process_group=mesh["node"].get_group(),
                                                        broadcast_buffers=False)
        inside = gradwire.hooks.ddp.register(ddp, "none", strategy="dense")  # (counts the bytes)
        state = _NodeReplicaStats(DiLoCo(model, compressor=method.compressor, strategy=method.strategy,
                                         backend=TorchDistBackend(mesh["replicate"].get_group()),
                                         error_feedback=method.error_feedback, seed=cfg.seed, **method.outer),
                                  inside)
    elif method.outer:  # DiLoCo: every rank a replica training alone, syncing every H steps
        ddp = model
        state = _OuterStats(DiLoCo(model, compressor=method.compressor, strategy=method.strategy,
                                   error_feedback=method.error_feedback, seed=cfg.seed, **method.outer))
    else:
        # own BatchNorm statistics per rank: buffer broadcasts would be traffic the hook does not count
        ddp = torch.nn.parallel.DistributedDataParallel(model, broadcast_buffers=False)
        state = gradwire.hooks.ddp.register(ddp, method.compressor, strategy=method.strategy,
                                            error_feedback=method.error_feedback, seed=cfg.seed,
                                            **cfg.hook_options(), **method.options)
    opt = make_optimizer(task, ddp, cfg.lr, "precondition" in cfg.hook_options())
    if isinstance(state, _TorchftStats):
        state.start(model, opt)
    # cosine decay to zero over the run: final accuracies settle instead of riding the noise of a constant lr
    schedule = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 0.5 * (1 + math.cos(math.pi * min(s, cfg.steps) / cfg.steps)))
    records = open(run_dir / "steps.jsonl", "w") if rank == 0 else None
    params = sum(p.numel() for p in model.parameters())
    totals = {"bytes_sent": 0, "bytes_received": 0, "dense_bytes": 0, "intra_bytes_sent": 0}
    wall = 0.0
    step_times: list[float] = []
    loader = batches(len(ds.x), cfg.batch * world, rank, world, cfg.seed)

    def log(record: dict[str, Any]) -> None:
        if records is not None:
            records.write(json.dumps(record) + "\n")
            records.flush()

    def epochs(step: int) -> float:  # training samples seen (all ranks) / training set size
        return step * cfg.batch * world / len(ds.x)

    def log_eval(step: int) -> dict[str, float]:
        # FSDP's forward all-gathers parameters: every rank evaluates, rank 0 records
        evaluated = state.global_model() if isinstance(state, (_OuterStats, _TorchftStats)) else model
        metrics = evaluate(evaluated, task, ds) if rank == 0 or cfg.engine != "ddp" else {}
        log({"type": "eval", "step": step, "epoch": epochs(step), "wall_s": wall,
             "cum_bytes_sent": totals["bytes_sent"], **metrics})
        return metrics

    dist.barrier()
    metrics = log_eval(0)
    tx_start = link_tx_bytes()
    for step in range(1, cfg.steps + 1):
        idx = next(loader)
        x, y = ds.x[idx], ds.y[idx]
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss = loss_of(task, ddp(x), y)
        loss.backward()
        opt.step()
        schedule.step()
        if isinstance(state, _OuterStats):
            state.outer.step()
        step_s = time.perf_counter() - t0
        wall += step_s
        step_times.append(step_s)
        stats = state.last_stats or {}
        for k in totals:
            totals[k] += int(stats.get(k, 0))
        comm = stats.get("encode_s", 0.0) + stats.get("exchange_s", 0.0) + stats.get("decode_s", 0.0)
        log({"type": "step", "step": step, "epoch": epochs(step), "loss": float(loss), "step_s": step_s,
             "compute_s": max(step_s - comm, 0.0), "encode_s": stats.get("encode_s", 0.0),
             "exchange_s": stats.get("exchange_s", 0.0), "decode_s": stats.get("decode_s", 0.0),
             "collectives": len(stats.get("buckets", {})),
             "bytes_sent": int(stats.get("bytes_sent", 0)), "bytes_received": int(stats.get("bytes_received", 0)),
             "intra_bytes_sent": int(stats.get("intra_bytes_sent", 0)),  # of bytes_sent: inside the node
             "dense_bytes": int(stats.get("dense_bytes", 0)), "cum_bytes_sent": totals["bytes_sent"], "wall_s": wall})
        if not math.isfinite(float(loss)):
            raise FloatingPointError(f"rank {rank}: loss became {float(loss)} at step {step}")
        if isinstance(state, _OuterStats) and step == cfg.steps:
            state.outer.finish()  # (a streamed fragment still in flight lands before the last evaluation)
        if step % cfg.eval_every == 0 or step == cfg.steps:
            metrics = log_eval(step)
    if isinstance(state, _TorchftStats):
        state.close()
    dist.barrier()  # every rank of every node is done sending: the link counters cover all training steps
    tx_end = link_tx_bytes()
    if tx_start is not None and tx_end is not None and rank % cfg.ranks_per_node == 0:
        totals["node_link_tx_bytes"] = tx_end - tx_start  # the node's first rank reports its node
    compute_ref = reference_compute(bare if cfg.engine != "ddp" else model, task, ds, loader)
    per_rank = _gather_totals(totals)
    if records is not None:
        records.close()
    if rank != 0:
        return None
    steady = step_times[len(step_times) // 5:] or [0.0]  # skip warm-up (first 20%)
    method_record = vars(cfg.resolved())
    if cfg.engine == "fsdp":  # the FSDP hook has one exchange: torch's reduce-scatter for dense, else alltoall
        method_record = dict(method_record, strategy="reduce_scatter" if method.compressor == "none" else "alltoall")
    elif cfg.engine == "hsdp":  # counted: the cross-node all-reduce (the reduce-scatter in a node is FSDP's own)
        method_record = dict(method_record, strategy=f"hsdp-{method.strategy}")
    summary = {"run_id": cfg.run_id, "config": cfg.to_dict(), "method": method_record,
               "params": params, "data": digest(ds), "final": metrics,
               "bytes_sent_per_rank": [r["bytes_sent"] for r in per_rank],
               "bytes_received_per_rank": [r["bytes_received"] for r in per_rank],
               "dense_bytes_per_rank": [r["dense_bytes"] for r in per_rank],
               "intra_bytes_sent_per_rank": [r["intra_bytes_sent"] for r in per_rank],
               "bytes_sent": per_rank[0]["bytes_sent"], "dense_bytes": per_rank[0]["dense_bytes"],
               "train_s": wall, "median_step_s": statistics.median(steady), "compute_ref_s": compute_ref,
               "steps": cfg.steps, "torch": torch.__version__}
    strategy = getattr(state, "_strategy", None)
    choice = getattr(strategy, "choice", None)
    if choice is not None:  # what `auto` chose (its cost model and trial times are in the rank logs)
        summary["auto_choice"] = choice
        if getattr(strategy, "choices", None):
            summary["auto_choices"] = dict(strategy.choices)  # per bucket
    # the share of wall time spent computing: per step, the reference forward + backward over the step;
    # an outer loop, every moment not spent launching or waiting on a sync (its inner steps are local)
    summary["compute_utilization"] = min(1.0, compute_ref * cfg.steps / wall) if wall > 0 else 0.0
    if isinstance(state, _OuterStats):
        exposed = sum(s["launch_s"] + s["wait_s"] for s in state.outer.stats)
        # (with replica=node the DDP all-reduce inside the node counts as compute: the fast link of a datacenter)
        summary["compute_utilization"] = max(0.0, 1.0 - exposed / wall) if wall > 0 else 0.0
        summary["exposed_comm_s"] = exposed
        # apart: the training thread's work at launch (the pseudo-gradient; the encode too unless
        # the exchange runs on DiLoCo's own thread) and its waits for exchanges to land
        summary["exposed_launch_s"] = sum(s["launch_s"] for s in state.outer.stats)
        summary["exposed_wait_s"] = sum(s["wait_s"] for s in state.outer.stats)
        summary["syncs"] = len(state.outer.stats)
        summary["peak_bytes_in_flight"] = state.outer.peak_bytes_in_flight()
    elif isinstance(state, _TorchftStats):  # (its exchanges are not timed: per-step utilization as above)
        summary["syncs"] = len(state.anchor.stats)
        summary["peak_bytes_in_flight"] = max((s["bytes_sent"] for s in state.anchor.stats), default=0)
    links = [r["node_link_tx_bytes"] for r in per_rank if "node_link_tx_bytes" in r]
    if links:  # measured on the emulated cluster's links: what really crossed between nodes
        summary["inter_node_wire_bytes_per_rank"] = sum(links) / world
    return summary


def main(argv: list[str]) -> int:
    run_dir, rank, addr, port = Path(argv[0]), int(argv[1]), argv[2], int(argv[3])
    cfg = RunConfig(**json.loads((run_dir / "config.json").read_text()))
    torch.set_num_threads(1)
    logging.basicConfig(level=logging.WARNING, format="%(name)s: %(message)s")
    logging.getLogger("gradwire").setLevel(logging.INFO)  # auto's measurements and choice, in rank<N>.log
    dist.init_process_group("gloo", init_method=f"tcp://{addr}:{port}", rank=rank, world_size=cfg.world,
                            timeout=timedelta(seconds=float(os.environ.get("GRADWIRE_EXPERIMENT_TIMEOUT", "300"))))
    try:
        summary = train(cfg, run_dir, rank, cfg.world, addr)
        if summary is not None:
            tmp = run_dir / "summary.json.tmp"
            tmp.write_text(json.dumps(summary, indent=1))
            tmp.replace(run_dir / "summary.json")  # its presence marks the run finished
        dist.barrier()  # every rank's work is done and recorded
        (run_dir / f"rank{rank}.done").touch()  # what follows is teardown (see launch.finished_ranks)
    finally:
        dist.destroy_process_group()
    return 0


_TOTALS = ("bytes_sent", "bytes_received", "dense_bytes", "intra_bytes_sent", "node_link_tx_bytes")


def _gather_totals(totals: dict[str, int]) -> list[dict[str, int]]:
    """Every rank's byte totals, as fixed-layout int64s (nothing unpickled; -1: a key not set)."""
    rows = TorchDistBackend().allgather_ints([int(totals.get(k, -1)) for k in _TOTALS])
    return [{k: v for k, v in zip(_TOTALS, row) if v >= 0 or k != "node_link_tx_bytes"} for row in rows]


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))

