// Byte planes for the lossless stage (gradwire/compress/lossless.py): each float's bits
// rotated left by one (sign to bit 0), then byte k of element i goes to planes[k*n + i].
// The frame content is unpadded, so plane and element pointers may have any alignment:
// everything moves byte by byte (coalesced per plane).
#include "common.cuh"

#define GW_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

template <int S>  // element size in bytes: 2 or 4
__global__ void planes_split(const u8* src, i64 n, u8* dst) {
    GW_LOOP(i, n) {
        u32 w = 0;
        for (int k = 0; k < S; ++k) w |= (u32)src[i * S + k] << (8 * k);
        w = S == 4 ? rotl1_32(w) : (u32)rotl1_16((u16)w);
        for (int k = 0; k < S; ++k) dst[(i64)k * n + i] = (u8)(w >> (8 * k));
    }
}

template <int S>
__global__ void planes_merge(const u8* src, i64 n, u8* dst) {
    GW_LOOP(i, n) {
        u32 w = 0;
        for (int k = 0; k < S; ++k) w |= (u32)src[(i64)k * n + i] << (8 * k);
        w = S == 4 ? rotr1_32(w) : (u32)rotr1_16((u16)w);
        for (int k = 0; k < S; ++k) dst[i * S + k] = (u8)(w >> (8 * k));
    }
}
