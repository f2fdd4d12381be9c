"""Expand a sweep into runs, run each (skipping finished ones), show progress, collect summaries."""

from __future__ import annotations

import json
import math
import shlex
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, Callable

from .cluster import EmulatedCluster
from gradwire.hooks.ddp import WARMUP_STRATEGIES
from .config import SPARSIFIERS, RunConfig, expand_methods, parse_method
from .tasks import Tuned, get_task
from .launch import launch


@dataclass
class Sweep:
    task: str
    arch: str
    width: int
    methods: list[str]
    ratios: list[float]
    worlds: list[int]
    links: list[str]
    steps: int
    batch: int
    lr: float
    seeds: list[int] = field(default_factory=lambda: [0])
    eval_every: int = 100
    strategy: str = "default"
    error_feedback: str = "auto"
    data_dir: str | None = None
    min_numel: int = 0
    engine: str = "ddp"
    ranks_per_node: int = 1
    link_seeds: dict[str, list[int]] = field(default_factory=dict)  # seeds of one link instead of `seeds`
    method_seeds: dict[str, list[int]] = field(default_factory=dict)  # seeds of one method (as in `methods`)
    start_iter: int = -1  # -1: the task's default for PowerSGD (Task.tuned), else the hook's
    warmup: int = -1  # -1: the task's default for sparsifiers
    precondition: str = "auto"  # "auto" (the task's default for sparsifiers), "none" or a spec such as "adam"
    task_lr: bool = False  # lr is the task's default (so Task.tuned may scale it)

    def runs(self) -> list[RunConfig]:
        out = []
        for link in self.links:
            default = self.link_seeds.get(link, self.seeds)
            seeds_of = {m: self.method_seeds.get(item, default)
                        for item in self.methods for m in expand_methods([item], self.ratios)}
            for world in self.worlds:
                for seed in dict.fromkeys(s for seeds in [default, *seeds_of.values()] for s in seeds):
                    for method in expand_methods(self.methods, self.ratios):
                        if seed not in seeds_of[method]:
                            continue
                        start, warmup, pre = self._tuned(method)
                        cfg = RunConfig(self.task, self.arch, self.width, method, world, self.steps, self.batch,
                                        self._lr(pre, world), seed, self.eval_every, link, self.strategy, self.error_feedback,
                                        self.data_dir, self.min_numel, self.engine, self.ranks_per_node,
                                        start, warmup, pre)
                        if not cfg.uses_min_numel():  # bad method strings fail here, before anything runs
                            cfg = replace(cfg, min_numel=0)  # irrelevant to this method: same run id either way
                        if cfg.resolved().strategy == "dense":
                            cfg = replace(cfg, start_iter=-1, warmup=0, precondition="")  # likewise
                        out.append(cfg)
        return out

    def _lr(self, precondition: str, world: int) -> float:
        tuned = get_task(self.task).tuned
        scale = self.task_lr and tuned.sqrt_world_lr and precondition and precondition == tuned.precondition
        return self.lr * math.sqrt(world) if scale else self.lr

    def _tuned(self, method: str) -> tuple[int, int, str]:
        """(start_iter, warmup, precondition) of one method: explicit options, else the task's defaults."""
        tuned = get_task(self.task).tuned if self.engine == "ddp" else Tuned()  # (options of the DDP hook)
        name = method.split(":")[0].split("+")[0].split("@")[0]
        sparsifier, powersgd = name in SPARSIFIERS, name == "powersgd"
        start = self.start_iter if self.start_iter >= 0 else tuned.powersgd_start if powersgd else -1
        if self.warmup >= 0:
            warmup = self.warmup
        else:  # the task's warm-up where the strategy can change its ratio per step (not auto, oktopk, artopk)
            via = parse_method(method, self.strategy, self.error_feedback).strategy if sparsifier else ""
            warmup = tuned.warmup if via in WARMUP_STRATEGIES else 0
        pre = {"none": "", "auto": tuned.precondition if sparsifier else ""}.get(self.precondition, self.precondition)
        return start, warmup, pre


def command_for(cfg: RunConfig, out: Path) -> str:
    """The exact command that reruns this one run (the sweep's resume makes it reuse a finished one)."""
    parts = ["gradwire", "experiment", "--task", cfg.task, "--arch", cfg.arch, "--width", str(cfg.width),
             "--methods", cfg.method, "--worlds", str(cfg.world), "--links", cfg.link, "--steps", str(cfg.steps),
             "--batch", str(cfg.batch), "--lr", repr(cfg.lr), "--seeds", str(cfg.seed),
             "--eval-every", str(cfg.eval_every), "--strategy", cfg.strategy, "--error-feedback", cfg.error_feedback,
             "--out", str(out)]
    if cfg.data_dir:
        parts += ["--data-dir", cfg.data_dir]
    parts += ["--min-numel", str(cfg.min_numel)]
    if cfg.engine != "ddp":
        parts += ["--engine", cfg.engine]
    if cfg.ranks_per_node != 1:
        parts += ["--ranks-per-node", str(cfg.ranks_per_node)]
    if cfg.start_iter >= 0:
        parts += ["--start-iter", str(cfg.start_iter)]
    if cfg.warmup or cfg.method not in ("none", "dense"):
        parts += ["--warmup", str(cfg.warmup)]  # explicit: the task's default may differ
    parts += ["--precondition", cfg.precondition or "none"]  # explicit: the task's default may change
    return shlex.join(parts)


def finished(cfg: RunConfig, run_dir: Path) -> dict[str, Any] | None:
    """The run's summary when it finished with exactly this config, else None."""
    path = run_dir / "summary.json"
    if not path.is_file():
        return None
    try:
        summary = json.loads(path.read_text())
    except json.JSONDecodeError:
        return None
    return summary if summary.get("config") == cfg.to_dict() else None


def _eta(seconds: float) -> str:
    m, s = divmod(int(seconds), 60)
    return f"{m // 60}h{m % 60:02d}m" if m >= 60 else f"{m}m{s:02d}s"


class _Progress:
    """A rich progress bar when rich is installed and the output is a terminal; otherwise plain
    lines, and every `every` seconds of a run a line with its steps and the time left (of the run,
    and of the sweep from the runs run so far), so a log shows a long sweep moving."""

    def __init__(self, total: int, enabled: bool, every: float = 30.0, to_run: int | None = None) -> None:
        self.bar = None
        self.total = total
        self.to_run = total if to_run is None else to_run  # not finished by an earlier sweep
        self.done = 0
        self.enabled = enabled
        self.every = every
        self.label, self.steps_total = "", 0
        self.run_started = self.last_line = 0.0
        self.ran: list[float] = []  # seconds per run actually run (not cached)
        if enabled:
            try:
                from rich.console import Console
                from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

                console = Console(stderr=True)
                if console.is_terminal:
                    self.bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                        TimeElapsedColumn(), console=console)
                    self.task = self.bar.add_task("sweep", total=total)
                    self.steps = self.bar.add_task("  steps", total=None, visible=False)
                    self.bar.start()
            except ImportError:
                pass

    def start(self, label: str, steps: int) -> None:
        self.label, self.steps_total = label, steps
        self.run_started = self.last_line = time.monotonic()
        if self.bar is not None:
            self.bar.update(self.task, description=label)
            self.bar.reset(self.steps, total=steps, visible=True)
        elif self.enabled:
            print(f"[{self.done + 1}/{self.total}] {label} ...", flush=True)

    def step(self, done: int) -> None:
        if self.bar is not None:
            self.bar.update(self.steps, completed=done)
            return
        now = time.monotonic()
        if not self.enabled or now - self.last_line < self.every:
            return
        self.last_line = now
        elapsed = now - self.run_started
        left = elapsed * (self.steps_total - done) / done if done else None
        line = f"    {self.label}: step {done}/{self.steps_total}, {elapsed:.0f} s"
        if left is not None:
            line += f", about {_eta(left)} left"
            per_run = (sum(self.ran) + elapsed + left) / (len(self.ran) + 1)
            runs_left = max(self.to_run - len(self.ran) - 1, 0)
            line += f"; sweep {self.done}/{self.total} done, about {_eta(left + per_run * runs_left)} left"
        print(line, flush=True)

    def finish(self, line: str, ran: bool = False) -> None:
        if ran:
            self.ran.append(time.monotonic() - self.run_started)
        self.done += 1
        if self.bar is not None:
            self.bar.console.print(line)
            self.bar.advance(self.task)
        elif self.enabled:
            print(f"[{self.done}/{self.total}] {line}", flush=True)

    def close(self) -> None:
        if self.bar is not None:
            self.bar.stop()


def describe(summary: dict[str, Any], skipped: bool) -> str:
    final = summary["final"]
    metric = f"ppl {final['perplexity']:.2f}" if "perplexity" in final else f"acc {final['accuracy']:.2f}%"
    ratio = summary["dense_bytes"] / max(summary["bytes_sent"], 1)
    cfg = summary["config"]
    state = "cached" if skipped else f"{summary['train_s']:.1f} s"
    return (f"{summary['method']['label']:<24} w={cfg['world']} link={cfg['link']:<8} {metric}  "
            f"sent {summary['bytes_sent'] / 1e6:.2f} MB/rank ({ratio:.1f}x fewer)  "
            f"step {summary['median_step_s'] * 1e3:.1f} ms  [{state}]")


def run_sweep(configs: list[RunConfig], out: Path, progress: bool = True, timeout: float = 1800.0,
              cluster_factory: Callable[..., EmulatedCluster] = EmulatedCluster) -> list[dict[str, Any]]:
    """Run every config not yet finished under `out/runs/`; return all summaries in config order."""
    out.mkdir(parents=True, exist_ok=True)
    summaries: list[dict[str, Any]] = []
    to_run = sum(finished(cfg, out / "runs" / cfg.run_id) is None for cfg in configs)
    bar = _Progress(len(configs), progress, to_run=to_run)
    try:
        for cfg in configs:
            run_dir = out / "runs" / cfg.run_id
            summary = finished(cfg, run_dir)
            skipped = summary is not None
            if summary is None:
                bar.start(f"{cfg.method} w={cfg.world} link={cfg.link}", cfg.steps)
                started = time.monotonic()
                if cfg.link == "none":
                    summary = launch(cfg, run_dir, None, timeout, bar.step)
                else:
                    with cluster_factory(cfg.world, cfg.link, ranks_per_node=cfg.ranks_per_node) as cluster:
                        summary = launch(cfg, run_dir, cluster, timeout, bar.step)
                summary["elapsed_s"] = time.monotonic() - started
                summary["command"] = command_for(cfg, out)
                (run_dir / "summary.json").write_text(json.dumps(summary, indent=1))
            summaries.append(summary)
            bar.finish(describe(summary, skipped), ran=not skipped)
    finally:
        bar.close()
    return summaries
