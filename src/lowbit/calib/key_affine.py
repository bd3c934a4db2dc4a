"""Fit the key equalisation map (lowbit.kv.key_affine: what it is, how it is applied and stored) on calibration text.

    maps = fit(model, windows)                                   # {layer: KeyAffine} from post-RoPE statistics
    maps, evidence = select(model, windows, maps, geometry)      # keep a layer's map only where int2's error drops
    rots = fit_base(model, windows, maps, geometry)              # base "fitted": per-layer rotations of mapped keys
    python -m lowbit.calib.key_affine --model M --out DIR        # fit, select, write the artifact, print the recipe line

Fitting runs the model on calibration windows (never the evaluation text): it lives with calibration,
above the KV format it writes (lowbit.kv.key_affine.save).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowbit.artifacts import load_manifest
from lowbit.calib.capture import capture_attention
from lowbit.calib.corpora import load_text, token_windows
from lowbit.core.errors import LowbitError
from lowbit.eval.layer_error import Variant, measure_layers
from lowbit.kv.key_affine import BASES, FILE_NAME, KeyAffine, map_keys, pair_mean, save
from lowbit.kv.plan import load_rotations
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.rotation.fit import check_orthogonal, rotation_from_cov
from lowbit.runtime.load import resolve


class KeyStats:
    """Running per-layer sums of post-RoPE K (and K^2) and Q^2 over tokens >= skip of each window."""

    def __init__(self, skip: int = 64):
        self.skip = int(skip)
        self.sk: dict[int, torch.Tensor] = {}
        self.sk2: dict[int, torch.Tensor] = {}
        self.sq2: dict[int, torch.Tensor] = {}
        self.n: dict[int, int] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None):
        i = int(module.layer_idx)
        B, Hkv, T, D = key.shape
        if T <= self.skip:
            return
        k = key[:, :, self.skip :].double()  # [B, Hkv, T', D]
        G = query.shape[1] // Hkv
        q = query[:, :, self.skip :].double().reshape(B, Hkv, G, T - self.skip, -1)
        if q.shape[-1] != D:
            raise LowbitError(f"layer {i}: query width {q.shape[-1]} differs from key width {D}")
        add = {"sk": k.sum((0, 2)), "sk2": k.pow(2).sum((0, 2)), "sq2": q.pow(2).sum((0, 2, 3)) / G}
        for name, t in add.items():
            d = getattr(self, name)
            d[i] = d[i] + t if i in d else t
        self.n[i] = self.n.get(i, 0) + B * (T - self.skip)
        return

    def affine(self, alpha: float = 0.5, center: bool = True) -> dict[int, KeyAffine]:
        """{layer: KeyAffine} from the sums (see the module docstring)."""
        out = {}
        for i, n in sorted(self.n.items()):
            mu = self.sk[i] / n
            var = (self.sk2[i] / n - (mu.pow(2) if center else 0)).clamp_min(0)
            sk = pair_mean(var).sqrt()
            sq = pair_mean(self.sq2[i] / n).sqrt()
            floor = 1e-6 * float(sk.max().clamp_min(1e-30))  # a dead pair keeps a finite scale
            s = sk.clamp_min(floor).pow(1 - alpha) / sq.clamp_min(1e-12).pow(alpha)
            s = s / s.log().mean(-1, keepdim=True).exp()  # geometric mean 1 per KV head
            out[i] = KeyAffine(s.float(), (mu if center else torch.zeros_like(mu)).float())
        return out


@torch.no_grad()
def fit(model, windows: torch.Tensor, *, alpha: float = 0.5, skip: int = 64, center: bool = True,
        shift_only: bool = False) -> dict[int, KeyAffine]:
    """Fit every layer's key map on calibration windows [N, L] (never the test text).

    shift_only: scale 1 (the map is k - shift): removes the keys' per-channel offset and nothing else, what a
    scale-only grid (TensorQuant zero "none", centred on 0) needs, without the pair scaling (on smollm2-135m
    the scaled map raised int2's error in 9 of 30 layers)."""
    if not 0.0 <= alpha <= 1.0:
        raise LowbitError(f"alpha {alpha} is outside [0, 1] (0: equalise keys only; 0.5: balance with queries)")
    if windows.dim() != 2 or windows.shape[1] <= skip:
        raise LowbitError(f"calibration windows must be [N, L] with L > skip ({skip}), got {tuple(windows.shape)}")
    st = KeyStats(skip)
    with capture_attention(model, st):
        for w in windows:
            model(w[None], use_cache=False, logits_to_keep=1)
    if not st.n:
        raise LowbitError("no attention layer reported keys during the key-affine fit")
    if shift_only and not center:
        raise LowbitError("a shift-only key map with no shift (center off) is the identity; drop one of them")
    maps = st.affine(alpha, center)
    if shift_only:
        maps = {i: KeyAffine(torch.ones_like(m.scale), m.shift) for i, m in maps.items()}
    return maps


@torch.no_grad()
def select(model, windows: torch.Tensor, maps: dict[int, KeyAffine], geometry, *, scheme="int2",
           base: str = "hadamard") -> tuple[dict[int, KeyAffine], dict]:
    """Keep a layer's map only where it lowers that layer's attention-output error (the layer-error
    harness, `scheme` through the cache's codec) on the same calibration windows; the others keep the
    plain rotation. Returns (kept maps, {layer: (dB plain, dB mapped)})."""
    sch = parse_kv_scheme(scheme) if isinstance(scheme, str) else scheme
    rots = load_rotations(base, geometry).per_layer
    rot = {g.index: rots[g.index] for g in geometry.layers}
    db = measure_layers(model, windows, [Variant("plain", sch, rot), Variant("mapped", sch, rot, key_affine=maps)])
    evidence = {i: (db["plain"].get(i), db["mapped"].get(i)) for i in sorted(maps)}
    kept = {i: m for i, m in maps.items() if evidence[i][1] is not None and evidence[i][0] is not None
            and evidence[i][1] < evidence[i][0]}
    return kept, evidence


class MappedMoments:
    """Per-layer second moments, summed over KV heads, of the mapped post-RoPE keys and of the values over
    tokens >= skip of each window: what a "fitted" base rotation is the eigenvectors of."""

    def __init__(self, maps: dict[int, KeyAffine], skip: int = 64):
        self.maps, self.skip = maps, int(skip)
        self.kk: dict[int, torch.Tensor] = {}
        self.vv: dict[int, torch.Tensor] = {}
        self.n: dict[int, int] = {}

    def __call__(self, module, query, key, value, attention_mask, scaling, softcap=None):
        i = int(module.layer_idx)
        if key.shape[2] <= self.skip:
            return
        k = map_keys(key[:, :, self.skip :], self.maps.get(i)).double()  # [B, Hkv, T', D_k]
        v = value[:, :, self.skip :].double()  # [B, Hkv, T', D_v]
        kk, vv = torch.einsum("bhtd,bhte->de", k, k), torch.einsum("bhtd,bhte->de", v, v)
        self.kk[i] = self.kk[i] + kk if i in self.kk else kk
        self.vv[i] = self.vv[i] + vv if i in self.vv else vv
        self.n[i] = self.n.get(i, 0) + k.shape[0] * k.shape[1] * k.shape[2]
        return

    def rotations(self) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
        """{layer: (R_k [D_k, D_k], R_v [D_v, D_v])} float32, orthogonal (checked)."""
        out = {}
        for i, n in sorted(self.n.items()):
            rk = rotation_from_cov(self.kk[i] / n).float().contiguous()
            rv = rotation_from_cov(self.vv[i] / n).float().contiguous()
            check_orthogonal(rk, f"layer {i} K")
            check_orthogonal(rv, f"layer {i} V")
            out[i] = (rk, rv)
        return out


@torch.no_grad()
def fit_base(model, windows: torch.Tensor, maps: dict[int, KeyAffine], geometry, *, skip: int = 64
             ) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    """The "fitted" base rotation of every layer on calibration windows [N, L], keys mapped by `maps` first."""
    for g in geometry.layers:
        if getattr(g, "storage", "mha") != "mha" or getattr(g, "shares_kv", False):
            raise LowbitError(f"layer {g.index} stores K and V once (MLA latent / K = V): a fitted key-affine base "
                              "covers plain K/V layers only; use --base hadamard, or lowbit fit-rotations")
    st = MappedMoments(maps, skip)
    with capture_attention(model, st):
        for w in windows:
            model(w[None], use_cache=False, logits_to_keep=1)
    missing = sorted({g.index for g in geometry.layers} - set(st.n))
    if missing:
        raise LowbitError(f"layers {missing} reported no keys longer than skip={skip} during the base fit; "
                          "use longer calibration windows")
    return st.rotations()


def main(argv=None) -> int:
    """python -m lowbit.calib.key_affine --model M --out DIR [--calib stdlib] [--windows 2] [--seq-len 1024]:
    fit on calibration text (never the evaluation text), write the artifact, print the recipe line."""
    import argparse
    import time

    ap = argparse.ArgumentParser(prog="python -m lowbit.calib.key_affine", description=main.__doc__)
    ap.add_argument("--model", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--calib", default="stdlib")
    ap.add_argument("--windows", type=int, default=2)
    ap.add_argument("--seq-len", type=int, default=1024)
    ap.add_argument("--alpha", type=float, default=0.5)
    ap.add_argument("--skip", type=int, default=64)
    ap.add_argument("--no-center", action="store_true")
    ap.add_argument("--base", default="hadamard", choices=BASES, help="rotation after the map: hadamard (default), "
                    "none, or fitted (eigenvectors of the mapped keys' / the values' second moments x Hadamard)")
    ap.add_argument("--threads", type=int, default=None)
    ap.add_argument("--no-select", action="store_true", help="keep every layer's map (default: only where the "
                    "calibration layer error of int2 drops)")
    ap.add_argument("--shift-only", action="store_true", help="scale 1: the map only subtracts the keys' "
                    "calibration mean per channel (for scale-only grids, --zero none)")
    ap.add_argument("--zero", default="group", choices=("group", "none"), help="int2's zero storage when --select "
                    "measures the layer error (none: scale-only groups)")
    a = ap.parse_args(argv)
    if Path(a.out).exists():
        raise LowbitError(f"--out {a.out} exists; give a new directory")
    if a.threads:
        torch.set_num_threads(a.threads)
    t0 = time.perf_counter()
    lm = resolve(a.model, dtype=torch.float32)
    windows = token_windows(lm.tokenizer, load_text(a.calib), a.seq_len, a.windows)
    maps = fit(lm.model, windows, alpha=a.alpha, skip=a.skip, center=not a.no_center, shift_only=a.shift_only)
    evidence = {}
    if not a.no_select:  # measured on Hadamard when the base is fitted (its rotations depend on the kept maps)
        maps, evidence = select(lm.model, windows, maps, lm.geometry, scheme=parse_kv_scheme("int2", zero=a.zero),
                                base="hadamard" if a.base == "fitted" else a.base)
        print("layer error of int2 on the calibration windows, dB plain -> mapped (kept where lower):")
        print("  " + ", ".join(f"{i}: {p:.1f}->{m:.1f}{'*' if i in maps else ''}" for i, (p, m) in evidence.items()))
        if not maps:
            raise LowbitError(f"the key affine lowers no layer's calibration error on {lm.name}: nothing to write")
    rots = fit_base(lm.model, windows, maps, lm.geometry, skip=a.skip) if a.base == "fitted" else None
    inputs = {"weights_sha256": lm.weights_sha256, "calib": str(a.calib), "windows": a.windows, "seq_len": a.seq_len,
              "alpha": a.alpha, "skip": a.skip, "center": not a.no_center, "selected": not a.no_select,
              "shift_only": a.shift_only, "select_zero": a.zero,
              "layer_db_plain_mapped": {str(i): [round(p, 2), round(m, 2)] for i, (p, m) in evidence.items()}}
    save(a.out, maps, model=lm.name, base=a.base, inputs=inputs, rotations=rots)
    sha = load_manifest(a.out).file_map()[FILE_NAME].sha256
    print(f"fitted {len(maps)} layers of {lm.name} on {a.windows} x {a.seq_len} {a.calib} tokens in "
          f"{time.perf_counter() - t0:.0f} s -> {a.out}")
    print(f'rotation = {{ path = "{a.out}", sha256 = "{sha}" }}')
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
