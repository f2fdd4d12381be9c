"""Time to accuracy: how soon (training wall-clock) each method reaches dense training's quality.

The target of a (task, world, link, seed) group is set by its dense run: its final accuracy
minus `ACCURACY_SLACK` points, or for a language model its final perplexity times
(1 + `PERPLEXITY_SLACK`). A run's time to target is the training wall time (rank 0's step
times, evaluations excluded) at its first evaluation that meets the target; a run that never
meets it has none. Speed-up = dense's time / the method's time, both in the same group.
"""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

from .network import link_sort_key

ACCURACY_SLACK = 0.5  # points below dense's final accuracy
PERPLEXITY_SLACK = 0.03  # relative, above dense's final perplexity


def group_of(r: dict[str, Any]) -> tuple:
    return r["task"], r["world"], r["link"], r["seed"]


def target_of(dense: dict[str, Any]) -> tuple[str, float]:
    """(metric, value) the others must reach: ("perplexity", <= value) or ("accuracy", >= value)."""
    if dense.get("perplexity") is not None:
        return "perplexity", dense["perplexity"] * (1 + PERPLEXITY_SLACK)
    return "accuracy", dense["accuracy"] - ACCURACY_SLACK


def meets(metric: str, value: float | None, target: float) -> bool:
    if value is None:
        return False
    return value <= target if metric == "perplexity" else value >= target


def time_to_target(evals: list[dict[str, Any]], metric: str, target: float) -> float | None:
    """Wall time of the first evaluation that meets the target (None if none does)."""
    for e in evals:
        if e["step"] > 0 and meets(metric, e.get(metric), target):
            return float(e["wall_s"])
    return None


def evals_of(records: list[dict[str, Any]]) -> list[dict[str, Any]]:
    return [e for e in records if e["type"] == "eval"]


def rows(runs: list[dict[str, Any]], summaries: dict[str, dict[str, Any]],
         steps: dict[str, list[dict[str, Any]]]) -> list[dict[str, Any]]:
    """One row per run that has a dense run in its group: time to target, speed-up, bytes."""
    dense = {group_of(r): r for r in runs if r["method"] == "dense"}
    out = []
    for r in runs:
        base = dense.get(group_of(r))
        if base is None:
            continue
        metric, target = target_of(base)
        s = summaries[r["run_id"]]
        tta = time_to_target(evals_of(steps[r["run_id"]]), metric, target)
        dense_tta = time_to_target(evals_of(steps[base["run_id"]]), metric, target)
        intra = s.get("intra_bytes_sent_per_rank")
        out.append({**{k: r[k] for k in ("task", "method", "world", "link", "seed", "run_id", "median_step_s")},
                    "metric": metric, "target": target, "final": r[metric], "tta_s": tta,
                    "speedup": dense_tta / tta if tta and dense_tta else None,
                    "bytes_sent": s["bytes_sent"],
                    "intra_bytes_sent": statistics.mean(intra) if intra else None,
                    "inter_wire_bytes": s.get("inter_node_wire_bytes_per_rank")})
    return out


def _fmt(v: float | None, spec: str, none: str = "-") -> str:
    return none if v is None else format(v, spec)


def _mb(v: float | None) -> str:
    return "-" if v is None else f"{v / 1e6:.1f}"


def markdown(tta: list[dict[str, Any]]) -> list[str]:
    """Per task and link: each method's time to target (mean over seeds, and each seed), its
    speed-up over dense, final quality and bytes per rank (all, intra-node, inter-node on the wire)."""
    if not tta:
        return []
    lines = ["", "## Time to accuracy", "",
             f"Target per (task, world, link, seed): dense's final accuracy - {ACCURACY_SLACK} points, or dense's final "
             f"perplexity + {PERPLEXITY_SLACK:.0%}. Time = training wall-clock (rank 0's steps, evaluations excluded) "
             "at the first evaluation meeting it; '-' = never met. Bytes per rank over the run: what the comm layer "
             "sent, of it inside a node (counted by the hierarchical strategy; flat strategies do not attribute theirs), "
             "and what crossed between nodes on the emulated links (the nodes' interface counters, TCP/IP included).", ""]
    for task in sorted({t["task"] for t in tta}):
        for link in sorted({t["link"] for t in tta if t["task"] == task}, key=link_sort_key):
            sel = [t for t in tta if t["task"] == task and t["link"] == link]
            metric = sel[0]["metric"]
            seeds = sorted({t["seed"] for t in sel})
            lines += [f"**{task}, {link}** (world {sel[0]['world']}, seeds {', '.join(map(str, seeds))})", "",
                      f"| method | time to target [s] | per seed | speed-up vs dense | final {metric} | "
                      "sent MB/rank | intra MB/rank | inter-node wire MB/rank | median step [ms] |",
                      "|---|---|---|---|---|---|---|---|---|"]
            for method in dict.fromkeys(t["method"] for t in sel):
                m = [t for t in sel if t["method"] == method]
                times = [t["tta_s"] for t in m]
                mean_t = statistics.mean(times) if all(v is not None for v in times) else None
                ups = [t["speedup"] for t in m]
                mean_up = statistics.mean(ups) if all(v is not None for v in ups) else None
                per_seed = " / ".join(_fmt(v, ".0f") for v in times) if len(m) > 1 else ""
                up = "-" if mean_up is None else f"{mean_up:.2f}x"
                lines.append(f"| {method} | {_fmt(mean_t, '.1f')} | {per_seed} | {up} | "
                             f"{statistics.mean(t['final'] for t in m):.2f} | "
                             f"{_mb(statistics.mean(t['bytes_sent'] for t in m))} | "
                             f"{_mb(_mean_or_none([t['intra_bytes_sent'] for t in m]))} | "
                             f"{_mb(_mean_or_none([t['inter_wire_bytes'] for t in m]))} | "
                             f"{statistics.mean(t['median_step_s'] for t in m) * 1e3:.1f} |")
            lines.append("")
    return lines


def _mean_or_none(values: list[float | None]) -> float | None:
    return statistics.mean(values) if values and all(v is not None for v in values) else None


def plot(out: Path, tta: list[dict[str, Any]], steps: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Quality vs training wall-clock, one figure per (task, link), seeds as thin lines of one colour,
    the target as a dashed line; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    files = []
    for task in sorted({t["task"] for t in tta}):
        for link in sorted({t["link"] for t in tta if t["task"] == task}, key=link_sort_key):
            sel = [t for t in tta if t["task"] == task and t["link"] == link]
            metric = sel[0]["metric"]
            fig, ax = plt.subplots(figsize=(7, 4.5))
            colours: dict[str, Any] = {}
            for t in sel:
                evals = [e for e in evals_of(steps[t["run_id"]]) if e["step"] > 0 and e.get(metric) is not None]
                first = t["method"] not in colours
                line, = ax.plot([e["wall_s"] for e in evals], [e[metric] for e in evals], marker="o", ms=2,
                                lw=1.2 if first else 0.7, color=colours.get(t["method"]),
                                label=t["method"] if first else None)
                colours.setdefault(t["method"], line.get_color())
            for target in sorted({t["target"] for t in sel}):
                ax.axhline(target, ls="--", lw=0.8, color="grey")
            if metric == "perplexity":
                ax.set_yscale("log")
            ax.set_xlabel("training wall-clock [s]")
            ax.set_ylabel("test perplexity" if metric == "perplexity" else "test accuracy [%]")
            ax.set_title(f"{task}, {link} between nodes (dashed: target)")
            ax.grid(alpha=0.3)
            ax.legend(fontsize=7)
            fig.tight_layout()
            name = f"{task}_{metric}_vs_time_{link}.png"
            fig.savefig(out / name, dpi=120)
            plt.close(fig)
            files.append(name)
    return files
