"""The ThreadSanitizer pass itself (tsan.py): it reports races no fiber schedule shows.

The fiber schedules never interleave a read-modify-write, so a non-atomic shared-memory
add looks correct under every one of them; TSan reports it, and a missing barrier, but
neither its atomic twin nor an exchange ordered by `__syncwarp`. gradwire's kernels under
TSan are tested in tests/cuda/test_cuda_tsan.py.
"""

from __future__ import annotations

import pytest
import torch

import cuda_emulator
from cuda_emulator import Schedule, tsan

pytestmark = pytest.mark.skipif(not (cuda_emulator.available() and tsan.available()),
                                reason="needs g++ with ThreadSanitizer on x86-64")

RACY = r"""
typedef unsigned int u32;
__global__ void shared_add(u32* out) {
    __shared__ u32 total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    total += 1;  // bug: a non-atomic read-modify-write by every thread
    __syncthreads();
    if (threadIdx.x == 0) *out = total;
}
__global__ void shared_atomic_add(u32* out) {
    __shared__ u32 total;
    if (threadIdx.x == 0) total = 0;
    __syncthreads();
    atomicAdd(&total, 1u);
    __syncthreads();
    if (threadIdx.x == 0) *out = total;
}
__global__ void shared_missing_barrier(u32* out) {
    __shared__ u32 v[64];
    v[threadIdx.x] = threadIdx.x;
    out[threadIdx.x] = v[63 - threadIdx.x];  // bug: reads another thread's write, no barrier
}
__global__ void warp_exchange(u32* out) {
    __shared__ u32 v[32];
    v[threadIdx.x] = threadIdx.x * 3u;
    __syncwarp();
    out[threadIdx.x] = v[31 - threadIdx.x];
}
__global__ void warp_exchange_shfl_only(u32* out) {
    __shared__ u32 v[32];
    v[threadIdx.x] = threadIdx.x * 3u;
    (void)__shfl_sync(0xFFFFFFFFu, 0u, 0);  // a shuffle exchanges registers, it orders no memory
    out[threadIdx.x] = v[31 - threadIdx.x];
}
"""
NAMES = ("shared_add", "shared_atomic_add", "shared_missing_barrier", "warp_exchange", "warp_exchange_shfl_only")


def test_non_atomic_shared_add_passes_every_schedule_but_not_tsan():
    mod = cuda_emulator.load("tsan_probe", RACY, NAMES)
    for schedule in (Schedule("lowest"), Schedule("highest"), Schedule("random", 5)):
        out = torch.zeros(1, dtype=torch.int32)
        mod.get_function("shared_add")(1, 64, (out,), schedule)
        assert out.item() == 64  # run-to-block scheduling never interleaves the add
    host = tsan.host("tsan_probe", RACY, NAMES)
    races, report, err = host.replay("shared_add", 1, 64, (torch.zeros(1, dtype=torch.int32),), Schedule())
    assert races >= 1 and "data race" in report and not err
    races, report, _ = host.replay("shared_atomic_add", 1, 64, (torch.zeros(1, dtype=torch.int32),), Schedule())
    assert races == 0, report
    races, report, _ = host.replay("shared_missing_barrier", 1, 64, (torch.zeros(64, dtype=torch.int32),), Schedule())
    assert races >= 1, report


def test_syncwarp_orders_shared_memory_and_a_shuffle_does_not():
    host = tsan.host("tsan_probe", RACY, NAMES)
    races, report, err = host.replay("warp_exchange", 1, 32, (torch.zeros(32, dtype=torch.int32),), Schedule())
    assert races == 0 and not err, report
    races, report, _ = host.replay("warp_exchange_shfl_only", 1, 32, (torch.zeros(32, dtype=torch.int32),),
                                   Schedule("random", 4))
    assert races >= 1, report
