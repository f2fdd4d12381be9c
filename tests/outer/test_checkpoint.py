"""DiLoCo's state through torch.distributed.checkpoint on real gloo ranks: a resumed run
continues bit for bit, each process getting back its own error feedback."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from gradwire.outer import DiLoCo, checkpoint
from multiproc import run_ranks

OPTIONS = dict(sync_every=4, fragments=2, compressor="topk:ratio=0.2,chunk=16", feedback_decay=0.9)


def _model() -> torch.nn.Module:
    torch.manual_seed(0)
    return torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))


def _steps(model, opt, outer, rank: int, steps: range) -> None:
    for step in steps:
        gen = torch.Generator().manual_seed(1000 * rank + step)
        opt.zero_grad()
        torch.nn.functional.mse_loss(model(torch.randn(6, 16, generator=gen)), torch.randn(6, 4, generator=gen)).backward()
        opt.step()
        outer.step()


def _resume(rank: int, world: int, path: str) -> dict:
    model = _model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    outer = DiLoCo(model, **OPTIONS)
    _steps(model, opt, outer, rank, range(8))  # both fragments synced twice: momentum and residuals exist
    checkpoint.save(outer, path, model=model.state_dict(), optim=opt.state_dict())
    residuals = [{k: v.clone() for k, v in e.strategy.feedback.residuals.items()} for e in outer.exchangers]
    _steps(model, opt, outer, rank, range(8, 15))
    straight = [p.detach().clone() for p in model.parameters()]

    model2 = torch.nn.Sequential(torch.nn.Linear(16, 32), torch.nn.Tanh(), torch.nn.Linear(32, 4))  # other weights
    opt2 = torch.optim.AdamW(model2.parameters(), lr=1e-2)
    outer2 = DiLoCo(model2, **OPTIONS)
    _steps(model2, opt2, outer2, rank, range(1))  # (AdamW's state exists, so DCP has somewhere to load it)
    outer2 = DiLoCo(model2, **OPTIONS)
    state = {"model": model2.state_dict(), "optim": opt2.state_dict()}
    checkpoint.load(outer2, path, **state)
    model2.load_state_dict(state["model"])
    opt2.load_state_dict(state["optim"])
    loaded = [{k: v.clone() for k, v in e.strategy.feedback.residuals.items()} for e in outer2.exchangers]
    _steps(model2, opt2, outer2, rank, range(8, 15))
    wrong = DiLoCo(model2, **{**OPTIONS, "feedback_decay": 0.5})
    try:
        checkpoint.load(wrong, path)
        refused = "no error"
    except ValueError as e:
        refused = str(e)
    return {"straight": straight, "resumed": [p.detach().clone() for p in model2.parameters()],
            "residuals": residuals, "loaded": loaded, "inner_step": outer2.inner_step, "refused": refused}


def test_a_run_resumed_from_a_dcp_checkpoint_continues_bit_identically(tmp_path) -> None:
    results = run_ranks(_resume, 2, str(tmp_path / "ckpt"))
    for r in results:
        assert r["inner_step"] == 15
        assert all(torch.equal(x, y) for x, y in zip(r["straight"], r["resumed"]))
        for mine, back in zip(r["residuals"], r["loaded"]):
            assert mine.keys() == back.keys() and all(torch.equal(mine[k], back[k]) for k in mine)
        assert "feedback_decay=0.9" in r["refused"] and "feedback_decay=0.5" in r["refused"]
    # each process got its own residuals back, and they differ between the replicas
    assert any(not torch.equal(results[0]["loaded"][0][k], results[1]["loaded"][0][k]) for k in results[0]["loaded"][0])


def _in_flight(rank: int, world: int, path: str) -> str:
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    outer = DiLoCo(model, sync_every=4, fragments=2, delay=1)
    _steps(model, opt, outer, rank, range(2))  # fragment 0 launched at step 2, lands at 3
    try:
        checkpoint.save(outer, path)
    except RuntimeError as e:
        outer.finish()
        return str(e)
    return "saved"


def test_save_refuses_while_an_exchange_is_in_flight(tmp_path) -> None:
    for message in run_ranks(_in_flight, 2, str(tmp_path / "ckpt")):
        assert "still being exchanged" in message


def test_the_outer_loop_imports_dcp_only_when_a_checkpoint_is_used() -> None:
    """An experiment rank imports the outer loop but never saves: DCP (DTensor, sympy; about a
    second) stays out of its start-up, and `gradwire.outer.checkpoint` still works when named."""
    probe = ("import sys, gradwire.experiments.worker, gradwire.outer as outer\n"
             "before = 'torch.distributed.checkpoint' in sys.modules\n"
             "save = outer.checkpoint.save\n"
             "print(before, 'torch.distributed.checkpoint' in sys.modules, 'checkpoint' in outer.__all__)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.split() == ["False", "True", "True"], done.stdout
    with pytest.raises(AttributeError, match="no attribute 'checkpont'"):
        import gradwire.outer

        gradwire.outer.checkpont  # noqa: B018 - a misspelt name fails as for any module
