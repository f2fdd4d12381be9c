"""What a peer's packet can cost the receiver: allocation and decode time, before and after.

    PYTHONPATH=. python benchmarks/hostile.py --before /path/to/older/checkout

Every measurement runs in a child process under RLIMIT_AS (2.5 GB by default), so a bomb
ends in MemoryError instead of swapping the machine. "before" runs the same corpus and
probes with an older checkout's code on PYTHONPATH (its `decode(buf)`, no expectations).
Reports: the hostile corpus (tests/compress/hostile/corpus.json, every packet < 1 KB) per class,
a one-index sparse packet declaring the largest numel each version lets through
standalone, and `merge_sparse` over 1M pairs of one index (a 12 MB message).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
RUNNER = ROOT / "tests" / "compress" / "hostile" / "run_corpus.py"

# A threshold packet (80 bytes) with one index and a declared numel of 2**EXP, decoded standalone.
PROBE = r"""
import resource, sys, time, json
lim = int(float(sys.argv[1]) * (1 << 30)); resource.setrlimit(resource.RLIMIT_AS, (lim, lim))
import torch
torch.set_num_threads(1)
import gradwire
from gradwire.compress.wire import Kind, Packet, Section
c = gradwire.compressor("threshold")
out = {}
for exp in map(int, sys.argv[2].split(",")):
    n = 1 << exp
    idx = torch.zeros(1, dtype=torch.int32 if n < 2**31 else torch.int64)
    buf = Packet(8, torch.float32, (n,), [Section(Kind.INDICES, idx), Section(Kind.VALUES, torch.ones(1))], c.crc).tensor()
    open("/proc/self/clear_refs", "w").write("5")
    t0 = time.perf_counter()
    try:
        y = c.decode(buf); got = f"decoded {y.numel() * 4 >> 20} MiB"; del y
    except Exception as e:
        got = type(e).__name__ + ": " + str(e)[:70]
    hwm = int([l for l in open("/proc/self/status") if l.startswith("VmHWM")][0].split()[1])
    out[exp] = {"bytes": buf.numel(), "result": got, "seconds": round(time.perf_counter() - t0, 3), "peak_mib": hwm >> 10}
print(json.dumps(out))
"""

MERGE = r"""
import time, json, torch
torch.set_num_threads(1)
try:  # (this text also runs against checkouts from before the rename)
    from gradwire.comm.sparse_exchange import merge_dense, merge_sparse
except ImportError:
    from gradwire.comm.sparse import merge_dense, merge_sparse
n = 1_000_000
val = torch.randn(n, generator=torch.Generator().manual_seed(0))
same = [(torch.zeros(n // 2, dtype=torch.int64), val[: n // 2]), (torch.zeros(n // 2, dtype=torch.int64), val[n // 2:])]
uniq = [(torch.arange(n // 2), val[: n // 2]), (torch.arange(n // 2, n), val[n // 2:])]
def best(fn, r=3):
    fn(); ts = []
    for _ in range(r):
        t0 = time.perf_counter(); fn(); ts.append(time.perf_counter() - t0)
    return round(min(ts), 4)
print(json.dumps({"merge_sparse, 1M pairs of one index": best(lambda: merge_sparse(same), 1),
                  "merge_sparse, 1M distinct indices": best(lambda: merge_sparse(uniq)),
                  "merge_dense, 1M pairs of one index": best(lambda: merge_dense(same, 1)),
                  "merge_dense, 1M distinct indices": best(lambda: merge_dense(uniq, n))}))
"""


def _env(root: Path) -> dict[str, str]:
    return dict(os.environ, PYTHONPATH=str(root), OMP_NUM_THREADS="1")


def corpus(root: Path, limit: float, legacy: bool) -> list[dict]:
    cmd = [sys.executable, str(RUNNER), "--limit-gb", str(limit)] + (["--legacy"] if legacy else [])
    out = subprocess.run(cmd, env=_env(root), cwd=root, capture_output=True, text=True, check=True).stdout
    return [json.loads(line) for line in out.splitlines()]


def summary(rows: list[dict]) -> dict[int, dict]:
    by: dict[int, dict] = defaultdict(lambda: {"n": 0, "peak_kib": 0, "seconds": 0.0, "results": defaultdict(int)})
    for r in rows:
        s = by[r["class"]]
        s["n"] += 1
        s["peak_kib"] = max(s["peak_kib"], r["peak_kib"])
        s["seconds"] = max(s["seconds"], r["seconds"])
        s["results"][r["result"].split(":")[0]] += 1
    return dict(sorted(by.items()))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--before", type=Path, required=True, help="root of the older checkout to compare")
    ap.add_argument("--limit-gb", type=float, default=2.5)
    ap.add_argument("--probe-exps", default="24,28,29,32")
    args = ap.parse_args()
    for label, root, legacy in (("before", args.before, True), ("after", ROOT, False)):
        print(f"## {label}: corpus ({root})")
        for cls, s in summary(corpus(root, args.limit_gb, legacy)).items():
            print(f"class {cls}: {s['n']} entries, worst peak RSS growth {s['peak_kib'] / 1024:.1f} MiB, "
                  f"worst {s['seconds'] * 1e3:.1f} ms, {dict(s['results'])}")
        # cwd=root: `python -c` puts the working directory first on sys.path
        probe = subprocess.run([sys.executable, "-c", PROBE, str(args.limit_gb), args.probe_exps], env=_env(root),
                               cwd=root, capture_output=True, text=True, check=True).stdout
        print(f"## {label}: one-index threshold packet declaring 2**e elements, standalone decode")
        for exp, r in json.loads(probe).items():
            print(f"2**{exp}: {r}")
        merge = subprocess.run([sys.executable, "-c", MERGE], env=_env(root), cwd=root, capture_output=True,
                               text=True, check=True).stdout
        print(f"## {label}: merges (best seconds)\n{merge}")


if __name__ == "__main__":
    main()
