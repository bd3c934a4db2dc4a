"""`lowbit tune`: per layer and per tensor (K, V) KV bits within a held-bits budget, chosen by measured loss.

    res = tune(lm, budget=2.5, context=32768, calib=windows)     # windows [N, T] of calibration text
    write_recipe(res, "smollm2-135m@2.5.toml")                   # `lowbit eval --recipe FILE` runs it

1. Sensitivity (lowbit.eval.layer_error.measure_layers, the layer-error harness, cache's own codec):
   for each candidate rotation r (scheme-wide: "hadamard", "none", or a RotationSet dir) and each
   tensor t in {K, V}, the per-layer attention-output error when only t is quantized, at 2 bits (each
   candidate 2-bit grid: the std grid, Gaussian Lloyd-Max, the scale-only std grid) and at 4 and 8 bits
   (min/max grid, what a layer_bits override gets; for the scale-only base, the scale-only grids its
   overrides get: std at 4 bits, symmetric at 8). Errors are energies relative to the exact output, e = 10^(dB/10); the
   loss model of an assignment is sum over layers of e_K(layer, bits) + e_V(layer, bits) (K and V
   errors add, to first order, since each perturbs the output independently).
2. Cost: held bits (lowbit.kv.held at `context`): each layer's middle elements at the context weigh
   what they hold, so a full-attention layer of gemma3 at 32k costs ~30x a sliding one.
3. Allocation, per (rotation, 2-bit grid) base: every tensor starts at 2 bits (the smallest recipe: a
   budget below its held bits is refused); the bits per tensor that minimise the loss model within the
   budget, exactly (a multiple-choice knapsack over held bits in steps of 1e-4 b/elt: `allocate`).
4. Check: every base's allocation (and the all-2-bit base) is run through the full-window fake-quant
   perplexity on the calibration windows (lowbit.eval.layer_error.fake_quant_ppl: errors compound as
   in serving) and the lowest PPL wins -- this is where a rotation or grid "pays" or not.
Calibration is never the evaluation text: the default is the stdlib corpus (pydoc topics).
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field, replace

from lowbit import __version__
from lowbit.core.errors import LowbitError
from lowbit.kv.held import codec_bits_per_token, held_bits
from lowbit.kv.scheme import LevelsRef, _with_bits, parse_kv_scheme

BITS = (2, 4, 8)
# 2-bit grid candidates. "scale-only": the std grid with no zero stored (lowbit.kv.scheme.TensorQuant zero
# "none"): int2 at group 64 costs 2.25 b/elt instead of 2.5, so the budget left buys more 4-bit tensors.
# "scale-only-mse": the same storage, each group's step searched for the least squared error at write time
# (TensorQuant grid "mse"; read exactly as scale-only, so the fused kernel serves it).
# "scale-only-mse-ue5m3": scale-only-mse with one-byte scales (TensorQuant scale_format "ue5m3"): int2 at
# group 64 holds 2.125 b/elt, and the fused kernel decodes the byte.
# "vq": VQ rows (lowbit.quant.vq): keys 2x16, values 4x256, one ue5m3 scale per row, with codebooks fitted
# beforehand by `lowbit calibrate --vq-for` on an all-VQ recipe (tune --codebooks DIR); a tensor tune puts at 4 or 8
# bits is a scale-only mse grid with ue5m3 scales. The codebooks' held bits are in the budget.
GRIDS = ("std", "lloyd-max", "scale-only", "scale-only-mse", "scale-only-mse-ue5m3", "vq")
DEFAULT_GRIDS = ("std", "lloyd-max")
DEFAULT_ROTATIONS = ("hadamard",)


def base_scheme(rotation, grid: str, *, sink=None, recent=None, page=None, codebooks=None):
    """The all-2-bit scheme of a base (rotation, 2-bit grid). codebooks: the LevelsRef of the VQ codebooks
    (grid "vq" only)."""
    if grid not in GRIDS:
        raise LowbitError(f"2-bit grid {grid!r} unknown; use {', '.join(GRIDS)}")
    if grid == "vq":
        if codebooks is None:
            raise LowbitError("the vq grid needs fitted codebooks: `lowbit calibrate --vq-for` an all-VQ recipe, "
                              "then pass --codebooks DIR")
        return parse_kv_scheme("int2", sink=sink, recent=recent, page=page, rotation=rotation, zero="none",
                               grid="mse", scale_format="ue5m3", vq="2x16,4x256", levels=codebooks)
    return parse_kv_scheme("int2", sink=sink, recent=recent, page=page, rotation=rotation,
                           lloyd_max=grid == "lloyd-max", zero="none" if grid.startswith("scale-only") else None,
                           grid="mse" if grid.startswith("scale-only-mse") else None,
                           scale_format="ue5m3" if grid.endswith("-ue5m3") else None)


def family(grid: str, bits: int) -> str:
    """The grid a tensor of a base with 2-bit grid `grid` uses at `bits` (the key of its measured errors):
    the 2-bit grid itself, "minmax" for the overrides of a base with stored zeros, "scale-only" at every
    width for the scale-only base (and the VQ base, whose wider tensors are scale-only)."""
    if grid.startswith("scale-only") or grid == "vq":
        return grid
    return grid if bits == 2 else "minmax"


def with_layer_bits(base, assign: dict):
    """base with layer_bits for every layer whose (K, V) bits differ from (2, 2)."""
    lb = {i: f"k{kb}v{vb}" for i, (kb, vb) in sorted(assign.items()) if (kb, vb) != (2, 2)}
    return replace(base, layer_bits=tuple(lb.items()))


def _rot_label(r) -> str:
    return r if isinstance(r, str) else str(getattr(r, "path", r))


@dataclass
class Candidate:
    rotation: str
    grid: str
    assign: dict  # layer -> (K bits, V bits)
    predicted: float  # loss model (sum of relative error energies)
    held: float  # held bits at the context
    scheme: object = None
    ppl: float | None = None
    base_ppl: float | None = None  # the all-2-bit base of the same rotation and grid
    rotation_sha256: str | None = None  # a fitted rotation / key affine: the sha256 the recipe pins


@dataclass
class TuneResult:
    model: str
    weights_sha256: object
    budget: float
    context: int
    calib: dict
    best: Candidate
    candidates: list = field(default_factory=list)
    ref_ppl: float | None = None
    db: dict = field(default_factory=dict)  # variant name -> layer -> dB
    held: object = None  # lowbit.kv.held.HeldBits of the best scheme
    seconds: float = 0.0


def smallest_held(geometry, context: int, rotations, grids, codebooks=None, **tiers) -> float:
    """Held bits of the cheapest recipe tune can write (every tensor at 2 bits) at `context` (VQ codebooks in)."""
    out = []
    for r in rotations:
        for g in grids:
            b = held_bits(base_scheme("none", g, codebooks=codebooks, **tiers), context, geometry=geometry).bits
            if b is not None:
                out.append(b)
    if not out:
        raise LowbitError(f"at context {context} every token sits in the sink + recent tiers: nothing is "
                          "quantized, so no budget applies; use a longer --context or lower --sink / --recent")
    return min(out)


def _cost_table(base, geometry, context: int):
    """(layer -> (K elements, V elements), bits -> per-element cost (K, V) per layer) at the context."""
    from lowbit.kv.plan import resolve

    h = held_bits(base, context, geometry=geometry)
    elems = {lh.index: (lh.elements_k, lh.elements_v) for lh in h.layers}
    cost: dict = {}
    for b in BITS:
        plan = resolve(with_layer_bits(base, {g.index: (b, b) for g in geometry.layers}), geometry)
        for lp in plan.layers:
            g = lp.geometry
            cost[(lp.index, b)] = (codec_bits_per_token(lp.k) / g.head_dim_k, codec_bits_per_token(lp.v) / g.head_dim_v)
    return elems, cost


def allocate(err: dict, elems: dict, cost: dict, budget: float, layers: list[int], *,
             resolution: float = 1e-4) -> tuple[dict, float, float]:
    """Multiple-choice knapsack over the tensors, solved exactly. err[(layer, t, bits)]: loss of tensor t (0=K,
    1=V) of a layer at bits; elems[layer] = (K, V) middle elements; cost[(layer, bits)] = (K, V) bits per element.
    Minimises the summed loss with held bits <= budget. Every tensor starts at 2 bits; a choice's extra held bits
    are rounded up to `resolution` b/elt, so the result never exceeds the budget (it may leave < 1 resolution
    step per tensor unspent). A greedy loss-per-bit pick is not enough: one cheap tensor with the best ratio can
    block a larger one that gains more (gemma3's full-attention K at budget 3).
    Returns (assign {layer: (kb, vb)}, predicted loss, held bits (codebooks aside))."""
    total_el = sum(sum(e) for e in elems.values())
    if total_el == 0:
        raise LowbitError("no layer holds a quantized token at this context; nothing to allocate")
    bits = {(i, t): 2 for i in layers for t in (0, 1)}

    def held() -> float:
        return sum(elems[i][t] * cost[(i, bits[(i, t)])][t] for (i, t) in bits) / total_el

    def steps(i: int, t: int, nb: int) -> int:  # extra held bits of (layer i, tensor t) at nb, in resolution steps
        return math.ceil(elems[i][t] * (cost[(i, nb)][t] - cost[(i, 2)][t]) / total_el / resolution - 1e-9)

    import torch

    cap = math.floor((budget - held()) / resolution + 1e-9)
    items = [(i, t) for (i, t) in bits if elems[i][t]]
    if cap > 0 and items:
        best = torch.zeros(cap + 1, dtype=torch.float64)  # best[c]: largest loss drop within c steps
        picks = []  # per item: the bits chosen at each capacity (2: unchanged)
        for i, t in items:
            new, pick = best.clone(), torch.full((cap + 1,), 2, dtype=torch.int8)
            for nb in BITS:
                if nb <= 2:
                    continue
                w = steps(i, t, nb)
                gain = err[(i, t, 2)] - err[(i, t, nb)]
                if w > cap or gain <= 0:
                    continue
                cand = torch.full_like(best, -math.inf)
                cand[w:] = best[: cap + 1 - w] + gain
                better = cand > new
                new = torch.where(better, cand, new)
                pick = torch.where(better, torch.tensor(nb, dtype=torch.int8), pick)
            best = new
            picks.append(pick)
        c = cap
        for (i, t), pick in zip(reversed(items), reversed(picks)):  # walk the choices back
            nb = int(pick[c])
            bits[(i, t)] = nb
            if nb != 2:
                c -= steps(i, t, nb)
    assign = {i: (bits[(i, 0)], bits[(i, 1)]) for i in layers}
    pred = sum(err[(i, t, bits[(i, t)])] for (i, t) in bits)
    return assign, pred, held()


def _rotation_maps(rots, geometry) -> tuple[dict, dict]:
    """(layer -> (R_k, R_v), layer -> KeyAffine) of a loaded lowbit.kv.plan.Rotations: a key-affine
    rotation candidate (lowbit.kv.key_affine artifact) is measured with its key maps, as the cache holds it."""
    rot = {g.index: rots.per_layer[g.index] for g in geometry.layers}
    ka = {g.index: rots.key_affine[g.index] for g in geometry.layers
          if rots.key_affine and rots.key_affine[g.index] is not None}
    return rot, ka


def _variants(geometry, rotations, grids, tiers, codebooks=None):
    """Layer-error variants: per rotation, K-only and V-only at each bits (2-bit once per grid). codebooks:
    (LevelsRef, {layer: (cb_k, cb_v)}) for the vq grid."""
    from lowbit.eval.layer_error import Variant
    from lowbit.kv.plan import load_rotations
    out = []
    for r in rotations:
        rot, ka = _rotation_maps(load_rotations(r, geometry), geometry)
        for t, name in ((0, "k{b}v16"), (1, "k16v{b}")):
            for b in BITS:
                for g in dict.fromkeys(family(g_, b) for g_ in grids):
                    if g.startswith("scale-only") or g == "vq":  # the TensorQuant the base's tensor has at b bits
                        s = parse_kv_scheme(name.format(b=b), rotation=r, **tiers)
                        base = base_scheme(r, g, codebooks=codebooks[0] if codebooks else None, **tiers)
                        tq = _with_bits(base.k if t == 0 else base.v, b)
                        s = replace(s, k=tq if t == 0 else s.k, v=tq if t == 1 else s.v)
                    else:
                        s = parse_kv_scheme(name.format(b=b), rotation=r, lloyd_max=g == "lloyd-max", **tiers)
                    if b == 2 and g == "std":
                        s = replace(s, k=replace(s.k, grid="std") if t == 0 else s.k,
                                    v=replace(s.v, grid="std") if t == 1 else s.v)
                    lv = codebooks[1] if codebooks and g == "vq" else {}
                    out.append((Variant(f"{_rot_label(r)}|{'KV'[t]}{b}|{g}", s, rot, key_affine=ka, levels=lv),
                                _rot_label(r), t, b, g))
    return out


@dataclass
class Measured:
    """What tune measures once per model and calibration, whatever the budget."""

    err: dict  # (rotation label, grid, layer, tensor, bits) -> relative error energy
    db: dict  # variant name -> layer -> dB
    ref_ppl: float
    rotations: tuple
    grids: tuple
    tiers: dict
    calib: object
    seconds: float
    ppl_cache: dict = field(default_factory=dict)  # repr(scheme) -> fake-quant PPL
    codebooks: tuple | None = None  # (LevelsRef, {layer: (cb_k, cb_v)}) of the vq grid


def measure(lm, calib, *, rotations=DEFAULT_ROTATIONS, grids=DEFAULT_GRIDS, sink=None, recent=None, page=None,
            codebooks=None, log=print) -> Measured:
    """Per-layer K-only / V-only errors of every candidate (see the module docstring, step 1). codebooks: the
    LevelsRef of the VQ codebooks (grid "vq")."""
    from lowbit.eval.layer_error import measure_layers
    from lowbit.eval.perplexity import full_window_ppl

    t0 = time.perf_counter()
    geometry = lm.geometry
    tiers = {"sink": sink, "recent": recent, "page": page}
    cbs = None
    if "vq" in grids:
        from lowbit.kv.plan import load_levels

        if codebooks is None:
            raise LowbitError("the vq grid needs fitted codebooks: pass --codebooks DIR (lowbit calibrate --vq-for)")
        loaded, sha = load_levels(codebooks, geometry)

        cbs = (LevelsRef(codebooks.path, sha), {i: (d.get("k"), d.get("v")) for i, d in loaded.items()})
    variants = _variants(geometry, rotations, grids, tiers, cbs)
    log(f"measuring {len(variants)} layer-error variants on {calib.shape[0]} x {calib.shape[1]} calibration tokens")
    db = measure_layers(lm.model, calib, [v for v, *_ in variants])
    err = {}
    for v, r, t, b, g in variants:
        for g_ in geometry.layers:
            x = db[v.name].get(g_.index, float("-inf"))
            err[(r, g, g_.index, t, b)] = 0.0 if x == float("-inf") else 10 ** (x / 10)
    ref_ppl = full_window_ppl(lm.model, calib)
    log(f"  measured in {time.perf_counter() - t0:.0f} s (exact calibration PPL {ref_ppl:.3f})")
    return Measured(err, db, ref_ppl, tuple(rotations), tuple(grids), tiers, calib, time.perf_counter() - t0,
                    codebooks=cbs)


def _ppl(lm, m: Measured, scheme, rot, ka=None) -> float:
    from lowbit.eval.layer_error import Variant, fake_quant_ppl

    key = repr(scheme)
    if key not in m.ppl_cache:
        layers = {g.index: scheme.for_layer(g.index) for g in lm.geometry.layers}
        lv = m.codebooks[1] if m.codebooks and scheme.levels is not None else {}
        v = Variant("v", scheme, rot, layer_scheme=layers, key_affine=ka or {}, levels=lv)
        m.ppl_cache[key] = fake_quant_ppl(lm.model, m.calib, v)[0]
    return m.ppl_cache[key]


def choose(lm, m: Measured, *, budget: float, context: int, calib_info: dict, log=print) -> TuneResult:
    """The recipe for one budget from the measurements (steps 2-4 of the module docstring)."""
    from lowbit.kv.plan import load_rotations

    t0 = time.perf_counter()
    geometry = lm.geometry
    cb_ref = m.codebooks[0] if m.codebooks else None
    floor = smallest_held(geometry, context, m.rotations, m.grids, codebooks=cb_ref, **m.tiers)
    if budget < floor - 1e-9:
        raise LowbitError(f"budget {budget:g} b/elt is below the smallest recipe's held bits ({floor:.3f} b/elt at "
                          f"{context} tokens: every K and V at 2 bits); give --budget {math.ceil(floor * 100) / 100:g} "
                          "or more")
    layers = [g.index for g in geometry.layers]
    cands = []
    for r in m.rotations:
        rl = _rot_label(r)
        rots = load_rotations(r, geometry)
        rot, ka = _rotation_maps(rots, geometry)
        for g in m.grids:
            base = base_scheme(r, g, codebooks=cb_ref if g == "vq" else None, **m.tiers)
            if held_bits(base, context, geometry=geometry).bits > budget + 1e-9:
                log(f"  rotation {rl}, 2-bit grid {g}: its all-2-bit recipe is over the budget (codebooks); skipped")
                continue
            elems, cost = _cost_table(base, geometry, context)
            e = {(i, t, b): m.err[(rl, family(g, b), i, t, b)] for i in layers for t in (0, 1) for b in BITS}
            assign, pred, _ = allocate(e, elems, cost, budget, layers)
            scheme = with_layer_bits(base, assign)
            held = held_bits(scheme, context, geometry=geometry).bits
            while held > budget + 1e-9:  # codebooks (amortised) are not in allocate's cost: step back
                worst = max((i for i in assign if assign[i] != (2, 2)), key=lambda i: sum(assign[i]))
                kb, vb = assign[worst]
                assign[worst] = (2, vb) if kb >= vb else (kb, 2)
                scheme = with_layer_bits(base, assign)
                held = held_bits(scheme, context, geometry=geometry).bits
            c = Candidate(rl, g, assign, pred, held, scheme, rotation_sha256=rots.sha256)
            c.ppl, c.base_ppl = _ppl(lm, m, scheme, rot, ka), _ppl(lm, m, base, rot, ka)
            log(f"  budget {budget:g}, rotation {rl}, 2-bit grid {g}: held {held:.3f} b/elt, calib PPL {c.ppl:.3f} "
                f"({100 * (c.ppl / m.ref_ppl - 1):+.2f}%; all-2-bit {100 * (c.base_ppl / m.ref_ppl - 1):+.2f}%), "
                f"{sum(1 for a in assign.values() if a != (2, 2))} layers above 2 bits")
            cands.append(c)
    best = min(cands, key=lambda c: c.ppl)
    return TuneResult(model=lm.name, weights_sha256=lm.weights_sha256, budget=budget, context=context,
                      calib=calib_info, best=best, candidates=cands, ref_ppl=m.ref_ppl, db=m.db,
                      held=held_bits(best.scheme, context, geometry=geometry),
                      seconds=m.seconds + time.perf_counter() - t0)


def tune(lm, *, budget: float, context: int, calib, calib_info: dict, rotations=DEFAULT_ROTATIONS, grids=DEFAULT_GRIDS,
         sink=None, recent=None, page=None, log=print) -> TuneResult:
    """measure + choose for one budget. lm: a lowbit LoadedModel; calib: LongTensor [N, T]."""
    m = measure(lm, calib, rotations=rotations, grids=grids, sink=sink, recent=recent, page=page, log=log)
    return choose(lm, m, budget=budget, context=context, calib_info=calib_info, log=log)


# ------------------------------------------------------------------ the recipe file
def _toml_value(v) -> str:
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (int, float)):
        if isinstance(v, float) and not math.isfinite(v):
            return '"nan"'
        return repr(round(v, 6)) if isinstance(v, float) else str(v)
    if isinstance(v, str):
        return '"' + v.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_toml_value(x) for x in v) + "]"
    if v is None:
        return '"none"'
    raise TypeError(f"cannot write {type(v).__name__} to TOML")


def _rotation_field(c: Candidate, out) -> str:
    """The recipe's rotation: a name, or a fitted artifact (RotationSet / key affine) as {path, sha256},
    the path relative to the recipe's directory (load_recipe resolves it from there) when `out` is given."""
    if c.rotation in ("none", "hadamard"):
        return _toml_value(c.rotation)
    return _artifact_field(c.rotation, c.rotation_sha256, out)


def _artifact_field(path, sha256, out) -> str:
    """An artifact a recipe names, as {path, sha256} (a bare path without a pin), the path relative to the
    recipe's directory when `out` is given."""
    import os
    from pathlib import Path

    path = str(Path(path).resolve())
    if out is not None:
        path = os.path.relpath(path, Path(out).resolve().parent)
    if sha256 is None:
        return _toml_value(path)
    return f"{{ path = {_toml_value(path)}, sha256 = {_toml_value(sha256)} }}"


def recipe_toml(res: TuneResult, *, command: str = "", out=None) -> str:
    """The recipe: [kv] (what load_recipe reads), [tune] (budget, measured held bits, evidence).
    out: where the recipe will be written (a fitted rotation's path is written relative to it)."""
    b = res.best
    s = b.scheme
    h = res.held
    lines = [f"# lowbit tune: {res.model}, budget {res.budget:g} held b/elt at {res.context} tokens",
             f"#   {command}" if command else "#",
             f"#   lowbit eval --model {res.model} --kv int2,kivi2 --recipe THIS_FILE", "", "[kv]",
             'scheme = "int2"', f"rotation = {_rotation_field(b, out)}", f"sink = {s.sink}", f"recent = {s.recent}",
             f"page = {s.page}"]
    if b.grid == "lloyd-max":
        lines.append("lloyd_max = true")
    if b.grid.startswith("scale-only") or b.grid == "vq":
        lines.append('zero = "none"')
    if b.grid.startswith("scale-only-mse") or b.grid == "vq":
        lines.append('grid = "mse"')
    if s.k.scale_format != "fp16":
        lines.append(f'scale_format = "{s.k.scale_format}"')
    if b.grid == "vq":
        lines.append(f"levels = {_artifact_field(s.levels.path, s.levels.sha256, out)}")
        for which, tq in (("k", s.k), ("v", s.v)):
            lines.append(f'{which} = {{ bits = 2, zero = "none", grid = "mse", scale_format = "{tq.scale_format}", '
                         f'vq = "{tq.vq}" }}')
    lines += ["", "[kv.layer_bits]"] + [f'"{i}" = "{name}"' for i, name in s.layer_bits]
    d = h.dense()
    tune_doc = {
        "model": res.model, "budget": res.budget, "context": res.context,
        "held_bits": h.bits, "held_bits_k": h.k_bits, "held_bits_v": h.v_bits,
        "dense_tiers_share": d["dense_share"], "avg_bits_all_tiers": d["avg_bits_all_tiers"],
        "rotation": b.rotation, "grid_2bit": b.grid, "calib_data": res.calib.get("data"),
        "calib_windows": res.calib.get("windows"), "calib_seq_len": res.calib.get("seq_len"),
        "calib_ref_ppl": res.ref_ppl, "calib_ppl": b.ppl, "calib_delta_ppl_pct": 100 * (b.ppl / res.ref_ppl - 1),
        "calib_all_int2_delta_ppl_pct": 100 * (b.base_ppl / res.ref_ppl - 1), "seconds": round(res.seconds, 1),
        "lowbit_version": __version__,
    }
    lines += ["", ("# evidence (ignored by load_recipe): held bits from lowbit.kv.held at the context; PPL on the "
              "calibration windows, full-window fake-quant (lowbit.eval.layer_error)"), "[tune]"]
    lines += [f"{k} = {_toml_value(v)}" for k, v in tune_doc.items()]
    ws = res.weights_sha256
    if isinstance(ws, str):
        lines.append(f"weights_sha256 = {_toml_value(ws)}")
    for c in res.candidates:
        lines += ["", "[[tune.candidates]]", f"rotation = {_toml_value(c.rotation)}", f"grid_2bit = {_toml_value(c.grid)}",
                  f"held_bits = {_toml_value(c.held)}", f"predicted_loss = {_toml_value(c.predicted)}",
                  f"calib_ppl = {_toml_value(c.ppl)}", f"calib_all_int2_ppl = {_toml_value(c.base_ppl)}",
                  f"layers_above_2bit = {sum(1 for a in c.assign.values() if a != (2, 2))}"]
    lines += ["", "# per-layer attention-output error (dB) on the calibration windows, K-only / V-only variants",
              "[tune.layer_error_db]"]
    for name, per in res.db.items():
        lines.append(f"{_toml_value(name)} = {_toml_value([round(per[i], 2) for i in sorted(per)])}")
    return "\n".join(lines) + "\n"
