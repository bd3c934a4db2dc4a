"""vLLM 0.26's KV-cache dtypes as `lowbit eval` peers: fake-quant with vLLM's own arithmetic.

vLLM's quantized KV kernels are CUDA/Triton-only, so their quality cannot be read through vLLM on a
CPU. Each peer here is a transformers DynamicCache (built from the model config, so sliding layers
keep their window) whose `update` writes what vLLM's store kernel would hold, dequantized the way
vLLM's read kernel dequantizes it, so the model's own attention sees the K/V that vLLM's attention
would see. Every function below names the vLLM 0.26.0 file and function it mirrors; the ports are
checked against vLLM's own code (its Triton kernels run in Triton's CPU interpreter, its Python
helpers run as they are) by tests/eval/test_peers_vllm.py on the values in
tests/eval/fixtures/vllm026_reference.pt (made by benchmarks/vllm_reference.py from the vLLM wheel).

  peer                  --kv-cache-dtype        storage per (token, KV head)
  vllm-fp8              fp8                     K, V in fp8 e4m3, one per-tensor scale per layer = 1.0
  vllm-fp8-calibrated   fp8 + calculate_kv_scales   scales = absmax(K)/200, absmax(V)/100 per layer from
                                                the first forward the engine runs (then fixed)
  vllm-int8-pth         int8_per_token_head     int8 codes, one fp32 absmax scale for K and one for V
  vllm-int4-pth         int4_per_token_head     randomized Hadamard (RHT), 4-bit asymmetric codes, one
                                                fp32 scale whose low 4 mantissa bits hold the zero point
  vllm-tq-k8v4          turboquant_k8v4         K fp8 e4m3 (no scale), V 4-bit uniform (fp16 scale + min)
  vllm-tq-4bit-nc       turboquant_4bit_nc      K: Hadamard + 4-bit Lloyd-Max + fp16 norm, norm
                                                correction; V 4-bit uniform
  vllm-tq-k3v4-nc       turboquant_k3v4_nc      K 3-bit Lloyd-Max, V 4-bit
  vllm-tq-3bit-nc       turboquant_3bit_nc      K 3-bit Lloyd-Max, V 3-bit
TurboQuant keeps the first 2 and last 2 decoder layers in the model dtype (vLLM adds them to
kv_cache_dtype_skip_layers: TurboQuantConfig.get_boundary_skip_layers); those layers count at 16 bits.

Which K/V each attention reads (vLLM's paths, mirrored):
  fp8 / int8 / int4   every token, the current chunk's too, is read back from the quantized cache
                      (reshape_and_cache first, then paged attention over the cache)
  TurboQuant          a first prefill chunk attends to its raw K/V (flash_attn fast path); a later
                      chunk of <= 128 tokens and every decode step read everything from the cache
                      (triton_turboquant_decode_attention); a later chunk of > 128 tokens reads the
                      cached tokens dequantized to fp16 and its own tokens raw (_continuation_prefill)
Not modelled (attention-kernel internals, not storage): FA3's fp8 path also casts the query (scale
1.0) and the softmax probabilities to fp8; the int4 path rotates the query in the model dtype.

Held bits per element: the dtype's real storage over K and V (codes + scales + norms; the int4 and
TurboQuant nibble packing as allocated), on top of which vLLM pads pages (not counted). bits_held
is over every layer (skip layers at the model dtype's 16 bits); the quantized tier alone is
`bits_per_elt`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from functools import lru_cache

import torch

from lowbit.eval.peers import VLLM_PEERS, Accounting, Entry

VLLM_VERSION = "0.26.0"
CACHE_DTYPE = {"vllm-fp8": "fp8", "vllm-fp8-calibrated": "fp8", "vllm-int8-pth": "int8_per_token_head",
               "vllm-int4-pth": "int4_per_token_head", "vllm-tq-k8v4": "turboquant_k8v4",
               "vllm-tq-4bit-nc": "turboquant_4bit_nc", "vllm-tq-k3v4-nc": "turboquant_k3v4_nc",
               "vllm-tq-3bit-nc": "turboquant_3bit_nc"}
# vllm/model_executor/layers/quantization/turboquant/config.py: TQ_PRESETS
TQ_PRESETS = {
    "turboquant_k8v4": {"key_quant_bits": 8, "value_quant_bits": 4, "norm_correction": False},
    "turboquant_4bit_nc": {"key_quant_bits": 4, "value_quant_bits": 4, "norm_correction": True},
    "turboquant_k3v4_nc": {"key_quant_bits": 3, "value_quant_bits": 4, "norm_correction": True},
    "turboquant_3bit_nc": {"key_quant_bits": 3, "value_quant_bits": 3, "norm_correction": True},
}
FP8_MAX = 448.0  # float8_e4m3fn (NVIDIA's fp8 dtype, current_platform.fp8_dtype() on CUDA)
# vllm/envs.py: K_SCALE_CONSTANT / V_SCALE_CONSTANT (Attention.calc_kv_scales divides absmax by them)
K_SCALE_CONSTANT, V_SCALE_CONSTANT = 200.0, 100.0
# vllm/v1/attention/backends/turboquant_attn.py: _CONTINUATION_DECODE_THRESHOLD
CONTINUATION_DECODE_THRESHOLD = 128
TQ_BOUNDARY_SKIP = 2  # TurboQuantConfig.get_boundary_skip_layers(n=2)


# ---------------------------------------------------------------------------------------------------
# fp8
# ---------------------------------------------------------------------------------------------------

def fp8_e4m3(x: torch.Tensor) -> torch.Tensor:
    """fp32 -> fp8 e4m3 -> fp32, round to nearest even, saturating at +-448: the store's implicit cast
    (Triton fp8e4nv / CUDA __nv_cvt_float_to_fp8(..., __NV_SATFINITE, __NV_E4M3))."""
    return x.float().clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn).float()


def fp8_per_tensor(x: torch.Tensor, scale: float | torch.Tensor) -> torch.Tensor:
    """vllm/v1/attention/ops/triton_reshape_and_cache_flash.py: reshape_and_cache_kernel_flash
    (FP8_KV_CACHE): store fp8(x / scale); FlashAttention reads it back times the descale."""
    s = torch.as_tensor(scale, dtype=torch.float32)
    return fp8_e4m3(x.float() / s) * s


def calibrated_scales(key: torch.Tensor, value: torch.Tensor) -> tuple[float, float]:
    """vllm/model_executor/layers/attention/attention.py: Attention.calc_kv_scales
    (absmax over the whole first forward's K / V of the layer, over K_SCALE_CONSTANT / V_SCALE_CONSTANT)."""
    k = torch.abs(key.float()).max() / torch.tensor(K_SCALE_CONSTANT, dtype=torch.float32)
    v = torch.abs(value.float()).max() / torch.tensor(V_SCALE_CONSTANT, dtype=torch.float32)
    return float(k), float(v)


# ---------------------------------------------------------------------------------------------------
# int8 / int4 per token-head
# ---------------------------------------------------------------------------------------------------

def _round_half_away(x: torch.Tensor) -> torch.Tensor:
    return torch.where(x >= 0, x + 0.5, x - 0.5)


def int8_per_token_head_codes(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """vllm/v1/attention/ops/triton_reshape_and_cache_flash.py: _reshape_cache_per_token_head
    (QUANT_MAX 127, QUANT_MIN -128, IS_INT_QUANT): scale = max(absmax / 127, 1e-6); code =
    int8(clamp(round-half-away(x * (1 / scale)), -128, 127)) (the int8 store truncates).
    x [..., D] -> (codes int8 [..., D], scale fp32 [...])."""
    xf = x.float()
    scale = torch.clamp(xf.abs().amax(-1) / 127.0, min=1e-6)
    q = xf * (1.0 / scale)[..., None]
    q = torch.clamp(_round_half_away(q), -128.0, 127.0)
    return torch.trunc(q).to(torch.int8), scale


def int8_per_token_head(x: torch.Tensor) -> torch.Tensor:
    """Quantize + dequantize: triton_unified_attention multiplies the int8 tile by the per-(token, head) scale."""
    codes, scale = int8_per_token_head_codes(x)
    return codes.float() * scale[..., None]


@lru_cache(maxsize=8)
def rht_signs(d: int) -> torch.Tensor:
    """vllm/v1/attention/ops/int4_per_token_head.py: _get_rht_signs(d, round_idx=0)."""
    gen = torch.Generator(device="cpu")
    gen.manual_seed(0x9E3779B9 + 0 * 0x517CC1B7)
    return 2.0 * torch.bernoulli(torch.full((d,), 0.5, device="cpu"), generator=gen) - 1.0


def walsh_hadamard(x: torch.Tensor) -> torch.Tensor:
    """Unnormalized Walsh-Hadamard transform along the last dim (int4_per_token_head.py:
    fast_hadamard_transform, its tier-3 PyTorch butterfly)."""
    d = x.shape[-1]
    h = 1
    while h < d:
        xv = x.view(*x.shape[:-1], d // (2 * h), 2, h)
        a, b = xv[..., 0, :], xv[..., 1, :]
        x = torch.stack([a + b, a - b], dim=-2).reshape(x.shape)
        h <<= 1
    return x


def single_rht(x: torch.Tensor, *, inverse: bool = False, hadacore: bool = True) -> torch.Tensor:
    """int4_per_token_head.py: single_rht = H x D1 x (unnormalized H). On CUDA sm80+ (hadacore, the
    path a GPU user gets) fast_hadamard_transform rounds an fp32 input to bf16, transforms with
    H / sqrt(d) and returns bf16 times sqrt(d): hadacore=True models that (bf16 in and out, fp32 in
    between); hadacore=False is the exact CPU butterfly (tier 3)."""
    d = x.shape[-1]
    d1 = rht_signs(d).to(x.device)

    def fwht(t):
        if not hadacore:
            return walsh_hadamard(t)
        y = walsh_hadamard(t.to(torch.bfloat16).float()) / math.sqrt(d)
        return y.to(torch.bfloat16).float() * math.sqrt(d)

    return fwht(x) * d1 if inverse else fwht(x * d1)


@dataclass
class Int4Codes:
    codes: torch.Tensor  # uint8 in [0, 15], [..., D]
    scale_packed: torch.Tensor  # fp32 [...]: the scale with its low 4 mantissa bits = zero point
    zero_point: torch.Tensor  # fp32 [...] in [0, 15]


def int4_per_token_head_codes(x_rot: torch.Tensor) -> Int4Codes:
    """vllm/v1/attention/ops/int4_per_token_head.py: _reshape_cache_int4_kernel, on the already
    rotated x_rot [..., D]: scale = max((max - min) / 15, 1e-6), zp = clamp(rha(-min / scale), 0, 15),
    code = clamp(rha(x * (1 / scale) + zp), 0, 15) (rha: round half away from zero, then truncation);
    the zero point replaces the low 4 bits of the fp32 scale."""
    xf = x_rot.float()
    mn, mx = xf.amin(-1), xf.amax(-1)
    scale = torch.clamp((mx - mn) / 15.0, min=1e-6)
    zp = torch.clamp(torch.trunc(_round_half_away(-mn / scale)), 0.0, 15.0)
    s = xf * (1.0 / scale)[..., None] + zp[..., None]
    codes = torch.clamp(torch.trunc(_round_half_away(s)), 0.0, 15.0).to(torch.uint8)
    bits = scale.view(torch.int32)
    packed = ((bits & -16) | (zp.to(torch.int32) & 0xF)).view(torch.float32)
    return Int4Codes(codes, packed, zp)


def int4_dequant_rotated(c: Int4Codes) -> torch.Tensor:
    """_attn_packed: the read kernel takes scale = bits & -16, zp = bits & 0xF, and scores
    (q . codes - sum(q) zp) * scale, i.e. the rotated vector (codes - zp) * scale."""
    bits = c.scale_packed.view(torch.int32)
    zp = (bits & 0xF).float()
    scale = (bits & -16).view(torch.float32)
    return (c.codes.float() - zp[..., None]) * scale[..., None]


def int4_per_token_head(x: torch.Tensor, *, hadacore: bool = True) -> torch.Tensor:
    """Quantize + dequantize in the original basis. reshape_and_cache_int4 stores
    int4(single_rht(x.float()).to(x.dtype)); unified_attention_int4 rotates q the same way, divides
    the softmax scale by D and un-rotates the output with single_rht(., inverse) / D. Since
    H H = D I, that equals attention over x_hat = single_rht(deq, inverse) / D."""
    d = x.shape[-1]
    x_rot = single_rht(x.float(), hadacore=hadacore).to(x.dtype)
    deq_rot = int4_dequant_rotated(int4_per_token_head_codes(x_rot))
    return single_rht(deq_rot, inverse=True, hadacore=False) / d


# ---------------------------------------------------------------------------------------------------
# TurboQuant
# ---------------------------------------------------------------------------------------------------

def _gaussian_pdf(x: float, sigma2: float) -> float:
    return (1.0 / math.sqrt(2 * math.pi * sigma2)) * math.exp(-x * x / (2 * sigma2))


def _trapz(f, a: float, b: float, n: int = 200) -> float:
    h = (b - a) / n
    result = 0.5 * (f(a) + f(b))
    for i in range(1, n):
        result += f(a + i * h)
    return result * h


@lru_cache(maxsize=32)
def tq_centroids(d: int, bits: int) -> torch.Tensor:
    """vllm/model_executor/layers/quantization/turboquant/centroids.py: solve_lloyd_max / get_centroids
    (Lloyd-Max for N(0, 1/d), trapezoid integration, 200 iterations, tol 1e-10), line for line."""
    n_levels = 2**bits
    sigma2 = 1.0 / d
    sigma = math.sqrt(sigma2)

    def pdf(x):
        return _gaussian_pdf(x, sigma2)

    lo, hi = -3.5 * sigma, 3.5 * sigma
    centroids = [lo + (hi - lo) * (i + 0.5) / n_levels for i in range(n_levels)]
    for _ in range(200):
        boundaries = [(centroids[i] + centroids[i + 1]) / 2.0 for i in range(n_levels - 1)]
        edges = [lo * 3] + boundaries + [hi * 3]
        new_centroids = []
        for i in range(n_levels):
            a, b = edges[i], edges[i + 1]
            num = _trapz(lambda x: x * pdf(x), a, b)
            den = _trapz(pdf, a, b)
            new_centroids.append(num / den if den > 1e-15 else centroids[i])
        if max(abs(new_centroids[i] - centroids[i]) for i in range(n_levels)) < 1e-10:
            break
        centroids = new_centroids
    return torch.tensor(centroids, dtype=torch.float32)


def tq_midpoints(d: int, bits: int) -> torch.Tensor:
    """TurboQuantAttentionImpl._ensure_on_device: midpoints of the sorted centroids (fp32)."""
    c, _ = tq_centroids(d, bits).sort()
    return (c[:-1] + c[1:]) / 2


@lru_cache(maxsize=8)
def tq_hadamard(d: int) -> torch.Tensor:
    """vllm/v1/attention/backends/turboquant_attn.py: _build_hadamard_cached (Sylvester, / sqrt(d));
    Pi = PiT = H."""
    H = torch.tensor([[1.0]])
    while H.shape[0] < d:
        H = torch.cat([torch.cat([H, H], 1), torch.cat([H, -H], 1)], 0)
    return H / math.sqrt(d)


def tq_value_codes(v: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """vllm/v1/attention/ops/triton_turboquant_store.py: _store_quantized_value. Per (token, head):
    scale = max((max - min) / (2^b - 1), 1e-8), code = clamp(int(( v - min) / scale + 0.5), 0, 2^b - 1),
    scale and min stored as fp16. Returns (codes int32, scale fp16, min fp16)."""
    vf = v.float()
    mn, mx = vf.amin(-1), vf.amax(-1)
    top = float(2**bits - 1)
    scale = (mx - mn) / top
    scale = torch.where(scale > 1e-8, scale, torch.full_like(scale, 1e-8))
    codes = torch.clamp(torch.trunc((vf - mn[..., None]) / scale[..., None] + 0.5), 0, top).to(torch.int32)
    return codes, scale.half(), mn.half()


def tq_values(v: torch.Tensor, bits: int) -> torch.Tensor:
    """Quantize + dequantize: _tq_decode_stage1 / _tq_full_dequant_kv read code * fp16 scale + fp16 min."""
    codes, scale, mn = tq_value_codes(v, bits)
    return codes.float() * scale.float()[..., None] + mn.float()[..., None]


def tq_key_codes(k: torch.Tensor, bits: int) -> tuple[torch.Tensor, torch.Tensor]:
    """triton_turboquant_store.py: triton_turboquant_store (MSE path) + _tq_fused_store_mse: norms =
    ||k||, y = (k / (norm + 1e-8)) @ PiT, index = number of midpoints <= y (the kernel's binary search),
    norm stored as fp16. Returns (indices int64 [..., D], norm fp16 [...])."""
    d = k.shape[-1]
    kf = k.float()
    norms = kf.norm(dim=-1, keepdim=True)
    y = (kf / (norms + 1e-8)) @ tq_hadamard(d).to(kf.device)
    idx = torch.bucketize(y, tq_midpoints(d, bits).to(kf.device), right=True)
    return idx, norms[..., 0].half()


def tq_keys_rotated(idx: torch.Tensor, norm16: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    """_tq_decode_stage1 / _tq_full_dequant_kv: centroid gather, norm correction (c / sqrt(sum c^2 + 1e-16)),
    times the fp16 norm: the key in the rotated basis."""
    c = tq_centroids(idx.shape[-1], bits).to(idx.device)[idx]
    if norm_correction:
        c = c * (1.0 / torch.sqrt((c * c).sum(-1, keepdim=True) + 1e-16))
    return norm16.float()[..., None] * c


def tq_keys(k: torch.Tensor, bits: int, norm_correction: bool) -> torch.Tensor:
    """Quantize + dequantize MSE keys in the original basis. The decode kernel scores <q @ PiT, k_rot>,
    which is <q, k_rot @ Pi> (Pi = H, symmetric), so the key attention sees is k_rot @ H."""
    idx, n16 = tq_key_codes(k, bits)
    return tq_keys_rotated(idx, n16, bits, norm_correction) @ tq_hadamard(k.shape[-1]).to(k.device)


@dataclass(frozen=True)
class TQConfig:
    """vllm/model_executor/layers/quantization/turboquant/config.py: TurboQuantConfig (sizes in bytes)."""

    head_dim: int
    key_quant_bits: int
    value_quant_bits: int
    norm_correction: bool

    @classmethod
    def from_cache_dtype(cls, cache_dtype: str, head_dim: int) -> TQConfig:
        return cls(head_dim=head_dim, **TQ_PRESETS[cache_dtype])

    @property
    def key_fp8(self) -> bool:
        return self.key_quant_bits == 8

    @property
    def key_packed_size(self) -> int:
        if self.key_fp8:
            return self.head_dim
        return math.ceil(self.head_dim * self.key_quant_bits / 8) + 2

    @property
    def value_packed_size(self) -> int:
        return math.ceil(self.head_dim * self.value_quant_bits / 8) + 4

    @property
    def slot_size_aligned(self) -> int:
        s = self.key_packed_size + self.value_packed_size
        return s + (s % 2)


def tq_skip_layers(num_layers: int, n: int = TQ_BOUNDARY_SKIP) -> list[int]:
    """TurboQuantConfig.get_boundary_skip_layers for a dense model: the first n and last n layers."""
    if n <= 0 or num_layers <= 0:
        return []
    n = min(n, num_layers // 2)
    return sorted(set(range(n)) | set(range(num_layers - n, num_layers)))


# ---------------------------------------------------------------------------------------------------
# The peer: specs, geometry rules, held bits, the cache
# ---------------------------------------------------------------------------------------------------

def _pow2(n: int) -> bool:
    return n > 0 and n & (n - 1) == 0


def cannot_run(name: str, geometry) -> str | None:
    """Why vLLM 0.26 cannot hold this model's K/V in `name`'s dtype (one line), or None."""
    dtype = CACHE_DTYPE[name]
    for g in geometry.layers:
        if g.storage != "mha" or getattr(g, "k_eq_v", False) or getattr(g, "kv_shared_from", None) is not None:
            return (f"layer {g.index} stores K/V as {g.storage}{' (K = V)' if g.k_eq_v else ''}; these peers model "
                    "vLLM's per-head K/V cache only")
    dims = sorted({g.head_dim_k for g in geometry.layers} | {g.head_dim_v for g in geometry.layers})
    if dtype.startswith("turboquant_"):
        sliding = [g.index for g in geometry.layers if g.attention != "full"]
        if sliding:
            return (f"vLLM 0.26's TURBOQUANT backend does not support sliding-window attention "
                    f"(supports_sliding_window is False) and this model has {len(sliding)} sliding layers; vLLM "
                    "refuses it unless --kv-cache-dtype-skip-layers sliding_window keeps them in bf16")
        if any(g.head_dim_k != g.head_dim_v for g in geometry.layers):
            return "TurboQuant packs K and V of one head_size per slot; this model's K and V head dims differ"
        cfg = TQConfig.from_cache_dtype(dtype, dims[0])
        if not cfg.key_fp8 and not all(_pow2(d) for d in dims):
            return (f"TurboQuant's MSE keys need a power-of-two head_dim for the Hadamard rotation "
                    f"(_build_hadamard); this model has head_dim {dims}")
        if cfg.value_quant_bits == 3 and any(d % 8 for d in dims):
            return f"TurboQuant's 3-bit values pack 8 per 3 bytes, so head_dim must be a multiple of 8; got {dims}"
        if any(d % 2 for d in dims):
            return f"TurboQuant's 4-bit values pack 2 per byte, so head_dim must be even; got {dims}"
        if not quantized_layers(name, geometry):
            return (f"TurboQuant keeps the first and last {TQ_BOUNDARY_SKIP} layers in the model dtype "
                    f"(get_boundary_skip_layers); this {geometry.num_layers}-layer model has no layer left to quantize")
    if dtype == "int4_per_token_head" and not all(_pow2(d) for d in dims):
        return (f"int4_per_token_head rotates with a Walsh-Hadamard transform that needs a power-of-two "
                f"head_dim (fast_hadamard_transform); this model has head_dim {dims}")
    return None


def quantized_layers(name: str, geometry) -> list[int]:
    """Layer indices vLLM holds in the quantized dtype (TurboQuant skips its boundary layers)."""
    n = geometry.num_layers
    skip = set(tq_skip_layers(n)) if CACHE_DTYPE[name].startswith("turboquant_") else set()
    return [i for i in range(n) if i not in skip]


def bits_per_element(name: str, head_dim_k: int, head_dim_v: int) -> float:
    """Bits one K+V element of a quantized layer holds in vLLM's storage (codes + scales + norms),
    per (token, KV head) over head_dim_k + head_dim_v elements. fp8's per-tensor scales (2 fp32 per
    layer) are amortized over the whole cache and count as 0 here."""
    dtype = CACHE_DTYPE[name]
    elts = head_dim_k + head_dim_v
    if dtype == "fp8":
        return 8.0
    if dtype == "int8_per_token_head":  # int8 codes + fp32 scale for K and for V (KVQuantMode.is_per_token_head)
        return (8.0 * elts + 2 * 32) / elts
    if dtype == "int4_per_token_head":  # head_dim // 2 bytes (AttentionSpec.real_page_size_bytes) + 2 fp32 scales
        return (8.0 * (head_dim_k // 2 + head_dim_v // 2) + 2 * 32) / elts
    cfg = TQConfig.from_cache_dtype(dtype, head_dim_k)
    return 8.0 * cfg.slot_size_aligned / elts


def held_bits(name: str, geometry, model_bits: int = 16) -> dict:
    """{'bits_held': b/elt over every layer, 'bits_quantized': b/elt of the quantized layers}: the
    same at every context length (vLLM has no full-precision window; pages' padding not counted)."""
    q = set(quantized_layers(name, geometry))
    bits = elts = qbits = qelts = 0.0
    for g in geometry.layers:
        e = g.num_kv_heads * (g.head_dim_k + g.head_dim_v)
        b = bits_per_element(name, g.head_dim_k, g.head_dim_v) if g.index in q else float(model_bits)
        bits += b * e
        elts += e
        if g.index in q:
            qbits += b * e
            qelts += e
    return {"bits_held": bits / elts if elts else None, "bits_quantized": qbits / qelts if qelts else None}


class VllmPeer:
    """One peer's quantize-dequantize of one layer's new K/V [B, H, T, D], plus what it remembers
    across windows (vllm-fp8-calibrated's scales, fixed after the first forward, as in vLLM)."""

    def __init__(self, name: str, geometry, *, hadacore: bool = True):
        if name not in VLLM_PEERS:
            raise ValueError(f"unknown vLLM peer {name}")
        self.name, self.dtype = name, CACHE_DTYPE[name]
        self.quantized = set(quantized_layers(name, geometry))
        self.hadacore = hadacore
        self.scales: dict[int, tuple[float, float]] = {}
        self.tq = TQ_PRESETS.get(self.dtype)

    def _calibrate(self, layer_idx: int, k, v) -> tuple[float, float]:
        if self.name != "vllm-fp8-calibrated":
            return 1.0, 1.0
        if layer_idx not in self.scales:
            self.scales[layer_idx] = calibrated_scales(k, v)
        return self.scales[layer_idx]

    def fake_quant(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) as vLLM's read path sees them after its store, in k's dtype."""
        dt = k.dtype
        if self.dtype == "fp8":
            ks, vs = self._calibrate(layer_idx, k, v)
            return fp8_per_tensor(k, ks).to(dt), fp8_per_tensor(v, vs).to(dt)
        if self.dtype == "int8_per_token_head":
            return int8_per_token_head(k).to(dt), int8_per_token_head(v).to(dt)
        if self.dtype == "int4_per_token_head":
            return (int4_per_token_head(k, hadacore=self.hadacore).to(dt),
                    int4_per_token_head(v, hadacore=self.hadacore).to(dt))
        t = self.tq
        kq = fp8_e4m3(k) if t["key_quant_bits"] == 8 else tq_keys(k, t["key_quant_bits"], t["norm_correction"])
        return kq.to(dt), tq_values(v, t["value_quant_bits"]).to(dt)


def make_cache_class():
    from transformers import DynamicCache

    class VllmFakeQuantCache(DynamicCache):
        """DynamicCache holding what vLLM's quantized KV cache would hold (see the module docstring)."""

        def __init__(self, model, peer: VllmPeer):
            super().__init__(config=model.config)
            self.peer = peer
            self.quantized_rows = 0
            self.tokens_written: dict[int, int] = {}

        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            p = self.peer
            if layer_idx not in p.quantized:
                return super().update(key_states, value_states, layer_idx, *args, **kwargs)
            b, h, t, _ = key_states.shape
            prior = self.tokens_written.get(layer_idx, 0)
            self.tokens_written[layer_idx] = prior + t
            kq, vq = p.fake_quant(layer_idx, key_states, value_states)
            self.quantized_rows += 2 * b * h * t
            keys, values = super().update(kq, vq, layer_idx, *args, **kwargs)
            if p.tq is None:
                return keys, values
            if prior == 0:  # first chunk: flash_attn over the raw batch K/V
                return key_states, value_states
            if t > CONTINUATION_DECODE_THRESHOLD:  # _continuation_prefill: cached part via fp16, own tokens raw
                keys = torch.cat([keys[..., :-t, :].half().to(keys.dtype), key_states], dim=-2)
                values = torch.cat([values[..., :-t, :].half().to(values.dtype), value_states], dim=-2)
            return keys, values

    return VllmFakeQuantCache


def fake_quant_accounting(name: str, geometry):
    """Accounting of a VllmFakeQuantCache: bits from vLLM's storage per element (held_bits), elements
    from what the cache holds now (sliding layers: their window)."""
    q = set(quantized_layers(name, geometry))

    def account(cache) -> Accounting:
        acc = Accounting(quantized_rows=int(getattr(cache, "quantized_rows", 0)))
        for i, layer in enumerate(cache.layers):
            keys, values = getattr(layer, "keys", None), getattr(layer, "values", None)
            if not isinstance(keys, torch.Tensor) or keys.dim() != 4:
                continue
            g = geometry.layers[i]
            n = int(keys.numel() + values.numel())
            if i in q:
                b = bits_per_element(name, g.head_dim_k, g.head_dim_v) * n
                acc.quant_bits += b
                acc.quant_elts += n
                acc.all_bits += b
            else:
                acc.all_bits += 8.0 * n * keys.element_size()
            acc.all_elts += n
        return acc

    return account


def vllm_entry(name: str, geometry):
    """`lowbit eval` row for a vLLM peer (lowbit.eval.peers.Entry), or a cannot-run entry."""
    dtype = CACHE_DTYPE[name]
    config = {"cache": "lowbit.eval.peers_vllm.VllmFakeQuantCache", "vllm": VLLM_VERSION,
              "kv_cache_dtype": dtype, "fake_quant": "vLLM's store + read arithmetic, ported (see peers_vllm)"}
    if name == "vllm-fp8-calibrated":
        config["calculate_kv_scales"] = True
    if dtype.startswith("turboquant_"):
        config["skip_layers"] = tq_skip_layers(geometry.num_layers)
        config.update(TQ_PRESETS[dtype])
    if dtype == "int4_per_token_head":
        config["rht"] = "hadacore (bf16 in/out)"
    reason = cannot_run(name, geometry)
    entry = Entry(name=name, kind="vllm-peer", make_cache=None, account=fake_quant_accounting(name, geometry),
                  quantizes=True, config=config, cannot_run=reason)
    if reason is None:
        config.update(held_bits(name, geometry))
        peer = VllmPeer(name, geometry)  # one per row: vllm-fp8-calibrated's scales persist across windows
        cls = make_cache_class()
        entry.make_cache = lambda model: cls(model, peer)
    return entry
