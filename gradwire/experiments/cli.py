"""`gradwire experiment`: sweep compressors x ratios x world sizes (x emulated links) and report."""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from .cluster import EmulationUnavailable, check_available
from .network import LINK_RE, PRESETS, Network, parse_link, parse_ms, rate_bits
from .report import write_report
from .sweep import Sweep, run_sweep
from .tasks import TASKS, get_task

QUICK = dict(task="mnist1d", arch="cnn", width=64, methods="none,topk,qsgd:bits=4,powersgd:rank=2", ratios="0.01",
             worlds="2", links="none", steps=300, eval_every=50)


def _csv(kind: type, text: str) -> list:
    try:
        return [kind(t) for t in text.split(",") if t.strip()]
    except ValueError:
        raise ValueError(f"expected a comma-separated list of {kind.__name__}, got {text!r}") from None


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="gradwire experiment", description=__doc__,
                                formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--quick", action="store_true",
                   help="a small sweep that finishes in under 3 minutes on 2 cores (mnist1d, 2 ranks, 300 steps)")
    p.add_argument("--task", default="mnist1d", choices=sorted(TASKS))
    p.add_argument("--arch", default=None, help="model architecture (mnist1d: cnn | mlp; charlm: transformer | gpt, "
                                                "the larger LM; "
                                                "cifar10: resnet20); default: the task's")
    p.add_argument("--width", type=int, default=0, help="model width (0: the architecture's default)")
    p.add_argument("--methods", default="none,topk,randomk,qsgd:bits=4,powersgd:rank=2",
                   help="comma list of gradwire compressor specs, 'none' (dense), 'powersgd:rank=R' and "
                        "'diloco:H=N[+compressor]' (a piece that is only key=value continues the method before it: "
                        "'diloco:H=30,fragments=3+fp4'); topk/randomk/dgc without ratio= are swept over --ratios")
    p.add_argument("--ratios", default="0.01,0.1", help="kept fractions for sparsifiers without an explicit ratio")
    p.add_argument("--worlds", default="4", help="comma list of world sizes (ranks on this machine)")
    p.add_argument("--links", default="none",
                   help="comma list: 'none' (loopback) or rates between emulated nodes such as 100mbit,1gbit "
                        "(emulated cluster; root), optionally with a round-trip time: 100mbit-rtt40ms")
    p.add_argument("--rtt", default="0ms",
                   help="comma list of round-trip times between nodes, e.g. 40ms,80ms, applied to every rate in "
                        "--links (0ms: none, tbf alone; >0: vde2's wirefilter delays the inter-node wires; traffic "
                        "inside a node is never delayed)")
    p.add_argument("--jitter", default="0ms", help="jitter of the round-trip time (each one-way delay varies "
                                                   "uniformly within +-jitter/2); needs --rtt")
    p.add_argument("--loss", type=float, default=0.0, help="packet loss between two nodes, percent of the packets each way; needs --rtt")
    p.add_argument("--network", default="",
                   help="comma list of named networks, added to --links: " + "; ".join(
                       f"{name}: {n.rate}" + (f", RTT {n.rtt_ms:g} ms" if n.rtt_ms else ", no added delay")
                       for name, n in PRESETS.items()))
    p.add_argument("--ranks-per-node", type=int, default=1,
                   help="ranks per node: in the emulated cluster they share one namespace and one shaped link "
                        "(fast between them, --links between nodes); the hierarchical strategy finds them")
    p.add_argument("--nodes", type=int, default=0,
                   help="number of nodes; sets the world size to nodes x --ranks-per-node (instead of --worlds)")
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--batch", type=int, default=0, help="per-rank batch (0: the task's default)")
    p.add_argument("--lr", type=float, default=0.0, help="learning rate (0: the task's default)")
    p.add_argument("--seeds", default="0", help="comma list of seeds (model init, data order, compressor RNG)")
    p.add_argument("--link-seeds", action="append", default=[], metavar="LINK=SEEDS",
                   help="other seeds for one link, e.g. 100mbit=0,1,2 (repeatable); other links use --seeds; "
                        "a link not in --links is ignored, so a sweep can run in parts")
    p.add_argument("--method-seeds", action="append", default=[], metavar="METHOD=SEEDS",
                   help="other seeds for one method as written in --methods, e.g. none=0,1,2 (repeatable): "
                        "more seeds for the methods that matter most, on every link")
    p.add_argument("--eval-every", type=int, default=100)
    p.add_argument("--strategy", default="default",
                   help="'default' (allreduce for summable payloads, allgather otherwise) or a gradwire strategy")
    p.add_argument("--error-feedback", default="auto", choices=["auto", "on", "off"],
                   help="auto: on for biased compressors, off for casts and unbiased ones (randomk, qsgd, terngrad)")
    p.add_argument("--min-numel", type=int, default=1024,
                   help="tensors with fewer elements (biases, small layers) are sent uncompressed by the allgather "
                        "strategy: a 1%% top-k would send one value of a 64-element bias per step")
    p.add_argument("--start-iter", type=int, default=-1,
                   help="dense steps before compression starts (-1: the task's default for PowerSGD, charlm: 40; "
                        "else the hook's: 2 with error feedback or PowerSGD, 0 without)")
    p.add_argument("--warmup", type=int, default=-1,
                   help="density warm-up (DGC): over this many steps after --start-iter a sparsifier's ratio "
                        "decays exponentially from 25%% to its own (-1: the task's default, charlm: 100; others: 0)")
    p.add_argument("--precondition", default="auto",
                   help="'adam': compressed methods send Adam's direction (each rank's own moments) and train with "
                        "plain SGD, so error feedback delays Adam's steps instead of shrinking them; 'global_adam': "
                        "moments shared by every rank, v frozen after the uncompressed first steps, each rank's "
                        "momentum compressed (the LM setting with sign@allgather); 'none'; "
                        "'auto': the task's default for sparsifiers (charlm: adam; others: none; never PowerSGD, whose "
                        "low rank fits raw gradients better). Dense runs use the task's optimizer")
    p.add_argument("--engine", default="ddp", choices=["ddp", "fsdp", "hsdp"],
                   help="ddp: DDP + the gradwire comm hook; fsdp: FSDP2 fully_shard + gradwire's compressed "
                        "reduce-scatter; hsdp: FSDP2 sharded inside each node (--ranks-per-node), gradwire's "
                        "compressed all-reduce between nodes")
    p.add_argument("--data-dir", default=None, help="local dataset folder (cifar10: cifar-10-batches-py)")
    p.add_argument("--out", default=None, help="output folder (default: experiment-results/<task>)")
    p.add_argument("--alpha-us", type=float, default=50.0, help="per-message latency of the alpha-beta projection")
    p.add_argument("--timeout", type=float, default=1800.0, help="seconds one run may take")
    p.add_argument("--no-progress", action="store_true")
    p.add_argument("--report-only", action="store_true", help="rewrite the report from finished runs only")
    return p


def network_links(args: argparse.Namespace) -> list[str]:
    """--links x --rtt (with --jitter and --loss), then --network's presets, as link strings (network.py)."""
    rtts = [parse_ms(t) for t in args.rtt.split(",") if t.strip()] or [0.0]
    jitter = parse_ms(args.jitter)
    out: list[str] = []
    given = "" if args.network and args.links == "none" else args.links  # --network alone: no loopback run
    for link in (s.strip() for s in given.split(",") if s.strip()):
        if link == "none":
            out.append(link)
            continue
        base = parse_link(link)
        if base.delayed and (rtts != [0.0] or jitter or args.loss):
            raise ValueError(f"link {link!r} has its own round-trip time: give --rtt, --jitter and --loss "
                             "or a link such as 100mbit-rtt40ms, not both")
        for rtt in rtts if not base.delayed else [base.rtt_ms]:
            net = base if base.delayed else Network(base.rate, rtt, jitter if rtt else 0.0, args.loss if rtt else 0.0)
            if not rtt and (jitter or args.loss):
                raise ValueError("--jitter and --loss need a round-trip time (--rtt > 0)")
            out.append(net.label)
    for name in (s.strip() for s in args.network.split(",") if s.strip()):
        if name not in PRESETS:
            raise ValueError(f"--network {name!r} is not one of {', '.join(PRESETS)}")
        out.append(PRESETS[name].label)
    return list(dict.fromkeys(out))


def split_methods(text: str) -> list[str]:
    """The comma-separated methods; a piece that is only `key=value` continues the method before
    it (`diloco:H=30,fragments=3+fp4`, `topk:ratio=0.01,chunk=4096`): no method name has an `=`
    before its first `:`."""
    methods: list[str] = []
    for piece in (p.strip() for p in text.split(",")):
        if not piece:
            continue
        head = piece.split(":")[0]
        if "=" in head and methods:
            methods[-1] += "," + piece
        else:
            methods.append(piece)
    return methods


def seeds_per_link(given: dict[str, list[int]], links: list[str]) -> dict[str, list[int]]:
    """--link-seeds keyed by the swept links: a swept link string names itself; a bare rate such
    as 100mbit names every swept link of that rate, whatever --rtt, --jitter or --loss added to it
    (else `--links 100mbit --rtt 40ms --link-seeds 100mbit=0,1,2` would silently sweep one seed)."""
    out: dict[str, list[int]] = {}
    for key, seeds in given.items():
        if key in links:
            out[key] = seeds
            continue
        if key == "none" or parse_link(key).delayed:
            continue  # not swept: a partial run
        for link in links:
            if link != "none" and rate_bits(parse_link(link).rate) == rate_bits(parse_link(key).rate):
                out.setdefault(link, seeds)
    return out


def sweep_from(args: argparse.Namespace) -> Sweep:
    if args.quick:
        defaults = build_parser().parse_args([])
        for key, value in QUICK.items():
            if getattr(args, key) == getattr(defaults, key):  # an explicit option still wins
                setattr(args, key, value)
    task = get_task(args.task)
    arch = args.arch or task.default_arch
    task.model(arch, args.width)  # unknown architecture: fail before anything runs
    links = network_links(args)
    if args.ranks_per_node < 1 or args.nodes < 0:
        raise ValueError("--ranks-per-node must be >= 1 and --nodes >= 0")
    link_seeds: dict[str, list[int]] = {}
    for item in args.link_seeds:
        link, eq, seeds = item.partition("=")
        link = link.strip()
        if not eq or (link != "none" and not LINK_RE.match(link.lower())):
            raise ValueError(f"--link-seeds takes LINK=SEEDS with LINK a rate such as 100mbit (or 100mbit-rtt40ms), "
                             f"got {item!r}")
        link_seeds[link] = _csv(int, seeds)  # a link not in --links is not swept (a partial run)
    link_seeds = seeds_per_link(link_seeds, links)
    methods = split_methods(args.methods)
    method_seeds: dict[str, list[int]] = {}
    for item in args.method_seeds:
        method, eq, seeds = item.rpartition("=")  # the method's own options have '=' too: seeds follow the last
        method = method.strip()
        if not eq or method not in methods:
            raise ValueError(f"--method-seeds takes METHOD=SEEDS with METHOD one of --methods {methods}, got {item!r}")
        method_seeds[method] = _csv(int, seeds)
        if not method_seeds[method]:
            raise ValueError(f"--method-seeds {item!r} names no seeds")
    worlds = [args.nodes * args.ranks_per_node] if args.nodes else _csv(int, args.worlds)
    if any(w < 1 for w in worlds):
        raise ValueError(f"world sizes must be >= 1, got {worlds}")
    if any(w % args.ranks_per_node for w in worlds):
        raise ValueError(f"world sizes {worlds} do not split into nodes of {args.ranks_per_node} ranks")
    if args.steps < 1 or args.eval_every < 1:
        raise ValueError("--steps and --eval-every must be >= 1")
    if args.min_numel < 0:
        raise ValueError("--min-numel must be >= 0")
    if args.precondition not in ("auto", "none"):
        from gradwire.hooks.precondition import make_preconditioner

        make_preconditioner(args.precondition)  # a bad spec fails before anything runs
    if args.start_iter < -1 or args.warmup < -1:
        raise ValueError("--start-iter and --warmup must be >= -1 (-1: the task's default)")
    if args.engine == "hsdp" and args.ranks_per_node < 2:
        raise ValueError("--engine hsdp shards inside nodes and replicates across them: give --ranks-per-node >= 2")
    return Sweep(args.task, arch, args.width, methods,
                 _csv(float, args.ratios), worlds, links, args.steps, args.batch or task.default_batch,
                 args.lr or task.default_lr, _csv(int, args.seeds), args.eval_every, args.strategy,
                 args.error_feedback, str(Path(args.data_dir).expanduser().resolve()) if args.data_dir else None,
                 args.min_numel, args.engine, args.ranks_per_node, link_seeds, start_iter=args.start_iter,
                 warmup=args.warmup, precondition=args.precondition, task_lr=not args.lr,
                 method_seeds=method_seeds)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        sweep = sweep_from(args)
        configs = sweep.runs()
    except (ValueError, FileNotFoundError) as exc:
        print(f"gradwire experiment: error: {exc}", file=sys.stderr)
        return 2
    out = Path(args.out or f"experiment-results/{sweep.task}" + ("-quick" if args.quick else ""))
    if any(c.link != "none" for c in configs) and not args.report_only:
        try:
            check_available(any(parse_link(c.link).delayed for c in configs if c.link != "none"))
        except EmulationUnavailable as exc:
            print(f"gradwire experiment: error: {exc}.\nRun with --links none instead: report.md and projection.csv "
                  "then model 1, 10 and 100 Gbit/s links (alpha-beta, from the bytes measured per step).",
                  file=sys.stderr)
            return 2
    started = time.monotonic()
    if args.report_only:
        from .sweep import command_for, finished

        summaries = [dict(s, command=command_for(c, out)) for c in configs
                     if (s := finished(c, out / "runs" / c.run_id)) is not None]
    else:
        print(f"gradwire experiment: {len(configs)} runs -> {out}", file=sys.stderr)
        summaries = run_sweep(configs, out, progress=not args.no_progress, timeout=args.timeout)
    files = write_report(out, summaries, alpha=args.alpha_us * 1e-6)
    print(f"gradwire experiment: {len(summaries)} runs in {time.monotonic() - started:.0f} s; "
          f"report: {files['report.md']}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
