// Shared pieces of gradwire's kernels: integer types, bit casts, float conversions,
// magnitude keys and the counter-based hash. Everything here is __host__ __device__
// and integer-only, so tests compile it into a host program and compare it with the
// CPU reference (tests/test_cuda_host.py) without a GPU.
//
// NVRTC has no standard headers: only builtin types and CUDA intrinsics are used.
#pragma once

#define GW_HD __host__ __device__ __forceinline__

typedef unsigned char u8;
typedef unsigned short u16;
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// Element dtype codes (the wire's): 0 fp32, 1 fp16, 2 bf16.
#define GW_F32 0
#define GW_F16 1
#define GW_BF16 2

#define GW_FLT_MAX_BITS 0x7F7FFFFFu

GW_HD u32 f2u(float f) {
#ifdef __CUDA_ARCH__
    return __float_as_uint(f);
#else
    union { float f; u32 u; } v; v.f = f; return v.u;
#endif
}

GW_HD float u2f(u32 u) {
#ifdef __CUDA_ARCH__
    return __uint_as_float(u);
#else
    union { float f; u32 u; } v; v.u = u; return v.f;
#endif
}

GW_HD bool is_nan(float f) { return (f2u(f) & 0x7FFFFFFFu) > 0x7F800000u; }
GW_HD bool is_finite(float f) { return (f2u(f) & 0x7F800000u) != 0x7F800000u; }

// NaN-propagating helpers (torch's clamp/max/min propagate NaN; fminf/fmaxf do not).
GW_HD float clamp_max(float v, float hi) { return v > hi ? hi : v; }
GW_HD float clamp_min(float v, float lo) { return v < lo ? lo : v; }
GW_HD float nan_max(float a, float b) { return is_nan(a) ? a : (is_nan(b) ? b : (b > a ? b : a)); }
GW_HD float nan_min(float a, float b) { return is_nan(a) ? a : (is_nan(b) ? b : (b < a ? b : a)); }
GW_HD float abs_f(float v) { return u2f(f2u(v) & 0x7FFFFFFFu); }

// ---- float conversions (bit-exact with torch's CPU casts for finite values and inf; NaN
// payloads follow torch 2.x's vectorised x86 path, which is not a promise: docs/cuda.md) --

// fp32 -> a small float with E exponent and M mantissa bits, round to nearest even,
// from the magnitude bits `a` (sign handled by the caller). Values that round past the
// largest finite code come out as the all-ones-exponent code (inf, or NaN for e4m3fn).
template <int E, int M>
GW_HD u32 round_small(u32 a) {
    const int bias = (1 << (E - 1)) - 1;
    int e = (int)(a >> 23) - 127;  // unbiased exponent of a normal fp32
    u32 mant = (a & 0x7FFFFFu) | 0x800000u;
    if ((a >> 23) == 0) return 0;  // fp32 subnormals are far below every target's range
    int sh;
    u32 base;
    if (e < 1 - bias) {  // target subnormal: value / 2^(1-bias-M) rounded
        sh = (23 - M) + (1 - bias - e);
        base = 0;
        if (sh > 25) return 0;
    } else {
        sh = 23 - M;
        base = (u32)(e + bias) << M;
        mant &= 0x7FFFFFu;
    }
    u32 q = mant >> sh;
    u32 rem = mant & ((1u << sh) - 1u);
    u32 half = 1u << (sh - 1);
    if (rem > half || (rem == half && (q & 1u))) q += 1u;
    return base + q;  // a carry out of the mantissa bumps the exponent, as it should
}

GW_HD u16 f32_to_f16(float f) {
    u32 u = f2u(f), s = (u >> 16) & 0x8000u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (u16)(s | 0x7E00u | (a >> 13));  // NaN: quiet, payload top bits kept
    if (a >= 0x477FF000u) return (u16)(s | 0x7C00u);  // >= 65520 rounds to inf
    return (u16)(s | round_small<5, 10>(a));
}

GW_HD u16 f32_to_bf16(float f) {
    u32 u = f2u(f);
    if ((u & 0x7FFFFFFFu) > 0x7F800000u) return 0xFFFFu;  // torch's CPU cast: all ones
    return (u16)((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}

GW_HD float f16_to_f32(u16 h) {
    u32 s = (u32)(h & 0x8000u) << 16, e = (h >> 10) & 0x1Fu, m = h & 0x3FFu;
    if (e == 0x1Fu) return u2f(s | 0x7F800000u | (m ? 0x400000u : 0u) | (m << 13));  // NaN comes out quiet
    if (e == 0) {
        if (m == 0) return u2f(s);
        int k = 0;  // normalise the subnormal
        while (!(m & 0x400u)) { m <<= 1; ++k; }
        return u2f(s | ((u32)(113 - k) << 23) | ((m & 0x3FFu) << 13));
    }
    return u2f(s | ((e + 112u) << 23) | (m << 13));
}

GW_HD float bf16_to_f32(u16 h) { return u2f((u32)h << 16); }

// float8_e4m3fn: no inf; NaN is 0x7F, anything that would round past 448 (inf included)
// saturates to 448 (0x7E), sign kept, as torch's cast does.
GW_HD u8 f32_to_e4m3(float f) {
    u32 u = f2u(f), s = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (u8)(s | 0x7Fu);
    if (a >= 0x43E80000u) return (u8)(s | 0x7Eu);  // >= 464: rounds to 448 or beyond
    return (u8)(s | round_small<4, 3>(a));
}

// float8_e5m2: |x| >= 65536 is inf (0x7C), NaN is 0x7F, sign kept.
GW_HD u8 f32_to_e5m2(float f) {
    u32 u = f2u(f), s = (u >> 24) & 0x80u, a = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return (u8)(s | 0x7Fu);
    if (a >= 0x47800000u) return (u8)(s | 0x7Cu);
    return (u8)(s | round_small<5, 2>(a));
}

GW_HD float e4m3_to_f32(u8 c) {
    u32 s = (u32)(c & 0x80u) << 24, e = (c >> 3) & 0xFu, m = c & 7u;
    if (e == 0xFu && m == 7u) return u2f(s | 0x7FF00000u);
    if (e == 0) {
        if (m == 0) return u2f(s);
        int k = 0;
        while (!(m & 8u)) { m <<= 1; ++k; }
        return u2f(s | ((u32)(121 - k) << 23) | ((m & 7u) << 20));
    }
    return u2f(s | ((e + 120u) << 23) | (m << 20));
}

GW_HD float e5m2_to_f32(u8 c) { return f16_to_f32((u16)((u16)c << 8)); }

// fp4 e2m1 (OCP microscaling): sign, 2 exponent bits (bias 1), 1 mantissa bit; magnitudes
// 0, 0.5, 1, 1.5, 2, 3, 4, 6. Round to nearest, ties to the even code (the thresholds
// alternate between > and >=); above 6 saturates to 6; NaN is code 0 (no sign: a NaN's
// sign bit differs between CPU and GPU; its chunk's scale is non-finite anyway).
GW_HD u32 f32_to_e2m1(float f) {
    if (is_nan(f)) return 0u;
    const float a = abs_f(f);
    const u32 m = (u32)(a > 0.25f) + (u32)(a >= 0.75f) + (u32)(a > 1.25f) + (u32)(a >= 1.75f)
                + (u32)(a > 2.5f) + (u32)(a >= 3.5f) + (u32)(a > 5.0f);
    return m | ((f2u(f) >> 31) << 3);
}

// Exact: 0.5 * mantissa below exponent 1, else (1 + 0.5 * mantissa) * 2^(e - 1).
GW_HD float e2m1_to_f32(u32 c) {
    const u32 s = (c & 8u) << 28, e = (c >> 1) & 3u, m = c & 1u;
    if (e == 0) return u2f(s | (m ? 0x3F000000u : 0u));
    return u2f(s | ((e + 126u) << 23) | (m << 22));
}

// Element access by dtype code: fp32 is stored as float, fp16/bf16 as their u16 bits.
template <int DT> struct Elem;
template <> struct Elem<GW_F32> {
    typedef float T;
    static GW_HD float load(T v) { return v; }
    static GW_HD T store(float v) { return v; }
    static GW_HD u32 bits(T v) { return f2u(v); }
};
template <> struct Elem<GW_F16> {
    typedef u16 T;
    static GW_HD float load(T v) { return f16_to_f32(v); }
    static GW_HD T store(float v) { return f32_to_f16(v); }
    static GW_HD u32 bits(T v) { return v; }
};
template <> struct Elem<GW_BF16> {
    typedef u16 T;
    static GW_HD float load(T v) { return bf16_to_f32(v); }
    static GW_HD T store(float v) { return f32_to_bf16(v); }
    static GW_HD u32 bits(T v) { return v; }
};

// Magnitude key: the bits with the sign cleared, every NaN clamped to inf + 1, so keys
// order like |x| and NaN > inf > finite (gradwire/compress/select.py).
template <int DT>
GW_HD u32 mag_key(typename Elem<DT>::T v) {
    u32 b = Elem<DT>::bits(v);
    if (DT == GW_F32) { b &= 0x7FFFFFFFu; return b > 0x7F800001u ? 0x7F800001u : b; }
    b &= 0x7FFFu;
    const u32 top = DT == GW_F16 ? 0x7C01u : 0x7F81u;
    return b > top ? top : b;
}

// ---- counter-based randomness (gradwire/compress/rng.py) -----------------------------
GW_HD u32 gw_hash(u32 x, u32 k1) {
    x ^= x >> 16; x *= 0x21F0AAADu;
    x ^= x >> 15; x *= 0x735A2D97u;
    x ^= x >> 15; x ^= k1;
    return x;
}

// u24 of element `element` in the stream (k0, k1): a uniform integer in [0, 2^24).
GW_HD u32 bits24(u32 k0, u32 k1, u64 element) { return gw_hash((u32)element + k0, k1) >> 8; }

// ---- bit packing (docs/wire-format.md) ------------------------------------------------
// Codes c[0..7] of b bits each (b <= 8) as the little-endian integer sum c[k] << (b*k).
GW_HD u64 pack8(const u32* c, int b) {
    u64 w = 0;
    for (int k = 0; k < 8; ++k) w |= (u64)c[k] << (b * k);
    return w;
}

// Bits rotated left by one (sign to bit 0) for the byte-plane split; and back.
GW_HD u32 rotl1_32(u32 w) { return (w << 1) | (w >> 31); }
GW_HD u32 rotr1_32(u32 w) { return (w >> 1) | (w << 31); }
GW_HD u16 rotl1_16(u16 w) { return (u16)((w << 1) | (w >> 15)); }
GW_HD u16 rotr1_16(u16 w) { return (u16)((w >> 1) | (w << 15)); }

// Strata of randomk: stratum i is [start(i), start(i+1)), start(i) = i*q + (i*r)/k.
GW_HD i64 stratum_start(i64 i, i64 q, i64 r, i64 k) { return i * q + (i * r) / k; }

// randomk's draw in stratum i of length len (rng.randbelow): floor(u24 * len / 2^24), or for
// strata of 2^24 elements or more a 48-bit draw from two 24-bit ones (elements i and k + i).
// Always in [0, len): a packet's key can move a value only within its own stratum.
GW_HD i64 randomk_offset(u32 k0, u32 k1, i64 i, i64 k, i64 len, int long_strata) {
    if (!long_strata) return ((i64)bits24(k0, k1, (u64)i) * len) >> 24;
    const i64 hi = bits24(k0, k1, (u64)i), lo = bits24(k0, k1, (u64)(k + i));
    return (hi * len + ((lo * len) >> 24)) >> 24;
}
