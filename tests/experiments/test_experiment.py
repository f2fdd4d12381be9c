"""`gradwire experiment`: real 2-rank sweeps over gloo, the report files, resume, the emulated cluster."""

from __future__ import annotations

import csv
import json
import math
import os
import pickle
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import numpy as np
import pytest
import torch

from gradwire.experiments import cli
from gradwire.experiments.cluster import EmulatedCluster, EmulationUnavailable, check_available, rate_bits
from gradwire.experiments.config import RunConfig, expand_methods, parse_method
from gradwire.experiments.launch import RunFailed, launch
from gradwire.experiments.projection import Profile, comm_seconds, step_seconds
from gradwire.experiments.report import pareto, seed_table
from gradwire.experiments.tasks import get_task

REPO = Path(__file__).resolve().parents[2]


def _can_emulate() -> str | None:
    try:
        check_available()
    except EmulationUnavailable as exc:
        return str(exc)
    return None


needs_netns = pytest.mark.skipif(_can_emulate() is not None, reason=f"no emulated cluster here: {_can_emulate()}")


def _namespaces() -> set[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    return {line.split()[0] for line in out.splitlines() if line.strip()}


# ---- the CI smoke sweep ----------------------------------------------------------------------
@pytest.fixture(scope="module")
def smoke(tmp_path_factory: pytest.TempPathFactory) -> Path:
    out = tmp_path_factory.mktemp("sweep")
    args = ["--methods", "none,topk,qsgd:bits=4,powersgd:rank=2", "--ratios", "0.01", "--worlds", "2",
            "--steps", "40", "--eval-every", "20", "--no-progress", "--out", str(out)]
    assert cli.main(args) == 0
    return out


def test_relative_out_is_relative_to_the_callers_folder(tmp_path: Path) -> None:
    """From a folder that is not the checkout, a relative --out lands there (ranks run elsewhere)."""
    done = subprocess.run([sys.executable, "-m", "gradwire.cli", "experiment", "--methods", "none", "--worlds", "2",
                           "--steps", "3", "--eval-every", "3", "--no-progress", "--out", "rel/out"],
                          capture_output=True, text=True, cwd=tmp_path, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    out = tmp_path / "rel" / "out"
    assert (out / "report.md").is_file() and (out / "runs.csv").is_file()
    assert [p.name for p in (out / "runs").iterdir()] and not (REPO / "rel").exists()
    assert "--out rel/out" in (out / "report.md").read_text()  # the command as the user typed it


def test_every_published_experiment_has_a_valid_definition() -> None:
    """experiments/<name>.sh exists for each copied report, parses, and the docs name it."""
    scripts = {p.stem: p for p in (REPO / "experiments").glob("*.sh")}
    published = {p.name for p in (REPO / "docs" / "experiments").iterdir() if p.is_dir()}
    assert published and published <= set(scripts), sorted(published - set(scripts))
    benchmarks = (REPO / "docs" / "benchmarks.md").read_text()
    for name, path in scripts.items():
        line = next(l for l in path.read_text().splitlines() if l.startswith("exec gradwire experiment "))
        args = line.removeprefix("exec gradwire experiment ").removesuffix(' "$@"').split()
        configs = cli.sweep_from(cli.build_parser().parse_args(args)).runs()  # ValueError if stale
        assert configs, name
        assert f"bash experiments/{name}.sh" in benchmarks, f"docs/benchmarks.md does not name {name}.sh"
        if name in published:
            assert f"--out experiment-results/{name}" in line
            assert f"bash experiments/{name}.sh" in (REPO / "docs" / "experiments" / name / "report.md").read_text()


def test_only_gradwire_is_installed_at_top_level() -> None:
    import tomllib

    found = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]["find"]
    assert found["include"] == ["gradwire*"]
    assert not (REPO / "experiments" / "__init__.py").exists()


def _rows(path: Path) -> list[dict[str, str]]:
    with open(path) as f:
        return list(csv.DictReader(f))


def test_smoke_writes_every_output(smoke: Path) -> None:
    for name in ("results.jsonl", "runs.csv", "steps.csv", "projection.csv", "report.md",
                 "accuracy_vs_bytes.png", "accuracy_vs_time.png", "bytes_per_step.png"):
        assert (smoke / name).is_file() and (smoke / name).stat().st_size > 0, name
    for png in smoke.glob("*.png"):
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    runs = _rows(smoke / "runs.csv")
    assert [r["method"] for r in runs] == ["dense", "topk:ratio=0.01", "qsgd:bits=4", "powersgd:rank=2"]
    report = (smoke / "report.md").read_text()
    assert "Pareto front" in report and "a projection, not a measurement" in report
    assert report.count("`gradwire experiment --task mnist1d") == 4  # each run's exact command


def test_smoke_metrics_are_in_range(smoke: Path) -> None:
    for line in (smoke / "results.jsonl").read_text().splitlines():
        summary = json.loads(line)
        acc = summary["final"]["accuracy"]
        assert 0.0 <= acc <= 100.0
        assert summary["final"]["test_loss"] > 0 and math.isfinite(summary["final"]["test_loss"])
        assert summary["config"]["seed"] == 0 and summary["data"]  # seed and data fingerprint recorded
        assert len(summary["bytes_sent_per_rank"]) == 2
    steps = [r for r in _rows(smoke / "steps.csv") if r["type"] == "step"]
    assert len(steps) == 4 * 40
    assert all(math.isfinite(float(r["loss"])) and float(r["step_s"]) > 0 for r in steps)


def test_smoke_bytes_shrink_by_the_expected_factor(smoke: Path) -> None:
    runs = {r["method"]: r for r in _rows(smoke / "runs.csv")}
    dense = int(runs["dense"]["bytes_sent"])
    params = int(runs["dense"]["params"])
    assert dense == 40 * 4 * params  # fp32, every step
    steps = [r for r in _rows(smoke / "steps.csv") if r["type"] == "step" and int(r["step"]) > 2]
    per_step = {}
    for r in steps:
        per_step.setdefault(r["method"], []).append(int(r["bytes_sent"]))
    # top-k 1% sends ~1% of the values plus their indices: at least 40x fewer bytes per compressed step
    assert max(per_step["topk:ratio=0.01"]) * 40 < 4 * params
    # 4-bit QSGD: ~5 bits per element with its sign: between 5x and 8x fewer
    assert 5 * max(per_step["qsgd:bits=4"]) < 4 * params < 8 * min(per_step["qsgd:bits=4"])
    # over the run the 2 dense warm-up steps dominate top-k's total: 40 / (2 + 38/70) ~ 15x
    assert dense / int(runs["topk:ratio=0.01"]["bytes_sent"]) > 12
    assert int(runs["powersgd:rank=2"]["bytes_sent"]) * 8 < dense


def test_sweep_resumes_by_skipping_finished_runs(smoke: Path, capsys: pytest.CaptureFixture[str]) -> None:
    before = {p: p.stat().st_mtime_ns for p in smoke.glob("runs/*/summary.json")}
    started = time.monotonic()
    args = ["--methods", "none,topk,qsgd:bits=4,powersgd:rank=2", "--ratios", "0.01", "--worlds", "2",
            "--steps", "40", "--eval-every", "20", "--out", str(smoke)]
    assert cli.main(args) == 0
    assert time.monotonic() - started < 30  # nothing retrained
    assert {p: p.stat().st_mtime_ns for p in smoke.glob("runs/*/summary.json")} == before
    assert capsys.readouterr().out.count("[cached]") == 4


# ---- the FSDP engine -----------------------------------------------------------------------
def test_fsdp_engine_runs_the_sweep_through_the_compressed_reduce_scatter(tmp_path: Path) -> None:
    args = ["--engine", "fsdp", "--methods", "none,int8", "--worlds", "2", "--steps", "10", "--eval-every", "10",
            "--no-progress", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    runs = {r["method"]: r for r in _rows(tmp_path / "runs.csv")}
    assert {r["strategy"] for r in runs.values()} == {"reduce_scatter", "alltoall"}
    assert all("-fsdp-" in r["run_id"] for r in runs.values())
    dense, params = int(runs["dense"]["bytes_sent"]), int(runs["dense"]["params"])
    assert dense == 10 * 4 * params // 2  # 2 ranks: a rank sends the other half of its fp32 gradient
    assert 3 * int(runs["int8"]["bytes_sent"]) < dense < 4 * int(runs["int8"]["bytes_sent"])
    assert (tmp_path / "report.md").read_text().count("--engine fsdp") == 2  # each run's command reruns it


# ---- the other tasks ----------------------------------------------------------------------
def test_charlm_trains_on_two_ranks_and_reports_perplexity(tmp_path: Path) -> None:
    cfg = RunConfig("charlm", "transformer", 64, "topk:ratio=0.1", 2, 6, 4, 0.003, eval_every=6)
    summary = launch(cfg, tmp_path / cfg.run_id)
    assert 1.0 < summary["final"]["perplexity"] < 300.0
    assert 0.0 <= summary["final"]["accuracy"] <= 100.0  # percent.0


def test_charlm_has_a_larger_lm_of_several_million_parameters() -> None:
    """`--arch gpt`: the outer-loop runs' larger LM, the same causal blocks six deep at width 256."""
    from gradwire.experiments.tasks import charlm_model

    small, gpt = charlm_model("transformer", 0), charlm_model("gpt", 0)
    n = sum(p.numel() for p in gpt.parameters())
    assert 4_000_000 < n < 6_000_000 and n > 10 * sum(p.numel() for p in small.parameters())
    x = torch.randint(0, 256, (2, 64))
    logits = gpt(x)
    assert logits.shape == (2, 64, 256)
    x2 = x.clone()
    x2[:, 40:] = (x2[:, 40:] + 1) % 256  # a causal model: later bytes do not change earlier outputs
    assert torch.allclose(gpt(x2)[:, :40], logits[:, :40], atol=1e-5)
    with pytest.raises(ValueError, match="valid: transformer, gpt"):
        charlm_model("vgg", 0)


def test_charlm_gets_its_tuned_lm_settings_unless_told_otherwise(tmp_path: Path) -> None:
    def options(argv: str) -> dict[str, dict]:
        runs = cli.sweep_from(cli.build_parser().parse_args(argv.split())).runs()
        return {c.method: c.hook_options() for c in runs}

    tuned = get_task("charlm").tuned
    lm = options("--task charlm --methods none,topk,powersgd:rank=4 --ratios 0.01")
    assert lm == {"none": {}, "topk:ratio=0.01": {"warmup": tuned.warmup, "precondition": "adam"},
                  "powersgd:rank=4": {"start_iter": tuned.powersgd_start}}
    assert options("--task charlm --methods topk --ratios 0.01 --precondition none --warmup 0 --start-iter 5") == {
        "topk:ratio=0.01": {"start_iter": 5}}
    assert options("--methods topk,powersgd:rank=4 --ratios 0.01") == {"topk:ratio=0.01": {}, "powersgd:rank=4": {}}
    assert options("--task charlm --methods topk --ratios 0.01 --engine fsdp") == {"topk:ratio=0.01": {}}
    assert options("--task charlm --methods topk@auto,topk@hierarchical --ratios 0.01") == {  # auto: no warm-up
        "topk:ratio=0.01@auto": {"precondition": "adam"},
        "topk:ratio=0.01@hierarchical": {"warmup": tuned.warmup, "precondition": "adam"}}
    # preconditioned top-k at the task's own lr: lr x sqrt(world); an explicit --lr is kept as given
    lrs = {(c.method, c.world): c.lr for c in cli.sweep_from(cli.build_parser().parse_args(
        "--task charlm --methods none,topk --ratios 0.01 --worlds 1,4".split())).runs()}
    assert lrs == {("none", 1): 0.003, ("topk:ratio=0.01", 1): 0.003, ("none", 4): 0.003, ("topk:ratio=0.01", 4): 0.006}
    explicit = cli.sweep_from(cli.build_parser().parse_args("--task charlm --methods topk --worlds 4 --lr 0.003".split()))
    assert {c.lr for c in explicit.runs()} == {0.003}
    # and a real 2-rank run with them: the optimizer is SGD over Adam's directions, the warm-up is sent
    cfg = RunConfig("charlm", "transformer", 64, "topk:ratio=0.1", 2, 6, 4, 0.003, eval_every=6, warmup=3,
                    precondition="adam")
    summary = launch(cfg, tmp_path / cfg.run_id)
    assert 1.0 < summary["final"]["perplexity"] < 300.0
    steps = [json.loads(line) for line in (tmp_path / cfg.run_id / "steps.jsonl").read_text().splitlines()]
    sent = [r["bytes_sent"] for r in steps if r["type"] == "step"]
    assert sent[2] > sent[3] > sent[4] > sent[5]  # 25% -> 10% over 3 steps, then 10%


def _fake_cifar(root: Path, per_batch: int = 8) -> Path:
    folder = root / "cifar-10-batches-py"
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for name in [f"data_batch_{i}" for i in range(1, 6)] + ["test_batch"]:
        batch = {b"data": rng.integers(0, 256, (per_batch, 3072), dtype=np.uint8),
                 b"labels": rng.integers(0, 10, per_batch).tolist()}
        with open(folder / name, "wb") as f:
            pickle.dump(batch, f)
    return root


def test_cifar10_reads_the_python_release_format(tmp_path: Path) -> None:
    task = get_task("cifar10")
    ds = task.load(_fake_cifar(tmp_path), tmp_path)
    assert ds.x.shape == (40, 3, 32, 32) and ds.x_test.shape == (8, 3, 32, 32)
    model = task.model("resnet20", 0)
    assert 0.26e6 < sum(p.numel() for p in model.parameters()) < 0.28e6  # ResNet-20: 0.27M parameters
    assert model(ds.x[:2]).shape == (2, 10)
    with pytest.raises(ValueError, match="--data-dir"):
        task.load(None, tmp_path)
    with pytest.raises(FileNotFoundError, match="missing data_batch_1"):
        task.load(tmp_path / "nowhere", tmp_path)


def test_a_failing_rank_fails_the_run_with_its_log(tmp_path: Path) -> None:
    cfg = RunConfig("cifar10", "resnet20", 0, "none", 2, 3, 4, 0.05, data_dir=str(tmp_path / "missing"))
    with pytest.raises(RunFailed, match="cifar-10-batches-py"):
        launch(cfg, tmp_path / "run", timeout=120)


# ---- methods and bad input -----------------------------------------------------------------
def test_methods_expand_over_ratios_and_map_onto_strategies() -> None:
    assert expand_methods(["none", "topk", "topk+fp16", "qsgd:bits=4", "topk"], [0.01, 0.1]) == [
        "none", "topk:ratio=0.01", "topk:ratio=0.1", "topk:ratio=0.01+fp16", "topk:ratio=0.1+fp16", "qsgd:bits=4"]
    assert parse_method("none").strategy == "dense"
    assert parse_method("randomk:ratio=0.1").strategy == "allreduce"
    assert not parse_method("randomk:ratio=0.1").error_feedback  # unbiased: no error feedback
    topk = parse_method("topk:ratio=0.01")
    assert (topk.strategy, topk.error_feedback) == ("allgather", True)
    assert parse_method("powersgd:rank=4").options == {"rank": 4}
    with pytest.raises(ValueError, match="rank=<int>"):
        parse_method("powersgd:bits=4")
    with pytest.raises(ValueError, match="topk"):
        parse_method("topk:ratio=2")
    # one method's own strategy
    assert expand_methods(["topk@oktopk", "topk+fp16@allgather"], [0.01]) == [
        "topk:ratio=0.01@oktopk", "topk:ratio=0.01+fp16@allgather"]
    ok = parse_method("topk:ratio=0.01@oktopk", strategy="allgather")
    assert (ok.label, ok.compressor, ok.strategy, ok.error_feedback) == (
        "topk:ratio=0.01@oktopk", "topk", "oktopk", True)
    with pytest.raises(ValueError, match="unknown strategy 'nosuch'"):
        parse_method("topk:ratio=0.01@nosuch")


def test_a_key_value_piece_continues_the_method_before_it() -> None:
    """Methods whose own parameters hold commas can be listed: diloco's options, topk's chunk."""
    assert cli.split_methods("none, diloco:H=30,fragments=3,delay=2+fp4,topk:ratio=0.01,chunk=4096+terngrad,bf16") == [
        "none", "diloco:H=30,fragments=3,delay=2+fp4", "topk:ratio=0.01,chunk=4096+terngrad", "bf16"]
    runs = cli.sweep_from(cli.build_parser().parse_args(
        ["--methods", "diloco:H=30,fragments=3,delay=2+fp4,diloco:H=30+sparseloco", "--worlds", "2"])).runs()
    assert [r.method for r in runs] == ["diloco:H=30,fragments=3,delay=2+fp4", "diloco:H=30+sparseloco"]
    assert runs[0].resolved().outer == {"sync_every": 30, "fragments": 3, "delay": 2}


@pytest.mark.parametrize("args, message", [
    (["--methods", "nosuch"], "nosuch"),
    (["--links", "100mb"], "100mb"),
    (["--worlds", "0"], "world sizes"),
    (["--arch", "vgg"], "unknown arch"),
    (["--ratios", "a"], "comma-separated"),
    (["--engine", "hsdp"], "give --ranks-per-node >= 2"),
    (["--nodes", "2", "--ranks-per-node", "0"], "--ranks-per-node must be >= 1"),
    (["--worlds", "3", "--ranks-per-node", "2"], "do not split into nodes of 2"),
    (["--engine", "fsdp", "--methods", "powersgd:rank=2"], "powersgd needs an all-reduce"),
    (["--precondition", "lamb"], "precondition must be 'adam'"),
])
def test_bad_options_fail_clearly_before_running(args: list[str], message: str, tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    assert cli.main(args + ["--out", str(tmp_path)]) == 2
    assert message in capsys.readouterr().err
    assert not (tmp_path / "runs").exists()


def test_without_ip_and_tc_the_cli_says_so_and_offers_the_model(tmp_path: Path) -> None:
    env = dict(os.environ, PATH=str(tmp_path))  # an empty PATH: no ip, no tc
    done = subprocess.run([sys.executable, "-m", "gradwire.cli", "experiment", "--links", "100mbit", "--out",
                           str(tmp_path / "o")], capture_output=True, text=True, env=env, cwd=REPO)
    assert done.returncode == 2
    assert "needs iproute2's ip and tc" in done.stderr and "--links none" in done.stderr
    assert "alpha-beta" in done.stderr


# ---- projection and pareto -------------------------------------------------------------------
def test_alpha_beta_projection_follows_the_ring_formulas() -> None:
    dense = Profile("dense", "dense", 4, 4e6, 2, 0.01, 0.0, 0.0)
    sparse = Profile("topk", "allgather", 4, 5e4, 1, 0.01, 0.002, 0.003)
    beta = 1e9 / 8
    assert comm_seconds(dense, 8, 1e-5, beta) == pytest.approx(2 * 2 * 7 * 1e-5 + 2 * 7 / 8 * 4e6 / beta)
    assert comm_seconds(sparse, 8, 1e-5, beta) == pytest.approx(7 * 1e-5 + 7 * 5e4 / beta)
    assert step_seconds(sparse, 8, "1gbit", 1e-5) == pytest.approx(0.01 + 0.002 + 0.003 * 7 / 3 + 7e-5 + 7 * 5e4 / beta)
    # allgather grows with P; the ring allreduce's bandwidth term does not
    assert comm_seconds(sparse, 1024, 0, beta) > comm_seconds(dense, 1024, 0, beta)
    assert comm_seconds(sparse, 8, 0, beta) < comm_seconds(dense, 8, 0, beta)


def test_pareto_keeps_only_undominated_runs() -> None:
    base = {"task": "t", "world": 2, "link": "none"}
    rows = [dict(base, method="a", bytes_sent=100, accuracy=90.0), dict(base, method="b", bytes_sent=10, accuracy=85.0),
            dict(base, method="c", bytes_sent=50, accuracy=80.0), dict(base, method="d", bytes_sent=10, accuracy=85.0)]
    assert [r["method"] for r in pareto(rows)] == ["b", "d", "a"]


def test_seed_table_averages_over_seeds_only_when_there_are_several() -> None:
    base = {"task": "t", "world": 2, "link": "none", "bytes_sent": 100}
    assert seed_table([dict(base, method="a", accuracy=90.0), dict(base, method="b", accuracy=80.0)]) == []
    lines = seed_table([dict(base, method="a", accuracy=90.0), dict(base, method="a", accuracy=93.0)])
    assert "| a | 2 | none | 2 | 91.50 | 90.00 | 93.00 | 100 B |" in lines


# ---- the emulated cluster -----------------------------------------------------------------------
def test_rates_parse() -> None:
    assert rate_bits("100mbit") == 1e8 and rate_bits("1gbit") == 1e9 and rate_bits("2.5Gbit") == 2.5e9
    with pytest.raises(ValueError, match="mbit"):
        rate_bits("fast")


@needs_netns
def test_emulated_links_are_rate_limited_and_torn_down() -> None:
    server = textwrap.dedent("""
        import socket, sys, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((sys.argv[1], 5555)); s.listen(1); print("ready", flush=True)
        c, _ = s.accept(); n = 0; t = time.monotonic()
        while (b := c.recv(1 << 20)):
            n += len(b)
        print(n / (time.monotonic() - t), flush=True)
    """)
    client = "import socket, sys; s = socket.create_connection((sys.argv[1], 5555)); s.sendall(b'x' * (6 << 20))"
    with EmulatedCluster(2, "20mbit") as c:
        names = set(c.namespaces)
        assert names <= _namespaces() and len(names) == 3
        srv = subprocess.Popen(c.prefix(1) + [sys.executable, "-c", server, c.address(1)], stdout=subprocess.PIPE,
                               text=True)
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        subprocess.run(c.prefix(0) + [sys.executable, "-c", client, c.address(1)], check=True, timeout=60)
        rate = float(srv.stdout.readline())
        srv.wait(timeout=10)
    assert 1.5e6 < rate < 3.0e6  # 20 Mbit/s = 2.5 MB/s
    assert not names & _namespaces()


def test_hsdp_engine_compresses_the_all_reduce_between_nodes(tmp_path: Path) -> None:
    """2 nodes x 2 ranks: FSDP2 shards inside a node, gradwire compresses the cross-node all-reduce."""
    args = ["--engine", "hsdp", "--methods", "none,powersgd:rank=2", "--worlds", "4", "--ranks-per-node", "2",
            "--steps", "6", "--eval-every", "6", "--no-progress", "--out", str(tmp_path)]
    assert cli.main(args) == 0
    runs = {r["method"]: r for r in _rows(tmp_path / "runs.csv")}
    assert set(runs) == {"dense", "powersgd:rank=2"}
    assert 8 * int(runs["powersgd:rank=2"]["bytes_sent"]) < int(runs["dense"]["bytes_sent"])
    assert all("-n2x2-" in p.name for p in (tmp_path / "runs").iterdir())
    assert "--ranks-per-node 2" in (tmp_path / "report.md").read_text()


@needs_netns
def test_a_node_s_ranks_talk_fast_and_share_one_shaped_link() -> None:
    """2 nodes x 2 ranks at 20 Mbit/s: inside a node the ranks share its namespace (unshaped); between
    nodes 20 Mbit/s = 2.5 MB/s."""
    server = textwrap.dedent("""
        import socket, sys, time
        s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        s.bind((sys.argv[1], int(sys.argv[2]))); s.listen(1); print("ready", flush=True)
        c, _ = s.accept(); n = 0; t = time.monotonic()
        while (b := c.recv(1 << 20)):
            n += len(b)
        print(n / (time.monotonic() - t), flush=True)
    """)
    client = ("import socket, sys; s = socket.create_connection((sys.argv[1], int(sys.argv[2]))); "
              "s.sendall(b'x' * (int(sys.argv[3]) << 20))")

    def rate(c: EmulatedCluster, src: int, dst: int, port: int, mib: int) -> float:
        srv = subprocess.Popen(c.prefix(dst) + [sys.executable, "-c", server, c.address(dst), str(port)],
                               stdout=subprocess.PIPE, text=True)
        assert srv.stdout is not None and srv.stdout.readline().strip() == "ready"
        subprocess.run(c.prefix(src) + [sys.executable, "-c", client, c.address(dst), str(port), str(mib)],
                       check=True, timeout=60)
        out = float(srv.stdout.readline())
        srv.wait(timeout=10)
        return out

    with EmulatedCluster(4, "20mbit", ranks_per_node=2) as c:
        assert len(c.namespaces) == 3  # the switch and one per node
        assert c.ns(0) == c.ns(1) != c.ns(2) == c.ns(3) and c.address(1) == c.address(0) != c.address(2)
        inside = rate(c, 1, 0, 5556, 64)
        between = rate(c, 1, 2, 5557, 6)
    assert 1.5e6 < between < 3.0e6
    assert inside > 20 * between


@needs_netns
@pytest.mark.parametrize("sig", [signal.SIGINT, signal.SIGTERM])
def test_teardown_on_ctrl_c_and_sigterm(sig: signal.Signals) -> None:
    # a background job of a non-interactive shell starts with SIGINT ignored: take Ctrl-C as a terminal would
    code = ("import signal, time; from gradwire.experiments.cluster import EmulatedCluster\n"
            "signal.signal(signal.SIGINT, signal.default_int_handler)\n"
            "with EmulatedCluster(2, '100mbit') as c:\n    print(' '.join(c.namespaces), flush=True); time.sleep(60)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True, cwd=REPO)
    try:
        assert proc.stdout is not None
        names = set(proc.stdout.readline().split())
        assert len(names) == 3 and names <= _namespaces()
        proc.send_signal(sig)
        proc.wait(timeout=30)
    finally:
        proc.kill()
    assert not names & _namespaces()


@needs_netns
def test_namespaces_of_a_dead_owner_are_removed() -> None:
    code = ("import os; from gradwire.experiments.cluster import EmulatedCluster\n"
            "c = EmulatedCluster(1, '1gbit'); c.build(); print(' '.join(c.namespaces), flush=True); os._exit(9)\n")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=REPO)
    names = set(done.stdout.split())
    assert len(names) == 2 and names <= _namespaces()  # the killed owner left them behind
    with EmulatedCluster(1, "1gbit"):
        assert not names & _namespaces()


@needs_netns
def test_a_run_inside_the_emulated_cluster(tmp_path: Path) -> None:
    cfg = RunConfig("mnist1d", "mlp", 64, "topk:ratio=0.1", 2, 5, 8, 0.05, eval_every=5, link="1gbit")
    with EmulatedCluster(2, cfg.link) as c:
        summary = launch(cfg, tmp_path / "run", c, timeout=180)
        names = set(c.namespaces)
    assert 0.0 <= summary["final"]["accuracy"] <= 100.0  # percent
    assert 0 < summary["bytes_sent"] < summary["dense_bytes"]  # top-k 10% sent less than dense would
    # the exchange crossed the emulated link between the two nodes (gloo's framing on top)
    assert summary["inter_node_wire_bytes_per_rank"] >= summary["bytes_sent"]
    assert not names & _namespaces()


@needs_netns
def test_a_crashed_rank_inside_the_cluster_still_tears_it_down(tmp_path: Path) -> None:
    cfg = RunConfig("cifar10", "resnet20", 0, "none", 2, 3, 4, 0.05, link="1gbit", data_dir=str(tmp_path / "no"))
    names: set[str] = set()
    with pytest.raises(RunFailed):
        with EmulatedCluster(2, cfg.link) as c:
            names = set(c.namespaces)
            launch(cfg, tmp_path / "run", c, timeout=120)
    assert names and not names & _namespaces()
