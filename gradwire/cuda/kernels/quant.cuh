// Per-element quantizer arithmetic and the per-chunk reduction, shared by the plain
// encoders (elementwise.cu) and the fused error-feedback ones (feedback.cu), so both give
// the same statistics, codes and decoded values bit for bit.
#pragma once
#include "common.cuh"

// Grid-stride loop over [0, n) with 64-bit indices.
#define GW_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Encoders run one thread per group of 8 elements (bit packing needs no atomics).
// Chunk of the group's first element, then step across chunk boundaries (one division).
#define GW_GROUP_BEGIN                                   \
    const i64 i0 = 8 * g;                               \
    i64 c = i0 / chunk, next = (c + 1) * chunk;

#define GW_GROUP_ADVANCE(i) \
    while ((i) >= next) { ++c; next += chunk; }

// ---- per-chunk statistics -----------------------------------------------------------------
// Reduction ops. One accumulator (a, b, c) per segment; combining is in a fixed order,
// so results are deterministic (but not the CPU's summation order: see docs/cuda.md).
#define OP_ABSMAX 0  // a = max |x| (NaN propagates)
#define OP_MINMAX 1  // a = min, b = max (NaN propagates)
#define OP_ABSSUM 2  // a = sum |x|
#define OP_SQSUM 3   // a = sum x^2
#define OP_PN 4      // a = sum of x >= 0 part, b = sum of x <= 0 part, c = count of sign bits

struct Acc { float a, b; u32 c; };

template <int OP>
__device__ __forceinline__ Acc acc_init() {
    Acc r;
    r.c = 0;
    if (OP == OP_MINMAX) { r.a = u2f(0x7F800000u); r.b = u2f(0xFF800000u); }
    else if (OP == OP_ABSMAX) { r.a = 0.0f; r.b = 0.0f; }
    else { r.a = 0.0f; r.b = 0.0f; }
    return r;
}

template <int OP>
__device__ __forceinline__ void acc_add(Acc& r, float x) {
    if (OP == OP_ABSMAX) r.a = nan_max(r.a, abs_f(x));
    else if (OP == OP_MINMAX) { r.a = nan_min(r.a, x); r.b = nan_max(r.b, x); }
    else if (OP == OP_ABSSUM) r.a = r.a + abs_f(x);
    else if (OP == OP_SQSUM) r.a = r.a + x * x;
    else {  // torch.clamp(x, min=0) / clamp(x, max=0): NaN stays NaN in both sums
        r.a = r.a + (is_nan(x) ? x : (x < 0.0f ? 0.0f : x));
        r.b = r.b + (is_nan(x) ? x : (x > 0.0f ? 0.0f : x));
        r.c += f2u(x) >> 31;
    }
}

template <int OP>
__device__ __forceinline__ void acc_merge(Acc& r, const Acc& o) {
    if (OP == OP_ABSMAX) r.a = nan_max(r.a, o.a);
    else if (OP == OP_MINMAX) { r.a = nan_min(r.a, o.a); r.b = nan_max(r.b, o.b); }
    else { r.a = r.a + o.a; r.b = r.b + o.b; r.c += o.c; }
}

// One warp per segment. Chunk c of `chunk` elements is cut into `spc` segments of `seg`
// elements (the last ones shorter); segment s = c * spc + p. Writes one partial per segment.
// `src(i)` is element i as fp32 (each i is read by exactly one lane: it may also write it).
template <int OP, class Src>
__device__ __forceinline__ void seg_reduce_run(Src src, i64 n, i64 chunk, i64 seg, i64 spc, i64 nseg,
                                               float* pa, float* pb, u32* pc) {
    const int lane = threadIdx.x & 31;
    const i64 warps = (i64)gridDim.x * (blockDim.x >> 5);
    for (i64 s = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5); s < nseg; s += warps) {
        const i64 c = s / spc, p = s - c * spc;
        const i64 c0 = c * chunk;
        const i64 lo = c0 + p * seg;
        i64 hi = c0 + (p + 1) * seg;
        if (hi > c0 + chunk) hi = c0 + chunk;
        if (hi > n) hi = n;
        Acc r = acc_init<OP>();
        for (i64 i = lo + lane; i < hi; i += 32) acc_add<OP>(r, src(i));
        for (int off = 16; off > 0; off >>= 1) {
            Acc o;
            o.a = __shfl_xor_sync(0xFFFFFFFFu, r.a, off);
            o.b = __shfl_xor_sync(0xFFFFFFFFu, r.b, off);
            o.c = __shfl_xor_sync(0xFFFFFFFFu, r.c, off);
            acc_merge<OP>(r, o);
        }
        if (lane == 0) { pa[s] = r.a; pb[s] = r.b; pc[s] = r.c; }
    }
}

// round_half_even then clamp to [0, 255]; a NaN becomes code 0 (what the CPU's int cast gives).
__device__ __forceinline__ u8 int8_code(float w) {
    w = rintf(w);
    if (is_nan(w)) return 0;
    w = w < 0.0f ? 0.0f : (w > 255.0f ? 255.0f : w);
    return (u8)(int)w;
}

// qsgd / terngrad level: min(floor(|v| * f + u24 * 2^-24), s); NaN gives level 0.
__device__ __forceinline__ u32 stochastic_level(float v, float f, float s, u32 k0, u32 k1, i64 i) {
    float w = abs_f(v) * f;
    w = w + (float)bits24(k0, k1, (u64)i) * 5.9604644775390625e-8f;  // exact: u24 * 2^-24
    w = clamp_max(w, s);
    return is_nan(w) ? 0u : (u32)(int)w;  // truncation = floor (w >= 0)
}
