// lowbit vLLM plugin: a decode step's few rows -> packed cells, the same bytes as SlotFormat.encode_rotated
// (TensorCodec.encode -> lowbit.quant.affine.quantize -> packing.pack "strided"), in one op.
//
// For the uniform min/max grid only (asymmetric or symmetric, any clip ratio), per-token groups, fp16
// scale / zero -- the codec's own float32 arithmetic step by step, so the bytes are identical
// (tests/serve/test_vllm_fused.py compares them on odd shapes):
//   lo, hi = min, max of the group (symmetric: amax = max |x|, center 0)
//   center = (lo + hi) * 0.5;  half = (hi - lo) * f32(0.5 * r)   (symmetric: half = amax * f32(r))
//   step = half * f32(2 / qmax);  scale = step (step 0, a constant group: the codec itself)
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
  int64_t bits, cbits, group, dim, symmetric, codes_off, scale_off, zero_off;
  float half_mul, step_mul;
};

inline uint16_t to_half(float f) { return c10::Half(f).x; }
inline float from_half(uint16_t h) { return static_cast<float>(c10::Half(h, c10::Half::from_bits())); }

// one row x [dim] -> its fields in `cell`; false on a non-finite value
bool encode_row(const float* x, const Quant& t, uint8_t* cell, uint8_t* codes) {
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
    float center, half;
    if (t.symmetric) {
      center = 0.f;
      half = amax * t.half_mul;
    } else {
      center = (lo + hi) * 0.5f;
      half = (hi - lo) * t.half_mul;
    }
    const float step = half * t.step_mul;
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
// (k then v) bits, cbits, group, dim, symmetric, codes / scale / zero offsets; mul float64 [4]: k half_mul,
// k step_mul, v half_mul, v step_mul (rounded to float32 here, as torch does for a python scalar) ->
// (cells uint8 [T,H,slot_bytes], ok). Pad bytes are zero.
std::tuple<torch::Tensor, bool> encode_cells(torch::Tensor kr, torch::Tensor vr, torch::Tensor meta,
                                             torch::Tensor mul, int64_t slot_bytes) {
  TORCH_CHECK(kr.dim() == 4 && vr.dim() == 4 && kr.size(0) == 1 && vr.size(0) == 1, "kr / vr: [1,H,T,D]");
  auto kc = kr.to(torch::kFloat32).contiguous(), vc = vr.to(torch::kFloat32).contiguous();
  auto mt = meta.to(torch::kInt64).contiguous();
  auto ml = mul.to(torch::kFloat64).contiguous();
  const int64_t* m = mt.data_ptr<int64_t>();
  const double* u = ml.data_ptr<double>();
  const Quant qk = quant_of(m, u[0], u[1]), qv = quant_of(m + 8, u[2], u[3]);
  const int64_t H = kc.size(1), T = kc.size(2);
  TORCH_CHECK(kc.size(3) == qk.dim && vc.size(3) == qv.dim && vc.size(1) == H && vc.size(2) == T, "dims");
  auto cells = torch::zeros({T, H, slot_bytes}, kr.options().dtype(torch::kUInt8));
  uint8_t* cp = cells.data_ptr<uint8_t>();
  const float* kp = kc.data_ptr<float>();
  const float* vp = vc.data_ptr<float>();
  std::vector<uint8_t> codes(std::max(qk.dim, qv.dim));
  for (int64_t t = 0; t < T; ++t)
    for (int64_t h = 0; h < H; ++h) {
      uint8_t* cell = cp + (t * H + h) * slot_bytes;
      if (!encode_row(kp + (h * T + t) * qk.dim, qk, cell, codes.data())) return {cells, false};
      if (!encode_row(vp + (h * T + t) * qv.dim, qv, cell, codes.data())) return {cells, false};
    }
  return {cells, true};
}

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("encode_cells", &encode_cells, "lowbit: rows -> packed cells, TensorCodec's bytes (CPU)");
}
