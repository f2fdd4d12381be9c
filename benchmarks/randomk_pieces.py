"""Where randomk's round trip spends its time: each step of encode and decode timed alone.

    python benchmarks/randomk_pieces.py [--numel 25000000] [--reps 8]

The steps of `RandomK.encode` (the draw of the k positions, the gather, the NaN/Inf
sentinel's min/max pass) and of `decode` (parse and checks, the draw again from the
packet's key, the fresh output, scaling, the scatter), each whole encode/decode beside
them, and GRACE's fresh `torch.zeros` for scale. 1 torch thread, minimum of `--reps`.
Not a test; numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import time

import torch

import gradwire
from gradwire import Ctx
from gradwire.compress import alloc, select, wire
from gradwire.compress.sparse import randomk


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__)
    p.add_argument("--numel", type=int, default=25_000_000)
    p.add_argument("--reps", type=int, default=8)
    args = p.parse_args()
    torch.set_num_threads(1)
    n = args.numel
    x = torch.randn(n, generator=torch.Generator().manual_seed(0))
    c = gradwire.compressor("randomk:ratio=0.01")
    k = c.value_count(n)
    times: dict[str, list[float]] = {}

    def timed(name: str, fn):
        t = time.perf_counter()
        out = fn()
        times.setdefault(name, []).append(time.perf_counter() - t)
        return out

    for rep in range(args.reps):
        ctx = Ctx(step=rep, key=1)
        idx = timed("encode: draw", lambda: c._draw(n, k, c._key(ctx), x.device)[0])
        timed("encode: gather", lambda: select.gather(x, idx))
        timed("encode: sentinel (min/max pass)", lambda: randomk._sentinel(x))
        buf = timed("encode", lambda: c.encode(x, ctx)).tensor()
        pk = timed("decode: parse and checks", lambda: wire.parse(buf))
        c.check_header(pk, None)
        idx = timed("decode: draw from the key", lambda: c._indices(pk))
        out = timed("decode: alloc.zeros", lambda: alloc.zeros(n, torch.float32))
        length = c._strata(n, k, "cpu")[1]
        values = timed("decode: scale", lambda: pk.sections[1].data.float() * length)
        timed("decode: scatter", lambda: out.index_copy_(0, idx, values))
        del out
        y = timed("decode", lambda: c.decode(buf))
        del y
        z = timed("torch.zeros (GRACE's output)", lambda: torch.zeros(n))
        del z
    print(f"{n:,} fp32 elements, k = {k:,}, 1 thread, minimum of {args.reps}")
    for name, v in times.items():
        print(f"{name:34s} {min(v) * 1e3:7.2f} ms")


if __name__ == "__main__":
    main()
