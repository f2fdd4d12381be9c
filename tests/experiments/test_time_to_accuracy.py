"""Time-to-accuracy reporting, per-link seeds, progress lines, and the bytes that cross between
emulated nodes (a real 2 nodes x 2 ranks run on shaped links)."""

from __future__ import annotations

import csv
from pathlib import Path

import pytest

from gradwire.experiments import cli, tta
from gradwire.experiments.sweep import _Progress
from test_experiment import needs_netns


def _evals(points: list[tuple[float, float]], metric: str = "accuracy") -> list[dict]:
    return [{"type": "eval", "step": 0, "wall_s": 0.0, metric: 10.0}] + [
        {"type": "eval", "step": 10 * (i + 1), "wall_s": t, metric: v} for i, (t, v) in enumerate(points)]


def _run(run_id: str, method: str, final: float, seed: int = 0, metric: str = "accuracy") -> dict:
    return {"run_id": run_id, "task": "t", "world": 4, "link": "100mbit", "seed": seed, "method": method,
            "median_step_s": 0.1, "accuracy": final if metric == "accuracy" else 40.0,
            "perplexity": final if metric == "perplexity" else None}


def test_time_to_target_is_the_first_eval_within_half_a_point_of_dense() -> None:
    runs = [_run("d", "dense", 95.0), _run("c", "topk", 94.6), _run("slow", "bf16", 94.4)]
    steps = {"d": _evals([(10.0, 90.0), (20.0, 94.6), (30.0, 95.0)]),
             "c": _evals([(2.0, 93.0), (4.0, 94.5), (6.0, 94.6)]),
             "slow": _evals([(5.0, 94.0), (10.0, 94.4)])}
    summaries = {r["run_id"]: {"bytes_sent": 100, "intra_bytes_sent_per_rank": [30, 30, 30, 30],
                               "inter_node_wire_bytes_per_rank": 80.0} for r in runs}
    rows = {r["method"]: r for r in tta.rows(runs, summaries, steps)}
    assert rows["dense"]["target"] == 94.5 and rows["dense"]["tta_s"] == 20.0
    assert rows["topk"]["tta_s"] == 4.0 and rows["topk"]["speedup"] == 5.0
    assert rows["bf16"]["tta_s"] is None and rows["bf16"]["speedup"] is None  # never within 0.5 points
    text = "\n".join(tta.markdown(list(rows.values())))
    assert "| topk | 4.0 |  | 5.00x | 94.60 |" in text and "| bf16 | - |  | - |" in text


def test_language_models_aim_at_dense_perplexity_plus_three_percent() -> None:
    runs = [_run("d", "dense", 7.0, metric="perplexity"), _run("p", "powersgd", 7.2, metric="perplexity")]
    steps = {"d": _evals([(10.0, 8.0), (20.0, 7.0)], "perplexity"),
             "p": _evals([(3.0, 7.3), (6.0, 7.2)], "perplexity")}
    summaries = {r["run_id"]: {"bytes_sent": 1} for r in runs}
    rows = {r["method"]: r for r in tta.rows(runs, summaries, steps)}
    assert rows["dense"]["target"] == pytest.approx(7.21)
    assert rows["powersgd"]["tta_s"] == 6.0 and rows["powersgd"]["speedup"] == pytest.approx(20 / 6)


def test_link_seeds_give_one_link_more_seeds() -> None:
    args = cli.build_parser().parse_args(["--methods", "none", "--links", "20mbit,100mbit", "--seeds", "0",
                                          "--link-seeds", "100mbit=0,1,2", "--nodes", "2", "--ranks-per-node", "2"])
    runs = cli.sweep_from(args).runs()
    assert [(c.link, c.seed) for c in runs] == [("20mbit", 0), ("100mbit", 0), ("100mbit", 1), ("100mbit", 2)]
    only = cli.build_parser().parse_args(["--methods", "none", "--links", "1gbit", "--link-seeds", "100mbit=0,1,2"])
    assert [(c.link, c.seed) for c in cli.sweep_from(only).runs()] == [("1gbit", 0)]  # a partial sweep
    # a bare rate names that rate's links whatever round-trip time --rtt gave them
    delayed = cli.build_parser().parse_args(["--methods", "none", "--links", "100mbit,1gbit", "--rtt", "40ms",
                                             "--link-seeds", "100mbit=0,1,2", "--nodes", "2", "--ranks-per-node", "2"])
    assert [(c.link, c.seed) for c in cli.sweep_from(delayed).runs()] == [
        ("100mbit-rtt40ms", 0), ("100mbit-rtt40ms", 1), ("100mbit-rtt40ms", 2), ("1gbit-rtt40ms", 0)]
    bad = cli.build_parser().parse_args(["--links", "20mbit", "--link-seeds", "fast=1"])
    with pytest.raises(ValueError, match="--link-seeds"):
        cli.sweep_from(bad)


def test_method_seeds_give_the_methods_that_matter_more_seeds() -> None:
    """Seeds 0-2 for dense, bf16 and auto, one seed for the rest, in one sweep and one report; a
    method's own options (`rank=4`) do not confuse the seeds after the last '='."""
    args = cli.build_parser().parse_args([
        "--methods", "none,topk:ratio=0.01,chunk=64@oktopk,powersgd:rank=4@auto", "--links", "20mbit,100mbit",
        "--seeds", "0", "--method-seeds", "none=0,1,2", "--method-seeds", "powersgd:rank=4@auto=0,2",
        "--nodes", "2", "--ranks-per-node", "2"])
    runs = [(c.link, c.seed, c.method) for c in cli.sweep_from(args).runs()]
    per_link = [(0, "none"), (0, "topk:ratio=0.01,chunk=64@oktopk"), (0, "powersgd:rank=4@auto"),
                (1, "none"), (2, "none"), (2, "powersgd:rank=4@auto")]
    assert runs == [(link, seed, m) for link in ("20mbit", "100mbit") for seed, m in per_link]
    for wrong in ("bf16=0,1", "none", "none=", "none=a"):  # not in --methods, no '=', no seeds, not a seed
        bad = cli.build_parser().parse_args(["--methods", "none", "--method-seeds", wrong])
        with pytest.raises(ValueError, match="--method-seeds|comma-separated"):
            cli.sweep_from(bad)


def test_plain_progress_shows_the_run_and_the_sweep_moving(capsys: pytest.CaptureFixture[str]) -> None:
    bar = _Progress(3, enabled=True, every=0.0)
    bar.start("dense w=4 link=20mbit", 100)
    bar.step(25)
    out = capsys.readouterr().out
    assert "dense w=4 link=20mbit: step 25/100" in out and "left; sweep 0/3 done, about" in out


def test_sweep_time_left_counts_only_runs_still_to_run(capsys: pytest.CaptureFixture[str]) -> None:
    """A resumed sweep of 30 runs of which 28 finished earlier: the time left is this run's
    and one more, not 29 more."""
    import re

    bar = _Progress(30, enabled=True, every=0.0, to_run=2)
    bar.start("dense w=4 link=20mbit", 100)
    bar.run_started -= 60.0  # a minute in, a quarter done: about 3 minutes left of this run
    bar.step(25)
    left = re.search(r"sweep 0/30 done, about (\d+)m(\d+)s left", capsys.readouterr().out)
    assert left is not None
    minutes = int(left.group(1)) + int(left.group(2)) / 60
    assert 6.5 < minutes < 7.5  # 3 of this run + 4 for the next one


@needs_netns
def test_two_nodes_report_the_bytes_that_cross_between_them(tmp_path: Path) -> None:
    """Dense ring allreduce sends about half its bytes to the other node; hierarchical top-k sends
    its node's chunk compressed, so far fewer bytes cross the shaped links."""
    args = ["--nodes", "2", "--ranks-per-node", "2", "--links", "100mbit", "--arch", "mlp", "--width", "256",
            "--methods", "none,topk@hierarchical", "--ratios", "0.01", "--steps", "30", "--eval-every", "15",
            "--no-progress", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    with open(tmp_path / "time_to_accuracy.csv") as f:
        rows = {r["method"]: r for r in csv.DictReader(f)}
    dense, hier = rows["dense"], rows["topk:ratio=0.01@hierarchical"]
    assert 0.3 * float(dense["bytes_sent"]) < float(dense["inter_wire_bytes"]) < 1.2 * float(dense["bytes_sent"])
    assert float(hier["intra_bytes_sent"]) > 0.5 * float(dense["bytes_sent"])  # dense inside the node
    assert 5 * float(hier["inter_wire_bytes"]) < float(dense["inter_wire_bytes"])  # 2 of the 30 steps are dense
    report = (tmp_path / "report.md").read_text()
    assert "## Time to accuracy" in report and "**mnist1d, 100mbit**" in report
    assert (tmp_path / "mnist1d_accuracy_vs_time_100mbit.png").stat().st_size > 0
