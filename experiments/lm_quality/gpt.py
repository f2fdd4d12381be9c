"""A small GPT trained the way people write GPT scripts, with gradwire added after the DDP line.

What a user's script does and gradwire must not break: AdamW with weight-decay groups (matrices
decay, biases, norms and embeddings do not), a linear warm-up then cosine learning rate,
`clip_grad_norm_(1.0)`, gradient accumulation with `no_sync`, and a held-out evaluation. The data is
Python's own documentation text (`pydoc_data.topics`, byte-level, as gradwire's charlm task), so
the script runs offline. Every method sees the same batches on the same ranks.

    python experiments/lm_quality/gpt.py --world 2 --method none
    python experiments/lm_quality/gpt.py --world 2 --method "topk:ratio=0.25+sign@allgather"
    python experiments/lm_quality/gpt.py --world 2 --method "powersgd:rank=8" --hook start_iter=40

`--method dense` runs plain DDP (no hook). One JSON line per run goes to `--out`: val loss,
perplexity, bytes this rank sent and the dense bytes it stands for.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn as nn
import torch.nn.functional as F

CONTEXT = 64


def corpus() -> torch.Tensor:
    from pydoc_data import topics

    text = "\n".join(topics.topics[k] for k in sorted(topics.topics)).encode("utf-8")
    return torch.frombuffer(bytearray(text), dtype=torch.uint8).long()


class Block(nn.Module):
    def __init__(self, width: int, heads: int) -> None:
        super().__init__()
        self.ln1, self.ln2 = nn.LayerNorm(width), nn.LayerNorm(width)
        self.qkv = nn.Linear(width, 3 * width)
        self.proj = nn.Linear(width, width)
        self.mlp = nn.Sequential(nn.Linear(width, 4 * width), nn.GELU(), nn.Linear(4 * width, width))
        self.heads = heads

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(self.ln1(x)).view(b, t, 3, self.heads, c // self.heads).permute(2, 0, 3, 1, 4)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.proj(y.transpose(1, 2).reshape(b, t, c))
        return x + self.mlp(self.ln2(x))


class GPT(nn.Module):
    def __init__(self, vocab: int = 256, width: int = 128, layers: int = 4, heads: int = 4) -> None:
        super().__init__()
        self.tok = nn.Embedding(vocab, width)
        self.pos = nn.Embedding(CONTEXT, width)
        self.blocks = nn.ModuleList(Block(width, heads) for _ in range(layers))
        self.ln = nn.LayerNorm(width)
        self.head = nn.Linear(width, vocab, bias=False)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        x = self.tok(idx) + self.pos(torch.arange(idx.shape[1]))
        for block in self.blocks:
            x = block(x)
        return self.head(self.ln(x))


def weight_decay_groups(model: nn.Module, weight_decay: float) -> list[dict]:
    """nanoGPT's rule: every matrix decays (linear weights), vectors (biases, norms) and embeddings do not."""
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and "tok" not in n and "pos" not in n]
    rest = [p for n, p in model.named_parameters() if not (p.dim() >= 2 and "tok" not in n and "pos" not in n)]
    return [{"params": decay, "weight_decay": weight_decay}, {"params": rest, "weight_decay": 0.0}]


def lr_factor(it: int, iters: int, warmup: int) -> float:
    if it < warmup:
        return (it + 1) / warmup
    progress = (it - warmup) / max(1, iters - warmup)
    return 0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * progress))


def hook_options(pairs: list[str]) -> dict:
    out: dict = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        try:
            out[key] = json.loads(value)
        except json.JSONDecodeError:
            out[key] = value
    return out


def run(rank: int, a: argparse.Namespace, port: int) -> None:
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    dist.init_process_group("gloo", rank=rank, world_size=a.world)
    data = corpus()
    split = int(0.9 * len(data))
    train, val = data[:split], data[split:]
    torch.manual_seed(a.seed)
    model = GPT(layers=a.layers, width=a.width)
    ddp = torch.nn.parallel.DistributedDataParallel(model)
    state = None
    opt = torch.optim.AdamW(weight_decay_groups(model, a.weight_decay), lr=a.lr, betas=(0.9, 0.95))
    clip = a.clip
    if a.method != "dense":
        import gradwire.hooks.ddp
        from gradwire.hooks.precondition import adam_spec, sgd_like

        options = hook_options(a.hook)
        if options.get("precondition") in ("adam", "global_adam"):  # the README's recipe, from the user's AdamW
            options["precondition"] = adam_spec(opt, clip=a.clip or None, shared=options["precondition"] == "global_adam")
            opt, clip = sgd_like(opt), 0.0  # the hook clips each rank's true gradient before Adam
        state = gradwire.hooks.ddp.register(ddp, a.method, **options)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: lr_factor(it, a.iters, a.warmup_iters))
    gen = torch.Generator().manual_seed(1000 * a.seed + rank)  # rank r's batches, the same for every method
    sent = dense = 0
    t0 = time.time()
    for it in range(a.iters):
        for micro in range(a.accum):
            starts = torch.randint(0, len(train) - CONTEXT - 1, (a.batch,), generator=gen)
            x = torch.stack([train[s:s + CONTEXT] for s in starts.tolist()])
            y = torch.stack([train[s + 1:s + CONTEXT + 1] for s in starts.tolist()])
            last = micro == a.accum - 1
            with (ddp.no_sync() if not last else torch.enable_grad()):
                logits = ddp(x)
                loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)) / a.accum
                loss.backward()
        if clip:
            torch.nn.utils.clip_grad_norm_(model.parameters(), clip)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        params_bytes = 4 * sum(p.numel() for p in model.parameters())
        dense += params_bytes
        if state is not None and state.last_stats is not None and state.last_stats.get("step") == it:
            sent += state.last_stats["bytes_sent"]
        else:
            sent += params_bytes
    val_loss = evaluate(model, val, a.seed)
    if rank == 0:
        rec = {"world": a.world, "method": a.method, "hook": a.hook, "iters": a.iters, "lr": a.lr, "clip": a.clip,
               "accum": a.accum, "batch": a.batch, "seed": a.seed, "tag": a.tag, "val_loss": val_loss,
               "perplexity": math.exp(val_loss), "bytes_sent": sent, "dense_bytes": dense, "fewer": dense / sent,
               "params": sum(p.numel() for p in model.parameters()), "secs": time.time() - t0}
        print(json.dumps(rec), flush=True)
        with open(a.out, "a") as f:
            f.write(json.dumps(rec) + "\n")
    dist.destroy_process_group()


@torch.no_grad()
def evaluate(model: nn.Module, val: torch.Tensor, seed: int, batches: int = 20, batch: int = 64) -> float:
    gen = torch.Generator().manual_seed(seed + 12345)
    model.eval()
    total = 0.0
    for _ in range(batches):
        starts = torch.randint(0, len(val) - CONTEXT - 1, (batch,), generator=gen).tolist()
        x = torch.stack([val[s:s + CONTEXT] for s in starts])
        y = torch.stack([val[s + 1:s + CONTEXT + 1] for s in starts])
        total += F.cross_entropy(model(x).reshape(-1, 256), y.reshape(-1)).item()
    model.train()
    return total / batches


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--method", default="dense", help="dense (no hook), or a gradwire method string")
    ap.add_argument("--hook", nargs="*", default=[], help="register options as key=value (JSON values)")
    ap.add_argument("--iters", type=int, default=600)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--batch", type=int, default=16, help="sequences per micro-batch per rank")
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--warmup-iters", type=int, default=30)
    ap.add_argument("--weight-decay", type=float, default=0.1)
    ap.add_argument("--clip", type=float, default=1.0)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--port", type=int, default=29611)
    ap.add_argument("--tag", default="")
    ap.add_argument("--out", default="experiments/lm_quality/gpt-results.jsonl")
    a = ap.parse_args()
    mp.start_processes(run, args=(a, a.port), nprocs=a.world, start_method="spawn")


if __name__ == "__main__":
    sys.exit(main())
