// lowbit vLLM plugin: fused decode attention over packed paged cells (CPU).
//
// One query token per request (decode). For each (request r, KV head h) the G query heads of h are
// scored against
//   1. the packed middle: cells of blocks mid_ids[r, j] (positions (b0[r] + j) * bs + t, kept when
//      mid_lo[r] <= pos < mid_hi[r]); a cell holds, per tensor, codes in lowbit's `strided` packing
//      (byte j holds dims j + i*S in bits [i*cbits, (i+1)*cbits)) and fp16 scale / zero per group;
//      x_hat = codes * scale + zero is never formed: the score is sum_g s_g (q_g . c_g) + z_g sum(q_g)
//      and the output sum_t (p_t s_t) c_t + p_t z_t, per group;
//   2. dense rows (the exact sink / recent tiers) at pool rows dense_rows[r, i] (-1: none);
//   3. the request's own new row (own_k / own_v, optional),
// with one streaming softmax (per tile of tokens: max, rescale once, accumulate).
// Every index set is prepared by the caller (paged.py), so this file holds math only: a CUDA port
// replaces this loop with lowbit's Triton split-K kernel over the same inputs.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <limits>
#include <type_traits>
#include <vector>

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
#include <immintrin.h>
#endif

namespace {

struct Field {
  int64_t codes, scale, zero, cbits, group, dim;
};

inline float half_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return static_cast<float>(c10::Half(b, c10::Half::from_bits()));
}

// codes of one row -> float [dim]; CB (container bits) fixed at compile time so the loops vectorise
template <int CB>
inline void unpack(const uint8_t* __restrict c, int64_t dim, float* __restrict out) {
  constexpr int P = 8 / CB;
  constexpr int mask = (1 << CB) - 1;
  const int64_t S = dim / P;
  for (int i = 0; i < P; ++i) {
    float* __restrict o = out + i * S;
    for (int64_t j = 0; j < S; ++j) o[j] = static_cast<float>((c[j] >> (i * CB)) & mask);
  }
}

inline float dot(const float* __restrict a, const float* __restrict b, int64_t n) {
  float s = 0.f;
  for (int64_t d = 0; d < n; ++d) s += a[d] * b[d];
  return s;
}

constexpr int TILE = 32;

template <typename T, int CBK, int CBV>
void decode_one(int64_t r, int64_t h, const float* q /*[G,D]*/, int64_t G, int64_t D, int64_t Dv,
                const uint8_t* cache, int64_t H, int64_t bs, int64_t C, const int64_t* ids, int64_t nb,
                int64_t b0, int64_t lo, int64_t hi, const Field& fk, const Field& fv, const T* pk,
                const T* pv, const int64_t* drows, int64_t nd, const float* ok, const float* ov, float scale,
                float softcap, float* out /*[G,Dv]*/, const float* rk /*[D,D] or null*/,
                const float* rv /*[Dv,Dv] or null*/) {
  const int64_t ngk = D / fk.group, ngv = Dv / fv.group;
  std::vector<float> qrot;
  if (rk != nullptr) {  // q @ R_k, the rotation the cache's rows carry (paged.attend's rotate, here per row)
    qrot.assign(G * D, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) {
        const float x = q[g * D + d];
        const float* __restrict rr = rk + d * D;
        float* __restrict o = &qrot[g * D];
        for (int64_t e = 0; e < D; ++e) o[e] += x * rr[e];
      }
    q = qrot.data();
  }
  std::vector<float> qsum(G * ngk), m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f);
  std::vector<float> acc(G * Dv, 0.f), kc(D), vc(Dv), s(G * TILE), sv(TILE * ngv), zv(TILE * ngv);
  std::vector<const uint8_t*> vcell(TILE);
  std::vector<const float*> vrow(TILE);
  std::vector<float> vtmp(TILE * Dv), kbuf(D), ks(ngk), kz(ngk);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < ngk; ++k) {
      float a = 0.f;
      for (int64_t d = k * fk.group; d < (k + 1) * fk.group; ++d) a += q[g * D + d];
      qsum[g * ngk + k] = a;
    }
  // a tile of tokens: scores for all G, then one rescale, then the values
  int n = 0;
  auto flush = [&]() {
    if (n == 0) return;
    for (int64_t g = 0; g < G; ++g) {
      float mx = m[g];
      for (int t = 0; t < n; ++t) mx = std::max(mx, s[g * TILE + t]);
      const float alpha = std::isinf(m[g]) ? 0.f : std::exp(m[g] - mx);
      l[g] *= alpha;
      for (int64_t d = 0; d < Dv; ++d) acc[g * Dv + d] *= alpha;
      m[g] = mx;
      for (int t = 0; t < n; ++t) s[g * TILE + t] = std::exp(s[g * TILE + t] - mx);  // p
    }
    for (int t = 0; t < n; ++t) {
      if (vcell[t] != nullptr) {
        unpack<CBV>(vcell[t] + fv.codes, Dv, vc.data());
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * TILE + t];
          l[g] += p;
          float* a = &acc[g * Dv];
          for (int64_t k = 0; k < ngv; ++k) {
            const float ps = p * sv[t * ngv + k], pz = p * zv[t * ngv + k];
            float* __restrict ag = a + k * fv.group;
            const float* __restrict cg = vc.data() + k * fv.group;
            for (int64_t d = 0; d < fv.group; ++d) ag[d] += ps * cg[d] + pz;
          }
        }
      } else {
        const float* vr = vrow[t];
        for (int64_t g = 0; g < G; ++g) {
          const float p = s[g * TILE + t];
          l[g] += p;
          float* __restrict a = &acc[g * Dv];
          for (int64_t d = 0; d < Dv; ++d) a[d] += p * vr[d];
        }
      }
    }
    n = 0;
  };
  auto finish_score = [&](float x) {
    x *= scale;
    if (softcap > 0.f) x = softcap * std::tanh(x / softcap);
    return x;
  };
  // 1. packed middle
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t base = (b0 + j) * bs;
    const int64_t t0 = std::max<int64_t>(0, lo - base), t1 = std::min<int64_t>(bs, hi - base);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* cell = cache + ((ids[j] * H + h) * bs + t) * C;
      unpack<CBK>(cell + fk.codes, D, kc.data());
      for (int64_t k = 0; k < ngk; ++k) {  // this token's K scale / zero, once for the G query heads
        ks[k] = half_at(cell + fk.scale + 2 * k);
        kz[k] = half_at(cell + fk.zero + 2 * k);
      }
      for (int64_t g = 0; g < G; ++g) {
        float sc = 0.f;
        for (int64_t k = 0; k < ngk; ++k) {
          const float dk = dot(q + g * D + k * fk.group, kc.data() + k * fk.group, fk.group);
          sc += dk * ks[k] + qsum[g * ngk + k] * kz[k];
        }
        s[g * TILE + n] = finish_score(sc);
      }
      for (int64_t k = 0; k < ngv; ++k) {
        sv[n * ngv + k] = half_at(cell + fv.scale + 2 * k);
        zv[n * ngv + k] = half_at(cell + fv.zero + 2 * k);
      }
      vcell[n] = cell;
      if (++n == TILE) flush();
    }
  }
  // 2. dense rows (pool) and 3. the own row
  for (int64_t i = 0; i <= nd; ++i) {
    const float* kr;
    const float* vr;
    float* kt = &vtmp[n * Dv];  // this tile slot's V row, kept until the flush
    if (i < nd) {
      const int64_t row = drows[i];
      if (row < 0) continue;
      const T* k = pk + (row * H + h) * D;
      const T* v = pv + (row * H + h) * Dv;
      for (int64_t d = 0; d < D; ++d) kbuf[d] = static_cast<float>(k[d]);
      for (int64_t d = 0; d < Dv; ++d) kt[d] = static_cast<float>(v[d]);
      kr = kbuf.data();
      vr = kt;
    } else {
      if (ok == nullptr) break;
      kr = ok + h * D;
      vr = ov + h * Dv;
    }
    for (int64_t g = 0; g < G; ++g) s[g * TILE + n] = finish_score(dot(q + g * D, kr, D));
    vcell[n] = nullptr;
    vrow[n] = vr;
    if (++n == TILE) flush();
  }
  flush();
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    if (rv == nullptr) {
      for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = acc[g * Dv + d] * inv;
    } else {  // o @ R_v^T: back from the rotated space (paged.attend's unrotate)
      for (int64_t d = 0; d < Dv; ++d) acc[g * Dv + d] *= inv;
      for (int64_t e = 0; e < Dv; ++e) out[g * Dv + e] = dot(&acc[g * Dv], rv + e * Dv, Dv);
    }
  }
}

#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__)
// ---- the vector path (AVX2 + FMA + F16C): the same sums, 8 dims at a time ----
// Every packed cell is read and dequantized once for the G query heads of its KV head (up to 4 heads per
// pass, their accumulators in registers); the codes -> float conversion happens inside the dot; the value
// pass runs dims-outer over a tile of tokens so each head's accumulator chunk stays in a register; the
// softmax's exp is an 8-wide polynomial (relative error ~1e-7, as std::exp within the test tolerance).
#define LOWBIT_PAGED_VEC 1
namespace vec {

// the 4 horizontal sums of a, b, c, d
inline __m128 hsum4(__m256 a, __m256 b, __m256 c, __m256 d) {
  const __m256 ab = _mm256_hadd_ps(a, b), cd = _mm256_hadd_ps(c, d);
  const __m256 x = _mm256_hadd_ps(ab, cd);  // a0123 b0123 c0123 d0123 | a4567 b4567 c4567 d4567
  return _mm_add_ps(_mm256_castps256_ps128(x), _mm256_extractf128_ps(x, 1));
}

// exp(x) for x <= 0 (softmax arguments): 2^n * p(r), r = x - n ln2 in [-ln2/2, ln2/2], degree-6 polynomial
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(x, _mm256_set1_ps(-87.0f));  // below: ~1e-38, as good as 0 next to the tile max's 1
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i e = _mm256_slli_epi32(_mm256_add_epi32(_mm256_cvtps_epi32(n), _mm256_set1_epi32(127)), 23);
  return _mm256_mul_ps(p, _mm256_castsi256_ps(e));
}

inline float half_at(const uint8_t* p) {
  uint16_t b;
  std::memcpy(&b, p, 2);
  return _cvtsh_ss(b);
}

// 8 consecutive dims of a row in any of the pool's float dtypes
inline __m256 load8(const float* p) { return _mm256_loadu_ps(p); }
inline __m256 load8(const c10::BFloat16* p) {
  const __m256i x = _mm256_cvtepu16_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
  return _mm256_castsi256_ps(_mm256_slli_epi32(x, 16));
}
inline __m256 load8(const c10::Half* p) {
  return _mm256_cvtph_ps(_mm_loadu_si128(reinterpret_cast<const __m128i*>(p)));
}

// dims 8u..8u+7 of a strided row (byte j holds dims j + i*S): 8 bytes from `at` = codes + j, shifted by i*CB
struct Chunk {
  int64_t at;
  __m128i shift;
};
template <int CB>
inline __m256 codes8(const uint8_t* codes, const Chunk& c) {
  __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + c.at)));
  if (CB < 8) x = _mm256_and_si256(_mm256_srl_epi32(x, c.shift), _mm256_set1_epi32((1 << CB) - 1));
  return _mm256_cvtepi32_ps(x);
}

template <int CB>
std::vector<Chunk> chunks_of(int64_t dim) {
  const int64_t S = dim / (8 / CB);
  std::vector<Chunk> out(dim / 8);
  for (int64_t u = 0; u < dim / 8; ++u) {
    const int64_t d = 8 * u, i = d / S;
    out[u] = Chunk{d - i * S, _mm_cvtsi32_si128(static_cast<int>(i * CB))};
  }
  return out;
}

// scores of one packed token for query heads g0..g0+NH-1: sum_k s_k (q_g . c_k) + z_k sum(q_g,k), into s[g*TILE]
template <int CB, int NH>
inline void score_packed(const uint8_t* codes, const Chunk* ch, const float* q, int64_t D, int64_t cpg, int64_t ngk,
                         const float* ks, const float* kz, const float* qsum, float* s, int64_t tile) {
  float tot[4] = {0.f, 0.f, 0.f, 0.f};
  for (int64_t k = 0; k < ngk; ++k) {
    __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
    for (int64_t u = k * cpg; u < (k + 1) * cpg; ++u) {
      const __m256 c = codes8<CB>(codes, ch[u]);
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 8 * u), c, a0);
      if (NH > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + 8 * u), c, a1);
      if (NH > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + 8 * u), c, a2);
      if (NH > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * D + 8 * u), c, a3);
    }
    alignas(16) float h[4];
    _mm_store_ps(h, hsum4(a0, a1, a2, a3));
    for (int g = 0; g < NH; ++g) tot[g] += h[g] * ks[k] + qsum[g * ngk + k] * kz[k];
  }
  for (int g = 0; g < NH; ++g) s[g * tile] = tot[g];
}

// one group per head (group == D): the P lanes of a byte are unpacked from one load -- dims j..j+7 of every
// lane i (i * S + j) from bytes j..j+7, lane i's codes the bits [i*CB, (i+1)*CB) -- and go to one accumulator
template <int CB, int NH>
inline void score_packed1(const uint8_t* codes, const float* q, int64_t D, float ks, float kz, const float* qsum,
                          float* s, int64_t tile) {
  constexpr int P = 8 / CB;
  const int64_t S = D / P;
  const __m256i mask = _mm256_set1_epi32((1 << CB) - 1);
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t j = 0; j < S; j += 8) {
    const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(codes + j)));
#pragma GCC unroll 4
    for (int i = 0; i < P; ++i) {
      __m256i xi = i == 0 ? x : _mm256_srli_epi32(x, i * CB);
      if (i < P - 1) xi = _mm256_and_si256(xi, mask);
      const __m256 c = _mm256_cvtepi32_ps(xi);
      const float* qd = q + i * S + j;
      a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qd), c, a0);
      if (NH > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(qd + D), c, a1);
      if (NH > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(qd + 2 * D), c, a2);
      if (NH > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(qd + 3 * D), c, a3);
    }
  }
  alignas(16) float h[4];
  _mm_store_ps(h, hsum4(a0, a1, a2, a3));
  for (int g = 0; g < NH; ++g) s[g * tile] = h[g] * ks + qsum[g] * kz;
}

// acc[g, :] += sum_t w[g, t] * codes_t (one group per head) over a tile's n cells, lanes unpacked from one load
template <int CB, int NH>
inline void accumulate_codes1(int n, const uint8_t* const* cells, int64_t off, int64_t Dv, const float* w,
                              int64_t tile, float* acc) {
  constexpr int P = 8 / CB;
  const int64_t S = Dv / P;
  const __m256i mask = _mm256_set1_epi32((1 << CB) - 1);
  for (int64_t j = 0; j < S; j += 8) {
    __m256 a[NH][P];
    for (int g = 0; g < NH; ++g)
      for (int i = 0; i < P; ++i) a[g][i] = _mm256_loadu_ps(acc + g * Dv + i * S + j);
    for (int t = 0; t < n; ++t) {
      const __m256i x = _mm256_cvtepu8_epi32(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(cells[t] + off + j)));
      __m256 wt[NH];
      for (int g = 0; g < NH; ++g) wt[g] = _mm256_broadcast_ss(w + g * tile + t);
#pragma GCC unroll 4
      for (int i = 0; i < P; ++i) {
        __m256i xi = i == 0 ? x : _mm256_srli_epi32(x, i * CB);
        if (i < P - 1) xi = _mm256_and_si256(xi, mask);
        const __m256 c = _mm256_cvtepi32_ps(xi);
        for (int g = 0; g < NH; ++g) a[g][i] = _mm256_fmadd_ps(wt[g], c, a[g][i]);
      }
    }
    for (int g = 0; g < NH; ++g)
      for (int i = 0; i < P; ++i) _mm256_storeu_ps(acc + g * Dv + i * S + j, a[g][i]);
  }
}

// scores of one dense row (any float dtype) for query heads g0..g0+NH-1
template <typename U, int NH>
inline void score_row(const U* k, const float* q, int64_t D, float* s, int64_t tile) {
  __m256 a0 = _mm256_setzero_ps(), a1 = a0, a2 = a0, a3 = a0;
  for (int64_t d = 0; d < D; d += 8) {
    const __m256 c = load8(k + d);
    a0 = _mm256_fmadd_ps(_mm256_loadu_ps(q + d), c, a0);
    if (NH > 1) a1 = _mm256_fmadd_ps(_mm256_loadu_ps(q + D + d), c, a1);
    if (NH > 2) a2 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 2 * D + d), c, a2);
    if (NH > 3) a3 = _mm256_fmadd_ps(_mm256_loadu_ps(q + 3 * D + d), c, a3);
  }
  alignas(16) float h[4];
  _mm_store_ps(h, hsum4(a0, a1, a2, a3));
  for (int g = 0; g < NH; ++g) s[g * tile] = h[g];
}

// acc[g, 8u..] += sum_t w[g, k(u), t] * x_t[8u..] over a tile's n tokens, for heads g0..g0+NH-1; `get(t, u)`
// gives token t's 8 values of chunk u, w[(g * ngv + k) * tile + t] the weight (p, or p * scale for codes)
template <int NH, typename Get>
inline void accumulate(int n, int64_t nchunks, int64_t cpg, int64_t ngv, const float* w, int64_t tile, float* acc,
                       int64_t Dv, Get get) {
  for (int64_t u = 0; u < nchunks; ++u) {
    const int64_t k = u / cpg;
    float* a = acc + 8 * u;
    __m256 a0 = _mm256_loadu_ps(a), a1 = a0, a2 = a0, a3 = a0;
    if (NH > 1) a1 = _mm256_loadu_ps(a + Dv);
    if (NH > 2) a2 = _mm256_loadu_ps(a + 2 * Dv);
    if (NH > 3) a3 = _mm256_loadu_ps(a + 3 * Dv);
    const float* w0 = w + k * tile;
    const int64_t gs = ngv * tile;
    for (int t = 0; t < n; ++t) {
      const __m256 x = get(t, u);
      a0 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + t), x, a0);
      if (NH > 1) a1 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + gs + t), x, a1);
      if (NH > 2) a2 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + 2 * gs + t), x, a2);
      if (NH > 3) a3 = _mm256_fmadd_ps(_mm256_broadcast_ss(w0 + 3 * gs + t), x, a3);
    }
    _mm256_storeu_ps(a, a0);
    if (NH > 1) _mm256_storeu_ps(a + Dv, a1);
    if (NH > 2) _mm256_storeu_ps(a + 2 * Dv, a2);
    if (NH > 3) _mm256_storeu_ps(a + 3 * Dv, a3);
  }
}

// heads in passes of up to 4: f(g0, integral_constant<NH>)
template <typename F>
inline void by_heads(int64_t G, F f) {
  for (int64_t g0 = 0; g0 < G; g0 += 4) {
    switch (std::min<int64_t>(4, G - g0)) {
      case 1: f(g0, std::integral_constant<int, 1>{}); break;
      case 2: f(g0, std::integral_constant<int, 2>{}); break;
      case 3: f(g0, std::integral_constant<int, 3>{}); break;
      default: f(g0, std::integral_constant<int, 4>{}); break;
    }
  }
}

// true when this layout can take the vector path: every 8-dim chunk inside one group and one strided lane
inline bool fits(int64_t D, int64_t Dv, const Field& fk, const Field& fv) {
  auto ok = [](const Field& f, int64_t dim) {
    const int64_t S = dim / (8 / f.cbits);
    return dim % 8 == 0 && f.group % 8 == 0 && S % 8 == 0 && dim % f.group == 0;
  };
  return ok(fk, D) && ok(fv, Dv);
}

constexpr int VT = 32;  // tokens per tile

template <typename T, int CBK, int CBV>
void decode_one(int64_t h, const float* q /*[G,D]*/, int64_t G, int64_t D, int64_t Dv, const uint8_t* cache,
                int64_t H, int64_t bs, int64_t C, const int64_t* ids, int64_t nb, int64_t b0, int64_t lo, int64_t hi,
                const Field& fk, const Field& fv, const T* pk, const T* pv, const int64_t* drows, int64_t nd,
                const float* ok, const float* ov, float scale, float softcap, float* out /*[G,Dv]*/,
                const float* rk /*[D,D] or null*/, const float* rv /*[Dv,Dv] or null*/) {
  const int64_t ngk = D / fk.group, ngv = Dv / fv.group, cpk = fk.group / 8, cpv = fv.group / 8;
  std::vector<float> qrot;
  if (rk != nullptr) {  // q @ R_k, the rotation the cache's rows carry
    qrot.assign(G * D, 0.f);
    for (int64_t g = 0; g < G; ++g)
      for (int64_t d = 0; d < D; ++d) {
        const float x = q[g * D + d];
        const float* __restrict rr = rk + d * D;
        float* __restrict o = &qrot[g * D];
        for (int64_t e = 0; e < D; ++e) o[e] += x * rr[e];
      }
    q = qrot.data();
  }
  const std::vector<Chunk> chk = chunks_of<CBK>(D), chv = chunks_of<CBV>(Dv);
  std::vector<float> qsum(G * ngk), m(G, -std::numeric_limits<float>::infinity()), l(G, 0.f), acc(G * Dv, 0.f);
  std::vector<float> s(G * VT, 0.f), w(G * ngv * VT, 0.f), zv(VT * ngv), sv(VT * ngv), ks(ngk), kz(ngk);
  std::vector<const uint8_t*> vcell(VT);
  std::vector<const T*> vrow(VT);
  for (int64_t g = 0; g < G; ++g)
    for (int64_t k = 0; k < ngk; ++k) {
      float a = 0.f;
      for (int64_t d = k * fk.group; d < (k + 1) * fk.group; ++d) a += q[g * D + d];
      qsum[g * ngk + k] = a;
    }
  int n = 0;
  // kind of the tile's tokens: 0 packed cells, 1 pool rows (T), 2 the own row (float)
  auto flush = [&](int kind, const float* own_v) {
    if (n == 0) return;
    const __m256 vscale = _mm256_set1_ps(scale);
    for (int64_t g = 0; g < G; ++g) {
      float* sg = &s[g * VT];
      for (int t = 0; t < n; t += 8) _mm256_storeu_ps(sg + t, _mm256_mul_ps(_mm256_loadu_ps(sg + t), vscale));
      if (softcap > 0.f)
        for (int t = 0; t < n; ++t) sg[t] = softcap * std::tanh(sg[t] / softcap);
      float mx = m[g];
      for (int t = 0; t < n; ++t) mx = std::max(mx, sg[t]);
      const float alpha = std::isinf(m[g]) ? 0.f : std::exp(m[g] - mx);
      m[g] = mx;
      const __m256 vmx = _mm256_set1_ps(mx);
      __m256 sum = _mm256_setzero_ps();
      for (int t = 0; t < n; t += 8) {
        __m256 p = exp8(_mm256_sub_ps(_mm256_loadu_ps(sg + t), vmx));
        if (n - t < 8) {  // the tile's tail: lanes past n weigh 0
          const __m256i lane = _mm256_setr_epi32(0, 1, 2, 3, 4, 5, 6, 7);
          p = _mm256_and_ps(p, _mm256_castsi256_ps(_mm256_cmpgt_epi32(_mm256_set1_epi32(n - t), lane)));
        }
        _mm256_storeu_ps(sg + t, p);
        sum = _mm256_add_ps(sum, p);
      }
      const __m128 s4 = _mm_add_ps(_mm256_castps256_ps128(sum), _mm256_extractf128_ps(sum, 1));
      const __m128 s2 = _mm_add_ps(s4, _mm_movehl_ps(s4, s4));
      l[g] = l[g] * alpha + _mm_cvtss_f32(_mm_add_ss(s2, _mm_shuffle_ps(s2, s2, 1)));
      float* ag = &acc[g * Dv];
      if (alpha != 1.f)
        for (int64_t d = 0; d < Dv; ++d) ag[d] *= alpha;
      if (kind == 0) {  // codes: weights p * scale per V group, and the zeros' share sum_t p z_t added once
        for (int64_t k = 0; k < ngv; ++k) {
          float zt = 0.f;
          float* wk = &w[(g * ngv + k) * VT];
          for (int t = 0; t < n; ++t) {
            wk[t] = sg[t] * sv[t * ngv + k];
            zt += sg[t] * zv[t * ngv + k];
          }
          for (int64_t d = k * fv.group; d < (k + 1) * fv.group; ++d) ag[d] += zt;
        }
      } else {
        std::memcpy(&w[g * ngv * VT], sg, VT * sizeof(float));  // ngv is only read as a stride below
      }
    }
    if (kind == 0) {
      if (ngv == 1) {
        by_heads(G, [&](int64_t g0, auto nh) {
          accumulate_codes1<CBV, decltype(nh)::value>(n, vcell.data(), fv.codes, Dv, &w[g0 * VT], VT, &acc[g0 * Dv]);
        });
      } else {
        by_heads(G, [&](int64_t g0, auto nh) {
          accumulate<decltype(nh)::value>(n, Dv / 8, cpv, ngv, &w[g0 * ngv * VT], VT, &acc[g0 * Dv], Dv,
                                          [&](int t, int64_t u) { return codes8<CBV>(vcell[t] + fv.codes, chv[u]); });
        });
      }
    } else if (kind == 1) {
      by_heads(G, [&](int64_t g0, auto nh) {
        accumulate<decltype(nh)::value>(n, Dv / 8, Dv / 8, ngv, &w[g0 * ngv * VT], VT, &acc[g0 * Dv], Dv,
                                        [&](int t, int64_t u) { return load8(vrow[t] + 8 * u); });
      });
    } else {
      by_heads(G, [&](int64_t g0, auto nh) {
        accumulate<decltype(nh)::value>(n, Dv / 8, Dv / 8, ngv, &w[g0 * ngv * VT], VT, &acc[g0 * Dv], Dv,
                                        [&](int, int64_t u) { return _mm256_loadu_ps(own_v + 8 * u); });
      });
    }
    n = 0;
  };
  // 1. packed middle
  for (int64_t j = 0; j < nb; ++j) {
    const int64_t base = (b0 + j) * bs;
    const int64_t t0 = std::max<int64_t>(0, lo - base), t1 = std::min<int64_t>(bs, hi - base);
    for (int64_t t = t0; t < t1; ++t) {
      const uint8_t* cell = cache + ((ids[j] * H + h) * bs + t) * C;
      for (int64_t k = 0; k < ngk; ++k) {
        ks[k] = half_at(cell + fk.scale + 2 * k);
        kz[k] = half_at(cell + fk.zero + 2 * k);
      }
      if (ngk == 1) {
        by_heads(G, [&](int64_t g0, auto nh) {
          score_packed1<CBK, decltype(nh)::value>(cell + fk.codes, q + g0 * D, D, ks[0], kz[0], &qsum[g0],
                                                  &s[g0 * VT + n], VT);
        });
      } else {
        by_heads(G, [&](int64_t g0, auto nh) {
          score_packed<CBK, decltype(nh)::value>(cell + fk.codes, chk.data(), q + g0 * D, D, cpk, ngk, ks.data(),
                                                 kz.data(), &qsum[g0 * ngk], &s[g0 * VT + n], VT);
        });
      }
      for (int64_t k = 0; k < ngv; ++k) {
        sv[n * ngv + k] = half_at(cell + fv.scale + 2 * k);
        zv[n * ngv + k] = half_at(cell + fv.zero + 2 * k);
      }
      vcell[n] = cell;
      if (++n == VT) flush(0, nullptr);
    }
  }
  flush(0, nullptr);
  // 2. dense rows (pool)
  for (int64_t i = 0; i < nd; ++i) {
    const int64_t row = drows[i];
    if (row < 0) continue;
    const T* k = pk + (row * H + h) * D;
    by_heads(G, [&](int64_t g0, auto nh) { score_row<T, decltype(nh)::value>(k, q + g0 * D, D, &s[g0 * VT + n], VT); });
    vrow[n] = pv + (row * H + h) * Dv;
    if (++n == VT) flush(1, nullptr);
  }
  flush(1, nullptr);
  // 3. the own row
  if (ok != nullptr) {
    by_heads(G, [&](int64_t g0, auto nh) {
      score_row<float, decltype(nh)::value>(ok + h * D, q + g0 * D, D, &s[g0 * VT], VT);
    });
    n = 1;
    flush(2, ov + h * Dv);
  }
  for (int64_t g = 0; g < G; ++g) {
    const float inv = l[g] > 0.f ? 1.f / l[g] : 0.f;
    if (rv == nullptr) {
      for (int64_t d = 0; d < Dv; ++d) out[g * Dv + d] = acc[g * Dv + d] * inv;
    } else {  // o @ R_v^T: back from the rotated space
      for (int64_t d = 0; d < Dv; ++d) acc[g * Dv + d] *= inv;
      for (int64_t e = 0; e < Dv; ++e) out[g * Dv + e] = dot(&acc[g * Dv], rv + e * Dv, Dv);
    }
  }
}

}  // namespace vec
#endif

}  // namespace

// q float (any float dtype) [R,H,G,D], unrotated when rot_k is given; cache uint8 [NB,H,bs,C]; mid_ids int64 [R,nb]; mid int64 [R,3] (b0, lo, hi);
// meta int64 [12] (k: codes, scale, zero, cbits, group, dim; v: same); pool_k/pool_v [rows,H,D] (any
// float dtype, may be empty); dense_rows int64 [R,nd]; own_k/own_v float [R,H,D] (empty: none);
// rot_k [D,D] / [H,D,D] (empty: q is already rotated); rot_v likewise (empty: the output stays rotated).
torch::Tensor paged_decode_impl(torch::Tensor q, torch::Tensor cache, torch::Tensor mid_ids, torch::Tensor mid,
                                torch::Tensor meta, torch::Tensor pool_k, torch::Tensor pool_v,
                                torch::Tensor dense_rows, torch::Tensor own_k, torch::Tensor own_v, double scale,
                                double softcap, torch::Tensor rot_k, torch::Tensor rot_v, bool scalar) {
  TORCH_CHECK(q.is_floating_point() && q.dim() == 4, "q: float [R,H,G,D]");
  q = q.to(torch::kFloat32).contiguous();
  TORCH_CHECK(cache.dtype() == torch::kUInt8 && cache.dim() == 4 && cache.is_contiguous(), "cache: uint8 [NB,H,bs,C]");
  TORCH_CHECK(mid_ids.dtype() == torch::kInt64 && mid_ids.is_contiguous() && mid.is_contiguous(), "mid: int64");
  TORCH_CHECK(dense_rows.dtype() == torch::kInt64 && dense_rows.is_contiguous(), "dense_rows: int64 [R,nd]");
  const int64_t R = q.size(0), H = q.size(1), G = q.size(2), D = q.size(3);
  const int64_t bs = cache.size(2), C = cache.size(3), nb = mid_ids.size(1), nd = dense_rows.size(1);
  auto mt = meta.to(torch::kInt64).contiguous();
  const int64_t* mm = mt.data_ptr<int64_t>();
  const Field fk{mm[0], mm[1], mm[2], mm[3], mm[4], mm[5]}, fv{mm[6], mm[7], mm[8], mm[9], mm[10], mm[11]};
  for (const Field* f : {&fk, &fv})
    TORCH_CHECK(f->cbits == 2 || f->cbits == 4 || f->cbits == 8, "container bits must be 2, 4 or 8");
  TORCH_CHECK(fk.dim == D, "K head_dim differs from q");
  const int64_t Dv = fv.dim;
  auto out = torch::zeros({R, H, G, Dv}, q.options());
  // rotations: empty (none), [D,D] for every head, or [H,D,D] per KV head
  auto rkc = rot_k.numel() ? rot_k.to(torch::kFloat32).contiguous() : rot_k;
  auto rvc = rot_v.numel() ? rot_v.to(torch::kFloat32).contiguous() : rot_v;
  TORCH_CHECK(!rot_k.numel() || (rkc.size(-1) == D && rkc.size(-2) == D && (rkc.dim() == 2 || (rkc.dim() == 3 && rkc.size(0) == H))),
              "rot_k: [D,D] or [H,D,D]");
  TORCH_CHECK(!rot_v.numel() || (rvc.size(-1) == fv.dim && rvc.size(-2) == fv.dim && (rvc.dim() == 2 || (rvc.dim() == 3 && rvc.size(0) == H))),
              "rot_v: [Dv,Dv] or [H,Dv,Dv]");
  const float* rkp = rot_k.numel() ? rkc.data_ptr<float>() : nullptr;
  const float* rvp = rot_v.numel() ? rvc.data_ptr<float>() : nullptr;
  const int64_t rks = (rot_k.numel() && rkc.dim() == 3) ? D * D : 0;
  const int64_t rvs = (rot_v.numel() && rvc.dim() == 3) ? fv.dim * fv.dim : 0;
  const bool has_own = own_k.numel() > 0;
  auto okc = has_own ? own_k.to(torch::kFloat32).contiguous() : own_k;
  auto ovc = has_own ? own_v.to(torch::kFloat32).contiguous() : own_v;
  auto pkc = pool_k.contiguous(), pvc = pool_v.contiguous();
  const uint8_t* cp = cache.data_ptr<uint8_t>();
  const int64_t* idp = mid_ids.data_ptr<int64_t>();
  const int64_t* mp = mid.data_ptr<int64_t>();
  const int64_t* dp = dense_rows.data_ptr<int64_t>();
  const float* qp = q.data_ptr<float>();
  float* op = out.data_ptr<float>();
  const float* okp = has_own ? okc.data_ptr<float>() : nullptr;
  const float* ovp = has_own ? ovc.data_ptr<float>() : nullptr;
  AT_DISPATCH_FLOATING_TYPES_AND2(at::kBFloat16, at::kHalf, pkc.scalar_type(), "paged_decode", [&] {
    const scalar_t* pk = pkc.numel() ? pkc.data_ptr<scalar_t>() : nullptr;
    const scalar_t* pv = pvc.numel() ? pvc.data_ptr<scalar_t>() : nullptr;
    auto one = [&](auto ck, auto cv) {
      constexpr int CK = decltype(ck)::value, CV = decltype(cv)::value;
#ifdef LOWBIT_PAGED_VEC
      if (!scalar && !std::is_same<scalar_t, double>::value && vec::fits(D, Dv, fk, fv)) {
        using VT = std::conditional_t<std::is_same<scalar_t, double>::value, float, scalar_t>;  // double: never here
        const VT* vpk = reinterpret_cast<const VT*>(pk);
        const VT* vpv = reinterpret_cast<const VT*>(pv);
        at::parallel_for(0, R * H, 1, [&](int64_t a, int64_t b) {
          for (int64_t x = a; x < b; ++x) {
            const int64_t r = x / H, h = x % H;
            vec::decode_one<VT, CK, CV>(h, qp + (r * H + h) * G * D, G, D, Dv, cp, H, bs, C, idp + r * nb, nb,
                                        mp[r * 3], mp[r * 3 + 1], mp[r * 3 + 2], fk, fv, vpk, vpv, dp + r * nd,
                                        pk ? nd : 0, okp ? okp + r * H * D : nullptr,
                                        ovp ? ovp + r * H * Dv : nullptr, static_cast<float>(scale),
                                        static_cast<float>(softcap), op + (r * H + h) * G * Dv,
                                        rkp ? rkp + h * rks : nullptr, rvp ? rvp + h * rvs : nullptr);
          }
        });
        return;
      }
#endif
      at::parallel_for(0, R * H, 1, [&](int64_t a, int64_t b) {
        for (int64_t x = a; x < b; ++x) {
          const int64_t r = x / H, h = x % H;
          decode_one<scalar_t, CK, CV>(r, h, qp + (r * H + h) * G * D, G, D, Dv, cp, H, bs, C, idp + r * nb, nb,
                                       mp[r * 3], mp[r * 3 + 1], mp[r * 3 + 2], fk, fv, pk, pv, dp + r * nd,
                                       pk ? nd : 0, okp ? okp + r * H * D : nullptr, ovp ? ovp + r * H * Dv : nullptr,
                                       static_cast<float>(scale), static_cast<float>(softcap),
                                       op + (r * H + h) * G * Dv, rkp ? rkp + h * rks : nullptr,
                                       rvp ? rvp + h * rvs : nullptr);
        }
      });
    };
    using I2 = std::integral_constant<int, 2>;
    using I4 = std::integral_constant<int, 4>;
    using I8 = std::integral_constant<int, 8>;
    auto with_v = [&](auto ck) {
      if (fv.cbits == 2) one(ck, I2{});
      else if (fv.cbits == 4) one(ck, I4{});
      else one(ck, I8{});
    };
    if (fk.cbits == 2) with_v(I2{});
    else if (fk.cbits == 4) with_v(I4{});
    else with_v(I8{});
  });
  return out;
}

// The arena pool rows of a step's dense tier positions: slot_map int64 [num block ids] (block id -> pool
// slot, -1 absent), blk / off int64 [R,n] (block id and offset of each position), valid bool [R,n] ->
// (rows int64 [R,n]: slot * bs + off, -1 where not valid; the number of valid positions whose block holds
// no slot, i.e. paged.TierArena.missing without prefix caching). One op for what is ~12 in torch.
std::tuple<torch::Tensor, int64_t> dense_rows(torch::Tensor slot_map, torch::Tensor blk, torch::Tensor off,
                                              torch::Tensor valid, int64_t bs) {
  TORCH_CHECK(slot_map.dtype() == torch::kInt64 && blk.dtype() == torch::kInt64 && off.dtype() == torch::kInt64 &&
              valid.dtype() == torch::kBool, "dense_rows: int64 map / blk / off, bool valid");
  auto mc = slot_map.contiguous(), bc = blk.contiguous(), oc = off.contiguous(), vc = valid.contiguous();
  auto rows = torch::empty(blk.sizes(), blk.options());
  const int64_t n = blk.numel(), nm = mc.numel();
  const int64_t* mp = mc.data_ptr<int64_t>();
  const int64_t* bp = bc.data_ptr<int64_t>();
  const int64_t* opp = oc.data_ptr<int64_t>();
  const bool* vp = vc.data_ptr<bool>();
  int64_t* rp = rows.data_ptr<int64_t>();
  int64_t missing = 0;
  for (int64_t i = 0; i < n; ++i) {
    const int64_t b = bp[i];
    const int64_t s = (b >= 0 && b < nm) ? mp[b] : -1;
    if (!vp[i]) {
      rp[i] = -1;
    } else if (s < 0) {
      rp[i] = -1;
      ++missing;
    } else {
      rp[i] = s * bs + opp[i];
    }
  }
  return {rows, missing};
}

torch::Tensor paged_decode(torch::Tensor q, torch::Tensor cache, torch::Tensor mid_ids, torch::Tensor mid,
                           torch::Tensor meta, torch::Tensor pool_k, torch::Tensor pool_v,
                           torch::Tensor dense_rows, torch::Tensor own_k, torch::Tensor own_v, double scale,
                           double softcap, torch::Tensor rot_k, torch::Tensor rot_v) {
  return paged_decode_impl(q, cache, mid_ids, mid, meta, pool_k, pool_v, dense_rows, own_k, own_v, scale, softcap,
                           rot_k, rot_v, false);
}

// the same op on the scalar loop only (the reference the vector path is tested against; odd layouts run it)
torch::Tensor paged_decode_scalar(torch::Tensor q, torch::Tensor cache, torch::Tensor mid_ids, torch::Tensor mid,
                                  torch::Tensor meta, torch::Tensor pool_k, torch::Tensor pool_v,
                                  torch::Tensor dense_rows, torch::Tensor own_k, torch::Tensor own_v, double scale,
                                  double softcap, torch::Tensor rot_k, torch::Tensor rot_v) {
  return paged_decode_impl(q, cache, mid_ids, mid, meta, pool_k, pool_v, dense_rows, own_k, own_v, scale, softcap,
                           rot_k, rot_v, true);
}

// whether this build has the vector path (AVX2 + FMA + F16C at compile time)
bool has_vector_path() {
#ifdef LOWBIT_PAGED_VEC
  return true;
#else
  return false;
#endif
}

// whether paged_decode runs its vector path for this slot layout (meta as paged_decode's; this build's choice)
bool vector_layout(torch::Tensor meta) {
#ifdef LOWBIT_PAGED_VEC
  auto mt = meta.to(torch::kInt64).contiguous();
  const int64_t* mm = mt.data_ptr<int64_t>();
  const Field fk{mm[0], mm[1], mm[2], mm[3], mm[4], mm[5]}, fv{mm[6], mm[7], mm[8], mm[9], mm[10], mm[11]};
  return vec::fits(fk.dim, fv.dim, fk, fv);
#else
  return false;
#endif
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("paged_decode", &paged_decode, "lowbit fused paged decode (CPU)");
  m.def("paged_decode_scalar", &paged_decode_scalar, "lowbit fused paged decode, scalar loop only (CPU)");
  m.def("has_vector_path", &has_vector_path, "whether paged_decode has its AVX2 path");
  m.def("vector_layout", &vector_layout, "whether paged_decode takes its vector path for this slot layout");
  m.def("dense_rows", &dense_rows, "lowbit arena rows of dense tier positions (CPU)");
}
