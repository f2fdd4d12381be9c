"""One config for every gradwire entry point: the DDP hook, the FSDP2 hook and `GradientExchanger`.

The entry points used to derive the same rules three times, and drifted apart. They live here
once, and each entry point adds its own fields in a small subclass (`hooks.ddp.DDPConfig`:
start_iter, density warm-up, precondition; `hooks.fsdp.FSDPConfig`: min_numel, HSDP;
`comm.api.ExchangerConfig`: bucket_mb, per_tensor):

- the compressor spec is parsed at construction, so a bad spec fails at once;
- the strategy name and its options are checked at construction against the registry's
  `traits(name, options)`, naming the valid ones, instead of failing at the first backward;
- ``error_feedback="auto"`` is on for strategies that compress by themselves (PowerSGD, as in
  torch's powerSGD_hook), else where the compressor's `feedback_helps` says so;
- ``seed`` reaches strategies that compress by themselves (PowerSGD's shared random init);
- `keeps_state`: whether anything is kept per bucket across steps (the DDP hook's earliest
  compressed step follows from it);
- `get_config()`: a plain dict, and ``type(config)(**config.get_config()) == config``;
- `describe()` and `fingerprint()`; `check_across_ranks()`: every rank must hold the same config
  before a strategy is built (`auto` and `hierarchical` run collectives while they are built,
  which ranks with different configs would hang in); `check_saved()`: a saved state loads only
  into the config that saved it.
"""

from __future__ import annotations

import zlib
from typing import Any, Callable, Mapping, Sequence

from ..compress import Compressor, compressor as make_compressor, resolve_error_feedback
from ..errors import ConfigMismatchError
from .backend import Backend
from .base import ExchangeStats, Strategy
from .framing import check_same_config, config_digest
from .hierarchical import launcher_ranks_per_node
from .registry import DEFAULT_INNER, KNOWN, StrategyTraits, make_strategy, traits as strategy_traits

# What a strategy that wraps another takes itself (StrategyTraits.wraps_inner), besides the inner one's options.
_WRAPPER_OPTIONS = frozenset({"inner", "ranks_per_node"})


def strategy_names(applies: Callable[[StrategyTraits], bool] = lambda t: True) -> list[str]:
    """The strategy names whose traits satisfy `applies` (for error messages that list valid choices)."""
    return [name for name in KNOWN if applies(strategy_traits(name))]


def accepted_options(found: StrategyTraits, options: Mapping[str, Any]) -> frozenset[str] | None:
    """The option names a strategy with traits `found` takes (a wrapper: its own and its inner
    strategy's); None when only the strategy itself can tell."""
    if found.options is not None:
        return found.options
    if found.wraps_inner:
        inner = strategy_traits(options.get("inner", DEFAULT_INNER))
        return _WRAPPER_OPTIONS | (inner.options or frozenset())
    return None


def _option_value(text: str) -> Any:
    """A method string's option value: int, float, true/false, or the text itself."""
    text = text.strip()
    if text.lower() in ("true", "false"):
        return text.lower() == "true"
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def split_method(spec: str) -> tuple[str, str | None, dict[str, Any]]:
    """One spelling of a method for every entry point and `gradwire experiment`: (compressor,
    strategy or None, strategy options).

    ``"topk:ratio=0.01@allgather"`` -> ``("topk:ratio=0.01", "allgather", {})``;
    ``"powersgd:rank=8"`` (a strategy that compresses by itself, named as the method) ->
    ``("none", "powersgd", {"rank": 8})``; ``"powersgd:rank=8@auto"`` (inside a strategy that wraps
    another) -> ``("none", "auto", {"inner": "powersgd", "rank": 8})``; a compressor alone -> (it, None, {})."""
    body, at, via = spec.partition("@")
    body, via = body.strip(), via.strip()
    if at and not via:
        raise ValueError(f"{spec!r} has nothing after '@': name a strategy ({', '.join(KNOWN)})")
    if via and via not in KNOWN:
        raise ValueError(f"unknown strategy {via!r} in {spec!r}; valid: {', '.join(KNOWN)}")
    name, _, args = body.partition(":")
    name = name.strip()
    if not (name in KNOWN and strategy_traits(name).own_compression):
        return body, via or None, {}
    options: dict[str, Any] = {}
    for item in filter(None, (a.strip() for a in args.split(","))):
        key, eq, value = item.partition("=")
        if not eq or not key.strip():
            raise ValueError(f"{name} options are key=value, got {item!r} in {spec!r}")
        options[key.strip()] = _option_value(value)
    if not via:
        return "none", name, options
    if not strategy_traits(via).wraps_inner:
        wrappers = ", ".join(strategy_names(lambda t: t.wraps_inner))
        raise ValueError(f"{name} runs on its own ({name!r}) or inside {wrappers} ('{name}:...@auto'), not @{via}")
    return "none", via, {"inner": name, **options}


def _check_relayed(first: Backend, second: Backend, text: str, what: str, rank: int) -> None:
    """`check_same_config` over a 2-D mesh known only by its two groups (HSDP: shard, then
    replicate): every rank learns every (rank, digest) pair in two hops, so all take the same
    branch; fixed-layout integers and text only, nothing unpickled."""
    pairs = [v for row in first.allgather_ints([rank, config_digest(text)]) for v in row]
    members = pairs[0::2]  # the first group's ranks
    pairs = [v for row in second.allgather_ints(pairs) for v in row]
    if len(set(pairs[1::2])) > 1:
        lines = "\n".join(f"  rank {r}: {d}" for r, d in zip(members, first.allgather_text(text)))
        lines = "\n".join(second.allgather_text(lines, limit=8192))
        raise ConfigMismatchError(f"{what} differ across ranks:\n{lines}")


class ExchangeConfig:
    """Compressor, strategy and its options, error feedback and seed: checked and resolved at
    construction, then read-only. Subclasses add an entry point's own fields (`_own_fields`)."""

    #: what the entry point is called in errors
    ENTRY_POINT = "gradwire"

    def __init__(self, compressor: Compressor | str, strategy: str | None, *, error_feedback: bool | str = "auto",
                 seed: int = 0, strategy_options: Mapping[str, Any] | None = None, **options: Any) -> None:
        named: dict[str, Any] = {}
        if isinstance(compressor, str):  # the method string may name the strategy too (`split_method`)
            spec = compressor
            compressor, via, named = split_method(spec)
            if via is not None and strategy is not None and strategy != via:
                raise ValueError(f"{spec!r} names strategy {via!r}, and strategy={strategy!r} was given: pass one")
            strategy = strategy if via is None else via
        self.parsed_compressor = _compressor_or_hint(compressor)
        self.compressor = str(self.parsed_compressor)
        both = set(strategy_options or {}) & set(options)
        if both:
            raise ValueError(f"options {sorted(both)} given both in strategy_options= and as keywords")
        given = {**(strategy_options or {}), **options}
        clash = sorted(k for k in set(named) & set(given) if named[k] != given[k])
        if clash:
            raise ValueError(f"options {clash} differ between the method string and the keywords: pass them once")
        self.strategy_options: dict[str, Any] = {**named, **given}
        if strategy is None:
            strategy = self.default_strategy()
        found = strategy_traits(strategy, self.strategy_options)  # unknown names: ValueError listing the valid ones
        self.strategy = strategy
        self._check_fits(found)
        accepted = accepted_options(found, self.strategy_options)
        unknown = set(self.strategy_options) - accepted if accepted is not None else set()
        if unknown:
            takes = f"takes {', '.join(sorted(accepted))}" if accepted else "takes no options"
            raise ValueError(f"strategy {strategy!r} {takes}, got {sorted(unknown)}")
        if found.own_compression and error_feedback == "auto":
            error_feedback = True  # its own error feedback, on by default as in torch's powerSGD_hook
        self.error_feedback = resolve_error_feedback(error_feedback, self.parsed_compressor)
        self.seed = int(seed)

    def default_strategy(self) -> str:
        """The strategy when neither the method string nor `strategy=` names one."""
        raise NotImplementedError(f"{type(self).__name__} needs a strategy")

    def _check_fits(self, found: StrategyTraits) -> None:
        """Reject a strategy this entry point cannot run (here: FSDP's reduce-scatter)."""
        if found.reduce_scatter:
            valid = strategy_names(lambda t: not t.reduce_scatter)
            raise ValueError(f"strategy {found.name!r} is FSDP's reduce-scatter (gradwire.hooks.fsdp); "
                             f"{self.ENTRY_POINT} takes {', '.join(valid)}")

    def _own_fields(self) -> dict[str, Any]:
        """A subclass's fields, as its constructor takes them."""
        return {}

    # ---- derived -----------------------------------------------------------------------
    @property
    def traits(self) -> StrategyTraits:
        return strategy_traits(self.strategy, self.strategy_options)

    @property
    def keeps_state(self) -> bool:
        """Whether anything is kept per bucket from step to step (error feedback, or the strategy's
        own state), so buckets must not change under it."""
        found = self.traits
        return (self.error_feedback or found.stateful
                or (found.stateful_unless_summable and not self.parsed_compressor.summable))

    def build_options(self) -> dict[str, Any]:
        """The options the strategy is built with: the user's, and `seed` for a strategy that
        compresses by itself (its shared random init)."""
        options = dict(self.strategy_options)
        if self.traits.own_compression:
            options.setdefault("seed", self.seed)
        return options

    def build_strategy(self, backend: Backend) -> Strategy:
        return make_strategy(self.strategy, backend, self.parsed_compressor, error_feedback=self.error_feedback,
                             **self.build_options())

    # ---- identity ----------------------------------------------------------------------
    def get_config(self) -> dict[str, Any]:
        """Plain data that rebuilds an equal config: ``type(self)(**self.get_config())``."""
        return {"compressor": self.compressor, "strategy": self.strategy, "error_feedback": self.error_feedback,
                "seed": self.seed, **self._own_fields(), "strategy_options": dict(self.strategy_options)}

    def describe(self) -> str:
        """One line naming every field (options sorted, so the order they were given in does not matter)."""
        config = self.get_config()
        config["strategy_options"] = dict(sorted(config["strategy_options"].items()))
        return " ".join(f"{key}={value!r}" for key, value in config.items())

    def fingerprint_text(self) -> str:
        """What `fingerprint` hashes (subclasses keep the text their saved states were stamped with)."""
        return self.describe()

    def fingerprint(self, extra: str = "") -> int:
        """A 32-bit checksum stamped on saved states; `extra`: what the entry point adds (FSDP: its layout)."""
        return zlib.crc32((self.fingerprint_text() + extra).encode())

    def __eq__(self, other: object) -> bool:
        return type(other) is type(self) and other.get_config() == self.get_config()  # type: ignore[attr-defined]

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.describe()})"

    # ---- checks ------------------------------------------------------------------------
    def check_across_ranks(self, backends: Sequence[Backend], text: str | None = None,
                           global_rank: int | None = None) -> None:
        """ConfigMismatchError on every rank unless every rank has the same `text` (default:
        `describe()`) and launcher node size (`auto` and `hierarchical` read it). Run it before a
        strategy is built. `backends`: one group, or the two groups of a 2-D mesh (HSDP: shard,
        then replicate; `global_rank` names this rank in the message)."""
        text = f"{self.describe() if text is None else text} ranks_per_node(launcher)={launcher_ranks_per_node()}"
        what = f"{self.ENTRY_POINT} configs"
        if len(backends) == 1:
            check_same_config(backends[0], text, what)
        elif len(backends) == 2:
            _check_relayed(backends[0], backends[1], text, what,
                           backends[0].rank if global_rank is None else global_rank)
        else:
            raise ValueError(f"check_across_ranks takes one group or the two of a 2-D mesh, got {len(backends)}")

    def check_saved(self, saved: Mapping[str, Any], fingerprint: int | None = None) -> None:
        """ValueError unless the saved state came from this config: its "fingerprint" must equal
        `fingerprint` (default: this config's), or for a state saved without one, its "config"
        must equal `get_config()`."""
        if "fingerprint" in saved:
            same = saved["fingerprint"] == (self.fingerprint() if fingerprint is None else fingerprint)
        else:
            same = saved.get("config") == self.get_config()
        if not same:
            was = saved.get("config", saved.get("describe", "an unknown config"))
            raise ValueError(f"checkpoint was saved with {was}, this {self.ENTRY_POINT} has {self.describe()}")


def check_rank(saved: Mapping[str, Any], rank: int, world: int, entry_point: str) -> None:
    """ValueError unless `saved` (one rank's state) was saved by this rank in a job of this size:
    states are per rank (error-feedback residuals, moments), so another rank's would resume silently
    wrong. States saved before ranks were recorded (no "rank" key) pass."""
    was_rank, was_world = saved.get("rank"), saved.get("world_size")
    if was_rank is not None and was_rank != rank or was_world is not None and was_world != world:
        of = f" of {was_world}" if was_world is not None else ""
        raise ValueError(f"this {entry_point} state was saved by rank {was_rank}{of}; this is rank {rank} of {world}. "
                         "Each rank keeps its own residuals: save every rank's state (all_ranks_state_dict() on "
                         "every rank, or one file per rank) and load each rank its own")


def _compressor_or_hint(spec: Compressor | str) -> Compressor:
    """The compressor; a strategy's name given as the compressor (``"powersgd:rank=8"``) raises
    with the spelling that works instead of only "unknown compressor"."""
    try:
        return make_compressor(spec)
    except ValueError as e:
        name, _, args = spec.partition(":") if isinstance(spec, str) else ("", "", "")
        if name.strip() not in KNOWN:
            raise
        options = ", ".join(f"{k.strip()}={v.strip()}" for k, _, v in (a.partition("=") for a in args.split(",")) if k)
        raise ValueError(f"{e}. {name.strip()!r} is a strategy, not a compressor: pass it as "
                         f"compressor=\"none\", strategy={name.strip()!r}" + (f", {options}" if options else "")) from None


def config_field(name: str, doc: str = "") -> property:
    """A read-only attribute of an entry point that reads `self.config.<name>` (old attribute names keep working)."""
    return property(lambda self: getattr(self.config, name), doc=doc or f"`config.{name}` (read-only)")


class EntryPoint:
    """What every entry point (DDP hook state, FSDP2 hook state, GradientExchanger) answers the
    same way: its config, and the statistics of the exchanges completed since `take_stats()`."""

    config: ExchangeConfig
    _untaken: ExchangeStats

    # the settings every entry point has, read-only (the old attribute names)
    strategy_name = config_field("strategy")
    strategy_options = config_field("strategy_options")
    error_feedback = config_field("error_feedback")
    seed = config_field("seed")

    def get_config(self) -> dict[str, Any]:
        return self.config.get_config()

    def describe(self) -> str:
        return self.config.describe()

    def fingerprint(self) -> int:
        return self.config.fingerprint()

    def take_stats(self) -> ExchangeStats:
        """Totals (bytes, seconds) of the exchanges completed since the last call."""
        stats, self._untaken = self._untaken, ExchangeStats()
        return stats
