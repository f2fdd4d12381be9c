"""DiLoCo on real gloo ranks, against a one-process simulation of the same replicas written
from the papers' equations (not from gradwire.outer)."""

from __future__ import annotations

import copy

import pytest
import torch

from gradwire.errors import ConfigMismatchError
from gradwire.outer import DiLoCo, OuterConfig, split_fragments
from gradwire.outer.diloco import saved_config
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
    return {"params": [p.detach().clone() for p in model.parameters()], "stats": outer.stats,
            "peak": outer.peak_bytes_in_flight(),
            "residuals": {k: v.clone() for k, v in outer.exchangers[0].strategy.feedback.residuals.items()}
            if outer.exchangers[0].strategy.feedback is not None else None}


def simulate(world: int, steps: int, sync_every: int, fragments: int = 1, delay: int = 0, mix: float = 0.0,
             carry: bool = False, outer_lr: float = 0.7, momentum: float = 0.9) -> list[list[torch.Tensor]]:
    """Every replica in one process; at fragment k's sync the mean of (global - local) over
    replicas drives Nesterov SGD on the global weights, applied `delay` steps later, when each
    replica's fragment becomes (1 - mix) * global + mix * local, or with `carry` global + (its
    local weights now - its local weights at the sync)."""
    models = [_model() for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    glob = [p.detach().clone() for p in models[0].parameters()]
    frag = split_fragments([p.numel() for p in glob], fragments)
    velocity = [torch.zeros_like(g) for g in glob]
    pending: list[tuple] = []  # (apply at, fragment, mean pseudo-gradient, replicas' weights then or None)
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            _inner_step(m, o, r, step)
        t = step + 1
        for entry in [p for p in pending if p[0] == t]:
            _apply(models, glob, velocity, frag, *entry[1:], outer_lr, momentum, mix)
            pending.remove(entry)
        for k in range(fragments):
            if t % sync_every == (sync_every * (k + 1)) // fragments % sync_every:
                delta = [sum(g - list(m.parameters())[i].detach() for m in models) / world if frag[i] == k else None
                         for i, g in enumerate(glob)]
                then = [[p.detach().clone() for p in m.parameters()] for m in models] if carry else None
                if delay:
                    pending.append((t + delay, k, delta, then))
                else:
                    _apply(models, glob, velocity, frag, k, delta, then, outer_lr, momentum, mix)
    for entry in pending:
        _apply(models, glob, velocity, frag, *entry[1:], outer_lr, momentum, mix)
    return [[p.detach().clone() for p in m.parameters()] for m in models]


def _apply(models, glob, velocity, frag, k, delta, then, lr, momentum, mix) -> None:
    with torch.no_grad():
        for i, g in enumerate(glob):
            if frag[i] != k:
                continue
            velocity[i] = momentum * velocity[i] + delta[i]
            g -= lr * (delta[i] + momentum * velocity[i])  # Nesterov, as torch.optim.SGD(nesterov=True)
            for r, m in enumerate(models):
                p = list(m.parameters())[i]
                p.copy_(g + (p - then[r][i]) if then else (1 - mix) * g + mix * p)


@pytest.mark.parametrize("options", [dict(sync_every=3), dict(sync_every=4, fragments=2, delay=1, mix=0.5),
                                     dict(sync_every=4, fragments=2, delay=1, carry=True, outer_lr=1.0, momentum=0.0)],
                         ids=["diloco", "streaming", "streaming-carry"])
def test_uncompressed_diloco_matches_the_papers_equations(options: dict) -> None:
    results = run_ranks(_train, 2, options)
    want = simulate(2, STEPS, **options)
    for got, replica in zip((r["params"] for r in results), want):
        for g, w in zip(got, replica):
            torch.testing.assert_close(g, w, rtol=1e-5, atol=1e-6)
    a, b = results
    same = all(torch.equal(x, y) for x, y in zip(a["params"], b["params"]))
    assert same == (not options.get("mix") and not options.get("carry"))  # both keep some of a replica's own steps
    fragments = options.get("fragments", 1)
    assert {s["fragment"] for s in a["stats"]} == set(range(fragments))
    if fragments == 2:  # staggered: fragment 0 at steps 2, 6; fragment 1 at 4, 8; applied one step later
        assert [(s["fragment"], s["step"]) for s in a["stats"]] == [(0, 3), (1, 5), (0, 7), (1, 9)]


def _train_beside_own_collectives(rank: int, world: int, on_training_thread: bool) -> dict:
    """Streamed int8 DiLoCo while the training thread all-reduces on the same (default) group
    right after every `step()`, when a launched exchange is issuing its own collectives."""
    import threading

    import torch.distributed as dist

    from gradwire.comm.torch_dist import TorchDistBackend

    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    backend = TorchDistBackend()
    backend.issue_from_any_thread = not on_training_thread
    outer = DiLoCo(model, sync_every=4, fragments=2, delay=1, compressor="int8", backend=backend)
    threads: list[str] = []
    for exchanger in outer.exchangers:
        def recorded(named, exchange=exchanger.exchange_async_):
            threads.append(threading.current_thread().name)
            return exchange(named)
        exchanger.exchange_async_ = recorded
    sums = []
    for step in range(STEPS):
        _inner_step(model, opt, rank, step)
        outer.step()
        mine = torch.full((1000,), float(rank + step))
        dist.all_reduce(mine)
        sums.append(mine.unique().tolist())
    outer.finish()
    return {"params": [p.detach().clone() for p in model.parameters()], "threads": threads, "sums": sums}


def test_streamed_exchanges_run_off_the_training_thread_and_its_own_collectives_keep_their_order() -> None:
    background, foreground = (run_ranks(_train_beside_own_collectives, 2, on) for on in (False, True))
    for r in range(2):
        assert background[r]["threads"] and all(t.startswith("gradwire-diloco") for t in background[r]["threads"])
        assert foreground[r]["threads"] and all(t == "MainThread" for t in foreground[r]["threads"])
        assert background[r]["sums"] == [[float(1 + 2 * step)] for step in range(STEPS)]  # 0+s + 1+s
        for x, y in zip(background[r]["params"], foreground[r]["params"]):
            assert torch.equal(x, y)  # the same exchange, only on another thread


def _thread_mismatch(rank: int, world: int) -> str:
    from gradwire.comm.torch_dist import TorchDistBackend

    backend = TorchDistBackend()
    backend.issue_from_any_thread = rank == 0  # (as MPI ranks initialized at different thread levels)
    try:
        DiLoCo(_model(), sync_every=4, fragments=2, delay=1, backend=backend)
    except ConfigMismatchError as e:
        return str(e)
    return "no error"


def test_ranks_that_disagree_on_the_exchange_thread_all_raise_before_splitting_the_group() -> None:
    for message in run_ranks(_thread_mismatch, 2, timeout=60):
        assert "exchange_thread" in message, message


def test_int8_pseudo_gradients_send_a_quarter_and_replicas_stay_identical() -> None:
    dense, int8 = (run_ranks(_train, 2, dict(sync_every=3, compressor=c)) for c in ("none", "int8"))
    sent = sum(s["bytes_sent"] for s in int8[0]["stats"])
    assert sent < 0.3 * sum(s["bytes_sent"] for s in dense[0]["stats"])
    assert all(torch.equal(x, y) for x, y in zip(int8[0]["params"], int8[1]["params"]))
    for x, y in zip(int8[0]["params"], dense[0]["params"]):
        torch.testing.assert_close(x, y, rtol=0.05, atol=0.02)  # close to uncompressed, not equal


def test_streamed_fp4_outer_gradients_send_a_sixth_and_report_the_bytes_in_flight() -> None:
    """Streaming DiLoCo with fp4 outer gradients (the Streaming DiLoCo paper's): each sync sends
    about 5 bits per weight instead of 32; a fragment is in flight from its launch to its apply,
    `delay` steps later (never beside another fragment's), so the peak bytes in flight is the
    largest fragment's packet; every sync reports how long its launch and its wait took (the
    communication the inner steps did not hide)."""
    opts = dict(sync_every=6, fragments=2, delay=2)
    dense, fp4 = (run_ranks(_train, 2, dict(opts, compressor=c)) for c in ("none", "fp4"))
    stats = fp4[0]["stats"]
    assert [(s["fragment"], s["launched"], s["step"]) for s in stats] == [(0, 3, 5), (1, 6, 8), (0, 9, 9)]
    assert all(s["launch_s"] >= 0 and s["wait_s"] >= 0 for s in stats)
    ratio = sum(s["bytes_sent"] for s in dense[0]["stats"]) / sum(s["bytes_sent"] for s in stats)
    assert 4.5 < ratio < 6.4, ratio  # 32 bits over 4 + 32/32 (headers make it a little less)
    for run in (fp4, dense):
        assert run[0]["peak"] == max(s["bytes_sent"] for s in run[0]["stats"]) > 0
    for x, y in zip(fp4[0]["params"], dense[0]["params"]):
        torch.testing.assert_close(x, y, rtol=0.1, atol=0.05)  # close to uncompressed, not equal


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
    before_carry = saved[2]["config"].replace(", carry=False", "")  # as a checkpoint from before `carry` reads
    assert before_carry != saved[2]["config"]
    outer2.load_state_dict({**saved[2], "config": before_carry})
    for step in range(6, 11):
        _inner_step(model2, opt2, rank, step)
        outer2.step()
    return {"straight": straight, "resumed": [p.detach().clone() for p in model2.parameters()]}


def test_a_resumed_run_continues_bit_identically() -> None:
    """Global weights, outer momentum and top-k's error feedback all come back."""
    for r in run_ranks(_resume, 2):
        assert all(torch.equal(x, y) for x, y in zip(r["straight"], r["resumed"]))


def test_a_saved_config_is_compared_field_by_field() -> None:
    now = OuterConfig(sync_every=10, fragments=3, delay=2, outer_lr=1.0, momentum=0.0)
    assert saved_config(repr(now)) == now
    assert saved_config("OuterConfig(sync_every=10, fragments=3, delay=2, mix=0.0, outer_lr=1.0, momentum=0.0, "
                        "nesterov=True, feedback_decay=1.0)") == now  # saved before `carry`: its default
    assert saved_config(repr(OuterConfig(sync_every=10, fragments=3, delay=2, carry=True))) != now
    with pytest.raises(ValueError, match="does not know: \\['lookahead'\\]"):
        saved_config("OuterConfig(sync_every=10, lookahead=2)")
    for garbage in ("OuterConfig(sync_every=os.system('x'))", "print(1)", "OuterConfig(10)", "OuterConfig(",
                    "OuterConfig(sync_every='10')"):
        with pytest.raises(ValueError, match="cannot be read"):
            saved_config(garbage)


def test_bad_settings_are_refused() -> None:
    for kwargs, match in [(dict(sync_every=0), "must be >= 1"), (dict(sync_every=4, fragments=5), "cannot take turns"),
                          (dict(sync_every=4, fragments=2, delay=2), "below sync_every / fragments"),
                          (dict(mix=1.0), r"mix must be in \[0, 1\)"),
                          (dict(sync_every=4, carry=True), "with delay=0 there are none"),
                          (dict(sync_every=4, delay=1, carry=True, mix=0.5), "carry and mix=0.5")]:
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


def test_gradwire_experiment_runs_a_node_as_one_replica(tmp_path, capsys) -> None:
    """`diloco:H=..,replica=node` on 2 nodes x 2 ranks: DDP inside each node every step (counted as
    intra-node bytes), DiLoCo between the 2 nodes every H steps (each rank sends its share: the
    same bytes as 2 single-rank replicas)."""
    import json

    from gradwire.experiments import cli
    from gradwire.experiments.config import parse_method

    out = tmp_path / "sweep"
    assert cli.main(["--methods", "diloco:H=10,replica=node", "--worlds", "4", "--ranks-per-node", "2",
                     "--steps", "20", "--eval-every", "20", "--no-progress", "--out", str(out)]) == 0
    assert cli.main(["--methods", "diloco:H=10", "--worlds", "2", "--steps", "20", "--eval-every", "20",
                     "--no-progress", "--out", str(out)]) == 0
    runs = {(s["method"]["label"], s["config"]["world"]): s
            for s in (json.loads(p.read_text()) for p in out.glob("runs/*/summary.json"))}
    node, ranks = runs[("diloco:H=10,replica=node", 4)], runs[("diloco:H=10", 2)]
    assert node["method"]["replica"] == "node" and node["method"]["outer"] == {"sync_every": 10}
    fp32 = 4 * node["params"]
    assert node["intra_bytes_sent_per_rank"] == [20 * fp32] * 4  # every inner step all-reduces inside the node
    between = [b - i for b, i in zip(node["bytes_sent_per_rank"], node["intra_bytes_sent_per_rank"])]
    assert between == [ranks["bytes_sent"]] * 4 and 0 < ranks["bytes_sent"] <= 2 * fp32
    assert node["syncs"] == ranks["syncs"] == 2
    assert node["final"]["accuracy"] > 15.0  # it learned (mnist1d: 10 classes)
    steps = [json.loads(line) for line in (out / "runs" / node["run_id"] / "steps.jsonl").read_text().splitlines()]
    synced = [r["step"] for r in steps if r["type"] == "step" and r["bytes_sent"] > r["intra_bytes_sent"]]
    assert synced == [10, 20]
    # one rank per node would be DDP over a single rank: refused before anything runs
    assert cli.main(["--methods", "diloco:H=10,replica=node", "--worlds", "2", "--out", str(tmp_path / "x")]) == 2
    assert "replica=node" in capsys.readouterr().err
    with pytest.raises(ValueError, match="replica= takes rank or node"):
        parse_method("diloco:H=10,replica=datacenter")


def test_carry_is_parsed_from_the_method_string_and_checked() -> None:
    from gradwire.experiments.config import parse_method

    assert parse_method("diloco:H=10,fragments=2,delay=4,carry=1+int8").outer["carry"] is True
    assert parse_method("diloco:H=10,fragments=2,delay=4,carry=0").outer["carry"] is False
    with pytest.raises(ValueError, match="carry= takes 0 or 1"):
        parse_method("diloco:H=10,delay=4,carry=2")
    with pytest.raises(ValueError, match="with delay=0 there are none"):
        parse_method("diloco:H=10,carry=1")
    for spec, key in [("diloco:H=10,delay=4,carry=yes", "carry"), ("diloco:H=ten", "H")]:
        with pytest.raises(ValueError, match=f"{key}= takes a number, got"):
            parse_method(spec)


def _fragments_mismatch(rank: int, world: int) -> str:
    try:
        _train(rank, world, dict(sync_every=4, fragments=1 + rank))
    except ConfigMismatchError as e:
        return str(e)
    return "no error"


def test_replicas_with_another_fragment_schedule_all_raise_diloco_s_own_error() -> None:
    """The outer settings are compared before any per-fragment exchanger is built (those run
    checks of their own, as many as there are fragments)."""
    for message in run_ranks(_fragments_mismatch, 2):
        assert "DiLoCo configs differ" in message and "fragments=1" in message and "fragments=2" in message


def _decayed(rank: int, world: int) -> dict:
    options = dict(sync_every=3, compressor="topk:ratio=0.1,chunk=64", momentum=0.0, outer_lr=1.0,
                   feedback_decay=0.5)
    return _train(rank, world, options, steps=9)


def simulate_sparseloco(world: int, steps: int, sync_every: int, spec: str, decay: float,
                        outer_lr: float) -> tuple[list[torch.Tensor], list[dict[str, torch.Tensor]]]:
    """SparseLoCo's equations, every replica in one process: e = decay * e + (global - local);
    sent = C(e); e -= sent; global -= outer_lr * mean(sent); locals = global. A tensor whose
    packet would not be smaller than its raw bytes (a 4-element bias) is sent exactly, with no
    accumulator, as every gradwire exchange does (`worth_compressing`)."""
    import gradwire
    from gradwire.comm.base import worth_compressing

    c = gradwire.compressor(spec)
    models = [_model() for _ in range(world)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    names = [n for n, _ in models[0].named_parameters()]
    glob = [p.detach().clone() for p in models[0].parameters()]
    compressed = {n for n, g in zip(names, glob) if worth_compressing(c, g.numel(), g.dtype)}
    errors: list[dict[str, torch.Tensor]] = [{n: torch.zeros_like(g) for n, g in zip(names, glob) if n in compressed}
                                             for _ in models]
    for step in range(steps):
        for r, (m, o) in enumerate(zip(models, opts)):
            _inner_step(m, o, r, step)
        if (step + 1) % sync_every:
            continue
        sent = []
        for m, e in zip(models, errors):
            mine = []
            for n, g, p in zip(names, glob, m.parameters()):
                if n not in compressed:
                    mine.append(g - p.detach())
                    continue
                e[n] = decay * e[n] + (g - p.detach())
                s = c.decode(c.encode(e[n]), shape=e[n].shape)
                e[n] = e[n] - s
                mine.append(s)
            sent.append(mine)
        glob = [g - outer_lr * sum(s[i] for s in sent) / world for i, g in enumerate(glob)]
        with torch.no_grad():
            for m in models:
                for p, g in zip(m.parameters(), glob):
                    p.copy_(g)
    return glob, errors


def test_feedback_decay_follows_sparseloco_s_equations() -> None:
    """Error feedback that decays in place of outer momentum, chunked top-k, plain SGD: the
    weights and each replica's accumulator match the equations run in one process."""
    results = run_ranks(_decayed, 2)
    glob, errors = simulate_sparseloco(2, 9, 3, "topk:ratio=0.1,chunk=64", 0.5, 1.0)
    for r, out in enumerate(results):
        for x, want in zip(out["params"], glob):
            torch.testing.assert_close(x, want, rtol=1e-5, atol=1e-6)
        assert set(out["residuals"]) == set(errors[r])
        for name, e in out["residuals"].items():
            torch.testing.assert_close(e, errors[r][name].reshape(-1), rtol=1e-5, atol=1e-6)
            assert e.abs().sum() > 0  # (the accumulator holds what was not sent)


def _sparseloco_bytes(rank: int, world: int) -> dict:
    torch.manual_seed(0)
    # norms and biases: small tensors, each its own packet were the model compressed tensor by tensor
    # (148x here, not 150x)
    model = torch.nn.Sequential(torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.Tanh(),
                                torch.nn.Linear(1024, 1024), torch.nn.LayerNorm(1024), torch.nn.Tanh(),
                                torch.nn.Linear(1024, 512))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    out = {}
    for name in ("sparseloco", "bf16"):
        outer = DiLoCo(model, sync_every=2, compressor=name)
        for step in range(2):
            x = torch.randn(8, 1024, generator=torch.Generator().manual_seed(100 * rank + step))
            opt.zero_grad()
            model(x).square().mean().backward()
            opt.step()
            outer.step()
        out[name] = (outer.stats[-1]["bytes_sent"], outer.config, str(outer.exchangers[0].compressor),
                     outer.exchangers[0].config.per_tensor)
    return out


def test_the_sparseloco_recipe_sends_150x_fewer_bytes_than_bf16() -> None:
    """1% of each chunk of 4096 of the flattened model with 2-bit values: on a 2.6M-parameter model
    with norms one sync sends at least 150x fewer bytes than the same sync in bf16; no outer
    momentum, decaying feedback."""
    a, b = run_ranks(_sparseloco_bytes, 2)
    assert a["sparseloco"][1:] == b["sparseloco"][1:]  # (the bytes may differ: index coding follows the data)
    sparse, config, spec, per_tensor = a["sparseloco"]
    assert not per_tensor and b["bf16"][3]  # the recipe's chunks cover the model; bf16 stays per tensor
    for run in (a, b):
        assert run["bf16"][0] >= 150 * run["sparseloco"][0], (run["bf16"][0], run["sparseloco"][0])
    assert spec == "topk:chunk=4096+terngrad"
    assert (config.momentum, config.outer_lr, config.feedback_decay) == (0.0, 1.0, 0.95)
