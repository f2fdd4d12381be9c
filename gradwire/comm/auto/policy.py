"""How `auto` chooses among candidates' times, modelled or measured: a near-tie goes to the
exchange that changes training least, and between dense and bf16 (the same exchange but for a
rounding torch's own bf16 hook applies) to the faster.

Tests: tests/comm/test_auto.py.
"""

from __future__ import annotations

# Candidates in the order of how little they change the training algorithm: dense is exact, bf16
# rounds (hierarchical_bf16 rounds each node's sum, once), allgather sums every rank's own top-k,
# hierarchical each node's; oktopk and artopk keep about k entries of the global sum (artopk: at
# one rank's positions), so they lose more per step.
PREFERENCE = ("dense", "bf16", "hierarchical_bf16", "allgather", "hierarchical", "powersgd")
#: Candidates that change training alike: the faster of them wins outright. bf16 costs no
#: measurable quality, while preferring dense in a near-tie keeps twice the bytes on the wire, a
#: cost a few timed steps can underrate (docs/benchmarks.md, "Round-trip time").
ALIKE = (("dense", "bf16"),)
APPROXIMATE = ("oktopk", "artopk")
MARGIN = 0.10  # a candidate this much slower than the fastest, by the model, still counts as as fast
#: The same for times measured in the trial: tighter, because it is a measurement, and because
#: a margin is also what auto may lose to the fastest.
TRIAL_MARGIN = 0.03
#: After the first timed turns, candidates whose step is this close to the fastest per-bucket mix
#: are timed again (so a further turn costs at most this much more than the best).
TRIAL_CLOSE = 0.25
#: After each candidate's first timed turn, one whose step took more than this many times the
#: fastest's is timed no more: it cannot come within TRIAL_MARGIN, and its turns are the slowest.
TRIAL_DROP = 1.5
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
        alike = next((group for group in ALIKE if choice in group), (choice,))
        choice = min((n for n in alike if n in exact), key=lambda n: exact[n])
        if not approx or min(approx.values()) * gain > best:
            return choice
    return min(approx, key=lambda n: approx[n])
