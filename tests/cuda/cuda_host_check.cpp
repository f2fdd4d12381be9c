// Host harness for gradwire/cuda/kernels/common.cuh: the integer device functions
// compiled as plain C++ (g++), driven by tests/test_cuda_host.py, which compares them
// with the CPU reference. Protocol: argv = op [params...]; stdin = u32 inputs;
// stdout = u32 outputs.
#define __host__
#define __device__
#define __forceinline__ inline
#include "common.cuh"

#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <vector>

static std::vector<u32> read_all() {
    std::vector<u32> v;
    u32 buf[4096];
    size_t got;
    while ((got = fread(buf, 4, 4096, stdin)) > 0) v.insert(v.end(), buf, buf + got);
    return v;
}

int main(int argc, char** argv) {
    if (argc < 2) return 2;
    const char* op = argv[1];
    std::vector<u32> in = read_all(), out;
    out.reserve(in.size() * 2 + 16);
    if (!strcmp(op, "f16")) for (u32 x : in) out.push_back(f32_to_f16(u2f(x)));
    else if (!strcmp(op, "bf16")) for (u32 x : in) out.push_back(f32_to_bf16(u2f(x)));
    else if (!strcmp(op, "e4m3")) for (u32 x : in) out.push_back(f32_to_e4m3(u2f(x)));
    else if (!strcmp(op, "e5m2")) for (u32 x : in) out.push_back(f32_to_e5m2(u2f(x)));
    else if (!strcmp(op, "f16to32")) for (u32 x : in) out.push_back(f2u(f16_to_f32((u16)x)));
    else if (!strcmp(op, "bf16to32")) for (u32 x : in) out.push_back(f2u(bf16_to_f32((u16)x)));
    else if (!strcmp(op, "e4m3to32")) for (u32 x : in) out.push_back(f2u(e4m3_to_f32((u8)x)));
    else if (!strcmp(op, "e5m2to32")) for (u32 x : in) out.push_back(f2u(e5m2_to_f32((u8)x)));
    else if (!strcmp(op, "key0")) for (u32 x : in) out.push_back(mag_key<GW_F32>(u2f(x)));
    else if (!strcmp(op, "key1")) for (u32 x : in) out.push_back(mag_key<GW_F16>((u16)x));
    else if (!strcmp(op, "key2")) for (u32 x : in) out.push_back(mag_key<GW_BF16>((u16)x));
    else if (!strcmp(op, "bits24")) {  // argv: k0 k1; inputs: element indices (low 32 bits)
        const u32 k0 = (u32)strtoul(argv[2], 0, 10), k1 = (u32)strtoul(argv[3], 0, 10);
        for (u32 x : in) out.push_back(bits24(k0, k1, (u64)x));
    } else if (!strcmp(op, "pack")) {  // argv: b; inputs: codes, 8 per group -> b bytes per group
        const int b = atoi(argv[2]);
        for (size_t g = 0; g + 8 <= in.size(); g += 8) {
            const u64 w = pack8(&in[g], b);
            for (int j = 0; j < b; ++j) out.push_back((u32)(w >> (8 * j)) & 0xFFu);
        }
    } else if (!strcmp(op, "rot")) {  // argv: bytes (2 or 4): rotl then rotr must round-trip
        const int s = atoi(argv[2]);
        for (u32 x : in) {
            const u32 l = s == 4 ? rotl1_32(x) : rotl1_16((u16)x);
            out.push_back(l);
            out.push_back(s == 4 ? rotr1_32(l) : rotr1_16((u16)l));
        }
    } else if (!strcmp(op, "strata")) {  // argv: numel k -> start(0..k)
        const i64 n = atoll(argv[2]), k = atoll(argv[3]), q = n / k, r = n - q * k;
        for (i64 i = 0; i <= k; ++i) {
            const i64 s = stratum_start(i, q, r, k);
            out.push_back((u32)s);
            out.push_back((u32)(s >> 32));
        }
    } else if (!strcmp(op, "randomk")) {  // argv: numel k k0 k1 -> each stratum's drawn position
        const i64 n = atoll(argv[2]), k = atoll(argv[3]), q = n / k, r = n - q * k;
        const u32 k0 = (u32)strtoul(argv[4], 0, 10), k1 = (u32)strtoul(argv[5], 0, 10);
        const int long_strata = (n + k - 1) / k >= (1 << 24);
        for (i64 i = 0; i < k; ++i) {
            const i64 s = stratum_start(i, q, r, k);
            const i64 pos = s + randomk_offset(k0, k1, i, k, stratum_start(i + 1, q, r, k) - s, long_strata);
            out.push_back((u32)pos);
            out.push_back((u32)(pos >> 32));
        }
    } else {
        return 2;
    }
    fwrite(out.data(), 4, out.size(), stdout);
    return 0;
}
