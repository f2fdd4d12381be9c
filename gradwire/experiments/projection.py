"""Alpha-beta projection of step time to larger clusters, from bytes measured per step.

A projection, not a measurement: each collective costs `alpha` per message hop plus bytes over
the link bandwidth `beta` (bytes/s), with the classic ring formulas
    allreduce of b bytes:  2 (P-1) alpha + 2 (P-1)/P * b / beta
    allgather of b bytes:    (P-1) alpha +   (P-1)   * b / beta   (every rank receives P-1 packets)
    oktopk sending b bytes: 3 (P-1) alpha +      2   * b / beta   (~k pairs out, ~k in, at any P)
    FSDP reduce-scatter or all-to-all of a gradient of c bytes (compressed or dense):
                             (P-1) alpha + (P-1)/P * c / beta     (c = b P_measured / (P_measured - 1))
summed over the collectives of a step, plus the compute/encode time measured in the run; decode of
an allgather grows with the number of packets and is scaled by (P-1)/(P_measured-1).
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass
from typing import Any, Iterable

from .cluster import rate_bits

ALLGATHER_STRATEGIES = ("allgather",)
REDUCE_SCATTER_STRATEGIES = ("alltoall", "reduce_scatter")  # FSDP: each rank sends (P-1)/P of its gradient
PROJECTED_RANKS = (8, 16, 64, 256, 1024)
PROJECTED_LINKS = ("1gbit", "10gbit", "100gbit")


@dataclass(frozen=True)
class Profile:
    """What one run measured per steady-state (compressed) step, on its rank 0."""

    label: str
    strategy: str
    world: int
    bytes_per_step: float  # bytes handed to the collectives by one rank
    collectives: float  # collectives per step (one per DDP bucket)
    compute_s: float  # forward + backward + optimizer, without communication
    encode_s: float
    decode_s: float


def profile(summary: dict[str, Any], steps: list[dict[str, Any]]) -> Profile:
    """Medians over the run's compressed steps (after the dense warm-up and the first 20%)."""
    rows = [r for r in steps if r["type"] == "step"]
    rows = rows[max(len(rows) // 5, 2):] or rows

    def median(key: str) -> float:
        return statistics.median(float(r.get(key, 0.0)) for r in rows) if rows else 0.0

    cfg = summary["config"]
    measured = f"{summary['method']['label']} (measured: {cfg['world']} ranks, link {cfg['link']})"
    # compute: forward + backward timed without DDP (compute_s of a step is only a lower bound,
    # since DDP overlaps the exchange with the backward pass)
    compute = summary.get("compute_ref_s", median("compute_s"))
    strategy = summary["method"]["strategy"].removeprefix("hsdp-")  # HSDP: the cross-node exchange is projected
    return Profile(measured, strategy, cfg["world"],
                   median("bytes_sent"), max(median("collectives"), 1.0), compute,
                   median("encode_s"), median("decode_s"))


def comm_seconds(p: Profile, ranks: int, alpha: float, beta: float) -> float:
    if ranks <= 1:
        return 0.0
    if p.strategy in ALLGATHER_STRATEGIES:
        return p.collectives * (ranks - 1) * alpha + (ranks - 1) * p.bytes_per_step / beta
    if p.strategy == "oktopk":  # all-to-all of its pairs out, allgatherv of about as many in
        return 3 * p.collectives * (ranks - 1) * alpha + 2 * p.bytes_per_step / beta
    if p.strategy in REDUCE_SCATTER_STRATEGIES:
        whole = p.bytes_per_step * p.world / max(p.world - 1, 1)
        return p.collectives * (ranks - 1) * alpha + (ranks - 1) / ranks * whole / beta
    return 2 * p.collectives * (ranks - 1) * alpha + 2 * (ranks - 1) / ranks * p.bytes_per_step / beta


def step_seconds(p: Profile, ranks: int, link: str, alpha: float) -> float:
    beta = rate_bits(link) / 8
    decode = p.decode_s
    if p.strategy in ALLGATHER_STRATEGIES and p.world > 1:
        decode *= (ranks - 1) / (p.world - 1)
    return p.compute_s + p.encode_s + decode + comm_seconds(p, ranks, alpha, beta)


def table(profiles: Iterable[Profile], link: str, alpha: float,
          ranks: Iterable[int] = PROJECTED_RANKS) -> list[dict[str, Any]]:
    """One row per profile: projected seconds per step at each cluster size, for one link."""
    return [{"method": p.label, "strategy": p.strategy, "link": link,
             **{f"P={n}": step_seconds(p, n, link, alpha) for n in ranks}} for p in profiles]
