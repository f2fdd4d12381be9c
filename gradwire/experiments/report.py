"""Turn finished runs into results files: JSON lines, CSV, PNG plots and a markdown report."""

from __future__ import annotations

import csv
import json
from pathlib import Path
from typing import Any

from . import tta as time_to_accuracy
from .network import link_sort_key
from .projection import PROJECTED_LINKS, PROJECTED_RANKS, profile, table

STEP_FIELDS = ["run_id", "method", "world", "link", "type", "step", "epoch", "loss", "accuracy", "test_loss",
               "perplexity", "step_s", "compute_s", "encode_s", "exchange_s", "decode_s", "collectives",
               "bytes_sent", "bytes_received", "intra_bytes_sent", "dense_bytes", "cum_bytes_sent", "wall_s"]
RUN_FIELDS = ["run_id", "task", "arch", "width", "method", "compressor", "strategy", "error_feedback", "world",
              "link", "seed", "steps", "params", "accuracy", "perplexity", "bytes_sent", "dense_bytes",
              "compression", "train_s", "median_step_s", "command", "intra_bytes_sent", "inter_node_wire_bytes",
              "compute_utilization", "syncs", "peak_bytes_in_flight"]


def read_steps(out: Path, run_id: str) -> list[dict[str, Any]]:
    with open(out / "runs" / run_id / "steps.jsonl") as f:
        return [json.loads(line) for line in f if line.strip()]


def run_row(s: dict[str, Any]) -> dict[str, Any]:
    cfg, method, final = s["config"], s["method"], s["final"]
    return {"run_id": s["run_id"], "task": cfg["task"], "arch": cfg["arch"], "width": cfg["width"],
            "method": method["label"], "compressor": method["compressor"], "strategy": method["strategy"],
            "error_feedback": method["error_feedback"], "world": cfg["world"], "link": cfg["link"],
            "seed": cfg["seed"], "steps": cfg["steps"], "params": s["params"], "accuracy": final.get("accuracy"),
            "perplexity": final.get("perplexity"), "bytes_sent": s["bytes_sent"], "dense_bytes": s["dense_bytes"],
            "compression": s["dense_bytes"] / max(s["bytes_sent"], 1), "train_s": s["train_s"],
            "median_step_s": s["median_step_s"], "command": s.get("command", ""),
            "intra_bytes_sent": s["intra_bytes_sent_per_rank"][0] if s.get("intra_bytes_sent_per_rank") else None,
            "inter_node_wire_bytes": s.get("inter_node_wire_bytes_per_rank"),
            "compute_utilization": s.get("compute_utilization"), "syncs": s.get("syncs"),
            "peak_bytes_in_flight": s.get("peak_bytes_in_flight")}


def _pct(v: float | None) -> str:
    return "-" if v is None else f"{100 * v:.1f}"


def pareto(rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Runs no other run beats on both fewer bytes and higher accuracy (per task, world and link)."""
    front = []
    for r in rows:
        dominated = any(o is not r and (o["task"], o["world"], o["link"]) == (r["task"], r["world"], r["link"])
                        and o["bytes_sent"] <= r["bytes_sent"] and o["accuracy"] >= r["accuracy"]
                        and (o["bytes_sent"] < r["bytes_sent"] or o["accuracy"] > r["accuracy"]) for o in rows)
        if not dominated:
            front.append(r)
    return sorted(front, key=lambda r: r["bytes_sent"])


def write_csv(path: Path, fields: list[str], rows: list[dict[str, Any]]) -> None:
    with open(path, "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=fields, extrasaction="ignore")
        w.writeheader()
        w.writerows(rows)


def plot(out: Path, rows: list[dict[str, Any]], steps: dict[str, list[dict[str, Any]]]) -> list[str]:
    """Accuracy vs cumulative bytes, accuracy vs wall time, bytes per step; returns the file names."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    def name(r: dict[str, Any]) -> str:
        return f"{r['method']} (w={r['world']}, {r['link']})"

    files = []
    for xkey, xlabel, fname in (("cum_bytes_sent", "cumulative bytes sent per rank", "accuracy_vs_bytes.png"),
                                ("wall_s", "training wall time [s]", "accuracy_vs_time.png")):
        fig, ax = plt.subplots(figsize=(7, 4.5))
        for r in rows:
            evals = [e for e in steps[r["run_id"]] if e["type"] == "eval" and e.get("accuracy") is not None
                     and e["step"] > 0]  # step 0 has sent nothing: no place on a log axis
            ax.plot([e[xkey] for e in evals],
                    [e["accuracy"] for e in evals], marker="o", ms=3, label=name(r))
        if xkey == "cum_bytes_sent":
            ax.set_xscale("log")
        ax.set_xlabel(xlabel)
        ax.set_ylabel("test accuracy [%]")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(out / fname, dpi=120)
        plt.close(fig)
        files.append(fname)
    fig, ax = plt.subplots(figsize=(7, 0.4 * len(rows) + 1.5))
    per_step = [r["bytes_sent"] / max(r["steps"], 1) for r in rows]
    ax.barh([name(r) for r in rows], per_step)
    ax.set_xscale("log")
    ax.set_xlabel("bytes sent per step per rank (mean over the run)")
    ax.grid(alpha=0.3, axis="x")
    fig.tight_layout()
    fig.savefig(out / "bytes_per_step.png", dpi=120)
    plt.close(fig)
    files.append("bytes_per_step.png")
    return files


def _fmt_bytes(n: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("kB", 1e3)):
        if n >= scale:
            return f"{n / scale:.2f} {unit}"
    return f"{n:.0f} B"


def seed_table(rows: list[dict[str, Any]]) -> list[str]:
    """Mean and spread over seeds, when a configuration ran with more than one seed."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        groups.setdefault((r["task"], r["method"], r["world"], r["link"]), []).append(r)
    if all(len(g) < 2 for g in groups.values()):
        return []
    lines = ["", "## Over seeds", "", "| method | world | link | seeds | accuracy mean [%] | min | max | "
             "bytes sent/rank (mean) |", "|---|---|---|---|---|---|---|---|"]
    for (_, method, world, link), g in groups.items():
        accs = [r["accuracy"] for r in g]
        lines.append(f"| {method} | {world} | {link} | {len(g)} | {sum(accs) / len(accs):.2f} | {min(accs):.2f} | "
                     f"{max(accs):.2f} | {_fmt_bytes(sum(r['bytes_sent'] for r in g) / len(g))} |")
    return lines


def markdown(rows: list[dict[str, Any]], front: list[dict[str, Any]], projections: list[dict[str, Any]],
             plots: list[str], alpha: float, tta_lines: list[str] | None = None) -> str:
    lm = any(r["perplexity"] is not None for r in rows)
    util = any(r.get("compute_utilization") is not None for r in rows)
    lines = ["# gradwire experiment report", "",
             "Bytes are what each rank handed to its collectives, as counted by gradwire's comm layer "
             "(dense warm-up steps included). Accuracy is the held-out accuracy at the last step"
             + (" (next-byte accuracy for the language model; perplexity beside it)" if lm else "") + ".", "",
             "| method | world | link | accuracy [%] |" + (" perplexity |" if lm else "")
             + " bytes sent/rank | fewer than dense | train time [s] | median step [ms] |"
             + (" compute [%] |" if util else ""),
             "|---|---|---|---|" + ("---|" if lm else "") + "---|---|---|---|" + ("---|" if util else "")]
    dense = {(r["task"], r["world"], r["link"], r["seed"]): r for r in rows if r["method"] == "dense"}
    for r in rows:
        base = dense.get((r["task"], r["world"], r["link"], r["seed"]))
        fewer = f"{base['bytes_sent'] / max(r['bytes_sent'], 1):.1f}x" if base else "-"
        ppl = f" {r['perplexity']:.2f} |" if lm else ""
        lines.append(f"| {r['method']} | {r['world']} | {r['link']} | {r['accuracy']:.2f} |{ppl} "
                     f"{_fmt_bytes(r['bytes_sent'])} | {fewer} | {r['train_s']:.1f} | {r['median_step_s'] * 1e3:.1f} |"
                     + (f" {_pct(r.get('compute_utilization'))} |" if util else ""))
    if util:
        lines += ["", "compute [%]: the share of the training wall time spent computing — per-step methods: the "
                  "reference forward + backward (no communication) times the steps over the wall time; outer-loop "
                  "methods: the time not spent launching or waiting on syncs."]
    lines += seed_table(rows)
    lines += tta_lines or []
    lines += ["", "## Pareto front (accuracy vs bytes, per task/world/link)", "",
              "| method | world | link | accuracy [%] | bytes sent/rank |", "|---|---|---|---|---|"]
    lines += [f"| {r['method']} | {r['world']} | {r['link']} | {r['accuracy']:.2f} | {_fmt_bytes(r['bytes_sent'])} |"
              for r in front]
    lines += ["", "## Plots", ""] + [f"![{p}]({p})" for p in plots]
    lines += ["", "## Projection to larger clusters (alpha-beta model — a projection, not a measurement)", "",
              f"Seconds per step projected from each run's measured per-step bytes, collectives, and "
              f"compute/encode/decode time, with alpha = {alpha * 1e6:.0f} us per message and beta = the link rate "
              "(ring allreduce: 2(P-1)a + 2(P-1)/P b/B; allgather: (P-1)a + (P-1) b/B). "
              "Compute, encode and decode times are those measured here, where ranks may share CPU cores "
              "(then they are inflated; each rank of a real cluster has its own). "
              "Real clusters add congestion, stragglers and topology.", ""]
    for link in sorted({p["link"] for p in projections}, key=link_sort_key):
        rows_l = [p for p in projections if p["link"] == link]
        cols = [f"P={n}" for n in PROJECTED_RANKS]
        lines += [f"**{link}** (projected s/step)", "", "| method | " + " | ".join(cols) + " |",
                  "|---|" + "---|" * len(cols)]
        lines += [f"| {p['method']} | " + " | ".join(f"{p[c]:.3f}" for c in cols) + " |" for p in rows_l]
        lines.append("")
    lines += ["## Commands", "", "Each run, exactly (rerunning reuses a finished run in the same --out):", ""]
    lines += [f"- `{r['command']}`" for r in rows if r["command"]]
    return "\n".join(lines) + "\n"


def write_report(out: Path, summaries: list[dict[str, Any]], alpha: float = 50e-6,
                 make_plots: bool = True) -> dict[str, Path]:
    """Write results.jsonl, runs.csv, steps.csv, projection.csv, plots and report.md under `out`."""
    rows = [run_row(s) for s in summaries]
    steps = {s["run_id"]: read_steps(out, s["run_id"]) for s in summaries}
    with open(out / "results.jsonl", "w") as f:
        for s in summaries:
            f.write(json.dumps(s) + "\n")
    write_csv(out / "runs.csv", RUN_FIELDS, rows)
    flat = [{"run_id": r["run_id"], "method": r["method"], "world": r["world"], "link": r["link"], **rec}
            for r in rows for rec in steps[r["run_id"]]]
    write_csv(out / "steps.csv", STEP_FIELDS, flat)
    profiles = [profile(s, steps[s["run_id"]]) for s in summaries]
    projections = [row for link in PROJECTED_LINKS for row in table(profiles, link, alpha)]
    write_csv(out / "projection.csv", ["method", "strategy", "link"] + [f"P={n}" for n in PROJECTED_RANKS],
              projections)
    tta = time_to_accuracy.rows(rows, {s["run_id"]: s for s in summaries}, steps)
    if tta:
        write_csv(out / "time_to_accuracy.csv", list(tta[0]), tta)
    plots = plot(out, rows, steps) if make_plots and rows else []
    if make_plots and tta:
        plots += time_to_accuracy.plot(out, tta, steps)
    (out / "report.md").write_text(markdown(rows, pareto(rows), projections, plots, alpha,
                                            time_to_accuracy.markdown(tta)))
    return {name: out / name for name in ["results.jsonl", "runs.csv", "steps.csv", "projection.csv", "report.md",
                                           *(["time_to_accuracy.csv"] if tta else []), *plots]}
