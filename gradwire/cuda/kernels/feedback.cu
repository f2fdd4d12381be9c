// Error feedback and DGC momentum, fused (gradwire/compress/feedback.py). Each kernel does
// in one trip through memory what the CPU path does tile by tile: corrected = x + e, the
// encode, e' = corrected - decode(code), and the finiteness flag of e'. Arithmetic is the
// plain encoders' (quant.cuh, elementwise.cu) and each float operation rounds on its own
// (__fadd_rn etc.: no contraction, like torch's CPU ops), so packets and residuals are
// bit for bit those of the unfused steps.
//
// `add` = 0 is the first step (no residual yet): corrected = x, and `e` is never read.
// `bad` (u32[1], zeroed by the caller) gets 1 when any new residual element is NaN/Inf.
#include "quant.cuh"

template <int DT>
__device__ __forceinline__ typename Elem<DT>::T corrected(const typename Elem<DT>::T* x,
                                                          const typename Elem<DT>::T* e, int add, i64 i) {
    if (!add) return x[i];
    return Elem<DT>::store(__fadd_rn(Elem<DT>::load(x[i]), Elem<DT>::load(e[i])));
}

// corrected - decoded, with decoded first rounded to the tensor dtype (as the CPU subtracts it)
template <int DT>
__device__ __forceinline__ typename Elem<DT>::T residual(typename Elem<DT>::T c, float decoded) {
    return Elem<DT>::store(__fsub_rn(Elem<DT>::load(c), Elem<DT>::load(Elem<DT>::store(decoded))));
}

template <int DT>
__device__ __forceinline__ void flag_nonfinite(typename Elem<DT>::T r, u32* bad) {
    if (!is_finite(Elem<DT>::load(r))) atomicOr(bad, 1u);
}

// ---- casts (and `none`: SRC == DST, the residual is +0) ------------------------------------
template <int SRC, int DST>
__global__ void ef_cast(const typename Elem<SRC>::T* x, const typename Elem<SRC>::T* e, int add, i64 n,
                        typename Elem<DST>::T* data, typename Elem<SRC>::T* out, u32* bad) {
    GW_LOOP(i, n) {
        const typename Elem<SRC>::T c = corrected<SRC>(x, e, add, i);
        const typename Elem<DST>::T d = Elem<DST>::store(Elem<SRC>::load(c));
        data[i] = d;
        const typename Elem<SRC>::T r = residual<SRC>(c, Elem<DST>::load(d));
        out[i] = r;
        flag_nonfinite<SRC>(r, bad);
    }
}

// ---- chunked quantizers: statistics of corrected (written to out), then one fused pass ---
template <int DT>
struct Corrected {
    const typename Elem<DT>::T *x, *e;
    int add;
    typename Elem<DT>::T* out;
    __device__ __forceinline__ float operator()(i64 i) const {
        const typename Elem<DT>::T c = corrected<DT>(x, e, add, i);
        out[i] = c;
        return Elem<DT>::load(c);
    }
};

template <int DT, int OP>
__global__ void ef_seg_reduce(const typename Elem<DT>::T* x, const typename Elem<DT>::T* e, int add,
                              typename Elem<DT>::T* out, i64 n, i64 chunk, i64 seg, i64 spc, i64 nseg,
                              float* pa, float* pb, u32* pc) {
    seg_reduce_run<OP>(Corrected<DT>{x, e, add, out}, n, chunk, seg, spc, nseg, pa, pb, pc);
}

// In the kernels below `out` holds corrected on entry and the new residual on exit.
template <int DT, int FMT>  // FMT 0: e4m3fn, 1: e5m2
__global__ void ef_fp8(typename Elem<DT>::T* out, i64 n, i64 chunk, const float* f0, const float* scales,
                       u8* codes, u32* bad) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            const typename Elem<DT>::T cv = out[i];
            const float v = __fmul_rn(Elem<DT>::load(cv), f0[c]);
            const u8 code = FMT == 0 ? f32_to_e4m3(v) : f32_to_e5m2(v);
            codes[i] = code;
            const float dec = __fmul_rn(FMT == 0 ? e4m3_to_f32(code) : e5m2_to_f32(code), scales[c]);
            const typename Elem<DT>::T r = residual<DT>(cv, dec);
            out[i] = r;
            flag_nonfinite<DT>(r, bad);
        }
    }
}

template <int DT>
__global__ void ef_fp4(typename Elem<DT>::T* out, i64 n, i64 chunk, const float* f0, const float* scales,
                       u8* data, u32* bad) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        u32 w = 0;
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            const typename Elem<DT>::T cv = out[i];
            const u32 code = f32_to_e2m1(__fmul_rn(Elem<DT>::load(cv), f0[c]));
            w |= code << (4 * k);
            const typename Elem<DT>::T r = residual<DT>(cv, __fmul_rn(e2m1_to_f32(code), scales[c]));
            out[i] = r;
            flag_nonfinite<DT>(r, bad);
        }
        for (int j = 0; j < 4; ++j) data[4 * g + j] = (u8)(w >> (8 * j));
    }
}

template <int DT>
__global__ void ef_int8(typename Elem<DT>::T* out, i64 n, i64 chunk, const float* inv, const float* lo,
                        const float* scales, u8* codes, u32* bad) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            const typename Elem<DT>::T cv = out[i];
            const u8 q = int8_code(__fmul_rn(__fsub_rn(Elem<DT>::load(cv), lo[c]), inv[c]));
            codes[i] = q;
            const float sc = scales[c];
            const float mid = __fadd_rn(lo[c], __fmul_rn(sc, 127.5f));
            const float dec = __fadd_rn(__fmul_rn(__fsub_rn((float)q, 127.5f), sc), mid);
            const typename Elem<DT>::T r = residual<DT>(cv, dec);
            out[i] = r;
            flag_nonfinite<DT>(r, bad);
        }
    }
}

// qsgd / terngrad (chunk = n: one scale for the tensor)
template <int DT>
__global__ void ef_stochastic(typename Elem<DT>::T* out, i64 n, i64 chunk, const float* f0, const float* scales,
                              float s, int b, u32 k0, u32 k1, u8* signs, u8* levels, u32* bad) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        u32 lv[8], sg = 0;
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            lv[k] = 0;
            if (i >= n) continue;
            GW_GROUP_ADVANCE(i)
            const typename Elem<DT>::T cv = out[i];
            const float v = Elem<DT>::load(cv);
            lv[k] = stochastic_level(v, f0[c], s, k0, k1, i);
            const u32 neg = f2u(v) >> 31;
            sg |= neg << k;
            const float dec = __fmul_rn(__fmul_rn((float)lv[k], __fdiv_rn(scales[c], s)), neg ? -1.0f : 1.0f);
            const typename Elem<DT>::T r = residual<DT>(cv, dec);
            out[i] = r;
            flag_nonfinite<DT>(r, bad);
        }
        signs[g] = (u8)sg;
        const u64 w = pack8(lv, b);
        for (int j = 0; j < b; ++j) levels[g * b + j] = (u8)(w >> (8 * j));
    }
}

// sign (TWO = 0: scales[c] * +-1) / onebit (TWO = 1: scales[2c + sign bit])
template <int DT, int TWO>
__global__ void ef_sign(typename Elem<DT>::T* out, i64 n, i64 chunk, const float* scales, u8* bits, u32* bad) {
    GW_LOOP(g, (n + 7) / 8) {
        GW_GROUP_BEGIN
        u32 sg = 0;
        for (int k = 0; k < 8; ++k) {
            const i64 i = i0 + k;
            if (i >= n) break;
            GW_GROUP_ADVANCE(i)
            const typename Elem<DT>::T cv = out[i];
            const u32 neg = Elem<DT>::bits(cv) >> (DT == GW_F32 ? 31 : 15);
            sg |= neg << k;
            const float dec = TWO ? scales[2 * c + neg] : __fmul_rn(scales[c], neg ? -1.0f : 1.0f);
            const typename Elem<DT>::T r = residual<DT>(cv, dec);
            out[i] = r;
            flag_nonfinite<DT>(r, bad);
        }
        bits[g] = (u8)sg;
    }
}

// ---- sparsifiers: only the sent positions -----------------------------------------------------
// out[idx[j]] -= vals[j] (vals in the tensor dtype; the input's own values give +0).
template <int DT, typename IDX>
__global__ void ef_sub_sent(typename Elem<DT>::T* out, const IDX* idx, const typename Elem<DT>::T* vals, i64 k,
                            u32* bad) {
    GW_LOOP(j, k) {
        const i64 i = (i64)idx[j];
        const typename Elem<DT>::T r = residual<DT>(out[i], Elem<DT>::load(vals[j]));
        out[i] = r;
        flag_nonfinite<DT>(r, bad);
    }
}

// ---- DGC momentum --------------------------------------------------------------------------
// u = m * u_old + g;  v = v_old + u  (Nesterov: v = v_old + (m * u + g)); each op rounded to
// the tensor dtype, as torch's in-place CPU ops do.
template <int DT>
__global__ void dgc_accumulate(const typename Elem<DT>::T* g, const typename Elem<DT>::T* u_old,
                               const typename Elem<DT>::T* v_old, typename Elem<DT>::T* u, typename Elem<DT>::T* v,
                               i64 n, float m, int nesterov) {
    typedef Elem<DT> E;
    GW_LOOP(i, n) {
        const float gi = E::load(g[i]);
        const typename E::T ui = E::store(__fadd_rn(E::load(E::store(__fmul_rn(E::load(u_old[i]), m))), gi));
        u[i] = ui;
        float add = E::load(ui);
        if (nesterov) add = E::load(E::store(__fadd_rn(E::load(E::store(__fmul_rn(add, m))), gi)));
        v[i] = E::store(__fadd_rn(E::load(v_old[i]), add));
    }
}

// v[i] -= sent; u[i] *= (sent == 0) at the sent positions (momentum-factor masking).
template <int DT, typename IDX>
__global__ void dgc_sent(typename Elem<DT>::T* u, typename Elem<DT>::T* v, const IDX* idx,
                         const typename Elem<DT>::T* sent, i64 k, u32* bad) {
    GW_LOOP(j, k) {
        const i64 i = (i64)idx[j];
        const float s = Elem<DT>::load(sent[j]);
        const typename Elem<DT>::T r = residual<DT>(v[i], s);
        v[i] = r;
        u[i] = Elem<DT>::store(__fmul_rn(Elem<DT>::load(u[i]), s == 0.0f ? 1.0f : 0.0f));
        flag_nonfinite<DT>(r, bad);
    }
}

// ---- keeping the old state of a non-finite step ----------------------------------------------
// new = old where the step was not finite (ok[0] == 0); nothing is moved otherwise.
template <typename W>
__global__ void ef_keep(const u8* ok, const W* old, W* fresh, i64 n) {
    if (ok[0]) return;
    GW_LOOP(i, n) { fresh[i] = old[i]; }
}
