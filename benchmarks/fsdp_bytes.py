"""Bytes per rank per step of the FSDP2 hook: compressed reduce-scatter (FSDP) and compressed
cross-replica all-reduce (HSDP 2x2), for a stack of transformer layers on N gloo ranks.

    python benchmarks/fsdp_bytes.py --layers 4 --width 512 --steps 3 [--json out.json]

Each layer and the root get `fully_shard`; every rank trains on its own random batch. Reported per
configuration: the median over `--steps` steps (after one warm-up step) of the bytes rank 0 sent
through gradwire, and of its exchange seconds (encode + exchange + decode). Reduce-scatter bytes are
what leaves the rank in the all-to-all (for dense, a ring reduce-scatter's (P-1)/P share); HSDP's
are the bytes handed to the cross-replica collective (allreduce payload, or one allgather packet).
FSDP's parameter all-gathers are not gradwire's and are not counted. Not a test.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch
from torch import nn

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", "support"))
from multiproc import run_ranks  # noqa: E402

FLAT = [("dense", "none", {}), ("int8", "int8", {}), ("fp8", "fp8", {}), ("topk 1%", "topk:ratio=0.01", {})]
HSDP = [("dense", "none", {}), ("int8", "int8", {}), ("topk 1%", "topk:ratio=0.01", {}),
        ("powersgd rank 4", "none", {"strategy": "powersgd", "rank": 4})]


def _model(layers: int, width: int, mesh=None) -> nn.Module:
    from torch.distributed.fsdp import fully_shard

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.TransformerEncoderLayer(width, nhead=8, dim_feedforward=4 * width, dropout=0.0,
                                                       batch_first=True) for _ in range(layers)])
    kw = {} if mesh is None else {"mesh": mesh}
    for layer in model:
        fully_shard(layer, **kw)
    fully_shard(model, **kw)
    return model


def _rank(rank: int, world: int, layers: int, width: int, steps: int, hsdp: bool) -> list[dict]:
    from gradwire.hooks import fsdp as gw

    mesh = group = None
    if hsdp:
        from torch.distributed.device_mesh import init_device_mesh

        full = init_device_mesh("cpu", (2, world // 2), mesh_dim_names=("replicate", "shard"))
        mesh, group = full["shard"], full["replicate"].get_group()
    x = torch.randn(4, 16, width, generator=torch.Generator().manual_seed(rank))
    out = []
    for label, spec, opts in (HSDP if hsdp else FLAT):
        model = _model(layers, width, mesh)
        params = sum(p.numel() for p in model.parameters())
        state = gw.register(model, spec, **({"replicate_group": group} if hsdp else {}), **opts)
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        sent, secs, dense = [], [], []
        for step in range(steps + 1):
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            s = state.take_stats()
            if step:
                sent.append(s.bytes_sent)
                secs.append(s.encode_s + s.exchange_s + s.decode_s)
                dense.append(s.dense_bytes)
        out.append({"label": label, "params": params, "bytes": statistics.median(sent),
                    "dense_bytes": statistics.median(dense), "seconds": statistics.median(secs)})
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=512)
    ap.add_argument("--steps", type=int, default=3)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    results = {}
    for name, world, hsdp in (("FSDP, 2 ranks", 2, False), ("FSDP, 4 ranks", 4, False), ("HSDP 2x2", 4, True)):
        results[name] = run_ranks(_rank, world, args.layers, args.width, args.steps, hsdp, timeout=1800)[0]
    print(f"{results['FSDP, 2 ranks'][0]['params']:,} parameters")
    print("| setup | method | MB sent/rank/step | fewer than dense | exchange s/step |")
    print("|---|---|---|---|---|")
    for name, rows in results.items():
        base = rows[0]["bytes"]
        for r in rows:
            print(f"| {name} | {r['label']} | {r['bytes'] / 1e6:.3f} | {base / r['bytes']:.1f}x | {r['seconds']:.3f} |")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
