"""Every kernel compiles with nvcc for sm_80 and sm_90 without register spills (no GPU needed).

Each kernel file is compiled with exactly the template instantiations the loader asks
NVRTC for (`gradwire.cuda.loader.INSTANTIATIONS`) and the same options, both
architectures in one nvcc call, the files in parallel. Skipped only when nvcc is absent.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from gradwire.cuda import loader

NVCC = shutil.which("nvcc") or next((p for p in ("/usr/local/cuda/bin/nvcc",) if os.path.exists(p)), None)
ARCHS = ("80", "90")
_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_ENTRY = re.compile(r"Compiling entry function '(\S+)' for 'sm_(\d+)'")
_REGS = re.compile(r"Used (\d+) registers")

pytestmark = pytest.mark.skipif(NVCC is None, reason="nvcc not installed")


def compile_file(file: str, workdir: Path) -> tuple[int, str]:
    unit = workdir / f"{Path(file).stem}_unit.cu"
    unit.write_text(loader.instantiation_unit(file))
    cmd = [NVCC, "-c", str(unit), "-o", str(workdir / f"{Path(file).stem}.o"), "-Xptxas", "-v",
           *loader.OPTIONS, f"-I{loader.KERNEL_DIR}"]
    for arch in ARCHS:
        cmd += ["-gencode", f"arch=compute_{arch},code=sm_{arch}"]
    res = subprocess.run(cmd, capture_output=True, text=True)
    return res.returncode, res.stdout + res.stderr


def summarize(log: str) -> list[tuple[str, str, int, int, int]]:
    """(kernel, arch, registers, spill stores, spill loads) per compiled entry."""
    rows, current = [], None
    for line in log.splitlines():
        m = _ENTRY.search(line)
        if m:
            current = [m.group(1), m.group(2), -1, 0, 0]
            continue
        if current is None:
            continue
        s = _SPILL.search(line)
        if s:
            current[3], current[4] = int(s.group(1)), int(s.group(2))
        r = _REGS.search(line)
        if r:
            current[2] = int(r.group(1))
            rows.append(tuple(current))
            current = None
    return rows


def test_kernels_compile_without_spills(tmp_path):
    files = sorted(loader.INSTANTIATIONS)
    with ThreadPoolExecutor(len(files)) as pool:
        results = dict(zip(files, pool.map(lambda f: compile_file(f, tmp_path), files)))
    failures = {f: log[-3000:] for f, (rc, log) in results.items() if rc != 0}
    assert not failures, failures
    for file, (_, log) in results.items():
        rows = summarize(log)
        # every instantiation compiled for both architectures
        assert len(rows) == len(ARCHS) * len(loader.INSTANTIATIONS[file]), (file, len(rows))
        spills = [r for r in rows if r[3] or r[4]]
        assert not spills, f"{file}: register spills {spills}"
        worst = max(rows, key=lambda r: r[2])
        print(f"{file}: {len(rows)} entries, max {worst[2]} registers ({worst[0]}, sm_{worst[1]}), no spills")
