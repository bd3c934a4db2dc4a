"""humming-kernels (vLLM 0.26's JIT-compiled quantized GEMM library) as one of lowbit's weight GEMM paths.

    p = plan(pw, torch.bfloat16, ms=(1, 16, 64))   # once per weight: repack into humming's layout, pick kernels
    y = run(p, x)                                    # x [M, K] bf16/fp16 -> y [M, N] in p.dtype (out_dtype: cast)
    y = linear(x, pw)                                # the plan made on first use and kept on pw
    y = linear_twin(x, pw)                           # the torch twin: weight_gemm.linear_twin (dequantize, matmul)

humming is imported lazily (`humming_missing()` says why it cannot be, with the install command); everything
above the GPU part is plain torch and runs on CPU.

What humming is given (`humming_inputs`, pure torch) for a lowbit PackedWeight (see weight_gemm: q signed codes,
scale [G, N], zero int8 [G, N] or None):
    weight        int32 [N, K * bits / 32]   unsigned codes u = q + 2**(bits-1), 32 / bits per word along K,
                                             element k at bits (k % (32 / bits)) * bits: compressed-tensors'
                                             pack_to_int32 order, i.e. its `weight_packed` (bits 4: lowbit's
                                             qweight word for word; bits 8: the bytes of q + 128)
    weight_scale  [N, G] in the activation dtype (G = 1: per channel)
    zero_point    int32 [N * bits / 32, G]   unsigned zero z = zero + 2**(bits-1) packed along N (compressed-tensors'
                                             `weight_zero_point`); asymmetric weights only
    bias          [N] in the activation dtype
with humming's HummingWeightSchema(b_dtype=uint<bits>, group_size=group (0 per channel), has_zero_point) and
HummingInputSchema(a_dtype=bfloat16 / float16 for A16, int8 for A8). humming's dequantization is
w = (u - z) * s with z = 2**(bits-1) when symmetric -- lowbit's (q - zero) * scale (`dequantize_reference` is
that formula in torch, tested against weight_gemm.dequantize). humming's transform_humming_layer then repacks
for its tensor-core loads (its own CUDA kernels).

A8 (w8a8, w4a8): the activations go through lowbit's per-token quantizer (weight_gemm.quantize_rows: the twin's
codes and scales bit for bit) and reach humming as int8 codes [M, K] + scales [M, 1] fp32, so humming's own
quantizer (scale max/127.49, min/128.49) is not used.

Error against the twin: humming writes bf16 / fp16 only, scales are cast to that dtype, and for W4A8 humming
re-expresses group scales as int16 multiples of max|s| / 1024 -- so the audit holds it to DEQUANT_TOL
(weight_audit.tolerance), as dequantize + cuBLAS.

Kernels: humming's own heuristics (humming.tune) at the sample Ms of the plan; M in (m_{i-1}, m_i] runs m_i's
kernel, M above the last sample the last one. Compilation is JIT (NVRTC or nvcc, cached on disk under
HUMMING_CACHE_DIR); `compile_plans` builds the kernels of many plans in parallel threads. An eager call costs
~50 us of host time: humming belongs inside captured CUDA graphs (lowbit bench gemm times it there).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from lowbit.core.errors import LowbitError

HUMMING_VERSION = "0.1.10"
INSTALL = (f"pip install 'lowbit[humming]' (humming-kernels=={HUMMING_VERSION}, which brings pyelftools, "
           "cuda-bindings and nvidia-ml-py; it JIT-compiles with the CUDA toolkit's NVRTC/nvcc)")
DEFAULT_MS = (1, 16, 32, 64, 128, 256, 1024, 4096)
_ACT = {torch.bfloat16: "bfloat16", torch.float16: "float16"}

_missing: list = []  # [reason or None] once probed


# ----------------------------------------------------------------------------------------------------------------
# pure part (CPU): what humming takes, and whether it takes this weight


def why_not(pw, x_dtype=torch.bfloat16) -> str | None:
    """Why humming's dense GEMM cannot run this weight with x_dtype activations, or None if it can.

    From humming 0.1.10's checks and the tiles its SM90 heuristics pick (humming.tune.sm90; checked by building its
    kernel configurations for the audit's shapes with the compiler stubbed out): N a multiple of 256 (128 for A8 with
    group scales), K a multiple of 1024 / a_bits, group >= 256 / a_bits, weight bits <= 8; A16 activations
    bf16/fp16; A8 weights symmetric. Other architectures' heuristics may take more shapes; these are refused anyway
    (a refused weight falls through to the next cell)."""
    if pw.bits not in (4, 8):
        return f"humming here takes 4- or 8-bit weights, got {pw.bits}"
    if x_dtype not in _ACT:
        return f"humming's A16/A8 kernels take bf16/fp16 inputs, got {x_dtype}"
    a_bits = 16 if pw.a_bits == 16 else 8
    nb = 128 if a_bits == 8 and not pw.per_channel else 256
    if pw.N % nb:
        return f"N={pw.N} is not a multiple of {nb} (the N tile humming's heuristics pick for this weight)"
    kb = 1024 // a_bits
    if pw.K % kb:
        return f"K={pw.K} is not a multiple of {kb} (humming's K tile at {a_bits}-bit activations)"
    if not pw.per_channel and pw.group < 256 // a_bits:
        return f"group {pw.group} is under humming's smallest ({256 // a_bits} at {a_bits}-bit activations)"
    if pw.a_bits == 8 and pw.zero is not None:
        return "A8 weights are symmetric (no zero point)"
    if pw.zero is not None and pw.bits == 8:
        return "8-bit weights with a zero point are not a lowbit scheme"
    return None


def pack_along(u: torch.Tensor, bits: int) -> torch.Tensor:
    """u int [R, C] in [0, 2**bits) -> int32 [R, C * bits / 32], element c at bits (c % (32/bits)) * bits of word
    c // (32/bits) (humming's pack_weight and compressed-tensors' pack_to_int32 order)."""
    per = 32 // bits
    R, C = u.shape
    if C % per:
        raise ValueError(f"{C} is not a multiple of {per}")
    v = u.to(torch.int64).reshape(R, C // per, per)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=u.device)
    w = (v << shifts).sum(dim=-1)
    return (w - ((w >> 31) & 1) * 2**32).to(torch.int32)


def unpack_along(words: torch.Tensor, bits: int, C: int) -> torch.Tensor:
    """Inverse of pack_along: int32 [R, C * bits / 32] -> int64 [R, C]."""
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=words.device)
    return ((words.to(torch.int64).unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).reshape(words.shape[0], C)


def humming_inputs(pw, dtype=torch.bfloat16) -> dict[str, torch.Tensor]:
    """The tensors humming's HummingWeightSchema takes before its transform (module docstring), from a PackedWeight.
    No copy of the codes where the layouts already agree (4-bit: pw.qweight itself)."""
    if pw.bits == 4:
        weight = pw.qweight  # int32 [N, K/8], nibble i of word j = q[n, 8j+i] + 8: the same words
    else:
        weight = (pw.qweight.to(torch.int16) + 128).to(torch.uint8).contiguous().view(torch.int32)  # [N, K/4]
    out = {"weight": weight, "weight_scale": pw.scale.t().to(dtype).contiguous()}  # [N, G]
    if pw.zero is not None:
        z = pw.zero.to(torch.int16) + (1 << (pw.bits - 1))  # [G, N] unsigned zero
        out["zero_point"] = pack_along(z, pw.bits).t().contiguous()  # [N * bits / 32, G]
    if pw.bias is not None:
        out["bias"] = pw.bias.to(dtype).contiguous()
    return out


def dequantize_reference(tensors: dict[str, torch.Tensor], bits: int, N: int, K: int) -> torch.Tensor:
    """float32 [N, K] from humming's inputs by humming's formula (humming.utils.weight.dequantize_weight):
    w = (u - z) * s, z = 2**(bits-1) without a zero point."""
    u = unpack_along(tensors["weight"], bits, K).float()
    s = tensors["weight_scale"].float()  # [N, G]
    group = K // s.shape[1]
    if "zero_point" in tensors:
        z = unpack_along(tensors["zero_point"].t().contiguous(), bits, N).t().float()  # [N, G]
        u = u - z.repeat_interleave(group, dim=1)
    else:
        u = u - (1 << (bits - 1))
    return u * s.repeat_interleave(group, dim=1)


def schema_args(pw, dtype=torch.bfloat16) -> dict:
    """The keyword arguments of humming's HummingWeightSchema and HummingInputSchema for this weight (as strings:
    humming parses them)."""
    return {"weight": {"b_dtype": f"uint{pw.bits}", "weight_scale_group_size": 0 if pw.per_channel else pw.group,
                       "has_zero_point": pw.zero is not None},
            "input": {"a_dtype": _ACT[dtype] if pw.a_bits == 16 else "int8"}}


def buckets(ms) -> list[tuple[int, int, int]]:
    """Sample Ms -> [(lo, hi, m)]: M in (lo, hi] runs the kernel tuned for m; the last hi is 2**30 (humming's
    'any larger M')."""
    ms = sorted({int(m) for m in ms if int(m) >= 1})
    if not ms:
        raise ValueError("a humming plan needs at least one sample M >= 1")
    out, lo = [], 0
    for i, m in enumerate(ms):
        out.append((lo, m if i < len(ms) - 1 else 1 << 30, m))
        lo = m
    return out


def linear_twin(x: torch.Tensor, pw, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The twin every humming result is checked against: weight_gemm.linear_twin (dequantize, then matmul in fp32)."""
    from lowbit.kernels.gemm.triton_gemm import linear_twin as twin

    return twin(x, pw, out_dtype)


# ----------------------------------------------------------------------------------------------------------------
# GPU part


def humming_missing() -> str | None:
    """None when humming imports here, else one line: why, and the install command."""
    if not _missing:
        try:
            import humming
            import humming.layer
            import humming.ops  # noqa: F401

            _missing.append(None)
        except Exception as e:  # noqa: BLE001 -- ImportError, or a missing CUDA toolkit piece at import
            first = str(e).splitlines()[0] if str(e) else ""
            _missing.append(f"humming-kernels is not importable here ({type(e).__name__}: {first}); install it: "
                            f"{INSTALL}")
    return _missing[0]


def require_humming(where: str = "") -> None:
    why = humming_missing()
    if why is not None:
        raise LowbitError(f"{where + ': ' if where else ''}{why}")


@dataclass
class HummingPlan:
    """A weight in humming's layout with its kernels chosen: N, K, the activation dtype (the output's), a8 (int8
    activations through lowbit's quantizer), the repacked tensors, humming's launch table `configs` (int64 CPU:
    [lo, hi, kernel id, num_sms] per M bucket) and `tuning` (the per-bucket configs, for compile_plans)."""

    N: int
    K: int
    dtype: torch.dtype
    a8: bool
    ms: tuple[int, ...]
    tensors: dict[str, torch.Tensor]
    layer_config: str
    tuning: list
    configs: torch.Tensor | None = None
    locks: torch.Tensor | None = None
    meta: object = field(default=None, repr=False)

    def nbytes(self) -> int:
        return sum(t.numel() * t.element_size() for t in self.tensors.values())


def plan(pw, dtype=torch.bfloat16, ms=DEFAULT_MS, *, compile: bool = True) -> HummingPlan:
    """Repack pw into humming's layout (humming's transform, on pw's CUDA device) and choose its kernel per M bucket
    (humming's heuristics at the sample Ms). compile=False leaves the kernels to compile_plans / the first run."""
    require_humming("the humming weight GEMM")
    why = why_not(pw, dtype)
    if why is not None:
        raise LowbitError(f"humming cannot run this {pw.kind} weight (N={pw.N}, K={pw.K}, group {pw.group}): {why}")
    if pw.qweight.device.type != "cuda":
        raise LowbitError(f"humming runs on CUDA; the weight is on {pw.qweight.device}")
    with torch.cuda.device(pw.qweight.device):  # humming reads the current device (capability, SMs, its kernels)
        p = _transform(pw, dtype, ms)
        if compile:
            load(p)
    return p


def _transform(pw, dtype, ms) -> HummingPlan:
    """humming's meta, transform and per-bucket configs for pw (on the current CUDA device; no kernel compiled)."""
    from humming.layer import HummingLayerMethod
    from humming.schema import HummingInputSchema, HummingWeightSchema
    from humming.tune import get_heuristics_config

    args = schema_args(pw, dtype)
    holder = torch.nn.Module()
    meta = HummingLayerMethod.prepare_layer_meta(
        holder, shape_n=pw.N, shape_k=pw.K, weight_schema=HummingWeightSchema(**args["weight"]),
        input_schema=HummingInputSchema(**args["input"]), has_bias=pw.bias is not None, torch_dtype=dtype)
    for name, t in humming_inputs(pw, dtype).items():
        setattr(holder, name, torch.nn.Parameter(t.clone() if t is pw.qweight else t, requires_grad=False))
    HummingLayerMethod.transform_humming_layer(holder)  # humming's repack, scale permutations, W4A8 int scales
    tuning, last = [], None
    for lo, hi, m in buckets(ms):
        cfg = get_heuristics_config(meta, shape_m=m)
        if last is not None and str(cfg) == str(last):
            tuning[-1][1] = hi  # the same kernel as the bucket below: one wider bucket
        else:
            tuning.append([lo, hi, cfg])
        last = cfg
    tensors = {k: v.data for k, v in holder.named_parameters()}
    return HummingPlan(pw.N, pw.K, dtype, pw.a_bits == 8, tuple(m for _, _, m in buckets(ms)), tensors,
                       meta.to_str(), tuning, locks=torch.zeros(1024, dtype=torch.int32, device=pw.qweight.device),
                       meta=meta)


def _kernel_kwargs(p: HummingPlan) -> list[dict]:
    """The HummingKernel constructor arguments of each bucket, as humming's prepare_kernels builds them."""
    import json

    base = json.loads(p.layer_config)
    base.pop("sublayer_name", None)
    out = []
    for _, _, cfg in p.tuning:
        kw = base | dict(cfg)
        kw.pop("num_sms", None)
        out.append(kw)
    return out


def compile_plans(plans, workers: int = 16, log=None) -> list[str]:
    """Compile every plan's kernels in parallel threads (the JIT's on-disk cache then serves load()); returns one
    line per kernel that failed to compile (its plan then fails at load, and the audit drops the cell)."""
    from concurrent.futures import ThreadPoolExecutor

    from humming.kernel.humming import HummingKernel

    seen, todo = set(), []
    for p in plans:
        for kw in _kernel_kwargs(p):
            key = repr(sorted(kw.items()))
            if key not in seen:
                seen.add(key)
                todo.append(kw)
    dev = torch.cuda.current_device()

    def build(kw):
        try:
            HummingKernel(**kw)
            return None
        except Exception as e:  # noqa: BLE001 -- a config humming's compiler refuses: reported
            return f"humming kernel for N={kw.get('shape_n')} K={kw.get('shape_k')} {kw.get('block_shape')}: " \
                   f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"

    with ThreadPoolExecutor(max_workers=max(1, workers), initializer=torch.cuda.set_device, initargs=(dev,)) as ex:
        errors = [e for e in ex.map(build, todo) if e]
    if log:
        log(f"humming: {len(todo)} kernel(s) compiled for {len(plans)} plan(s), {len(errors)} failed")
    return errors


def load(p: HummingPlan) -> HummingPlan:
    """humming's launch table for the plan (compiles what is not cached yet, in the main thread: loading must be)."""
    if p.configs is None:
        from humming.kernel.humming import HummingKernel

        p.configs = HummingKernel.prepare_kernels(p.layer_config, None, p.tuning)
    return p


def run(p: HummingPlan, x: torch.Tensor, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] (p.dtype; rows contiguous) -> y [M, N] in out_dtype (default p.dtype): one humming launch (A8: after
    lowbit's row quantizer). Capturable once load(p) ran (no compile, no host sync)."""
    from humming import ops

    M, K = x.shape
    if K != p.K:
        raise ValueError(f"x has K={K}, the weight K={p.K}")
    if M == 0:
        return torch.empty(0, p.N, dtype=out_dtype or p.dtype, device=x.device)
    if x.dtype != p.dtype:
        raise ValueError(f"the plan is for {p.dtype} activations, x is {x.dtype}")
    load(p)
    t = p.tensors
    if p.a8:
        from lowbit.kernels.gemm.triton_gemm import quantize_rows

        xin, sx = quantize_rows(x)  # int8 [M, K], fp32 [M]: the twin's codes and scales
        xs = sx.view(M, 1)
    else:
        xin, xs = x.contiguous(), None
    y = ops.launch_kernel(p.configs, xin, t["weight"], None, xs, t.get("weight_scale"), t.get("zero_point"),
                          t.get("bias"), t.get("global_scale"), locks=p.locks)
    return y if out_dtype is None or out_dtype == y.dtype else y.to(out_dtype)


def plan_for(pw, dtype=torch.bfloat16, ms=DEFAULT_MS) -> HummingPlan:
    """The plan kept on pw (made on first use: repack once per weight and activation dtype)."""
    plans = pw.__dict__.setdefault("_humming_plans", {})
    if dtype not in plans:
        plans[dtype] = plan(pw, dtype, ms)
    return plans[dtype]


def linear(x: torch.Tensor, pw, out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, K] bf16/fp16 -> [M, N] through humming (the dispatch's "humming" path)."""
    return run(plan_for(pw, x.dtype), x, out_dtype)


def probe(log=print) -> int:
    """`python -m lowbit.kernels.gemm.humming`: whether humming imports here, its launcher build time, and one small
    W4A16 GEMM against the twin (one kernel compiled). 0 when all of that worked."""
    import time

    why = humming_missing()
    if why is not None:
        log(why)
        return 1
    from importlib.metadata import version

    log(f"humming-kernels {version('humming-kernels')} imports on {torch.cuda.get_device_name()}")
    t = time.time()
    from humming.ops.utils import init_humming_launcher

    init_humming_launcher()
    log(f"humming launcher built in {time.time() - t:.0f}s")
    from lowbit.kernels.gemm.triton_gemm import random_weight

    pw = random_weight("w4a16-g128", 256, 512, "cuda")
    t = time.time()
    p = plan(pw, torch.bfloat16, ms=(16,))
    log(f"one humming kernel compiled and loaded in {time.time() - t:.0f}s")
    worst = 0.0
    for M in (1, 5, 16, 40):
        x = torch.randn(M, pw.K, device="cuda", dtype=torch.bfloat16)
        y, ref = run(p, x, torch.float32), linear_twin(x, pw, torch.float32)
        worst = max(worst, float((y - ref).norm() / ref.norm()) if bool(torch.isfinite(y).all()) else float("inf"))
    log(f"w4a16-g128 N=256 K=512 M 1/5/16/40 against the twin: worst rel L2 {worst:.2e}")
    return 0 if worst < 1e-2 else 2


if __name__ == "__main__":
    import sys

    sys.exit(probe())
