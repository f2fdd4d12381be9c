"""Kernel sources and their compiled modules.

Each `.cu` file under `kernels/` is compiled once per process by `cupy.RawModule` with
every template instantiation listed in `INSTANTIATIONS` (CuPy's disk cache keeps the
binary across processes). The same list drives the CPU-only compile check
(`tests/cuda/test_cuda_compile.py`), so what CI compiles is what the loader loads.
"""

from __future__ import annotations

import functools
import itertools
import re
from pathlib import Path

KERNEL_DIR = Path(__file__).with_name("kernels")

#: NVRTC/nvcc options: no fused multiply-add, so float results round like torch's CPU ops.
OPTIONS: tuple[str, ...] = ("--fmad=false", "-std=c++17")

_DT = (0, 1, 2)  # fp32, fp16, bf16 (wire dtype codes)


def _names(template: str, *axes) -> list[str]:
    return [f"{template}<{', '.join(str(a) for a in combo)}>" for combo in itertools.product(*axes)]


INSTANTIATIONS: dict[str, tuple[str, ...]] = {
    "elementwise.cu": tuple(
        [f"cast_kernel<{s}, {d}>" for s in _DT for d in _DT if s != d]
        + _names("seg_reduce", _DT, range(5))
        + ["seg_finish<0, 0>", "seg_finish<1, 1>", "seg_finish<3, 2>", "seg_finish<0, 3>",
           "seg_finish<2, 4>", "seg_finish<4, 5>", "seg_finish<1, 6>"]
        + _names("fp8_encode", _DT, (0, 1)) + _names("fp4_encode", _DT) + _names("int8_encode", _DT) + _names("stochastic_encode", _DT)
        + _names("sign_bits", _DT)
        + _names("fp8_decode", _DT, (0, 1)) + _names("fp4_decode", _DT) + _names("int8_decode", _DT) + _names("stochastic_decode", _DT)
        + _names("sign_decode", _DT) + _names("onebit_decode", _DT)),
    "select.cu": tuple(
        ["radix_init", "radix_pick", "set_threshold"]
        + _names("radix_hist", _DT) + _names("select_count", _DT, (0, 1)) + _names("select_write", _DT, (0, 1))
        + _names("sample_keys", _DT) + _names("randomk_pick", _DT)),
    "bytes.cu": ("planes_split<2>", "planes_split<4>", "planes_merge<2>", "planes_merge<4>"),
    "scatter.cu": tuple(
        _names("scatter_sorted", _DT, ("int", "long long")) + _names("scatter_randomk", _DT)
        + _names("fill_sentinel", _DT)),
    "feedback.cu": tuple(
        [f"ef_cast<{s}, {d}>" for s in _DT for d in _DT]
        + _names("ef_seg_reduce", _DT, range(5)) + _names("ef_fp8", _DT, (0, 1)) + _names("ef_fp4", _DT) + _names("ef_int8", _DT)
        + _names("ef_stochastic", _DT) + _names("ef_sign", _DT, (0, 1))
        + _names("ef_sub_sent", _DT, ("int", "long long")) + _names("dgc_accumulate", _DT)
        + _names("dgc_sent", _DT, ("int", "long long")) + ["ef_keep<u16>", "ef_keep<u32>"]),
}


def source(file: str, kernel_dir: Path = KERNEL_DIR, _seen: set[str] | None = None) -> str:
    """The text of one kernel file with its local headers inlined: CuPy's disk cache is keyed
    by the source text, so a changed header must change the text too. (`kernel_dir`: a copy
    of the sources, e.g. the emulator's mutation check.) Each header is inlined once per file."""
    seen = set() if _seen is None else _seen
    lines = []
    for line in (Path(kernel_dir) / file).read_text().splitlines():
        m = re.fullmatch(r'\s*#include "([\w.]+\.cuh)"\s*', line)
        if m:
            if m.group(1) not in seen:
                seen.add(m.group(1))
                lines.append(source(m.group(1), kernel_dir, seen).replace("#pragma once\n", ""))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


@functools.lru_cache(maxsize=None)
def module(file: str):
    """The compiled `cupy.RawModule` of a kernel file (compiled on first use)."""
    import cupy

    return cupy.RawModule(code=source(file), options=OPTIONS, name_expressions=list(INSTANTIATIONS[file]))


@functools.lru_cache(maxsize=None)
def kernel(file: str, name: str):
    """One kernel by its name expression, e.g. ``kernel("select.cu", "radix_hist<0>")``."""
    if name not in INSTANTIATIONS[file]:
        raise KeyError(f"{name} is not instantiated in {file}; add it to INSTANTIATIONS")
    return module(file).get_function(name)


def instantiation_unit(file: str) -> str:
    """A translation unit for offline nvcc: exactly the source NVRTC gets, plus a host
    reference to every instantiation (taking a kernel's address makes nvcc compile it)."""
    refs = ",\n    ".join(f"(void*)&{name}" for name in INSTANTIATIONS[file])
    return f"{source(file)}\nvoid* gradwire_refs[] = {{\n    {refs}\n}};\n"
