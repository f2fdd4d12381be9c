"""What an honest rank sees when a peer lies, dies or freezes: the error, how soon, and how much
its peak memory grew. Runs the scenarios of tests/comm/test_hostile_peers.py and tests/comm/test_faults.py
on real gloo ranks and prints one markdown row per case (the worst honest rank).

    python benchmarks/hostile_peers.py

Not a test (the tests assert the same outcomes); numbers go to docs/benchmarks.md.
"""

from __future__ import annotations

import os
import sys

for _folder in ("support", "comm"):  # the shared helpers, and the test modules whose scenarios run here
    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "tests", _folder))
import test_faults as faults  # noqa: E402
import test_hostile_peers as hostile  # noqa: E402
from multiproc import run_ranks  # noqa: E402


def _row(case: str, honest: list[dict]) -> str:
    kinds = sorted({h["kind"] if "CollectiveError" not in h["message"] or h["kind"] == "CollectiveError"
                    else f"{h['kind']} (CollectiveError)" for h in honest})
    return (f"| {case} | {', '.join(kinds)} | {max(h['seconds'] for h in honest):.2f} | "
            f"{max(h.get('grew_mb', 0.0) for h in honest):.1f} |")


def main() -> None:
    print("| case | honest ranks raised | slowest honest rank (s) | peak memory growth (MiB) |")
    print("|---|---|---|---|")
    for fn, world in ((hostile._sizes, 3), (hostile._framing, 4)):
        results = run_ranks(fn, world, timeout=300)
        for case in results[0]:
            if isinstance(results[0][case], dict):
                print(_row(case, [r[case] for rank, r in enumerate(results) if rank != hostile.EVIL]))
    for case in hostile.CONFIG_CASES[:-1]:
        results = run_ranks(hostile._config, 4, case, timeout=120, pg_timeout=30)
        print(_row(f"config: {case}", [r for rank, r in enumerate(results) if rank != hostile.EVIL]))
    for case, (spec, options, fail, at) in faults.DDP_CASES.items():
        results = run_ranks(faults._ddp_run, 3, spec, options, fail, at, timeout=180, may_die=(2,),
                            pg_timeout=faults.PG_TIMEOUT)
        print(_row(f"DDP {case} (timeout {faults.PG_TIMEOUT:g} s)", results[:-1]))
    for case, (strategy, spec, options, world, fail) in faults.EXCHANGER_CASES.items():
        results = run_ranks(faults._exchanger_run, world, strategy, spec, options, fail, timeout=180,
                            may_die=(world - 1,), pg_timeout=faults.PG_TIMEOUT)
        print(_row(f"GradientExchanger {case}, a rank {'freezes' if 'freeze' in fail else 'dies'}", results[:-1]))
    results = run_ranks(faults._fsdp_run, 3, timeout=180, may_die=(2,), pg_timeout=faults.PG_TIMEOUT)
    print(_row("FSDP2 int8 reduce-scatter, a rank dies inside it", results[:-1]))


if __name__ == "__main__":
    main()
