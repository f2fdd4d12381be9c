"""One run's configuration, how a sweep expands into runs, and how methods map onto gradwire."""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import asdict, dataclass, field
from typing import Any

from gradwire.comm.config import accepted_options, split_method
from gradwire.comm.registry import traits
from gradwire.compress import compressor as make_compressor, resolve_error_feedback
from gradwire.outer import OuterConfig
from gradwire.outer.recipes import recipe

SPARSIFIERS = ("topk", "randomk", "dgc")
ENGINES = ("ddp", "fsdp", "hsdp")


@dataclass(frozen=True)
class Method:
    """How a user-facing method string ("topk:ratio=0.01", "powersgd:rank=4") runs in the hook."""

    label: str
    compressor: str
    strategy: str
    options: dict[str, Any] = field(default_factory=dict)
    error_feedback: bool = True
    outer: dict[str, Any] = field(default_factory=dict)  # DiLoCo's settings (gradwire.outer); empty: per step
    replica: str = "rank"  # an outer loop's replica: one rank, or one node whose ranks run DDP inside


def parse_method(spec: str, strategy: str = "default", error_feedback: str = "auto", min_numel: int = 0) -> Method:
    """Map a method string onto (compressor, strategy, options, error feedback); bad input raises ValueError.
    `min_numel` (tensors with fewer elements go uncompressed) applies to the allgather, auto, oktopk and
    hierarchical (its inner allgather) strategies."""
    spec = spec.strip()
    if spec in ("none", "dense"):
        return Method("dense", "none", "dense", {}, False)
    if spec.split("+")[0].split(":")[0].split("@")[0] == "diloco":
        return _diloco(spec, error_feedback)
    if spec.split(":")[0] == TORCHFT:
        return _torchft(spec)
    label = spec
    compressor, via, named = split_method(spec)  # the hooks' own spelling; raises ValueError naming what was wrong
    if compressor == "none" and via is not None and (via == "powersgd" or named.get("inner") == "powersgd"):
        return _powersgd(via, named, error_feedback)
    c = make_compressor(compressor)
    canonical = str(c)
    if via:
        chosen = via
    elif strategy == "default":
        chosen = "allreduce" if c.summable else "allgather"
    else:
        chosen = strategy
    ef = resolve_error_feedback(error_feedback, c)  # "auto": the library's rule, Compressor.feedback_helps
    takes_min_numel = "min_numel" in (accepted_options(traits(chosen), {}) or ())
    options = {"min_numel": min_numel} if min_numel and takes_min_numel else {}
    return Method(label, canonical, chosen, options, ef)


OUTER_OPTIONS = {"H": "sync_every", "fragments": "fragments", "delay": "delay", "mix": "mix", "carry": "carry",
                 "outer_lr": "outer_lr", "momentum": "momentum", "decay": "feedback_decay"}


def _outer_options(method: str, allowed: tuple[str, ...], args: str, spec: str) -> dict[str, Any]:
    """`H=..,fragments=..` of an outer-loop method as OuterConfig's settings, checked before
    anything runs (steps as ints; ValueError naming what was wrong)."""
    outer: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = (part.strip() for part in item.partition("="))
        if not eq or key not in allowed:
            raise ValueError(f"{method} takes {', '.join(f'{k}=' for k in allowed)}; got {item!r} in {spec!r}")
        try:
            number = float(value)
        except ValueError:
            raise ValueError(f"{spec!r}: {key}= takes a number, got {value!r}") from None
        as_int = number.is_integer() and key in ("H", "fragments", "delay")
        if key == "carry" and number not in (0, 1):
            raise ValueError(f"{spec!r}: carry= takes 0 or 1, got {value!r}")
        outer[OUTER_OPTIONS[key]] = bool(number) if key == "carry" else int(number) if as_int else number
    if "sync_every" not in outer:
        raise ValueError(f"{spec!r}: say how often replicas sync, e.g. {method}:H=100")
    OuterConfig(**outer)
    return outer


TORCHFT = "torchft-diloco"
TORCHFT_OPTIONS = ("H", "fragments", "delay", "mix")


def _torchft(spec: str) -> Method:
    """`torchft-diloco:H=100[,fragments=F,delay=T,mix=A]`: torchft's own DiLoCo (uncompressed fp32
    allreduce, Nesterov outer SGD as gradwire's), the outside reference for the outer loop."""
    head, _, args = spec.partition(":")
    if "+" in spec or "@" in spec:
        raise ValueError(f"{spec!r}: torchft's DiLoCo sends fp32 over its own allreduce; it takes no compressor "
                         "or strategy")
    outer = _outer_options(TORCHFT, TORCHFT_OPTIONS, args, spec)
    if outer["sync_every"] % outer.get("fragments", 1):
        raise ValueError(f"{spec!r}: torchft needs H to be a multiple of the fragments")
    return Method(spec, "none", "torchft", {}, False, outer)


def _diloco(spec: str, error_feedback: str) -> Method:
    """`diloco:H=100[,fragments=F,delay=T,mix=A|carry=1,outer_lr=..,momentum=..,decay=..][+compressor][@strategy]`: replicas
    (ranks, or nodes with `replica=node`) that train alone and average their pseudo-gradients every
    H steps (gradwire.outer), through the compressor (default none; or a recipe: `+sparseloco`) and
    strategy (allreduce for summable payloads, else allgather)."""
    head, plus, rest = spec.partition("+")
    head, at, via = head.partition("@")
    if at and plus:
        raise ValueError(f"{spec!r}: put the strategy after the compressor, e.g. diloco:H=100+int8@allgather")
    rest, at2, via2 = rest.partition("@")
    via = (via or via2).strip()
    _, _, args = head.partition(":")
    args, replica = _replica_option(args, spec)
    outer = _outer_options("diloco", tuple(OUTER_OPTIONS), args, spec)
    named = recipe(rest.strip())  # (sparseloco: a compressor with the outer settings it is meant with)
    c = make_compressor(named.compressor if named else rest.strip() or "none")
    strategy = via or ("allreduce" if c.summable else "allgather")
    return Method(spec, rest.strip() if named else str(c), strategy, {}, resolve_error_feedback(error_feedback, c),
                  outer, replica)


REPLICAS = ("rank", "node")


def _replica_option(args: str, spec: str) -> tuple[str, str]:
    """Take `replica=rank|node` out of diloco's options: `node` makes each node one replica whose
    ranks train with DDP inside it (the deployment across datacenters: DiLoCo only between nodes)."""
    kept, replica = [], "rank"
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, _, value = (part.strip() for part in item.partition("="))
        if key != "replica":
            kept.append(item)
        elif value in REPLICAS:
            replica = value
        else:
            raise ValueError(f"{spec!r}: replica= takes {' or '.join(REPLICAS)}, got {value!r}")
    return ",".join(kept), replica


def _powersgd(strategy: str, options: dict[str, Any], error_feedback: str) -> Method:
    """`powersgd:rank=R` (its own all-reduce), `powersgd:rank=R@hierarchical` (between nodes), or
    `powersgd:rank=R@auto` (`auto` with low-rank candidates: dense, bf16, flat or between nodes)."""
    options = {"rank": 1, **options}
    if not isinstance(options["rank"], int) or set(options) - {"rank", "inner"}:
        raise ValueError(f"powersgd takes rank=<int> in gradwire experiment, got {options}")
    ef = error_feedback != "off"  # PowerSGD's own error feedback, on unless asked off
    label = f"powersgd:rank={options['rank']}"
    if strategy == "powersgd":
        return Method(label, "none", "powersgd", options, ef)
    return Method(f"{label}@{strategy}", "none", strategy, {"inner": "powersgd", **options}, ef)


def expand_methods(items: list[str], ratios: list[float]) -> list[str]:
    """`topk` with ratios [0.01, 0.1] -> `topk:ratio=0.01`, `topk:ratio=0.1` (`@strategy` kept
    at the end); explicit specs stay."""
    out: list[str] = []
    for item in items:
        item, at, via = item.strip().partition("@")
        if not item:
            continue
        name = item.split(":")[0].split("+")[0]
        if name in SPARSIFIERS and "ratio=" not in item:
            head, plus, tail = item.partition("+")
            sep = "," if ":" in head else ":"
            out.extend(f"{head}{sep}ratio={r:g}{plus}{tail}{at}{via}" for r in ratios)
        else:
            out.append(f"{item}{at}{via}")
    seen: set[str] = set()
    return [m for m in out if not (m in seen or seen.add(m))]


@dataclass(frozen=True)
class RunConfig:
    """Everything that determines one training run (recorded with its results)."""

    task: str
    arch: str
    width: int
    method: str
    world: int
    steps: int
    batch: int
    lr: float
    seed: int = 0
    eval_every: int = 100
    link: str = "none"  # "none" (loopback) or a link between nodes: "100mbit", "100mbit-rtt40ms" (network.py)
    strategy: str = "default"
    error_feedback: str = "auto"
    data_dir: str | None = None
    min_numel: int = 0  # tensors under this many elements are sent uncompressed (allgather-based strategies)
    engine: str = "ddp"  # "ddp" or "fsdp" (FSDP2 fully_shard, gradwire's compressed reduce-scatter)
    ranks_per_node: int = 1  # ranks sharing a node (its namespace and shaped link in the emulated cluster)
    start_iter: int = -1  # dense steps before compression starts (-1: the hook's default, 2 with state)
    warmup: int = 0  # steps over which a sparsifier's ratio decays from 25% to its own (DGC's warm-up)
    precondition: str = ""  # "adam": Adam's direction is compressed, the optimizer is SGD (hooks/precondition.py)

    def resolved(self) -> Method:
        if self.engine not in ENGINES:
            raise ValueError(f"engine must be one of {', '.join(ENGINES)}, got {self.engine!r}")
        method = parse_method(self.method, self.strategy, self.error_feedback, self.min_numel)
        if self.engine != "ddp" and (self.start_iter >= 0 or self.warmup or self.precondition):
            raise ValueError("--start-iter, --warmup and --precondition are options of the DDP hook (--engine ddp)")
        if method.replica == "node" and (self.engine != "ddp" or self.ranks_per_node < 2):
            raise ValueError(f"{self.method!r}: replica=node runs DDP inside each node and DiLoCo between nodes; "
                             f"it needs --engine ddp and --ranks-per-node >= 2 (got {self.engine}, "
                             f"{self.ranks_per_node})")
        if self.engine == "fsdp" and method.strategy == "powersgd":
            raise ValueError("powersgd needs an all-reduce; FSDP reduce-scatters (it runs on HSDP's cross-replica "
                             "all-reduce: --engine hsdp --ranks-per-node G)")
        return method

    def hook_options(self) -> dict[str, Any]:
        """The hook's own options this run sets (dense first steps, density warm-up, Adam before the exchange)."""
        method = self.resolved()
        opts: dict[str, Any] = {}
        if self.start_iter >= 0 and method.strategy != "dense":
            opts["start_iter"] = self.start_iter
        if self.warmup and method.strategy != "dense":
            opts["warmup"] = self.warmup
        if self.precondition and method.strategy != "dense":
            opts["precondition"] = self.precondition
        return opts

    def uses_min_numel(self) -> bool:
        return "min_numel" in self.resolved().options

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        if not d["min_numel"]:
            del d["min_numel"]  # added later: runs without it keep their ids and resume
        if d["engine"] == "ddp":
            del d["engine"]  # likewise
        for name, default in (("ranks_per_node", 1), ("start_iter", -1), ("warmup", 0), ("precondition", "")):
            if d[name] == default:
                del d[name]  # likewise
        return d

    @property
    def run_id(self) -> str:
        digest = hashlib.sha256(json.dumps(self.to_dict(), sort_keys=True).encode()).hexdigest()[:8]
        slug = re.sub(r"[^A-Za-z0-9.=]+", "_", self.resolved().label)
        engine = "" if self.engine == "ddp" else f"-{self.engine}"
        ranks = f"w{self.world}" if self.ranks_per_node == 1 else f"n{self.world // self.ranks_per_node}x{self.ranks_per_node}"
        link = re.sub(r"[^A-Za-z0-9.=-]+", "_", self.link)  # (100mbit-rtt40ms-loss0.1% -> ..._)
        return f"{self.task}-{self.arch}{self.width}-{slug}{engine}-{ranks}-{link}-s{self.seed}-{digest}"
