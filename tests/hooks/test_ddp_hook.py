"""The DDP comm hook on real gloo process groups (2 and 4 ranks on CPU)."""

from __future__ import annotations

import math
import pickle

import pytest
import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks import default_hooks
from torch.nn.parallel import DistributedDataParallel as DDP

import gradwire
from gradwire.hooks import ddp as gw_ddp
from gradwire.comm.auto import TRIAL_MARGIN, prefer
from multiproc import run_ranks

IN, OUT = 32, 4


def make_model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(IN, 64), nn.ReLU(), nn.Linear(64, 64), nn.ReLU(), nn.Linear(64, OUT))


def batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 * step + rank)
    teacher = torch.Generator().manual_seed(7)
    w = torch.randn(IN, OUT, generator=teacher)
    x = torch.randn(16, IN, generator=g)
    return x, x @ w


def train(rank: int, hook: str, steps: int, options: dict | None = None, model: DDP | None = None,
          opt: torch.optim.Optimizer | None = None, state=None, start: int = 0):
    if model is None:
        model = DDP(make_model(), bucket_cap_mb=0.005)  # several buckets
        opt = torch.optim.SGD(model.parameters(), lr=0.05)
        if hook == "torch_fp16":
            model.register_comm_hook(None, default_hooks.fp16_compress_hook)
        elif hook != "default":
            state = gw_ddp.register(model, hook, **(options or {}))
    losses = []
    for step in range(start, start + steps):
        x, y = batch(rank, step)
        loss = nn.functional.mse_loss(model(x), y)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return model, opt, state, losses


def params(model: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for p in model.parameters()]


def _compare_baselines(rank: int, world: int) -> dict:
    out = {}
    for name, hook, options in [("default", "default", None), ("torch_fp16", "torch_fp16", None),
                                ("gw_none", "none", {"strategy": "allreduce", "error_feedback": False,
                                                     "start_iter": 0}),
                                ("gw_fp16", "fp16", {"strategy": "allreduce", "error_feedback": False,
                                                     "start_iter": 0}),
                                ("gw_none_defaults", "none", {}), ("gw_fp16_defaults", "fp16", {})]:
        model, _, _, _ = train(rank, hook, 6, options)
        out[name] = params(model)
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_none_equals_ddp_default_and_fp16_equals_torch_fp16_hook(world):
    results = run_ranks(_compare_baselines, world)
    for r in results:
        for name in ("gw_none", "gw_none_defaults"):
            assert all(torch.equal(a, b) for a, b in zip(r["default"], r[name])), name
        for name in ("gw_fp16", "gw_fp16_defaults"):  # the defaults are torch's hook from the first step
            assert all(torch.equal(a, b) for a, b in zip(r["torch_fp16"], r[name])), name
        # and the comparison is not vacuous: fp16 differs from fp32 training
        assert any(not torch.equal(a, b) for a, b in zip(r["default"], r["gw_fp16"]))
    for r in results[1:]:
        for a, b in zip(results[0]["gw_fp16"], r["gw_fp16"]):
            assert torch.equal(a, b)


TRAIN_SPECS = [
    ("none", "auto"), ("fp16", "allreduce"), ("bf16", "auto"), ("fp8", "allgather"), ("int8", "allgather"),
    ("qsgd:bits=4", "allgather"), ("terngrad", "allgather"), ("sign", "allgather"), ("onebit", "allgather"),
    ("topk:ratio=0.1", "allgather"), ("topk:ratio=0.1", "artopk"), ("topk:ratio=0.1", "oktopk"),
    ("topk:ratio=0.1", "auto"), ("topk:ratio=0.1", "hierarchical"),
    ("randomk:ratio=0.2", "allreduce-noef"), ("randomk:ratio=0.2", "allgather-noef"),
    ("threshold:threshold=0.01", "allgather"), ("dgc:ratio=0.1", "allgather"),
    ("topk:ratio=0.1+fp16", "allgather"), ("topk:ratio=0.1+qsgd:bits=8+zstd", "allgather"), ("zstd", "allgather"),
]
STEPS = 40


def _train_all(rank: int, world: int) -> dict:
    out = {}
    for spec, strategy in TRAIN_SPECS:
        # randomk is scaled to be unbiased, hence not contractive: error feedback would diverge
        options = {"strategy": strategy.removesuffix("-noef"), "error_feedback": not strategy.endswith("-noef")}
        if strategy == "auto":  # a modelled slow network, so the choice is the same on any machine
            options.update(alpha=1e-4, beta=1e-7, gamma_encode=1e-9, gamma_decode=1e-9, trials=0)
        if strategy == "hierarchical":  # 2 "nodes" of world/2 ranks, top-k between them
            options.update(ranks_per_node=world // 2, inner="allgather")
        model, _, state, losses = train(rank, spec, STEPS, options)
        out[f"{spec}|{strategy}"] = {"params": params(model), "losses": losses, "stats": state.last_stats}
    model, _, _, losses = train(rank, "default", STEPS)
    out["dense"] = {"params": params(model), "losses": losses}
    return out


@pytest.mark.parametrize("world", [2, 4])
def test_every_compressor_trains_and_ranks_stay_identical(world):
    results = run_ranks(_train_all, world, timeout=600)
    dense_final = sum(sum(r["dense"]["losses"][-5:]) for r in results) / (5 * world)
    first = sum(results[0]["dense"]["losses"][:2]) / 2
    problems = []
    for key in results[0]:
        finals = [sum(r[key]["losses"][-5:]) / 5 for r in results]
        if not max(finals) < 0.5 * first:
            problems.append(f"{key}: final loss {finals} vs initial {first:.3f} (dense {dense_final:.3f})")
        for r in results[1:]:
            if not all(torch.equal(a, b) for a, b in zip(results[0][key]["params"], r[key]["params"])):
                problems.append(f"{key}: ranks hold different parameters")
        if key != "dense":
            stats = results[0][key]["stats"]
            if stats is None or stats["iter"] != STEPS - 1:
                problems.append(f"{key}: no statistics for the last step: {stats}")
            elif not key.startswith("none|") and not stats["inter_bytes_sent"] < stats["dense_bytes"]:
                # (hierarchical: what stays inside a node is dense; what crosses nodes is compressed)
                problems.append(f"{key}: sent {stats['inter_bytes_sent']} bytes, dense is {stats['dense_bytes']}")
    assert not problems, "\n".join(problems)


def _checkpoint_resume(rank: int, world: int, path: str) -> dict:
    options = {"strategy": "allgather"}
    model, opt, state, _ = train(rank, "topk:ratio=0.1", 5, options)
    file = f"{path}/ckpt{rank}.pt"
    torch.save({"model": model.module.state_dict(), "opt": opt.state_dict(), "hook": state.state_dict(),
                "pickled_state": pickle.dumps(state)}, file)
    ckpt = torch.load(file, weights_only=False)
    model, opt, state, _ = train(rank, "topk:ratio=0.1", 5, model=model, opt=opt, state=state, start=5)
    continued = params(model)
    # resume from the checkpoint in a fresh model
    fresh = DDP(make_model(), bucket_cap_mb=0.005)
    fresh.module.load_state_dict(ckpt["model"])
    fresh_opt = torch.optim.SGD(fresh.parameters(), lr=0.05)
    fresh_opt.load_state_dict(ckpt["opt"])
    fresh_state = gw_ddp.register(fresh, "topk:ratio=0.1", **options)
    fresh_state.load_state_dict(ckpt["hook"])
    fresh, _, _, _ = train(rank, "topk:ratio=0.1", 5, model=fresh, opt=fresh_opt, state=fresh_state, start=5)
    # and from the pickled state object
    again = DDP(make_model(), bucket_cap_mb=0.005)
    again.module.load_state_dict(ckpt["model"])
    again_opt = torch.optim.SGD(again.parameters(), lr=0.05)
    again_opt.load_state_dict(ckpt["opt"])
    unpickled = gw_ddp.register(again, state=pickle.loads(ckpt["pickled_state"]))
    again, _, _, _ = train(rank, "topk:ratio=0.1", 5, model=again, opt=again_opt, state=unpickled, start=5)
    return {"continued": continued, "resumed": params(fresh), "unpickled": params(again)}


@pytest.mark.parametrize("world", [2, 4])
def test_checkpoint_resume_is_bit_identical(tmp_path, world):
    for r in run_ranks(_checkpoint_resume, world, str(tmp_path)):
        for a, b, c in zip(r["continued"], r["resumed"], r["unpickled"]):
            assert torch.equal(a, b) and torch.equal(a, c)


def _mismatch(rank: int, world: int) -> str:
    spec = "topk:ratio=0.1" if rank == 0 else "qsgd:bits=4"
    try:
        train(rank, spec, 4, {"strategy": "allgather"})
    except Exception as e:  # noqa: BLE001 - DDP re-raises hook errors as RuntimeError
        return str(e)
    return "no error"


def test_config_mismatch_fails_loudly_on_every_rank():
    messages = run_ranks(_mismatch, 2, timeout=60)
    for m in messages:
        assert "configs differ" in m and "topk:ratio=0.1" in m and "qsgd:bits=4" in m


def test_state_validation():
    with pytest.raises(ValueError, match="start_iter"):
        gw_ddp.GradwireState("topk:ratio=0.1", start_iter=1)
    with pytest.raises(ValueError, match="error_feedback"):
        gw_ddp.GradwireState("topk:ratio=0.1", error_feedback="sometimes")


@pytest.mark.parametrize("spec, strategy, feedback, start", [
    ("none", "auto", False, 0), ("fp16", "auto", False, 0), ("bf16", "allreduce", False, 0),
    ("randomk:ratio=0.1", "auto", False, 0), ("qsgd:bits=4", "allgather", False, 0),
    ("terngrad", "allgather", False, 0), ("qsgd:bits=4", "auto", False, 2),
    ("topk:ratio=0.01", "auto", True, 2), ("dgc:ratio=0.01", "allgather", True, 2), ("sign", "allgather", True, 2),
    ("onebit", "allgather", True, 2), ("int8", "allgather", True, 2), ("fp8", "allgather", True, 2),
    ("topk:ratio=0.01+fp16", "allgather", True, 2), ("randomk:ratio=0.1+fp16", "allreduce", False, 0),
    ("fp16+zstd", "allgather", False, 0), ("none", "powersgd", True, 2),
])
def test_default_error_feedback_and_start_follow_the_compressor(spec, strategy, feedback, start):
    state = gw_ddp.GradwireState(spec, strategy=strategy)
    assert (state.error_feedback, state.start_iter) == (feedback, start)
    assert gw_ddp.GradwireState(spec, strategy=strategy, error_feedback="on").error_feedback is True
    with pytest.raises(ValueError, match="unknown compressor"):
        gw_ddp.GradwireState("nosuch")



def _per_step_stats(rank: int, world: int) -> dict:
    out = {}
    for spec, strategy, options in [("topk:ratio=0.1", "allgather", {}), ("fp16", "allreduce", {}),
                                    ("topk:ratio=0.1", "hierarchical", {"ranks_per_node": 2, "inner": "allgather"}),
                                    ("none", "powersgd", {"rank": 2})]:
        _, _, state, _ = train(rank, spec, 8, {"strategy": strategy, **options})
        out[f"{spec}@{strategy}"] = state.history
    return out


def test_each_steps_stats_count_every_bucket_of_that_step():
    """With several buckets in flight, a bucket finishing after the step's last one is still that
    step's: every step's record counts each parameter's bytes exactly once."""
    total = sum(p.numel() * 4 for p in make_model().parameters())
    for name, history in run_ranks(_per_step_stats, 4, timeout=300)[0].items():
        assert [h["iter"] for h in history] == list(range(8)), name
        assert len(history[-1]["buckets"]) > 1, name  # (DDP's first step has one bucket, then it rebuilds)
        assert [h["dense_bytes"] for h in history] == [total] * 8, name
        assert all(h["exchange_s"] > 0 for h in history), name
        if "hierarchical" in name:  # the inter-node stage runs in a callback, after the intra-node one
            assert len({h["intra_bytes_sent"] for h in history[2:]}) == 1, name
            assert all(0 < h["inter_bytes_sent"] < total for h in history[2:]), name


def _auto_lowrank(rank: int, world: int) -> dict:
    options = {"strategy": "auto", "inner": "powersgd", "rank": 2, "ranks_per_node": 2, "trials": 1}
    model, _, state, losses = train(rank, "none", STEPS, options)
    out = {"params": params(model), "losses": losses, "choice": state.strategy.choice,
           "choices": state.strategy.choices, "candidates": sorted(state.strategy.measured),
           "feedback": state.error_feedback, "buckets": [h["buckets"] for h in state.history]}
    dist.barrier()  # the hierarchical candidate's sub-groups outlive every pending callback
    return out


def test_auto_with_lowrank_candidates_trains_in_the_hook_and_ranks_agree():
    results = run_ranks(_auto_lowrank, 4, timeout=300)
    a = results[0]
    assert a["feedback"] is True  # PowerSGD's own error feedback, on by default
    assert {"dense", "bf16", "powersgd"} <= set(a["candidates"]) and a["choice"] in a["candidates"]
    assert set(a["buckets"][0].values()) == {"dense"}  # the dense first steps
    last = a["buckets"][-1]
    assert len(a["choices"]) > 1 and set(a["choices"]) <= set(last)  # every bucket has its own choice
    for bucket, choice in a["choices"].items():
        assert last[bucket] == {"bf16": "allreduce"}.get(choice, choice)  # (the name bf16 is recorded under)
    assert sum(a["losses"][-5:]) < 0.5 * sum(a["losses"][:5])
    for r in results[1:]:
        assert (r["choice"], r["choices"]) == (a["choice"], a["choices"])
        assert all(torch.equal(x, y) for x, y in zip(r["params"], a["params"]))


def _auto_warmup(rank: int, world: int) -> dict:
    options = {"strategy": "auto", "inner": "powersgd", "rank": 2, "ranks_per_node": 2, "trials": 1,
               "settle": 0, "start_iter": 19}
    model, _, state, losses = train(rank, "none", 24, options)
    warm = state.strategy.warmup_strategy
    out = {"params": params(model), "losses": losses, "buckets": [h["buckets"] for h in state.history],
           "warm_choices": warm.choices, "warm_times": warm.measured_per_bucket, "warm_steps": warm.measured,
           "warm_turns": dict(warm.turns.turns),
           "turns": dict(state.strategy.trial.turns), "measured": state.strategy.measured,
           "choice": state.strategy.choice,
           "plan_buckets": state.strategy.plan_buckets,
           "ddp_buckets": gw_ddp.ddp_bucket_count([p.numel() * p.element_size() for p in model.parameters()],
                                                  model.bucket_bytes_cap)}
    dist.barrier()  # the hierarchical candidate's sub-groups outlive every pending callback
    return out


def test_auto_spends_its_dense_first_steps_on_the_fastest_uncompressed_exchange():
    """auto on two nodes: the hook's uncompressed steps after the second go to dense, bf16 and
    bf16 between nodes only in turns (an untimed round, one timed, then 3 more timed rounds of
    those within TRIAL_DROP of the fastest), then every bucket takes the one whose steps were
    fastest (dense unless another is 3% faster) until compression starts, whose trial reuses those
    times; all ranks choose alike and keep bit-identical replicas."""
    results = run_ranks(_auto_warmup, 4, timeout=300)
    a = results[0]
    order = ("dense", "bf16", "hierarchical_bf16")
    # (recorded under their strategies' names: bf16 is an allreduce, hierarchical_bf16 one between nodes)
    names = {"dense": {"dense"}, "bf16": {"allreduce"}, "hierarchical_bf16": {"hierarchical", "allreduce"}}
    assert [set(b.values()) for b in a["buckets"][:2]] == [{"dense"}, {"dense"}]  # DDP settles its buckets
    for step in range(2, 8):  # the untimed and the first timed round: dense, bf16, hierarchical_bf16, dense, ...
        assert set(a["buckets"][step].values()) == names[order[(step - 2) % 3]], step
    alive = [n for n in order if a["warm_turns"][n] == 4]  # the others were dropped after one timed turn
    assert a["warm_turns"] == {n: 4 if n in alive else 1 for n in order} and alive
    end = 8 + 3 * len(alive)
    for step in range(8, end):  # 3 more rounds of the survivors
        assert set(a["buckets"][step].values()) == names[alive[(step - 8) % len(alive)]], step
    assert set(a["warm_choices"]) == set(a["buckets"][end]) and len(a["warm_choices"]) > 1
    assert a["plan_buckets"] == a["ddp_buckets"] >= 1  # what auto prices each candidate's rounds by
    for step in range(end, 19):  # each bucket's own pick, from the ranks' times
        for bucket, choice in a["warm_choices"].items():
            assert {a["buckets"][step][bucket]} <= names[choice]
    steps = a["warm_steps"]  # each candidate's step span: the choice for every bucket
    assert list(steps) == list(order) and all(t > 0 for t in steps.values())
    assert set(a["warm_choices"].values()) == {prefer(steps, margin=TRIAL_MARGIN)}
    for times in a["warm_times"].values():
        assert all(t > 0 for t in times.values()) and list(times) == list(order)
    # compression's trial (from step 19) times only the compressed candidates, one timed turn each
    # (no untimed round: the uncompressed steps connected every link): those were timed already
    assert set(a["buckets"][19].values()) == {"powersgd"} and "hierarchical" in a["buckets"][20].values()
    assert a["turns"] == {"powersgd": 1, "hierarchical": 1}
    assert {n: a["measured"][n] for n in order} == steps and a["choice"] is not None
    assert a["choice"] == prefer(a["measured"], margin=TRIAL_MARGIN)
    assert set(a["buckets"][21].values()) <= {"dense", "allreduce", "powersgd", "hierarchical"}
    assert all(math.isfinite(x) for x in a["losses"])
    for r in results[1:]:
        assert (r["warm_choices"], r["warm_times"], r["warm_turns"]) == (a["warm_choices"], a["warm_times"], a["warm_turns"])
        assert (r["choice"], r["measured"]) == (a["choice"], a["measured"])
        assert all(torch.equal(x, y) for x, y in zip(r["params"], a["params"]))


def _bucket_counts(rank: int, world: int) -> list[tuple[int, int, int]]:
    out = []
    for widths, cap_mb in (([64, 64], 25.0), ([512, 512, 512, 512], 1.0), ([1024, 2048, 1024], 4.0)):
        layers = [nn.Linear(a, b) for a, b in zip(widths, widths[1:])]
        model = DDP(nn.Sequential(*layers), bucket_cap_mb=cap_mb)
        seen: set[int] = set()

        def count(_, bucket):  # (unannotated: DDP checks annotations against its own types)
            seen.add(bucket.index())
            return default_hooks.allreduce_hook(None, bucket)  # type: ignore[arg-type]

        model.register_comm_hook(None, count)
        for _ in range(2):  # (DDP rebuilds its buckets after the first step)
            seen.clear()
            model(torch.randn(2, widths[0])).sum().backward()
        sizes = [p.numel() * p.element_size() for p in model.parameters()]
        out.append((len(seen), gw_ddp.ddp_bucket_count(sizes, model.bucket_bytes_cap), len(sizes)))
    return out


def test_auto_prices_round_trips_per_bucket_as_ddp_buckets_the_model():
    """`auto` pays each candidate's rounds once per bucket; the hook counts the buckets as DDP makes
    them from the second step on (the first up to 1 MiB, then bucket_cap_mb), checked against real DDP."""
    counts = run_ranks(_bucket_counts, 2)[0]
    for seen, estimated, tensors in counts:
        assert seen == estimated, (seen, estimated, tensors)
    assert [seen for seen, _, _ in counts] != [1, 1, 1]  # the models do make several
