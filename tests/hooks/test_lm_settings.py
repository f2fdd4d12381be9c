"""The LM settings of the DDP hook on real 2-rank gloo groups: DGC's density warm-up and Adam
moved before the exchange (`precondition="adam"`)."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP

from gradwire import compressor as make_compressor
from gradwire.compress.schedule import warmup_ratio, with_ratio
from gradwire.hooks import ddp as gw_ddp
from multiproc import run_ranks

SPEC = "topk:ratio=0.01,indices=raw"  # raw indices: packet sizes follow from k alone


def make_model() -> nn.Module:
    torch.manual_seed(0)  # no biases: every tensor is large enough to be compressed at any ratio here
    return nn.Sequential(nn.Linear(32, 64, bias=False), nn.ReLU(), nn.Linear(64, 64, bias=False), nn.ReLU(),
                         nn.Linear(64, 4, bias=False))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x[:, :4] * 2


def train(model: nn.Module, opt: torch.optim.Optimizer, rank: int, steps: int) -> list[torch.Tensor]:
    for step in range(steps):
        x, y = batch(rank, step)
        opt.zero_grad()
        nn.functional.mse_loss(model(x), y).backward()
        opt.step()
    return [p.detach().clone() for p in model.parameters()]


def _warmup(rank: int, world: int) -> dict:
    # one bucket: a step's statistics close when its last bucket completes, and with several buckets
    # an earlier one may complete later and count in the next step
    model = DDP(make_model())
    state = gw_ddp.register(model, SPEC, strategy="allgather", warmup=5)
    final = train(model, torch.optim.SGD(model.parameters(), lr=0.05), rank, 10)
    sizes = [p.numel() for p in model.parameters()]
    # the hierarchical strategy hands each step's compressor to its inner strategy (2 nodes of 1 rank)
    nodes = DDP(make_model())
    hier = gw_ddp.register(nodes, SPEC, strategy="hierarchical", inner="allgather", ranks_per_node=1, warmup=5)
    train(nodes, torch.optim.SGD(nodes.parameters(), lr=0.05), rank, 10)
    return {"history": state.history, "sizes": sizes, "params": final, "start": state.start_iter,
            "hier": [(h["density"], h["inter_bytes_sent"]) for h in hier.history if "density" in h]}


def test_density_warmup_sends_the_scheduled_ratio_each_step():
    results = run_ranks(_warmup, 2)
    r = results[0]
    assert all(torch.equal(a, b) for a, b in zip(r["params"], results[1]["params"]))
    c = make_compressor(SPEC)
    compressed = [h for h in r["history"] if h["iter"] >= r["start"]]
    assert [h["iter"] for h in compressed] == list(range(2, 10))
    for h in compressed:
        t = h["iter"] - r["start"]
        ratio = warmup_ratio(0.01, t, 5)
        assert h["density"] == pytest.approx(ratio)
        # one int64 length per segment, then each tensor's top-k packet at this step's ratio
        expected = 8 * len(r["sizes"]) + sum(with_ratio(c, ratio).static_size(n) for n in r["sizes"])
        assert h["bytes_sent"] == expected, (h["iter"], ratio)
    assert compressed[0]["density"] == pytest.approx(0.25)
    assert compressed[-1]["density"] == 0.01 and compressed[-1]["bytes_sent"] < compressed[0]["bytes_sent"] / 10
    hier = r["hier"]
    assert [d for d, _ in hier] == [h["density"] for h in compressed]
    assert all(a[1] > b[1] for a, b in zip(hier[:5], hier[1:6])) and hier[5][1] == hier[-1][1]


def _adam(rank: int, world: int) -> dict:
    out = {}
    # the same batch on both ranks: each rank's direction is then Adam's on the averaged gradient
    base = DDP(make_model())
    out["adam"] = train(base, torch.optim.Adam(base.parameters(), lr=0.01), 0, 8)
    pre = DDP(make_model())
    gw_ddp.register(pre, "none", strategy="allreduce", precondition="adam")
    out["pre"] = train(pre, torch.optim.SGD(pre.parameters(), lr=0.01), 0, 8)
    sparse = DDP(make_model(), bucket_cap_mb=0.005)
    state = gw_ddp.register(sparse, "topk:ratio=0.1", strategy="allgather", precondition="adam")
    out["sparse"] = train(sparse, torch.optim.SGD(sparse.parameters(), lr=0.01), rank, 8)
    out["moments"] = len(state.preconditioner.m)
    return out


def test_adam_preconditioner_matches_torch_adam_and_keeps_replicas_identical():
    results = run_ranks(_adam, 2)
    for r in results:
        assert all(torch.allclose(a, b, rtol=1e-5, atol=1e-6) for a, b in zip(r["adam"], r["pre"]))
        assert any(not torch.equal(a, b) for a, b in zip(r["adam"], r["sparse"]))
        assert r["moments"] == 3
    assert all(torch.equal(a, b) for a, b in zip(results[0]["sparse"], results[1]["sparse"]))


def test_lm_options_are_checked():
    with pytest.raises(ValueError, match="ratio="):
        gw_ddp.GradwireState("qsgd:bits=4", strategy="allgather", warmup=10)
    with pytest.raises(ValueError, match="strategies"):
        gw_ddp.GradwireState("topk:ratio=0.01", strategy="oktopk", warmup=10)
    with pytest.raises(ValueError, match="precondition"):
        gw_ddp.GradwireState("topk:ratio=0.01", precondition="lamb")
    assert warmup_ratio(0.01, 0, 4) == 0.25 and warmup_ratio(0.01, 4, 4) == 0.01
    assert warmup_ratio(0.01, 2, 4) == pytest.approx(0.05)  # halfway: the geometric mean


def _frozen_v_adam(steps: int, dense: int, lr: float, world: int) -> list[torch.Tensor]:
    """Reference for global_adam with an exact exchange, in one process: Adam on the ranks'
    averaged gradient whose second moment stops updating after `dense` steps."""
    model = make_model()
    params = list(model.parameters())
    m = [torch.zeros_like(p) for p in params]
    v = [torch.zeros_like(p) for p in params]
    bound = 0.1 / (0.001 * (1 - 0.81 / 0.999)) ** 0.5
    for step in range(steps):
        grads = []
        for rank in range(world):
            model.zero_grad()
            x, y = batch(rank, step)
            nn.functional.mse_loss(model(x), y).backward()
            grads.append([p.grad.clone() for p in params])
        with torch.no_grad():
            for j, p in enumerate(params):
                # the dense steps travel in bf16: each rank's share cast, summed in bf16 (2 ranks: one rounding)
                g = sum(gr[j] for gr in grads) / world if step >= dense else \
                    (grads[0][j] / world).bfloat16().add(grads[1][j].div(world).bfloat16()).float()
                m[j].mul_(0.9).add_(g, alpha=0.1)
                if step < dense:
                    v[j].mul_(0.999).addcmul_(g, g, value=0.001)
                vhat = v[j] / (1 - 0.999 ** min(step + 1, dense))
                d = m[j] / (1 - 0.9 ** (step + 1)) / (vhat.sqrt() + 1e-8)
                if step >= dense:  # a unit dead in the dense steps (v = 0) steps by at most Adam's bound
                    d.clamp_(-bound, bound)
                p.sub_(lr * d)
    return [p.detach().clone() for p in params]


def _close_but_few_bf16_flips(expected: torch.Tensor, actual: torch.Tensor) -> bool:
    """Equal to fp32 precision except at most 4 coordinates, each off by under a tenth of a step (lr 0.01)."""
    off = ~torch.isclose(actual, expected, rtol=1e-4, atol=1e-6)
    return int(off.sum()) <= 4 and bool(((actual - expected).abs() < 1e-3).all())


def _global_adam(rank: int, world: int) -> dict:
    out = {}
    base = DDP(make_model())
    out["adam"] = train(base, torch.optim.Adam(base.parameters(), lr=0.01), rank, 8)
    out["default_start"] = gw_ddp.GradwireState("sign@allgather", precondition="global_adam").start_iter
    never = DDP(make_model())  # compression never starts: every step is dense Adam on the average
    gw_ddp.register(never, "none", strategy="allgather", precondition="global_adam", start_iter=100)
    out["never"] = train(never, torch.optim.SGD(never.parameters(), lr=0.01), rank, 8)
    exact = DDP(make_model(), bucket_cap_mb=0.005)  # "none" sends each rank's momentum exactly
    state = gw_ddp.register(exact, "none", strategy="allgather", precondition="global_adam", start_iter=3)
    out["exact"] = train(exact, torch.optim.SGD(exact.parameters(), lr=0.01), rank, 8)
    out["exact_start"] = state.start_iter
    signs = DDP(make_model())
    state = gw_ddp.register(signs, "sign@allgather", precondition="global_adam", start_iter=4)
    out["sign"] = train(signs, torch.optim.SGD(signs.parameters(), lr=0.01), rank, 8)
    out["sign_history"] = list(state.history)
    out["start"] = state.start_iter
    saved = copy.deepcopy(state.state_dict())  # (what torch.save would have written: the live tensors move on)
    out["more"] = train(signs, torch.optim.SGD(signs.parameters(), lr=0.01), rank, 3)
    resumed = DDP(make_model())
    with torch.no_grad():
        for p, q in zip(resumed.parameters(), out["sign"]):
            p.copy_(q)
    again = gw_ddp.register(resumed, "sign@allgather", precondition="global_adam", start_iter=4)
    again.load_state_dict(saved)
    out["resumed"] = train(resumed, torch.optim.SGD(resumed.parameters(), lr=0.01), rank, 3)
    return out


def test_global_adam_is_adam_on_the_average_and_compresses_the_momentum():
    results = run_ranks(_global_adam, 2)
    reference = _frozen_v_adam(8, 3, 0.01, 2)
    bf16_adam = _frozen_v_adam(8, 100, 0.01, 2)  # never compressed: Adam on the bf16-exchanged average
    for r in results:
        # fp32 arithmetic differing in the last bit (CPU-dependent kernels) can, once in a great while, put a
        # gradient on the other side of a bf16 rounding boundary: one coordinate then moves a fraction of a
        # step. An fp32 exchange in place of bf16 would move thousands of coordinates by up to 3 steps.
        assert all(_close_but_few_bf16_flips(a, b) for a, b in zip(bf16_adam, r["never"]))
        # bf16 moves coordinates whose two halves nearly cancel, which Adam then normalizes; the rest is Adam's
        assert all(torch.allclose(a, b, atol=0.05) for a, b in zip(r["adam"], r["never"]))
        assert r["default_start"] == 12 and r["exact_start"] == 3 and r["start"] == 4
        assert all(torch.allclose(a, b, rtol=1e-4, atol=1e-6) for a, b in zip(reference, r["exact"]))
        dense = [h for h in r["sign_history"] if h["iter"] < r["start"]]
        sent = [h for h in r["sign_history"] if h["iter"] >= r["start"]]
        assert len(dense) == 4 and len(sent) == 4
        assert all(h["bytes_sent"] * 10 < dense[0]["bytes_sent"] for h in sent)  # 1 bit + scales vs 16 bits
        assert dense[0]["bytes_sent"] == 2 * sum(p.numel() for p in r["sign"])  # bf16
        assert any(not torch.equal(a, b) for a, b in zip(r["sign"], r["never"]))
        assert all(torch.equal(a, b) for a, b in zip(r["more"], r["resumed"]))  # moments and residuals resume
    for key in ("sign", "exact", "more"):
        assert all(torch.equal(a, b) for a, b in zip(results[0][key], results[1][key]))


def test_global_adam_spec():
    from gradwire.hooks.precondition import GlobalAdam, adam_spec, make_preconditioner

    adamw = torch.optim.AdamW(make_model().parameters(), betas=(0.9, 0.95))
    spec = adam_spec(adamw, clip=1.0, shared=True)
    assert spec == "global_adam:beta1=0.9,beta2=0.95,eps=1e-08,clip=1"
    pre = make_preconditioner(spec)
    assert isinstance(pre, GlobalAdam) and str(pre) == "global_adam:beta1=0.9,beta2=0.95,eps=1e-08,clip=1"
    with pytest.raises(ValueError, match="global_adam preconditioner takes"):
        make_preconditioner("global_adam:gamma=1")
    with pytest.raises(ValueError, match="start_iter must be >= 1"):
        gw_ddp.GradwireState("none", strategy="allgather", precondition="global_adam", start_iter=0)


def _readme_recipe(rank: int, world: int) -> dict:
    import warnings

    from gradwire.hooks.precondition import adam_spec, sgd_like

    model = make_model()
    ddp = DDP(model)
    decay = [p for p in model.parameters() if p.shape[0] == 64]
    rest = [p for p in model.parameters() if p.shape[0] != 64]
    adamw = torch.optim.AdamW([{"params": decay, "weight_decay": 0.1}, {"params": rest, "weight_decay": 0.0}],
                              lr=0.01, betas=(0.9, 0.95))
    opt = sgd_like(adamw)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda it: 1.0 / (1 + it))
    state = gw_ddp.register(ddp, "sign@allgather", precondition=adam_spec(adamw, clip=1.0, shared=True))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for step in range(16):
            x, y = batch(rank, step)
            nn.functional.mse_loss(ddp(x), y).backward()
            opt.step()
            opt.zero_grad()
            sched.step()
    return {"params": [p.detach().clone() for p in model.parameters()], "history": state.history,
            "warnings": [str(w.message) for w in caught if "gradwire" in str(w.message)],
            "lrs": [g["lr"] for g in opt.param_groups], "decays": [g["weight_decay"] for g in opt.param_groups],
            "precondition": state.precondition, "norm": state.last_stats.get("grad_norm")}


def test_readme_lm_recipe_keeps_the_users_groups_schedule_and_clipping():
    results = run_ranks(_readme_recipe, 2)
    r = results[0]
    assert all(torch.equal(a, b) for a, b in zip(r["params"], results[1]["params"]))
    assert r["warnings"] == []  # neither the wrong-optimizer nor the rescaled-direction warning
    assert r["decays"] == [0.1, 0.0] and r["lrs"] == [pytest.approx(0.01 / 17)] * 2
    assert r["precondition"] == "global_adam:beta1=0.9,beta2=0.95,eps=1e-08,clip=1"
    assert r["norm"] is not None and r["norm"] > 0  # the hook measured (and clipped) the true gradient
    dense = [h["bytes_sent"] for h in r["history"][:12]]
    sent = [h["bytes_sent"] for h in r["history"][12:]]
    assert len(sent) == 4 and max(sent) * 8 < min(dense)  # bf16 first steps, then one bit per element
