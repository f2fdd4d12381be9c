"""Decode every entry of corpus.json under an address-space limit; print one JSON line each.

    python tests/compress/hostile/run_corpus.py [--limit-gb 2.5] [--legacy]

Run in its own process (the limit is per process): a decompression or allocation bomb
then fails with MemoryError here instead of swapping the machine. Each line holds the
entry's name, "ok" or what went wrong, the seconds taken and the peak resident memory
growth (KiB) during the entry. `--legacy` only decodes standalone, with the API every
version has (`decode(buf)`), and reports what happened: the "before" of docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import json
import resource
import sys
import time
from pathlib import Path

CORPUS = Path(__file__).with_name("corpus.json")


def _hwm_kib() -> int:
    for line in open("/proc/self/status"):
        if line.startswith("VmHWM"):
            return int(line.split()[1])
    return 0


def _reset_hwm() -> None:
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # resets the peak resident set size (VmHWM)
    except OSError:
        pass


def _outcome(fn) -> str:
    from gradwire import WireFormatError

    try:
        fn()
    except WireFormatError:
        return "WireFormatError"
    except MemoryError:
        return "MemoryError"
    except Exception as e:  # noqa: BLE001 - reported by name
        return f"{type(e).__name__}: {str(e)[:120]}"
    return "decoded"


def check(entry: dict) -> str:
    """'ok', or what this version does wrong with the entry."""
    import torch

    import gradwire
    from gradwire.comm import sparse_exchange as sparse
    from gradwire.comm.artopk import check_leader_indices
    from gradwire.comm.base import Segment, split_message

    buf = torch.frombuffer(bytearray.fromhex(entry["hex"]), dtype=torch.uint8) if entry["hex"] \
        else torch.empty(0, dtype=torch.uint8)
    shape, dtype = tuple(entry["shape"]), getattr(torch, entry["dtype"])
    problems = []

    def want(what: str, fn, expected: str = "WireFormatError") -> None:
        got = _outcome(fn)
        if got != expected:
            problems.append(f"{what}: {got}")

    if entry["kind"] == "packet":
        c = gradwire.compressor(entry["spec"])
        if "out_dtype" in entry:
            out = torch.zeros(shape, dtype=getattr(torch, entry["out_dtype"]))
            want("out", lambda: c.decode(buf, out=out))
            if out.any():
                problems.append("out was written")
        else:
            want("expected", lambda: c.decode(buf, shape=shape, dtype=dtype))
            # out= takes any packet of its numel and dtype (filled in out's shape)
            fits = entry["standalone"] == "decodes" and _fits(buf, shape, dtype)
            want("out", lambda: c.decode(buf, out=torch.zeros(shape, dtype=dtype)), "decoded" if fits else
                 "WireFormatError")
        if entry["standalone"] == "raises":
            want("standalone", lambda: c.decode(buf))
        else:
            declared = gradwire.compress.wire.parse(buf)
            want("standalone", lambda: _same_shape(c.decode(buf), declared.shape), "decoded")
    elif entry["kind"] == "message":
        want("split", lambda: split_message(buf, entry["count"]))
    elif entry["kind"] == "sparse":
        numel = shape[0]

        def merge():
            parts = [sparse.unpack(buf, dtype, numel)]
            sparse.check_indices(parts, numel)
            dense = sparse.merge_dense(parts, numel)
            ref = torch.zeros(numel, dtype=torch.float32)
            for i, v in zip(parts[0][0].tolist(), parts[0][1].tolist()):  # sequential, in order
                ref[i] = (ref[i].double() + torch.tensor(v, dtype=torch.float32).double()).float()
            assert torch.equal(dense, ref), "merge is not the sequential sum"
            unique, summed = sparse.merge_sparse(parts)
            assert torch.equal(summed, ref[unique]), "merge_sparse differs from merge_dense"
        want("unpack", merge, "decoded" if entry["standalone"] == "decodes" else "WireFormatError")
    elif entry["kind"] == "artopk":
        offsets = [0]
        for n in entry["segments"][:-1]:
            offsets.append(offsets[-1] + n)
        segs = [Segment(str(i), o, n) for i, (o, n) in enumerate(zip(offsets, entry["segments"]))]
        want("indices", lambda: check_leader_indices(buf.view(torch.int64), segs, entry["counts"]))
    return "ok" if not problems else "; ".join(problems)


def _fits(buf, shape, dtype) -> bool:
    import math

    from gradwire.compress import wire

    pk = wire.parse(buf)
    return pk.numel == math.prod(shape) and pk.dtype == dtype


def _same_shape(y, shape) -> None:
    assert tuple(y.shape) == tuple(shape), f"decoded shape {tuple(y.shape)}, declared {tuple(shape)}"


def legacy(entry: dict) -> str:
    """What `decode(buf)` (or comm.sparse.unpack) does with the entry, in any version."""
    import torch

    import gradwire

    buf = torch.frombuffer(bytearray.fromhex(entry["hex"]), dtype=torch.uint8)
    if entry["kind"] == "packet":
        return _outcome(lambda: gradwire.compressor(entry["spec"]).decode(buf))
    if entry["kind"] == "sparse":
        try:  # (the module's name before 0.2)
            from gradwire.comm import sparse_exchange as sparse
        except ImportError:
            from gradwire.comm import sparse

        return _outcome(lambda: sparse.unpack(buf, getattr(torch, entry["dtype"]), entry["shape"][0]))
    return "skipped"


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--limit-gb", type=float, default=2.5)
    ap.add_argument("--legacy", action="store_true")
    ap.add_argument("--only", default="", help="only entries whose name contains this")
    args = ap.parse_args()
    limit = int(args.limit_gb * (1 << 30))
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    import torch

    torch.set_num_threads(1)
    entries = json.loads(CORPUS.read_text())["entries"]
    for e in entries:
        if args.only not in e["name"]:
            continue
        _reset_hwm()
        base = _hwm_kib()
        t0 = time.perf_counter()
        result = legacy(e) if args.legacy else check(e)
        seconds = time.perf_counter() - t0
        print(json.dumps({"name": e["name"], "class": e["class"], "bytes": len(e["hex"]) // 2, "result": result,
                          "seconds": round(seconds, 4), "peak_kib": max(0, _hwm_kib() - base)}), flush=True)


if __name__ == "__main__":
    sys.exit(main())
