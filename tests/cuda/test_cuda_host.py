"""The kernels' integer building blocks (kernels/common.cuh) against the CPU reference.

common.cuh is plain C++ apart from its qualifiers, so it is compiled here as a host
program (g++) and fed bit patterns: float conversions (exhaustive for 8/16-bit sources),
magnitude keys, the counter-based hash, bit packing, byte rotation and randomk's
strata and draws. No GPU needed; the device compiles the same source (tests/cuda/test_cuda_compile.py).
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch

from gradwire.compress import rng
from gradwire.compress.quantize import tiles as quantize
from gradwire.compress.select import keys_of as _keys_of
from gradwire.compress.sparse import RandomK
from gradwire.cuda.loader import KERNEL_DIR

HARNESS = Path(__file__).with_name("cuda_host_check.cpp")
CXX = shutil.which("g++") or shutil.which("c++") or shutil.which("clang++")
pytestmark = pytest.mark.skipif(CXX is None, reason="no C++ compiler")


@pytest.fixture(scope="module")
def harness(tmp_path_factory) -> Path:
    exe = tmp_path_factory.mktemp("host") / "gw_host"
    subprocess.run([CXX, "-O1", "-std=c++17", f"-I{KERNEL_DIR}", str(HARNESS), "-o", str(exe)], check=True)
    return exe


def run(exe: Path, op: str, inputs: np.ndarray, *args) -> np.ndarray:
    res = subprocess.run([str(exe), op, *map(str, args)], input=inputs.astype("<u4").tobytes(),
                         capture_output=True, check=True)
    return np.frombuffer(res.stdout, dtype="<u4")


def f32_patterns(count: int = 1 << 20, seed: int = 0) -> np.ndarray:
    """Random bit patterns plus every edge worth a look (zeros, subnormals, rounding ties
    of each target format, overflow thresholds, inf, NaN of both signs)."""
    g = np.random.default_rng(seed)
    rand = g.integers(0, 1 << 32, count, dtype=np.uint64).astype(np.uint32)
    # values near each small format's range: exponents 2^-30 .. 2^20, all mantissa tails
    near = (g.integers(97, 148, count // 2, dtype=np.uint32) << 23) | g.integers(0, 1 << 23, count // 2, dtype=np.uint32)
    ties = []
    for e in range(97, 148):
        for m in (0, 1, 0x7FFFFF, 0x400000, 0x100000, 0x080000, 0x0FFFFF, 0x180000, 0x1000, 0x3000, 0x8000, 0x18000):
            ties.append((e << 23) | m)
    special = [0, 0x80000000, 1, 0x807FFFFF, 0x00800000, 0x7F7FFFFF, 0x7F800000, 0xFF800000, 0x7FC00000,
               0xFFC00000, 0x7F800001, 0xFFFFFFFF, 0x477FEFFF, 0x477FF000, 0x477FF001, 0x43E00000, 0x43E80000,
               0x43F00000, 0x43EFFFFF, 0x47600000, 0x47700000, 0x47800000, 0x477FFFFF]
    base = np.concatenate([rand, near, np.array(ties + special, dtype=np.uint32)])
    return np.concatenate([base, base ^ np.uint32(0x80000000)])


def torch_bits(bits: np.ndarray, dtype: torch.dtype) -> np.ndarray:
    x = torch.from_numpy(bits.view(np.float32).copy()).to(dtype)
    ints = {2: torch.int16, 1: torch.uint8}[x.element_size()]
    return x.view(ints).numpy().astype(np.int64) & ((1 << (8 * x.element_size())) - 1)


@pytest.mark.parametrize("op,dtype", [("f16", torch.float16), ("bf16", torch.bfloat16),
                                      ("e4m3", torch.float8_e4m3fn), ("e5m2", torch.float8_e5m2)])
def test_fp32_to_small_float(harness, op, dtype):
    bits = f32_patterns()
    got = run(harness, op, bits).astype(np.int64)
    want = torch_bits(bits, dtype)
    bad = np.flatnonzero(got != want)
    # NaN payloads are not promised (docs/cuda.md): a NaN must stay a NaN, its bits may differ
    nan_in = (bits & 0x7FFFFFFF) > 0x7F800000
    out_nan = {"f16": lambda v: (v & 0x7FFF) > 0x7C00, "bf16": lambda v: (v & 0x7FFF) > 0x7F80,
               "e4m3": lambda v: (v & 0x7F) == 0x7F, "e5m2": lambda v: (v & 0x7F) > 0x7C}[op]
    assert np.array_equal(out_nan(got), nan_in)
    bad = bad[~nan_in[bad]]
    assert bad.size == 0, [(hex(int(bits[i])), hex(int(got[i])), hex(int(want[i]))) for i in bad[:8]]


@pytest.mark.parametrize("op,dtype,width", [("f16to32", torch.float16, 16), ("bf16to32", torch.bfloat16, 16),
                                            ("e4m3to32", torch.float8_e4m3fn, 8), ("e5m2to32", torch.float8_e5m2, 8)])
def test_small_float_to_fp32_exhaustive(harness, op, dtype, width):
    codes = np.arange(1 << width, dtype=np.uint32)
    got = run(harness, op, codes)
    src = torch.from_numpy(codes.astype(np.int64)).to(torch.int16 if width == 16 else torch.uint8)
    if width == 16:
        src = torch.from_numpy(codes.astype(np.uint16).view(np.int16))
    want = src.view(dtype).to(torch.float32).view(torch.int32).numpy().view(np.uint32)
    nan = (want & 0x7FFFFFFF) > 0x7F800000
    assert np.array_equal((got & 0x7FFFFFFF) > 0x7F800000, nan)
    bad = (got != want) & ~nan  # NaN payloads are not promised
    assert not bad.any(), [hex(int(c)) for c in codes[bad][:8]]


@pytest.mark.parametrize("dt,dtype", [(0, torch.float32), (1, torch.float16), (2, torch.bfloat16)])
def test_magnitude_keys(harness, dt, dtype):
    if dt == 0:
        bits = f32_patterns(1 << 16)
        ints = torch.from_numpy(bits.view(np.int32).copy())
    else:
        bits = np.arange(1 << 16, dtype=np.uint32)
        ints = torch.from_numpy(bits.astype(np.uint16).view(np.int16).copy())
    got = run(harness, f"key{dt}", bits)
    want = _keys_of(ints, dtype).numpy().view(np.uint32)
    assert np.array_equal(got, want)


@pytest.mark.parametrize("seed,start", [(0, 0), (7, 123456), (3, (1 << 32) - 5000)])
def test_bits24_matches_rng(harness, seed, start):
    key = rng.stream_key(seed, 11, 2, 99, stream=10)
    n = 5000
    elements = (np.arange(n, dtype=np.uint64) + start).astype(np.uint32)
    got = run(harness, "bits24", elements, key[0], key[1])
    want = rng.bits24(key, n, start=start).numpy().view(np.uint32)
    assert np.array_equal(got, want)
    assert int(got[17]) == rng.reference_bits24(key, start + 17)


@pytest.mark.parametrize("b", range(1, 9))
def test_pack8_matches_cpu_packing(harness, b):
    g = np.random.default_rng(b)
    codes = g.integers(0, 1 << b, 8 * 333, dtype=np.uint32)
    got = run(harness, "pack", codes, b).astype(np.uint8)
    out = torch.empty(333 * b, dtype=torch.uint8)
    quantize._pack(torch.from_numpy(codes.astype(np.uint8)), b, out, torch.empty(400, dtype=torch.int64))
    assert np.array_equal(got, out.numpy())


@pytest.mark.parametrize("size", [2, 4])
def test_rotation_round_trips(harness, size):
    x = f32_patterns(1 << 12) & np.uint32((1 << (8 * size)) - 1 if size == 2 else 0xFFFFFFFF)
    got = run(harness, "rot", x, size).reshape(-1, 2)
    assert np.array_equal(got[:, 1], x)
    t = torch.from_numpy(x.astype(np.uint16).view(np.int16) if size == 2 else x.view(np.int32))
    want = (t << 1) | ((t >> (8 * size - 1)) & 1)
    mask = (1 << (8 * size)) - 1
    assert np.array_equal(got[:, 0].astype(np.int64) & mask, want.numpy().astype(np.int64) & mask)


@pytest.mark.parametrize("numel,k", [(10, 3), (1000, 7), (12345, 1000), ((1 << 33) + 7, 12345)])
def test_strata_match(harness, numel, k):
    got = run(harness, "strata", np.zeros(0, dtype=np.uint32), numel, k).view("<i8")
    start, length = RandomK._strata(numel, k, "cpu")
    assert np.array_equal(got[:-1], start.numpy())
    assert np.array_equal(np.diff(got), length.numpy())


@pytest.mark.parametrize("numel,k", [(10, 3), (1000, 7), (100_003, 1000), (40_000_000, 2), ((1 << 33) + 7, 12345)])
def test_randomk_positions_match(harness, numel, k):
    """The device's draw (randomk_offset: what an encode picks and a decode draws again
    from the packet's key) is the CPU's, short and long (>= 2^24) strata alike."""
    key = rng.stream_key(3, 5, 0, 77, stream=RandomK.codec_id)
    got = run(harness, "randomk", np.zeros(0, dtype=np.uint32), numel, k, *key).view("<i8")
    assert np.array_equal(got, RandomK()._draw(numel, k, key, "cpu")[0].numpy())
