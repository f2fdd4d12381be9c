// Sparse decode: scatter values into a zeroed tensor, checking every index on the device.
// A write happens only at an index inside [0, numel), so a forged packet can never write
// out of bounds; any bad index (out of range, not strictly ascending) sets *err, which the
// caller reads once and turns into a WireFormatError. randomk packets carry no indices.
#include "common.cuh"

#define GW_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

template <int DT, typename IDX>
__global__ void scatter_sorted(const IDX* idx, const typename Elem<DT>::T* vals, i64 count, i64 numel,
                               typename Elem<DT>::T* out, u32* err) {
    GW_LOOP(j, count) {
        const i64 i = (i64)idx[j];
        const bool ok = i >= 0 && i < numel && (j == 0 || (i64)idx[j - 1] < i);
        if (i >= 0 && i < numel) out[i] = vals[j];
        if (!ok) atomicOr(err, 1u);
    }
}

// randomk: stratum j's position is drawn again from the packet's 64-bit stream key (as
// randomk_pick drew it, so it lies inside the stratum whatever the key says) and gets the
// value times the stratum length. When the packet's sentinel is non-finite every element
// becomes x + sentinel * 0 (NaN), as on the CPU.
template <int DT>
__global__ void scatter_randomk(const typename Elem<DT>::T* vals, i64 k, i64 numel, const i64* key,
                                int long_strata, const float* sentinel, typename Elem<DT>::T* out) {
    const i64 q = numel / k, r = numel - q * k;
    const u64 w = (u64)*key;
    const u32 k0 = (u32)w, k1 = (u32)(w >> 32);
    const float s = *sentinel;
    GW_LOOP(j, k) {
        const i64 start = stratum_start(j, q, r, k), len = stratum_start(j + 1, q, r, k) - start;
        typename Elem<DT>::T v = Elem<DT>::store(Elem<DT>::load(vals[j]) * (float)len);
        if (!is_finite(s)) v = Elem<DT>::store(Elem<DT>::load(v) + s * 0.0f);
        out[start + randomk_offset(k0, k1, j, k, len, long_strata)] = v;
    }
}

// Fill with zeros, or with NaN (0 + sentinel * 0) when the sentinel is non-finite.
template <int DT>
__global__ void fill_sentinel(typename Elem<DT>::T* out, i64 numel, const float* sentinel) {
    const float s = *sentinel;
    const typename Elem<DT>::T z = Elem<DT>::store(is_finite(s) ? 0.0f : 0.0f + s * 0.0f);
    GW_LOOP(i, numel) { out[i] = z; }
}
