"""The `auto` strategy: shortlist candidates by their cost models, time the shortlist, keep the fastest.

Compression is not free, so each candidate's modelled time also counts its encode and
decode work: seconds per element measured at the first exchange on tensors of the real sizes,
through error feedback when it is on (`gamma_encode`, `gamma_decode`). Each candidate prices
itself (`Strategy.modelled_seconds`, on the links of links.py); auto only measures the links
(probe.py), asks, and chooses (policy.py). alpha (s) and beta (s/byte) are measured once at
start-up, then averaged over ranks so every rank holds the same numbers and makes the same
choice for every bucket. alpha is the latency of one round (on a link with a long round trip,
about one round trip: gloo waits for its peer at every ring step; the probe fits it from
bucket-sized allreduces, not from a few bytes), and
every candidate pays its rounds once per bucket of the step (`per_step`), so where round trips
are long the candidates of fewer sequential rounds win: bf16 between nodes only
(`hierarchical_bf16`, a ring of the nodes instead of all ranks) on several nodes.

Tests: tests/comm/test_auto.py (choices, trial, near-ties, low-rank candidates, on real gloo ranks);
tests/experiments/test_wan.py (the probe across a 40 ms link).
"""

from __future__ import annotations

import logging
from dataclasses import replace
from typing import Any

import torch

from ...compress import Compressor, Ctx
from ..allgather import Allgather
from ..backend import Backend, Work
from ..base import ExchangeStats, Strategy, StrategyTraits, Workload, estimated_packet_bytes, segments_of, take_stats_of
from ..dense import Allreduce, DenseAllreduce
from ..hierarchical import Hierarchical, launcher_ranks_per_node
from ..links import CostModel, Links
from ..oktopk import OkTopK
from ..powersgd import POWERSGD_OPTIONS, PowerSGD
from . import policy
from .probe import agreed, measure, measure_compute
from .turns import TimedTurns
from .uncompressed import FasterUncompressed

log = logging.getLogger("gradwire")
#: candidates that do not compress: choosing dense for a bucket is worth a warning
UNCOMPRESSED = ("dense", "bf16", "hierarchical_bf16")

#: The order candidates are modelled in: `candidates` sorts by time, so ties keep this order.
MODEL_ORDER = ("dense", "allgather", "powersgd", "oktopk", "bf16", "hierarchical", "hierarchical_bf16")


def per_step(links: Links, buckets: int) -> Links:
    """The links as a step of `buckets` exchanges sees them: every collective's rounds are paid
    once per bucket (alpha x buckets) while the bytes are the step's, so a candidate of more
    rounds per exchange (PowerSGD: three allreduces; the flat ring: 2(P-1) steps) costs more on
    a link with a long round trip."""
    def scaled(m: CostModel | None) -> CostModel | None:
        return None if m is None else CostModel(m.alpha * buckets, m.beta)

    return Links(scaled(links.flat), scaled(links.intra), scaled(links.inter))  # type: ignore[arg-type]


class Auto(Strategy):
    """Summable compressors (none, fp16, bf16, randomk) are allreduced, as torch's hooks do:
    nothing is cheaper on the wire and the sums match torch's bit for bit. For the others, the
    cheapest of dense allreduce, allgather of packets and (for plain top-k) oktopk, by their
    cost models (AR-top-k is not a candidate: it sends one rank's positions for all); on several
    nodes of several ranks also a bf16 allreduce and `hierarchical`, with the links inside and
    between nodes measured apart. The model's choice is made
    once, from the sizes of all the tensors exchanged (`plan_sizes`, set by the DDP hook from the
    model's parameters) or else from the first bucket, so it is the same on every rank and does
    not depend on how tensors are grouped into buckets. The model only shortlists: with
    `trials=N` (default 2) each shortlisted candidate, dense and bf16 always among them, runs
    one untimed step (none on CPU after the uncompressed first steps: the links are connected) and N
    timed ones, with its encode and decode (one only if its first was
    more than `TRIAL_DROP` times the fastest; none for the uncompressed candidates the hook's
    uncompressed first steps timed already, on the same buckets), and the ranks choose by the
    mean of their steps' spans, within `TRIAL_MARGIN` (`choice`, and `choices` per bucket, all
    alike): a step's span counts how its buckets' exchanges overlap each other and the backward
    pass, which summed per-bucket times do not (where round trips are long, two buckets in flight
    together cost one round trip, not two). The candidates take turns, one step each (turns.py
    says why). Candidates within `TRIAL_CLOSE` of the fastest are then timed `settle` more turns each (default
    3 x trials): two timed turns of exchanges a few milliseconds long cannot tell bf16 from
    dense, and the extra turns cost little, every candidate in them being about as fast as the
    best. Why measure: the model misses what compression costs besides the wire (per-tensor
    overheads, ranks sharing cores), which can reverse its ranking. Error feedback of the
    candidates not chosen is not dropped: each rank adds what they still hold for a bucket to its
    gradient at the bucket's first exchange after the choice (`take_leftover`), so the chosen
    exchange sends it. `trials=0`: the model alone.

    `inner="powersgd"` (with PowerSGD's options: rank=, seed=, ...) makes the compressed
    candidates low-rank: PowerSGD's own allreduce and, on several nodes, `hierarchical` with
    PowerSGD between nodes, beside dense and bf16 (the compressor is then `none`). Its wire
    bytes are modelled from the matrices' shapes (`plan_shapes`, set by the DDP hook, or the
    first bucket's); its compute is not modelled, so on a fast link the trial is what rejects it.
    With a trial the model would shortlist every low-rank candidate anyway, so the links are
    not probed (probing costs whole seconds on a slow link); they are measured only if
    `predict` is asked, by every rank at once.

    On several nodes, the DDP hook's uncompressed first steps (`start_iter`) go to
    `warmup_strategy`: dense, bf16 or bf16 between nodes only, whichever steps fastest, timed in turns."""

    name = "auto"
    TRAITS = StrategyTraits("auto", frozenset({"alpha", "beta", "gamma_encode", "gamma_decode", "min_numel",
                                               "ranks_per_node", "trials", "settle", "intra_alpha", "intra_beta",
                                               "inner", *POWERSGD_OPTIONS}),
                            stateful_unless_summable=True, wraps_inner=True, cross_replica=False)

    def __init__(self, backend: Backend, compressor: Compressor | str, error_feedback: bool = True,
                 alpha: float | None = None, beta: float | None = None,
                 gamma_encode: float | None = None, gamma_decode: float | None = None, min_numel: int = 0,
                 ranks_per_node: int | None = None, intra_alpha: float | None = None,
                 intra_beta: float | None = None, trials: int = 2, settle: int | None = None,
                 inner: str | None = None, **inner_options: Any) -> None:
        super().__init__(backend, compressor, error_feedback=False, min_numel=min_numel)
        if inner not in (None, "powersgd"):
            raise ValueError(f"auto's inner= chooses low-rank candidates: 'powersgd', got {inner!r}")
        if inner_options and inner is None:
            raise ValueError(f"auto takes {sorted(inner_options)} only with inner='powersgd'")
        self.lowrank: dict[str, Any] | None = dict(inner_options) if inner == "powersgd" else None
        if self.lowrank is not None and self.compressor.name != "none":
            raise ValueError(f"auto with inner='powersgd' is its own compression: compressor must be 'none', "
                             f"got {str(self.compressor)!r}")
        if (alpha is None) != (beta is None) or (intra_alpha is None) != (intra_beta is None):
            raise ValueError("give both alpha and beta (intra_alpha and intra_beta) to override the measured "
                             "cost model, or neither")
        if (gamma_encode is None) != (gamma_decode is None):
            raise ValueError("give both gamma_encode and gamma_decode, or neither")
        c = self.compressor
        self.plan_sizes: list[int] | None = None
        self.plan_shapes: list[torch.Size] | None = None  # (the DDP hook sets these from the model)
        self.plan_buckets: int | None = None  # exchanges per step, each paying its own round trips
        self.choice: str | None = None
        if int(trials) < 0:
            raise ValueError(f"trials must be >= 0, got {trials}")
        self.trials = int(trials)  # steps each candidate is timed for before choosing (0: the model alone)
        if settle is not None and int(settle) < 0:
            raise ValueError(f"settle must be >= 0, got {settle}")
        self.settle = 3 * self.trials if settle is None else int(settle)  # more turns for near-ties
        self.choices: dict[str, str] = {}  # bucket key -> its measured choice (else `choice`)
        self._handed_over: set[str] = set()  # buckets the other candidates' error feedback went into
        self._timings: dict[str, float] = {}  # every trial phase's measurements, for the warning
        self._modelled: dict[str, float] = {}  # the cost model's times that shortlisted the trial
        self._stage = "first"  # of the trial: first, rest, settle (`_timed_exchange`)
        if c.summable and self.lowrank is None:
            self.subs: dict[str, Strategy] = {"allreduce": Allreduce(backend, c, error_feedback)}
            self.choice = "allreduce"  # nothing to measure
            self.trial = TimedTurns(backend, self.subs)
            return
        given = CostModel(alpha, beta) if alpha is not None else None  # type: ignore[arg-type]
        self._model: CostModel | None = given
        # encode/decode seconds per element: given, or measured at the first exchange on the real sizes
        self.gamma: tuple[float, float] | None = (gamma_encode, gamma_decode) if gamma_encode is not None else None
        self._feedback = error_feedback
        self.subs = {"dense": DenseAllreduce(backend)}
        lowrank = self.lowrank
        if lowrank is not None:
            self.subs["powersgd"] = PowerSGD(backend, error_feedback, **lowrank)  # (its compute: the trial)
        else:
            self.subs["allgather"] = Allgather(backend, c, error_feedback, min_numel)
        if c.selects_global_topk:  # (plain top-k: what oktopk selects from the sum)
            # (not artopk: one rank's positions for everyone cost accuracy; docs/benchmarks.md)
            self.subs["oktopk"] = OkTopK(backend, c, error_feedback)
        self.nodes: Hierarchical | None = None  # on several nodes of several ranks: their links
        self._intra_model: CostModel | None = None
        if intra_alpha is not None:
            self._intra_model = CostModel(intra_alpha, intra_beta)  # type: ignore[arg-type]
        self._inter_model: CostModel | None = given
        per_node = ranks_per_node or launcher_ranks_per_node()
        if per_node is not None and 1 < per_node < backend.world_size:
            def between_nodes(inter: Backend) -> Strategy:
                if lowrank is not None:
                    return PowerSGD(inter, error_feedback, **lowrank)
                return Allgather(inter, c, error_feedback, min_numel)

            self.nodes = Hierarchical(backend, between_nodes, ranks_per_node=per_node)
            self.subs["hierarchical"] = self.nodes
            self.subs["bf16"] = Allreduce(backend, "bf16", error_feedback=False)  # the cheap dense baseline
            # bf16 between nodes only: one ring of `nodes` ranks crosses the slow links instead of
            # all ranks', so a step pays far fewer round trips where they are long
            self.subs["hierarchical_bf16"] = Hierarchical.beside(
                self.nodes, lambda inter: Allreduce(inter, "bf16", error_feedback=False))
            self.warmup_strategy = FasterUncompressed(self.subs["dense"], self.subs["bf16"],
                                                      margin=policy.TRIAL_MARGIN,
                                                      hierarchical_bf16=self.subs["hierarchical_bf16"])
        self.trial = TimedTurns(backend, self.subs)  # (turns.py)
        if self.lowrank is None or not self.trials:
            self._measure_links()  # (the low-rank trial runs every candidate: nothing to shortlist)

    def _measure_links(self) -> None:
        """The cost models not given: the flat links, and on several nodes the links inside a node
        (each node measures its own; all ranks hold the average) and between nodes. A collective:
        every rank calls it at the same point."""
        if self._model is None:
            self._model = measure(self.backend)
        log.info("gradwire auto: alpha=%.3g s, beta=%.3g s/B (%.2f GB/s)", self._model.alpha, self._model.beta,
                 1e-9 / self._model.beta)
        if self.nodes is None:
            return
        if self._intra_model is None:
            self._intra_model = agreed(self.backend, measure(self.nodes.intra))
        if self._inter_model is None:
            self._inter_model = agreed(self.backend, measure(self.nodes.inter))
        log.info("gradwire auto: %d nodes x %d ranks; intra alpha=%.3g beta=%.3g, inter alpha=%.3g beta=%.3g",
                 self.backend.world_size // self.nodes.intra.world_size, self.nodes.intra.world_size,
                 self._intra_model.alpha, self._intra_model.beta, self._inter_model.alpha, self._inter_model.beta)

    @property
    def model(self) -> CostModel:
        """The flat links' cost model (measured now if it was not: a collective)."""
        if self._model is None:
            self._measure_links()
        return self._model  # type: ignore[return-value]

    @property
    def intra_model(self) -> CostModel | None:
        """The links inside a node (None on one node, or with one rank per node)."""
        if self.nodes is not None and self._intra_model is None:
            self._measure_links()
        return self._intra_model if self.nodes is not None else None

    @property
    def inter_model(self) -> CostModel | None:
        """The links between nodes (None on one node, or with one rank per node)."""
        if self.nodes is not None and self._inter_model is None:
            self._measure_links()
        return self._inter_model if self.nodes is not None else None

    def predict(self, sizes: list[int], dtype: torch.dtype,
                shapes: list[torch.Size] | None = None) -> dict[str, float]:
        """Modelled seconds of each candidate for exchanging tensors of these sizes (and shapes),
        each candidate pricing itself; one that cannot (PowerSGD without shapes) gets 0: trusted,
        so that the trial measures it."""
        world, flat = self.backend.world_size, self.model
        work = Workload(list(sizes), dtype, list(shapes) if shapes is not None else None)
        if self.lowrank is None:
            if any(estimated_packet_bytes(self.compressor, n, dtype) is None for n in sizes):
                # size unknown until sent: trust the user's choice to compress
                dense = self.subs["dense"].modelled_seconds(Links(flat), work, world)
                return {"dense": dense, "allgather": 0.0}  # type: ignore[dict-item]
            if self.gamma is None:  # every rank reaches this at the same first exchange: a collective is safe
                self.gamma = measure_compute(self.backend, self.compressor, numel=1 << 22, sizes=sizes,
                                             error_feedback=self._feedback)
                log.info("gradwire auto: encode %.3g s/elem, decode %.3g s/elem (on the %d tensors, "
                         "error feedback %s)", *self.gamma, len(sizes), self._feedback)
            work = replace(work, encode_s=self.gamma[0], decode_s=self.gamma[1])
        links = per_step(Links(flat, self.intra_model, self.inter_model), self.plan_buckets or 1)
        names = [n for n in MODEL_ORDER if n in self.subs] + [n for n in self.subs if n not in MODEL_ORDER]
        times = {}
        for name in names:
            seconds = self.subs[name].modelled_seconds(links, work, world)
            times[name] = 0.0 if seconds is None else seconds
        return times

    def candidates(self, sizes: list[int], dtype: torch.dtype,
                   shapes: list[torch.Size] | None = None) -> list[str]:
        """What the timed trial runs: dense and bf16 always (the model misses what compression
        costs beside the wire on a busy host), and every other candidate the model puts within
        3x of its fastest, fastest first."""
        if self.lowrank is not None and self._model is None:  # none would be left out: all, not probed
            return list(self.subs)
        times = self.predict(self.plan_sizes or sizes, dtype, self.plan_shapes or shapes)
        self._modelled = times
        best = min(times.values())
        keep = [n for n in sorted(times, key=lambda n: times[n])
                if n in ("dense", "bf16") or times[n] <= 3 * best]
        return keep

    @property
    def measured(self) -> dict[str, float]:
        """Candidate -> mean seconds per timed step (its span), the shortest over ranks: the trial's,
        and for the uncompressed candidates it did not time, the uncompressed first steps'."""
        return {**self._known(), **self.trial.measured}

    def _known(self) -> dict[str, float]:
        """Step spans the uncompressed first steps already timed (dense, bf16, bf16 between nodes),
        on the same buckets, in the same turns: the trial need not time them again. Empty when
        those steps were too few to finish their turns (every rank alike: they agree by allreduce)."""
        warm = self.warmup_strategy
        if not isinstance(warm, FasterUncompressed) or warm.choices is None:
            return {}
        return {n: t for n, t in warm.measured.items() if n in self.subs}

    @property
    def measured_per_bucket(self) -> dict[str, dict[str, float]]:
        return self.trial.measured_per_bucket

    def _timed_exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool,
                        shapes: list[torch.Size] | None, keys: list[str] | None,
                        sizes: list[int]) -> Work[torch.Tensor] | None:
        """During the trial, exchange with this step's candidate (in turns, timed). The trial runs
        in stages, each ended by the ranks agreeing on its times at the first step after it:
        "first" (an untimed round, unless the uncompressed first steps ran, and one timed turn
        each), "rest" (trials - 1 more turns for the candidates within `policy.TRIAL_DROP` of the
        fastest: a step several times the best's cannot win, and on a slow link each of its turns
        costs seconds), "settle" (the near-ties).
        None once chosen."""
        trial = self.trial
        if trial.phase is None:
            known = self._known()
            order = [n for n in self.candidates(sizes, x.dtype, shapes) if n not in known]
            if order:
                self._stage = "first"
                # (after the uncompressed first steps every link is connected: on CPU nothing is
                # left for an untimed round to pay for; CUDA kernels compile at their first call)
                untimed = 0 if known and not x.is_cuda else 1
                trial.start(ctx.step, order, untimed=untimed, timed=min(self.trials, 1))
        if trial.phase is not None and trial.running(ctx.step):
            return trial.exchange(x, key, ctx, average, self.into_input, shapes, keys)
        if trial.phase is not None:
            trial.agree()
        measured = self.measured
        fastest = min(measured.values())  # (a step's span: its buckets' overlap counted)
        self._timings = {**self._timings, **measured}  # (every candidate's, for the warning)
        timed = list(trial.phase.order) if trial.phase is not None else []
        if self._stage == "first" and self.trials > 1:
            alive = [n for n in timed if measured[n] <= policy.TRIAL_DROP * fastest]
            if alive:
                self._stage = "rest"
                trial.start(ctx.step, alive, untimed=0, timed=self.trials - 1)
                return trial.exchange(x, key, ctx, average, self.into_input, shapes, keys)
        if self._stage in ("first", "rest"):
            close = [n for n in measured if measured[n] <= (1 + policy.TRIAL_CLOSE) * fastest]
            self._stage = "settle"
            # (the uncompressed first steps timed their own near-ties over several turns already)
            if self.settle and len(close) > 1 and any(n in trial.turns for n in close):
                trial.start(ctx.step, close, untimed=0, timed=self.settle)
                return trial.exchange(x, key, ctx, average, self.into_input, shapes, keys)
        self.choice = policy.prefer(measured, margin=policy.TRIAL_MARGIN)
        self.choices = {b: self.choice for b in self.measured_per_bucket}  # (timed by whole steps: one for all)
        log.info("gradwire auto: %s after a timed trial (turns: %s; from the uncompressed first steps: %s): %s; "
                 "per bucket: %s", self.choice, ", ".join(f"{n} {c}" for n, c in trial.turns.items()),
                 ", ".join(n for n in measured if n not in trial.turns) or "none",
                 ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in measured.items()),
                 "; ".join(f"{b}: {', '.join(f'{n} {t * 1e3:.3f}' for n, t in m.items())}"
                           for b, m in self.measured_per_bucket.items()))
        self._say_if_uncompressed({**self._timings, **measured}, "measured")
        return None

    def choose(self, sizes: list[int], dtype: torch.dtype, shapes: list[torch.Size] | None = None) -> str:
        if self.choice is None:
            times = self.predict(self.plan_sizes or sizes, dtype, self.plan_shapes or shapes)
            self.choice = policy.prefer(times)
            log.info("gradwire auto: %s for %d tensors of %d elements in all; modelled: %s", self.choice,
                     len(self.plan_sizes or sizes), sum(self.plan_sizes or sizes),
                     ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items()))
            self._say_if_uncompressed(times, "modelled")
        return self.choice

    def _say_if_uncompressed(self, times: dict[str, float], how: str) -> None:
        """One WARNING when auto decides to send gradients uncompressed: a newcomer's local check
        otherwise shows no compression with nothing said (what it timed, and how to force it)."""
        chosen = list(self.choices.values()) or [self.choice]
        dense = sum(c == "dense" for c in chosen)
        if not dense:
            return
        def listed(t: dict[str, float]) -> str:
            return ", ".join(f"{n} {s * 1e3:.3f} ms" for n, s in sorted(t.items(), key=lambda kv: kv[1]) if s > 0)

        modelled = times if how == "modelled" else self._modelled
        compressed = {n: t for n, t in modelled.items() if n not in UNCOMPRESSED and t > 0}
        # (allgather keeps what the compressor chose, as the tie-break does; else the fastest compressed)
        best = "allgather" if "allgather" in self.subs or not compressed else min(compressed, key=compressed.get)
        timing = f"{how}: {listed(times)}" + (f"; modelled: {listed(modelled)}" if modelled is not times else "")
        log.warning("gradwire auto: %s %d of %d buckets uncompressed: a dense allreduce steps as fast as any "
                    "exchange here (%s), so compressing (%s) would cost more time than it saves on these links. "
                    "To compress anyway pass strategy=%r (state.strategy.choices shows the choice per bucket).",
                    "sends" if how == "measured" else "will send", dense, len(chosen), timing, self.compressor, best)

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        sizes = [s.numel for s in segments_of(x, key, shapes, keys)]
        if self.choice is None and self.trials:
            trial = self._timed_exchange(x, key, ctx, average, shapes, keys, sizes)
            if trial is not None:
                return trial
        chosen = self.choose(sizes, x.dtype, shapes)
        name = self.choices.get(str(key), chosen)
        if str(key) not in self._handed_over:
            self._hand_over(x, key, name, shapes, keys)
        sub = self.subs[name]
        sub.into_input = self.into_input
        return sub.exchange(x, key, ctx, average, shapes, keys)

    def _hand_over(self, x: torch.Tensor, key: int | str, chosen: str, shapes: list[torch.Size] | None,
                   keys: list[str] | None) -> None:
        """Once per bucket, at its first exchange after the choice: what the other candidates'
        error feedback still holds from their trial turns goes into this rank's gradient (x, in
        place), so the chosen exchange sends it rather than it being dropped with them."""
        self._handed_over.add(str(key))
        for name, sub in self.subs.items():
            if name != chosen:
                left = sub.take_leftover(x, key, shapes, keys)
                if left is not None:
                    x.add_(left)

    def take_stats(self) -> ExchangeStats:
        return take_stats_of(self.subs.values())

    def state_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "choices": dict(self.choices),  # (a resumed run keeps its choices;
                "handed_over": sorted(self._handed_over),  # one taken in the trial restarts it)
                "subs": {n: s.state_dict() for n, s in self.subs.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.choice = state["choice"]
        self.choices = dict(state.get("choices", {}))
        self._handed_over = set(state.get("handed_over", ()))
        for n, s in state["subs"].items():
            self.subs[n].load_state_dict(s)
