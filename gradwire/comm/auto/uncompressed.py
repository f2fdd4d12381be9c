"""The fastest uncompressed exchange, measured per bucket: `auto`'s dense first steps.

A compressor's first steps stay uncompressed (PowerSGD's `start_iter`), and on a slow link a
bf16 step, half the bytes, can take about half as long as a dense one; on a link with a long
round-trip time, bf16 between nodes only (`hierarchical_bf16`: fewer ranks in the slow ring,
so fewer round trips) is faster still. `auto` spends those steps on whichever is fastest. bf16 rounds each gradient to 8 bits of mantissa, which
in those first steps costs no measurable quality (docs/benchmarks.md).

Tests: tests/hooks/test_ddp_hook.py (the DDP hook's uncompressed first steps under `auto` on two nodes).
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...compress import Ctx
from ..backend import Work
from ..base import ExchangeStats, Strategy, take_stats_of
from . import policy
from .turns import TimedTurns


log = logging.getLogger("gradwire")


class FasterUncompressed(Strategy):
    """The candidates (dense, bf16, ...) take turns (turns.py), one step each: a round untimed,
    then `rounds` timed rounds, each timed by its step's span; one whose first timed step took
    more than `policy.TRIAL_DROP` times the fastest's takes no more turns (on a link with long
    round trips, bf16 between nodes only can cost a second per turn where it loses). Every bucket
    then takes what `policy.prefer` takes within `margin` (the same on all ranks): the faster of
    dense and bf16 unless bf16 between nodes only is clearly faster still."""

    name = "uncompressed"

    def __init__(self, dense: Strategy, bf16: Strategy, rounds: int = 4, margin: float = 0.03,
                 **more: Strategy) -> None:
        super().__init__(dense.backend, "none", error_feedback=False)
        if rounds < 1:
            raise ValueError(f"rounds must be >= 1, got {rounds}")
        self.subs = {"dense": dense, "bf16": bf16, **more}
        self.rounds, self.margin = int(rounds), float(margin)
        self.choices: dict[str, str] | None = None  # bucket key -> "dense" or "bf16", once measured
        self.turns = TimedTurns(self.backend, self.subs)

    @property
    def measured_per_bucket(self) -> dict[str, dict[str, float]]:
        return self.turns.measured_per_bucket

    @property
    def measured(self) -> dict[str, float]:
        """Candidate -> mean seconds per timed step (its span), the shortest over ranks (turns.py)."""
        return self.turns.measured

    def exchange(self, x: torch.Tensor, key: int | str, ctx: Ctx, average: bool = False,
                 shapes: list[torch.Size] | None = None, keys: list[str] | None = None) -> Work[torch.Tensor]:
        if self.choices is None:
            turns = self.turns
            if turns.phase is None:
                turns.start(ctx.step, list(self.subs), untimed=1, timed=1)
            if not turns.running(ctx.step) and not turns.turns:  # the first timed round is over
                turns.agree()
                fastest = min(turns.measured.values())
                alive = [n for n in self.subs if turns.measured[n] <= policy.TRIAL_DROP * fastest]
                if self.rounds > 1:
                    turns.start(ctx.step, alive, untimed=0, timed=self.rounds - 1)
            if turns.running(ctx.step):
                return turns.exchange(x, key, ctx, average, self.into_input, shapes, keys)
            self._choose()
        sub = self.subs[self.choices.get(str(key), "dense")]  # type: ignore[union-attr]
        sub.into_input = self.into_input
        return sub.exchange(x, key, ctx, average, shapes, keys)

    def _choose(self) -> None:
        if self.rounds > 1:
            self.turns.agree()
        steps = self.turns.measured  # a step's span: its buckets' overlap counted
        best = policy.prefer(steps, margin=self.margin)
        self.choices = {b: best for b in self.measured_per_bucket}
        log.info("gradwire auto: uncompressed steps: %s (per step: %s; per bucket: %s)", best,
                 ", ".join(f"{n} {t * 1e3:.3f} ms" for n, t in steps.items()), "; ".join(
                     f"{b}: {', '.join(f'{n} {t * 1e3:.3f}' for n, t in m.items())} ms"
                     for b, m in self.measured_per_bucket.items()))

    def take_stats(self) -> ExchangeStats:
        return take_stats_of(self.subs.values())

    def state_dict(self) -> dict[str, Any]:
        return {}  # (a resumed run measures again: nothing it carries depends on the choice)

    def load_state_dict(self, state: dict[str, Any]) -> None:
        pass
