// lowbit: weight-only GEMM for small M (LLM decode, M = 1..64) on tensor cores.
//
//   y[M, N] = x[M, K] @ W^T,  W[n, k] = (q[n, k] - zero[g, n]) * scale[g, n],  g = k / group
//
// Built by lowbit/kernels/weight_cuda.py with nvcc into a shared library (no torch headers) and called
// through ctypes with raw device pointers on the caller's stream (so it can be captured in a CUDA graph).
//
// Weight layout: lowbit's PackedWeight as it is (no repack):
//   bits 4: int32 words [N, K/8], nibble i of word j = q[n, 8j + i] + 8 (compressed-tensors pack_to_int32)
//   bits 8: int8 [N, K], q signed
//   scale [G, N] (bf16 / fp16 / fp32), zero int8 [G, N] or null, bias [N] or null.
//
// Why it can run near the copy rate: the weight is the mma's A operand (16 weight rows x 16 k), the
// activations the B operand (16 k x 8 activation rows; MT = 1, 2, 4, 8 mmas per A fragment for M up to
// 8, 16, 32, 64), so an mma does 256 weights for one warp instruction and each dequantized A fragment
// serves every activation row. The K order inside an mma is free as long as
// A and B agree, so each lane feeds the mma from the words it loaded itself (16-byte loads of its
// weight row, a warp reading 8 rows x 64 contiguous bytes per instruction) and the activations are
// permuted once into shared memory in the matching order. 4-bit: one lop3 puts two nibbles
// (bits 0-3 and 16-19 of the shifted word) under the bf16 exponent of 128 (0x4300 | c == 128 + c) and
// one bf16x2 subtract of 136 + zero gives q - zero exactly (small integers are exact in bf16): 11
// instructions per 8 weights. 8-bit: byte_perm into the fp32 2**23 magic, subtract, pack to bf16x2.
// Each K chunk lies inside one group (chunk = 4 lanes x LW words, LW chosen on the host so that the
// chunk divides the group), so its fp32 partial is exact integer-weight sums and the group scale
// multiplies the partial once per chunk. x is staged into shared memory in windows of `xs_chunks` chunks
// (the whole split's K range when it fits): at M = 64 a 4096-wide row range is 512 KB of fragments, and
// splitting K only to fit it would cost more fp32 partial traffic than the weight itself. The weight ring
// stays in flight across a window's two barriers (it lives in registers). Split-K across blocks writes fp32 partials to a workspace;
// the last block of a row block (a counter, reset by that block) sums them in a fixed order (the
// result does not depend on which block finishes last) and writes y: no memset, no extra launch.

#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include <stdint.h>

namespace {

enum { KIND_BF16 = 0, KIND_FP16 = 1, KIND_FP32 = 2 };

struct Params {
  const __nv_bfloat16* x;  // [M, ldx] bf16, 16-byte aligned rows
  long long ldx;
  const uint32_t* qw;      // 4-bit: [N, K/8] words; 8-bit: [N, K] bytes read as [N, K/4] words
  const void* scale;       // [G, N]
  const int8_t* zero;      // [G, N] or null
  const void* bias;        // [N] or null
  void* y;                 // [M, ldy]
  long long ldy;
  float* ws;               // split-K partials [splitk, M, N] (splitk > 1)
  unsigned* counters;      // one per row block, zero between launches (splitk > 1)
  int M, N, K, group;
  int chunks_per_split;    // K chunks per blockIdx.y
  int xs_chunks;           // K chunks of x staged in shared memory at a time
  int splitk;              // gridDim.y
  int scale_kind, bias_kind, out_kind;
  int pdl;                 // launched as a programmatic dependent (cudaLaunchKernelEx; sm_90+)
};

// Programmatic dependent launch: let the next PDL-launched kernel be scheduled once every block of this one runs,
// warm L2 with this warp's first weight lines (a prefetch cannot hand back a stale value: every write lands in L2,
// and the loads that use the data come after the wait), then wait for the previous kernel to complete before
// touching anything it may have written (x, the split-K workspace, y). Without a PDL launch both are no-ops.
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

// Dynamic shared memory a kernel may take without opting in: 48 KB less its static shared memory (both kernels
// declare a 4-byte `last_block`), so a plan of exactly 48 KB needs the attribute too (without it: "invalid argument").
constexpr int kDynSmemDefault = 48 * 1024 - 256;

// <<<>>> or, with p.pdl, cudaLaunchKernelEx with programmatic stream serialization (captured into a CUDA graph as a
// programmatic edge).
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
  cudaGetLastError();  // returned here: not left behind for the next launch's cudaGetLastError to report as its own
  return (int)e;
}

__device__ __forceinline__ float ld_scalar(const void* p, int kind, long long i) {
  if (kind == KIND_BF16) return __bfloat162float(reinterpret_cast<const __nv_bfloat16*>(p)[i]);
  if (kind == KIND_FP16) return __half2float(reinterpret_cast<const __half*>(p)[i]);
  return reinterpret_cast<const float*>(p)[i];
}

// A scale as its raw bits (converted where it is used, so the load stays in flight meanwhile).
__device__ __forceinline__ uint32_t ld_raw(const void* p, int kind, long long i) {
  if (kind == KIND_FP32) return __ldg(reinterpret_cast<const unsigned int*>(p) + i);
  return __ldg(reinterpret_cast<const unsigned short*>(p) + i);
}

__device__ __forceinline__ float raw_to_float(uint32_t r, int kind) {
  if (kind == KIND_BF16) return __uint_as_float(r << 16);
  if (kind == KIND_FP16) return __half2float(__ushort_as_half(static_cast<unsigned short>(r)));
  return __uint_as_float(r);
}

__device__ __forceinline__ void st_out(void* y, int kind, long long i, float v) {
  if (kind == KIND_BF16) reinterpret_cast<__nv_bfloat16*>(y)[i] = __float2bfloat16_rn(v);
  else if (kind == KIND_FP16) reinterpret_cast<__half*>(y)[i] = __float2half_rn(v);
  else reinterpret_cast<float*>(y)[i] = v;
}

// LW consecutive 32-bit words, read once: no L1 allocation (the weight is streamed), 256-byte L2 fetch.
template <int LW>
__device__ __forceinline__ void ldg_words(const uint32_t* p, uint32_t* w) {
  if constexpr (LW == 4) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(w[0]), "=r"(w[1]), "=r"(w[2]), "=r"(w[3]) : "l"(p));
  } else if constexpr (LW == 2) {
    asm("ld.global.nc.L1::no_allocate.L2::256B.v2.u32 {%0, %1}, [%2];" : "=r"(w[0]), "=r"(w[1]) : "l"(p));
  } else {
    asm("ld.global.nc.L1::no_allocate.L2::256B.u32 %0, [%1];" : "=r"(w[0]) : "l"(p));
  }
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

__device__ __forceinline__ uint32_t pack_bf16x2(float lo, float hi) {
  __nv_bfloat162 r = __floats2bfloat162_rn(lo, hi);  // .x (low half) = lo
  return *reinterpret_cast<uint32_t*>(&r);
}

// D = A (16x16, row) * B (16x8, col) + D, bf16 in, fp32 accumulate.
__device__ __forceinline__ void mma_bf16(float* d, const uint32_t* a, uint32_t b0, uint32_t b1) {
  asm(
      "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
      "{%0, %1, %2, %3};"
      : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
      : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Split-K: this block's fp32 partials are in p.ws[blockIdx.y]; the last block of the row block to arrive (a
// counter, reset by that block) sums every split in a fixed order and writes y.
__device__ __forceinline__ void finish_split(const Params& p, int n_block, int rows_per_block, int* last_block) {
  __threadfence();
  __syncthreads();
  if (threadIdx.x == 0) *last_block = atomicAdd(&p.counters[blockIdx.x], 1u) == (unsigned)(p.splitk - 1);
  __syncthreads();
  if (!*last_block) return;
  __threadfence();
  for (int idx = threadIdx.x; idx < rows_per_block * p.M; idx += blockDim.x) {
    const int m = idx / rows_per_block, n = n_block + idx - m * rows_per_block;
    if (n >= p.N) continue;
    float v = 0.f;
    for (int ks = 0; ks < p.splitk; ++ks) v += __ldcg(&p.ws[((long long)ks * p.M + m) * p.N + n]);
    if (p.bias) v += ld_scalar(p.bias, p.bias_kind, n);
    st_out(p.y, p.out_kind, (long long)m * p.ldy + n, v);
  }
  if (threadIdx.x == 0) p.counters[blockIdx.x] = 0u;  // ready for the next launch on this stream
}

// BITS: 4 or 8. MT: activation tiles of 8 rows (1, 2, 4, 8: M <= 8, 16, 32, 64). LW: words per lane per row and
// chunk (a chunk is 4 lanes x LW words of K). RT: 16-row weight tiles per warp (they share the B loads).
template <int BITS, int MT, int LW, int RT>
__global__ void __launch_bounds__(256) wq_small_m(const Params p) {
  constexpr int KPW = BITS == 4 ? 8 : 4;  // k per word
  constexpr int SPW = BITS == 4 ? 2 : 1;  // mma k16-steps per word
  constexpr int CK = 4 * LW * KPW;        // k per chunk
  constexpr int S = LW * SPW;             // mma steps per chunk
  constexpr int WPC = CK / KPW;           // words per row per chunk (= 4 * LW)
  // B fragments: [window chunk][step][MT][lane] x (b0, b1); a warp reads 256 contiguous bytes per step and tile.
  extern __shared__ uint2 xs[];
  __shared__ int last_block;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int wpr = p.K / KPW;  // words per weight row
  const int c_begin = blockIdx.y * p.chunks_per_split;
  const int c_end = min(p.K / CK, c_begin + p.chunks_per_split);
  const int nch = c_end - c_begin;
  const int rows_per_block = nwarps * RT * 16;
  const int n_block = blockIdx.x * rows_per_block;
  const int n_warp = n_block + warp * RT * 16;

  // this lane's two weight rows per tile (gid, gid + 8), clamped inside the weight (stores are masked)
  const uint32_t* rowp[RT][2];
  int rown[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt) {
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rown[rt][h] = n_warp + rt * 16 + gid + 8 * h;
      rowp[rt][h] = p.qw + (long long)min(rown[rt][h], p.N - 1) * wpr + (long long)c_begin * WPC + tig * LW;
    }
  }

  // A ring of NB chunks in registers (indices are compile-time after unrolling): NB - 1 chunks of words,
  // scales and zero-points in flight while one is computed.
  constexpr int WORDS = RT * 2 * LW;
  constexpr int NB = WORDS <= 8 ? 4 : (WORDS <= 16 ? 3 : 2);
  uint32_t bw[NB][RT][2][LW];
  uint32_t bs[NB][RT][2];
  int bz[NB][RT][2];
  auto issue = [&](int b, int c) {  // chunk c (of this split) into buffer b
    const int grp = (c_begin + c) * CK / p.group;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ldg_words<LW>(rowp[rt][h] + c * WPC, bw[b][rt][h]);
        const long long gi = (long long)grp * p.N + min(rown[rt][h], p.N - 1);
        bs[b][rt][h] = ld_raw(p.scale, p.scale_kind, gi);
        bz[b][rt][h] = p.zero ? (int)__ldg(p.zero + gi) : 0;
      }
  };
  pdl_launch_dependents();
#pragma unroll
  for (int b = 0; b < NB - 1; ++b)
    if (b < nch)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) prefetch_l2(rowp[rt][h] + b * WPC);
  pdl_wait();
#pragma unroll
  for (int b = 0; b < NB - 1; ++b)
    if (b < nch) issue(b, b);  // in flight while x is staged

  // stage x[:, chunks cw .. cw + xs_chunks of this split] in the fragment order (rows m >= M are zeros).
  // SU loads per thread are issued before any store: one at a time, a window of 64 rows x 768 k is 24 dependent
  // L2 round trips per thread. At MT 1 a window is about one piece per thread, and SU > 1 would only cost the
  // registers that keep two 256-thread blocks per SM; at MT 8 RT 2 the accumulators already hold most of them.
  constexpr int SU = MT == 1 ? 1 : (MT == 2 ? 2 : (RT * MT >= 16 ? 2 : 4));
  auto stage = [&](int cw) {
    const int k_begin = (c_begin + cw) * CK;
    const int pieces = min(p.xs_chunks, nch - cw) * CK / 8;  // 16-byte pieces per activation row
    const int total = 8 * MT * pieces;
    for (int u0 = threadIdx.x; u0 < total; u0 += SU * blockDim.x) {
      uint4 v[SU];
#pragma unroll
      for (int i = 0; i < SU; ++i) {
        const int u = u0 + i * blockDim.x, m = u / pieces, piece = u - m * pieces;
        v[i] = make_uint4(0u, 0u, 0u, 0u);
        if (u < total && m < p.M) v[i] = *reinterpret_cast<const uint4*>(p.x + (long long)m * p.ldx + k_begin + piece * 8);
      }
#pragma unroll
      for (int i = 0; i < SU; ++i) {
        const int u = u0 + i * blockDim.x;
        if (u >= total) break;
        const int m = u / pieces, piece = u - m * pieces;
        const int t = m >> 3, g = m & 7;
        const int c = (piece * 8) / CK, kin = piece * 8 - c * CK;
        if constexpr (BITS == 4) {
          // one word's 8 k: step 2j takes pairs (k0, k4), (k1, k5); step 2j + 1 (k2, k6), (k3, k7)
          const int wi = kin / 8, tg = wi / LW, j = wi - tg * LW;
          const uint2 even = make_uint2(__byte_perm(v[i].x, v[i].z, 0x5410), __byte_perm(v[i].x, v[i].z, 0x7632));
          const uint2 odd = make_uint2(__byte_perm(v[i].y, v[i].w, 0x5410), __byte_perm(v[i].y, v[i].w, 0x7632));
          xs[((c * S + 2 * j) * MT + t) * 32 + g * 4 + tg] = even;
          xs[((c * S + 2 * j + 1) * MT + t) * 32 + g * 4 + tg] = odd;
        } else {
          // two words of 4 k each, natural order: b0 = (k0, k1), b1 = (k2, k3)
          const int wi = kin / 4;
          const int tg0 = wi / LW, s0 = wi - tg0 * LW, tg1 = (wi + 1) / LW, s1 = wi + 1 - tg1 * LW;
          xs[((c * S + s0) * MT + t) * 32 + g * 4 + tg0] = make_uint2(v[i].x, v[i].y);
          xs[((c * S + s1) * MT + t) * 32 + g * 4 + tg1] = make_uint2(v[i].z, v[i].w);
        }
      }
    }
  };

  float acc[RT][MT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.f;

  auto compute = [&](int b, int c) {  // c: the chunk's index in the staged window
#pragma unroll
    for (int rt = 0; rt < RT; ++rt) {
      float sc[2];
      uint32_t sub2[2];  // 4-bit: bf16x2 (136 + z); 8-bit: fp32 bits of 2**23 + 128 + z
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        sc[h] = raw_to_float(bs[b][rt][h], p.scale_kind);
        const float z = (float)bz[b][rt][h];
        if constexpr (BITS == 4) sub2[h] = pack_bf16x2(136.f + z, 136.f + z);
        else sub2[h] = __float_as_uint(8388736.f + z);
      }
      float part[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) part[t][i] = 0.f;
#pragma unroll
      for (int j = 0; j < LW; ++j) {
        const uint32_t wa = bw[b][rt][0][j], wb = bw[b][rt][1][j];  // rows gid, gid + 8
        if constexpr (BITS == 4) {
#pragma unroll
          for (int hs = 0; hs < 2; ++hs) {
            uint32_t a[4];
            a[0] = bf16x2_sub(nib_pair(wa >> (8 * hs)), sub2[0]);      // (n_{2hs}, n_{2hs+4}) of row gid
            a[1] = bf16x2_sub(nib_pair(wb >> (8 * hs)), sub2[1]);      // the same of row gid + 8
            a[2] = bf16x2_sub(nib_pair(wa >> (8 * hs + 4)), sub2[0]);  // (n_{2hs+1}, n_{2hs+5})
            a[3] = bf16x2_sub(nib_pair(wb >> (8 * hs + 4)), sub2[1]);
            const int s = 2 * j + hs;
#pragma unroll
            for (int t = 0; t < MT; ++t) {
              const uint2 bf = xs[((c * S + s) * MT + t) * 32 + lane];
              mma_bf16(part[t], a, bf.x, bf.y);
            }
          }
        } else {
          const uint32_t ua = wa ^ 0x80808080u, ub = wb ^ 0x80808080u;  // q + 128 per byte
          const float oa = __uint_as_float(sub2[0]), ob = __uint_as_float(sub2[1]);
          float fa[4], fb[4];
#pragma unroll
          for (int i = 0; i < 4; ++i) {
            fa[i] = __uint_as_float(__byte_perm(ua, 0x4B000000u, 0x7540 + i)) - oa;  // exact q - z
            fb[i] = __uint_as_float(__byte_perm(ub, 0x4B000000u, 0x7540 + i)) - ob;
          }
          uint32_t a[4] = {pack_bf16x2(fa[0], fa[1]), pack_bf16x2(fb[0], fb[1]), pack_bf16x2(fa[2], fa[3]),
                           pack_bf16x2(fb[2], fb[3])};
#pragma unroll
          for (int t = 0; t < MT; ++t) {
            const uint2 bf = xs[((c * S + j) * MT + t) * 32 + lane];
            mma_bf16(part[t], a, bf.x, bf.y);
          }
        }
      }
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        acc[rt][t][0] += part[t][0] * sc[0];
        acc[rt][t][1] += part[t][1] * sc[0];
        acc[rt][t][2] += part[t][2] * sc[1];
        acc[rt][t][3] += part[t][3] * sc[1];
      }
    }
  };
  for (int c0 = 0; c0 < nch; c0 += NB) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int c = c0 + b;
      if (c < nch) {  // block-uniform, so the barriers below are reached by every thread
        if (c + NB - 1 < nch) issue((b + NB - 1) % NB, c + NB - 1);
        const int cw = c % p.xs_chunks;
        if (cw == 0) {
          if (c > 0) __syncthreads();  // every warp is done with the previous window
          stage(c);
          __syncthreads();
        }
        compute(b, cw);
      }
    }
  }

  // C fragment: acc[rt][t][i] is (weight row gid + 8 * (i >= 2), activation row 8t + 2 tig + (i & 1))
  if (p.splitk == 1) {
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int t = 0; t < MT; ++t)
#pragma unroll
        for (int i = 0; i < 4; ++i) {
          const int n = rown[rt][i >> 1], m = 8 * t + 2 * tig + (i & 1);
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
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) {
        const int n = rown[rt][i >> 1], m = 8 * t + 2 * tig + (i & 1);
        if (n < p.N && m < p.M) p.ws[((long long)blockIdx.y * p.M + m) * p.N + n] = acc[rt][t][i];
      }
  finish_split(p, n_block, rows_per_block, &last_block);
}


// ---- 4-bit, M <= 16: the K range split across a block's warps (decode's small-batch GEMV) ---------------------
// The same mma fragments as wq_small_m, arranged so more of the weight is in flight per SM and less work sits
// outside the loads: (1) each lane builds its B fragment from its own 16-byte loads of x (L1-resident; lanes of
// activation rows >= M hold zeros), so there is no shared-memory staging and no barrier before the first mma (x
// staged once per block in shared memory instead measured 5-16% slower at M = 1, though it takes ~25 registers
// fewer: `results/weights/gemm_explore_ws_xsmem_*`); (2) a block's W warps share its 16 * RT rows and take
// interleaved K chunks (warp w: chunks w, w + W, ...), so the block reads W consecutive chunks of its rows at once,
// and the warps' partials are summed in shared memory in a fixed order (split-K across blocks only where the rows
// alone do not fill the SMs); (3) a ring of NB chunks per warp in registers (NB - 1 in flight while one is
// computed); (4) the offset is taken out of the inner loop: the mma sums (128 + c) x over a chunk (one lop3 per two
// weights), one more mma with an all-ones A sums x, and q - z = (128 + c) - (136 + z) is applied once per chunk and
// row (both sums fp32; the integers are exact).
//
// MT activation tiles of 8 rows (1: M <= 8, 2: M <= 16) share each dequantized A fragment.
//
// Shared memory: the warps' partials [W][16 RT][8 MT] fp32.
// MAXT: the launch bound, threads per block. 512 (16-warp launches) caps a thread at 128 registers, where the RT 2
// and two-activation-tile instances spill (ptxas: up to 208 B of spill stores a thread at LW 4); 256 (launches of
// at most 8 warps, CudaConfig.bound) lets them take up to 255 registers instead.
template <int LW, int RT, int NB, bool ZP, int MT, int MAXT>
__global__ void __launch_bounds__(MAXT) wq_warp_split(const Params p) {
  constexpr int CK = 4 * LW * 8;  // k per chunk
  constexpr int WPC = 4 * LW;     // words per row per chunk
  extern __shared__ float red[];
  __shared__ int last_block;

  const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
  const int gid = lane >> 2, tig = lane & 3;
  const int wpr = p.K / 8;
  const int c_begin = blockIdx.y * p.chunks_per_split + warp;  // this warp's first chunk
  const int c_end = min(p.K / CK, blockIdx.y * p.chunks_per_split + p.chunks_per_split);
  const int nu = c_begin < c_end ? (c_end - c_begin + nw - 1) / nw : 0;  // chunks of this warp: c_begin + nw * i
  const int rows_per_block = RT * 16;
  const int n_block = blockIdx.x * rows_per_block;

  const uint32_t* rowp[RT][2];
  int rown[RT][2];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int h = 0; h < 2; ++h) {
      rown[rt][h] = n_block + rt * 16 + gid + 8 * h;
      rowp[rt][h] = p.qw + (long long)min(rown[rt][h], p.N - 1) * wpr + (long long)c_begin * WPC + tig * LW;
    }
  bool has_x[MT];
  const uint4* xp[MT];
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    has_x[t] = gid + 8 * t < p.M;
    xp[t] = reinterpret_cast<const uint4*>(p.x + (long long)min(gid + 8 * t, p.M - 1) * p.ldx + (long long)c_begin * CK) +
            tig * LW;
  }

  uint32_t bw[NB][RT][2][LW];
  uint32_t bs[NB][RT][2];
  int bz[NB][RT][2];
  auto issue = [&](int b, int i) {  // this warp's chunk i into buffer b
    const int grp = (c_begin + i * nw) * CK / p.group;
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        ldg_words<LW>(rowp[rt][h] + (long long)i * nw * WPC, bw[b][rt][h]);
        const long long gi = (long long)grp * p.N + min(rown[rt][h], p.N - 1);
        bs[b][rt][h] = ld_raw(p.scale, p.scale_kind, gi);
        if constexpr (ZP) bz[b][rt][h] = (int)__ldg(p.zero + gi);
        else bz[b][rt][h] = 0;
      }
  };

  float acc[RT][MT][4];
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i) acc[rt][t][i] = 0.f;
  const uint32_t ones[4] = {0x3F803F80u, 0x3F803F80u, 0x3F803F80u, 0x3F803F80u};  // bf16x2 (1, 1)

  auto compute = [&](int b, int i) {
    uint4 xv[MT][LW];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int j = 0; j < LW; ++j)
        xv[t][j] = has_x[t] ? __ldg(xp[t] + (long long)i * nw * (CK / 8) + j) : make_uint4(0u, 0u, 0u, 0u);
    float part[RT][MT][4], xsum[MT][4];
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int q = 0; q < 4; ++q) {
        xsum[t][q] = 0.f;
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) part[rt][t][q] = 0.f;
      }
#pragma unroll
    for (int j = 0; j < LW; ++j) {
      // word j's 8 k: step 0 takes (k0, k4), (k1, k5); step 1 (k2, k6), (k3, k7) (wq_small_m's stage order)
      uint32_t bx[MT][4];
#pragma unroll
      for (int t = 0; t < MT; ++t) {
        bx[t][0] = __byte_perm(xv[t][j].x, xv[t][j].z, 0x5410);
        bx[t][1] = __byte_perm(xv[t][j].x, xv[t][j].z, 0x7632);
        bx[t][2] = __byte_perm(xv[t][j].y, xv[t][j].w, 0x5410);
        bx[t][3] = __byte_perm(xv[t][j].y, xv[t][j].w, 0x7632);
      }
#pragma unroll
      for (int hs = 0; hs < 2; ++hs) {
#pragma unroll
        for (int t = 0; t < MT; ++t) mma_bf16(xsum[t], ones, bx[t][2 * hs], bx[t][2 * hs + 1]);
#pragma unroll
        for (int rt = 0; rt < RT; ++rt) {
          const uint32_t wa = bw[b][rt][0][j], wb = bw[b][rt][1][j];
          const uint32_t a[4] = {nib_pair(wa >> (8 * hs)), nib_pair(wb >> (8 * hs)), nib_pair(wa >> (8 * hs + 4)),
                                 nib_pair(wb >> (8 * hs + 4))};
#pragma unroll
          for (int t = 0; t < MT; ++t) mma_bf16(part[rt][t], a, bx[t][2 * hs], bx[t][2 * hs + 1]);
        }
      }
    }
#pragma unroll
    for (int rt = 0; rt < RT; ++rt)
#pragma unroll
      for (int h = 0; h < 2; ++h) {
        const float sc = raw_to_float(bs[b][rt][h], p.scale_kind);
        const float off = 136.f + (float)bz[b][rt][h];
#pragma unroll
        for (int t = 0; t < MT; ++t) {
          acc[rt][t][2 * h] = fmaf(sc, fmaf(-off, xsum[t][0], part[rt][t][2 * h]), acc[rt][t][2 * h]);
          acc[rt][t][2 * h + 1] = fmaf(sc, fmaf(-off, xsum[t][1], part[rt][t][2 * h + 1]), acc[rt][t][2 * h + 1]);
        }
      }
  };

  pdl_launch_dependents();
#pragma unroll
  for (int b = 0; b < NB - 1; ++b)
    if (b < nu)
#pragma unroll
      for (int rt = 0; rt < RT; ++rt)
#pragma unroll
        for (int h = 0; h < 2; ++h) prefetch_l2(rowp[rt][h] + (long long)b * nw * WPC);
  pdl_wait();
#pragma unroll
  for (int b = 0; b < NB - 1; ++b)
    if (b < nu) issue(b, b);
  for (int i0 = 0; i0 < nu; i0 += NB) {
#pragma unroll
    for (int b = 0; b < NB; ++b) {
      const int i = i0 + b;
      if (i < nu) {
        if (i + NB - 1 < nu) issue((b + NB - 1) % NB, i + NB - 1);
        compute(b, i);
      }
    }
  }

  // C fragment: acc[rt][t][i] is (weight row rt * 16 + gid + 8 * (i >= 2), activation row 8 t + 2 tig + (i & 1))
#pragma unroll
  for (int rt = 0; rt < RT; ++rt)
#pragma unroll
    for (int t = 0; t < MT; ++t)
#pragma unroll
      for (int i = 0; i < 4; ++i)
        red[(warp * rows_per_block + rt * 16 + gid + 8 * (i >> 1)) * 8 * MT + 8 * t + 2 * tig + (i & 1)] = acc[rt][t][i];
  __syncthreads();
  for (int idx = threadIdx.x; idx < rows_per_block * p.M; idx += blockDim.x) {
    const int m = idx / rows_per_block, r = idx - m * rows_per_block, n = n_block + r;
    if (n >= p.N) continue;
    float v = 0.f;
    for (int w = 0; w < nw; ++w) v += red[(w * rows_per_block + r) * 8 * MT + m];
    if (p.splitk == 1) {
      if (p.bias) v += ld_scalar(p.bias, p.bias_kind, n);
      st_out(p.y, p.out_kind, (long long)m * p.ldy + n, v);
    } else {
      p.ws[((long long)blockIdx.y * p.M + m) * p.N + n] = v;
    }
  }
  if (p.splitk > 1) finish_split(p, n_block, rows_per_block, &last_block);
}

// Dynamic shared memory of one wq_warp_split block: the warps' partials.
static int warp_split_smem(int rt, int warps, int mt) { return warps * rt * 16 * 8 * mt * 4; }

template <int LW, int RT, int NB, bool ZP, int MT, int MAXT>
int launch_warp_split(const Params& p, int warps, cudaStream_t stream, int* occupancy) {
  if (warps * 32 > MAXT) return -4;  // more threads than this instance was compiled for
  auto kern = wq_warp_split<LW, RT, NB, ZP, MT, MAXT>;
  const int smem = warp_split_smem(RT, warps, MT);
  static int smem_set[64] = {0};
  int dev = 0;
  cudaGetDevice(&dev);
  if (smem > kDynSmemDefault && (dev >= 64 || smem > smem_set[dev])) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    if (dev < 64) smem_set[dev] = smem;
  }
  if (occupancy) {  // blocks per SM for this launch (the exploration's record), no launch
    return (int)cudaOccupancyMaxActiveBlocksPerMultiprocessor(occupancy, kern, warps * 32, smem);
  }
  const int rows_per_block = RT * 16;
  dim3 grid((p.N + rows_per_block - 1) / rows_per_block, p.splitk);
  return launch_kernel(kern, grid, warps * 32, smem, stream, p);
}

template <int LW, bool ZP, int MAXT>
int warp_split_by_rt_nb(const Params& p, int rt, int nb, int warps, cudaStream_t s, int* occ) {
  const bool two = p.M > 8;  // MT 2: rows 8-15 of the activations in a second B tile
#ifdef LOWBIT_COMPILE_CHECK
  if (rt == 1 && nb == 4) return two ? launch_warp_split<LW, 1, 4, ZP, 2, MAXT>(p, warps, s, occ)
                                     : launch_warp_split<LW, 1, 4, ZP, 1, MAXT>(p, warps, s, occ);
#else
  if (!two) {
    if (rt == 1 && nb == 3) return launch_warp_split<LW, 1, 3, ZP, 1, MAXT>(p, warps, s, occ);
    if (rt == 1 && nb == 4) return launch_warp_split<LW, 1, 4, ZP, 1, MAXT>(p, warps, s, occ);
    if (rt == 1 && nb == 6) return launch_warp_split<LW, 1, 6, ZP, 1, MAXT>(p, warps, s, occ);
    if (rt == 2 && nb == 3) return launch_warp_split<LW, 2, 3, ZP, 1, MAXT>(p, warps, s, occ);
    if (rt == 2 && nb == 4) return launch_warp_split<LW, 2, 4, ZP, 1, MAXT>(p, warps, s, occ);
  } else {
    if (rt == 1 && nb == 3) return launch_warp_split<LW, 1, 3, ZP, 2, MAXT>(p, warps, s, occ);
    if (rt == 1 && nb == 4) return launch_warp_split<LW, 1, 4, ZP, 2, MAXT>(p, warps, s, occ);
    if (rt == 2 && nb == 3) return launch_warp_split<LW, 2, 3, ZP, 2, MAXT>(p, warps, s, occ);
    // 64 weight rows per warp: each x fragment feeds four row tiles (half the x reads per weight byte of RT 2);
    // ~250 registers, so only under bound 256
    if constexpr (MAXT == 256) {
      if (rt == 4 && nb == 2) return launch_warp_split<LW, 4, 2, ZP, 2, MAXT>(p, warps, s, occ);
    }
  }
#endif
  return -6;
}

template <int BITS, int MT, int LW, int RT>
int launch(const Params& p, int warps, int smem, cudaStream_t stream) {
  auto kern = wq_small_m<BITS, MT, LW, RT>;
  static int smem_set[64] = {0};  // per device: the dynamic shared memory limit raised so far
  int dev = 0;
  cudaGetDevice(&dev);
  if (smem > kDynSmemDefault && (dev >= 64 || smem > smem_set[dev])) {
    cudaError_t e = cudaFuncSetAttribute(kern, cudaFuncAttributeMaxDynamicSharedMemorySize, smem);
    if (e != cudaSuccess) return (int)e;
    if (dev < 64) smem_set[dev] = smem;
  }
  const int rows_per_block = warps * RT * 16;
  dim3 grid((p.N + rows_per_block - 1) / rows_per_block, p.splitk);
  return launch_kernel(kern, grid, warps * 32, smem, stream, p);
}

// RT 4 only for MT <= 2: with 4 or 8 activation tiles its accumulators would not fit the registers.
template <int BITS, int MT>
int by_lw_rt(const Params& p, int lw, int rt, int warps, int smem, cudaStream_t s) {
#ifdef LOWBIT_COMPILE_CHECK  // the CPU test's quick compile: every code path, fewer template instances
#define LOWBIT_RT(LW_)                                                 \
  if (rt == 1) return launch<BITS, MT, LW_, 1>(p, warps, smem, s);    \
  return -2;
#else
#define LOWBIT_RT(LW_)                                                            \
  if (rt == 1) return launch<BITS, MT, LW_, 1>(p, warps, smem, s);               \
  if (rt == 2) return launch<BITS, MT, LW_, 2>(p, warps, smem, s);               \
  if constexpr (MT <= 2) { if (rt == 4) return launch<BITS, MT, LW_, 4>(p, warps, smem, s); } \
  return -2;
#endif
  if (lw == 4) { LOWBIT_RT(4) }
  if (lw == 2) { LOWBIT_RT(2) }
  if (lw == 1) { LOWBIT_RT(1) }
#undef LOWBIT_RT
  return -3;
}

}  // namespace

extern "C" {

static int mt_for(int M) { return M <= 8 ? 1 : (M <= 16 ? 2 : (M <= 32 ? 4 : 8)); }

// The kernels' arguments from the C entry points' (the same for both kernels; xs_chunks 0 for the warp-split one).
static Params make_params(const void* x, long long ldx, const void* qw, const void* scale, int scale_kind,
                          const void* zero, const void* bias, int bias_kind, void* y, long long ldy, int out_kind,
                          float* ws, unsigned* counters, int M, int N, int K, int group, int chunks_per_split,
                          int xs_chunks, int splitk, int pdl) {
  Params p = {};
  p.x = reinterpret_cast<const __nv_bfloat16*>(x);
  p.ldx = ldx;
  p.qw = reinterpret_cast<const uint32_t*>(qw);
  p.scale = scale;
  p.zero = reinterpret_cast<const int8_t*>(zero);
  p.bias = bias;
  p.y = y;
  p.ldy = ldy;
  p.ws = ws;
  p.counters = counters;
  p.M = M;
  p.N = N;
  p.K = K;
  p.group = group;
  p.chunks_per_split = chunks_per_split;
  p.xs_chunks = xs_chunks;
  p.splitk = splitk;
  p.scale_kind = scale_kind;
  p.bias_kind = bias_kind;
  p.out_kind = out_kind;
  p.pdl = pdl;
  return p;
}

// Bytes of dynamic shared memory one block needs for a window of xs_chunks chunks (the caller checks it
// against the device).
int lowbit_wq_small_m_smem(int bits, int M, int lw, int xs_chunks) {
  const int s = lw * (bits == 4 ? 2 : 1);
  return xs_chunks * s * mt_for(M) * 32 * 8;
}

// y = x @ W^T for 1 <= M <= 64. Returns 0, a cudaError_t, or -1..-4 for arguments the library has no
// instance for (bits, M, lw, rt, warps). Sizes are checked by the Python wrapper (weight_cuda.py).
int lowbit_wq_small_m(const void* x, long long ldx, const void* qw, const void* scale, int scale_kind,
                      const void* zero, const void* bias, int bias_kind, void* y, long long ldy, int out_kind,
                      float* ws, unsigned* counters, int M, int N, int K, int group, int bits, int lw, int rt,
                      int warps, int chunks_per_split, int xs_chunks, int splitk, int pdl, unsigned long long stream) {
  if (M < 1 || M > 64) return -1;
  if (xs_chunks < 1) return -5;
  if (warps != 2 && warps != 4 && warps != 8) return -4;
  const Params p = make_params(x, ldx, qw, scale, scale_kind, zero, bias, bias_kind, y, ldy, out_kind, ws, counters, M, N,
                               K, group, chunks_per_split, xs_chunks, splitk, pdl);
  const int smem = lowbit_wq_small_m_smem(bits, M, lw, xs_chunks);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const int mt = mt_for(M);
#ifdef LOWBIT_COMPILE_CHECK  // MT 1 and 8 (every branch of the MT-dependent code)
  if (bits == 4) return mt == 1 ? by_lw_rt<4, 1>(p, lw, rt, warps, smem, s) : by_lw_rt<4, 8>(p, lw, rt, warps, smem, s);
  if (bits == 8) return mt == 1 ? by_lw_rt<8, 1>(p, lw, rt, warps, smem, s) : by_lw_rt<8, 8>(p, lw, rt, warps, smem, s);
#else
#define LOWBIT_MT(B_)                                                  \
  if (mt == 1) return by_lw_rt<B_, 1>(p, lw, rt, warps, smem, s);     \
  if (mt == 2) return by_lw_rt<B_, 2>(p, lw, rt, warps, smem, s);     \
  if (mt == 4) return by_lw_rt<B_, 4>(p, lw, rt, warps, smem, s);     \
  return by_lw_rt<B_, 8>(p, lw, rt, warps, smem, s);
  if (bits == 4) { LOWBIT_MT(4) }
  if (bits == 8) { LOWBIT_MT(8) }
#undef LOWBIT_MT
#endif
  return -1;
}

// y = x @ W^T for 4-bit weights and 1 <= M <= 16 through wq_warp_split (warps per block 4, 8 or 16; rt 1 or 2 row
// tiles per warp; nb chunks in each warp's ring; zero-points iff zero != null; bound 512 or 256: the instance's
// launch bound, 256 for at most 8 warps with up to 255 registers a thread). Same return codes as above, -6: no
// instance for this (rt, nb, M). With occupancy != null nothing is launched: *occupancy = blocks per SM.
int lowbit_wq_warp_split_smem(int rt, int warps, int M) { return warp_split_smem(rt, warps, M > 8 ? 2 : 1); }

int lowbit_wq_warp_split(const void* x, long long ldx, const void* qw, const void* scale, int scale_kind,
                         const void* zero, const void* bias, int bias_kind, void* y, long long ldy, int out_kind,
                         float* ws, unsigned* counters, int M, int N, int K, int group, int lw, int rt, int nb,
                         int warps, int bound, int chunks_per_split, int splitk, int pdl, unsigned long long stream,
                         int* occupancy) {
  if (M < 1 || M > 16) return -1;
  if (warps != 4 && warps != 8 && warps != 16) return -4;
  if (bound != 256 && bound != 512) return -4;
  const Params p = make_params(x, ldx, qw, scale, scale_kind, zero, bias, bias_kind, y, ldy, out_kind, ws, counters, M, N,
                               K, group, chunks_per_split, 0, splitk, pdl);
  cudaStream_t s = reinterpret_cast<cudaStream_t>(stream);
  const bool zp = zero != nullptr;
#define LOWBIT_WS(LW_)                                                                                  \
  if (bound == 256)                                                                                   \
    return zp ? warp_split_by_rt_nb<LW_, true, 256>(p, rt, nb, warps, s, occupancy)                   \
              : warp_split_by_rt_nb<LW_, false, 256>(p, rt, nb, warps, s, occupancy);                 \
  return zp ? warp_split_by_rt_nb<LW_, true, 512>(p, rt, nb, warps, s, occupancy)                     \
            : warp_split_by_rt_nb<LW_, false, 512>(p, rt, nb, warps, s, occupancy);
  if (lw == 4) { LOWBIT_WS(4) }
  if (lw == 2) { LOWBIT_WS(2) }
  if (lw == 1) { LOWBIT_WS(1) }
#undef LOWBIT_WS
  return -3;
}

const char* lowbit_cuda_error_string(int code) {
  if (code == -1) return "no instance for these bits / M (4 or 8 bits, 1 <= M <= 64)";
  if (code == -2) return "no instance for this rows-per-warp (1, 2 or 4; 1 or 2 for M > 16)";
  if (code == -3) return "no instance for this words-per-lane (1, 2 or 4)";
  if (code == -4) return "no instance for this warps-per-block (x-staging: 2, 4 or 8; warp-split: 4, 8 or 16, at most 8 "
                         "under launch bound 256)";
  if (code == -5) return "xs_chunks must be >= 1";
  if (code == -6) return "no warp-split instance for this (rows-per-warp, ring depth, M)";
  return cudaGetErrorString(static_cast<cudaError_t>(code));
}

}  // extern "C"
