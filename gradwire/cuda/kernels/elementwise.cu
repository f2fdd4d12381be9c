// Casts, per-chunk statistics and the dense quantizers (fp8, fp4, int8, qsgd, terngrad,
// sign, onebit): encode and decode. Semantics follow gradwire/compress/quantize/
// operation for operation; the module is compiled with --fmad=false so every float
// multiply and add rounds on its own, as torch's CPU ops do.
#include "quant.cuh"

// ---- casts ------------------------------------------------------------------------------
template <int SRC, int DST>
__global__ void cast_kernel(const typename Elem<SRC>::T* x, typename Elem<DST>::T* y, i64 n) {
    GW_LOOP(i, n) { y[i] = Elem<DST>::store(Elem<SRC>::load(x[i])); }
}

// ---- per-chunk statistics (quant.cuh) ----------------------------------------------------
template <int DT>
struct Plain {
    const typename Elem<DT>::T* x;
    __device__ __forceinline__ float operator()(i64 i) const { return Elem<DT>::load(x[i]); }
};

template <int DT, int OP>
__global__ void seg_reduce(const typename Elem<DT>::T* x, i64 n, i64 chunk, i64 seg, i64 spc, i64 nseg,
                           float* pa, float* pb, u32* pc) {
    seg_reduce_run<OP>(Plain<DT>{x}, n, chunk, seg, spc, nseg, pa, pb, pc);
}

// What each quantizer derives per chunk from its statistics.
#define FIN_FP8 0     // scales = absmax / fmax, f0 = min(fmax / absmax, FLT_MAX)
#define FIN_INT8 1    // scales = hi/255 - lo/255, offsets (f1) = lo, f0 = 1/scale (0 if scale = 0)
#define FIN_QSGD 2    // scales = sqrt(sum x^2), f0 = min(levels / norm, FLT_MAX)
#define FIN_TERN 3    // scales = absmax, f0 = min(1 / absmax, FLT_MAX)
#define FIN_SIGN 4    // scales = sum |x| / width
#define FIN_ONEBIT 5  // scales[2c] = pos sum / max(#pos, 1), scales[2c+1] = neg sum / max(#neg, 1)
#define FIN_SENTINEL 6  // scales[0] = min * 0 + max * 0 (randomk: NaN iff non-finite input)

// One thread per chunk: merge its segments in order, then derive the chunk's numbers.
template <int OP, int FIN>
__global__ void seg_finish(const float* pa, const float* pb, const u32* pc, i64 nchunks, i64 spc, i64 n,
                           i64 chunk, float param, float* scales, float* f0, float* f1) {
    const float flt_max = u2f(GW_FLT_MAX_BITS);
    GW_LOOP(c, nchunks) {
        Acc r;
        r.a = pa[c * spc]; r.b = pb[c * spc]; r.c = pc[c * spc];
        for (i64 p = 1; p < spc; ++p) {
            Acc o;
            o.a = pa[c * spc + p]; o.b = pb[c * spc + p]; o.c = pc[c * spc + p];
            acc_merge<OP>(r, o);
        }
        i64 width = n - c * chunk;
        if (width > chunk) width = chunk;
        if (FIN == FIN_FP8) {
            scales[c] = r.a / param;
            f0[c] = clamp_max(param / r.a, flt_max);
        } else if (FIN == FIN_INT8) {
            const float lo = r.a, hi = r.b;
            const float sc = hi / 255.0f - lo / 255.0f;
            float inv = clamp_max(1.0f / sc, flt_max);
            if (sc == 0.0f) inv = 0.0f;
            scales[c] = sc; f1[c] = lo; f0[c] = inv;
        } else if (FIN == FIN_QSGD) {
            const float norm = sqrtf(r.a);
            scales[c] = norm;
            f0[c] = clamp_max(param / norm, flt_max);
        } else if (FIN == FIN_TERN) {
            scales[c] = r.a;
            f0[c] = clamp_max(1.0f / r.a, flt_max);
        } else if (FIN == FIN_SIGN) {
            scales[c] = r.a / (float)width;
        } else if (FIN == FIN_ONEBIT) {
            i64 neg = (i64)r.c, pos = width - neg;
            if (neg < 1) neg = 1;
            if (pos < 1) pos = 1;
            scales[2 * c] = r.a / (float)pos;
            scales[2 * c + 1] = r.b / (float)neg;
        } else {
            scales[0] = r.a * 0.0f + r.b * 0.0f;
        }
    }
}

// ---- encoders: one thread per group of 8 elements ----------------------------------------
template <int DT, int FMT>  // FMT 0: e4m3fn, 1: e5m2
__global__ void fp8_encode(const typename Elem<DT>::T* x, i64 n, i64 chunk, const float* f0, u8* codes) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            const float v = Elem<DT>::load(x[i]) * f0[c];
            codes[i] = FMT == 0 ? f32_to_e4m3(v) : f32_to_e5m2(v);
        }
    }
}

// fp4: two e2m1 codes per byte, element 2j in the low nibble; f0 = min(6 / absmax, FLT_MAX).
template <int DT>
__global__ void fp4_encode(const typename Elem<DT>::T* x, i64 n, i64 chunk, const float* f0, u8* data) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        u32 w = 0;
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            w |= f32_to_e2m1(Elem<DT>::load(x[i]) * f0[c]) << (4 * k);
        }
        for (int j = 0; j < 4; ++j) data[4 * g + j] = (u8)(w >> (8 * j));
    }
}

template <int DT>
__global__ void int8_encode(const typename Elem<DT>::T* x, i64 n, i64 chunk, const float* inv, const float* lo,
                            u8* codes) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            codes[i] = int8_code((Elem<DT>::load(x[i]) - lo[c]) * inv[c]);
        }
    }
}

// qsgd / terngrad: level = min(floor(|x| * f + u24 * 2^-24), s), b bits each, packed; one
// sign bit each. Levels of the padding elements are 0.
template <int DT>
__global__ void stochastic_encode(const typename Elem<DT>::T* x, i64 n, i64 chunk, const float* f0, float s,
                                  int b, u32 k0, u32 k1, u8* signs, u8* levels) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        u32 lv[8], sg = 0;
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            lv[k] = 0;
            if (i >= n) continue;
            GW_GROUP_ADVANCE(i)
            const float v = Elem<DT>::load(x[i]);
            lv[k] = stochastic_level(v, f0[c], s, k0, k1, i);
            sg |= (f2u(v) >> 31) << k;
        }
        signs[g] = (u8)sg;
        const u64 w = pack8(lv, b);
        for (int j = 0; j < b; ++j) levels[g * b + j] = (u8)(w >> (8 * j));
    }
}

// sign / onebit: just the sign bits (the scales come from seg_finish).
template <int DT>
__global__ void sign_bits(const typename Elem<DT>::T* x, i64 n, u8* bits) {
    GW_LOOP(g, (n + 7) / 8) {
        u32 sg = 0;
        for (int k = 0; k < 8; ++k) {
            const i64 i = 8 * g + k;
            if (i < n) sg |= (Elem<DT>::bits(x[i]) >> (DT == GW_F32 ? 31 : 15)) << k;
        }
        bits[g] = (u8)sg;
    }
}

// ---- decoders: one thread per element --------------------------------------------------------
template <int DT, int FMT>
__global__ void fp8_decode(const u8* codes, const float* scales, i64 n, i64 chunk, typename Elem<DT>::T* y) {
    GW_LOOP(i, n) {
        const float v = FMT == 0 ? e4m3_to_f32(codes[i]) : e5m2_to_f32(codes[i]);
        y[i] = Elem<DT>::store(v * scales[i / chunk]);
    }
}

template <int DT>
__global__ void fp4_decode(const u8* data, const float* scales, i64 n, i64 chunk, typename Elem<DT>::T* y) {
    GW_LOOP(i, n) {
        const u32 code = (data[i >> 1] >> (4 * (i & 1))) & 15u;
        y[i] = Elem<DT>::store(e2m1_to_f32(code) * scales[i / chunk]);
    }
}

template <int DT>
__global__ void int8_decode(const u8* codes, const float* scales, const float* offsets, i64 n, i64 chunk,
                            typename Elem<DT>::T* y) {
    GW_LOOP(i, n) {
        const i64 c = i / chunk;
        const float sc = scales[c];
        const float mid = offsets[c] + sc * 127.5f;
        y[i] = Elem<DT>::store(((float)codes[i] - 127.5f) * sc + mid);
    }
}

// qsgd / terngrad: (-1)^sign * level * (scale / s); chunk = n when there is one scale.
template <int DT>
__global__ void stochastic_decode(const u8* signs, const u8* levels, const float* scales, i64 n, i64 chunk,
                                  float s, int b, typename Elem<DT>::T* y) {
    GW_LOOP(i, n) {
        const i64 g = i >> 3;
        const int k = (int)(i & 7);
        u64 w = 0;
        for (int j = 0; j < b; ++j) w |= (u64)levels[g * b + j] << (8 * j);
        const u32 lv = (u32)(w >> (b * k)) & ((1u << b) - 1u);
        const float step = scales[i / chunk] / s;
        const float pm = (signs[g] >> k) & 1 ? -1.0f : 1.0f;
        y[i] = Elem<DT>::store(((float)lv * step) * pm);
    }
}

template <int DT>
__global__ void sign_decode(const u8* bits, const float* scales, i64 n, i64 chunk, typename Elem<DT>::T* y) {
    GW_LOOP(i, n) {
        const float pm = (bits[i >> 3] >> (i & 7)) & 1 ? -1.0f : 1.0f;
        y[i] = Elem<DT>::store(scales[i / chunk] * pm);
    }
}

template <int DT>
__global__ void onebit_decode(const u8* bits, const float* scales, i64 n, i64 chunk, typename Elem<DT>::T* y) {
    GW_LOOP(i, n) {
        const int neg = (bits[i >> 3] >> (i & 7)) & 1;
        y[i] = Elem<DT>::store(scales[2 * (i / chunk) + neg]);
    }
}
