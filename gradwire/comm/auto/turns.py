"""Timed turns: how `auto` and its uncompressed first steps compare exchanges on the real buckets.

Candidates take turns, one step each, so drift over the measurement (a shared host, a link's
bursts) hits all of them alike, and a first untimed round (where one is asked for) pays for
connections, allocations and compiling. What a turn costs is its step's span: from its first
bucket's exchange to the last one's result. The exchanges run as they will after the trial
(asynchronously, the buckets' collectives in flight together and beside the backward pass), so a
candidate that blocks the step (`hierarchical` waits inside a node) is charged for it and one
whose buckets overlap is not charged twice: on a link with long round trips that is the
difference between 2 x 300 ms and 325 ms. Each bucket's own time (issue to result) is kept
too, for the logs. The ranks do not line up before a turn (that would cost a round trip per
turn, a tenth of a second across a WAN): a rank that arrives early, while another is still busy
with its own work (rank 0's evaluation), waits inside the collective, so of each turn the ranks
keep the shortest span, the one of the rank that arrived last, which waited for nobody. After a
phase the ranks exchange their times with one allgather, reached at the same bucket on every
rank, so every rank holds the same numbers and makes the same choice.

Tests: tests/comm/test_auto.py (the trial and its near-ties), tests/hooks/test_ddp_hook.py (the
uncompressed first steps).
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import torch

from ...compress import Ctx
from ..backend import Backend, Work
from ..base import Strategy


@dataclass(frozen=True)
class Phase:
    """From step `first`, the candidates in `order` take turns: `untimed` rounds, then `timed`."""
    first: int
    order: list[str]
    untimed: int
    timed: int

    @property
    def steps(self) -> int:
        return (self.untimed + self.timed) * len(self.order)


class TimedTurns:
    """Runs phases of turns among `subs` and keeps each candidate's mean seconds per timed turn:
    the step's span (`measured`) and each bucket's own time (`measured_per_bucket`), over all phases."""

    def __init__(self, backend: Backend, subs: dict[str, Strategy]) -> None:
        self.backend, self.subs = backend, subs
        self.phase: Phase | None = None  # the current (or last) phase; None before the first
        self.turns: dict[str, int] = {}  # candidate -> timed turns in the phases agreed on
        self.measured: dict[str, float] = {}
        self.measured_per_bucket: dict[str, dict[str, float]] = {}
        self._spent: dict[str, dict[str, float]] = {}  # this phase, this rank: bucket -> candidate -> s
        self._spans: dict[int, tuple[str, float, float]] = {}  # this phase: step -> (candidate, start, last end)
        self._agreed: dict[str, dict[str, float]] = {}  # earlier phases, over ranks: the same, summed
        self._agreed_spans: dict[str, float] = {}
        self._lock = threading.Lock()  # (results arrive on the transport's threads)

    def start(self, step: int, order: list[str], untimed: int, timed: int) -> None:
        self.phase = Phase(step, list(order), untimed, timed)

    def running(self, step: int) -> bool:
        """Whether `step` is one of the current phase's turns."""
        return self.phase is not None and step - self.phase.first < self.phase.steps

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool, into_input: bool,
                 shapes: list[torch.Size] | None, keys: list[str] | None) -> Work[torch.Tensor]:
        """This step's turn: its candidate exchanges x, timed unless the round is untimed."""
        phase = self.phase
        assert phase is not None and self.running(ctx.step)
        turn = ctx.step - phase.first
        name = phase.order[turn % len(phase.order)]
        sub = self.subs[name]
        sub.into_input = into_input
        if turn < phase.untimed * len(phase.order):
            return sub.exchange(x, key, ctx, average, shapes, keys)
        step, bucket = ctx.step, str(key)
        if step not in self._spans:
            self._spans[step] = (name, time.perf_counter(), 0.0)
        self._spent.setdefault(bucket, {})  # (buckets in the order issued, alike on all ranks)
        began = time.perf_counter()

        def done(out: torch.Tensor) -> torch.Tensor:
            now = time.perf_counter()
            with self._lock:
                spent = self._spent[bucket]
                spent[name] = spent.get(name, 0.0) + now - began
                who, start, end = self._spans[step]
                self._spans[step] = (who, start, max(end, now))
            return out

        return sub.exchange(x, key, ctx, average, shapes, keys).then(done)

    def agree(self) -> None:
        """Fold the phase's times into the means: of each bucket's time and each step's span, the
        shortest over ranks (one allgather). Every exchange of the phase has completed (DDP waits
        for a step's buckets before the next)."""
        phase = self.phase
        assert phase is not None
        buckets, steps = list(self._spent), sorted(self._spans)
        rows = [[self._spent[b].get(n, 0.0) for n in phase.order] for b in buckets]
        mine = torch.tensor([t for row in rows for t in row]
                            + [max(self._spans[s][2] - self._spans[s][1], 0.0) for s in steps], dtype=torch.float64)
        gathered = torch.stack(self.backend.allgather(mine).wait())
        # (a time no clock gives, NaN or negative, from a broken peer: never the fastest)
        gathered = torch.nan_to_num(gathered, nan=float("inf")).masked_fill(gathered < 0, float("inf"))
        least = gathered.amin(dim=0).tolist()
        per_bucket, spans = least[:len(buckets) * len(phase.order)], least[len(buckets) * len(phase.order):]
        for i, b in enumerate(buckets):
            agreed = self._agreed.setdefault(b, {})
            for j, n in enumerate(phase.order):
                agreed[n] = agreed.get(n, 0.0) + per_bucket[i * len(phase.order) + j]
        for s, t in zip(steps, spans):
            who = self._spans[s][0]
            self._agreed_spans[who] = self._agreed_spans.get(who, 0.0) + t
        for n in phase.order:
            self._agreed_spans.setdefault(n, 0.0)
            self.turns[n] = self.turns.get(n, 0) + phase.timed
        self._spent, self._spans = {}, {}
        self.measured_per_bucket = {b: {n: t / self.turns[n] for n, t in agreed.items()}
                                    for b, agreed in self._agreed.items()}
        self.measured = {n: t / self.turns[n] for n, t in self._agreed_spans.items()}
