"""torchft's DiLoCo (the anchor of issue 28) against gradwire's on the same model, data, H and
seed: two replicas, real processes, gloo on loopback, torchft's own lighthouse and manager."""

from __future__ import annotations

import pytest
import torch
from frameworks import require

require("torchft", extra="test")  # (CI sets GRADWIRE_REQUIRE_FRAMEWORKS=1: a missing torchft fails there)

from gradwire.experiments.torchft_anchor import TorchftDiLoCo  # noqa: E402
from gradwire.outer import DiLoCo  # noqa: E402
from multiproc import run_ranks  # noqa: E402


def _model() -> torch.nn.Module:
    torch.manual_seed(0)  # the same initial weights on every replica, in both runs
    return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 2))


def _inner_step(model: torch.nn.Module, opt: torch.optim.Optimizer, rank: int, step: int) -> None:
    gen = torch.Generator().manual_seed(1000 * rank + step)
    x, y = torch.randn(5, 8, generator=gen), torch.randn(5, 2, generator=gen)
    opt.zero_grad()
    torch.nn.functional.mse_loss(model(x), y).backward()
    opt.step()


def _both(rank: int, world: int, options: dict, steps: int) -> dict:
    """gradwire's DiLoCo, then torchft's, in the same process on the same batches."""
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    ours = DiLoCo(model, compressor="none", **options)
    for step in range(steps):
        _inner_step(model, opt, rank, step)
        ours.step()
    ours.finish()

    model_ft = _model()
    opt_ft = torch.optim.SGD(model_ft.parameters(), lr=0.1)
    anchor = TorchftDiLoCo(model_ft, opt_ft, rank=rank, world=world, timeout_s=30, **options)
    with anchor:
        for step in range(steps):
            _inner_step(model_ft, opt_ft, rank, step)
    anchor.close()
    return {"ours": [p.detach().clone() for p in model.parameters()], "ours_stats": ours.stats,
            "ours_global": [g.detach().clone() for g in ours.globals],
            "torchft": [p.detach().clone() for p in model_ft.parameters()], "torchft_stats": anchor.stats,
            "torchft_global": anchor.global_weights()}


@pytest.mark.parametrize("options, steps", [(dict(sync_every=3), 9), (dict(sync_every=4, fragments=2, mix=0.5), 8)],
                         ids=["diloco", "streaming-mix"])
def test_torchft_diloco_matches_gradwire_uncompressed(options: dict, steps: int, monkeypatch) -> None:
    monkeypatch.setenv("RUST_LOG", "warn")  # torchft's Rust side logs every quorum at INFO otherwise
    a, b = run_ranks(_both, 2, options, steps, timeout=90)
    for rank in (a, b):
        for ft, ours in zip(rank["torchft"], rank["ours"]):
            torch.testing.assert_close(ft, ours, rtol=1e-5, atol=1e-6)
        for ft, ours in zip(rank["torchft_global"], rank["ours_global"]):
            torch.testing.assert_close(ft, ours, rtol=1e-5, atol=1e-6)
        # the same pseudo-gradient bytes, sync by sync (fp32 payload, not the ring's traffic)
        assert [s["bytes_sent"] for s in rank["torchft_stats"]] == [s["bytes_sent"] for s in rank["ours_stats"]]
        assert [s["step"] for s in rank["torchft_stats"]] == [s["step"] for s in rank["ours_stats"]]
    assert all(torch.equal(x, y) for x, y in zip(a["torchft_global"], b["torchft_global"]))
    same = all(torch.equal(x, y) for x, y in zip(a["torchft"], b["torchft"]))
    # mixing keeps a share of each replica's own weights (and a streamed fragment other than the
    # last one synced has trained on alone since its sync)
    assert same == (options.get("fragments", 1) == 1 and not options.get("mix"))
    assert len(a["torchft_stats"]) == steps // options["sync_every"] * options.get("fragments", 1)


def test_torchft_issues_a_delayed_fragment_tau_steps_before_its_sync(monkeypatch) -> None:
    """Streaming with delay tau: torchft sends fragment k's pseudo-gradient tau steps before its
    sync step and applies it at that step; gradwire sends at the sync step and applies tau later,
    so the two runs are the same schedule shifted by tau (not the same weights)."""
    monkeypatch.setenv("RUST_LOG", "warn")
    a, b = run_ranks(_both, 2, dict(sync_every=4, fragments=2, delay=1), 8, timeout=90)
    assert [s["step"] for s in a["torchft_stats"]] == [1, 3, 5, 7]
    assert [s["launched"] for s in a["ours_stats"]] == [2, 4, 6, 8]
    assert all(torch.equal(x, y) for x, y in zip(a["torchft_global"], b["torchft_global"]))


def test_gradwire_experiment_runs_torchft_s_diloco_beside_its_own(tmp_path, monkeypatch) -> None:
    """`torchft-diloco:H=10` in a real 2-rank `gradwire experiment` sweep trains exactly as
    `diloco:H=10`: the same final metrics and bytes (the same algorithm, fp32 over an allreduce),
    so the WAN sweeps can run torchft's DiLoCo as one more method."""
    import json

    from gradwire.experiments import cli
    from gradwire.experiments.config import parse_method

    monkeypatch.setenv("RUST_LOG", "warn")
    out = tmp_path / "sweep"
    assert cli.main(["--methods", "diloco:H=10,torchft-diloco:H=10", "--worlds", "2", "--steps", "20",
                     "--eval-every", "20", "--no-progress", "--out", str(out)]) == 0
    runs = {json.loads(p.read_text())["method"]["label"]: json.loads(p.read_text())
            for p in out.glob("runs/*/summary.json")}
    ours, ft = runs["diloco:H=10"], runs["torchft-diloco:H=10"]
    assert ft["method"]["strategy"] == "torchft" and ft["method"]["outer"] == {"sync_every": 10}
    assert ft["final"] == ours["final"]
    assert ft["bytes_sent"] == ours["bytes_sent"] > 0 and ft["syncs"] == ours["syncs"] == 2
    for bad, message in [("torchft-diloco:H=10+int8", "no compressor"), ("torchft-diloco:H=10,fragments=3", "multiple"),
                         ("torchft-diloco:fragments=2", "how often"), ("torchft-diloco:H=10,decay=0.5", "takes H=")]:
        with pytest.raises(ValueError, match=message):
            parse_method(bad)
