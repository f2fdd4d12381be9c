// Selection for the sparsifiers: exact top-k by radix select over magnitude keys (8 bits
// per pass, device-side state, no host round trip), threshold compaction, strided key
// samples (dgc), randomk's stratified indices. Compaction keeps index order: an element's
// output slot is (#selected before it), from per-tile counts and a scan.
#include "common.cuh"

#define GW_THREADS 256
#define GW_ITEMS 16
#define GW_TILE (GW_THREADS * GW_ITEMS)  // elements per block in the count/write kernels

#define GW_LOOP(i, n) \
    for (i64 i = (i64)blockIdx.x * blockDim.x + threadIdx.x; i < (n); i += (i64)blockDim.x * gridDim.x)

// Radix state (u64[4]): [0] key prefix found so far, [1] mask of its known bits,
// [2] how many of the elements matching the prefix are still to be taken.
__global__ void radix_init(u64* state, u64* hist, i64 k) {
    const int t = threadIdx.x;
    if (t == 0) { state[0] = 0; state[1] = 0; state[2] = (u64)k; state[3] = 0; }
    hist[t] = 0;
}

// Histogram of the digit at `shift` among elements whose known key bits match the prefix.
// Gradients put most keys in a few bins, so lanes with the same bin add once per warp.
template <int DT>
__global__ void radix_hist(const typename Elem<DT>::T* x, i64 n, const u64* state, u64* hist, int shift) {
    __shared__ u32 h[256];
    h[threadIdx.x] = 0;
    __syncthreads();
    const u32 prefix = (u32)state[0], mask = (u32)state[1];
    GW_LOOP(i, n) {
        const u32 key = mag_key<DT>(x[i]);
        const u32 bin = (key & mask) == prefix ? (key >> shift) & 0xFFu : 256u;
        const u32 peers = __match_any_sync(__activemask(), bin);
        if (bin < 256u && (int)(threadIdx.x & 31) == __ffs(peers) - 1) atomicAdd(&h[bin], (u32)__popc(peers));
    }
    __syncthreads();
    if (h[threadIdx.x]) atomicAdd(&hist[threadIdx.x], (u64)h[threadIdx.x]);
}

// One thread: the digit holding the k-th largest among the matching elements; narrow the
// prefix, count what lies above it, and clear the histogram for the next pass.
__global__ void radix_pick(u64* state, u64* hist, int shift) {
    if (threadIdx.x != 0) return;
    const u64 want = state[2];
    u64 above = 0;
    int d = 255;
    for (; d > 0; --d) {
        if (above + hist[d] >= want) break;
        above += hist[d];
    }
    state[0] |= (u64)d << shift;
    state[1] |= (u64)0xFFu << shift;
    state[2] = want - above;
    for (int j = 0; j < 256; ++j) hist[j] = 0;
}

// MODE 0 (top-k): take key > T, and the first state[2] elements with key == T (T = state[0]).
// MODE 1 (at least): take key >= state[0].
template <int DT, int MODE>
__device__ __forceinline__ void classify(typename Elem<DT>::T v, u32 t, u32& gt, u32& eq) {
    const u32 key = mag_key<DT>(v);
    if (MODE == 0) { gt = key > t; eq = key == t; }
    else { gt = key >= t; eq = 0; }
}

// Per tile: how many elements are taken for sure (gt) and how many tie (eq). Counting
// does not care about order, so the loads are strided (coalesced).
template <int DT, int MODE>
__global__ void select_count(const typename Elem<DT>::T* x, i64 n, const u64* state, u32* cnt_gt, u32* cnt_eq) {
    __shared__ u32 sg[GW_THREADS], se[GW_THREADS];
    const u32 t = (u32)state[0];
    const i64 base = (i64)blockIdx.x * GW_TILE + threadIdx.x;
    u32 g = 0, e = 0;
    for (int j = 0; j < GW_ITEMS; ++j) {
        const i64 i = base + (i64)j * GW_THREADS;
        if (i < n) { u32 a, b; classify<DT, MODE>(x[i], t, a, b); g += a; e += b; }
    }
    sg[threadIdx.x] = g; se[threadIdx.x] = e;
    __syncthreads();
    for (int s = GW_THREADS / 2; s > 0; s >>= 1) {
        if ((int)threadIdx.x < s) { sg[threadIdx.x] += sg[threadIdx.x + s]; se[threadIdx.x] += se[threadIdx.x + s]; }
        __syncthreads();
    }
    if (threadIdx.x == 0) { cnt_gt[blockIdx.x] = sg[0]; cnt_eq[blockIdx.x] = se[0]; }
}

// Exclusive scan of one value per thread over the block (Hillis-Steele in shared memory).
__device__ __forceinline__ u32 block_exclusive_scan(u32 v, u32* buf) {
    buf[threadIdx.x] = v;
    __syncthreads();
    for (int off = 1; off < GW_THREADS; off <<= 1) {
        const u32 add = (int)threadIdx.x >= off ? buf[threadIdx.x - off] : 0u;
        __syncthreads();
        buf[threadIdx.x] += add;
        __syncthreads();
    }
    const u32 r = buf[threadIdx.x] - v;
    __syncthreads();
    return r;
}

// Write the taken elements in index order: slot = gt_before + min(eq_before, need).
// inc_gt / inc_eq are inclusive scans (int64) of the per-tile counts. The tile is staged
// in shared memory (coalesced loads, one pad word per 16 against bank conflicts) so each
// thread then walks 16 consecutive elements.
#define GW_PAD(p) ((p) + ((p) >> 4))
template <int DT, int MODE>
__global__ void select_write(const typename Elem<DT>::T* x, i64 n, const u64* state, const u32* cnt_gt,
                             const u32* cnt_eq, const i64* inc_gt, const i64* inc_eq, i64* idx,
                             typename Elem<DT>::T* vals) {
    typedef typename Elem<DT>::T T;
    __shared__ T tile[GW_PAD(GW_TILE)];
    __shared__ u32 buf[GW_THREADS];
    const u32 t = (u32)state[0];
    const i64 need = MODE == 0 ? (i64)state[2] : 0;
    const i64 tile0 = (i64)blockIdx.x * GW_TILE;
    for (int j = 0; j < GW_ITEMS; ++j) {
        const int p = j * GW_THREADS + threadIdx.x;
        if (tile0 + p < n) tile[GW_PAD(p)] = x[tile0 + p];
    }
    __syncthreads();
    const int p0 = threadIdx.x * GW_ITEMS;
    u32 g = 0, e = 0;
    for (int j = 0; j < GW_ITEMS; ++j) {
        if (tile0 + p0 + j < n) { u32 a, b; classify<DT, MODE>(tile[GW_PAD(p0 + j)], t, a, b); g += a; e += b; }
    }
    i64 gb = inc_gt[blockIdx.x] - cnt_gt[blockIdx.x] + block_exclusive_scan(g, buf);
    i64 eb = inc_eq[blockIdx.x] - cnt_eq[blockIdx.x] + block_exclusive_scan(e, buf);
    for (int j = 0; j < GW_ITEMS; ++j) {
        const i64 i = tile0 + p0 + j;
        if (i >= n) break;
        const T v = tile[GW_PAD(p0 + j)];
        u32 a, b;
        classify<DT, MODE>(v, t, a, b);
        if (a) {
            const i64 slot = gb + (eb < need ? eb : need);
            idx[slot] = i; vals[slot] = v;
            ++gb;
        } else if (b) {
            if (eb < need) { idx[gb + eb] = i; vals[gb + eb] = v; }
            ++eb;
        }
    }
}

// Keys of the dgc sample: every stride-th run of 16 elements (rows), else every stride-th element.
template <int DT>
__global__ void sample_keys(const typename Elem<DT>::T* x, i64 m, i64 stride, int rows, u32* keys) {
    GW_LOOP(j, m) {
        const i64 i = rows ? (j >> 4) * stride * 16 + (j & 15) : j * stride;
        keys[j] = mag_key<DT>(x[i]);
    }
}

// state[0] <- keys[pos] (the sample's threshold key), without leaving the device.
__global__ void set_threshold(const u32* keys, i64 pos, u64* state) {
    if (threadIdx.x == 0 && blockIdx.x == 0) { state[0] = keys[pos]; state[1] = 0; state[2] = 0; state[3] = 0; }
}

// randomk: index of stratum i's element and the element itself (see randomk_offset).
template <int DT>
__global__ void randomk_pick(const typename Elem<DT>::T* x, i64 numel, i64 k, u32 k0, u32 k1, int long_strata,
                             i64* idx, typename Elem<DT>::T* vals) {
    const i64 q = numel / k, r = numel - q * k;
    GW_LOOP(i, k) {
        const i64 start = stratum_start(i, q, r, k);
        const i64 len = stratum_start(i + 1, q, r, k) - start;
        const i64 off = randomk_offset(k0, k1, i, k, len, long_strata);
        idx[i] = start + off;
        vals[i] = x[start + off];
    }
}
