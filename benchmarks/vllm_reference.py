"""Reference values for lowbit.eval.peers_vllm, computed by vLLM 0.26.0's own code on a CPU.

    python -m pip download --no-deps vllm==0.26.0 --only-binary=:all: --python-version 3.12 \
        --platform manylinux_2_28_x86_64 -d /tmp/vllm026
    (cd /tmp/vllm026 && mkdir -p src && unzip -q -o vllm-0.26.0-*.whl 'vllm/*.py' -d src)
    TRITON_INTERPRET=1 python benchmarks/vllm_reference.py /tmp/vllm026/src tests/eval/fixtures/vllm026_reference.pt.gz

vLLM is not installed (its package import pulls CUDA extensions); instead the functions named below
are taken from the unzipped source files with `ast` and executed as written: the Triton store and
dequant kernels run in Triton's interpreter (TRITON_INTERPRET=1, numpy on the CPU), the Python helpers
(Lloyd-Max centroids, Hadamard construction, RHT signs, the CPU butterfly) run as they are. The only
stand-ins are platform probes: `current_platform` (not ROCm / XPU, no hadacore) and
`_use_fp8_e4b15` (0: Hopper's e4m3). The fixture stores the inputs and vLLM's outputs (raw cache
bytes, scales, dequantized tensors); tests/eval/test_peers_vllm.py compares the lowbit port to them.
"""

from __future__ import annotations

import ast
import importlib.util
import math
import os
import sys
import types
from pathlib import Path

os.environ.setdefault("TRITON_INTERPRET", "1")

import torch
import triton
import triton.language as tl

FILES = {
    "store": "vllm/v1/attention/ops/triton_turboquant_store.py",
    "decode": "vllm/v1/attention/ops/triton_turboquant_decode.py",
    "flash": "vllm/v1/attention/ops/triton_reshape_and_cache_flash.py",
    "int4": "vllm/v1/attention/ops/int4_per_token_head.py",
    "attn": "vllm/v1/attention/backends/turboquant_attn.py",
    "centroids": "vllm/model_executor/layers/quantization/turboquant/centroids.py",
    "config": "vllm/model_executor/layers/quantization/turboquant/config.py",
}


class _Platform:
    def is_rocm(self):
        return False

    def is_xpu(self):
        return False

    def is_cuda(self):
        return False

    def is_cuda_alike(self):
        return False


def extract(src_root: Path, rel: str, names: list[str], ns: dict) -> dict:
    """Execute the named top-level functions / assignments of one vLLM file in `ns`."""
    tree = ast.parse((src_root / rel).read_text())
    keep = []
    for node in tree.body:
        name = getattr(node, "name", None)
        if name is None and isinstance(node, (ast.Assign, ast.AnnAssign)):
            tgt = node.targets[0] if isinstance(node, ast.Assign) else node.target
            name = getattr(tgt, "id", None)
        if name in names:
            keep.append(node)
    found = {getattr(n, "name", None) or (n.targets[0] if isinstance(n, ast.Assign) else n.target).id
             for n in keep}
    missing = set(names) - found
    if missing:
        raise SystemExit(f"{rel}: not found: {sorted(missing)}")
    mod = ast.Module(body=keep, type_ignores=[])
    code = compile(mod, str(src_root / rel), "exec")
    exec(code, ns)  # noqa: S102 -- vLLM's own source, run as written (the point of this script)
    return ns


def load_module(src_root: Path, rel: str, name: str):
    spec = importlib.util.spec_from_file_location(name, src_root / rel)
    m = importlib.util.module_from_spec(spec)
    sys.modules[name] = m  # dataclasses look their module up there
    spec.loader.exec_module(m)
    return m


def base_ns() -> dict:
    return {"torch": torch, "triton": triton, "tl": tl, "math": math, "current_platform": _Platform(),
            "Any": object, "functools": __import__("functools")}


def inputs(n: int, h: int, d: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(n, h, d, generator=g) * 2.0
    v = torch.randn(n, h, d, generator=g) * 0.5
    k[0, 0, 3] = 40.0  # an outlier channel value, as real keys have
    v[1, 0, 5] = -6.0
    return k.to(torch.bfloat16), v.to(torch.bfloat16)


def run_turboquant(src: Path, preset: str, k, v) -> dict:
    ns = base_ns()
    ns["_use_fp8_e4b15"] = lambda device=0: 0
    extract(src, FILES["store"], ["_store_quantized_value", "_tq_fused_store_fp8", "_tq_fused_store_mse",
                                  "triton_turboquant_store"], ns)
    extract(src, FILES["decode"], ["_tq_full_dequant_kv"], ns)
    extract(src, FILES["attn"], ["_build_hadamard", "_build_hadamard_cached"], ns)
    cfgmod = load_module(src, FILES["config"], "vllm_tq_config")
    cmod = load_module(src, FILES["centroids"], "vllm_tq_centroids")
    n, h, d = k.shape
    cfg = cfgmod.TurboQuantConfig.from_cache_dtype(preset, d)
    H = ns["_build_hadamard"](d, "cpu")
    centroids = cmod.get_centroids(d, cfg.centroid_bits).float()
    c_sorted, _ = centroids.sort()
    midpoints = (c_sorted[:-1] + c_sorted[1:]) / 2
    block_size = 16
    nblocks = (n + block_size - 1) // block_size
    kv_cache = torch.zeros(nblocks, block_size, h, cfg.slot_size_aligned, dtype=torch.uint8)
    slots = torch.arange(n, dtype=torch.int32)
    ns["triton_turboquant_store"](k, v, kv_cache, slots, H, midpoints, cfg.mse_bits, cfg.key_packed_size,
                                  cfg.value_quant_bits, key_fp8=cfg.key_fp8)
    # _continuation_prefill's dequant: fp16 K (rotated basis for MSE keys) and V, [1, Hk, len, D]
    alloc = nblocks * block_size
    k_out = torch.zeros(1, h, alloc, d, dtype=torch.float16)
    v_out = torch.zeros(1, h, alloc, d, dtype=torch.float16)
    bt = torch.arange(nblocks, dtype=torch.int32)[None, :]
    mse_bits = cfg.key_mse_bits
    ns["_tq_full_dequant_kv"][(alloc, h)](
        kv_cache, bt, centroids, k_out, v_out,
        k_out.stride(0), k_out.stride(1), k_out.stride(2), v_out.stride(0), v_out.stride(1), v_out.stride(2),
        kv_cache.stride(0), kv_cache.stride(1), kv_cache.stride(2), bt.stride(0),
        HEAD_DIM=d, BLOCK_SIZE=block_size, NUM_KV_HEADS=h, MSE_BYTES=math.ceil(d * mse_bits / 8),
        KPS=cfg.key_packed_size, VQB=cfg.value_quant_bits, VAL_DATA_BYTES=math.ceil(d * cfg.value_quant_bits / 8),
        MSE_BITS=mse_bits, KEY_FP8=1 if cfg.key_fp8 else 0, BLOCK_D=triton.next_power_of_2(d),
        NORM_CORRECTION=1 if cfg.norm_correction else 0, FP8_E4B15=0)
    return {"cache": kv_cache.reshape(-1, h, cfg.slot_size_aligned)[:n].clone(),
            "k_dequant": k_out[0, :, :n].transpose(0, 1).clone(),  # [n, h, d]; rotated basis if MSE
            "v_dequant": v_out[0, :, :n].transpose(0, 1).clone(),
            "slot_size_aligned": cfg.slot_size_aligned, "key_packed_size": cfg.key_packed_size,
            "value_packed_size": cfg.value_packed_size}


def run_int8(src: Path, k, v) -> dict:
    ns = base_ns()
    extract(src, FILES["flash"], ["_reshape_cache_per_token_head"], ns)
    n, h, d = k.shape
    kc = torch.zeros(n, 1, h, d, dtype=torch.int8)
    vc = torch.zeros(n, 1, h, d, dtype=torch.int8)
    ks = torch.zeros(n, 1, h, dtype=torch.float32)
    vs = torch.zeros(n, 1, h, dtype=torch.float32)
    slots = torch.arange(n, dtype=torch.int32)
    ns["_reshape_cache_per_token_head"][(n, h)](
        k, v, kc, vc, ks, vs, slots, k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        kc.stride(0), kc.stride(1), kc.stride(2), vc.stride(0), vc.stride(1), vc.stride(2),
        ks.stride(0), ks.stride(1), ks.stride(2), vs.stride(0), vs.stride(1), vs.stride(2),
        block_size=1, head_size=d, head_size_v=d, HEAD_SIZE_PADDED=triton.next_power_of_2(d),
        QUANT_MAX=127.0, QUANT_MIN=-128.0, IS_INT_QUANT=True)
    return {"k_codes": kc[:, 0].clone(), "v_codes": vc[:, 0].clone(), "k_scale": ks[:, 0].clone(),
            "v_scale": vs[:, 0].clone()}


def run_int4(src: Path, k, v) -> dict:
    ns = base_ns()
    ns["_hadacore_available"] = lambda: False
    extract(src, FILES["int4"], ["pack_int4_nibbles", "_reshape_cache_int4_kernel", "_run_reshape_kernel",
                                 "reshape_and_cache_int4", "_INT4_PACKING_FACTOR", "_RHT_SIGNS_CACHE",
                                 "_get_rht_signs", "fast_hadamard_transform", "single_rht",
                                 "_TRITON_HADAMARD_MIN_D", "_TRITON_HADAMARD_MAX_D"], ns)
    n, h, d = k.shape
    kc = torch.zeros(n, 1, h, d // 2, dtype=torch.uint8)
    vc = torch.zeros(n, 1, h, d // 2, dtype=torch.uint8)
    ks = torch.zeros(n, 1, h, dtype=torch.float32)
    vs = torch.zeros(n, 1, h, dtype=torch.float32)
    ns["reshape_and_cache_int4"](k, v, kc, vc, torch.arange(n, dtype=torch.int32), k_scale_cache=ks,
                                 v_scale_cache=vs)
    x = torch.randn(3, d, generator=torch.Generator().manual_seed(7))
    return {"k_packed": kc[:, 0].clone(), "v_packed": vc[:, 0].clone(), "k_scale": ks[:, 0].clone(),
            "v_scale": vs[:, 0].clone(), "rht_in": x, "rht_out": ns["single_rht"](x.clone()),
            "rht_inv_out": ns["single_rht"](x.clone(), inverse=True), "signs": ns["_get_rht_signs"](d, 0, "cpu")}


def run_fp8(src: Path, k, v, k_scale: float, v_scale: float) -> dict:
    ns = base_ns()
    extract(src, FILES["flash"], ["reshape_and_cache_kernel_flash"], ns)
    n, h, d = k.shape
    kc = torch.zeros(n, 1, h, d, dtype=torch.float8_e4m3fn)
    vc = torch.zeros(n, 1, h, d, dtype=torch.float8_e4m3fn)
    ksc = torch.tensor([k_scale], dtype=torch.float32)
    vsc = torch.tensor([v_scale], dtype=torch.float32)
    nn = h * d
    tile = triton.next_power_of_2(nn)
    ns["reshape_and_cache_kernel_flash"][(n, 1)](
        k, v, kc, vc, torch.arange(n, dtype=torch.int32), ksc, vsc, k.stride(0), v.stride(0),
        kc.stride(0), kc.stride(2), 0, 0, kc.stride(1), num_heads=h, head_size=d, block_size=1, x=1,
        USE_HEAD_MAJOR_LAYOUT=False, FP8_KV_CACHE=True, TILE_SIZE=tile)
    return {"k_fp8": kc[:, 0].float(), "v_fp8": vc[:, 0].float(), "k_scale": k_scale, "v_scale": v_scale}


def main(src_root: str, out: str) -> None:
    src = Path(src_root)
    ref = {"vllm": "0.26.0", "files": FILES, "made_by": "benchmarks/vllm_reference.py (TRITON_INTERPRET=1)"}
    cmod = load_module(src, FILES["centroids"], "vllm_tq_centroids")
    ref["centroids"] = {f"{d}_{b}": cmod.get_centroids(d, b).clone() for d in (64, 128, 256) for b in (3, 4)}
    ns = extract(src, FILES["attn"], ["_build_hadamard", "_build_hadamard_cached"], base_ns())
    ref["hadamard_64"] = ns["_build_hadamard"](64, "cpu").clone()
    cfgmod = load_module(src, FILES["config"], "vllm_tq_config")
    ref["skip_layers"] = {n: cfgmod.TurboQuantConfig.get_boundary_skip_layers(
        types.SimpleNamespace(is_hybrid=False, hf_text_config=types.SimpleNamespace(num_hidden_layers=n)))
        for n in (1, 3, 18, 30)}
    for d in (64, 128):
        k, v = inputs(40, 3, d, seed=d)
        case = {"k": k, "v": v}
        for preset in ("turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc"):
            case[preset] = run_turboquant(src, preset, k, v)
            print(f"d={d} {preset}: ok", flush=True)
        case["int8"] = run_int8(src, k, v)
        case["int4"] = run_int4(src, k, v)
        case["fp8"] = run_fp8(src, k, v, 1.0, 1.0)
        case["fp8_scaled"] = run_fp8(src, k, v, 0.05, 0.01)
        print(f"d={d} int8 / int4 / fp8: ok", flush=True)
        ref[f"d{d}"] = case
    Path(out).parent.mkdir(parents=True, exist_ok=True)
    import gzip
    import io

    buf = io.BytesIO()
    torch.save(ref, buf)
    Path(out).write_bytes(gzip.compress(buf.getvalue(), 9, mtime=0))  # torch.save pads every tensor
    print(f"wrote {out}")


if __name__ == "__main__":
    if len(sys.argv) != 3:
        raise SystemExit(__doc__)
    main(sys.argv[1], sys.argv[2])
