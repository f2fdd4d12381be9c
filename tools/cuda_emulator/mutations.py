"""Mutation check for the emulated CUDA suite: each planted bug must make it fail.

For every mutation, copy gradwire/cuda/kernels/ to a temporary directory, plant one bug of
a class that passes silently on a CPU (a removed barrier, a full mask where the active
mask belongs, an off-by-one bound, a half-warp shuffle mask, lanes leaving before a
shuffle, a missing butterfly stage, a removed scan barrier, a non-atomic shared add; in the
fused error-feedback kernels: an ignored finiteness flag, a lost store, a skipped rounding,
a short loop, a contracted multiply-add, a non-atomic flag), and run the emulated parity
tests (the error-feedback tests, or the TSan pass) against the copy
(GRADWIRE_EMULATOR_KERNELS) until the first failure. A mutation that survives the whole
selection fails the check.

    python tools/cuda_emulator/mutations.py            # all mutations
    python tools/cuda_emulator/mutations.py -k scan    # those whose name contains "scan"
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]  # the repository
KERNELS = ROOT / "gradwire" / "cuda" / "kernels"

# (name, file, text to replace (must occur), replacement, which tests to run)
MUTATIONS = [
    ("count-barrier-removed", "select.cu",
     "    sg[threadIdx.x] = g; se[threadIdx.x] = e;\n    __syncthreads();\n",
     "    sg[threadIdx.x] = g; se[threadIdx.x] = e;\n", "topk or dgc or threshold"),
    ("full-mask-for-activemask", "select.cu",
     "__match_any_sync(__activemask(), bin)", "__match_any_sync(0xFFFFFFFFu, bin)", "topk"),
    ("off-by-one-bound", "quant.cuh",
     "for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n);",
     "for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i <= (n);", "fp16 or int8"),
    ("half-warp-shuffle-mask", "quant.cuh",
     "o.a = __shfl_xor_sync(0xFFFFFFFFu, r.a, off);", "o.a = __shfl_xor_sync(0x0000FFFFu, r.a, off);",
     "int8 or qsgd"),
    ("lanes-leave-before-shuffle", "quant.cuh",
     "        Acc r = acc_init<OP>();\n",
     "        if (lo + lane >= hi) return;  // idle lanes leave early\n        Acc r = acc_init<OP>();\n",
     "int8 or qsgd or sign"),
    ("missing-butterfly-stage", "quant.cuh",
     "for (int off = 16; off > 0; off >>= 1) {\n            Acc o;",
     "for (int off = 8; off > 0; off >>= 1) {\n            Acc o;", "int8 or qsgd"),
    ("scan-barrier-removed", "select.cu",
     "        const u32 add = (int)threadIdx.x >= off ? buf[threadIdx.x - off] : 0u;\n        __syncthreads();\n",
     "        const u32 add = (int)threadIdx.x >= off ? buf[threadIdx.x - off] : 0u;\n", "topk"),
    # only ThreadSanitizer sees this one: no schedule interleaves a read-modify-write
    ("shared-add-not-atomic", "select.cu",
     "atomicAdd(&h[bin], (u32)__popc(peers));", "h[bin] += (u32)__popc(peers);", "tsan:topk"),
    # the fused error-feedback kernels (feedback.cu; "ef:" runs tests/cuda/test_cuda_feedback.py)
    ("ef-keep-ignores-flag", "feedback.cu", "    if (ok[0]) return;\n", "", "ef:matches_cpu and int8"),
    ("ef-corrected-not-stored", "feedback.cu", "        out[i] = c;\n        return Elem<DT>::load(c);",
     "        return Elem<DT>::load(c);", "ef:matches_cpu and int8"),
    ("ef-decoded-not-rounded", "feedback.cu", "Elem<DT>::load(Elem<DT>::store(decoded))", "decoded",
     "ef:matches_cpu and int8 and float16"),
    ("ef-sent-loop-short", "feedback.cu", "__global__ void ef_sub_sent(typename Elem<DT>::T* out, const IDX* idx, "
     "const typename Elem<DT>::T* vals, i64 k,\n                            u32* bad) {\n    GW_LOOP(j, k) {",
     "__global__ void ef_sub_sent(typename Elem<DT>::T* out, const IDX* idx, "
     "const typename Elem<DT>::T* vals, i64 k,\n                            u32* bad) {\n    GW_LOOP(j, k - 1) {",
     "ef:matches_cpu and topk"),
    ("dgc-momentum-contracted", "feedback.cu",
     "E::store(__fadd_rn(E::load(E::store(__fmul_rn(E::load(u_old[i]), m))), gi))",
     "E::store(fmaf(E::load(u_old[i]), m, gi))", "ef:dgc and float32"),
    ("ef-flag-not-atomic", "feedback.cu", "atomicOr(bad, 1u);", "*bad |= 1u;", "tsan:feedback"),
    # fp4: two codes per byte, element 2j in the low nibble; the fused step decodes with the scale
    ("fp4-nibbles-swapped", "elementwise.cu", "w |= f32_to_e2m1(Elem<DT>::load(x[i]) * f0[c]) << (4 * k);",
     "w |= f32_to_e2m1(Elem<DT>::load(x[i]) * f0[c]) << (4 * (k ^ 1));", "fp4"),
    ("ef-fp4-decoded-with-multiplier", "feedback.cu", "__fmul_rn(e2m1_to_f32(code), scales[c])",
     "__fmul_rn(e2m1_to_f32(code), f0[c])", "ef:matches_cpu and fp4"),
]


def plant(dest: Path, file: str, old: str, new: str) -> None:
    shutil.copytree(KERNELS, dest, dirs_exist_ok=True)
    text = (dest / file).read_text()
    if text.count(old) < 1:
        raise SystemExit(f"mutation target not found in {file}: {old!r}")
    (dest / file).write_text(text.replace(old, new, 1))


def run(kernels: Path, select: str) -> tuple[bool, str, float]:
    """(suite failed, first failure line, seconds). `select` "tsan:EXPR" runs the TSan pass."""
    env = dict(os.environ, GRADWIRE_EMULATOR_KERNELS=str(kernels), PYTHONPATH=str(ROOT))
    if select.startswith("tsan:"):
        tests, expr = "tests/cuda/test_cuda_tsan.py", f"race_free and ({select[5:]})"
    elif select.startswith("ef:"):
        tests, expr = "tests/cuda/test_cuda_feedback.py", f"emu and ({select[3:]})"
    else:
        tests, expr = "tests/cuda/test_cuda_parity.py", f"emu and (byte_identical or within_tolerance) and not 1000003 and ({select})"
    cmd = [sys.executable, "-m", "pytest", "-q", "-x", "-p", "no:cacheprovider", tests, "-k", expr]
    t = time.perf_counter()
    res = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True)
    took = time.perf_counter() - t
    first = next((line for line in res.stdout.splitlines() if line.startswith("FAILED")), res.stdout.strip()[-200:])
    return res.returncode == 1, first, took


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("-k", default="", help="only mutations whose name contains this")
    args = ap.parse_args()
    survived = []
    for name, file, old, new, select in MUTATIONS:
        if args.k not in name:
            continue
        with tempfile.TemporaryDirectory() as tmp:
            plant(Path(tmp), file, old, new)
            failed, first, took = run(Path(tmp), select)
        print(f"{'caught  ' if failed else 'SURVIVED'} {name:28s} {took:6.1f}s  {first}", flush=True)
        if not failed:
            survived.append(name)
    if survived:
        print(f"{len(survived)} mutation(s) survived: {', '.join(survived)}")
        return 1
    print("every mutation was caught")
    return 0


if __name__ == "__main__":
    sys.exit(main())
