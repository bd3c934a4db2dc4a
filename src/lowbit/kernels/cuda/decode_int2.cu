// lowbit: split-K decode attention over the tiered KV cache, int2 middle tier, head_dim 128 (CUDA C++).
//
//   out[b, h] = softmax(q[b, h] . K[b, h / G]^T * sm_scale) V[b, h / G]   over sink + packed middle + recent tokens
//
// Stage 1 only: grid (nsm + dense, Hkv, B), one block per (split, KV head, sequence). Block x < nsm takes middle
// tokens [x * split_tokens, ...) of the packed tier; block x == nsm (when the call has dense tiers) takes the sink
// and recent tiers. Each block writes its split's output normalised by its own softmax sum and its log2-sum-exp
// into the rows lowbit.kernels.decode_attention's Triton stage 2 merges (same layout as the Triton stage 1).
//
// Middle tier (lowbit.quant.packing "strided", 2-bit): row of a token = 32 bytes, byte j = d[j] | d[j+32] << 2 |
// d[j+64] << 4 | d[j+96] << 6; one fp16 scale and zero per token row (group 128); x = code * scale + zero (or,
// scale-only, zero = -centre * scale).
//
// Why this layout of the work (benchmarks/NOTES.md, round 12):
// - QK with the tokens as the mma's M side: A = 16 tokens x 16 dims of codes, B = 16 dims x 8 query heads (the G
//   heads of the KV head, padded to 8). The order of the dims inside an mma is free as long as A and B agree, so
//   each lane feeds A from the 8 bytes of the row it loaded itself (one 8-byte load per token) and q is
//   permuted into the same order once per block. Dequant is one AND-OR per two codes: (w & (3 << 2j) per
//   16-bit half) | 0x6400 IS the fp16 number 1024 + 4^j * code; the 4^-j goes into q, and the 1024 * sum(q)
//   offset is measured once by an mma over the magic word alone and subtracted per token (the K sum cancels by
//   a factor of ~40 at most: fp32 keeps it).
// - PV with the dims as M: A = 16 dims x 16 tokens of V codes, B = 16 tokens x 8 heads of p * scale. A lane
//   needs two tokens' codes of one dim per register: one byte-permute of two tokens' words, one AND-OR per two
//   codes (as above) and one fp16 FMA that centres them exactly (code - 1.5: a sum of large positive codes
//   cancelling against the zero term loses the accuracy the audit asks at 128k tokens). The scores' mma
//   layout (token rows, head columns) is the transpose of the B operand: movmatrix turns it in registers.
// - No shared memory and no barrier in the loop: each warp keeps its own softmax state over its own 32-token
//   blocks (warp w takes blocks w, w + NW, ...), the next block's codes and scales are loaded before the
//   current block is computed, and the warps merge once at the end through shared memory.
// - Dense tiers (sink, recent; bf16 or fp16): the same mma structure, values converted to fp16 in registers.

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

constexpr int D = 128;
constexpr uint32_t MAGIC = 0x64006400u;  // fp16x2 (1024, 1024)

struct Params {
  const void* q;  // [B, Hq, 128] bf16 / fp16
  long long sqb, sqh;
  const uint8_t* kc;  // [B, Hkv, T, 32]
  long long skb, skh;
  const unsigned short* ks;  // fp16 [B, Hkv, T]
  const unsigned short* kz;  // or null (scale-only)
  long long sksb, sksh;
  const uint8_t* vc;
  long long svb, svh;
  const unsigned short* vs;
  const unsigned short* vz;
  long long svsb, svsh;
  const int* mid_len;  // [B]
  const uint16_t* sk;  // dense sink K / V [B, Hkv, Ns, 128] (or null)
  const uint16_t* sv;
  long long sskb, sskh, sskt, ssvb, ssvh, ssvt;
  const int* sink_len;
  const uint16_t* rk;  // dense recent
  const uint16_t* rv;
  long long srkb, srkh, srkt, srvb, srvh, srvt;
  const int* rec_len;
  float* op;   // [B, Hq, nsplit, 128]
  float* lse;  // [B, Hq, nsplit]
  float qk_scale;  // sm_scale * log2(e)
  float kctr, vctr;
  int split_tokens, nsm, nsplit, G, q_bf16, dense_bf16;
};

__device__ __forceinline__ void mma16816(float (&c)[4], uint32_t a0, uint32_t a1, uint32_t a2, uint32_t a3,
                                         uint32_t b0, uint32_t b1) {
  asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};"
      : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
      : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

__device__ __forceinline__ uint32_t trans8x8(uint32_t x) {
  uint32_t y;
  asm("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;" : "=r"(y) : "r"(x));
  return y;
}

__device__ __forceinline__ uint32_t hfma2(uint32_t a, uint32_t b, uint32_t c) {
  uint32_t d;
  asm("fma.rn.f16x2 %0, %1, %2, %3;" : "=r"(d) : "r"(a), "r"(b), "r"(c));
  return d;
}

__device__ __forceinline__ uint32_t pack_h2(float lo, float hi) {
  uint32_t d;
  asm("cvt.rn.f16x2.f32 %0, %1, %2;" : "=r"(d) : "f"(hi), "f"(lo));
  return d;
}

// (x & mask) | MAGIC in one lop3 (C's & and | with two immediates compile to two).
__device__ __forceinline__ uint32_t and_or(uint32_t x, uint32_t mask) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(x), "r"(mask), "r"(MAGIC));
  return r;
}

__device__ __forceinline__ float ex2(float x) {
  float y;
  asm("ex2.approx.ftz.f32 %0, %1;" : "=f"(y) : "f"(x));
  return y;
}

__device__ __forceinline__ float h2f(unsigned short r) { return __half2float(__ushort_as_half(r)); }

__device__ __forceinline__ float ld_q(const void* q, int bf16, long long i) {
  const unsigned short r = reinterpret_cast<const unsigned short*>(q)[i];
  return bf16 ? __uint_as_float(uint32_t(r) << 16) : h2f(r);
}

// Two 16-bit dense values (bf16 or fp16, lo in the low half) -> fp16x2.
template <bool BF16>
__device__ __forceinline__ uint32_t dense_h2(uint32_t w) {
  if (!BF16) return w;
  return pack_h2(__uint_as_float(w << 16), __uint_as_float(w & 0xffff0000u));
}

// K codes of one token: words wi (bytes 8*tig + 4*wi .. +3); register r = (wi, bh, j) holds bytes bh and bh + 2
// of word wi, code j: fp16x2 (1024 + 4^j c_lo, 1024 + 4^j c_hi).
__device__ __forceinline__ uint32_t k_frag(uint32_t w_lo8, uint32_t w_hi8, int r) {
  const int bh = (r >> 2) & 1, j = r & 3;
  const uint32_t x = bh ? w_hi8 : w_lo8;
  return and_or(x, 0x00030003u << (2 * j));
}

// Dim of K register r, half hi, for lane tig (the q permutation that matches k_frag).
__device__ __forceinline__ int k_dim(int tig, int r, int hi) {
  const int wi = r >> 3, bh = (r >> 2) & 1, j = r & 3;
  return 8 * tig + 4 * wi + bh + 2 * hi + 32 * j;
}

// V: combo c = 4 * i + j (byte i of the lane's word, code j) of a token pair, centred: fp16x2 (c_a - 1.5, c_b - 1.5).
// src = the pair's byte-permuted word for byte i (bytes i of token a / token b in the two halves' low bytes).
__device__ __forceinline__ uint32_t v_frag(uint32_t src, int j) {
  // j = 0 is moved to bits 2-3 so every code sits at 4^(j') with j' >= 1: then (1024 / 4^j' + 1.5) is exact in fp16
  const uint32_t x = j == 0 ? (src << 2) : src;
  const int jj = j == 0 ? 1 : j;
  const uint32_t t = and_or(x, 0x00030003u << (2 * jj));
  // t = 1024 + 4^jj c -> t * 4^-jj - (1024 * 4^-jj + 1.5) = c - 1.5 (one rounding of an exact value)
  const uint32_t mul = jj == 1 ? 0x34003400u : jj == 2 ? 0x2C002C00u : 0x24002400u;  // 1/4, 1/16, 1/64
  const uint32_t add = jj == 1 ? 0xDC06DC06u : jj == 2 ? 0xD418D418u : 0xCC60CC60u;  // -257.5, -65.5, -17.5
  return hfma2(t, mul, add);
}

// Dim of V combo c for lane gid (middle tier): byte i = c >> 2 of the lane's word (bytes 4*gid ..), code j = c & 3.
__device__ __forceinline__ int v_dim(int gid, int c) { return 4 * gid + (c >> 2) + 32 * (c & 3); }
// Dense tier: lane gid holds 16-byte chunks gid and gid + 8: combo c = 8 * (chunk) + element.
__device__ __forceinline__ int vd_dim(int gid, int c) { return 64 * (c >> 3) + 8 * gid + (c & 7); }
// Dense K: lane tig holds 16-byte chunks tig, tig + 4, tig + 8, tig + 12; register r = 4 * chunk + pair.
__device__ __forceinline__ int kd_dim(int tig, int r, int hi) { return 8 * (tig + 4 * (r >> 2)) + 2 * (r & 3) + hi; }

// Per-warp online softmax state for heads 2*tig (A) and 2*tig+1 (B) and the PV accumulator [8 d-tiles][4].
struct State {
  float m[2], l[2], lz[2];
  float o[8][4];
};

__device__ __forceinline__ void state_init(State& st) {
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    st.m[e] = -INFINITY;
    st.l[e] = 0.f;
    st.lz[e] = 0.f;
  }
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int e = 0; e < 4; ++e) st.o[m][e] = 0.f;
}

// Online softmax over one 32-token block's scores sc[mt][e] (mt: 16-token tile; e: c0..c3 = (token gid, A),
// (gid, B), (gid + 8, A), (gid + 8, B)); returns the fp16x2 p * vscale pairs for the PV B operand (before the
// transpose): pp[mt][0] = tokens gid (A, B), pp[mt][1] = gid + 8. vsc / vzc: per token (mt, half) the V scale and
// (centred) zero term; p of a masked token is 0 (its score is -inf).
__device__ __forceinline__ void softmax_block(State& st, float (&sc)[2][4], const float (&vsc)[2][2],
                                              const float (&vzc)[2][2], uint32_t (&pp)[2][2]) {
  float bm[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    bm[e] = fmaxf(fmaxf(sc[0][e], sc[0][e + 2]), fmaxf(sc[1][e], sc[1][e + 2]));
    bm[e] = fmaxf(bm[e], __shfl_xor_sync(0xffffffffu, bm[e], 4));
    bm[e] = fmaxf(bm[e], __shfl_xor_sync(0xffffffffu, bm[e], 8));
    bm[e] = fmaxf(bm[e], __shfl_xor_sync(0xffffffffu, bm[e], 16));
  }
  float alpha[2], mn[2];
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    mn[e] = fmaxf(st.m[e], bm[e]);  // finite: every block has a valid token
    alpha[e] = ex2(st.m[e] - mn[e]);
    st.m[e] = mn[e];
  }
  float ps[2] = {0.f, 0.f}, pz[2] = {0.f, 0.f};
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    float p[4];
#pragma unroll
    for (int e = 0; e < 4; ++e) {
      p[e] = ex2(sc[mt][e] - mn[e & 1]);
      ps[e & 1] += p[e];
      pz[e & 1] = fmaf(p[e], vzc[mt][e >> 1], pz[e & 1]);
    }
    pp[mt][0] = pack_h2(p[0] * vsc[mt][0], p[1] * vsc[mt][0]);
    pp[mt][1] = pack_h2(p[2] * vsc[mt][1], p[3] * vsc[mt][1]);
  }
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    st.l[e] = fmaf(st.l[e], alpha[e], ps[e]);
    st.lz[e] = fmaf(st.lz[e], alpha[e], pz[e]);
  }
  // rescale the accumulator only when a max moved (after the first blocks it rarely does)
  if (__any_sync(0xffffffffu, alpha[0] != 1.f || alpha[1] != 1.f)) {
#pragma unroll
    for (int m = 0; m < 8; ++m) {
      st.o[m][0] *= alpha[0];
      st.o[m][1] *= alpha[1];
      st.o[m][2] *= alpha[0];
      st.o[m][3] *= alpha[1];
    }
  }
}

// PV of one 16-token tile: va[0..3] = the lane's V words of tokens 2*tig, 2*tig+1, 2*tig+8, 2*tig+9 (bytes 4*gid..).
__device__ __forceinline__ void pv_mid(State& st, const uint32_t (&va)[4], uint32_t b0, uint32_t b1) {
  const uint32_t x0 = __byte_perm(va[0], va[1], 0x5410), z0 = __byte_perm(va[0], va[1], 0x7632);
  const uint32_t x1 = __byte_perm(va[2], va[3], 0x5410), z1 = __byte_perm(va[2], va[3], 0x7632);
  const uint32_t s0[4] = {x0, x0 >> 8, z0, z0 >> 8};
  const uint32_t s1[4] = {x1, x1 >> 8, z1, z1 >> 8};
#pragma unroll
  for (int m = 0; m < 8; ++m) {
    const int c0 = 2 * m, c1 = 2 * m + 1;  // rows gid / gid + 8 of d-tile m
    const uint32_t a0 = v_frag(s0[c0 >> 2], c0 & 3), a1 = v_frag(s0[c1 >> 2], c1 & 3);
    const uint32_t a2 = v_frag(s1[c0 >> 2], c0 & 3), a3 = v_frag(s1[c1 >> 2], c1 & 3);
    mma16816(st.o[m], a0, a1, a2, a3, b0, b1);
  }
}

struct MidData {
  uint2 kw[2][2];    // [mt][token gid / gid+8]
  uint32_t vw[2][4];  // [mt][token 2tig, 2tig+1, 2tig+8, 2tig+9]
  unsigned short ks[2][2], kz[2][2], vs[2][2], vz[2][2];  // [mt][token gid / gid+8]
};

// One 32-token block of the middle tier in shared memory (a warp's ring stage), as the global rows lie.
struct Stage {
  uint8_t k[32 * 32];
  uint8_t v[32 * 32];
  unsigned short ks[32], kz[32], vs[32], vz[32];
};

__device__ __forceinline__ void cp_async16(void* dst, const void* src, int src_bytes) {
  const uint32_t d = static_cast<uint32_t>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(d), "l"(src), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

// Copy block [tb, tb + 32) of this (sequence, KV head) into a stage: 16 bytes a lane per copy, tokens at or past
// `end` zero-filled (so their scales are 0: p * scale = 0, and their scores are masked), never read.
// kc / vc: the (sequence, head)'s code rows; ks.. its scales (16-byte aligned: the wrapper checks).
template <bool HAS_ZERO>
__device__ __forceinline__ void issue_stage(Stage& st, const uint8_t* kc, const uint8_t* vc, const unsigned short* ks,
                                            const unsigned short* kz, const unsigned short* vs,
                                            const unsigned short* vz, int tb, int end, int lane) {
#pragma unroll
  for (int h = 0; h < 2; ++h) {
    const int c = lane + 32 * h;  // 16-byte chunk of the 1 KB block: token tb + c / 2
    const int t = tb + (c >> 1);
    const int n = t < end ? 16 : 0;
    const long long o = (long long)(n ? t : tb) * 32 + (c & 1) * 16;
    cp_async16(st.k + c * 16, kc + o, n);
    cp_async16(st.v + c * 16, vc + o, n);
  }
  constexpr int NA = HAS_ZERO ? 4 : 2;
  if (lane < 4 * NA) {
    const int a = lane >> 2, c = lane & 3;  // array a, tokens tb + 8c ..
    const int t = tb + 8 * c;
    const int n = max(0, min(8, end - t)) * 2;
    const unsigned short* src = a == 0 ? ks : a == 1 ? vs : a == 2 ? kz : vz;
    unsigned short* dst = a == 0 ? st.ks : a == 1 ? st.vs : a == 2 ? st.kz : st.vz;
    cp_async16(dst + 8 * c, src + (n ? t : tb), n);
  }
}

// This lane's view of a stage (the fragments' tokens and bytes; see compute_mid).
template <bool HAS_ZERO>
__device__ __forceinline__ void read_stage(MidData& d, const Stage& st, int gid, int tig) {
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const int t = 16 * mt + 8 * hf + gid;
      d.kw[mt][hf] = *reinterpret_cast<const uint2*>(st.k + t * 32 + 8 * tig);
      d.ks[mt][hf] = st.ks[t];
      d.vs[mt][hf] = st.vs[t];
      if (HAS_ZERO) {
        d.kz[mt][hf] = st.kz[t];
        d.vz[mt][hf] = st.vz[t];
      }
    }
#pragma unroll
    for (int i = 0; i < 4; ++i)
      d.vw[mt][i] = *reinterpret_cast<const uint32_t*>(st.v + (16 * mt + 2 * tig + (i & 1) + 8 * (i >> 1)) * 32 + 4 * gid);
  }
}

template <bool HAS_ZERO>
__device__ __forceinline__ void compute_mid(State& st, const MidData& d, const uint32_t (&qf)[16], const float (&off)[2],
                                            const float (&qs)[2], float kctr, float vctr, int tb, int end, bool masked,
                                            int gid) {
  float sc[2][4];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) {
    float acc[4] = {0.f, 0.f, 0.f, 0.f};
    const uint32_t w0 = d.kw[mt][0].x, w1 = d.kw[mt][0].y, u0 = d.kw[mt][1].x, u1 = d.kw[mt][1].y;
    const uint32_t w08 = w0 >> 8, w18 = w1 >> 8, u08 = u0 >> 8, u18 = u1 >> 8;
#pragma unroll
    for (int s = 0; s < 8; ++s) {
      const int r0 = 2 * s, r1 = 2 * s + 1;  // both in word r0 >> 3
      const bool wi = r0 >= 8;
      const uint32_t a0 = k_frag(wi ? w1 : w0, wi ? w18 : w08, r0);
      const uint32_t a1 = k_frag(wi ? u1 : u0, wi ? u18 : u08, r0);
      const uint32_t a2 = k_frag(wi ? w1 : w0, wi ? w18 : w08, r1);
      const uint32_t a3 = k_frag(wi ? u1 : u0, wi ? u18 : u08, r1);
      mma16816(acc, a0, a1, a2, a3, qf[r0], qf[r1]);
    }
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float s_ = h2f(d.ks[mt][hf]);
      const float z_ = HAS_ZERO ? h2f(d.kz[mt][hf]) : -kctr * s_;
      const float a = s_ * 0.015625f;  // the 2^6 folded into q
#pragma unroll
      for (int e = 0; e < 2; ++e) sc[mt][2 * hf + e] = fmaf(acc[2 * hf + e] - off[e], a, z_ * qs[e]);
    }
  }
  if (masked) {
#pragma unroll
    for (int mt = 0; mt < 2; ++mt)
#pragma unroll
      for (int hf = 0; hf < 2; ++hf)
        if (tb + 16 * mt + gid + 8 * hf >= end) sc[mt][2 * hf] = sc[mt][2 * hf + 1] = -INFINITY;
  }
  float vsc[2][2], vzc[2][2];
#pragma unroll
  for (int mt = 0; mt < 2; ++mt)
#pragma unroll
    for (int hf = 0; hf < 2; ++hf) {
      const float s_ = h2f(d.vs[mt][hf]);
      const float z_ = HAS_ZERO ? h2f(d.vz[mt][hf]) : -vctr * s_;
      vsc[mt][hf] = s_;
      vzc[mt][hf] = fmaf(1.5f, s_, z_);  // the codes enter centred (c - 1.5)
    }
  uint32_t pp[2][2];
  softmax_block(st, sc, vsc, vzc, pp);
#pragma unroll
  for (int mt = 0; mt < 2; ++mt) pv_mid(st, d.vw[mt], trans8x8(pp[mt][0]), trans8x8(pp[mt][1]));
}

// Dense tiers: 16-token tiles of model-dtype K / V rows (stride st elements), tokens [0, n). qd: q in kd_dim order.
template <bool BF16>
__device__ __forceinline__ void dense_tier(State& st, const uint16_t* K, const uint16_t* V, long long skt, long long svt,
                                           int n, const uint32_t (&qd)[16], int warp, int nw, int gid, int tig) {
  const int nblk = (n + 31) / 32;
  for (int bi = warp; bi < nblk; bi += nw) {
    const int tb = bi * 32, last = n - 1;
    float sc[2][4];
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      uint4 kr[2][4];
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const int t = min(tb + 16 * mt + gid + 8 * hf, last);
#pragma unroll
        for (int ch = 0; ch < 4; ++ch)
          kr[hf][ch] = __ldg(reinterpret_cast<const uint4*>(K + t * skt + 8 * (tig + 4 * ch)));
      }
      float acc[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < 8; ++s) {
        const int r0 = 2 * s, r1 = 2 * s + 1;  // chunk r >> 2, pair r & 3
        const uint32_t* c0 = reinterpret_cast<const uint32_t*>(&kr[0][r0 >> 2]);
        const uint32_t* c1 = reinterpret_cast<const uint32_t*>(&kr[1][r0 >> 2]);
        mma16816(acc, dense_h2<BF16>(c0[r0 & 3]), dense_h2<BF16>(c1[r0 & 3]), dense_h2<BF16>(c0[r1 & 3]),
                 dense_h2<BF16>(c1[r1 & 3]), qd[r0], qd[r1]);
      }
#pragma unroll
      for (int hf = 0; hf < 2; ++hf) {
        const bool valid = tb + 16 * mt + gid + 8 * hf < n;
#pragma unroll
        for (int e = 0; e < 2; ++e) sc[mt][2 * hf + e] = valid ? acc[2 * hf + e] : -INFINITY;
      }
    }
    const float vsc[2][2] = {{1.f, 1.f}, {1.f, 1.f}}, vzc[2][2] = {{0.f, 0.f}, {0.f, 0.f}};
    uint32_t pp[2][2];
    softmax_block(st, sc, vsc, vzc, pp);
#pragma unroll
    for (int mt = 0; mt < 2; ++mt) {
      const uint32_t b0 = trans8x8(pp[mt][0]), b1 = trans8x8(pp[mt][1]);
      // the lane's 16 dims (chunks gid, gid + 8) of tokens 2tig, 2tig+1 (a) and 2tig+8, 2tig+9 (b)
      uint4 vr[4][2];
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int t = min(tb + 16 * mt + 2 * tig + (i & 1) + 8 * (i >> 1), last);
#pragma unroll
        for (int ch = 0; ch < 2; ++ch) vr[i][ch] = __ldg(reinterpret_cast<const uint4*>(V + t * svt + 8 * (gid + 8 * ch)));
      }
#pragma unroll
      for (int m = 0; m < 8; ++m) {
        uint32_t a[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
          const int c = 2 * m + (k & 1);  // rows gid / gid + 8
          const int pr = k >> 1;          // tokens (2tig, 2tig+1) or (2tig+8, 2tig+9)
          const int ch = c >> 3, el = c & 7;
          const uint32_t wa = reinterpret_cast<const uint32_t*>(&vr[2 * pr][ch])[el >> 1];
          const uint32_t wb = reinterpret_cast<const uint32_t*>(&vr[2 * pr + 1][ch])[el >> 1];
          const uint32_t both = __byte_perm(wa, wb, (el & 1) ? 0x7632 : 0x5410);
          a[k] = dense_h2<BF16>(both);
        }
        mma16816(st.o[m], a[0], a[1], a[2], a[3], b0, b1);
      }
    }
  }
}

// Merge the warps' states through shared memory and write the split's row of OP / LSE.
// ring: the kernel's shared bytes, warp w's part [w] (its ring, no longer in use) holding its rows: o [8][D], then
// m, l, lz [8] each.
template <int NW, int S>
__device__ __forceinline__ void merge_write(State& st, const Params& p, int b, int kvh, int split, int warp, int gid,
                                            int tig, bool dense, uint8_t (*ring)[S * sizeof(Stage)]) {
  auto so = [&](int w) { return reinterpret_cast<float(*)[D]>(ring[w]); };
  auto sm = [&](int w) { return reinterpret_cast<float*>(ring[w]) + 8 * D; };
  auto sl = [&](int w) { return reinterpret_cast<float*>(ring[w]) + 8 * D + 8; };
  auto slz = [&](int w) { return reinterpret_cast<float*>(ring[w]) + 8 * D + 16; };
#pragma unroll
  for (int e = 0; e < 2; ++e) {
    float l = st.l[e], lz = st.lz[e];
#pragma unroll
    for (int x = 4; x < 32; x <<= 1) {
      l += __shfl_xor_sync(0xffffffffu, l, x);
      lz += __shfl_xor_sync(0xffffffffu, lz, x);
    }
    if (gid == 0) {
      sm(warp)[2 * tig + e] = st.m[e];
      sl(warp)[2 * tig + e] = l;
      slz(warp)[2 * tig + e] = lz;
    }
  }
#pragma unroll
  for (int m = 0; m < 8; ++m)
#pragma unroll
    for (int rh = 0; rh < 2; ++rh) {
      const int c = 2 * m + rh;
      const int d = dense ? vd_dim(gid, c) : v_dim(gid, c);
      so(warp)[2 * tig][d] = st.o[m][2 * rh];
      so(warp)[2 * tig + 1][d] = st.o[m][2 * rh + 1];
    }
  __syncthreads();
  const int G = p.G, Hq = G * gridDim.y;
  for (int i = threadIdx.x; i < G * D; i += NW * 32) {
    const int h = i / D, d = i % D;
    float mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < NW; ++w) mx = fmaxf(mx, sm(w)[h]);
    const long long row = ((long long)b * Hq + kvh * G + h) * p.nsplit + split;
    if (mx == -INFINITY) {  // no token in this split
      p.op[row * D + d] = 0.f;
      if (d == 0) p.lse[row] = -INFINITY;
      continue;
    }
    float L = 0.f, num = 0.f;
#pragma unroll
    for (int w = 0; w < NW; ++w) {
      const float f = ex2(sm(w)[h] - mx);
      L = fmaf(f, sl(w)[h], L);
      num = fmaf(f, so(w)[h][d] + slz(w)[h], num);
    }
    p.op[row * D + d] = num / L;
    if (d == 0) p.lse[row] = mx + __log2f(L);
  }
}

// MINB: blocks per SM the register allocation must allow (__launch_bounds__' second argument; 1 = no cap).
template <int NW, int S, int MINB, bool HAS_ZERO, bool DENSE_BF16>
__global__ void __launch_bounds__(NW * 32, MINB) decode_int2_stage1(const Params p) {
  const int split = blockIdx.x, kvh = blockIdx.y, b = blockIdx.z;
  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, gid = lane >> 2, tig = lane & 3;
  const int G = p.G;
  const long long qrow = (long long)b * p.sqb + (long long)(kvh * G + min(gid, G - 1)) * p.sqh;
  const bool hval = gid < G;
  // each warp's ring of S stages; after the loop the same bytes hold the warps' partial outputs for the merge
  static_assert(S * sizeof(Stage) >= sizeof(float) * (8 * D + 24), "a warp's ring must hold its merge rows");
  __shared__ __align__(16) uint8_t ring[NW][S * sizeof(Stage)];
  Stage* stages = reinterpret_cast<Stage*>(ring[warp]);
  State st;
  state_init(st);

  if (split < p.nsm) {
    // ---- packed middle tier ----
    const int L = p.mid_len[b];
    const int start = split * p.split_tokens, end = min(start + p.split_tokens, L);
    // q in k_frag's dim order, times qk_scale * 2^(6 - 2j) (fp16); qs = sum_d q * qk_scale for the zero term
    uint32_t qf[16];
    float qpart = 0.f;
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float f = p.qk_scale * float(64 >> (2 * (r & 3)));
      const float lo = hval ? ld_q(p.q, p.q_bf16, qrow + k_dim(tig, r, 0)) : 0.f;
      const float hi = hval ? ld_q(p.q, p.q_bf16, qrow + k_dim(tig, r, 1)) : 0.f;
      qpart += lo + hi;
      qf[r] = pack_h2(lo * f, hi * f);
    }
    qpart += __shfl_xor_sync(0xffffffffu, qpart, 1);
    qpart += __shfl_xor_sync(0xffffffffu, qpart, 2);
    float qs[2], off[2];
    qs[0] = __shfl_sync(0xffffffffu, qpart, 8 * tig) * p.qk_scale;  // head 2*tig lives in lanes 4 * (2 tig) ..
    qs[1] = __shfl_sync(0xffffffffu, qpart, 8 * tig + 4) * p.qk_scale;
    {
      float c[4] = {0.f, 0.f, 0.f, 0.f};
#pragma unroll
      for (int s = 0; s < 8; ++s) mma16816(c, MAGIC, MAGIC, MAGIC, MAGIC, qf[2 * s], qf[2 * s + 1]);
      off[0] = c[0];
      off[1] = c[1];
    }
    const uint8_t* kc = p.kc + (long long)b * p.skb + (long long)kvh * p.skh;
    const uint8_t* vc = p.vc + (long long)b * p.svb + (long long)kvh * p.svh;
    const long long sko = (long long)b * p.sksb + (long long)kvh * p.sksh;
    const long long svo = (long long)b * p.svsb + (long long)kvh * p.svsh;
    const unsigned short *ks = p.ks + sko, *vs = p.vs + svo;
    const unsigned short *kz = HAS_ZERO ? p.kz + sko : nullptr, *vz = HAS_ZERO ? p.vz + svo : nullptr;
    const int nblk = end > start ? (end - start + 31) / 32 : 0;
    // blocks warp, warp + NW, ...; block i of this warp in stage i % S, S - 1 blocks in flight ahead of the math
#pragma unroll
    for (int i = 0; i < S - 1; ++i) {
      const int bi = warp + i * NW;
      if (bi < nblk) issue_stage<HAS_ZERO>(stages[i], kc, vc, ks, kz, vs, vz, start + 32 * bi, end, lane);
      cp_async_commit();
    }
    int it = 0;
    for (int bi = warp; bi < nblk; bi += NW, ++it) {
      const int nb = bi + (S - 1) * NW;
      if (nb < nblk) issue_stage<HAS_ZERO>(stages[(it + S - 1) % S], kc, vc, ks, kz, vs, vz, start + 32 * nb, end, lane);
      cp_async_commit();
      cp_async_wait<S - 1>();
      __syncwarp();
      MidData d;
      read_stage<HAS_ZERO>(d, stages[it % S], gid, tig);
      const int tb = start + 32 * bi;
      compute_mid<HAS_ZERO>(st, d, qf, off, qs, p.kctr, p.vctr, tb, end, tb + 32 > end, gid);
      __syncwarp();  // every lane has read the stage before the next iteration refills it
    }
    cp_async_wait<0>();
    __syncwarp();
    merge_write<NW, S>(st, p, b, kvh, split, warp, gid, tig, false, ring);
  } else {
    // ---- dense tiers (sink, recent) ----
    uint32_t qd[16];
#pragma unroll
    for (int r = 0; r < 16; ++r) {
      const float lo = hval ? ld_q(p.q, p.q_bf16, qrow + kd_dim(tig, r, 0)) : 0.f;
      const float hi = hval ? ld_q(p.q, p.q_bf16, qrow + kd_dim(tig, r, 1)) : 0.f;
      qd[r] = pack_h2(lo * p.qk_scale, hi * p.qk_scale);
    }
    if (p.sk != nullptr) {
      const int n = p.sink_len[b];
      dense_tier<DENSE_BF16>(st, p.sk + b * p.sskb + kvh * p.sskh, p.sv + b * p.ssvb + kvh * p.ssvh, p.sskt, p.ssvt, n,
                             qd, warp, NW, gid, tig);
    }
    if (p.rk != nullptr) {
      const int n = p.rec_len[b];
      dense_tier<DENSE_BF16>(st, p.rk + b * p.srkb + kvh * p.srkh, p.rv + b * p.srvb + kvh * p.srvh, p.srkt, p.srvt, n,
                             qd, warp, NW, gid, tig);
    }
    merge_write<NW, S>(st, p, b, kvh, split, warp, gid, tig, true, ring);
  }
}

template <int NW, int S, int MINB>
int launch_nw(const Params& p, int grid_x, int hkv, int B, cudaStream_t stream) {
  const dim3 grid(grid_x, hkv, B);
  const bool z = p.kz != nullptr;
  if (z && p.dense_bf16) decode_int2_stage1<NW, S, MINB, true, true><<<grid, NW * 32, 0, stream>>>(p);
  else if (z) decode_int2_stage1<NW, S, MINB, true, false><<<grid, NW * 32, 0, stream>>>(p);
  else if (p.dense_bf16) decode_int2_stage1<NW, S, MINB, false, true><<<grid, NW * 32, 0, stream>>>(p);
  else decode_int2_stage1<NW, S, MINB, false, false><<<grid, NW * 32, 0, stream>>>(p);
  return (int)cudaGetLastError();
}

template <int NW, int S, int MINB>
int occupancy_nw(bool z, bool bf16) {
  int n = 0;
  cudaError_t e;
  const int t = NW * 32;
  if (z && bf16) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_int2_stage1<NW, S, MINB, true, true>, t, 0);
  else if (z) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_int2_stage1<NW, S, MINB, true, false>, t, 0);
  else if (bf16) e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_int2_stage1<NW, S, MINB, false, true>, t, 0);
  else e = cudaOccupancyMaxActiveBlocksPerMultiprocessor(&n, decode_int2_stage1<NW, S, MINB, false, false>, t, 0);
  return e == cudaSuccess ? n : -(int)e;
}

// The (warps, stages, min blocks) instances in the library; -1 for one it does not have.
#ifdef LOWBIT_COMPILE_CHECK
#define LOWBIT_DECODE_SHAPES(X) X(4, 3, 1)
#else
#define LOWBIT_DECODE_SHAPES(X) X(2, 4, 1) X(4, 2, 1) X(4, 3, 1) X(4, 4, 1) X(4, 3, 3) X(4, 4, 3) X(4, 3, 4) X(8, 2, 2)
#endif

int launch_shape(const Params& p, int grid_x, int hkv, int B, cudaStream_t s, int nw, int ns, int minb) {
#define X(W, S, M) \
  if (nw == W && ns == S && minb == M) return launch_nw<W, S, M>(p, grid_x, hkv, B, s);
  LOWBIT_DECODE_SHAPES(X)
#undef X
  return -1;
}

int occupancy_shape(int nw, int ns, int minb, bool z, bool bf16) {
#define X(W, S, M) \
  if (nw == W && ns == S && minb == M) return occupancy_nw<W, S, M>(z, bf16);
  LOWBIT_DECODE_SHAPES(X)
#undef X
  return -1;
}

}  // namespace

extern "C" {

// Launch stage 1 on `stream`. Returns a cudaError_t (0 = launched; -1: no (nw, ns, minb) instance). grid = (nsm + dense, hkv, B).
int lowbit_decode_int2(const void* q, long long sqb, long long sqh, int q_bf16, const void* kc, long long skb,
                       long long skh, const void* ks, const void* kz, long long sksb, long long sksh, const void* vc,
                       long long svb, long long svh, const void* vs, const void* vz, long long svsb, long long svsh,
                       const int* mid_len, const void* sk, const void* sv, long long sskb, long long sskh,
                       long long sskt, long long ssvb, long long ssvh, long long ssvt, const int* sink_len,
                       const void* rk, const void* rv, long long srkb, long long srkh, long long srkt, long long srvb,
                       long long srvh, long long srvt, const int* rec_len, int dense_bf16, float* op, float* lse,
                       float qk_scale, float kctr, float vctr, int split_tokens, int nsm, int nsplit, int G, int hkv,
                       int B, int nw, int ns, int minb, unsigned long long stream) {
  Params p;
  p.q = q; p.sqb = sqb; p.sqh = sqh; p.q_bf16 = q_bf16;
  p.kc = static_cast<const uint8_t*>(kc); p.skb = skb; p.skh = skh;
  p.ks = static_cast<const unsigned short*>(ks); p.kz = static_cast<const unsigned short*>(kz);
  p.sksb = sksb; p.sksh = sksh;
  p.vc = static_cast<const uint8_t*>(vc); p.svb = svb; p.svh = svh;
  p.vs = static_cast<const unsigned short*>(vs); p.vz = static_cast<const unsigned short*>(vz);
  p.svsb = svsb; p.svsh = svsh;
  p.mid_len = mid_len;
  p.sk = static_cast<const uint16_t*>(sk); p.sv = static_cast<const uint16_t*>(sv);
  p.sskb = sskb; p.sskh = sskh; p.sskt = sskt; p.ssvb = ssvb; p.ssvh = ssvh; p.ssvt = ssvt; p.sink_len = sink_len;
  p.rk = static_cast<const uint16_t*>(rk); p.rv = static_cast<const uint16_t*>(rv);
  p.srkb = srkb; p.srkh = srkh; p.srkt = srkt; p.srvb = srvb; p.srvh = srvh; p.srvt = srvt; p.rec_len = rec_len;
  p.dense_bf16 = dense_bf16;
  p.op = op; p.lse = lse; p.qk_scale = qk_scale; p.kctr = kctr; p.vctr = vctr;
  p.split_tokens = split_tokens; p.nsm = nsm; p.nsplit = nsplit; p.G = G;
  const int grid_x = nsm + ((sk != nullptr || rk != nullptr) ? 1 : 0);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  return launch_shape(p, grid_x, hkv, B, s, nw, ns, minb);
}

// Blocks of stage 1 resident per SM (registers, shared memory), or -cudaError_t (-1: no (nw, ns, minb) instance).
int lowbit_decode_int2_occupancy(int nw, int ns, int minb, int has_zero, int dense_bf16) {
  return occupancy_shape(nw, ns, minb, has_zero != 0, dense_bf16 != 0);
}

const char* lowbit_decode_int2_error_string(int e) { return cudaGetErrorString(static_cast<cudaError_t>(e)); }

}  // extern "C"
