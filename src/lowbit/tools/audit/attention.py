"""Audit every Triton kernel against its torch twin on the current device.

`audit(device)` runs a shape sweep (full shapes on CUDA, small ones under the CPU interpreter),
and returns one AuditRow per case: relative L2 error, max relative error, NaN/Inf, pass/fail.
A kernel that returns garbage on some GPU generation while the capability query says yes is
exactly what this catches, so run it on the device before trusting the kernel there.
"""

from __future__ import annotations

import time

import torch

from lowbit.kernels.attention.reference import (
    decode_attention_latent_ref,
    decode_attention_ref,
    decode_attention_vq_ref,
    dequantize_mid,
)
from lowbit.kernels.twin import TOL, AuditRow
from lowbit.quant import residual, vq
from lowbit.quant import scale_format as sf
from lowbit.quant.affine import centre, quantize, quantize_centred
from lowbit.quant.packing import pack
from lowbit.vllm_plugin.kernel_audit import audit_plugin


def _packed(x, bits, group, zero="group", scale_format="fp16"):
    """-> codes, scale, zero (None for zero "none": scale-only groups, lowbit.kv.codec; their scale is
    uint8 UE5M3 codes with scale_format "ue5m3")."""
    if zero == "none":
        one_byte = scale_format == "ue5m3"
        qz = quantize_centred(x, bits, group, grid="std" if bits <= 4 else "absmax", scale_format=scale_format,
                              scale_dtype=torch.float32 if one_byte else torch.float16)
        scale = sf.encode(qz.scale) if one_byte else qz.scale
        return (pack(qz.codes, bits, "strided") if bits < 8 else qz.codes), scale, None
    qz = quantize(x, bits, group, scale_dtype=torch.float16)
    return pack(qz.codes, bits, "strided"), qz.scale, qz.zero


def make_case(B, Hq, Hkv, D, T, kbits, vbits, *, group=None, sink=0, recent=0, ragged=False, zero="group",
              scale_format="fp16", dtype=torch.bfloat16, device="cpu", seed=0):
    """Random inputs for decode_attention: keys with per-channel offsets (outlier channels), packed
    through lowbit.quant (the one quantizer + the strided layout). zero "none": K and V in scale-only
    groups (no zero stored; the kernel computes zero = -centre * scale), with scale_format "ue5m3" their
    scales as one-byte codes."""
    g = torch.Generator(device=device).manual_seed(seed)
    group = group or D

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    kx = rnd(B, Hkv, T, D) + 2.0 * rnd(1, Hkv, 1, D)
    vx = rnd(B, Hkv, T, D)
    kc, ks, kz = _packed(kx, kbits, group, zero, scale_format)
    vc, vs, vz = _packed(vx, vbits, group, zero, scale_format)
    del kx, vx
    lens = torch.randint(0, T + 1, (B,), generator=g, device=device) if ragged else torch.full((B,), T, device=device)
    kw = {"q": rnd(B, Hq, D).to(dtype), "k_codes": kc, "k_scale": ks, "k_zero": kz,
              "v_codes": vc, "v_scale": vs, "v_zero": vz, "mid_lens": lens.to(torch.int32), "k_bits": kbits, "v_bits": vbits}
    if zero == "none":
        kw.update(k_centre=centre(kbits), v_centre=centre(vbits))
    if sink:
        kw.update(sink_k=rnd(B, Hkv, sink, D).to(dtype), sink_v=rnd(B, Hkv, sink, D).to(dtype))
    if recent:
        kw.update(recent_k=rnd(B, Hkv, recent, D).to(dtype), recent_v=rnd(B, Hkv, recent, D).to(dtype),
                  recent_lens=torch.randint(0, recent + 1, (B,), generator=g, device=device).to(torch.int32))
    return kw


def sweep(device: str) -> list[dict]:
    """(name, kwargs for make_case) covering bits 2/4/8 and k4v2, head_dim 64/128/256, GQA 1/3/4/8/9,
    batches 1..17, ragged lengths incl. empty sequences, with and without dense tiers."""
    if device == "cuda":
        base = [
            (16, 32, 8, 128, 32768, 2, 2, {}),
            (16, 32, 8, 128, 32768, 4, 4, {}),
            (4, 32, 8, 128, 16384, 8, 8, {}),
            (1, 32, 8, 128, 131072, 2, 2, {}),
            (8, 32, 8, 128, 8000, 4, 2, {"ragged": True}),
            (16, 4, 1, 256, 32768, 2, 2, {"group": 128}),
            (3, 4, 1, 256, 5000, 4, 4, {"group": 128, "ragged": True}),
            (2, 8, 8, 64, 4096, 2, 2, {}),  # MHA
            (5, 24, 8, 128, 1000, 2, 2, {"ragged": True}),  # GQA 3
            (17, 9, 1, 64, 129, 2, 2, {"ragged": True}),  # GQA 9
            (7, 64, 8, 128, 3000, 2, 4, {"ragged": True}),  # GQA 8
            (16, 32, 8, 128, 32768, 2, 2, {"zero": "none"}),  # scale-only groups
            (17, 9, 3, 64, 4099, 2, 2, {"zero": "none", "ragged": True}),  # smollm2's geometry, scale-only
            (3, 4, 1, 256, 5000, 2, 4, {"group": 128, "zero": "none", "ragged": True}),
            (16, 32, 8, 128, 32768, 2, 2, {"zero": "none", "scale_format": "ue5m3"}),  # one-byte scales
            (17, 9, 3, 64, 4099, 4, 2, {"zero": "none", "scale_format": "ue5m3", "ragged": True}),
            (3, 4, 1, 256, 5000, 2, 2, {"group": 128, "zero": "none", "scale_format": "ue5m3", "ragged": True}),
        ]
        out = []
        for B, Hq, Hkv, D, T, kb, vb, extra in base:
            for tiers in ({}, {"sink": 64, "recent": 256}):
                out.append((f"B{B} Hq{Hq}/Hkv{Hkv} D{D} T{T} k{kb}v{vb}" + (" +tiers" if tiers else "")
                            + (" ragged" if extra.get("ragged") else "") + (" scale-only" if extra.get("zero") else "")
                            + (" ue5m3" if extra.get("scale_format") == "ue5m3" else ""),
                            dict(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, kbits=kb, vbits=vb, **extra, **tiers)))
        return out
    return [
        ("B1 Hq4/Hkv1 D64 T1 k2v2", {"B": 1, "Hq": 4, "Hkv": 1, "D": 64, "T": 1, "kbits": 2, "vbits": 2}),
        ("B2 Hq3/Hkv1 D64 T7 k4v4 +tiers", {"B": 2, "Hq": 3, "Hkv": 1, "D": 64, "T": 7, "kbits": 4, "vbits": 4, "sink": 3, "recent": 5}),
        ("B5 Hq8/Hkv2 D64 T129 k2v2 ragged", {"B": 5, "Hq": 8, "Hkv": 2, "D": 64, "T": 129, "kbits": 2, "vbits": 2, "ragged": True}),
        ("B1 Hq8/Hkv1 D64 T1000 k8v8", {"B": 1, "Hq": 8, "Hkv": 1, "D": 64, "T": 1000, "kbits": 8, "vbits": 8}),
        ("B2 Hq2/Hkv2 D128 T70 k4v2 g64", {"B": 2, "Hq": 2, "Hkv": 2, "D": 128, "T": 70, "kbits": 4, "vbits": 2, "group": 64}),
        ("B3 Hq9/Hkv3 D64 T99 k2v2 scale-only ragged", {"B": 3, "Hq": 9, "Hkv": 3, "D": 64, "T": 99, "kbits": 2,
                                                        "vbits": 2, "zero": "none", "ragged": True}),
        ("B3 Hq9/Hkv3 D64 T99 k4v2 scale-only ue5m3 ragged +tiers", {
            "B": 3, "Hq": 9, "Hkv": 3, "D": 64, "T": 99, "kbits": 4, "vbits": 2, "zero": "none",
            "scale_format": "ue5m3", "ragged": True, "sink": 3, "recent": 5}),
    ]


def make_latent_case(B, Hq, D, DR, T, bits, *, group=128, sink=0, recent=0, ragged=False, dense_mid=False,
                     dtype=torch.bfloat16, device="cpu", seed=0):
    """Random inputs for decode_attention_latent: one latent head (c_kv / Gemma-4's V) with per-channel
    offsets, packed through lowbit.quant, its dense key part (k_pe / K's RoPE dims) and dense tiers."""
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    x = rnd(B, 1, T, D) + 1.5 * rnd(1, 1, 1, D)
    if dense_mid:
        c, s, z = x.to(dtype), None, None
    else:
        c, s, z = _packed(x, bits, group)
    del x
    lens = torch.randint(0, T + 1, (B,), generator=g, device=device) if ragged else torch.full((B,), T, device=device)
    kw = {"q_lat": rnd(B, Hq, D).to(dtype), "q_pe": rnd(B, Hq, DR).to(dtype), "codes": c, "scale": s, "zero": z,
          "pe": rnd(B, 1, T, DR).to(dtype), "mid_lens": lens.to(torch.int32), "bits": bits, "dense_mid": dense_mid}
    if sink:
        kw.update(sink_v=rnd(B, 1, sink, D).to(dtype), sink_pe=rnd(B, 1, sink, DR).to(dtype))
    if recent:
        kw.update(recent_v=rnd(B, 1, recent, D).to(dtype), recent_pe=rnd(B, 1, recent, DR).to(dtype),
                  recent_lens=torch.randint(0, recent + 1, (B,), generator=g, device=device).to(torch.int32))
    return kw


def geo_sweep(device: str) -> list[tuple]:
    """(kernel, name, kwargs) for the geometry kernel: MLA latent (DeepSeek-V3 128 heads, TP8 16 heads),
    Gemma-4 full K = V (16 heads, 512 + 128 RoPE dims), Kimi-K2 K192/V128 (64 heads), head_dim 512 GQA;
    bits 2/4/8, ragged lengths, with and without dense tiers, the bf16 dense-latent baseline."""
    if device == "cuda":
        # the bench's shapes (B16 / B1 at 32k) without tiers, odd ones with the sink/recent tiers
        lat = [(16, 128, 512, 64, 32768, 2, {}), (1, 128, 512, 64, 32768, 2, {}), (16, 16, 512, 64, 32768, 2, {}),
               (3, 128, 512, 64, 5000, 4, {"ragged": True, "tiers": True}), (16, 16, 512, 128, 32768, 2, {}),
               (3, 16, 512, 128, 3000, 8, {"ragged": True, "tiers": True}),
               (2, 128, 512, 64, 4096, 16, {"dense_mid": True, "tiers": True}),
               # the int2 latent above runs the CUDA middle by default (decode_geometry.default_impl): the Triton
               # middle at the bench's shapes, the CUDA one's other instance, and odd CUDA cases
               (16, 128, 512, 64, 32768, 2, {"config": {"impl": "triton"}}),
               (16, 16, 512, 64, 32768, 2, {"config": {"impl": "triton"}}),
               (1, 16, 512, 64, 32768, 2, {"config": {"impl": "triton"}}),
               (16, 16, 512, 64, 32768, 2, {"config": {"impl": "cuda", "num_warps": 4}}),
               (16, 128, 512, 64, 32768, 2, {"config": {"impl": "cuda", "num_warps": 8}}),
               (3, 16, 512, 64, 5000, 2, {"ragged": True, "tiers": True}),
               (5, 32, 512, 64, 999, 2, {"ragged": True, "tiers": True, "config": {"impl": "cuda", "num_warps": 4}})]
        mha = [(16, 64, 64, 192, 128, 8192, 2, 2, 64, False), (1, 64, 64, 192, 128, 32768, 4, 4, 64, False),
               (5, 64, 64, 192, 128, 1000, 2, 4, 64, True), (16, 16, 1, 512, 512, 32768, 2, 2, 128, False),
               (3, 16, 1, 512, 512, 5000, 4, 4, 128, True)]
        tiers = {"sink": 64, "recent": 256}
    else:
        lat = [(1, 3, 512, 64, 17, 2, {}), (3, 5, 512, 64, 99, 4, {"ragged": True, "tiers": True}),
               (1, 4, 512, 128, 17, 2, {"tiers": True}), (2, 3, 512, 64, 17, 16, {"dense_mid": True, "tiers": True})]
        mha = [(3, 2, 2, 192, 128, 17, 2, 2, 64, True), (1, 3, 1, 512, 512, 19, 4, 4, 128, True)]
        tiers = {"sink": 3, "recent": 5}
    out = []
    for B, Hq, D, DR, T, bits, extra in lat:
        extra = dict(extra)
        for tr in ((tiers,) if extra.pop("tiers", False) else ({},)):
            what = "bf16 latent" if extra.get("dense_mid") else f"int{bits}"
            conf = extra.get("config")
            out.append(("decode_latent", f"B{B} Hq{Hq} D{D}+{DR} T{T} {what}" + (" +tiers" if tr else "")
                        + ("".join(f" {k}={v}" for k, v in conf.items()) if conf else "")
                        + (" ragged" if extra.get("ragged") else ""),
                        dict(B=B, Hq=Hq, D=D, DR=DR, T=T, bits=bits, **extra, **tr)))
    for B, Hq, Hkv, Dk, Dv, T, kb, vb, grp, with_tiers in mha:
        for tr in ((tiers,) if with_tiers else ({},)):
            out.append(("decode_geometry", f"B{B} Hq{Hq}/Hkv{Hkv} K{Dk}/V{Dv} T{T} k{kb}v{vb}" + (" +tiers" if tr else ""),
                        dict(B=B, Hq=Hq, Hkv=Hkv, D=Dk, Dv=Dv, T=T, kbits=kb, vbits=vb, group=grp, **tr)))
    return out


def _row(kernel, name, out, ref, t):
    finite = bool(torch.isfinite(out).all())
    d = (out.double() - ref.double())
    rel = float(d.norm() / ref.double().norm().clamp_min(1e-30)) if finite else float("inf")
    mrel = float(d.abs().max() / ref.double().abs().max().clamp_min(1e-30)) if finite else float("inf")
    return AuditRow(kernel, name, rel, mrel, finite, finite and rel <= TOL, time.time() - t)


def audit_geometry(device: str | None = None, cases=None) -> list[AuditRow]:
    """The geometry kernel (lowbit.kernels.attention.geometry) against its twins, default launch config
    on CUDA, a small one under the interpreter."""
    from lowbit.kernels.attention.geometry import GeoConfig, decode_attention_geo, decode_attention_latent
    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    cfg = GeoConfig() if device == "cuda" else GeoConfig(block_t=16, num_splits=3, dense_block=16)
    rows = []
    for kernel, name, kw in cases or geo_sweep(device):
        t = time.time()
        if kernel == "decode_latent":
            conf = kw.pop("config", None)
            inp = make_latent_case(**kw, device=device, seed=len(rows))
            if conf:
                kw["config"] = conf
            q = inp["q_lat"]
            out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=device)
            _, launch = decode_attention_latent(**inp, config=GeoConfig(**conf) if conf else cfg, out=out,
                                                return_launch=True)
            name = f"{name} [{launch.config.impl}]"  # the middle's kernel (the default picks per shape)
            ref = decode_attention_latent_ref(**inp)
        else:
            Dv = kw.pop("Dv")
            inp = _make_geo_case(**kw, Dv=Dv, device=device, seed=len(rows))
            q = inp["q"]
            out = torch.full((q.shape[0], q.shape[1], Dv), float("nan"), dtype=torch.float32, device=device)
            decode_attention_geo(**inp, config=cfg, out=out)
            ref = decode_attention_ref(**inp)
            kw["Dv"] = Dv
        rows.append(_row(kernel, name, out, ref, t))
        del inp, out, ref
    return rows


def _make_geo_case(B, Hq, Hkv, D, Dv, T, kbits, vbits, *, group, sink=0, recent=0, device="cpu", seed=0,
                   dtype=torch.bfloat16):
    """make_case with a V head_dim of its own (V's group: min(group, Dv))."""
    kw = make_case(B, Hq, Hkv, D, T, kbits, vbits, group=group, sink=sink, recent=recent, device=device, seed=seed,
                   dtype=dtype)
    g = torch.Generator(device=device).manual_seed(seed + 1)
    vc, vs, vz = _packed(torch.randn(B, Hkv, T, Dv, generator=g, device=device), vbits, min(group, Dv))
    kw.update(v_codes=vc, v_scale=vs, v_zero=vz)
    for name in ("sink", "recent"):
        if f"{name}_v" in kw:
            kw[f"{name}_v"] = torch.randn(B, Hkv, kw[f"{name}_v"].shape[2], Dv, generator=g, device=device).to(dtype)
    return kw


def audit(device: str | None = None, cases=None, config=None,
          kernels=("decode_attention", "decode_geometry", "decode_vq")) -> list[AuditRow]:
    """Run the sweep on `device` ('cuda' or 'cpu'; default: cuda if available) with the kernel's
    default launch config (or `config`). kernels: which sweeps ("decode_attention": the 64/128/256
    kernel; "decode_geometry": the geometry kernel's latent and K/V cases; "decode_vq": the VQ-row kernel;
    "vllm_cpu": the vLLM plugin's C++ CPU kernels, lowbit.vllm_plugin.kernel_audit)."""
    from lowbit.kernels.attention.tiers import KernelConfig, decode_attention

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    vq_rows = audit_vq(device) if "decode_vq" in kernels and cases is None else []
    if "decode_attention" not in kernels:
        return (audit_geometry(device) if "decode_geometry" in kernels else []) + vq_rows + _plugin_rows(kernels)
    if config is not None:
        cfg = config
    else:
        cfg = KernelConfig() if device == "cuda" else KernelConfig(warp_tokens=16, num_warps=2, num_splits=3,
                                                                  dense_block=16)
    rows = []
    for name, kw in cases or sweep(device):
        t = time.time()
        inp = make_case(**kw, device=device, seed=len(rows))
        q = inp["q"]
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=device)  # poisoned
        decode_attention(**inp, config=cfg, out=out)
        ref = decode_attention_ref(**inp)
        finite = bool(torch.isfinite(out).all())
        d = (out.double() - ref.double())
        rel = float(d.norm() / ref.double().norm().clamp_min(1e-30)) if finite else float("inf")
        mrel = float(d.abs().max() / ref.double().abs().max().clamp_min(1e-30)) if finite else float("inf")
        rows.append(AuditRow("decode_attention", name, rel, mrel, finite, finite and rel <= TOL,
                             time.time() - t))
        del inp, out, ref
    if "decode_geometry" in kernels and cases is None:
        rows += audit_geometry(device)
    return rows + vq_rows + _plugin_rows(kernels)


def make_vq_case(B, Hq, Hkv, D, T, k, v, *, sink=0, recent=0, ragged=False, dtype=torch.bfloat16, device="cpu", seed=0):
    """Inputs for lowbit.kernels.attention.vq.decode_attention_vq. k / v: ("vq", SUB, E, scale_format) with a random
    codebook per KV head, or ("scalar", bits, group, scale_format) scale-only groups; a 5th item
    "sign" / "qjl" adds a 1-bit residual; rows (keys with per-channel offsets) written through lowbit.quant
    (the codec's own encoders and packing)."""
    from dataclasses import replace

    from lowbit.kernels.attention.vq import MidTensor
    g = torch.Generator(device=device).manual_seed(seed)

    def rnd(*shape):
        return torch.randn(*shape, generator=g, device=device)

    def base(x, spec):
        if spec[0] == "vq":
            _, sub, e, fmt = spec[:4]
            cb = rnd(Hkv, e, sub).half()
            idx, s = vq.encode(x, cb, fmt)
            return MidTensor(vq.pack_idx(idx, e), sf.encode(s) if fmt == "ue5m3" else s.half(),
                             int(vq.bits_per_element(sub, e)), cb)
        _, bits, group, fmt = spec[:4]
        one = fmt == "ue5m3"
        q = quantize_centred(x, bits, group, grid="std" if bits <= 4 else "absmax", scale_format=fmt,
                             scale_dtype=torch.float32 if one else torch.float16)
        return MidTensor(pack(q.codes, bits, "strided") if bits < 8 else q.codes,
                         sf.encode(q.scale) if one else q.scale, bits, None, centre(bits))

    def mid(x, spec):
        m = base(x, spec)
        if len(spec) < 5 or spec[4] is None:
            return m
        rb, gain = residual.encode(x.float() - dequantize_mid(m), spec[4], spec[3])  # the codec's order
        return replace(m, rbits=rb, rgain=sf.encode(gain) if spec[3] == "ue5m3" else gain.half())

    kw = {"q": rnd(B, Hq, D).to(dtype), "k_mid": mid(rnd(B, Hkv, T, D) + 2.0 * rnd(1, Hkv, 1, D), k),
          "v_mid": mid(rnd(B, Hkv, T, D), v),
          "mid_lens": (torch.randint(0, T + 1, (B,), generator=g, device=device) if ragged
                       else torch.full((B,), T, device=device)).to(torch.int32)}
    if sink:
        kw.update(sink_k=rnd(B, Hkv, sink, D).to(dtype), sink_v=rnd(B, Hkv, sink, D).to(dtype))
    if recent:
        kw.update(recent_k=rnd(B, Hkv, recent, D).to(dtype), recent_v=rnd(B, Hkv, recent, D).to(dtype),
                  recent_lens=torch.randint(0, recent + 1, (B,), generator=g, device=device).to(torch.int32))
    return kw


VQ_K, VQ_V = ("vq", 2, 16, "ue5m3"), ("vq", 4, 256, "ue5m3")
RES_K, RES_V = ("scalar", 2, 64, "ue5m3", "sign"), ("scalar", 2, 64, "ue5m3", "qjl")  # int2 + a 1-bit residual


def _spec_name(x) -> str:
    return f"{x[0]}{x[1]}x{x[2]}" + (f"+{x[4]}" if len(x) > 4 and x[4] else "")


def vq_sweep(device: str) -> list[tuple[str, dict]]:
    """(name, make_vq_case kwargs): VQ 2x16 / 4x256 rows with one-byte and fp16 scales, a scalar int4 K beside
    VQ V (the shipped recipes' int4-key layers), head_dim 64/128/256, GQA 1/3/4, ragged lengths, dense tiers."""
    if device == "cuda":
        base = [(16, 32, 8, 128, 32768, VQ_K, VQ_V, {}),
                (17, 9, 3, 64, 4099, ("scalar", 4, 64, "ue5m3"), VQ_V, {"ragged": True}),
                (3, 4, 1, 256, 5000, ("vq", 2, 16, "fp16"), ("vq", 4, 256, "fp16"), {"ragged": True}),
                (1, 32, 8, 128, 131072, VQ_K, VQ_V, {}),
                (16, 32, 8, 128, 32768, RES_K, RES_V, {}),
                (5, 15, 3, 64, 9999, RES_K, ("scalar", 2, 64, "fp16", "sign"), {"ragged": True}),
                (2, 8, 2, 256, 4097, ("vq", 2, 16, "fp16", "qjl"), ("scalar", 4, 128, "ue5m3"), {})]
        return [(f"B{B} Hq{Hq}/Hkv{Hkv} D{D} T{T} K{_spec_name(k)} V{_spec_name(v)} {k[3]}"
                 + (" ragged" if x.get("ragged") else "") + " +tiers",
                 dict(B=B, Hq=Hq, Hkv=Hkv, D=D, T=T, k=k, v=v, sink=64, recent=256, **x))
                for B, Hq, Hkv, D, T, k, v, x in base]
    return [("B3 Hq9/Hkv3 D64 T99 vq2x16/vq4x256 ue5m3 ragged +tiers",
             {"B": 3, "Hq": 9, "Hkv": 3, "D": 64, "T": 99, "k": VQ_K, "v": VQ_V, "ragged": True, "sink": 3, "recent": 5}),
            ("B2 Hq4/Hkv2 D64 T40 int4-g32/vq4x256 ue5m3",
             {"B": 2, "Hq": 4, "Hkv": 2, "D": 64, "T": 40, "k": ("scalar", 4, 32, "ue5m3"), "v": VQ_V}),
            ("B1 Hq8/Hkv1 D128 T17 vq2x16/int2 fp16 +tiers",
             {"B": 1, "Hq": 8, "Hkv": 1, "D": 128, "T": 17, "k": ("vq", 2, 16, "fp16"), "v": ("scalar", 2, 64, "fp16"),
              "sink": 2, "recent": 3}),
            ("B2 Hq6/Hkv2 D64 T45 int2+sign/int2+qjl ue5m3 ragged +tiers",
             {"B": 2, "Hq": 6, "Hkv": 2, "D": 64, "T": 45, "k": RES_K, "v": RES_V, "ragged": True, "sink": 2,
              "recent": 3})]


def audit_vq(device: str | None = None, cases=None) -> list[AuditRow]:
    """The VQ-row kernel (lowbit.kernels.attention.vq) against its twin (reference.decode_attention_vq_ref)."""
    from lowbit.kernels.attention.vq import decode_attention_vq

    device = device or ("cuda" if torch.cuda.is_available() else "cpu")
    rows = []
    for name, kw in cases or vq_sweep(device):
        t = time.time()
        inp = make_vq_case(**kw, device=device, seed=len(rows))
        q = inp["q"]
        out = torch.full(q.shape, float("nan"), dtype=torch.float32, device=device)  # poisoned
        decode_attention_vq(**inp, out=out, num_splits=None if device == "cuda" else 3)
        rows.append(_row("decode_vq", name, out, decode_attention_vq_ref(**inp), t))
        del inp, out
    return rows


def _plugin_rows(kernels) -> list[AuditRow]:
    """"vllm_cpu": the vLLM plugin's C++ CPU kernels (paged_decode, encode_cells) against their twins."""
    if "vllm_cpu" not in kernels:
        return []

    return audit_plugin()


def format_table(rows: list[AuditRow]) -> str:
    w = max(len(r.case) for r in rows)
    lines = [f"{'kernel':<17} {'case':<{w}}  {'rel_l2':>9} {'max_rel':>9}  finite  result"]
    for r in rows:
        lines.append(f"{r.kernel:<17} {r.case:<{w}}  {r.rel_l2:9.2e} {r.max_rel:9.2e}  {r.finite!s:<6}  "
                     f"{'ok' if r.ok else 'FAIL'}")
    bad = sum(not r.ok for r in rows)
    lines.append(f"{len(rows) - bad}/{len(rows)} ok (tolerance rel L2 <= {TOL:g})")
    return "\n".join(lines)
