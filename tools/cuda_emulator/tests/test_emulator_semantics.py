"""The CUDA emulator's semantics: deliberately wrong kernels must be reported.

Each kernel below is a small CUDA program with one planted bug of a class that passes
silently on a CPU and breaks (or is undefined) on a GPU: a barrier in divergent code,
a `*_sync` mask that leaves out its caller or names an exited lane, a shuffle reading a
lane outside its mask, different warp ops meeting, a deadlock, out-of-bounds accesses, a
missing barrier (visible through the poisoned shared memory), a full mask where
`__activemask()` belongs. Correct twins run clean under every schedule.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

import cuda_emulator
from cuda_emulator import EmulatorError, Schedule

pytestmark = pytest.mark.skipif(not cuda_emulator.available(), reason="the emulator needs g++ on x86-64 Linux")

SCHEDULES = [Schedule("lowest"), Schedule("highest"), Schedule("random", 1), Schedule("random", 2)]

SOURCE = r"""
typedef unsigned int u32;
typedef long long i64;

// correct: block sum through shared memory and a warp butterfly
__global__ void block_sum(const float* x, i64 n, float* out) {
    __shared__ float part[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v = 0.0f;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) v += x[i];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if (lane == 0) part[warp] = v;
    __syncthreads();
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += part[w];
        *out = s;
    }
}

// bug: the barrier between the shared writes and the read is missing
__global__ void block_sum_no_barrier(const float* x, i64 n, float* out) {
    __shared__ float part[8];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    float v = 0.0f;
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) v += x[i];
    for (int off = 16; off > 0; off >>= 1) v += __shfl_xor_sync(0xFFFFFFFFu, v, off);
    if (lane == 0) part[warp] = v;
    if (threadIdx.x == 0) {
        float s = 0.0f;
        for (int w = 0; w < (int)(blockDim.x >> 5); ++w) s += part[w];
        *out = s;
    }
}

// bug: two different __syncthreads in divergent branches
__global__ void divergent_barrier(u32* out) {
    if (threadIdx.x < 64) { __syncthreads(); out[threadIdx.x] = 1; }
    else { __syncthreads(); out[threadIdx.x] = 2; }
}

// bug: the mask covers half the warp, but every lane calls
__global__ void half_mask(float* out) {
    float v = (float)threadIdx.x;
    v += __shfl_xor_sync(0x0000FFFFu, v, 1);
    out[threadIdx.x] = v;
}

// bug: lanes 16..31 leave before the full-warp shuffle
__global__ void early_exit(float* out) {
    if ((threadIdx.x & 31) >= 16) return;
    float v = (float)threadIdx.x;
    v += __shfl_xor_sync(0xFFFFFFFFu, v, 1);
    out[threadIdx.x] = v;
}

// bug: lanes 0..15 shuffle among themselves but read lane ^ 16
__global__ void shfl_outside(float* out) {
    if ((threadIdx.x & 31) < 16) {
        float v = (float)threadIdx.x;
        v += __shfl_xor_sync(0x0000FFFFu, v, 16);
        out[threadIdx.x] = v;
    }
}

// bug: even lanes shuffle, odd lanes vote, both with the full mask
__global__ void op_mismatch(u32* out) {
    if (threadIdx.x & 1) out[threadIdx.x] = __ballot_sync(0xFFFFFFFFu, 1);
    else out[threadIdx.x] = __shfl_sync(0xFFFFFFFFu, (u32)threadIdx.x, 0);
}

// bug: lane 0 waits for lane 1 in __syncwarp while lane 1 waits at the block barrier
__global__ void deadlock(u32* out) {
    if (threadIdx.x == 0) __syncwarp(0x3u);
    else __syncthreads();
    out[threadIdx.x] = 1;
}

// bug: a full mask in a grid-stride loop whose last iteration only some lanes reach
__global__ void full_mask_in_loop(const u32* x, i64 n, u32* out) {
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const u32 peers = __match_any_sync(0xFFFFFFFFu, x[i]);
        out[i] = (u32)__popc(peers);
    }
}

// correct twin: the active mask
__global__ void active_mask_in_loop(const u32* x, i64 n, u32* out) {
    for (i64 i = threadIdx.x; i < n; i += blockDim.x) {
        const u32 peers = __match_any_sync(__activemask(), x[i]);
        out[i] = (u32)__popc(peers);
    }
}

// an assumption __activemask() does not promise: that it is the whole converged warp
__global__ void assumes_full_active(u32* out) {
    out[threadIdx.x] = (u32)__popc(__activemask());
}

// bug: off-by-one bound (<= n)
__global__ void write_past_end(float* y, i64 n) {
    for (i64 i = threadIdx.x + (i64)blockIdx.x * blockDim.x; i <= n; i += (i64)blockDim.x * gridDim.x) y[i] = 1.0f;
}

__global__ void read_past_end(const float* x, i64 n, float* y) {
    for (i64 i = threadIdx.x + (i64)blockIdx.x * blockDim.x; i < n; i += (i64)blockDim.x * gridDim.x) y[i] = x[i + 1];
}

__global__ void write_before_start(float* y) {
    if (threadIdx.x == 0) y[-1] = 1.0f;
}

// uninitialised shared memory, copied out (written once, late, so the compiler cannot
// fold the never-stored array to zeros)
__global__ void read_uninit_shared(u32* out) {
    __shared__ u32 s[64];
    out[threadIdx.x] = s[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = 7;
}

// the same, as a template: GCC emits its static as STB_GNU_UNIQUE unless told otherwise
template <int K> __global__ void read_uninit_shared_t(u32* out) {
    __shared__ u32 s[64];
    out[threadIdx.x] = s[threadIdx.x];
    __syncthreads();
    s[threadIdx.x] = 7 * K;
}

__global__ void divide(const int* a, int d, int* out) { out[threadIdx.x] = a[threadIdx.x] / d; }

// copies x[0..n) to x[1..n], through two overlapping arguments
__global__ void shift_right(const u32* src, u32* dst, i64 n) {
    for (i64 i = n - 1 - (i64)threadIdx.x; i >= 0; i -= blockDim.x) {
        const u32 v = src[i];
        __syncthreads();
        dst[i] = v;
        __syncthreads();
    }
}

__device__ __noinline__ u32 deep(u32 k) { volatile u32 pad[256]; pad[k & 255] = k; return k ? deep(k - 1) + pad[k & 255] : 0; }
__global__ void overflow_stack(u32* out) { out[threadIdx.x] = deep(1u << 20); }

__global__ void atomic_count(const u32* x, i64 n, unsigned long long* total, u32* hist) {
    for (i64 i = threadIdx.x + (i64)blockIdx.x * blockDim.x; i < n; i += (i64)blockDim.x * gridDim.x) {
        atomicAdd(total, (unsigned long long)x[i]);
        atomicAdd(&hist[x[i] & 7u], 1u);
    }
}
"""
NAMES = ("block_sum", "block_sum_no_barrier", "divergent_barrier", "half_mask", "early_exit", "shfl_outside",
         "op_mismatch", "deadlock", "full_mask_in_loop", "active_mask_in_loop", "assumes_full_active",
         "write_past_end", "read_past_end", "write_before_start", "read_uninit_shared", "read_uninit_shared_t<1>", "divide", "shift_right",
         "overflow_stack", "atomic_count")


@pytest.fixture(scope="module")
def mod():
    return cuda_emulator.load("emulator_semantics", SOURCE, NAMES)


def i64(v: int) -> np.int64:
    return np.int64(v)


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_correct_block_sum_under_every_schedule(mod, schedule):
    x = torch.arange(1000, dtype=torch.float32)
    out = torch.zeros(1)
    mod.get_function("block_sum")(1, 256, (x, i64(1000), out), schedule)
    assert out.item() == float(sum(range(1000)))


def test_missing_barrier_reads_poisoned_shared_memory(mod):
    x = torch.ones(256)
    got = set()
    for schedule in SCHEDULES:
        out = torch.zeros(1)
        mod.get_function("block_sum_no_barrier")(1, 256, (x, i64(256), out), schedule)
        got.add(out.item())
    assert got != {256.0}  # some schedule runs thread 0 before the other warps' writes


def test_barrier_divergence(mod):
    with pytest.raises(EmulatorError, match="barrier divergence"):
        mod.get_function("divergent_barrier")(1, 128, (torch.zeros(128, dtype=torch.int32),))


def test_caller_outside_its_mask(mod):
    with pytest.raises(EmulatorError, match="outside its mask 0x0000ffff"):
        mod.get_function("half_mask")(1, 32, (torch.zeros(32),))


def test_named_lane_exited(mod):
    with pytest.raises(EmulatorError, match="exited"):
        mod.get_function("early_exit")(1, 32, (torch.zeros(32),))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_shuffle_from_lane_outside_mask(mod, schedule):
    with pytest.raises(EmulatorError, match="reads lane 1[6-9]|reads lane 2|reads lane 3"):
        mod.get_function("shfl_outside")(1, 32, (torch.zeros(32),), schedule)


def test_op_mismatch(mod):
    with pytest.raises(EmulatorError, match="warp op mismatch"):
        mod.get_function("op_mismatch")(1, 32, (torch.zeros(32, dtype=torch.int32),))


def test_deadlock(mod):
    with pytest.raises(EmulatorError, match="deadlock"):
        mod.get_function("deadlock")(1, 32, (torch.zeros(32, dtype=torch.int32),))


@pytest.mark.parametrize("schedule", SCHEDULES, ids=str)
def test_full_mask_where_active_mask_belongs(mod, schedule):
    n = 40  # the second iteration reaches lanes 0..7 only
    x = torch.arange(n, dtype=torch.int32) % 3
    with pytest.raises(EmulatorError, match="exited"):
        mod.get_function("full_mask_in_loop")(1, 32, (x, i64(n), torch.zeros(n, dtype=torch.int32)), schedule)
    out = torch.zeros(n, dtype=torch.int32)
    mod.get_function("active_mask_in_loop")(1, 32, (x, i64(n), out), schedule)
    # each element counts its peers with the same value among the lanes that ran with it
    assert bool((out >= 1).all()) and int(out.max()) <= 11


def test_active_mask_is_split_by_the_random_schedule(mod):
    out = torch.zeros(32, dtype=torch.int32)
    mod.get_function("assumes_full_active")(1, 32, (out,), Schedule("lowest"))
    assert bool((out == 32).all())
    seen = set()
    for seed in range(8):
        mod.get_function("assumes_full_active")(1, 32, (out,), Schedule("random", seed))
        seen |= set(out.tolist())
    assert min(seen) < 32  # a legal split the kernel did not expect


@pytest.mark.parametrize("n", [1000, 7])  # 1000 floats end on the guard page; 7 leave 4 slack bytes
def test_write_past_the_end(mod, n):
    with pytest.raises(EmulatorError, match="past its end|out-of-bounds write"):
        mod.get_function("write_past_end")(2, 64, (torch.zeros(n), i64(n)))


def test_illegal_address_names_block_and_thread(mod):
    with pytest.raises(EmulatorError, match=r"block \(\d+,0,0\) thread \(\d+,0,0\): illegal address .*argument 0"):
        mod.get_function("read_past_end")(4, 64, (torch.zeros(1024), i64(1024), torch.zeros(1024)))


def test_write_before_the_start(mod):
    with pytest.raises(EmulatorError, match="before argument 0|out-of-bounds write"):
        mod.get_function("write_before_start")(1, 32, (torch.zeros(16),))


def test_shared_memory_is_poisoned_per_block_start(mod):
    patterns = set()
    for _ in range(3):
        out = torch.zeros(64, dtype=torch.int32)
        mod.get_function("read_uninit_shared")(1, 64, (out,))
        patterns.add(int(out[5]) & 0xFFFFFFFF)
    assert patterns == {0xFFFFFFFF, 0xA5A5A5A5, 0}


def test_integer_division_by_zero_is_reported(mod):
    with pytest.raises(EmulatorError, match="division by zero"):
        mod.get_function("divide")(1, 4, (torch.ones(4, dtype=torch.int32), np.int32(0), torch.zeros(4, dtype=torch.int32)))


def test_atomics_across_blocks(mod):
    x = torch.arange(5000, dtype=torch.int32)
    total = torch.zeros(1, dtype=torch.int64)
    hist = torch.zeros(8, dtype=torch.int32)
    mod.get_function("atomic_count")(7, 96, (x, i64(5000), total, hist), Schedule("random", 3))
    assert total.item() == sum(range(5000))
    assert hist.tolist() == torch.bincount(x & 7, minlength=8).tolist()


def test_arguments_are_checked_against_parameter_types(mod):
    k = mod.get_function("atomic_count")
    x, total, hist = torch.zeros(8, dtype=torch.int32), torch.zeros(1, dtype=torch.int64), torch.zeros(8, dtype=torch.int32)
    with pytest.raises(TypeError, match="Python int"):
        k(1, 32, (x, 8, total, hist))
    with pytest.raises(TypeError, match="int32, the parameter is i8"):
        k(1, 32, (x, np.int32(8), total, hist))
    with pytest.raises(TypeError, match="4-byte elements"):
        k(1, 32, (x, i64(8), hist, hist))  # u32 counts where a u64 total is expected
    with pytest.raises(TypeError, match="3 arguments for 4"):
        k(1, 32, (x, i64(8), total))


def test_overlapping_arguments_alias_as_on_the_device(mod):
    x = torch.arange(100, dtype=torch.int32)
    mod.get_function("shift_right")(1, 32, (x[:99], x[1:], i64(99)))
    assert x.tolist() == [0] + list(range(99))


def test_fiber_stack_overflow_is_reported(mod):
    with pytest.raises(EmulatorError, match="illegal address"):
        mod.get_function("overflow_stack")(1, 2, (torch.zeros(2, dtype=torch.int32),))


def test_two_builds_of_one_source_do_not_share_shared_memory(mod):
    """-fno-gnu-unique -fvisibility=hidden: GCC would otherwise emit a template's local
    statics as STB_GNU_UNIQUE, binding the second library's to the first one's (even under
    RTLD_LOCAL), so its poisoning would miss them and the first one's 7s would show."""
    other = cuda_emulator.load("emulator_semantics_copy", SOURCE + "// another build\n", NAMES)
    assert other.path != mod.path
    out = torch.zeros(64, dtype=torch.int32)
    mod.get_function("read_uninit_shared_t<1>")(1, 64, (out,))  # leaves 7 in this library's array
    seen = set()
    for _ in range(3):
        other.get_function("read_uninit_shared_t<1>")(1, 64, (out,))
        seen.add(int(out[3]) & 0xFFFFFFFF)
    assert 7 not in seen and seen == {0xFFFFFFFF, 0xA5A5A5A5, 0}
