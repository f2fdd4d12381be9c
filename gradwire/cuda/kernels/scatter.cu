// Sparse decode: scatter values into a zeroed tensor, checking every index on the device.
// A write happens only at an index inside [0, numel), so a forged packet can never write
// out of bounds; any bad index (out of range, not strictly ascending, not in its randomk
// stratum) sets *err, which the caller reads once and turns into a WireFormatError.
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

// randomk: stratum j must hold index j; the value is scaled by the stratum length. When the
// packet's sentinel is non-finite every element becomes x + sentinel * 0 (NaN), as on the CPU.
template <int DT, typename IDX>
__global__ void scatter_randomk(const IDX* idx, const typename Elem<DT>::T* vals, i64 k, i64 numel,
                                const float* sentinel, typename Elem<DT>::T* out, u32* err) {
    const i64 q = numel / k, r = numel - q * k;
    const float s = *sentinel;
    GW_LOOP(j, k) {
        const i64 i = (i64)idx[j];
        const i64 start = stratum_start(j, q, r, k), end = stratum_start(j + 1, q, r, k);
        if (i >= start && i < end) {
            typename Elem<DT>::T w = Elem<DT>::store(Elem<DT>::load(vals[j]) * (float)(end - start));
            if (!is_finite(s)) w = Elem<DT>::store(Elem<DT>::load(w) + s * 0.0f);
            out[i] = w;
        } else {
            atomicOr(err, 1u);
        }
    }
}

// Fill with zeros, or with NaN (0 + sentinel * 0) when the sentinel is non-finite.
template <int DT>
__global__ void fill_sentinel(typename Elem<DT>::T* out, i64 numel, const float* sentinel) {
    const float s = *sentinel;
    const typename Elem<DT>::T z = Elem<DT>::store(is_finite(s) ? 0.0f : 0.0f + s * 0.0f);
    GW_LOOP(i, numel) { out[i] = z; }
}
