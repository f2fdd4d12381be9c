"""Single-process emulation of W data-parallel ranks on gradwire's charlm task (issue 29 study).

One model copy; each step computes the W ranks' gradients one after another (the same per-rank
batches as gradwire/experiments/worker.py: `batches(n, 16*W, rank, W, seed)`), then applies a method:

  dense     Adam (torch.optim.Adam, as the worker) on the rank-averaged gradient, cosine lr.
  recipe    gradwire's current recipe: per-rank local Adam moments -> direction, EF top-k on it
            (tensors < 1024 elements dense), DGC density warm-up from 25%, average, SGD lr*sqrt(W).
  sharedm   EF top-k on each rank's raw gradient, average the sparse messages, ONE shared momentum of
            the average, global v from dense warm-up (frozen, or refreshed by periodic dense steps).
  plain     EF top-k on each rank's raw gradient, average, then the user's own Adam (moments of the
            averaged sparse gradient; optimizer untouched).
  delta     shared momentum M kept dense by everyone; each rank sends EF-compressed increments
            (1-b1)*(g_i - M), the average is added to M (unsent coordinates keep their value);
            global v from dense warm-up, frozen.
  onebit    1-bit-Adam style: each rank m_i = b1*m_shared + (1-b1)*g_i, EF top-k on m_i, the average
            becomes m_shared; global v from dense warm-up, frozen (or refreshed).

Bytes per rank: dense step = 4*P; compressed step = sum over tensors (small: 4*numel, big: k*(4+vbytes)).
Usage: python experiments/lm_quality/emulate.py --method sharedm --world 2 --ratio 0.01 --warm 20
"""
from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from gradwire.experiments.tasks import get_task  # noqa: E402
from gradwire.experiments.worker import batches, evaluate  # noqa: E402
from gradwire.compress import indexcodec  # noqa: E402
from gradwire.compress.registry import compressor as make_compressor  # noqa: E402

B1, B2, EPS = 0.9, 0.999, 1e-8


def topk_(t: torch.Tensor, k: int) -> torch.Tensor:
    flat = t.reshape(-1)
    idx = flat.abs().topk(k, sorted=False).indices
    out = torch.zeros_like(flat)
    out[idx] = flat[idx]
    return out.view_as(t)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--method", required=True, choices=["dense", "recipe", "sharedm", "onebit", "plain", "delta"])
    ap.add_argument("--world", type=int, default=2)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--lr", type=float, default=3e-3)
    ap.add_argument("--ratio", type=float, default=0.01)
    ap.add_argument("--warm", type=int, default=20, help="dense Adam steps before compression (sharedm/onebit)")
    ap.add_argument("--dgc-warmup", type=int, default=0, help="density warm-up steps 25%% -> ratio")
    ap.add_argument("--vrefresh", type=int, default=0, help="every N steps a dense step refreshes v (0: frozen)")
    ap.add_argument("--vbytes", type=int, default=4, help="bytes per sent value (4 fp32, 2 fp16)")
    ap.add_argument("--min-numel", type=int, default=1024)
    ap.add_argument("--index", default="raw", choices=["raw", "packed"],
                    help="packed: count gradwire's indexcodec bytes for the actual kept indices")
    ap.add_argument("--spec", default="", help="a gradwire compressor spec applied per big tensor (overrides --ratio's top-k)")
    ap.add_argument("--no-sqrt-world", action="store_true", help="recipe: SGD at lr, not lr x sqrt(W)")
    ap.add_argument("--lr-mult", type=float, default=1.0, help="sharedm/onebit: lr multiplier after the dense warm-up")
    ap.add_argument("--comp", default="topk", choices=["topk", "sign"],
                    help="sign: 1-bit Adam's compressor, sign(acc) * mean|acc| per tensor (every tensor)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default="experiments/lm_quality/results.jsonl")
    ap.add_argument("--tag", default="")
    a = ap.parse_args()
    torch.set_num_threads(1)

    task = get_task("charlm")
    ds = task.load(None, Path.home() / ".cache" / "gradwire" / "data")
    torch.manual_seed(a.seed)
    model = task.model(task.default_arch, 0)
    params = list(model.parameters())
    P = sum(p.numel() for p in params)
    W = a.world
    loaders = [batches(len(ds.x), task.default_batch * W, r, W, a.seed) for r in range(W)]
    big = [p.numel() >= a.min_numel for p in params]
    if a.method == "recipe" and a.dgc_warmup == 0 and "--dgc-warmup" not in sys.argv:
        a.dgc_warmup = 100

    def lr_at(step: int) -> float:  # LambdaLR cosine as the worker: step s (1-based) uses factor(s-1)
        return a.lr * 0.5 * (1 + math.cos(math.pi * min(step - 1, a.steps) / a.steps))

    def density(step: int) -> float:  # DGC warm-up: exponential 25% -> ratio over dgc_warmup steps
        if a.dgc_warmup and step <= a.dgc_warmup:
            return max(a.ratio, 0.25 * (a.ratio / 0.25) ** ((step - 1) / a.dgc_warmup))
        return a.ratio

    def sparse_bytes(ratio: float) -> int:
        if a.comp == "sign":  # 1 bit per element + one fp32 scale per tensor
            return sum((p.numel() + 7) // 8 + 4 for p in params)
        n = 0
        for p, b in zip(params, big):
            n += max(1, int(p.numel() * ratio)) * (4 + a.vbytes) if b else 4 * p.numel()
        return n

    def rank_grads() -> list[list[torch.Tensor]]:
        out = []
        for r in range(W):
            idx = next(loaders[r])
            x, y = ds.x[idx], ds.y[idx]
            model.zero_grad(set_to_none=True)
            logits = model(x)
            F.cross_entropy(logits.reshape(-1, logits.shape[-1]), y.reshape(-1)).backward()
            out.append([p.grad.detach().clone() for p in params])
        return out

    sent = [0]
    spec = make_compressor(a.spec) if a.spec else None

    def compress(vals: list[torch.Tensor], err: list[torch.Tensor], ratio: float) -> list[torch.Tensor]:
        """EF top-k per tensor; small tensors dense. Updates err in place, returns the message."""
        msg = []
        for j, (g, b) in enumerate(zip(vals, big)):
            if a.comp == "sign":
                acc = g + err[j]
                s = acc.sign() * acc.abs().mean()
                err[j] = acc - s
                msg.append(s)
                continue
            if not b:
                msg.append(g)
                sent[0] += 4 * g.numel()
                continue
            acc = g + err[j]
            if spec is not None:
                pk = spec.encode(acc.reshape(-1).contiguous())
                s = spec.decode(pk).view_as(acc)
                sent[0] += pk.nbytes
                err[j] = acc - s
                msg.append(s)
                continue
            k = max(1, int(g.numel() * ratio))
            s = topk_(acc, k)
            if a.vbytes == 2:
                s = s.half().float()
            elif a.vbytes == 1:  # fp8 e4m3 with one fp32 scale per tensor
                sc = s.abs().max().clamp_min(1e-30) / 448.0
                s = (s / sc).to(torch.float8_e4m3fn).float() * sc
            if a.index == "packed":
                idx = s.reshape(-1).nonzero().reshape(-1).to(torch.int32)
                sent[0] += indexcodec.encode(idx, g.numel()).numel() + k * a.vbytes + 4
            else:
                sent[0] += k * (4 + a.vbytes)
            err[j] = acc - s
            msg.append(s)
        return msg

    zeros = lambda: [torch.zeros_like(p) for p in params]  # noqa: E731
    total_bytes = 0
    dense_step = 4 * P
    t0 = time.time()
    opt = torch.optim.Adam(params, lr=a.lr) if a.method in ("dense", "plain") else None

    def take_sent(ratio: float) -> float:
        n = sparse_bytes(ratio) if a.comp == "sign" else sent[0] / W
        sent[0] = 0
        return n
    # per-rank state
    err = [zeros() for _ in range(W)]
    lm = [zeros() for _ in range(W)]  # recipe: local m
    lv = [zeros() for _ in range(W)]  # recipe: local v
    m, v = zeros(), zeros()  # global moments (sharedm/onebit)
    vhat: list[torch.Tensor] | None = None
    t_adam = 0
    for step in range(1, a.steps + 1):
        gs = rank_grads()
        lr = lr_at(step)
        if a.method == "dense":
            for j, p in enumerate(params):
                p.grad = sum(g[j] for g in gs) / W
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            total_bytes += dense_step
        elif a.method == "plain":
            if step <= a.warm:
                avg = [sum(g[j] for g in gs) / W for j in range(len(params))]
                total_bytes += dense_step
            else:
                ratio = density(step - a.warm)
                msgs = [compress(gs[r], err[r], ratio) for r in range(W)]
                avg = [sum(mm[j] for mm in msgs) / W for j in range(len(params))]
                total_bytes += take_sent(ratio)
            for j, p in enumerate(params):
                p.grad = avg[j]
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
        elif a.method == "recipe":
            ratio = density(step)
            msgs = []
            for r in range(W):
                d = []
                for j, g in enumerate(gs[r]):
                    lm[r][j].mul_(B1).add_(g, alpha=1 - B1)
                    lv[r][j].mul_(B2).addcmul_(g, g, value=1 - B2)
                    d.append(lm[r][j] / (1 - B1 ** step) / ((lv[r][j] / (1 - B2 ** step)).sqrt() + EPS))
                msgs.append(compress(d, err[r], ratio))
            total_bytes += take_sent(ratio)
            with torch.no_grad():
                for j, p in enumerate(params):
                    p.add_(sum(mm[j] for mm in msgs) / W, alpha=-lr * (1.0 if a.no_sqrt_world else math.sqrt(W)))
        else:
            dense_now = step <= a.warm or (a.vrefresh and step % a.vrefresh == 0)
            t_adam += 1
            if dense_now:
                # dense step: send g_i (+ pending EF residual, which is then flushed)
                avg = [sum(gs[r][j] + err[r][j] for r in range(W)) / W for j in range(len(params))]
                gtrue = [sum(gs[r][j] for r in range(W)) / W for j in range(len(params))]
                err = [zeros() for _ in range(W)]
                total_bytes += dense_step
                if step <= a.warm:
                    for j in range(len(params)):
                        v[j].mul_(B2).addcmul_(gtrue[j], gtrue[j], value=1 - B2)
                    vhat = [vv / (1 - B2 ** step) for vv in v]
                else:  # refresh: EMA over refreshes, effective beta2 over the refresh interval
                    b2r = B2 ** a.vrefresh
                    vhat = [b2r * vh + (1 - b2r) * g * g for vh, g in zip(vhat, gtrue)]
                for j in range(len(params)):
                    m[j].mul_(B1).add_(avg[j], alpha=1 - B1)
            else:
                ratio = density(step - a.warm)
                if a.method == "sharedm":
                    msgs = [compress(gs[r], err[r], ratio) for r in range(W)]
                    for j in range(len(params)):
                        m[j].mul_(B1).add_(sum(mm[j] for mm in msgs) / W, alpha=1 - B1)
                elif a.method == "delta":
                    msgs = [compress([(1 - B1) * (gs[r][j] - m[j]) for j in range(len(params))], err[r], ratio)
                            for r in range(W)]
                    for j in range(len(params)):
                        m[j].add_(sum(mm[j] for mm in msgs) / W)
                else:  # onebit: compress local momentum started from the shared one
                    msgs = [compress([B1 * m[j] + (1 - B1) * gs[r][j] for j in range(len(params))], err[r], ratio)
                            for r in range(W)]
                    m = [sum(mm[j] for mm in msgs) / W for j in range(len(params))]
                total_bytes += take_sent(ratio)
            with torch.no_grad():
                bc1 = 1 - B1 ** t_adam
                for j, p in enumerate(params):
                    p.add_(m[j] / bc1 / (vhat[j].sqrt() + EPS), alpha=-lr * (a.lr_mult if step > a.warm else 1.0))
    ev = evaluate(model, task, ds)
    rec = {"method": a.method, "world": W, "ratio": a.ratio, "warm": a.warm, "dgc_warmup": a.dgc_warmup,
           "vrefresh": a.vrefresh, "vbytes": a.vbytes, "lr_mult": a.lr_mult, "comp": a.comp, "index": a.index, "spec": a.spec, "steps": a.steps, "seed": a.seed, "tag": a.tag,
           "val_loss": ev["test_loss"], "perplexity": ev["perplexity"], "accuracy": ev["accuracy"],
           "bytes_per_rank": total_bytes, "dense_bytes": dense_step * a.steps,
           "fewer": dense_step * a.steps / total_bytes, "secs": time.time() - t0, "argv": sys.argv[1:]}
    print(json.dumps(rec))
    with open(a.out, "a") as f:
        f.write(json.dumps(rec) + "\n")


if __name__ == "__main__":
    main()
