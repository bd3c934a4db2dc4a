// lowbit: 4-bit weight-only GEMM tiled over weight rows AND activation rows, for 17 <= M <= a few hundred (batched
// decode, prefill chunks) on tensor cores.
//
//   y[M, N] = x[M, K] @ W^T,  W[n, k] = (q[n, k] - zero[g, n]) * scale[g, n],  g = k / group
//
// Built by lowbit/kernels/weight_tiled.py with nvcc into a shared library (no torch headers), called through ctypes
// with raw device pointers on the caller's stream (capturable in a CUDA graph).
//
// Why a second kernel beside weight_small_m.cu: that one is a GEMV with activation "riders": every block stages the
// whole x range it needs and each warp owns 16-32 weight rows, so at M = 64 a block re-reads 16x more x than weight
// and each weight fragment's registers sit beside 8 activation tiles (166 registers, 1 block a SM; 0.40x bf16 at
// M = 64). Here a block owns BN = WN * RT * 16 weight rows x BM = WM * MTW * 8 activation rows and streams K in
// stages of 128 through a cp.async ring in shared memory (weights, x, scales, zero-points of one stage together),
// so x is read once per BN weight rows and nothing waits in registers.
//
// Weight layout: lowbit's PackedWeight as it is (compressed-tensors int32 words [N, K/8], nibble i of word j =
// q[n, 8j + i] + 8), so the M <= 16 kernels and this one read the same tensor. The mma fragments follow
// weight_small_m.cu: the weight is the mma's A operand (16 rows x 16 k), x the B operand (16 k x 8 activation rows);
// lane (gid, tig) takes words tig * LW .. tig * LW + LW - 1 of each 4 * LW-word chunk of rows gid and gid + 8, word j
// giving steps 2j (nibble pairs (0, 4) and (1, 5)) and 2j + 1 ((2, 6), (3, 7)); one lop3 puts two nibbles under the
// bf16 exponent of 128 and one bf16x2 subtract of 136 + zero gives q - zero exactly. The B fragment of a word is the
// 16 bytes of x at the same 8 k, permuted by four byte-permutes in registers (x is staged as it lies in memory; its
// shared-memory pieces are XOR-swizzled so a quarter-warp's 16-byte reads hit distinct banks). A chunk (4 lanes x LW
// words = 32 * LW k) lies in one group, so its fp32 partial is an exact integer-weight sum and the group scale
// multiplies it once per chunk and row.
//
// Split-K across blockIdx.z: fp32 partials to a workspace, and the last block of a tile (a counter it resets) sums
// them in a fixed order and writes y: no memset, no second launch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

// The small helpers below (Params' kinds, PDL, cp.async, scalar load/store, nib_pair, launch_kernel) repeat
// weight_small_m.cu's on purpose: lowbit.kernels.nvcc builds each library from one source file and keys its cache
// (and the libraries carried to the device) on that file's bytes alone, so a shared header would change a kernel
// without changing its cache key.
namespace {

enum { KIND_BF16 = 0, KIND_FP16 = 1, KIND_FP32 = 2 };
constexpr int KS = 128;  // k per pipeline stage

struct Params {
  const __nv_bfloat16* x;  // [M, ldx] bf16, 16-byte aligned rows
  long long ldx;
  const uint32_t* qw;      // [N, K/8] words
  const void* scale;       // [G, N] bf16 / fp16
  const int8_t* zero;      // [G, N] or null
  const void* bias;        // [N] or null
  void* y;                 // [M, ldy]
  long long ldy;
  float* ws;               // split-K partials [splitk, M, N] (splitk > 1)
  unsigned* counters;      // one per (row block, activation block), zero between launches (splitk > 1)
  int M, N, K, group;
  int stages_per_split;    // 128-k stages per blockIdx.z
  int splitk;              // gridDim.z
  int scale_kind, bias_kind, out_kind;
  int pdl;
  int l2p;                 // L2 prefetch size of the weight copies: 0, 128 or 256 bytes
};

__device__ __forceinline__ void pdl_launch_dependents() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
}
__device__ __forceinline__ void pdl_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
  asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}
__device__ __forceinline__ void prefetch_l2(const void* ptr) { asm volatile("prefetch.global.L2 [%0];" ::"l"(ptr)); }

// 16 bytes global -> shared, bypassing L1; src_bytes 0 fills zeros (rows past N or M). L2P: the L2 prefetch size
// of the copy (0: none, 128 or 256 bytes): a stage reads 64 bytes of each weight row, rows K / 2 bytes apart, so
// without it every stage opens each row's DRAM page for 64 bytes.
template <int L2P = 0>
__device__ __forceinline__ void cp_async16(void* smem, const void* gmem, int src_bytes) {
  const unsigned s = static_cast<unsigned>(__cvta_generic_to_shared(smem));
  if constexpr (L2P == 256)
    asm volatile("cp.async.cg.shared.global.L2::256B [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
  else if constexpr (L2P == 128)
    asm volatile("cp.async.cg.shared.global.L2::128B [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
  else
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;" ::"r"(s), "l"(gmem), "r"(src_bytes) : "memory");
}
__device__ __forceinline__ void cp_async_commit() { asm volatile("cp.async.commit_group;" ::: "memory"); }
template <int N>
__device__ __forceinline__ void cp_async_wait() { asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory"); }

__device__ __forceinline__ float ld_scalar(const void* p, int kind, long long i) {
  if (kind == KIND_BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  if (kind == KIND_FP16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

__device__ __forceinline__ float half_bits_to_float(unsigned short r, int kind) {
  if (kind == KIND_BF16) return __uint_as_float(static_cast<uint32_t>(r) << 16);
  return __half2float(__ushort_as_half(r));
}

__device__ __forceinline__ void st_out(void* y, int kind, long long i, float v) {
  if (kind == KIND_BF16) reinterpret_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
  else if (kind == KIND_FP16) reinterpret_cast<__half*>(y)[i] = __float2half_rn(v);
  else reinterpret_cast<float*>(y)[i] = v;
}

// Nibbles at bits 0-3 and 16-19 of w -> bf16x2 (128 + c_lo, 128 + c_hi): (w & 0x000F000F) | 0x43004300.
__device__ __forceinline__ uint32_t nib_pair(uint32_t w) {
  uint32_t r;
  asm("lop3.b32 %0, %1, %2, %3, 0xEA;" : "=r"(r) : "r"(w), "n"(0x000F000F), "n"(0x43004300));
  return r;
}

__device__ __forceinline__ uint32_t bf16x2_sub(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hsub2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t bf16x2_mul(uint32_t a, uint32_t b) {
  __nv_bfloat162 r = __hmul2(*reinterpret_cast<__nv_bfloat162*>(&a), *reinterpret_cast<__nv_bfloat162*>(&b));
  return *reinterpret_cast<uint32_t*>(&r);
}

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);
  return *reinterpret_cast<uint32_t*>(&r);
}

// D = A (16x16, row) * B (16x8, col) + D, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm volatile(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Split-K: every block has written its fp32 partial of the tile to p.ws; the last split of the tile to arrive sums
// every split in a fixed order (the result does not depend on which block finished last) and resets the counter for
// the next launch on this stream.
template <int BN, int BM, int NT>
__device__ __forceinline__ void finish_split_k(const Params& p, int n_block, int m_block, int& last_block) {
  const int tid = threadIdx.x;
  __threadfence();
  __syncthreads();
  const int tile = blockIdx.y * gridDim.x + blockIdx.x;
  if (tid == 0) last_block = atomicAdd(&p.counters[tile], 1u) == (unsigned)(p.splitk - 1);
  __syncthreads();
  if (!last_block) return;
  __threadfence();
  for (int idx = tid; idx < BM * BN; idx += NT) {
    const int mi = idx / BN, n = n_block + idx - mi * BN, m = m_block + mi;
    if (n >= p.N || m >= p.M) continue;
    float v = 0.f;
    for (int ks = 0; ks < p.splitk; ++ks) v += __ldcg(&p.ws[((long long)ks * p.M + m) * p.N + n]);
    if (p.bias) v += ld_scalar(p.bias, p.bias_kind, n);
    st_out(p.y, p.out_kind, (long long)m * p.ldy + n, v);
  }
  if (tid == 0) p.counters[tile] = 0u;
}

// The permuted x of a stage: [hs][row][16 units of 8 bytes], unit = the (b0, b1) of one piece (8 k) for the even (hs 0:
// (k0, k4), (k1, k5)) or odd (hs 1: (k2, k6), (k3, k7)) mma step. A half-warp's 8-byte reads (rows gid 0..3, pieces
// tig * LW + j) hit 16 distinct units of a 128-byte row when the unit index is XORed with the row's low bits on the
// bits tig does not use (LW 4: bits 0-1; LW 2: bits 0 and 3).
template <int LW>
__device__ __forceinline__ int x_unit(int r, int pc) {
  if constexpr (LW == 4) return pc ^ (r & 3);
  else return pc ^ ((r & 1) | ((r & 2) << 2));
}

// Bytes of one ring stage: weights BN x 64, x as copied BM x 256, scales (128 / CK) x BN x 2, zero-points (128 / CK) x
// BN; after the ring, two buffers of permuted x (BM x 256 each).
template <int LW, bool ZP, int BN, int BM>
struct Stage {
  static constexpr int CPS = KS / (32 * LW);  // chunks per stage
  static constexpr int W = 0;
  static constexpr int X = BN * 64;
  static constexpr int S = X + BM * 256;
  static constexpr int Z = S + CPS * BN * 2;
  static constexpr int BYTES = Z + (ZP ? CPS * BN : 0);
  static constexpr int XP = BM * 256;  // one permuted buffer
};

// LW: words per lane per row and chunk (4, 2: group 128+ / 64). WN x WM warps: WN along weight rows, WM along
// activation rows; each warp RT tiles of 16 weight rows x MTW tiles of 8 activation rows. STAGES: the ring depth.
// FOLD: the A fragment is bf16((q - zero) * scale) (one bf16x2 multiply by a bf16 scale, rounded once: the weight
// dequantize + cuBLAS multiplies), accumulated straight into the output tile: no per-chunk fp32 partials, so half the
// accumulator registers and no per-chunk scale pass; without it the integer-weight partials are exact and the scale
// is applied in fp32 per chunk.
//
// x is copied as it lies (cp.async) and permuted into mma-fragment order once per stage by the threads that copied
// it (each its own pieces, after its own cp.async.wait: no extra barrier), into one of two buffers that the next
// iteration's barrier publishes. s23 call 4 (ncu): with the byte-permutes in every warp's B path the kernel issued
// ~10-15 instructions an mma, ALU-bound at ~0.16 mma a cycle per SM.
template <int LW, bool ZP, int WN, int WM, int RT, int MTW, int STAGES, bool FOLD>
__global__ void __launch_bounds__(WN * WM * 32, 512 / (WN * WM * 32)) wq_tiled(const Params p) {
  constexpr int BN = WN * RT * 16, BM = WM * MTW * 8, NT = WN * WM * 32;
  constexpr int CK = 32 * LW;  // k per chunk (one group)
  using St = Stage<LW, ZP, BN, BM>;
  constexpr int CPS = St::CPS;
  extern __shared__ __align__(16) unsigned char smem[];
  unsigned char* xperm = smem + STAGES * St::BYTES;
  __shared__ int last_block;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int warp_n = warp % WN, warp_m = warp / WN;
  const int n_block = blockIdx.x * BN, m_block = blockIdx.y * BM;
  const int wpr = p.K / 8;
  const int st_begin = blockIdx.z * p.stages_per_split;
  const int nst = min(p.K / KS - st_begin, p.stages_per_split);
  // Blocks start their K walk at different stages (and wrap around), so the requests in flight do not all share
  // their low address bits (rows are K / 2 bytes apart).
  const int rot = nst > 0 ? (int)((blockIdx.x + 5u * blockIdx.y) % (unsigned)nst) : 0;

  // one stage's copies: every thread a fixed set of 16-byte pieces (the permute pass below takes the same x pieces)
  auto load = [&](int buf, int st) {
    unsigned char* base = smem + buf * St::BYTES;
    const int k0 = (st_begin + (st + rot) % nst) * KS;
    for (int i = tid; i < BN * 4; i += NT) {  // weight rows: 64 bytes = 4 pieces each
      const int r = i >> 2, pc = i & 3, n = n_block + r;
      const uint32_t* src = p.qw + (long long)min(n, p.N - 1) * wpr + k0 / 8 + pc * 4;
      if (p.l2p == 256) cp_async16<256>(base + St::W + r * 64 + pc * 16, src, n < p.N ? 16 : 0);
      else if (p.l2p == 128) cp_async16<128>(base + St::W + r * 64 + pc * 16, src, n < p.N ? 16 : 0);
      else cp_async16(base + St::W + r * 64 + pc * 16, src, n < p.N ? 16 : 0);
    }
    for (int i = tid; i < BM * 16; i += NT) {  // activation rows: 256 bytes = 16 pieces each, as in memory
      const int r = i >> 4, pc = i & 15, m = m_block + r;
      const __nv_bfloat16* src = p.x + (long long)min(m, p.M - 1) * p.ldx + k0 + pc * 8;
      cp_async16(base + St::X + i * 16, src, m < p.M ? 16 : 0);
    }
    for (int i = tid; i < CPS * BN / 8; i += NT) {  // scales: 8 rows a piece (N % 16 == 0)
      const int c = i / (BN / 8), q = i - c * (BN / 8), n = n_block + q * 8;
      const long long g = (k0 + c * CK) / p.group;
      const unsigned short* src = reinterpret_cast<const unsigned short*>(p.scale) + g * p.N + min(n, p.N - 8);
      cp_async16(base + St::S + (c * BN + q * 8) * 2, src, n < p.N ? 16 : 0);
    }
    if constexpr (ZP) {
      for (int i = tid; i < CPS * BN / 16; i += NT) {
        const int c = i / (BN / 16), q = i - c * (BN / 16), n = n_block + q * 16;
        const long long g = (k0 + c * CK) / p.group;
        cp_async16(base + St::Z + c * BN + q * 16, p.zero + g * p.N + min(n, p.N - 16), n < p.N ? 16 : 0);
      }
    }
  };
  // this thread's copied x pieces of ring slot `buf` -> permuted buffer `pb` (after this thread's cp.async.wait)
  auto permute = [&](int buf, int pb) {
    const unsigned char* raw = smem + buf * St::BYTES + St::X;
    unsigned char* dst = xperm + pb * St::XP;
    for (int i = tid; i < BM * 16; i += NT) {
      const int r = i >> 4, pc = i & 15, u = x_unit<LW>(r, pc);
      const uint4 v = *reinterpret_cast<const uint4*>(raw + i * 16);
      *reinterpret_cast<uint2*>(dst + (r * 16 + u) * 8) =
          make_uint2(__byte_perm(v.x, v.z, 0x5410), __byte_perm(v.x, v.z, 0x7632));
      *reinterpret_cast<uint2*>(dst + BM * 128 + (r * 16 + u) * 8) =
          make_uint2(__byte_perm(v.y, v.w, 0x5410), __byte_perm(v.y, v.w, 0x7632));
    }
  };

  pdl_launch_dependents();
  // the weights are never written by an earlier kernel: warm L2 with this block's first stages before the wait
  for (int st = 0; st < STAGES - 1 && st < nst; ++st)
    for (int r = tid; r < BN; r += NT)  // a row's 64 bytes of one stage lie in one 128-byte line
      prefetch_l2(p.qw + (long long)min(n_block + r, p.N - 1) * wpr + (st_begin + (st + rot) % nst) * KS / 8);
  pdl_wait();

#pragma unroll
  for (int s = 0; s < STAGES - 1; ++s) {
    if (s < nst) load(s, s);
    cp_async_commit();
  }
  if (nst > 0) {
    cp_async_wait<STAGES - 2>();
    permute(0, 0);
  }

  float acc[RT][MTW][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int t = 0; t < MTW; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.f;

  const int row0 = warp_n * RT * 16 + gid;  // this lane's first weight row in the block (and + 8, + 16, ...)
  // this lane's activation rows xrow0 + 8 t share their low bits (gid), so one XOR key for every tile
  const int xrow0 = warp_m * MTW * 8 + gid;
  const int key = x_unit<LW>(xrow0, 0);

  for (int st = 0; st < nst; ++st) {
    __syncthreads();  // stage st's permuted x is complete; every warp is done with stage st - 1's buffers
    if (st + STAGES - 1 < nst) load((st + STAGES - 1) % STAGES, st + STAGES - 1);
    cp_async_commit();

    const unsigned char* base = smem + (st % STAGES) * St::BYTES;  // holds stage (st + rot) % nst of the split
    const unsigned char* xp = xperm + (st & 1) * St::XP + xrow0 * 128;
#pragma unroll
    for (int c = 0; c < CPS; ++c) {
      uint32_t sub2[RT][2];  // bf16x2 (136 + zero) of the lane's rows
      uint32_t sc2[RT][2];   // FOLD: bf16x2 (scale, scale)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          float z = 0.f;
          if constexpr (ZP) z = (float)reinterpret_cast<const int8_t*>(base + St::Z)[c * BN + row0 + rt * 16 + 8 * h];
          sub2[rt][h] = pack_bf16x2(136.f + z, 136.f + z);
          if constexpr (FOLD) {
            const uint32_t r = reinterpret_cast<const unsigned short*>(base + St::S)[c * BN + row0 + rt * 16 + 8 * h];
            sc2[rt][h] = r | (r << 16);
          }
        }
      // this chunk's words of the lane's rows: LW consecutive words at (c * 4 + tig) * LW
      uint32_t w[RT][2][LW];
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const uint32_t* src =
              reinterpret_cast<const uint32_t*>(base + St::W + (row0 + rt * 16 + 8 * h) * 64) + (c * 4 + tig) * LW;
          if constexpr (LW == 4) {
            const uint4 v = *reinterpret_cast<const uint4*>(src);
            w[rt][h][0] = v.x; w[rt][h][1] = v.y; w[rt][h][2] = v.z; w[rt][h][3] = v.w;
          } else {
            const uint2 v = *reinterpret_cast<const uint2*>(src);
            w[rt][h][0] = v.x; w[rt][h][1] = v.y;
          }
        }
      float part[FOLD ? 1 : RT][FOLD ? 1 : MTW][4];
      if constexpr (!FOLD) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int t = 0; t < MTW; ++t)
#pragma unroll
            for (int i = 0; i < 4; ++i) part[rt][t][i] = 0.f;
      }
#pragma unroll
      for (int j = 0; j < LW; ++j) {
        const int u = ((c * 4 + tig) * LW + j) ^ key;  // this lane's unit of word j
#pragma unroll
        for (int hs = 0; hs < 2; ++hs) {
          uint2 b[MTW];  // the B fragments of step 2j + hs, one per activation tile
#pragma unroll
          for (int t = 0; t < MTW; ++t) b[t] = *reinterpret_cast<const uint2*>(xp + hs * BM * 128 + t * 8 * 128 + u * 8);
#pragma unroll
          for (int rt = 0; rt < RT; ++rt) {
            const uint32_t wa = w[rt][0][j], wb = w[rt][1][j];
            uint32_t a[4];
            a[0] = bf16x2_sub(nib_pair(wa >> (8 * hs)), sub2[rt][0]);
            a[1] = bf16x2_sub(nib_pair(wb >> (8 * hs)), sub2[rt][1]);
            a[2] = bf16x2_sub(nib_pair(wa >> (8 * hs + 4)), sub2[rt][0]);
            a[3] = bf16x2_sub(nib_pair(wb >> (8 * hs + 4)), sub2[rt][1]);
            if constexpr (FOLD) {
              a[0] = bf16x2_mul(a[0], sc2[rt][0]);
              a[1] = bf16x2_mul(a[1], sc2[rt][1]);
              a[2] = bf16x2_mul(a[2], sc2[rt][0]);
              a[3] = bf16x2_mul(a[3], sc2[rt][1]);
            }
#pragma unroll
            for (int t = 0; t < MTW; ++t) {
              if constexpr (FOLD) mma_bf16(acc[rt][t], a, b[t].x, b[t].y);
              else mma_bf16(part[rt][t], a, b[t].x, b[t].y);
            }
          }
        }
      }
      if constexpr (!FOLD) {
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          float sc[2];  // read here, not held through the mma loop
#pragma unroll
          for (int h = 0; h < 2; ++h)
            sc[h] = half_bits_to_float(
                reinterpret_cast<const unsigned short*>(base + St::S)[c * BN + row0 + rt * 16 + 8 * h], p.scale_kind);
#pragma unroll
          for (int t = 0; t < MTW; ++t) {
            acc[rt][t][0] += part[rt][t][0] * sc[0];
            acc[rt][t][1] += part[rt][t][1] * sc[0];
            acc[rt][t][2] += part[rt][t][2] * sc[1];
            acc[rt][t][3] += part[rt][t][3] * sc[1];
          }
        }
      }
    }
    if (st + 1 < nst) {  // stage st + 1's copies of this thread have landed: permute them for the next iteration
      cp_async_wait<STAGES - 2>();
      permute((st + 1) % STAGES, (st + 1) & 1);
    }
  }
  cp_async_wait<0>();

  // C fragment: acc[rt][t][i] is (weight row row0 + 16 rt + 8 (i >= 2), activation row xrow0 - gid + 8 t + 2 tig + (i & 1))
  if (p.splitk == 1) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int t = 0; t < MTW; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int n = n_block + row0 + rt * 16 + 8 * (i >> 1);
          const int m = m_block + warp_m * MTW * 8 + 8 * t + 2 * tig + (i & 1);
          if (n < p.N && m < p.M) {
            const float b = p.bias ? ld_scalar(p.bias, p.bias_kind, n) : 0.f;
            st_out(p.y, p.out_kind, (long long)m * p.ldy + n, acc[rt][t][i] + b);
          }
        }
    return;
  }
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int t = 0; t < MTW; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = n_block + row0 + rt * 16 + 8 * (i >> 1);
        const int m = m_block + warp_m * MTW * 8 + 8 * t + 2 * tig + (i & 1);
        if (n < p.N && m < p.M) p.ws[((long long)blockIdx.z * p.M + m) * p.N + n] = acc[rt][t][i];
      }
  finish_split_k<BN, BM, NT>(p, n_block, m_block, last_block);
}

// ---- Hopper (sm_90a): the folded product on wgmma ----
//
// s23 (NOTES round 21, ncu): above M ~ 32 the mma.sync kernel above is bound by instruction issue (10-15 warp
// instructions an mma: the B fragments' shared-memory reads and the per-warp dequantize), not by the weight stream.
// Here a warpgroup (4 warps) multiplies 64 weight rows by all BM activation rows in one wgmma m64nBMk16: the
// dequantized weight is the register A operand (each warp's 16 rows in the mma.sync A layout) and x is read by the
// tensor cores straight from shared memory through a descriptor, once per warpgroup, with no permute: cp.async puts
// each 16-byte piece of x (8 consecutive k of one activation row) where the B operand's no-swizzle K-major core
// matrices expect it, so the mma's k order is memory order and the lane (gid, tig) takes nibbles 2 tig, 2 tig + 1
// (byte tig) of words 2s and 2s + 1 of its rows at step s (one byte-permute puts a byte's two nibbles under the bf16
// exponent of 128, one lop3 masks them). Always folded: A = bf16((q - zero) * scale) per 64-k chunk's group, the
// numerics of dequantize + cuBLAS. Operand layouts and the descriptor's (LBO, SBO) reading: benchmarks/probes/
// wgmma_rs_layout.cu (s22, H200).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ == 900 && defined(__CUDA_ARCH_FEAT_SM90_ALL)
#define LOWBIT_SM90_WGMMA 1
#endif

__device__ __forceinline__ void wg_fence() {
#ifdef LOWBIT_SM90_WGMMA
  asm volatile("wgmma.fence.sync.aligned;" ::: "memory");
#endif
}
__device__ __forceinline__ void wg_commit() {
#ifdef LOWBIT_SM90_WGMMA
  asm volatile("wgmma.commit_group.sync.aligned;" ::: "memory");
#endif
}
template <int N>
__device__ __forceinline__ void wg_wait() {
#ifdef LOWBIT_SM90_WGMMA
  asm volatile("wgmma.wait_group.sync.aligned %0;" ::"n"(N) : "memory");
#endif
}
// cp.async writes shared memory through the generic proxy, wgmma reads it through the async proxy
__device__ __forceinline__ void fence_async_smem() {
#ifdef LOWBIT_SM90_WGMMA
  asm volatile("fence.proxy.async.shared::cta;" ::: "memory");
#endif
}
// keeps the compiler from moving accumulators that an in-flight wgmma owns
template <int N>
__device__ __forceinline__ void fence_acc(float (&d)[N]) {
#pragma unroll
  for (int i = 0; i < N; ++i) asm volatile("" : "+f"(d[i])::"memory");
}

// no-swizzle K-major B descriptor: core matrix (n block, k block) at start + n * 2048 + k * 128 (LBO 128, SBO 2048)
__device__ __forceinline__ uint64_t b_desc(uint32_t smem_addr) {
  return static_cast<uint64_t>((smem_addr & 0x3FFFF) >> 4) | (static_cast<uint64_t>(128 >> 4) << 16) |
         (static_cast<uint64_t>(2048 >> 4) << 32);
}

__device__ __forceinline__ void wgmma_n64(float (&d)[32], const uint32_t (&a)[4], uint64_t desc) {
#ifdef LOWBIT_SM90_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %37, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n64k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31"
      "}, {%32,%33,%34,%35}, %36, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#endif
}
__device__ __forceinline__ void wgmma_n128(float (&d)[64], const uint32_t (&a)[4], uint64_t desc) {
#ifdef LOWBIT_SM90_WGMMA
  asm volatile(
      "{\n.reg .pred p;\nsetp.ne.b32 p, %69, 0;\n"
      "wgmma.mma_async.sync.aligned.m64n128k16.f32.bf16.bf16 {"
      "%0,%1,%2,%3,%4,%5,%6,%7,%8,%9,%10,%11,%12,%13,%14,%15,"
      "%16,%17,%18,%19,%20,%21,%22,%23,%24,%25,%26,%27,%28,%29,%30,%31,"
      "%32,%33,%34,%35,%36,%37,%38,%39,%40,%41,%42,%43,%44,%45,%46,%47,"
      "%48,%49,%50,%51,%52,%53,%54,%55,%56,%57,%58,%59,%60,%61,%62,%63"
      "}, {%64,%65,%66,%67}, %68, p, 1, 1, 0;\n}\n"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3]), "+f"(d[4]), "+f"(d[5]), "+f"(d[6]), "+f"(d[7]),
        "+f"(d[8]), "+f"(d[9]), "+f"(d[10]), "+f"(d[11]), "+f"(d[12]), "+f"(d[13]), "+f"(d[14]), "+f"(d[15]),
        "+f"(d[16]), "+f"(d[17]), "+f"(d[18]), "+f"(d[19]), "+f"(d[20]), "+f"(d[21]), "+f"(d[22]), "+f"(d[23]),
        "+f"(d[24]), "+f"(d[25]), "+f"(d[26]), "+f"(d[27]), "+f"(d[28]), "+f"(d[29]), "+f"(d[30]), "+f"(d[31]),
        "+f"(d[32]), "+f"(d[33]), "+f"(d[34]), "+f"(d[35]), "+f"(d[36]), "+f"(d[37]), "+f"(d[38]), "+f"(d[39]),
        "+f"(d[40]), "+f"(d[41]), "+f"(d[42]), "+f"(d[43]), "+f"(d[44]), "+f"(d[45]), "+f"(d[46]), "+f"(d[47]),
        "+f"(d[48]), "+f"(d[49]), "+f"(d[50]), "+f"(d[51]), "+f"(d[52]), "+f"(d[53]), "+f"(d[54]), "+f"(d[55]),
        "+f"(d[56]), "+f"(d[57]), "+f"(d[58]), "+f"(d[59]), "+f"(d[60]), "+f"(d[61]), "+f"(d[62]), "+f"(d[63])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "l"(desc), "r"(1));
#endif
}

template <int BM>
__device__ __forceinline__ void wgmma_bm(float (&d)[BM / 2], const uint32_t (&a)[4], uint64_t desc) {
  if constexpr (BM == 64) wgmma_n64(d, a, desc);
  else wgmma_n128(d, a, desc);
}

// Byte b of w -> bf16x2 (128 + low nibble, 128 + high nibble); sel = b | (4 + b) << 8.
__device__ __forceinline__ uint32_t byte_nibbles(uint32_t w, uint32_t sel) { return nib_pair(__byte_perm(w, w >> 4, sel)); }

// One ring stage: weights BN x 64 bytes (16-byte pieces XOR-swizzled by row bits 1-2, so the 8 rows a warp reads
// at once hit 8 distinct bank groups), x as B core matrices [BM / 8][16 k blocks][8 rows][16 bytes], scales and
// zero-points of the stage's two 64-k chunks.
template <bool ZP, int BN, int BM>
struct WgStage {
  static constexpr int W = 0;
  static constexpr int X = BN * 64;
  static constexpr int S = X + BM * 256;
  static constexpr int Z = S + 2 * BN * 2;
  static constexpr int BYTES = Z + (ZP ? 2 * BN : 0);
};

// NWG warpgroups, each RT m64 tiles of weight rows (BN = 64 * NWG * RT) x BM activation rows; a ring of STAGES, of
// which STAGES - 2 are in flight ahead: a slot is refilled two stages after its wgmmas were issued, and each step
// leaves at most WD (<= 8, one stage of steps) wgmma groups in flight behind it, so the refill never races a read.
// WD: s24 call 1 measured WD 1 at ~600 cycles a k16 step whatever M (NOTES round 22): with WD groups in flight the
// dequantize of a step waits only for the wgmma WD + 1 steps back.
template <bool ZP, int NWG, int RT, int BM, int STAGES, int WD>
__global__ void __launch_bounds__(NWG * 128, 1) wq_wgmma(const Params p) {
#ifdef LOWBIT_SM90_WGMMA
  constexpr int BN = NWG * RT * 64, NT = NWG * 128, D = STAGES - 2;
  static_assert(D >= 1 && (BM == 64 || BM == 128) && WD >= 1 && WD <= 8, "wgmma instance");
  using St = WgStage<ZP, BN, BM>;
  extern __shared__ __align__(128) unsigned char smem[];
  __shared__ int last_block;

  const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int n_block = blockIdx.x * BN, m_block = blockIdx.y * BM;
  const int wpr = p.K / 8;
  const int st_begin = blockIdx.z * p.stages_per_split;
  const int nst = min(p.K / KS - st_begin, p.stages_per_split);
  const int rot = nst > 0 ? (int)((blockIdx.x + 5u * blockIdx.y) % (unsigned)nst) : 0;

  auto load = [&](int buf, int st) {
    unsigned char* base = smem + buf * St::BYTES;
    const int k0 = (st_begin + (st + rot) % nst) * KS;
    for (int i = tid; i < BN * 4; i += NT) {
      const int r = i >> 2, pc = i & 3, n = n_block + r;
      const uint32_t* src = p.qw + (long long)min(n, p.N - 1) * wpr + k0 / 8 + pc * 4;
      unsigned char* dst = base + St::W + r * 64 + ((pc ^ ((r >> 1) & 3)) << 4);
      if (p.l2p == 256) cp_async16<256>(dst, src, n < p.N ? 16 : 0);
      else if (p.l2p == 128) cp_async16<128>(dst, src, n < p.N ? 16 : 0);
      else cp_async16(dst, src, n < p.N ? 16 : 0);
    }
    for (int i = tid; i < BM * 16; i += NT) {
      const int r = i >> 4, kb = i & 15, m = m_block + r;
      const __nv_bfloat16* src = p.x + (long long)min(m, p.M - 1) * p.ldx + k0 + kb * 8;
      cp_async16(base + St::X + (r >> 3) * 2048 + kb * 128 + (r & 7) * 16, src, m < p.M ? 16 : 0);
    }
    for (int i = tid; i < 2 * BN / 8; i += NT) {
      const int ch = i / (BN / 8), q = i - ch * (BN / 8), n = n_block + q * 8;
      const long long g = (k0 + ch * 64) / p.group;
      const unsigned short* src = reinterpret_cast<const unsigned short*>(p.scale) + g * p.N + min(n, p.N - 8);
      cp_async16(base + St::S + (ch * BN + q * 8) * 2, src, n < p.N ? 16 : 0);
    }
    if constexpr (ZP) {
      for (int i = tid; i < 2 * BN / 16; i += NT) {
        const int ch = i / (BN / 16), q = i - ch * (BN / 16), n = n_block + q * 16;
        const long long g = (k0 + ch * 64) / p.group;
        cp_async16(base + St::Z + ch * BN + q * 16, p.zero + g * p.N + min(n, p.N - 16), n < p.N ? 16 : 0);
      }
    }
  };

  pdl_launch_dependents();
  for (int st = 0; st < D && st < nst; ++st)
    for (int r = tid; r < BN; r += NT)
      prefetch_l2(p.qw + (long long)min(n_block + r, p.N - 1) * wpr + (st_begin + (st + rot) % nst) * KS / 8);
  pdl_wait();

#pragma unroll
  for (int s = 0; s < D; ++s) {
    if (s < nst) load(s, s);
    cp_async_commit();
  }

  float acc[RT][BM / 2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int i = 0; i < BM / 2; ++i) acc[rt][i] = 0.f;

  const int row0 = (warp >> 2) * RT * 64 + (warp & 3) * 16 + gid;  // + 64 rt, + 8 h
  const int key = (gid >> 1) & 3;                                  // the swizzle of every row the lane reads
  const uint32_t sel = tig | ((4 + tig) << 8);
  const uint32_t smem0 = static_cast<uint32_t>(__cvta_generic_to_shared(smem));

  for (int st = 0; st < nst; ++st) {
    cp_async_wait<D - 1>();  // this thread's copies of stage st have landed
    fence_async_smem();
    __syncthreads();  // every thread's copies; every warpgroup is past stage st - 2's wgmmas
    if (st + D < nst) load((st + D) % STAGES, st + D);
    cp_async_commit();

    const int slot = st % STAGES;
    const unsigned char* base = smem + slot * St::BYTES;
    const uint32_t xs = smem0 + slot * St::BYTES + St::X;
#pragma unroll
    for (int ch = 0; ch < 2; ++ch) {
      uint32_t sub2[RT][2], sc2[RT][2];  // bf16x2 (136 + zero), (scale, scale) of the lane's rows in chunk ch
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) {
          const int r = row0 + rt * 64 + 8 * h;
          float z = 0.f;
          if constexpr (ZP) z = (float)reinterpret_cast<const int8_t*>(base + St::Z)[ch * BN + r];
          sub2[rt][h] = pack_bf16x2(136.f + z, 136.f + z);
          const uint32_t sr = reinterpret_cast<const unsigned short*>(base + St::S)[ch * BN + r];
          sc2[rt][h] = sr | (sr << 16);
        }
#pragma unroll
      for (int s4 = 0; s4 < 4; ++s4) {
        const int s = ch * 4 + s4;  // k16 step of the stage: words 2s, 2s + 1 of every row
        uint32_t a[RT][4];
#pragma unroll
        for (int rt = 0; rt < RT; ++rt)
#pragma unroll
          for (int h = 0; h < 2; ++h) {
            const uint2 w = *reinterpret_cast<const uint2*>(base + St::W + (row0 + rt * 64 + 8 * h) * 64 +
                                                            (((s >> 1) ^ key) << 4) + (s & 1) * 8);
            a[rt][h] = bf16x2_mul(bf16x2_sub(byte_nibbles(w.x, sel), sub2[rt][h]), sc2[rt][h]);
            a[rt][2 + h] = bf16x2_mul(bf16x2_sub(byte_nibbles(w.y, sel), sub2[rt][h]), sc2[rt][h]);
          }
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) fence_acc(acc[rt]);
        wg_fence();
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) wgmma_bm<BM>(acc[rt], a[rt], b_desc(xs + s * 256));
        wg_commit();
        wg_wait<WD>();
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) fence_acc(acc[rt]);
      }
    }
  }
  wg_wait<0>();
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) fence_acc(acc[rt]);
  cp_async_wait<0>();

  // D fragment: acc[rt][4j + e] is (weight row row0 + 64 rt + 8 (e >= 2), activation row 8j + 2 tig + (e & 1))
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int j = 0; j < BM / 8; ++j)
#pragma unroll
      for (int e = 0; e < 4; ++e) {
        const int n = n_block + row0 + rt * 64 + 8 * (e >> 1);
        const int m = m_block + 8 * j + 2 * tig + (e & 1);
        if (n >= p.N || m >= p.M) continue;
        if (p.splitk == 1) {
          const float b = p.bias ? ld_scalar(p.bias, p.bias_kind, n) : 0.f;
          st_out(p.y, p.out_kind, (long long)m * p.ldy + n, acc[rt][4 * j + e] + b);
        } else {
          p.ws[((long long)blockIdx.z * p.M + m) * p.N + n] = acc[rt][4 * j + e];
        }
      }
  if (p.splitk > 1) finish_split_k<BN, BM, NT>(p, n_block, m_block, last_block);
#endif
}

// <<<>>> or, with p.pdl, cudaLaunchKernelEx with programmatic stream serialization (a programmatic edge when
// captured). A failed launch's error is returned here, not left for the next launch's cudaGetLastError.
template <typename Kern>
int launch_kernel(Kern kern, dim3 grid, int threads, int smem, cudaStream_t stream, const Params& p) {
  if (!p.pdl) {
    kern<<<grid, threads, smem, stream>>>(p);
    return (int)cudaGetLastError();
  }
  cudaLaunchConfig_t cfg = {};
  cfg.gridDim = grid;
  cfg.blockDim = dim3(threads);
  cfg.dynamicSmemBytes = smem;
  cfg.stream = stream;
  cudaLaunchAttribute attr[1];
  attr[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
  attr[0].val.programmaticStreamSerializationAllowed = 1;
  cfg.attrs = attr;
  cfg.numAttrs = 1;
  const cudaError_t e = cudaLaunchKernelEx(&cfg, kern, p);
  cudaGetLastError();
  return (int)e;
}

// Opts the kernel into `smem` bytes of dynamic shared memory once per device (every instance opts in: its static
// shared memory, last_block, counts against the default), then launches it, or with `occupancy` only asks.
template <typename Kern>
int launch_tile(Kern kern, int bn, int bm, int threads, int smem, int* smem_set, const Params& p, cudaStream_t stream,
                int* occupancy) {
  int dev = 0;
  cudaGetDevice(&dev);
  if (dev >= 64 || smem > smem_set[dev]) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    if (dev < 64) smem_set[dev] = smem;
  }
  if (occupancy) return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(occupancy, kern, threads, smem);
  dim3 grid((p.N + bn - 1) / bn, (p.M + bm - 1) / bm, p.splitk);
  return launch_kernel(kern, grid, threads, smem, stream, p);
}

template <int LW, bool ZP, int WN, int WM, int RT, int MTW, int STAGES, bool FOLD>
int launch(const Params& p, cudaStream_t stream, int* occupancy) {
  constexpr int BN = WN * RT * 16, BM = WM * MTW * 8;
  static int smem_set[64] = {0};
  return launch_tile(wq_tiled<LW, ZP, WN, WM, RT, MTW, STAGES, FOLD>, BN, BM, WN * WM * 32,
                     STAGES * Stage<LW, ZP, BN, BM>::BYTES + 2 * Stage<LW, ZP, BN, BM>::XP, smem_set, p, stream,
                     occupancy);
}

template <bool ZP, int NWG, int RT, int BM, int STAGES, int WD>
int launch_wg(const Params& p, cudaStream_t stream, int* occupancy) {
  constexpr int BN = NWG * RT * 64;
  static int smem_set[64] = {0};
  return launch_tile(wq_wgmma<ZP, NWG, RT, BM, STAGES, WD>, BN, BM, NWG * 128, STAGES * WgStage<ZP, BN, BM>::BYTES,
                     smem_set, p, stream, occupancy);
}

// The wgmma instances: (WN = 4 warps a warpgroup, RT m64 tiles a warpgroup, MTW = BM / 8, STAGES, WD wgmma groups in
// flight); always folded. Listed once here and in weight_tiled.TILES_WG.
template <bool ZP>
int by_tile_wg(const Params& p, int wn, int rt, int mtw, int stages, int wd, cudaStream_t s, int* occ) {
#define LOWBIT_WG(WN_, RT_, MTW_, ST_, WD_)                                        \
  if (wn == WN_ && rt == RT_ && mtw == MTW_ && stages == ST_ && wd == WD_) \
    return launch_wg<ZP, WN_ / 4, RT_, MTW_ * 8, ST_, WD_>(p, s, occ);
#ifdef LOWBIT_COMPILE_CHECK
  LOWBIT_WG(8, 2, 8, 4, 3)
#else
  LOWBIT_WG(8, 2, 16, 4, 1)  // 256 x 128, 2 warpgroups of 2 m64 tiles
  LOWBIT_WG(8, 1, 16, 4, 1)  // 128 x 128
  LOWBIT_WG(8, 2, 8, 4, 1)   // 256 x 64
  LOWBIT_WG(16, 1, 8, 4, 1)  // 256 x 64, 4 warpgroups
  LOWBIT_WG(16, 1, 8, 4, 3)  // the s24 call 1 best (256 x 64), 3 groups in flight (not yet run)
  LOWBIT_WG(8, 1, 16, 4, 3)  // 128 x 128, 3 groups in flight (not yet run)
  LOWBIT_WG(8, 2, 8, 4, 3)   // 256 x 64, 3 groups in flight (not yet run)
#endif
#undef LOWBIT_WG
  return -2;
}

// The instances: (WN, WM, RT, MTW, STAGES) -> tile BN x BM, exact (fp32 partials) or FOLD. Listed once here and in
// weight_tiled.TILES / TILES_FOLD.
template <int LW, bool ZP>
int by_tile(const Params& p, int wn, int wm, int rt, int mtw, int stages, int fold, cudaStream_t s, int* occ) {
#define LOWBIT_TILE(WN_, WM_, RT_, MTW_, ST_, F_)                                        \
  if (wn == WN_ && wm == WM_ && rt == RT_ && mtw == MTW_ && stages == ST_ && fold == F_) \
    return launch<LW, ZP, WN_, WM_, RT_, MTW_, ST_, F_>(p, s, occ);
#ifdef LOWBIT_COMPILE_CHECK
  LOWBIT_TILE(4, 2, 2, 4, 3, 0)
  LOWBIT_TILE(4, 2, 2, 4, 3, 1)
#else
  LOWBIT_TILE(8, 1, 1, 4, 3, 0)  // 128 x 32
  LOWBIT_TILE(4, 2, 2, 4, 3, 0)  // 128 x 64
  LOWBIT_TILE(4, 2, 1, 4, 3, 0)  // 64 x 64
  LOWBIT_TILE(8, 1, 1, 4, 3, 1)  // 128 x 32
  LOWBIT_TILE(4, 2, 2, 4, 3, 1)  // 128 x 64
  LOWBIT_TILE(8, 1, 1, 8, 3, 1)  // 128 x 64, 64 activation rows a warp
  LOWBIT_TILE(4, 1, 2, 8, 3, 1)  // 128 x 64, 4 warps of 32 x 64
  LOWBIT_TILE(4, 2, 2, 8, 2, 1)  // 128 x 128
#endif
#undef LOWBIT_TILE
  return -2;
}

}  // namespace

extern "C" {

// Shared memory one block of this tile takes (the caller checks it against the device).
int lowbit_wq_tiled_smem(int lw, int zp, int wn, int wm, int rt, int mtw, int stages, int wg) {
  const int bn = wn * rt * 16, bm = wm * mtw * 8, cps = KS / (32 * lw);
  if (wg) return stages * (bn * 64 + bm * 256 + 4 * bn + (zp ? 2 * bn : 0));
  return stages * (bn * 64 + bm * 256 + cps * bn * 2 + (zp ? cps * bn : 0)) + 2 * bm * 256;
}

// y = x @ W^T, 4-bit weights. Returns 0, a cudaError_t, or a negative code (lowbit_wq_tiled_error). With occupancy
// != null nothing is launched: *occupancy = blocks per SM. wg: 0 for the mma.sync instances, k >= 1 for the wgmma
// instance with k groups in flight (sm_90 only).
int lowbit_wq_tiled(const void* x, long long ldx, const void* qw, const void* scale, int scale_kind, const void* zero,
                    const void* bias, int bias_kind, void* y, long long ldy, int out_kind, float* ws,
                    unsigned* counters, int M, int N, int K, int group, int lw, int wn, int wm, int rt, int mtw,
                    int stages, int fold, int wg, int stages_per_split, int splitk, int pdl, int l2p,
                    unsigned long long stream, int* occupancy) {
  if (scale_kind != KIND_BF16 && (fold || scale_kind != KIND_FP16)) return -3;
  if (K % KS || N % 16) return -4;
  Params p;
  p.x = static_cast<const __nv_bfloat16*>(x);
  p.ldx = ldx;
  p.qw = static_cast<const uint32_t*>(qw);
  p.scale = scale;
  p.zero = static_cast<const int8_t*>(zero);
  p.bias = bias;
  p.y = y;
  p.ldy = ldy;
  p.ws = ws;
  p.counters = counters;
  p.M = M;
  p.N = N;
  p.K = K;
  p.group = group;
  p.stages_per_split = stages_per_split;
  p.splitk = splitk;
  p.scale_kind = scale_kind;
  p.bias_kind = bias_kind;
  p.out_kind = out_kind;
  p.pdl = pdl;
  p.l2p = l2p;
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool zp = zero != nullptr;
  if (wg) {
    int dev = 0, major = 0, minor = 0;
    cudaGetDevice(&dev);
    cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor, dev);
    cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor, dev);
    if (major != 9 || minor != 0) return -5;
    if (!fold || wm != 1) return -2;
    return zp ? by_tile_wg<true>(p, wn, rt, mtw, stages, wg, s, occupancy)
              : by_tile_wg<false>(p, wn, rt, mtw, stages, wg, s, occupancy);
  }
  if (lw == 4) return zp ? by_tile<4, true>(p, wn, wm, rt, mtw, stages, fold, s, occupancy)
                         : by_tile<4, false>(p, wn, wm, rt, mtw, stages, fold, s, occupancy);
  if (lw == 2) return zp ? by_tile<2, true>(p, wn, wm, rt, mtw, stages, fold, s, occupancy)
                         : by_tile<2, false>(p, wn, wm, rt, mtw, stages, fold, s, occupancy);
  return -1;
}

const char* lowbit_wq_tiled_error(int code) {
  if (code == -1) return "no instance for this words-per-lane (4: group >= 128, 2: group 64)";
  if (code == -2) return "no instance for this tile (warps along N x M, row tiles, activation tiles, stages)";
  if (code == -3) return "scales must be bf16 or fp16 (bf16 for the folded kernel)";
  if (code == -4) return "K must be a multiple of 128 and N of 16";
  if (code == -5) return "the wgmma instances run on sm_90 (Hopper) only";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
