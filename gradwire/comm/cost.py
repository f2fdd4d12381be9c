"""Alpha-beta cost model and the `auto` strategy that chooses by it.

Compression is not free, so each candidate's modelled time also counts its encode and
decode work: seconds per element measured at the first exchange on tensors of the real sizes,
through error feedback when it is on (`gamma_encode`, `gamma_decode`; allgather decodes P
packets). A collective of n bytes over P ranks is modelled with ring algorithms:
allreduce ``2(P-1)·alpha + 2(P-1)/P · n · beta``, allgather of m bytes each
``(P-1)·alpha + (P-1) · m · beta``, broadcast ``ceil(log2 P)·(alpha + n·beta)``, all-to-all of
n bytes out ``2(P-1)·alpha + n·beta`` (counts first).
alpha (s) and beta (s/byte) are measured once at start-up, then averaged over ranks so
every rank holds the same numbers and makes the same choice for every bucket.
"""

from __future__ import annotations

import logging
import math
import statistics
import time
from dataclasses import dataclass
from typing import Any

import torch

from ..compress import Compressor, Ctx
from .backend import Backend, Work
from .hierarchical import Hierarchical, launcher_ranks_per_node
from .strategies import Allgather, Allreduce, DenseAllreduce, ExchangeStats, Strategy, segments_of, take_stats_of
from .turns import TimedTurns
from .uncompressed import FasterUncompressed

log = logging.getLogger("gradwire")


@dataclass(frozen=True)
class CostModel:
    alpha: float  # seconds per message
    beta: float  # seconds per byte

    def allreduce(self, nbytes: int, world: int) -> float:
        return 2 * (world - 1) * self.alpha + 2 * (world - 1) / world * nbytes * self.beta

    def allgather(self, nbytes_each: int, world: int, sized: bool = True) -> float:
        t = (world - 1) * (self.alpha + nbytes_each * self.beta)
        return t if sized else t + (world - 1) * (self.alpha + 8 * self.beta)  # size exchange

    def broadcast(self, nbytes: int, world: int) -> float:
        return math.ceil(math.log2(max(world, 2))) * (self.alpha + nbytes * self.beta)

    def alltoall(self, nbytes_out: int, world: int) -> float:
        """Pairwise exchange: one message to each peer, nbytes_out in all, after a size exchange."""
        return 2 * (world - 1) * self.alpha + (nbytes_out + 16 * (world - 1)) * self.beta


def measure(backend: Backend, small: int = 1, large: int = 1 << 20, repeat: int = 5,
            enough_s: float = 0.1, start: int = 1 << 18) -> CostModel:
    """Fit alpha and beta from timed allreduces of `small` float32 elements and of a large size
    grown 4x at a time from `start` until one allreduce takes `enough_s` (or reaches `large`):
    on a fast link that is `large`, on a 20 Mbit/s link `start` (1 MB, well past the bursts a
    shaper lets through at line rate), so a slow network is not probed for many seconds. The
    ranks agree on each step (the mean of their times decides), so they run the same collectives."""
    world = backend.world_size

    def timed(n: int) -> float:
        t = torch.zeros(n)
        backend.allreduce(t).wait()  # warm-up
        samples = []
        for _ in range(repeat):
            began = time.perf_counter()
            backend.allreduce(t).wait()
            samples.append(time.perf_counter() - began)
        mean = torch.tensor([statistics.median(samples)], dtype=torch.float64)
        return float(backend.allreduce(mean).wait()) / world  # the same number on every rank

    t_small = timed(small)
    n = min(start, large)
    t_large = timed(n)
    while t_large < enough_s and n < large:
        n = min(4 * n, large)
        t_large = timed(n)
    large = n
    steps = max(2 * (world - 1), 1)
    alpha = max(t_small / steps, 1e-7)
    beta = max((t_large - t_small) / (2 * (world - 1) / world * 4 * (large - small)) if world > 1 else 1e-10, 1e-12)
    agreed = torch.tensor([alpha, beta], dtype=torch.float64)
    backend.allreduce(agreed).wait()
    alpha, beta = (agreed / world).tolist()
    return CostModel(alpha, beta)


def measure_compute(backend: Backend, c: Compressor, numel: int = 1 << 20, repeat: int = 3,
                    sizes: list[int] | None = None, error_feedback: bool = False) -> tuple[float, float]:
    """Seconds per element to encode and to decode with c, averaged over ranks (so all agree).
    With `sizes`, on tensors of exactly those sizes (and through error feedback if used): a
    model of many small tensors then pays their per-tensor overheads, which a 1M-element probe
    hides (10 tensors of 192k elements in all: 2.6 ms to encode, not 0.2). A large model is
    sampled: its first tensors, up to `numel` elements (at least one tensor)."""
    from ..compress import ErrorFeedback

    sample: list[int] = []
    for n in sizes or [numel]:
        if sample and sum(sample) + n > numel:
            break
        sample.append(n)
    gen = torch.Generator().manual_seed(0)
    xs = [torch.randn(n, generator=gen) for n in sample]
    numel = max(sum(x.numel() for x in xs), 1)
    ef = ErrorFeedback(c) if error_feedback else None

    def encode_all() -> list:
        return [(ef.encode(x, i) if ef is not None else c.encode(x)).tensor() for i, x in enumerate(xs)]

    packets = encode_all()
    t_enc = min(_timed(encode_all) for _ in range(repeat))
    t_dec = min(_timed(lambda: [c.decode(p) for p in packets]) for _ in range(repeat))
    agreed = torch.tensor([t_enc / numel, t_dec / numel], dtype=torch.float64)
    backend.allreduce(agreed).wait()
    enc, dec = (agreed / backend.world_size).tolist()
    return enc, dec


def _timed(fn: Any) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def estimated_packet_bytes(c: Compressor, numel: int, dtype: torch.dtype) -> int | None:
    """Packet size from numel alone (identical on every rank), or None if data-dependent
    with no estimate."""
    static = c.static_size(numel, dtype)
    if static is not None:
        return static
    count = getattr(c, "value_count", None) or getattr(getattr(c, "first", None), "value_count", None)
    if count is not None and count(numel) is not None:
        item = torch.empty((), dtype=dtype).element_size()
        return 128 + count(numel) * (item + 4)
    return None


def worth_compressing(c: Compressor, numel: int, dtype: torch.dtype) -> bool:
    """Whether c's packet for numel elements is smaller than the dense bytes (decided from numel
    and dtype alone, so identically on every rank; unknown sizes count as worth it)."""
    est = estimated_packet_bytes(c, numel, dtype)
    return est is None or est < numel * torch.empty((), dtype=dtype).element_size()


class Auto(Strategy):
    """Summable compressors (none, fp16, bf16, randomk) are allreduced, as torch's hooks do:
    nothing is cheaper on the wire and the sums match torch's bit for bit. For the others, the
    cheapest of dense allreduce, allgather of packets and (for plain top-k) oktopk, by the
    cost model (AR-top-k is not a candidate: it sends one rank's positions for all); on several
    nodes of several ranks also a bf16 allreduce and `hierarchical`, with the links inside and
    between nodes measured apart. The model's choice is made
    once, from the sizes of all the tensors exchanged (`plan_sizes`, set by the DDP hook from the
    model's parameters) or else from the first bucket, so it is the same on every rank and does
    not depend on how tensors are grouped into buckets. The model only shortlists: with
    `trials=N` (default 2) each shortlisted candidate, dense and bf16 always among them, runs
    one untimed step and N timed ones, with its encode and decode, and the ranks choose by the
    mean of their times, within `TRIAL_MARGIN`, for each bucket (`choices`; `choice`, from the
    buckets' summed times, serves a bucket the trial did not see, such as a resumed DDP's first
    grouping): a bucket of small tensors may stay dense while a large one is compressed. The
    candidates take turns, one step each (turns.py says why). Candidates within `TRIAL_CLOSE` of
    the fastest (each bucket's fastest, summed) are then timed `settle` more turns each (default
    3 x trials): two timed turns of 5-13 ms exchanges could not tell bf16 from dense (charlm at
    1 Gbit/s, 2026-12-01), and the extra turns cost little, every candidate in them being about
    as fast as the best. Why measure: the model misses what compression costs besides the wire
    (per-tensor overheads, ranks sharing cores: at 1 Gbit/s on 4 ranks of 2 cores it modelled
    top-k allgather at 1.9 ms against dense's 10.3 ms; measured, the step was 28 ms against
    16). Error feedback of the candidates not chosen is dropped with them (N + 1 steps of
    residual). `trials=0`: the model alone.

    `inner="powersgd"` (with PowerSGD's options: rank=, seed=, ...) makes the compressed
    candidates low-rank: PowerSGD's own allreduce and, on several nodes, `hierarchical` with
    PowerSGD between nodes, beside dense and bf16 (the compressor is then `none`). Its wire
    bytes are modelled from the matrices' shapes (`plan_shapes`, set by the DDP hook, or the
    first bucket's); its compute is not modelled, so on a fast link the trial is what rejects it.
    With a trial the model would shortlist every low-rank candidate anyway, so the links are
    not probed (1.1 s of three probes in the first step of a 13 s run at 1 Gbit/s); they are
    measured only if `predict` is asked, by every rank at once.

    On several nodes, the DDP hook's uncompressed first steps (`start_iter`) go to
    `warmup_strategy`: dense or bf16, whichever is faster per bucket, timed in turns."""

    name = "auto"

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
        self.plan_shapes: list[torch.Size] | None = None  # (the DDP hook sets both from the model)
        self.choice: str | None = None
        if int(trials) < 0:
            raise ValueError(f"trials must be >= 0, got {trials}")
        self.trials = int(trials)  # steps each candidate is timed for before choosing (0: the model alone)
        if settle is not None and int(settle) < 0:
            raise ValueError(f"settle must be >= 0, got {settle}")
        self.settle = 3 * self.trials if settle is None else int(settle)  # more turns for near-ties
        self.choices: dict[str, str] = {}  # bucket key -> its measured choice (else `choice`)
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
        if self.lowrank is not None:
            from .powersgd import PowerSGD

            self.subs["powersgd"] = PowerSGD(backend, error_feedback, **self.lowrank)  # (its compute: the trial)
        else:
            self.subs["allgather"] = Allgather(backend, c, error_feedback, min_numel)
        if c.name == "topk":
            from .oktopk import OkTopK

            self.subs["oktopk"] = OkTopK(backend, c, error_feedback)  # (not artopk: one rank's positions
            # for everyone lost 11 points on mnist1d at 100 Mbit/s, 84.1% vs allgather's 95.3%)
        self.nodes: Hierarchical | None = None  # on several nodes of several ranks: their links
        self._intra_model: CostModel | None = None
        if intra_alpha is not None:
            self._intra_model = CostModel(intra_alpha, intra_beta)  # type: ignore[arg-type]
        self._inter_model: CostModel | None = given
        per_node = ranks_per_node or launcher_ranks_per_node()
        if per_node is not None and 1 < per_node < backend.world_size:
            between = {"inner": "powersgd", **self.lowrank} if self.lowrank is not None else {"min_numel": min_numel}
            self.nodes = Hierarchical(backend, c, error_feedback, ranks_per_node=per_node, **between)
            self.subs["hierarchical"] = self.nodes
            self.subs["bf16"] = Allreduce(backend, "bf16", error_feedback=False)  # the cheap dense baseline
            self.warmup_strategy = FasterUncompressed(self.subs["dense"], self.subs["bf16"], margin=TRIAL_MARGIN)
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
            self._intra_model = _agreed(self.backend, measure(self.nodes.intra))
        if self._inter_model is None:
            self._inter_model = _agreed(self.backend, measure(self.nodes.inter))
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
        """Modelled seconds of each candidate for exchanging tensors of these sizes (and shapes)."""
        world, m = self.backend.world_size, self.model
        item = torch.empty((), dtype=dtype).element_size()
        dense = sum(sizes) * item
        if self.lowrank is not None:
            return self._predict_lowrank(sizes, item, shapes)
        packed = [estimated_packet_bytes(self.compressor, n, dtype) for n in sizes]
        times = {"dense": m.allreduce(dense, world)}
        if None in packed:
            times["allgather"] = 0.0  # size unknown until sent: trust the user's choice to compress
            return times
        est = sum(min(p, n * item) for p, n in zip(packed, sizes))  # type: ignore[type-var]
        static = all(self.compressor.static_size(n, dtype) is not None for n in sizes)
        numel = sum(sizes)
        if self.gamma is None:  # every rank reaches this at the same first exchange: a collective is safe
            self.gamma = measure_compute(self.backend, self.compressor, numel=1 << 22, sizes=sizes,
                                         error_feedback=self._feedback)
            log.info("gradwire auto: encode %.3g s/elem, decode %.3g s/elem (on the %d tensors, error feedback %s)",
                     *self.gamma, len(sizes), self._feedback)
        enc, dec = self.gamma
        times["allgather"] = m.allgather(est, world, sized=static) + numel * (enc + world * dec)
        if "oktopk" in self.subs:
            k = sum(self.compressor.value_count(n) for n in sizes)  # type: ignore[attr-defined]
            times["oktopk"] = oktopk_seconds(m, k, item, world) + numel * (enc + dec)
        if self.intra_model is not None:  # dense inside a node; only a node's share crosses the slow links
            g = self.nodes.intra.world_size  # type: ignore[union-attr]
            nodes, intra = world // g, self.intra_model
            times["bf16"] = m.allreduce(numel * 2, world)  # the cast itself is taken as free
            times["hierarchical"] = (intra.alltoall(dense * (g - 1) // g, g) + intra.allgather(dense // g, g)
                                     + self.inter_model.allgather(est // g, nodes, sized=static)
                                     + numel // g * (enc + nodes * dec))
        return times

    def _predict_lowrank(self, sizes: list[int], item: int, shapes: list[torch.Size] | None) -> dict[str, float]:
        """PowerSGD's candidates: its allreduces of the dense part, of P and of Q (three
        messages), flat or between nodes on a node's share. Unknown shapes: 0 (trust the user)."""
        from .powersgd import sent_numels

        world, m, numel = self.backend.world_size, self.model, sum(sizes)
        times = {"dense": m.allreduce(numel * item, world), "powersgd": 0.0}
        if self.intra_model is not None:
            times["bf16"] = m.allreduce(numel * 2, world)
            times["hierarchical"] = 0.0
        if shapes is None or sum(math.prod(s) for s in shapes) != numel:
            return times
        rank, rate = int(self.lowrank.get("rank", 1)), float(self.lowrank.get("min_compression_rate", 2.0))
        parts = [n * item for n in sent_numels(shapes, rank, rate) if n]
        times["powersgd"] = sum(m.allreduce(n, world) for n in parts)
        if self.intra_model is not None:
            g = self.nodes.intra.world_size  # type: ignore[union-attr]
            nodes, intra = world // g, self.intra_model
            times["hierarchical"] = (intra.alltoall(numel * item * (g - 1) // g, g)
                                     + intra.allgather(numel * item // g, g)
                                     + sum(self.inter_model.allreduce(n // g, nodes) for n in parts))
        return times

    def candidates(self, sizes: list[int], dtype: torch.dtype,
                   shapes: list[torch.Size] | None = None) -> list[str]:
        """What the timed trial runs: dense and bf16 always (the model misses what compression
        costs beside the wire on a busy host), and every other candidate the model puts within
        3x of its fastest, fastest first."""
        if self.lowrank is not None and self._model is None:  # none would be left out: all, not probed
            return list(self.subs)
        times = self.predict(self.plan_sizes or sizes, dtype, self.plan_shapes or shapes)
        best = min(times.values())
        keep = [n for n in sorted(times, key=lambda n: times[n])
                if n in ("dense", "bf16") or times[n] <= 3 * best]
        return keep

    @property
    def measured(self) -> dict[str, float]:
        """Candidate -> mean seconds per timed trial turn, summed over buckets, averaged over ranks."""
        return self.trial.measured

    @property
    def measured_per_bucket(self) -> dict[str, dict[str, float]]:
        return self.trial.measured_per_bucket

    def _timed_exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool,
                        shapes: list[torch.Size] | None, keys: list[str] | None,
                        sizes: list[int]) -> Work[torch.Tensor] | None:
        """During the trial, exchange with this step's candidate (in turns, timed). At the first
        step after a phase, agree on its times; then time the near-ties again (`settle`), or
        choose by `prefer`. None once chosen."""
        trial = self.trial
        if trial.phase is None:
            trial.start(ctx.step, self.candidates(sizes, x.dtype, shapes), untimed=1, timed=self.trials)
        if trial.running(ctx.step):
            return trial.exchange(x, key, ctx, average, self.into_input, shapes, keys)
        trial.agree()
        phase = trial.phase
        assert phase is not None
        mix = sum(min(t.values()) for t in self.measured_per_bucket.values())  # each bucket's fastest
        close = [n for n in phase.order if self.measured[n] <= (1 + TRIAL_CLOSE) * mix]
        if phase.untimed and self.settle and len(close) > 1:
            trial.start(ctx.step, close, untimed=0, timed=self.settle)
            return trial.exchange(x, key, ctx, average, self.into_input, shapes, keys)
        self.choice = prefer(self.measured, margin=TRIAL_MARGIN)
        self.choices = {b: prefer(t, margin=TRIAL_MARGIN) for b, t in self.measured_per_bucket.items()}
        log.info("gradwire auto: %s after a timed trial (turns: %s): %s; per bucket: %s", self.choice,
                 ", ".join(f"{n} {c}" for n, c in trial.turns.items()),
                 ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in self.measured.items()),
                 "; ".join(f"{b}: {self.choices[b]} ({', '.join(f'{n} {t * 1e3:.3f}' for n, t in m.items())})"
                           for b, m in self.measured_per_bucket.items()))
        return None

    def choose(self, sizes: list[int], dtype: torch.dtype, shapes: list[torch.Size] | None = None) -> str:
        if self.choice is None:
            times = self.predict(self.plan_sizes or sizes, dtype, self.plan_shapes or shapes)
            self.choice = prefer(times)
            log.info("gradwire auto: %s for %d tensors of %d elements in all; modelled: %s", self.choice,
                     len(self.plan_sizes or sizes), sum(self.plan_sizes or sizes),
                     ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in times.items()))
        return self.choice

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        sizes = [s.numel for s in segments_of(x, key, shapes, keys)]
        if self.choice is None and self.trials:
            trial = self._timed_exchange(x, key, ctx, average, shapes, keys, sizes)
            if trial is not None:
                return trial
        chosen = self.choose(sizes, x.dtype, shapes)
        sub = self.subs[self.choices.get(str(key), chosen)]
        sub.into_input = self.into_input
        return sub.exchange(x, key, ctx, average, shapes, keys)

    def take_stats(self) -> ExchangeStats:
        return take_stats_of(self.subs.values())

    def state_dict(self) -> dict[str, Any]:
        return {"choice": self.choice, "choices": dict(self.choices),  # (a resumed run keeps its choices;
                "subs": {n: s.state_dict() for n, s in self.subs.items()}}  # one taken in the trial restarts it)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.choice = state["choice"]
        self.choices = dict(state.get("choices", {}))
        for n, s in state["subs"].items():
            self.subs[n].load_state_dict(s)


# Candidates in the order of how little they change the training algorithm: dense is exact, bf16
# rounds, allgather sums every rank's own top-k, hierarchical each node's; oktopk and artopk keep
# about k entries of the global sum (artopk: at one rank's positions), so they lose more per step.
PREFERENCE = ("dense", "bf16", "allgather", "hierarchical", "powersgd")
APPROXIMATE = ("oktopk", "artopk")
MARGIN = 0.10  # a candidate this much slower than the fastest, by the model, still counts as as fast
#: The same for times measured in the trial: tighter, because it is a measurement, and because
#: a margin is also what auto may lose to the fastest (charlm at 1 Gbit/s, 2026-12-01: bf16
#: was 11% faster than dense, which the model's 10% still called a tie).
TRIAL_MARGIN = 0.03
#: After the first timed turns, candidates whose step is this close to the fastest per-bucket mix
#: are timed again (so a further turn costs at most this much more than the best).
TRIAL_CLOSE = 0.25
APPROXIMATE_GAIN = 4.0  # oktopk/artopk must be this many times faster than the others


def prefer(times: dict[str, float], margin: float = MARGIN, gain: float = APPROXIMATE_GAIN) -> str:
    """The first candidate in PREFERENCE order modelled within `margin` of the fastest of them,
    unless oktopk or artopk is `gain` times faster still (then the faster of those):
    a near-tie (these models are a few percent apart at 4 ranks) goes to the exchange that
    changes training least, and one that keeps fewer entries of the sum must win clearly
    (as oktopk does on large clusters, where allgather's volume grows with the ranks)."""
    exact = {n: t for n, t in times.items() if n not in APPROXIMATE}
    approx = {n: t for n, t in times.items() if n in APPROXIMATE}
    if exact:
        best = min(exact.values())
        ranked = [n for n in PREFERENCE if n in exact] + [n for n in exact if n not in PREFERENCE]
        choice = next(n for n in ranked if exact[n] <= best * (1 + margin))
        if not approx or min(approx.values()) * gain > best:
            return choice
    return min(approx, key=lambda n: approx[n])


def oktopk_seconds(m: CostModel, k: int, item: int, world: int) -> float:
    """Modelled `oktopk` exchange of k pairs: (P-1)/P of them out by all-to-all, then an
    allgatherv of about k/P kept pairs each (a value and a bit-packed index, ~2 bytes)."""
    pair = 2 + item
    return m.alltoall(k * pair * (world - 1) // world, world) + m.allgather(k * pair // world + 12, world, sized=False)


def _agreed(backend: Backend, model: CostModel) -> CostModel:
    """The average of every rank's model, so all ranks choose alike."""
    t = torch.tensor([model.alpha, model.beta], dtype=torch.float64)
    backend.allreduce(t).wait()
    alpha, beta = (t / backend.world_size).tolist()
    return CostModel(alpha, beta)
