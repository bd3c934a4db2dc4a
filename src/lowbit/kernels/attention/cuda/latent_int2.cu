// MLA latent decode attention over an int2 middle tier, one dequantization per tile shared by both products.
//
// Shapes (one block: 16 query heads of one KV head, one split of one sequence; 4 warps):
//   q_lat  bf16 [B, Hq, 512]  (q_nope absorbed by W_uk, rotated like the latent)     q_pe bf16 [B, Hq, 64]
//   codes  uint8 [B, Hkv, T, 128]  the `strided` layout: byte j holds dims j + 128 i at bits 2i..2i+1
//   scale / zero  fp16 [B, Hkv, T, 4]   x = codes * scale + zero, group i = dims [128 i, 128 i + 128)
//   pe     bf16 [B, Hkv, T, 64]   (row stride spt elements, rows 16-byte aligned)
//   part   fp32 [B, Hq, nsplit, 512], lse fp32 [B, Hq, nsplit]  (log2 units): splits [0, nsm) written here;
//   the dense tiers' split and the merge are the Triton kernels' (lowbit.kernels.decode_geometry).
//
// Why CUDA: the Triton kernel dequantizes a tile twice (token-major for the scores, token-minor for the values)
// and spills holding 16 x 576 q in registers (NOTES round 11). Here heads are the MMA's M (16), a tile of
// BT = 64 tokens is staged once in shared memory by cp.async (3 stages), and
//   scores  warp w: tokens 16w..16w+15 (two n-tiles of 8). B operand = 16 codes a 32-bit word: one AND per two
//           codes (a word masked to one 2-bit code per 16-bit half IS two fp16 subnormals, code * 2^(2i-24));
//           q's A fragments are prebuilt once per block in shared memory, times 2^-2i (the 2^24 goes on the
//           scale). One accumulator per scale group: s = sum_i scale_i acc_i 2^24 + zero_i sum(q_i) + pe.q_pe.
//   softmax the tile max across warps through shared memory; each warp writes p * scale_i as the A fragment of
//           its 16 tokens (the C fragments of two n-tiles ARE the A fragment of one k-chunk), so
//   values  warp w: packed bytes 32w..32w+31 (128 dims: 4 groups x 32); B operand = one byte of 4 tokens paired
//           by 8 byte-permutes per 4 words, then the same AND. A fresh product per tile is folded in by one FMA
//           (alpha), so the MMA's accumulator sums 64 tokens only.
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <math.h>
#include <stdint.h>

namespace {

constexpr int D = 512, DR = 64, ROWB = 128, NG = 4;
constexpr int KC_LAT = 32, KC = KC_LAT + DR / 16;  // k-chunks of 16: 32 latent (8 words x 4 groups) + 4 pe

// NW warps a block, BT = 16 NW tokens a tile (16 a warp for the scores), STAGES tiles in the cp.async ring
template <int NW, int STAGES>
struct Smem {
    static constexpr int BT = 16 * NW;
    struct Stage {
        uint8_t codes[BT * ROWB];  // 16-byte chunk j of row r at j ^ (r & 7)
        uint8_t pe[BT * DR * 2];   // 16-byte chunk j of row r at j ^ ((r & 1) << 2)
        __half scale[BT * NG];
        __half zero[BT * NG];
    };
    Stage ring[STAGES];
    uint4 qfrag[KC * 32];       // A fragments of q: [k-chunk][lane]
    uint4 pbuf[NG * NW * 32];   // A fragments of p * scale_i: [group][k-chunk = warp][lane]
    float smax[NW][16];
    float qsum[NG][16];
    float red_l[NW][16];
    float red_z[NW][NG][16];
};

__device__ __forceinline__ void cp16(void* dst, const void* src, int bytes) {
    unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp8(void* dst, const void* src, int bytes) {
    unsigned d = static_cast<unsigned>(__cvta_generic_to_shared(dst));
    asm volatile("cp.async.ca.shared.global [%0], [%1], 8, %2;\n" ::"r"(d), "l"(src), "r"(bytes));
}
__device__ __forceinline__ void cp_commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N>
__device__ __forceinline__ void cp_wait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

__device__ __forceinline__ void mma_f16(float (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}
__device__ __forceinline__ void mma_bf16(float (&c)[4], const uint4& a, uint32_t b0, uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a.x), "r"(a.y), "r"(a.z), "r"(a.w), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
    __half2 h = __floats2half2_rn(lo, hi);
    return *reinterpret_cast<uint32_t*>(&h);
}
__device__ __forceinline__ float half_at(const uint4& v, int k) {  // half k (0..7) of a 16-byte vector
    uint32_t w = k < 2 ? v.x : k < 4 ? v.y : k < 6 ? v.z : v.w;
    unsigned short s = static_cast<unsigned short>((k & 1) ? (w >> 16) : (w & 0xffff));
    return __half2float(__ushort_as_half(s));
}

// MINB: blocks a SM the instance is built for (3: at most 168 registers a thread). FRESH: the values' product of
// a tile starts from zero and is folded into O with alpha (the MMA's accumulator sums one tile); else O is
// rescaled by alpha first and the MMAs accumulate into it (fewer registers)
template <int NW, int STAGES, int MINB, bool FRESH>
__global__ void __launch_bounds__(NW * 32, MINB) latent_int2_stage1(
    const __nv_bfloat16* __restrict__ q, long long sqb, long long sqh,
    const __nv_bfloat16* __restrict__ qp, long long sqpb, long long sqph,
    const uint8_t* __restrict__ codes, long long scb, long long sch,
    const __half* __restrict__ scale, const __half* __restrict__ zero, long long ssb, long long ssh,
    const __nv_bfloat16* __restrict__ pe, long long spb, long long sph, long long spt,
    const int* __restrict__ mid_len, float* __restrict__ part, float* __restrict__ lse_out,
    float qk_scale, int split_tokens, int nsplit, int G, int NHB) {
    constexpr int NTHR = NW * 32, BT = 16 * NW;
    constexpr int BPL = 16 / NW;  // values: packed bytes per lane (the warp's 128 / NW bytes over 8 lanes)
    constexpr int IPG = NW == 4 ? 2 : 1;  // scores: groups a pass (8 warps: registers capped at 128 a thread)
    using S = Smem<NW, STAGES>;
    extern __shared__ __align__(128) uint8_t smem_raw[];
    S& sm = *reinterpret_cast<S*>(smem_raw);
    const int tid = threadIdx.x, w = tid >> 5, lane = tid & 31, g = lane >> 2, c = lane & 3;
    const int kvh = blockIdx.x / NHB, hb = blockIdx.x % NHB, split = blockIdx.y, b = blockIdx.z;
    const int Hq = G * (gridDim.x / NHB);
    const int h0 = kvh * G + hb * 16;
    const int L = mid_len[b];
    const int start = split * split_tokens;
    const int end = min(start + split_tokens, L);
    const int ntiles = end > start ? (end - start + BT - 1) / BT : 0;
    const uint8_t* cbase = codes + b * scb + kvh * sch;
    const __half* sbase = scale + b * ssb + kvh * ssh;
    const __half* zbase = zero + b * ssb + kvh * ssh;
    const __nv_bfloat16* pbase = pe + b * spb + kvh * sph;

    auto load_tile = [&](int tile, int s) {
        const int t0 = start + tile * BT;
        typename S::Stage& st = sm.ring[s];
#pragma unroll
        for (int k = 0; k < BT * 8 / NTHR; ++k) {
            const int ch = tid + NTHR * k, row = ch >> 3, col = ch & 7, t = t0 + row;
            const bool ok = t < end;
            cp16(st.codes + row * ROWB + ((col ^ (row & 7)) << 4), ok ? cbase + (long long)t * ROWB + col * 16 : cbase,
                 ok ? 16 : 0);
            cp16(st.pe + row * 128 + ((col ^ ((row & 1) << 2)) << 4), ok ? pbase + (long long)t * spt + col * 8 : pbase,
                 ok ? 16 : 0);
        }
        {  // one token's 4 groups of scale (threads [0, BT)) or zero ([BT, 2 BT)): 8 bytes (rows of any T)
            const int j = tid % BT, t = t0 + j;
            const bool ok = t < end;
            const __half* base = tid < BT ? sbase : zbase;
            __half* dst = tid < BT ? st.scale : st.zero;
            cp8(dst + NG * j, ok ? base + (long long)t * NG : base, ok ? 8 : 0);
        }
    };

#pragma unroll
    for (int s = 0; s < STAGES - 1; ++s) {
        if (s < ntiles) load_tile(s, s);
        cp_commit();
    }

    // ---- q -> A fragments (raw rows staged in the last ring stage and in pbuf, both free until the loop) ----
    __nv_bfloat16* qraw = reinterpret_cast<__nv_bfloat16*>(sm.ring[STAGES - 1].codes);  // [16][512]: 16 KB
    __nv_bfloat16* praw = reinterpret_cast<__nv_bfloat16*>(sm.pbuf);                     // [16][64]
    for (int k = tid; k < 16 * 64; k += NTHR) {
        const int r = k >> 6, col = k & 63;
        *reinterpret_cast<uint4*>(qraw + r * D + col * 8) =
            *reinterpret_cast<const uint4*>(q + b * sqb + (long long)(h0 + r) * sqh + col * 8);
    }
    for (int k = tid; k < 16 * 8; k += NTHR) {
        const int r = k >> 3, col = k & 7;
        *reinterpret_cast<uint4*>(praw + r * DR + col * 8) =
            *reinterpret_cast<const uint4*>(qp + b * sqpb + (long long)(h0 + r) * sqph + col * 8);
    }
    __syncthreads();
    for (int e = tid; e < KC * 32; e += NTHR) {
        const int kc = e >> 5, ln = e & 31, gg = ln >> 2, cc = ln & 3;
        uint32_t r[4];
        if (kc < KC_LAT) {
            // group i, word wv: lane cc's k-slots (2cc, 2cc+1 | 2cc+8, 2cc+9) are bytes (0, 2 | 1, 3) of packed
            // word 8cc + wv, i.e. dims u + (0, 2 | 1, 3) with u = 4 (8cc + wv) + 128 i
            const int i = kc >> 3, wv = kc & 7, u = 4 * (8 * cc + wv) + 128 * i;
            const float f = 1.0f / static_cast<float>(1 << (2 * i));
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = gg + ((j & 1) ? 8 : 0), d0 = u + ((j & 2) ? 1 : 0);
                r[j] = pack_h2(__bfloat162float(qraw[row * D + d0]) * f, __bfloat162float(qraw[row * D + d0 + 2]) * f);
            }
        } else {
            // pe k-chunk kk = 2m + half: lane cc's slots are dims 32m + 8cc + 4 half + (0, 1 | 2, 3), so one
            // 16-byte read of a pe row serves two k-chunks
            const int kk = kc - KC_LAT, m = kk >> 1, hf = kk & 1, u = 32 * m + 8 * cc + 4 * hf;
#pragma unroll
            for (int j = 0; j < 4; ++j) {
                const int row = gg + ((j & 1) ? 8 : 0), d0 = u + ((j & 2) ? 2 : 0);
                r[j] = *reinterpret_cast<const uint32_t*>(praw + row * DR + d0);
            }
        }
        sm.qfrag[e] = make_uint4(r[0], r[1], r[2], r[3]);
    }
    if (tid < 64) {
        const int row = tid >> 2, i = tid & 3;
        float s = 0.f;
        for (int d = 0; d < 128; ++d) s += __bfloat162float(qraw[row * D + 128 * i + d]);
        sm.qsum[i][row] = s;
    }
    __syncthreads();

    float m_run[2] = {-INFINITY, -INFINITY};
    float l_part[2] = {0.f, 0.f};
    float z_part[NG][2] = {};
    float O[BPL][NG][4] = {};  // [byte o of the lane's bytes][group i][C element]

    for (int tile = 0; tile < ntiles; ++tile) {
        cp_wait<STAGES - 2>();
        __syncthreads();  // (A) this tile landed for everyone; the previous tile's reads are done
        {
            const int nx = tile + STAGES - 1;
            if (nx < ntiles) load_tile(nx, nx % STAGES);
            cp_commit();
        }
        const typename S::Stage& st = sm.ring[tile % STAGES];
        const int t0 = start + tile * BT;

        // ---------------- scores: tokens 16w + 8nt + (2c, 2c+1), heads g, g+8 ----------------
        float sc[2][4];
        uint32_t W[2][8];
        uint4 SV[2], ZV[2];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
            const int row = 16 * w + 8 * nt + g;
            const uint4* crow = reinterpret_cast<const uint4*>(st.codes + row * ROWB);
            const uint4 lo = crow[(2 * c) ^ g], hi = crow[(2 * c + 1) ^ g];
            W[nt][0] = lo.x; W[nt][1] = lo.y; W[nt][2] = lo.z; W[nt][3] = lo.w;
            W[nt][4] = hi.x; W[nt][5] = hi.y; W[nt][6] = hi.z; W[nt][7] = hi.w;
            const int ta = 16 * w + 8 * nt + 2 * c;
            SV[nt] = *reinterpret_cast<const uint4*>(st.scale + ta * NG);
            ZV[nt] = *reinterpret_cast<const uint4*>(st.zero + ta * NG);
#pragma unroll
            for (int e = 0; e < 4; ++e) sc[nt][e] = 0.f;
            const uint4* prow = reinterpret_cast<const uint4*>(st.pe + row * 128);
#pragma unroll
            for (int m = 0; m < 2; ++m) {
                const uint4 pw = prow[(4 * m + c) ^ ((g & 1) << 2)];
                mma_bf16(sc[nt], sm.qfrag[(KC_LAT + 2 * m) * 32 + lane], pw.x, pw.y);
                mma_bf16(sc[nt], sm.qfrag[(KC_LAT + 2 * m + 1) * 32 + lane], pw.z, pw.w);
            }
        }
#pragma unroll
        for (int ip = 0; ip < NG; ip += IPG) {  // IPG groups at a time: 2 IPG independent MMA chains
            float acc[IPG][2][4] = {};          // [group - ip][nt][C element]
#pragma unroll
            for (int wv = 0; wv < 8; ++wv)
#pragma unroll
                for (int ii = 0; ii < IPG; ++ii) {
                    const uint32_t M = 0x00030003u << (2 * (ip + ii));
                    const uint4 a = sm.qfrag[(8 * (ip + ii) + wv) * 32 + lane];
#pragma unroll
                    for (int nt = 0; nt < 2; ++nt) mma_f16(acc[ii][nt], a, W[nt][wv] & M, (W[nt][wv] >> 8) & M);
                }
#pragma unroll
            for (int ii = 0; ii < IPG; ++ii) {
                const int i = ip + ii;
#pragma unroll
                for (int nt = 0; nt < 2; ++nt) {
                    const float s0 = half_at(SV[nt], i) * 16777216.f, s1 = half_at(SV[nt], NG + i) * 16777216.f;
                    const float z0 = half_at(ZV[nt], i), z1 = half_at(ZV[nt], NG + i);
                    const float q0 = sm.qsum[i][g], q1 = sm.qsum[i][g + 8];
                    sc[nt][0] += acc[ii][nt][0] * s0 + z0 * q0;
                    sc[nt][1] += acc[ii][nt][1] * s1 + z1 * q0;
                    sc[nt][2] += acc[ii][nt][2] * s0 + z0 * q1;
                    sc[nt][3] += acc[ii][nt][3] * s1 + z1 * q1;
                }
            }
        }
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) {
                const int t = t0 + 16 * w + 8 * nt + 2 * c + (e & 1);
                sc[nt][e] = t < end ? sc[nt][e] * qk_scale : -INFINITY;
                mx[e >> 1] = fmaxf(mx[e >> 1], sc[nt][e]);
            }
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 1));
            mx[r] = fmaxf(mx[r], __shfl_xor_sync(0xffffffffu, mx[r], 2));
        }
        if (c == 0) {
            sm.smax[w][g] = mx[0];
            sm.smax[w][g + 8] = mx[1];
        }
        __syncthreads();  // (B)

        // ---------------- online softmax (the tile's max over all warps) ----------------
        float alpha[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            float mt = sm.smax[0][g + 8 * r];
#pragma unroll
            for (int ww = 1; ww < NW; ++ww) mt = fmaxf(mt, sm.smax[ww][g + 8 * r]);
            const float mn = fmaxf(m_run[r], mt);  // finite: the tile has a valid token
            alpha[r] = exp2f(m_run[r] - mn);
            m_run[r] = mn;
        }
        float p[2][4];
#pragma unroll
        for (int nt = 0; nt < 2; ++nt)
#pragma unroll
            for (int e = 0; e < 4; ++e) p[nt][e] = exp2f(sc[nt][e] - m_run[e >> 1]);
#pragma unroll
        for (int r = 0; r < 2; ++r)
            l_part[r] = l_part[r] * alpha[r] + p[0][2 * r] + p[0][2 * r + 1] + p[1][2 * r] + p[1][2 * r + 1];
#pragma unroll
        for (int i = 0; i < NG; ++i) {
            float zs[2][2], ss[2][2];  // [nt][token parity]
#pragma unroll
            for (int nt = 0; nt < 2; ++nt) {
                zs[nt][0] = half_at(ZV[nt], i);
                zs[nt][1] = half_at(ZV[nt], NG + i);
                ss[nt][0] = half_at(SV[nt], i);
                ss[nt][1] = half_at(SV[nt], NG + i);
            }
#pragma unroll
            for (int r = 0; r < 2; ++r)
                z_part[i][r] = z_part[i][r] * alpha[r] + p[0][2 * r] * zs[0][0] + p[0][2 * r + 1] * zs[0][1] +
                               p[1][2 * r] * zs[1][0] + p[1][2 * r + 1] * zs[1][1];
            uint4 a;
            a.x = pack_h2(p[0][0] * ss[0][0], p[0][1] * ss[0][1]);
            a.y = pack_h2(p[0][2] * ss[0][0], p[0][3] * ss[0][1]);
            a.z = pack_h2(p[1][0] * ss[1][0], p[1][1] * ss[1][1]);
            a.w = pack_h2(p[1][2] * ss[1][0], p[1][3] * ss[1][1]);
            sm.pbuf[(i * NW + w) * 32 + lane] = a;
        }
        __syncthreads();  // (C)

        // ------- values: packed bytes (128 / NW) w + BPL g + o of tokens 16kc + 2c + (0, 1, 8, 9) -------
        float Pt[FRESH ? BPL : 1][NG][4] = {};  // this tile's product (FRESH)
        if constexpr (!FRESH) {
#pragma unroll
            for (int o = 0; o < BPL; ++o)
#pragma unroll
                for (int i = 0; i < NG; ++i) {
                    O[o][i][0] *= alpha[0];
                    O[o][i][1] *= alpha[0];
                    O[o][i][2] *= alpha[1];
                    O[o][i][3] *= alpha[1];
                }
        }
#pragma unroll
        for (int kc = 0; kc < NW; ++kc) {
            const int r0 = 16 * kc + 2 * c;
            const int byte = (128 / NW) * w + BPL * g, chk = byte >> 4, off = byte & 15;
            auto ld = [&](int row) -> uint32_t {
                const uint8_t* p = st.codes + row * ROWB + ((chk ^ (row & 7)) << 4) + off;
                if constexpr (BPL == 4) return *reinterpret_cast<const uint32_t*>(p);
                else return *reinterpret_cast<const uint16_t*>(p);
            };
            const uint32_t T0 = ld(r0), T1 = ld(r0 + 1), T8 = ld(r0 + 8), T9 = ld(r0 + 9);
            uint32_t wd[BPL];  // byte o of the 4 tokens as (t0, t8, t1, t9)
            const uint32_t a01 = __byte_perm(T0, T1, 0x5140), a89 = __byte_perm(T8, T9, 0x5140);
            wd[0] = __byte_perm(a01, a89, 0x5140);
            wd[1] = __byte_perm(a01, a89, 0x7362);
            if constexpr (BPL == 4) {
                const uint32_t b01 = __byte_perm(T0, T1, 0x7362), b89 = __byte_perm(T8, T9, 0x7362);
                wd[2] = __byte_perm(b01, b89, 0x5140);
                wd[3] = __byte_perm(b01, b89, 0x7362);
            }
#pragma unroll
            for (int i = 0; i < NG; ++i) {
                const uint32_t M = 0x00030003u << (2 * i);
                const uint4 A = sm.pbuf[(i * NW + kc) * 32 + lane];
#pragma unroll
                for (int o = 0; o < BPL; ++o) {
                    if constexpr (FRESH) mma_f16(Pt[o][i], A, wd[o] & M, (wd[o] >> 8) & M);
                    else mma_f16(O[o][i], A, wd[o] & M, (wd[o] >> 8) & M);
                }
            }
        }
        // fold this tile's product in (the MMA's accumulator summed BT tokens only)
#pragma unroll
        for (int o = 0; o < (FRESH ? BPL : 0); ++o)
#pragma unroll
            for (int i = 0; i < NG; ++i) {
                O[o][i][0] = fmaf(O[o][i][0], alpha[0], Pt[o][i][0]);
                O[o][i][1] = fmaf(O[o][i][1], alpha[0], Pt[o][i][1]);
                O[o][i][2] = fmaf(O[o][i][2], alpha[1], Pt[o][i][2]);
                O[o][i][3] = fmaf(O[o][i][3], alpha[1], Pt[o][i][3]);
            }
    }

    // ---------------- epilogue: sums over lanes and warps, the split's partial output and lse ----------------
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        l_part[r] += __shfl_xor_sync(0xffffffffu, l_part[r], 1);
        l_part[r] += __shfl_xor_sync(0xffffffffu, l_part[r], 2);
#pragma unroll
        for (int i = 0; i < NG; ++i) {
            z_part[i][r] += __shfl_xor_sync(0xffffffffu, z_part[i][r], 1);
            z_part[i][r] += __shfl_xor_sync(0xffffffffu, z_part[i][r], 2);
        }
    }
    if (c == 0) {
#pragma unroll
        for (int r = 0; r < 2; ++r) {
            sm.red_l[w][g + 8 * r] = l_part[r];
#pragma unroll
            for (int i = 0; i < NG; ++i) sm.red_z[w][i][g + 8 * r] = z_part[i][r];
        }
    }
    __syncthreads();
#pragma unroll
    for (int r = 0; r < 2; ++r) {
        const int row = g + 8 * r;
        float lt = 0.f, zt[NG] = {};
#pragma unroll
        for (int ww = 0; ww < NW; ++ww) {
            lt += sm.red_l[ww][row];
#pragma unroll
            for (int i = 0; i < NG; ++i) zt[i] += sm.red_z[ww][i][row];
        }
        const float inv = lt > 0.f ? 1.f / lt : 0.f;
        const long long orow = ((long long)b * Hq + h0 + row) * nsplit + split;
        if (w == 0 && c == 0) lse_out[orow] = lt > 0.f ? m_run[r] + log2f(lt) : -INFINITY;
        float* dst = part + orow * D;
#pragma unroll
        for (int i = 0; i < NG; ++i) {
            const float f = inv * static_cast<float>(1 << (24 - 2 * i)), z = zt[i] * inv;
#pragma unroll
            for (int o = 0; o < BPL; ++o) {  // C column n = 2c + j holds packed byte (128 / NW) w + BPL n + o
                const int d = 128 * i + (128 / NW) * w + 2 * BPL * c + o;
                dst[d] = O[o][i][2 * r] * f + z;
                dst[d + BPL] = O[o][i][2 * r + 1] * f + z;
            }
        }
    }
}

template <int NW, int STAGES, int MINB, bool FRESH>
int launch(const void* q, long long sqb, long long sqh, const void* qp, long long sqpb, long long sqph,
           const void* codes, long long scb, long long sch, const void* scale, const void* zero, long long ssb,
           long long ssh, const void* pe, long long spb, long long sph, long long spt, const void* mid_len, void* part,
           void* lse, float qk_scale, int split_tokens, int nsm, int nsplit, int B, int Hkv, int G,
           cudaStream_t stream) {
    const int smem = static_cast<int>(sizeof(Smem<NW, STAGES>));
    cudaError_t e = cudaFuncSetAttribute(latent_int2_stage1<NW, STAGES, MINB, FRESH>,
                                         cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return static_cast<int>(e);
    const int NHB = G / 16;
    dim3 grid(Hkv * NHB, nsm, B);
    latent_int2_stage1<NW, STAGES, MINB, FRESH><<<grid, NW * 32, smem, stream>>>(
        static_cast<const __nv_bfloat16*>(q), sqb, sqh, static_cast<const __nv_bfloat16*>(qp), sqpb, sqph,
        static_cast<const uint8_t*>(codes), scb, sch, static_cast<const __half*>(scale),
        static_cast<const __half*>(zero), ssb, ssh, static_cast<const __nv_bfloat16*>(pe), spb, sph, spt,
        static_cast<const int*>(mid_len), static_cast<float*>(part), static_cast<float*>(lse), qk_scale,
        split_tokens, nsplit, G, NHB);
    return static_cast<int>(cudaGetLastError());
}

}  // namespace

extern "C" {

// Shared memory per block of an instance (warps, stages): (4, 3) and (8, 2) at 2 blocks a SM, (4, 2) at 3; -1 for an
// instance the library does not have.
int lowbit_latent_int2_smem(int warps, int stages) {
    if (warps == 4 && stages == 3) return static_cast<int>(sizeof(Smem<4, 3>));
    if (warps == 4 && stages == 2) return static_cast<int>(sizeof(Smem<4, 2>));
    if (warps == 8 && stages == 2) return static_cast<int>(sizeof(Smem<8, 2>));
    return -1;
}

// Launch stage 1 for the middle splits [0, nsm) on `stream` with the (warps, stages) instance: (4, 3) and (8, 2) at
// 2 blocks a SM with a fresh product per tile, (4, 2) at 3 blocks a SM accumulating into O; 0, -1 (no such
// instance) or a cudaError_t code.
int lowbit_latent_int2_stage1(const void* q, long long sqb, long long sqh, const void* qp, long long sqpb,
                              long long sqph, const void* codes, long long scb, long long sch, const void* scale,
                              const void* zero, long long ssb, long long ssh, const void* pe, long long spb,
                              long long sph, long long spt, const void* mid_len, void* part, void* lse,
                              float qk_scale, int split_tokens, int nsm, int nsplit, int B, int Hkv, int G, int warps,
                              int stages, unsigned long long stream) {
    cudaStream_t st = reinterpret_cast<cudaStream_t>(stream);
#define LOWBIT_LATENT_LAUNCH(NW_, ST_, MB_, FR_)                                                                     \
    return launch<NW_, ST_, MB_, FR_>(q, sqb, sqh, qp, sqpb, sqph, codes, scb, sch, scale, zero, ssb, ssh, pe, spb, sph, \
                                 spt, mid_len, part, lse, qk_scale, split_tokens, nsm, nsplit, B, Hkv, G, st)
    if (warps == 4 && stages == 3) LOWBIT_LATENT_LAUNCH(4, 3, 2, true);
    if (warps == 4 && stages == 2) LOWBIT_LATENT_LAUNCH(4, 2, 3, false);
    if (warps == 8 && stages == 2) LOWBIT_LATENT_LAUNCH(8, 2, 2, true);
#undef LOWBIT_LATENT_LAUNCH
    return -1;
}

const char* lowbit_latent_cuda_error_string(int code) {
    return code == -1 ? "no such instance: (warps, stages) must be (4, 3), (4, 2) or (8, 2)" : cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
