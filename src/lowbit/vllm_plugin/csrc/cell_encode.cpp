// lowbit vLLM plugin: a decode step's few rows -> packed cells, the same bytes as SlotFormat.encode_rotated
// (TensorCodec.encode -> lowbit.quant.affine.quantize -> packing.pack "strided"), in one op.
//
// For the uniform grids (min/max asymmetric or symmetric with any clip ratio; the std-placed grid), per-token
// groups, fp16 scale / zero -- the codec's own float32 arithmetic step by step, so the bytes are identical
// (tests/serve/test_vllm_fused.py compares them on odd shapes):
//   min/max: lo, hi = min, max of the group (symmetric: amax = max |x|, center 0)
//            center = (lo + hi) * 0.5;  half = (hi - lo) * f32(0.5 * r)   (symmetric: half = amax * f32(r))
//            step = half * f32(2 / qmax)
//   std:     center = mean, step = std * f32(unit_step), with mean / std (population) computed by torch itself
//            (encode_cells_std's stats: the codec's own reductions, whose summation order this file does not
//            mirror)
//   scale = step (step 0, a constant group: the codec itself)
//   scale: rounded to fp16 (nearest even), one fp16 step up if that fell below (affine._round_up)
//   zero = center - scale * (qmax * 0.5), rounded to fp16
//   codes = clamp(round_half_even((x - zero) / scale), 0, qmax)
// Built WITHOUT fast-math or FP contraction (cpu_kernel.load_encoder): an FMA or a reordered sum would
// change the bytes. Any non-finite input, scale or zero: returns ok = false and the caller runs the codec
// itself (whose checks-off arithmetic on NaN / inf this file does not mirror).
#include <torch/extension.h>
#include <c10/util/Half.h>

#include <cmath>
#include <cstring>
#include <tuple>
#include <vector>

namespace {

struct Quant {  // one tensor's (K or V) codec and where its fields sit in the cell
  int64_t bits, cbits, group, dim, mode /*0 min/max, 1 symmetric min/max, 2 std*/, codes_off, scale_off, zero_off;
  float half_mul, step_mul;
};

inline uint16_t to_half(float f) { return c10::Half(f).x; }
inline float from_half(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// one row x [dim] -> its fields in `cell`; false on a non-finite value. stat: the std grid's (mean, std) per
// group of this row, [2][ngroups] with stride `ss` between mean and std (null for the min/max grids)
bool encode_row(const float* x, const Quant& t, uint8_t* cell, uint8_t* codes, const float* stat, int64_t ss) {
  const int64_t qmax = (int64_t{1} << t.bits) - 1;
  const float fq = static_cast<float>(qmax);
  const float mid = static_cast<float>(qmax) * 0.5f;
  const int64_t g = t.group, ng = t.dim / g;
  for (int64_t k = 0; k < ng; ++k) {
    const float* xg = x + k * g;
    float lo = xg[0], hi = xg[0], amax = std::fabs(xg[0]);
    for (int64_t i = 0; i < g; ++i) {
      const float v = xg[i];
      if (!std::isfinite(v)) return false;
      lo = v < lo ? v : lo;
      hi = v > hi ? v : hi;
      const float a = std::fabs(v);
      amax = a > amax ? a : amax;
    }
    float center, step;
    if (t.mode == 2) {
      center = stat[k];
      step = stat[ss + k] * t.step_mul;
      if (!std::isfinite(center) || !std::isfinite(step)) return false;
    } else if (t.mode == 1) {
      center = 0.f;
      step = (amax * t.half_mul) * t.step_mul;
    } else {
      center = (lo + hi) * 0.5f;
      step = ((hi - lo) * t.half_mul) * t.step_mul;
    }
    // a constant group (step 0) goes to the codec: its zero is the center, whose sign for an all-zero group
    // (-0 or +0) follows torch's min / max, which this file does not mirror
    if (!(step > 0.f)) return false;
    float scale = step;
    uint16_t sh = to_half(scale);
    if (from_half(sh) < scale) sh = static_cast<uint16_t>(sh + 1);  // nextafter toward +inf (scale > 0)
    scale = from_half(sh);
    const float prod = scale * mid;
    float zero = center - prod;
    const uint16_t zh = to_half(zero);
    zero = from_half(zh);
    if (!std::isfinite(scale) || !std::isfinite(zero)) return false;
    for (int64_t i = 0; i < g; ++i) {
      const float d = xg[i] - zero;
      float c = std::nearbyint(d / scale);
      c = c < 0.f ? 0.f : (c > fq ? fq : c);
      codes[k * g + i] = static_cast<uint8_t>(c);
    }
    std::memcpy(cell + t.scale_off + 2 * k, &sh, 2);
    std::memcpy(cell + t.zero_off + 2 * k, &zh, 2);
  }
  uint8_t* out = cell + t.codes_off;
  if (t.cbits == 8) {
    std::memcpy(out, codes, t.dim);
  } else {  // "strided": byte j holds dims j + i*S in bits [i*cbits, (i+1)*cbits)
    const int64_t P = 8 / t.cbits, S = t.dim / P;
    for (int64_t j = 0; j < S; ++j) {
      uint8_t b = 0;
      for (int64_t i = 0; i < P; ++i) b |= static_cast<uint8_t>(codes[i * S + j] << (i * t.cbits));
      out[j] = b;
    }
  }
  return true;
}

Quant quant_of(const int64_t* m, double half_mul, double step_mul) {
  return Quant{m[0], m[1], m[2], m[3], m[4], m[5], m[6], m[7], static_cast<float>(half_mul),
               static_cast<float>(step_mul)};
}

}  // namespace

// kr [1,H,T,Dk], vr [1,H,T,Dv] (any float dtype: the codec quantizes x.float()); meta int64 [16]: per tensor
// (k then v) bits, cbits, group, dim, mode (0 min/max, 1 symmetric min/max, 2 std), codes / scale / zero offsets;
// mul float64 [4]: k half_mul, k step_mul, v half_mul, v step_mul (the std grid: unused, unit_step), rounded to
// float32 here, as torch does for a python scalar ->
// (cells uint8 [T,H,slot_bytes], ok). Pad bytes are zero.
// cache (optional, uint8 [NB,H,bs,slot_bytes] contiguous): the cells go straight to cache[blk[t], h, off[t]] and
// the returned cells are empty; a declined write may leave some of those cells half written (the caller's codec
// write then replaces them all)
std::tuple<torch::Tensor, bool> encode_impl(torch::Tensor kr, torch::Tensor vr, torch::Tensor kstat, torch::Tensor vstat,
                                            torch::Tensor meta, torch::Tensor mul, int64_t slot_bytes,
                                            torch::Tensor cache, torch::Tensor blk, torch::Tensor off) {
  TORCH_CHECK(kr.dim() == 4 && vr.dim() == 4 && kr.size(0) == 1 && vr.size(0) == 1, "kr / vr: [1,H,T,D]");
  auto kc = kr.to(torch::kFloat32).contiguous(), vc = vr.to(torch::kFloat32).contiguous();
  auto mt = meta.to(torch::kInt64).contiguous();
  auto ml = mul.to(torch::kFloat64).contiguous();
  const int64_t* m = mt.data_ptr<int64_t>();
  const double* u = ml.data_ptr<double>();
  const Quant qk = quant_of(m, u[0], u[1]), qv = quant_of(m + 8, u[2], u[3]);
  const int64_t H = kc.size(1), T = kc.size(2);
  TORCH_CHECK(kc.size(3) == qk.dim && vc.size(3) == qv.dim && vc.size(1) == H && vc.size(2) == T, "dims");
  const bool direct = cache.numel() > 0;
  torch::Tensor cells, bc, oc;
  uint8_t* cp = nullptr;
  const int64_t* bp = nullptr;
  const int64_t* op = nullptr;
  int64_t bs = 0;
  if (direct) {
    TORCH_CHECK(cache.dtype() == torch::kUInt8 && cache.dim() == 4 && cache.is_contiguous() && cache.size(1) == H &&
                cache.size(3) == slot_bytes, "cache: uint8 [NB,H,bs,slot_bytes]");
    bc = blk.to(torch::kInt64).contiguous();
    oc = off.to(torch::kInt64).contiguous();
    TORCH_CHECK(bc.numel() == T && oc.numel() == T, "blk / off: [T]");
    bp = bc.data_ptr<int64_t>();
    op = oc.data_ptr<int64_t>();
    bs = cache.size(2);
    for (int64_t t = 0; t < T; ++t)
      TORCH_CHECK(bp[t] >= 0 && bp[t] < cache.size(0) && op[t] >= 0 && op[t] < bs, "blk / off outside the cache");
    cells = torch::empty({0}, kr.options().dtype(torch::kUInt8));
    cp = cache.data_ptr<uint8_t>();
  } else {
    cells = torch::zeros({T, H, slot_bytes}, kr.options().dtype(torch::kUInt8));
    cp = cells.data_ptr<uint8_t>();
  }
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  // the std grid's stats: float32 [2, 1, H, T, ngroups] (mean, std), contiguous
  auto stat_of = [&](torch::Tensor st, const Quant& q) -> torch::Tensor {
    if (q.mode != 2) return st;
    TORCH_CHECK(st.dtype() == torch::kFloat32 && st.is_contiguous() && st.numel() == 2 * H * T * (q.dim / q.group),
                "std stats: float32 [2,1,H,T,groups]");
    return st;
  };
  auto ks = stat_of(kstat, qk), vs = stat_of(vstat, qv);
  const float* ksp = qk.mode == 2 ? ks.data_ptr<float>() : nullptr;
  const float* vsp = qv.mode == 2 ? vs.data_ptr<float>() : nullptr;
  const int64_t ngk = qk.dim / qk.group, ngv = qv.dim / qv.group;
  std::vector<uint8_t> codes(std::max(qk.dim, qv.dim));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      uint8_t* cell = direct ? cp + ((bp[t] * H + h) * bs + op[t]) * slot_bytes : cp + (t * H + h) * slot_bytes;
      if (direct) std::memset(cell, 0, slot_bytes);  // pad bytes zero, as a fresh cell
      const int64_t row = h * T + t;
      if (!encode_row(kp + row * qk.dim, qk, cell, codes.data(), ksp ? ksp + row * ngk : nullptr, H * T * ngk))
        return {cells, false};
      if (!encode_row(vp + row * qv.dim, qv, cell, codes.data(), vsp ? vsp + row * ngv : nullptr, H * T * ngv))
        return {cells, false};
    }
  return {cells, true};
}

std::tuple<torch::Tensor, bool> encode_cells(torch::Tensor kr, torch::Tensor vr, torch::Tensor meta,
                                             torch::Tensor mul, int64_t slot_bytes) {
  auto m = meta.to(torch::kInt64).contiguous();
  TORCH_CHECK(m.data_ptr<int64_t>()[4] != 2 && m.data_ptr<int64_t>()[12] != 2, "the std grid needs encode_cells_std");
  auto none = torch::empty({0}, kr.options().dtype(torch::kFloat32));
  auto nb = torch::empty({0}, kr.options().dtype(torch::kUInt8));
  return encode_impl(kr, vr, none, none, meta, mul, slot_bytes, nb, nb, nb);
}

// kstat / vstat float32 [2,1,H,T,groups]: (mean, population std) of each group as torch computes them
// (TensorCodec's quantize_std reductions); empty for a min/max tensor
std::tuple<torch::Tensor, bool> encode_cells_std(torch::Tensor kr, torch::Tensor vr, torch::Tensor kstat,
                                                 torch::Tensor vstat, torch::Tensor meta, torch::Tensor mul,
                                                 int64_t slot_bytes) {
  auto nb = torch::empty({0}, kr.options().dtype(torch::kUInt8));
  return encode_impl(kr, vr, kstat, vstat, meta, mul, slot_bytes, nb, nb, nb);
}

// encode_cells / encode_cells_std written straight into the paged cache at (blk [T], off [T]) (no cells tensor,
// no index_put); kstat / vstat empty unless a tensor has the std grid -> ok (false: the codec must write them)
bool write_cells(torch::Tensor kr, torch::Tensor vr, torch::Tensor kstat, torch::Tensor vstat, torch::Tensor meta,
                 torch::Tensor mul, torch::Tensor cache, torch::Tensor blk, torch::Tensor off) {
  TORCH_CHECK(cache.numel() > 0, "write_cells: an empty cache");
  return std::get<1>(encode_impl(kr, vr, kstat, vstat, meta, mul, cache.size(3), cache, blk, off));
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_cells", &encode_cells, "lowbit: rows -> packed cells, TensorCodec's bytes (CPU)");
  m.def("encode_cells_std", &encode_cells_std, "lowbit: rows + torch's group stats -> packed cells, std grid (CPU)");
  m.def("write_cells", &write_cells, "lowbit: rows -> packed cells written into the paged cache (CPU)");
}
