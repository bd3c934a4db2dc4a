"""H200 probe of lowbit.kernels.decode_latent (one dequantization per tile for both products) against the
geometry kernel's packed latent and its bf16 dense-latent path, same inputs, same timer (a CUDA graph of
calls cycling through input sets larger than the L2). Checks the new kernel against the torch twin first.

    PYTHONPATH=src python benchmarks/latent_proto_bench.py --out latent_proto.json
"""

from __future__ import annotations

import argparse
import json
import math

import torch

from lowbit.kernels.bench import env_info, graph_time_ms, n_buffers
from lowbit.kernels.decode_attention import _stage2
from lowbit.kernels.decode_geometry import GeoConfig, decode_attention_latent
from lowbit.kernels.decode_latent import latent_middle
from lowbit.kernels.geo_bench import _rand_packed
from lowbit.kernels.reference import decode_attention_latent_ref


def new_fn(q, qp, t, lens, sm, cfg, out):
    B, Hq, D = q.shape
    ns = cfg["num_splits"]
    part = torch.empty(B, Hq, ns, D, device=q.device)
    lse = torch.empty(B, Hq, ns, device=q.device)
    ch = min(32, max(16, 1 << (ns - 1).bit_length()))

    def f():
        n, _ = latent_middle(q, qp, t["c"].view(torch.int32), t["s"], t["z"], t["pe"], lens, bits=2, sm_scale=sm,
                             heads=cfg["heads"], block_t=cfg["block_t"], num_warps=cfg["num_warps"],
                             num_splits=ns, part=part, lse=lse, out_split0=0, num_stages=cfg.get("num_stages", 2),
                             reload=bool(cfg.get("reload", 1)), pv_acc=bool(cfg.get("pv_acc", 0)))
        _stage2[(B, Hq)](part, lse, out, out.stride(0), out.stride(1), ns, NCH=-(-ns // ch), CH=ch, DV=D,
                         num_warps=4)
        return out
    return f


def splits_for(B, Hq, heads, T, bt, sms=132, waves=2):
    programs = B * -(-Hq // heads)
    return int(max(1, min(math.ceil(waves * sms / programs), math.ceil(T / (2 * bt)))))


def main(argv=None):
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--cfg", action="append", default=[], help="heads=16,block_t=64,num_warps=4[,reload=1,waves=2]")
    ap.add_argument("--hq", default="16,128")
    ap.add_argument("--batch", default="16,1")
    a = ap.parse_args(argv)
    dev = "cuda"
    rows, D, DR, L = [], 512, 64, 32768
    cfgs = [{k: int(v) for k, v in (x.split("=") for x in c.split(","))} for c in a.cfg]
    g = torch.Generator(device=dev).manual_seed(0)
    # correctness: odd sizes against the twin
    for (B, Hq, T) in ((3, 16, 999), (1, 128, 77), (2, 20, 4099)):
        q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
        qp = torch.randn(B, Hq, DR, device=dev, dtype=torch.bfloat16, generator=g)
        c, s, z = _rand_packed(B, 1, T, D, 2, 128, g, dev)
        pe = torch.randn(B, 1, T, DR, device=dev, dtype=torch.bfloat16, generator=g)
        lens = torch.tensor([T - 5 * i for i in range(B)], dtype=torch.int32, device=dev)
        ref = decode_attention_latent_ref(q, qp, c, s, z, pe, lens, bits=2, sm_scale=1 / math.sqrt(D + DR))
        for cfg in cfgs:
            cfg = dict(cfg, num_splits=splits_for(B, Hq, cfg["heads"], T, cfg["block_t"]))
            out = torch.empty(B, Hq, D, device=dev, dtype=torch.bfloat16)
            t = {"c": c, "s": s, "z": z, "pe": pe}
            o = new_fn(q, qp, t, lens, 1 / math.sqrt(D + DR), cfg, out)().float()
            err = ((o - ref).norm() / ref.norm()).item()
            print(f"CHECK B{B} Hq{Hq} T{T} {cfg}: rel L2 {err:.2e}", flush=True)
            rows.append({"check": True, "B": B, "Hq": Hq, "T": T, "cfg": cfg, "rel_l2": err})
    for Hq in (int(x) for x in a.hq.split(",")):
        for B in (int(x) for x in a.batch.split(",")):
            q = torch.randn(B, Hq, D, device=dev, dtype=torch.bfloat16, generator=g)
            qp = torch.randn(B, Hq, DR, device=dev, dtype=torch.bfloat16, generator=g)
            out = torch.empty(B, Hq, D, device=dev, dtype=torch.bfloat16)
            pb = B * L * (D * 2 // 8 + 4 * D // 128 + 2 * DR)
            nb = n_buffers(pb, 40e9)
            sets = []
            for _ in range(nb):
                c, s, z = _rand_packed(B, 1, L, D, 2, 128, g, dev)
                sets.append({"c": c, "s": s, "z": z, "pe": torch.randn(B, 1, L, DR, device=dev, dtype=torch.bfloat16,
                                                                        generator=g)})
            lens = torch.full((B,), L, dtype=torch.int32, device=dev)
            sm = 1 / math.sqrt(D + DR)
            row = {"B": B, "Hq": Hq, "L": L, "bytes": pb}
            old = [lambda t=t: decode_attention_latent(q, qp, t["c"], t["s"], t["z"], t["pe"], bits=2, out=out)
                   for t in sets]
            row["geo_int2_ms"] = graph_time_ms(old)
            for cfg in cfgs:
                cfg = dict(cfg, num_splits=splits_for(B, Hq, cfg["heads"], L, cfg["block_t"], waves=cfg.get("waves", 2)))
                try:
                    ms = graph_time_ms([new_fn(q, qp, t, lens, sm, cfg, out) for t in sets])
                except Exception as e:  # noqa: BLE001
                    print(f"  {cfg} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
                    continue
                row[f"new {cfg}"] = ms
                print(f"B{B} Hq{Hq}: new {cfg} {ms:.4f} ms ({pb / ms / 1e9:.2f} TB/s)", flush=True)
            del sets
            torch.cuda.empty_cache()
            # bf16 dense latent through the geometry kernel and the torch matmul form (the bench's baseline)
            nbd = n_buffers(B * L * 2 * (D + DR), 40e9)
            dsets = [torch.randn(B, 1, L, D + DR, device=dev, dtype=torch.bfloat16, generator=g) for _ in range(nbd)]
            qf = torch.cat([q, qp], -1)
            def torch_form(x):
                s_ = torch.matmul(qf, x[:, 0].transpose(1, 2)) * sm
                return torch.matmul(torch.softmax(s_.float(), -1).to(x.dtype), x[:, 0, :, :D])
            row["torch_bf16_ms"] = graph_time_ms([lambda x=x: torch_form(x) for x in dsets])
            row["torch_bf16_tbs"] = B * L * 2 * (D + DR) / row["torch_bf16_ms"] / 1e9
            print(f"ROW {json.dumps(row)}", flush=True)
            rows.append(row)
            del dsets
            torch.cuda.empty_cache()
    with open(a.out, "w") as f:
        json.dump({"env": env_info(), "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
