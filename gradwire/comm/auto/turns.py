"""Timed turns: how `auto` and its uncompressed first steps compare exchanges on the real buckets.

Candidates take turns, one step each, so drift over the measurement (a shared host, a link's
bursts) hits all of them alike, and a first untimed round pays for connections, allocations and
compiling. A timed turn starts with a 1-element allreduce, so a rank still busy with its own work
(rank 0's evaluation) is not counted as the exchange's cost, and it waits for the exchange, so
the time is the exchange's alone. After a phase the ranks average their times with one
allreduce, reached at the same bucket on every rank, so every rank holds the same numbers and
makes the same choice.

Tests: tests/comm/test_auto.py (the trial and its near-ties), tests/hooks/test_ddp_hook.py (the
uncompressed first steps).
"""

from __future__ import annotations

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
    """Runs phases of turns among `subs` and keeps each candidate's mean seconds per timed turn,
    per bucket (`measured_per_bucket`) and summed over buckets (`measured`), over all phases."""

    def __init__(self, backend: Backend, subs: dict[str, Strategy]) -> None:
        self.backend, self.subs = backend, subs
        self.phase: Phase | None = None  # the current (or last) phase; None before the first
        self.turns: dict[str, int] = {}  # candidate -> timed turns in the phases agreed on
        self.measured: dict[str, float] = {}
        self.measured_per_bucket: dict[str, dict[str, float]] = {}
        self._spent: dict[str, dict[str, float]] = {}  # this phase, this rank: bucket -> candidate -> s
        self._agreed: dict[str, dict[str, float]] = {}  # earlier phases, over ranks: the same, summed

    def start(self, step: int, order: list[str], untimed: int, timed: int) -> None:
        self.phase = Phase(step, list(order), untimed, timed)

    def running(self, step: int) -> bool:
        """Whether `step` is one of the current phase's turns."""
        return self.phase is not None and step - self.phase.first < self.phase.steps

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool, into_input: bool,
                 shapes: list[torch.Size] | None, keys: list[str] | None) -> Work[torch.Tensor]:
        """This step's turn (synchronous): its candidate exchanges x, timed unless the round is untimed."""
        phase = self.phase
        assert phase is not None and self.running(ctx.step)
        turn = ctx.step - phase.first
        name = phase.order[turn % len(phase.order)]
        sub = self.subs[name]
        sub.into_input = into_input
        timed = turn >= phase.untimed * len(phase.order)
        if timed:
            self.backend.allreduce(torch.zeros(1)).wait()  # start together
        began = time.perf_counter()
        out = sub.exchange(x, key, ctx, average, shapes, keys).wait()
        if timed:
            spent = self._spent.setdefault(str(key), {})  # (buckets in the order first seen, alike on all ranks)
            spent[name] = spent.get(name, 0.0) + time.perf_counter() - began
        return Work.done(out)

    def agree(self) -> None:
        """Fold the phase's times, averaged over ranks with one allreduce, into the means."""
        phase = self.phase
        assert phase is not None
        buckets = list(self._spent)
        spent = torch.tensor([[self._spent[b].get(n, 0.0) for n in phase.order] for b in buckets],
                             dtype=torch.float64).reshape(len(buckets), len(phase.order))
        self.backend.allreduce(spent).wait()
        spent /= self.backend.world_size
        for b, row in zip(buckets, spent.tolist()):
            agreed = self._agreed.setdefault(b, {})
            for n, t in zip(phase.order, row):
                agreed[n] = agreed.get(n, 0.0) + t
        for n in phase.order:
            self.turns[n] = self.turns.get(n, 0) + phase.timed
        self._spent = {}
        self.measured_per_bucket = {b: {n: t / self.turns[n] for n, t in agreed.items()}
                                    for b, agreed in self._agreed.items()}
        self.measured = {n: sum(t[n] for t in self.measured_per_bucket.values()) for n in self.turns}
