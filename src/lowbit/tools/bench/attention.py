"""GPU benchmark of the fused decode attention against bf16 SDPA (flash backend, enable_gqa).

Both sides are timed the same way in the same process: a CUDA graph of N back-to-back calls that
cycle through several input sets (so the KV is never served from the 60 MB L2), replayed several
times; the median per-call time is reported. Event-based `triton.testing.do_bench` medians (L2
flushed, launch overhead included) are recorded beside them.
"""

from __future__ import annotations

import math
import platform
import statistics
import time

import torch

from lowbit.quant import scale_format

L2_BYTES = 60 * 2**20

GEOMETRIES = {
    # name: (Hq, Hkv, D, group)
    "llama3-8b": (32, 8, 128, 128),
    "gemma3-1b": (4, 1, 256, 128),  # also gemma3-270m's attention geometry
    "smollm2-135m": (9, 3, 64, 64),
    "qwen2.5-coder-0.5b": (14, 2, 64, 64),
}


def packed_bytes(B, Hkv, L, D, bits, group, scale_only: bool = False, one_byte: bool = False) -> int:
    """Bytes the kernel must read for K + V: codes plus fp16 scale and zero per group (scale-only groups: the
    scale alone; one_byte: a one-byte ue5m3 scale; group = D for VQ rows' one scale per row)."""
    per_tensor = D * bits // 8 + (1 if one_byte else 2 if scale_only else 4) * (D // group)
    return 2 * B * Hkv * L * per_tensor


def bits_tag(spec: tuple) -> str:
    """(kbits, vbits) -> "k2v2"; (kbits, vbits, "so") -> "k2v2so" (scale-only groups, the shipped @2.5 recipes');
    (kbits, vbits, "s8") -> "k2v2s8" (scale-only groups with one-byte ue5m3 scales); (2, 2, "vq") -> "k2v2vq"
    (VQ 2x16 keys and 4x256 values, one ue5m3 scale per row: lowbit.kernels.attention.vq); (2, 2, "rs") -> "k2v2rs"
    (int2 scale-only ue5m3 plus a 1-bit residual on K and V: lowbit.kernels.attention.vq)."""
    return f"k{spec[0]}v{spec[1]}" + (spec[2] if len(spec) > 2 else "")


def dense_bytes(B, Hkv, L, D) -> int:
    return 2 * B * Hkv * L * D * 2


def n_buffers(nbytes: int, cap_bytes: float) -> int:
    """Enough input sets that a cycle is >= 4x L2, within cap_bytes of memory."""
    want = max(2, math.ceil(4 * L2_BYTES / max(1, nbytes)))
    return int(max(1, min(want, 16, cap_bytes // max(1, nbytes))))


def graph_time_ms(fns, reps: int = 5, target_ms: float = 30.0) -> float:
    """Median per-call time (ms) of a CUDA graph of N calls cycling through `fns`."""
    for f in fns:
        f()
    torch.cuda.synchronize()
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    for i in range(len(fns) * 2):
        fns[i % len(fns)]()
    e.record()
    torch.cuda.synchronize()
    est = max(1e-3, s.elapsed_time(e) / (len(fns) * 2))
    n = int(max(len(fns), min(2000, target_ms / est)))
    n = (n // len(fns)) * len(fns) or len(fns)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.stream(stream):
        fns[0]()  # warm the stream
        torch.cuda.synchronize()
        with torch.cuda.graph(g, stream=stream):
            for i in range(n):
                fns[i % len(fns)]()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        s.record()
        g.replay()
        e.record()
        torch.cuda.synchronize()
        times.append(s.elapsed_time(e) / n)
    del g
    return float(statistics.median(times))


def event_time_ms(fns) -> float:
    import triton.testing

    it = [0]

    def f():
        fns[it[0] % len(fns)]()
        it[0] += 1

    return float(triton.testing.do_bench(f, warmup=10, rep=40, return_mode="median"))


def sdpa_case(B, Hq, Hkv, D, L, nbuf, seed=0):
    """Callables running bf16 SDPA (flash backend) over nbuf KV sets."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, 1, D, device="cuda", dtype=torch.bfloat16, generator=g)
    sets = []
    for _ in range(nbuf):
        k = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        v = torch.randn(B, Hkv, L, D, device="cuda", dtype=torch.bfloat16, generator=g)
        sets.append((k, v))

    def mk(k, v):
        def f():
            with sdpa_kernel(SDPBackend.FLASH_ATTENTION):
                return sdpa(q, k, v, enable_gqa=True)
        return f

    return [mk(k, v) for k, v in sets], sets


def kernel_case(B, Hq, Hkv, D, L, kbits, vbits, group, nbuf, cfg, seed=0, scale_only: bool = False,
                one_byte: bool = False):
    """Callables running the fused kernel over nbuf packed KV sets (random codes and scales; scale_only: no zero
    stored, the kernel takes the centre code, as lowbit.kv.codec writes zero "none" groups; one_byte: those
    scales as uint8 ue5m3 codes, scale_format "ue5m3")."""
    from lowbit.kernels.attention.tiers import decode_attention
    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    ng = D // group
    sets = []
    for _ in range(nbuf):
        t = {}
        for n, bits in (("k", kbits), ("v", vbits)):
            t[n + "c"] = torch.randint(0, 256, (B, Hkv, L, D * bits // 8), device="cuda", dtype=torch.uint8,
                                       generator=g)
            t[n + "s"] = (torch.rand(B, Hkv, L, ng, device="cuda", generator=g) * 0.1 + 0.01).half()
            if one_byte:
                t[n + "s"] = scale_format.encode(t[n + "s"].float())
            t[n + "z"] = None if scale_only or one_byte else (-torch.rand(B, Hkv, L, ng, device="cuda", generator=g)).half()
        sets.append(t)
    centre = {"k_centre": ((1 << kbits) - 1) / 2, "v_centre": ((1 << vbits) - 1) / 2} if scale_only or one_byte else {}

    def mk(t):
        def f():  # the set keeps what its last call launched (t["launch"]: decode_attention.Launch)
            o, t["launch"] = decode_attention(q, t["kc"], t["ks"], t["kz"], t["vc"], t["vs"], t["vz"], k_bits=kbits,
                                              v_bits=vbits, config=cfg, out=out, return_launch=True, **centre)
            return o
        return f

    return [mk(t) for t in sets], sets


def vq_case(B, Hq, Hkv, D, L, nbuf, seed=0):
    """Callables running lowbit.kernels.attention.vq over nbuf VQ middle tiers (K 2x16, V 4x256, ue5m3 row scales;
    random codes, scales and codebooks), as a VQ recipe stores them."""
    from lowbit.kernels.attention.vq import MidTensor, decode_attention_vq

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)
    sets = []
    for _ in range(nbuf):
        t = {}
        for n, (sub, e) in (("k", (2, 16)), ("v", (4, 256))):
            codes = torch.randint(0, 256, (B, Hkv, L, D // 4), device="cuda", dtype=torch.uint8, generator=g)
            scale = torch.randint(100, 140, (B, Hkv, L, 1), device="cuda", dtype=torch.uint8, generator=g)
            t[n] = MidTensor(codes, scale, 2, torch.randn(Hkv, e, sub, device="cuda", generator=g).half())
        sets.append(t)

    def mk(t):
        def f():
            return decode_attention_vq(q, t["k"], t["v"], sm_scale=None, out=out)
        return f

    return [mk(t) for t in sets], sets


def residual_case(B, Hq, Hkv, D, L, group, nbuf, seed=0):
    """Callables running lowbit.kernels.attention.vq over nbuf middle tiers of int2 scale-only groups with one-byte
    ue5m3 scales plus a 1-bit residual on K and V (sign bits + one ue5m3 gain per row; random fields)."""
    from lowbit.kernels.attention.vq import MidTensor, decode_attention_vq

    g = torch.Generator(device="cuda").manual_seed(seed)
    q = torch.randn(B, Hq, D, device="cuda", dtype=torch.bfloat16, generator=g)
    out = torch.empty(B, Hq, D, device="cuda", dtype=torch.bfloat16)

    def u8(*shape, lo=0, hi=256):
        return torch.randint(lo, hi, shape, device="cuda", dtype=torch.uint8, generator=g)

    sets = [{n: MidTensor(u8(B, Hkv, L, D // 4), u8(B, Hkv, L, D // group, lo=100, hi=140), 2, None, 1.5,
                          u8(B, Hkv, L, D // 8), u8(B, Hkv, L, 1, lo=90, hi=120)) for n in ("k", "v")}
            for _ in range(nbuf)]

    def mk(t):
        def f():
            return decode_attention_vq(q, t["k"], t["v"], sm_scale=None, out=out)
        return f

    return [mk(t) for t in sets], sets


def env_info() -> dict:
    import triton

    info = {"torch": torch.__version__, "triton": triton.__version__, "python": platform.python_version(),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}
    try:
        import transformers

        info["transformers"] = transformers.__version__
    except ImportError:
        pass
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        info.update(gpu=p.name, sms=p.multi_processor_count, memory_gb=round(p.total_memory / 1e9, 1),
                    cuda=torch.version.cuda, capability=f"{p.major}.{p.minor}")
    return info


def run(batches=(1, 16, 64), lengths=(4096, 32768, 131072), geometries=("llama3-8b", "gemma3-1b"),
        bits=((2, 2), (4, 4), (8, 8)), configs=None, mem_cap_gb: float = 60.0, event_timing: bool = False,
        log=print) -> dict:
    """The decode-attention table. bits: (kbits, vbits) or (kbits, vbits, "so") for scale-only groups (tag
    "k2v2so"), (kbits, vbits, "s8") for them with one-byte ue5m3 scales (tag "k2v2s8"). configs:
    {(geometry, B, L, kbits): KernelConfig} (default: the kernel's own choice). Returns a
    JSON-able dict with env, rows and the ratios."""
    from lowbit.kernels.attention.tiers import KernelConfig

    configs = configs or {}
    rows = []
    for geo in geometries:
        Hq, Hkv, D, group = GEOMETRIES[geo]
        for B in batches:
            for L in lengths:
                db = dense_bytes(B, Hkv, L, D)
                if db > mem_cap_gb * 1e9:
                    log(f"skip {geo} B{B} L{L}: bf16 KV {db / 1e9:.0f} GB over the {mem_cap_gb:.0f} GB cap")
                    continue
                nb = n_buffers(db, mem_cap_gb * 1e9)
                fns, keep = sdpa_case(B, Hq, Hkv, D, L, nb)
                t_ref = graph_time_ms(fns)
                row = {"geometry": geo, "B": B, "L": L, "Hq": Hq, "Hkv": Hkv, "D": D, "group": group, "bf16_bytes": db, "bf16_buffers": nb,
                           "sdpa_ms": t_ref, "sdpa_tbs": db / t_ref / 1e9}
                if event_timing:
                    row["sdpa_event_ms"] = event_time_ms(fns)
                del fns, keep
                for spec in bits:
                    kb, vb, so, s8 = spec[0], spec[1], spec[2:] == ("so",), spec[2:] == ("s8",)
                    vqr, res = spec[2:] == ("vq",), spec[2:] == ("rs",)
                    pb = packed_bytes(B, Hkv, L, D, kb, D if vqr else group, so or s8 or vqr or res,
                                      one_byte=s8 or vqr or res)
                    if res:  # + D sign bits and a one-byte gain per row, K and V
                        pb += 2 * B * Hkv * L * (D // 8 + 1)
                    nbk = n_buffers(pb, mem_cap_gb * 1e9)
                    cfg = configs.get((geo, B, L, kb)) or KernelConfig()
                    if vqr:
                        fns, keep = vq_case(B, Hq, Hkv, D, L, nbk)
                    elif res:
                        fns, keep = residual_case(B, Hq, Hkv, D, L, group, nbk)
                    else:
                        fns, keep = kernel_case(B, Hq, Hkv, D, L, kb, vb, group, nbk, cfg, scale_only=so, one_byte=s8)
                    t = graph_time_ms(fns)
                    tag = bits_tag(spec)
                    row[f"{tag}_ms"] = t
                    row[f"{tag}_ratio"] = t_ref / t
                    row[f"{tag}_tbs"] = pb / t / 1e9
                    row[f"{tag}_bytes"] = pb
                    if vqr or res:
                        row[f"{tag}_config"] = {"kernel": "decode_vq", "block": 32}
                    else:
                        rc = cfg.resolve(B, Hkv, D, max(kb, vb))
                        launch = keep[0].get("launch")  # what the timed calls launched
                        row[f"{tag}_config"] = dict(rc.__dict__, num_splits=launch.num_splits if launch else None)
                    if event_timing:
                        row[f"{tag}_event_ms"] = event_time_ms(fns)
                    del fns, keep
                torch.cuda.empty_cache()
                rows.append(row)
                log(format_row(row, bits))
    return {"env": env_info(), "rows": rows}


def format_row(r: dict, bits=((2, 2), (4, 4), (8, 8))) -> str:
    s = f"{r['geometry']:<10} B{r['B']:<3} L{r['L']:<7} sdpa {r['sdpa_ms']:.3f} ms ({r['sdpa_tbs']:.2f} TB/s)"
    for spec in bits:
        tag = bits_tag(spec)
        if f"{tag}_ms" in r:
            s += f" | {tag} {r[f'{tag}_ms']:.3f} ms x{r[f'{tag}_ratio']:.2f} {r[f'{tag}_tbs']:.2f} TB/s"
    return s
