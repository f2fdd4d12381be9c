"""Measuring what `auto`'s cost model needs: the links' alpha and beta, and a compressor's encode
and decode seconds per element. Every function here is a collective: all ranks call it at the
same point and get the same numbers (the mean over ranks), so they make the same choices.

Tests: tests/comm/test_auto.py.
"""

from __future__ import annotations

import statistics
import time
from typing import Any, Callable

import torch

from ...compress import Compressor, ErrorFeedback
from ..backend import Backend
from ..links import CostModel


def measure(backend: Backend, small: int = 4096, large: int = 1 << 20, repeat: int = 5,
            enough_s: float = 0.1, start: int = 1 << 18) -> CostModel:
    """Fit alpha and beta through two timed allreduces: of `small` float32 elements (16 KB) and
    of a large size grown 4x at a time from `start` until one allreduce takes `enough_s` (or
    reaches `large`): on a fast link that is `large`, on a 20 Mbit/s link `start` (1 MB, well
    past the bursts a shaper lets through at line rate), so a slow network is not probed for
    many seconds. The small size is a gradient bucket's smallest, not one element: gloo sends a
    few bytes in one round trip whatever the ranks, but anything larger in its ring's 2(P-1)
    steps, each waiting on a peer, so one element would put alpha a ring's length too low on a
    link with a long round trip. The ranks agree on each step (the mean of their times decides),
    so they run the same collectives."""
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
    share = 2 * (world - 1) / world * 4  # bytes on each rank's link per element allreduced
    beta = max((t_large - t_small) / (share * (large - small)) if world > 1 and large > small else 1e-10, 1e-12)
    alpha = max((t_small - share * small * beta) / steps, 1e-7)
    agreed = torch.tensor([alpha, beta], dtype=torch.float64)
    backend.allreduce(agreed).wait()
    alpha, beta = (agreed / world).tolist()
    return CostModel(alpha, beta)


def measure_compute(backend: Backend, c: Compressor, numel: int = 1 << 20, repeat: int = 3,
                    sizes: list[int] | None = None, error_feedback: bool = False) -> tuple[float, float]:
    """Seconds per element to encode and to decode with c, averaged over ranks (so all agree).
    With `sizes`, on tensors of exactly those sizes (and through error feedback if used): a
    model of many small tensors then pays their per-tensor overheads, which one large probe
    hides. A large model is sampled: its first tensors, up to `numel` elements (at least one tensor)."""
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


def _timed(fn: Callable[[], Any]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def agreed(backend: Backend, model: CostModel) -> CostModel:
    """The average of every rank's model, so all ranks choose alike."""
    t = torch.tensor([model.alpha, model.beta], dtype=torch.float64)
    backend.allreduce(t).wait()
    alpha, beta = (t / backend.world_size).tolist()
    return CostModel(alpha, beta)
