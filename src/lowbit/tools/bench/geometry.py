"""GPU benchmark of the geometry decode kernel (lowbit.kernels.attention.geometry): the issue-19 geometries.

Rows have the format of lowbit.tools.bench.attention (results/decode_attention_<gpu>.json): `sdpa_ms` /
`sdpa_tbs` are the bf16 baseline, `k{b}v{b}_ms/_ratio/_tbs/_bytes/_config` the packed kernel. A row
whose baseline is not torch SDPA names it in "baseline" and repeats its time in "baseline_ms"; the
ratios are always relative to the row's baseline. Timing: lowbit.tools.bench.attention.graph_time_ms (a CUDA
graph of calls cycling through enough input sets to defeat the L2), the same for both sides.

Geometries (full-size attention shapes, random codes/scales; bytes from the tensors held):
  deepseek-v3-latent      MLA latent, 128 q heads over one latent (c_kv 512 packed + k_pe 64 bf16);
                          baseline: the same kernel over a dense bf16 latent (best of its configs) or
                          the torch matmul form over a 576-wide bf16 cache, whichever is faster.
  deepseek-v3-latent-tp8  the same with 16 q heads (one GPU of a TP8 deployment).
  kimi-k192v128           expanded MHA, 64 heads, K 192 (group 64) / V 128 (group 128); baseline SDPA.
  gemma4-full512          Gemma-4 full layers, 16 q heads, 1 KV head of 512, K = V stored once
                          (V packed, group 128, + K's 128 RoPE dims bf16); baseline SDPA over K, V [.., 512].
Each packed row is timed under a few launch configs; the fastest is reported with its config and
every candidate's time ("candidates_ms").
"""

from __future__ import annotations

import json

import torch

from lowbit.core.errors import LowbitError
from lowbit.tools.bench.attention import env_info, graph_time_ms, n_buffers

GEOMETRIES = {
    # name: dict(kind, Hq, Hkv, Dk, Dv, DR, gk, gv)
    "deepseek-v3-latent": dict(kind="latent", Hq=128, Hkv=1, Dk=512, Dv=512, DR=64, gk=128, gv=128),
    "deepseek-v3-latent-tp8": dict(kind="latent", Hq=16, Hkv=1, Dk=512, Dv=512, DR=64, gk=128, gv=128),
    "kimi-k192v128": dict(kind="mha", Hq=64, Hkv=64, Dk=192, Dv=128, DR=0, gk=64, gv=128),
    "gemma4-full512": dict(kind="latent", Hq=16, Hkv=1, Dk=512, Dv=512, DR=128, gk=128, gv=128),
}


def candidates(geo: dict, packed: bool = True):
    """Launch configs tried per row of `run` (GeoConfig); the first is the kernel's own default
    (GeoConfig.resolve), the others the runners-up of the H200 sweep (`sweep`)."""
    from lowbit.kernels.attention.geometry import GeoConfig

    if geo["kind"] == "mha":
        return [GeoConfig(), GeoConfig(block_t=64, num_warps=1), GeoConfig(block_t=64, num_warps=2)]
    if packed and geo["kind"] == "latent" and geo["DR"] == 64:
        # the packed DeepSeek latent: GeoConfig() resolves to the CUDA middle (decode_geometry.default_impl), so
        # the Triton middle is named, and the CUDA one's other instances follow
        t = "triton"
        tri = ([GeoConfig(impl=t), GeoConfig(block_t=64, heads=32, impl=t), GeoConfig(block_t=64, heads=16, impl=t)]
               if geo["Hq"] > 16 else
               [GeoConfig(impl=t), GeoConfig(block_t=64, zero_mma=False, impl=t), GeoConfig(block_t=64, q_loop=False,
                                                                                          impl=t)])
        return [GeoConfig(), *tri, GeoConfig(impl="cuda", num_warps=4), GeoConfig(impl="cuda", num_warps=8),
                GeoConfig(impl="cuda", num_warps=4, num_stages=2, waves=3),
                GeoConfig(impl="cuda", num_warps=4, num_stages=2, waves=6)]
    if geo["Hq"] > 16:  # 64 tokens x 32 heads: the best bf16 dense-middle config of the sweep
        return [GeoConfig(), GeoConfig(block_t=64, heads=32), GeoConfig(block_t=64, heads=16)]
    return [GeoConfig(), GeoConfig(block_t=64, zero_mma=False), GeoConfig(block_t=64, q_loop=False)]


def sweep_candidates(geo: dict):
    """The wider grid `sweep` times (tile tokens x warps x heads per program x q in registers/L1 x waves)."""
    from lowbit.kernels.attention.geometry import GeoConfig

    if geo["kind"] == "mha":
        out = [GeoConfig(block_t=bt, num_warps=w) for bt in (32, 64, 128) for w in (1, 2, 4)]
        return out + [GeoConfig(block_t=64, num_warps=4, waves=8), GeoConfig(block_t=64, num_warps=1, zero_mma=False),
                      GeoConfig(block_t=64, num_warps=4, zero_mma=False)]
    heads = (16, 32) if geo["Hq"] > 16 else (16,)
    out = [GeoConfig(block_t=bt, num_warps=w, heads=h) for h in heads for bt in (32, 64) for w in (4, 8)]
    out += [GeoConfig(block_t=64, num_warps=4, q_loop=False), GeoConfig(block_t=64, num_warps=4, waves=8),
            GeoConfig(block_t=64, num_warps=4, zero_mma=False), GeoConfig(block_t=64, num_warps=4, heads=16, waves=2)]
    return out


def sweep(batches=(1, 16), lengths=(32768,), geometries=tuple(GEOMETRIES), bits=(2,), mem_cap_gb: float = 40.0,
          log=print, dev: str = "cuda", timer=graph_time_ms, configs=None) -> dict:
    """Time every sweep_candidates config (or `configs`) of the packed kernel, and for the DeepSeek
    latent of the bf16 dense-middle path, per geometry x batch x length. Returns {"env", "rows"}: one
    row per (geometry, B, L, bits) with {config repr: ms or None} and the best."""
    rows = []
    for name in geometries:
        geo = GEOMETRIES[name]
        cfgs = configs or sweep_candidates(geo)
        for B in batches:
            for L in lengths:
                variants = list(bits) + ([16] if name.startswith("deepseek") else [])
                for b in variants:
                    pb = dense_bytes(geo, B, L) if b == 16 else kernel_bytes(geo, B, L, b)
                    nb = n_buffers(pb, mem_cap_gb * 1e9)
                    if geo["kind"] == "latent":
                        make = (lambda c, b=b, nb=nb: latent_fns(geo, B, L, b, nb, c, dense_mid=b == 16, dev=dev))
                    else:
                        make = (lambda c, b=b, nb=nb: mha_fns(geo, B, L, b, nb, c, dev=dev))
                    t, cfg, launch, cand = _best(make, cfgs, log, timer)
                    row = {"geometry": name, "B": B, "L": L, "bits": b, "bytes": pb, "best_ms": t,
                           "best_tbs": pb / t / 1e9, "best_config": repr(cfg),
                           "best_num_splits": launch.num_splits if launch else None, "candidates_ms": cand,
                           "default_ms": cand.get(repr(GeoConfig_default())),
                           "default_resolved": repr(GeoConfig_default().resolve(
                               geo["Hq"] // geo["Hkv"], geo["Dv"], geo["Dk"] + geo["DR"], geo["kind"] == "latent"))}
                    rows.append(row)
                    log(f"SWEEP {name:<22} B{B:<3} L{L} {'bf16' if b == 16 else f'int{b}'}: best {t:.4f} ms "
                        f"({row['best_tbs']:.2f} TB/s) {cfg} splits {row['best_num_splits']}; default "
                        f"{row['default_ms']}")
                    log("SWEEPROW " + json.dumps(row))
                    if dev == "cuda":
                        torch.cuda.empty_cache()
    return {"env": env_info(), "rows": rows}


def parse_config(text: str):
    """'block_t=64,heads=8,q_loop=0' -> GeoConfig (integers; q_loop / zero_mma 0 or 1)."""
    from lowbit.kernels.attention.geometry import GeoConfig

    fields = {}
    for kv in text.split(","):
        k, _, v = kv.partition("=")
        if k not in GeoConfig.__dataclass_fields__ or not v.lstrip("-").isdigit():
            raise LowbitError(f"--cfg {text!r}: expected name=integer pairs of GeoConfig fields "
                              f"({', '.join(GeoConfig.__dataclass_fields__)})")
        fields[k] = bool(int(v)) if k in ("q_loop", "zero_mma") else int(v)
    return GeoConfig(**fields)


def GeoConfig_default():
    from lowbit.kernels.attention.geometry import GeoConfig

    return GeoConfig()


def kernel_bytes(geo, B, L, bits) -> int:
    """Bytes one decode step reads from the middle: codes + fp16 scale/zero (+ the dense key part)."""
    H = geo["Hkv"]
    if geo["kind"] == "latent":
        per = geo["Dv"] * bits // 8 + 4 * geo["Dv"] // geo["gv"] + 2 * geo["DR"]
    else:
        per = (geo["Dk"] * bits // 8 + 4 * geo["Dk"] // geo["gk"]) + (geo["Dv"] * bits // 8 + 4 * geo["Dv"] // geo["gv"])
    return B * H * L * per


def dense_bytes(geo, B, L) -> int:
    """bf16 bytes of the baseline's cache: latent [c_kv | k_pe]; MHA / Gemma K and V (SDPA reads both)."""
    H = geo["Hkv"]
    if geo["kind"] == "latent" and geo["DR"] == 64:
        return B * H * L * 2 * (geo["Dv"] + geo["DR"])
    return B * H * L * 2 * (geo["Dk"] + geo["Dv"])


def _rand_packed(B, H, L, D, bits, group, g, dev):
    c = torch.randint(0, 256, (B, H, L, D * bits // 8), device=dev, dtype=torch.uint8, generator=g)
    s = (torch.rand(B, H, L, D // group, device=dev, generator=g) * 0.1 + 0.01).half()
    z = (-torch.rand(B, H, L, D // group, device=dev, generator=g)).half()
    return c, s, z


def latent_fns(geo, B, L, bits, nbuf, cfg, dense_mid=False, seed=0, dev="cuda"):
    """Callables of decode_attention_latent over nbuf middle sets (packed, or bf16 with dense_mid)."""
    from lowbit.kernels.attention.geometry import decode_attention_latent

    g = torch.Generator(device=dev).manual_seed(seed)
    Hq, D, DR = geo["Hq"], geo["Dv"], geo["DR"]
    q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
    qp = torch.randn(B, Hq, DR, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty(B, Hq, D, device=dev, dtype=torch.bfloat16)
    sets = []
    for _ in range(nbuf):
        if dense_mid:
            t = {"c": torch.randn(B, 1, L, D, device=dev, dtype=torch.bfloat16, generator=g), "s": None, "z": None}
        else:
            t = dict(zip("csz", _rand_packed(B, 1, L, D, bits, geo["gv"], g, dev)))
        t["pe"] = torch.randn(B, 1, L, DR, device=dev, dtype=torch.bfloat16, generator=g)
        sets.append(t)

    def mk(t):
        def f():
            o, t["launch"] = decode_attention_latent(q, qp, t["c"], t["s"], t["z"], t["pe"], bits=bits,
                                                     dense_mid=dense_mid, config=cfg, out=out, return_launch=True)
            return o
        return f

    return [mk(t) for t in sets], sets


def mha_fns(geo, B, L, bits, nbuf, cfg, seed=0, dev="cuda"):
    from lowbit.kernels.attention.geometry import decode_attention_geo

    g = torch.Generator(device=dev).manual_seed(seed)
    Hq, H, Dk, Dv = geo["Hq"], geo["Hkv"], geo["Dk"], geo["Dv"]
    q = torch.randn(B, Hq, Dk, device=dev, dtype=torch.bfloat16, generator=g)
    out = torch.empty(B, Hq, Dv, device=dev, dtype=torch.bfloat16)
    sets = []
    for _ in range(nbuf):
        kc, ks, kz = _rand_packed(B, H, L, Dk, bits, geo["gk"], g, dev)
        vc, vs, vz = _rand_packed(B, H, L, Dv, bits, geo["gv"], g, dev)
        sets.append(dict(kc=kc, ks=ks, kz=kz, vc=vc, vs=vs, vz=vz))

    def mk(t):
        def f():
            o, t["launch"] = decode_attention_geo(q, t["kc"], t["ks"], t["kz"], t["vc"], t["vs"], t["vz"], k_bits=bits,
                                                  v_bits=bits, config=cfg, out=out, return_launch=True)
            return o
        return f

    return [mk(t) for t in sets], sets


def sdpa_fns(geo, B, L, nbuf, seed=0, dev="cuda"):
    """bf16 SDPA over K [B, Hkv, L, Dk], V [B, Hkv, L, Dv] with the first backend that runs the shape
    (flash, then efficient, cuDNN, math). Returns (fns, sets, backend name). With Hkv < Hq the G query
    heads of a KV head go in as G query positions of one head (no causal mask: the same attention),
    so backends without GQA read each K/V once instead of a repeated copy."""
    from torch.nn.attention import SDPBackend, sdpa_kernel
    from torch.nn.functional import scaled_dot_product_attention as sdpa

    g = torch.Generator(device=dev).manual_seed(seed)
    Hq, H, Dk, Dv = geo["Hq"], geo["Hkv"], geo["Dk"], geo["Dv"]
    q = torch.randn(B, H, Hq // H, Dk, device=dev, dtype=torch.bfloat16, generator=g)
    sets = [(torch.randn(B, H, L, Dk, device=dev, dtype=torch.bfloat16, generator=g),
             torch.randn(B, H, L, Dv, device=dev, dtype=torch.bfloat16, generator=g)) for _ in range(nbuf)]
    for be in (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION, SDPBackend.CUDNN_ATTENTION, SDPBackend.MATH):
        try:
            with sdpa_kernel(be):
                sdpa(q, *sets[0])
            if dev == "cuda":
                torch.cuda.synchronize()
        except RuntimeError:
            continue

        def mk(k, v, be=be):
            def f():
                with sdpa_kernel(be):
                    return sdpa(q, k, v)
            return f

        return [mk(k, v) for k, v in sets], sets, be.name.lower()
    raise RuntimeError("no SDPA backend runs this shape")


def torch_latent_fns(geo, B, L, nbuf, seed=0, dev="cuda"):
    """The MLA decode in plain torch over a bf16 [B, L, 576] cache (FlashMLA's layout: V = its first 512
    columns): one batched GEMM for the scores of all heads, softmax, one GEMM for the values."""
    g = torch.Generator(device=dev).manual_seed(seed)
    Hq, D, DR = geo["Hq"], geo["Dv"], geo["DR"]
    q = torch.randn(B, Hq, D + DR, device=dev, dtype=torch.bfloat16, generator=g)
    sets = [torch.randn(B, L, D + DR, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(nbuf)]
    scale = (D + DR) ** -0.5

    def mk(kv):
        def f():
            s = torch.matmul(q, kv.transpose(1, 2))  # [B, Hq, L]
            p = torch.softmax(s.float() * scale, -1).to(torch.bfloat16)
            return torch.matmul(p, kv[..., :D])
        return f

    return [mk(kv) for kv in sets], sets


def _best(make, cfgs, log, timer):
    """Time make(cfg) for each candidate config; returns (best ms, best cfg, launch, {cfg str: ms})."""
    best, times = None, {}
    for cfg in cfgs:
        try:
            fns, keep = make(cfg)
            t = timer(fns)
        except Exception as e:  # noqa: BLE001  (a candidate that does not compile/fit is reported, not fatal)
            log(f"  config {cfg} failed: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            times[repr(cfg)] = None
            continue
        times[repr(cfg)] = t
        log(f"  config {cfg}: {t:.4f} ms")
        if best is None or t < best[0]:
            best = (t, cfg, keep[0].get("launch"))
        del fns, keep
    if best is None:
        raise RuntimeError("no candidate config ran")
    return best[0], best[1], best[2], times


def run(batches=(1, 16), lengths=(32768,), geometries=tuple(GEOMETRIES), bits=(2, 4), mem_cap_gb: float = 60.0,
        log=print, dev: str = "cuda", timer=graph_time_ms) -> dict:
    """Rows for the geometry kernel (format of lowbit.tools.bench.attention.run). dev/timer: tests run the same
    code on CPU tensors (the Triton interpreter) with a stand-in timer."""
    rows = []
    for name in geometries:
        geo = GEOMETRIES[name]
        for B in batches:
            for L in lengths:
                db = dense_bytes(geo, B, L)
                if db > mem_cap_gb * 1e9:
                    log(f"skip {name} B{B} L{L}: bf16 KV {db / 1e9:.0f} GB over the {mem_cap_gb:.0f} GB cap")
                    continue
                nb = n_buffers(db, mem_cap_gb * 1e9)
                row = {"geometry": name, "B": B, "L": L, "Hq": geo["Hq"], "Hkv": geo["Hkv"], "D": geo["Dk"],
                       "Dv": geo["Dv"], "DR": geo["DR"], "group": geo["gv"], "group_k": geo["gk"],
                       "bf16_bytes": db, "bf16_buffers": nb}
                if geo["kind"] == "latent" and name.startswith("deepseek"):
                    t_k, cfg_k, _, cand = _best(lambda c: latent_fns(geo, B, L, 16, nb, c, dense_mid=True, dev=dev),
                                                candidates(geo, packed=False), log, timer)
                    # the kernel's dense middle holds c_kv and k_pe apart: same bytes as the 576-wide cache
                    fns, keep = torch_latent_fns(geo, B, L, nb, dev=dev)
                    t_t = timer(fns)
                    del fns, keep
                    row.update(bf16_kernel_ms=t_k, bf16_kernel_config=repr(cfg_k), bf16_kernel_candidates_ms=cand,
                               torch_latent_ms=t_t)
                    if t_k <= t_t:
                        row["baseline"] = "lowbit latent kernel over a dense bf16 latent (c_kv 512 + k_pe 64)"
                        t_ref = t_k
                    else:
                        row["baseline"] = "torch matmul-softmax-matmul over a bf16 [B, L, 576] latent cache"
                        t_ref = t_t
                    row.update(baseline_ms=t_ref, baseline_tbs=db / t_ref / 1e9)
                else:
                    fns, keep, be = sdpa_fns(geo, B, L, nb, dev=dev)
                    t_ref = timer(fns)
                    del fns, keep
                    row.update(sdpa_backend=be, sdpa_ms=t_ref, sdpa_tbs=db / t_ref / 1e9)
                    if be != "flash_attention":
                        row["baseline"] = f"torch SDPA ({be}; flash does not run head_dim {geo['Dk']}/{geo['Dv']})"
                        row["baseline_ms"] = t_ref
                if dev == "cuda":
                    torch.cuda.empty_cache()
                for b in bits:
                    pb = kernel_bytes(geo, B, L, b)
                    nbk = n_buffers(pb, mem_cap_gb * 1e9)
                    cfgs = candidates(geo) if b == bits[0] else candidates(geo)[:1]
                    if geo["kind"] == "latent":
                        t, cfg, launch, cand = _best(lambda c: latent_fns(geo, B, L, b, nbk, c, dev=dev), cfgs, log,
                                                     timer)
                    else:
                        t, cfg, launch, cand = _best(lambda c: mha_fns(geo, B, L, b, nbk, c, dev=dev), cfgs, log, timer)
                    tag = f"k{b}v{b}"
                    row[f"{tag}_ms"] = t
                    row[f"{tag}_ratio"] = t_ref / t
                    row[f"{tag}_tbs"] = pb / t / 1e9
                    row[f"{tag}_bytes"] = pb
                    row[f"{tag}_bytes_per_token_layer"] = pb // (B * L)
                    # the config the call resolved (launch.config: the middle's kernel included)
                    row[f"{tag}_config"] = dict((launch.config if launch else
                                                 cfg.resolve(geo["Hq"] // geo["Hkv"], geo["Dv"])).__dict__,
                                                num_splits=launch.num_splits if launch else None)
                    row[f"{tag}_candidates_ms"] = cand
                    if dev == "cuda":
                        torch.cuda.empty_cache()
                row["bf16_bytes_per_token_layer"] = db // (B * L)
                rows.append(row)
                log(format_row(row, bits))
                log("ROW " + json.dumps(row))  # a run cut short still leaves its rows in the log
    return {"env": env_info(), "rows": rows}


def format_row(r: dict, bits=(2, 4)) -> str:
    base = r.get("baseline", "sdpa flash")
    ms = r.get("baseline_ms", r.get("sdpa_ms"))
    tbs = r.get("baseline_tbs", r.get("sdpa_tbs"))
    s = f"{r['geometry']:<22} B{r['B']:<3} L{r['L']:<6} base {ms:.3f} ms ({tbs:.2f} TB/s; {base[:48]})"
    for b in bits:
        tag = f"k{b}v{b}"
        if f"{tag}_ms" in r:
            s += f" | {tag} {r[f'{tag}_ms']:.3f} ms x{r[f'{tag}_ratio']:.2f} {r[f'{tag}_tbs']:.2f} TB/s"
    return s


def main(argv=None) -> int:
    """python -m lowbit.tools.bench.geometry --sweep OUT.json [--geometry a,b] [--batch 1,16] [--length 32768]"""
    import argparse

    ap = argparse.ArgumentParser(prog="python -m lowbit.tools.bench.geometry")
    ap.add_argument("--sweep", required=True, help="JSON file to write the sweep to")
    ap.add_argument("--geometry", default=",".join(GEOMETRIES))
    ap.add_argument("--batch", default="1,16")
    ap.add_argument("--length", default="32768")
    ap.add_argument("--bits", default="2")
    ap.add_argument("--cfg", action="append", default=[],
                    help="GeoConfig fields to time instead of sweep_candidates, e.g. block_t=64,heads=8,q_loop=0 "
                         "(repeatable)")
    a = ap.parse_args(argv)
    ints = lambda x: tuple(int(v) for v in x.split(","))
    res = sweep(ints(a.batch), ints(a.length), tuple(a.geometry.split(",")), ints(a.bits),
                configs=[parse_config(c) for c in a.cfg] or None)
    with open(a.sweep, "w") as f:
        json.dump(res, f, indent=1)
    print(f"wrote {a.sweep}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
