"""Audit cases for the vLLM plugin's two C++ CPU kernels (`lowbit audit kernels --kernel vllm_cpu`):

- `paged_decode` (csrc/paged_decode.cpp, the fused decode attention) against its torch twin
  (paged.attend kernel="torch"): odd head dims, GQA 1/3/5/9, 2/4/8 bits and k4v2, two groups per head,
  sink/recent tiers, a sliding window, softcap, fp32/bf16/fp16 pools, rotations inside the kernel, and a
  layout only the scalar loop takes. Row: relative L2 / max relative error, pass at rel L2 <= TOL.
- `encode_cells` (csrc/cell_encode.cpp, the decode step's rows -> packed cells; min/max and std grids) against
  TensorCodec.encode (SlotFormat.encode_rotated(fast=False)): it must give the codec's bytes bit for bit.
  Row: rel_l2 = the share of differing bytes, max_rel = the largest byte difference / 255; pass only when
  both are 0 and the encoder served the write itself.

Small shapes (the whole audit takes seconds once the extensions are built; the first build takes minutes).
"""

from __future__ import annotations

import time

import torch


def _decode_case(name, D, group, Hkv, G, bs, lens, sink, recent, window, rotation, softcap, dtype, seed):
    """(paged.attend kwargs, format, cache, q): histories written through paged.write in two chunks each."""
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.rotation.hadamard import hadamard
    from lowbit.vllm_plugin import paged
    from lowbit.vllm_plugin.slot import SlotFormat

    g = torch.Generator().manual_seed(seed)
    sch = parse_kv_scheme(name, sink=sink, recent=recent, page=1, group=group, rotation="none")
    fmt = SlotFormat(sch, D, D, dtype)
    rk = rv = hadamard(D) if rotation else None
    nbt = max(-(-n // bs) for n in lens) + 1
    nblocks = len(lens) * nbt + 2
    cache = torch.zeros(nblocks, Hkv, bs, fmt.slot_bytes, dtype=torch.uint8)
    table = torch.randperm(nblocks, generator=g)[: len(lens) * nbt].reshape(len(lens), nbt)
    arena = paged.TierArena(sink, recent, bs, dtype, window=window) if sink or recent else None
    last_k, last_v = [], []
    for r, n in enumerate(lens):
        k = (torch.randn(n, Hkv, D, generator=g) + 2.0 * torch.randn(1, Hkv, D, generator=g)).to(dtype)
        v = torch.randn(n, Hkv, D, generator=g).to(dtype)
        for a, b in ((0, (n - 1) // 2), ((n - 1) // 2, n - 1)):
            if b > a:
                pos = torch.arange(a, b)
                paged.write(cache, fmt, k[a:b], v[a:b], table[r][pos // bs] * bs + pos % bs, rk, rv, positions=pos,
                            row_seq_lens=torch.full((b - a,), b), arena=arena)
        last_k.append(k[-1])
        last_v.append(v[-1])
    q = torch.randn(len(lens), Hkv * G, D, generator=g).to(dtype)
    kw = dict(block_table=table, seq_lens=torch.tensor(lens), query_start_loc=torch.arange(len(lens) + 1),
              scale=D ** -0.5, rot_k=rk, rot_v=rv, window=window, softcap=softcap, arena=arena,
              new_k=torch.stack(last_k), new_v=torch.stack(last_v), evict=False)
    return kw, fmt, cache, q


# name, D, group, Hkv, G, block, lens, sink, recent, window, rotation, softcap, pool dtype
DECODE_CASES = [
    ("int4", 64, 64, 3, 3, 16, [1, 37, 99, 200], 3, 21, None, True, None, torch.bfloat16),  # smollm2 geometry
    ("int2", 64, 32, 2, 5, 8, [5, 70, 129], 7, 9, None, False, 20.0, torch.float16),  # two groups, softcap
    ("int8", 128, 64, 1, 9, 16, [3, 77], 0, 0, None, True, None, torch.float32),  # GQA 9, no tiers
    ("k4v2", 128, 64, 2, 1, 16, [17, 90, 133], 16, 32, None, True, None, torch.bfloat16),  # MHA
    ("int2", 256, 128, 1, 4, 16, [40, 230], 5, 30, 48, False, None, torch.bfloat16),  # window (gemma3-like)
    ("int4", 40, 40, 2, 3, 8, [29, 61], 4, 6, None, False, None, torch.bfloat16),  # 20-dim lanes: scalar loop
]

# name, D, group, H, scheme flags, T rows
ENCODE_CASES = [
    ("int4", 64, 64, 3, {}, 1),
    ("int4", 96, 32, 5, {"clip": ".96,.92"}, 3),
    ("int8", 128, 64, 1, {}, 16),
    ("int3", 64, 16, 2, {}, 7),
    ("k4v2", 256, 128, 3, {"grid": "minmax", "clip": ".9"}, 2),
    ("int2", 64, 64, 2, {"grid": "minmax", "symmetric": True, "clip": ".94"}, 5),
    ("int2", 64, 64, 3, {}, 4),  # the int2 default: std grid
    ("k4v2", 128, 64, 2, {}, 3),  # K min/max, V std
]


def audit_plugin() -> list:
    """AuditRows for paged_decode and encode_cells (one row saying why, failed, if an extension did not build)."""
    from lowbit.kernels.twin import TOL, AuditRow
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.vllm_plugin import cpu_kernel, paged
    from lowbit.vllm_plugin.slot import SlotFormat

    rows = []
    t = time.time()
    mod, why = cpu_kernel.load()
    if mod is None:
        rows.append(AuditRow("vllm paged_decode", f"not built: {why}", float("inf"), float("inf"), False, False,
                             time.time() - t))
    else:
        vec = getattr(mod, "vector_layout", None)
        for i, (name, D, group, Hkv, G, bs, lens, sink, recent, window, rot, softcap, dtype) in enumerate(DECODE_CASES):
            t = time.time()
            kw, fmt, cache, q = _decode_case(name, D, group, Hkv, G, bs, lens, sink, recent, window, rot, softcap,
                                             dtype, seed=i)
            ref = paged.attend(q, cache, fmt, kernel="torch", **kw)
            out = paged.attend(q, cache, fmt, kernel="cpu-fused", memo={}, **kw)
            path = "vector" if vec is not None and vec(paged.kernel_meta(fmt)) else "scalar"
            case = (f"{name} D{D} g{group} Hkv{Hkv} G{G} lens{'/'.join(map(str, lens))} sink{sink} recent{recent}"
                    + (f" window{window}" if window else "") + (f" softcap{softcap:g}" if softcap else "")
                    + (" rot" if rot else "") + f" {str(dtype).split('.')[-1]} ({path})")
            finite = bool(torch.isfinite(out).all())
            d = out.double() - ref.double()
            rel = float(d.norm() / ref.double().norm().clamp_min(1e-30)) if finite else float("inf")
            mrel = float(d.abs().max() / ref.double().abs().max().clamp_min(1e-30)) if finite else float("inf")
            rows.append(AuditRow("vllm paged_decode", case, rel, mrel, finite, finite and rel <= TOL, time.time() - t))
    t = time.time()
    enc, why = cpu_kernel.load_encoder()
    if enc is None:
        rows.append(AuditRow("vllm encode_cells", f"not built: {why}", float("inf"), float("inf"), False, False,
                             time.time() - t))
        return rows
    for i, (name, D, group, H, flags, T) in enumerate(ENCODE_CASES):
        t = time.time()
        g = torch.Generator().manual_seed(100 + i)
        fmt = SlotFormat(parse_kv_scheme(name, sink=0, recent=0, page=1, group=group, rotation="none", **flags), D, D,
                         torch.bfloat16)
        kr = torch.randn(1, H, T, D, generator=g) * torch.exp(torch.randn(1, H, T, 1, generator=g) * 1.5)
        kr[..., 3] += 40.0  # an outlier per row
        vr = (torch.randn(1, H, T, D, generator=g) * 0.01).bfloat16()
        f = fmt._encoder()
        served = False
        if f is not None and f[3]:  # a std-grid tensor: torch's group stats go in
            cells, served = f[0].encode_cells_std(kr, vr, *fmt._std_stats(kr, vr, f[3]), f[1], f[2], fmt.slot_bytes)
        elif f is not None:
            cells, served = f[0].encode_cells(kr, vr, f[1], f[2], fmt.slot_bytes)
        want = fmt.encode_rotated(kr, vr, fast=False)
        if served:
            diff = (cells.int() - want.int()).abs()
            rel, mrel = float((diff > 0).double().mean()), float(diff.max()) / 255.0
        else:
            rel = mrel = float("inf")
        case = f"{name} D{D} g{group} H{H} T{T}" + "".join(f" {k}={v}" for k, v in flags.items())
        rows.append(AuditRow("vllm encode_cells", case + ("" if served else " (declined)"), rel, mrel, served,
                             served and rel == 0.0, time.time() - t))
    return rows
