"""DiLoCo on real gloo ranks, against a one-process simulation of the same replicas written
from the papers' equations (not from gradwire.outer)."""

from __future__ import annotations

import copy

import pytest
import torch

from gradwire.errors import ConfigMismatchError
from gradwire.outer import DiLoCo, OuterConfig, split_fragments
from multiproc import run_ranks

STEPS = 9


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every replica
    return torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 4))


def _batch(rank: int, step: int) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    return torch.randn(5, 32, generator=gen), torch.randn(5, 4, generator=gen)


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    x, y = _batch(rank, step)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _train(rank: int, world: int, options: dict, steps: int = STEPS) -> dict:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, **options)
    for step in range(steps):
        _inner_step(model, opt, rank, step)
        outer.step()
    outer.finish()
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": outer.stats}


def simulate(world: int, steps: int, sync_every: int, fragments: int = 1, delay: int = 0, mix: float = 0.0,
             outer_lr: float = 0.7, momentum: float = 0.9) -> list[list[torch.Tensor]]:
    """Every replica in one process; at fragment k's sync the mean of (global - local) over
    replicas drives Nesterov SGD on the global weights, applied `delay` steps later, when each
    replica's fragment becomes (1 - mix) * global + mix * local."""
    models = [_model() for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    glob = [p.detach().clone() for p in models[0].parameters()]
    frag = split_fragments([p.numel() for p in glob], fragments)
    velocity = [torch.zeros_like(g) for g in glob]
    pending: list[tuple[int, int, list[torch.Tensor]]] = []  # (apply at, fragment, mean pseudo-gradient)
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            _inner_step(m, o, r, step)
        t = step + 1
        for due, k, delta in [p for p in pending if p[0] == t]:
            _apply(models, glob, velocity, frag, k, delta, outer_lr, momentum, mix)
            pending.remove((due, k, delta))
        for k in range(fragments):
            if t % sync_every == (sync_every * (k + 1)) // fragments % sync_every:
                delta = [sum(g - list(m.parameters())[i].detach() for m in models) / world if frag[i] == k else None
                         for i, g in enumerate(glob)]
                if delay:
                    pending.append((t + delay, k, delta))
                else:
                    _apply(models, glob, velocity, frag, k, delta, outer_lr, momentum, mix)
    for _, k, delta in pending:
        _apply(models, glob, velocity, frag, k, delta, outer_lr, momentum, mix)
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def _apply(models, glob, velocity, frag, k, delta, lr, momentum, mix) -> None:
    with torch.no_grad():
        for i, g in enumerate(glob):
            if frag[i] != k:
                continue
            velocity[i] = momentum * velocity[i] + delta[i]
            g -= lr * (delta[i] + momentum * velocity[i])  # Nesterov, as torch.optim.SGD(nesterov=True)
            for m in models:
                p = list(m.parameters())[i]
                p.copy_((1 - mix) * g + mix * p)


@pytest.mark.parametrize("options", [dict(sync_every=3), dict(sync_every=4, fragments=2, delay=1, mix=0.5)],
                         ids=["diloco", "streaming"])
def test_uncompressed_diloco_matches_the_papers_equations(options: dict) -> None:
    results = run_ranks(_train, 2, options)
    want = simulate(2, STEPS, **options)
    for got, replica in zip((r["params"] for r in results), want):
        for g, w in zip(got, replica):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    a, b = results
    same = all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert same == (not options.get("mix"))  # mixing keeps a share of each replica's own weights
    fragments = options.get("fragments", 1)
    assert {s["fragment"] for s in a["stats"]} == set(range(fragments))
    if fragments == 2:  # staggered: fragment 0 at steps 2, 6; fragment 1 at 4, 8; applied one step later
        assert [(s["fragment"], s["step"]) for s in a["stats"]] == [(0, 3), (1, 5), (0, 7), (1, 9)]


def test_int8_pseudo_gradients_send_a_quarter_and_replicas_stay_identical() -> None:
    dense, int8 = (run_ranks(_train, 2, dict(sync_every=3, compressor=c)) for c in ("none", "int8"))
    sent = sum(s["bytes_sent"] for s in int8[0]["stats"])
    assert sent < 0.3 * sum(s["bytes_sent"] for s in dense[0]["stats"])
    assert all(torch.equal(x, y) for x, y in zip(int8[0]["params"], int8[1]["params"]))
    for x, y in zip(int8[0]["params"], dense[0]["params"]):
        torch.testing.assert_close(x, y, rtol=0.05, atol=0.02)  # close to uncompressed, not equal


def _mismatch(rank: int, world: int) -> str:
    try:
        _train(rank, world, dict(sync_every=3 + rank))
    except ConfigMismatchError as e:
        return str(e)
    return "no error"


def test_replicas_with_another_sync_period_all_raise_at_the_first_sync() -> None:
    for message in run_ranks(_mismatch, 2):
        assert "DiLoCo configs differ" in message and "sync_every=3" in message and "sync_every=4" in message


def _resume(rank: int, world: int) -> dict:
    options = dict(sync_every=3, compressor="topk:ratio=0.2")
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.5)
    outer = DiLoCo(model, **options)
    for step in range(6):
        _inner_step(model, opt, rank, step)
        outer.step()
    # (deep-copied as a checkpoint on disk is: state dicts hold the live tensors, as torch's do)
    saved = copy.deepcopy((model.state_dict(), opt.state_dict(), outer.state_dict()))
    for step in range(6, 11):
        _inner_step(model, opt, rank, step)
        outer.step()
    straight = [p.detach().clone() for p in model.parameters()]
    model2 = _model()
    model2.load_state_dict(saved[0])
    opt2 = torch.optim.SGD(model2.parameters(), lr=0.1, momentum=0.5)
    opt2.load_state_dict(saved[1])
    outer2 = DiLoCo(model2, **options)
    outer2.load_state_dict(saved[2])
    for step in range(6, 11):
        _inner_step(model2, opt2, rank, step)
        outer2.step()
    return {"straight": straight, "resumed": [p.detach().clone() for p in model2.parameters()]}


def test_a_resumed_run_continues_bit_identically() -> None:
    """Global weights, outer momentum and top-k's error feedback all come back."""
    for r in run_ranks(_resume, 2):
        assert all(torch.equal(x, y) for x, y in zip(r["straight"], r["resumed"]))


def test_bad_settings_are_refused() -> None:
    for kwargs, match in [(dict(sync_every=0), "must be >= 1"), (dict(sync_every=4, fragments=5), "cannot take turns"),
                          (dict(sync_every=4, fragments=2, delay=2), "below sync_every / fragments"),
                          (dict(mix=1.0), r"mix must be in \[0, 1\)")]:
        with pytest.raises(ValueError, match=match):
            OuterConfig(**kwargs)
    with pytest.raises(ValueError, match="at least as many parameter tensors"):
        split_fragments([10, 10], 3)
    assert split_fragments([10, 10, 10, 10], 2) == [0, 0, 1, 1]
    assert split_fragments([100, 1, 1, 1], 3) == [0, 1, 2, 2]  # every fragment gets a tensor


def test_gradwire_experiment_runs_diloco_methods(tmp_path) -> None:
    """`diloco:H=..[+compressor]` in a real 2-rank sweep: replicas sync every H steps, so a
    run sends about 1/H of dense's bytes; int8 about a quarter of that again."""
    import json

    from gradwire.experiments import cli

    out = tmp_path / "sweep"
    assert cli.main(["--methods", "none,diloco:H=10,diloco:H=10+int8", "--worlds", "2", "--steps", "40",
                     "--eval-every", "20", "--no-progress", "--out", str(out)]) == 0
    runs = {json.loads(p.read_text())["method"]["label"]: json.loads(p.read_text())
            for p in out.glob("runs/*/summary.json")}
    dense, diloco, int8 = runs["dense"], runs["diloco:H=10"], runs["diloco:H=10+int8"]
    assert diloco["method"]["outer"] == {"sync_every": 10}
    assert 0.05 * dense["bytes_sent"] < diloco["bytes_sent"] < 0.2 * dense["bytes_sent"]
    assert int8["bytes_sent"] < 0.35 * diloco["bytes_sent"]
    for r in (diloco, int8):  # it learned: well above the 10% of mnist1d's 10 classes, as dense after 40 steps
        assert r["final"]["accuracy"] > 15.0 and dense["final"]["accuracy"] > 15.0
    steps = [json.loads(line) for line in (out / "runs" / diloco["run_id"] / "steps.jsonl").read_text().splitlines()]
    synced = [r["step"] for r in steps if r["type"] == "step" and r["bytes_sent"]]
    assert synced == [10, 20, 30, 40]
