"""`lowbit validate ARTIFACT`: the order a serious hand-off checks an artifact in, one stage at a time.

    report = validate("out/exp", device="cpu")          # stages 1..4, stops at the first failure
    print(format_report(report)); write_report(report, "validate.json")

Stages (each returns {"stage", "name", "ok", "checks": [{"name", "ok", "detail"}], "error", "seconds"}),
so a dependency, a packing and a model error each fail a different stage:
    1 cpu-checks    manifest digests (every file, named when it differs), artifact class (a fake-quant-eval
                    artifact is refused where a native-packed one is needed), the recipe against the
                    model's geometry (the KV plan, the plugin's rules, the weight tensors' groups, the
                    rotation set's model) -- config files only, no weights loaded
    2 kernel-audit  exactly the kernels and shapes this artifact uses, against their torch twins, on the
                    device (CUDA; on CPU the Triton interpreter at small T)
    3 smoke         load + prefill + decode a few tokens: finite logits, the packed tier really holds
                    rows, the greedy token equals the reference path's (the unquantized model, plain cache)
    4 accuracy      one short window of stdlib text, chunked through the cache as serving does:
                    PPL, KL(reference || artifact) and top-1 against the unquantized model

Artifact kinds validate knows (manifest `kind` -> what it is, the class it must have):
    vllm-model                   `lowbit export --for vllm`     KV sidecar (+ maybe quantized weights)  native-packed
    weights-compressed-tensors   `lowbit quantize`              compressed-tensors checkpoint           native-packed
    kv-rotations                 RotationSet.save / fit-rotations  run through a cache with scheme `kv`  generic
    diffusers-compressed-tensors `lowbit quantize --component`  a DiT checkpoint: stage 1 only       native-packed
                                 (its smoke and accuracy are images: `lowbit eval images` runs the structure gate)

The report carries its provenance once at the top, for every stage result in it: the lowbit commit
and whether the tree was modified (or the installed version), package versions, the device, the
artifact's file digests, the full plan and the flags.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import platform
import subprocess
import sys
import time
from dataclasses import dataclass, field
from importlib import metadata
from pathlib import Path
from typing import Any

import lowbit
from lowbit import __version__, backends
from lowbit.artifacts import FAILED, MISSING, OK, UNLISTED, load_manifest, require_class, verify
from lowbit.artifacts.writer import sweep_stale, write_new_file
from lowbit.core.device import resolve_device
from lowbit.core.errors import LowbitError
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.geometry import ModelGeometry
from lowbit.models.load import model_dir, model_name
from lowbit.models.registry import BUILTINS
from lowbit.vllm_plugin import sidecar

REPORT_FORMAT = "lowbit-validate"
REPORT_VERSION = 1
STAGES = {1: "cpu-checks", 2: "kernel-audit", 3: "smoke", 4: "accuracy"}
# manifest kind -> (short label, the class that kind must have)
KINDS = {
    "vllm-model": ("kv-export", "native-packed"),
    "weights-compressed-tensors": ("weights", "native-packed"),
    "kv-rotations": ("rotations", "generic"),
    "diffusers-compressed-tensors": ("dit", "native-packed"),
}
# why stages 2-4 are not run on a DiT checkpoint (they load a causal LM and read text)
DIT_STAGES_WHY = "a DiT checkpoint: stages 2-4 read text through a causal LM; run `lowbit eval images` for its gate"
PACKAGES = ("torch", "transformers", "triton", "compressed-tensors", "safetensors")
DEFAULT_ROTATION_KV = "int4"  # the scheme a rotation set is run with in stages 2-4 (--kv)
DEFAULT_MAX_PPL_INCREASE = 50.0  # percent; catches a broken artifact, not a quality bar (set your own)
DEFAULT_MAX_KL = 0.5  # nats per token, mean KL(reference || artifact)
SMOKE_DECODE = 4  # greedy tokens decoded in stage 3
# stage 3 accepts another first token only when the reference itself ranks the two this close (log-prob
# nats): random test models and real ones both have near-ties that any quantization may flip
SMOKE_TIE_NATS = 0.1
ACCURACY_MIN_TOKENS = 512  # stage 4 window length (longer when sink + recent need it)
CHUNK = 128  # prefill chunk in stage 4 (as serving feeds a prompt)


# ------------------------------------------------------------------ options and context
@dataclass
class Options:
    """What `lowbit validate` was asked (recorded in the report's provenance as `flags`)."""

    artifact: str
    model: str | None = None  # rotation sets: the model they were fitted for (default: manifest inputs.model)
    base: str | None = None  # quantized weights: the unquantized base (default: manifest inputs)
    device: str = "cpu"
    stages: tuple = (1, 2, 3, 4)
    kv: str | None = None  # rotation sets only: the scheme run with them (None: DEFAULT_ROTATION_KV)
    max_ppl_increase: float = DEFAULT_MAX_PPL_INCREASE
    max_kl: float = DEFAULT_MAX_KL
    json: str | None = None

    def to_dict(self) -> dict:
        return {"artifact": self.artifact, "model": self.model, "base": self.base, "device": self.device,
                "stages": list(self.stages), "kv": self.kv, "max_ppl_increase": self.max_ppl_increase,
                "max_kl": self.max_kl, "json": self.json}


@dataclass
class Context:
    """What stage 1 found and later stages use. Models are loaded once (stage 3 or 4, whichever runs first)."""

    root: Path
    opts: Options
    manifest: Any = None
    label: str | None = None  # "kv-export" | "weights" | "rotations"
    geometry: Any = None  # ModelGeometry of the model the artifact runs on
    plan: Any = None  # lowbit.kv.plan.Plan (KV kinds)
    weight_scheme: Any = None  # WeightScheme when the artifact holds quantized weights
    test_src: str | None = None  # what is loaded as the artifact's model
    ref_src: str | None = None  # what is loaded as the unquantized reference (None: the same model)
    ref_sha256: str | None = None  # weights sha256 the artifact says its reference had
    loaded: dict = field(default_factory=dict)

    def plan_doc(self) -> dict | None:
        doc: dict = {}
        if self.plan is not None:
            doc["kv"] = self.plan.to_dict()
        if self.weight_scheme is not None:
            doc["weights"] = {"scheme": self.weight_scheme.to_dict(),
                              "kernel": "none (QuantLinear torch twin: dequantize + matmul)"}
        if self.test_src is not None:
            doc["models"] = {"artifact": self.test_src, "reference": self.ref_src or self.test_src}
        return doc or None


class _Stage:
    """Collects the checks of one stage; the first failing check's detail is the stage's error."""

    def __init__(self, n: int):
        self.n, self.checks, self.t0 = n, [], time.perf_counter()
        self.metrics: dict | None = None

    def check(self, name: str, ok: bool, detail: str) -> bool:
        self.checks.append({"name": name, "ok": bool(ok), "detail": detail})
        return ok

    def result(self, error: str | None = None) -> dict:
        if error is None:
            bad = [c for c in self.checks if not c["ok"]]
            error = f"{bad[0]['name']}: {bad[0]['detail']}" if bad else None
        out = {"stage": self.n, "name": STAGES[self.n], "ok": error is None, "checks": self.checks,
               "error": error, "seconds": round(time.perf_counter() - self.t0, 3)}
        if self.metrics is not None:  # numbers a later reader compares (strict JSON: non-finite -> None)
            out["metrics"] = {k: (v if not isinstance(v, float) or math.isfinite(v) else None)
                              for k, v in self.metrics.items()}
        return out


def _one_line(e: BaseException) -> str:
    msg = " ".join(str(e).split())
    return msg if isinstance(e, LowbitError) else f"{type(e).__name__}: {msg}"


# ------------------------------------------------------------------ provenance
def _git_state() -> dict:
    """{commit, modified} of the checkout lowbit runs from; {commit: None} for an installed package."""
    root = Path(lowbit.__file__).resolve().parents[2]  # <checkout>/src/lowbit/__init__.py
    if not (root / "src" / "lowbit").is_dir() or not (root / ".git").exists():
        return {"commit": None, "modified": None, "source": "installed"}
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True,
                              timeout=20, check=True).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain"], capture_output=True, text=True,
                               timeout=20, check=True).stdout.splitlines()
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "modified": None, "source": "installed"}
    return {"commit": head, "modified": bool(dirty), "modified_paths": len(dirty), "source": str(root)}


def _device_info(device: str) -> dict:
    import torch

    if device == "cuda":
        i = torch.cuda.current_device()
        p = torch.cuda.get_device_properties(i)
        return {"type": "cuda", "name": torch.cuda.get_device_name(i), "capability": list(torch.cuda.get_device_capability(i)),
                "memory_bytes": int(p.total_memory), "cuda": torch.version.cuda}
    return {"type": "cpu", "name": platform.processor() or platform.machine(), "threads": torch.get_num_threads()}


def provenance(ctx: Context) -> dict:
    pk: dict = {"python": platform.python_version()}
    for name in PACKAGES:
        try:
            pk[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            pk[name] = None
    art: dict = {"path": str(ctx.root.resolve())}
    mpath = ctx.root / "manifest.json"
    if mpath.is_file():
        art["manifest_sha256"] = hashlib.sha256(mpath.read_bytes()).hexdigest()
    if ctx.manifest is not None:
        m = ctx.manifest
        art.update(kind=m.kind, artifact_class=m.artifact_class, inputs=m.inputs,
                   files=[{"path": e.path, "bytes": e.bytes, "sha256": e.sha256} for e in m.files])
    return {"lowbit": {"version": __version__, **_git_state()}, "packages": pk, "device": _device_info(ctx.opts.device),
            "artifact": art, "plan": ctx.plan_doc(), "flags": ctx.opts.to_dict()}


# ------------------------------------------------------------------ stage 1: CPU checks
def stage_cpu_checks(ctx: Context) -> dict:
    """Digests, class, and the recipe against the model's geometry (config files only)."""
    st = _Stage(1)
    try:
        ctx.manifest = load_manifest(ctx.root)
    except LowbitError as e:
        return st.result(f"manifest: {e}")
    st.check("manifest", True, f"kind {ctx.manifest.kind!r}, class {ctx.manifest.artifact_class!r}, "
             f"{len(ctx.manifest.files)} files, {ctx.manifest.total_bytes} bytes")
    status = verify(ctx.root)
    ctx.label = KINDS.get(ctx.manifest.kind, (None,))[0]  # named in the report even when a check fails
    why = {FAILED: "its size or sha256 differs from the manifest", MISSING: "listed but absent",
           UNLISTED: "present but not in the manifest"}
    bad = [f"{s.path} {s.status} ({why[s.status]})" for s in status if s.status != OK]
    if not st.check("digests", not bad, "; ".join(bad) + "; the artifact changed since it was written: re-create or "
                    "copy it again" if bad else f"all {len(status)} files match their sha256"):
        return st.result()
    m = ctx.manifest
    known = KINDS.get(m.kind)
    need = known[1] if known else "native-packed"
    try:
        require_class(m, need)
    except LowbitError as e:
        st.check("class", False, str(e))
        return st.result()
    if known is None:
        st.check("kind", False, f"kind {m.kind!r} is not one validate runs ({', '.join(KINDS)}); "
                 f"check its files with `lowbit verify {ctx.root}`")
        return st.result()
    ctx.label = known[0]
    st.check("class", True, f"{m.artifact_class} (what kind {m.kind} must be)")
    try:
        {"kv-export": _cpu_kv_export, "weights": _cpu_weights, "rotations": _cpu_rotations,
         "dit": _cpu_dit}[ctx.label](ctx, st)
    except LowbitError as e:
        st.check("model and recipe", False, str(e))
    return st.result()


def _config(d: Path) -> dict:
    p = d / "config.json"
    if not p.is_file():
        raise LowbitError(f"{d} has no config.json: the artifact is incomplete; re-create it")
    return json.loads(p.read_text())


def _model_ref(spec: str | None, flag: str, what: str) -> tuple[Path, str]:
    """(HF directory, name) of a built-in name or local dir, without loading weights."""
    if not spec:
        raise LowbitError(f"the manifest names no {what}; pass {flag} NAME_OR_DIR")
    if spec not in BUILTINS and not Path(spec).expanduser().is_dir():
        raise LowbitError(f"{what} {spec!r} (from the manifest) is neither a built-in model nor a directory here; "
                          f"pass {flag} NAME_OR_DIR")
    try:
        return model_dir(spec), model_name(spec)
    except LowbitError as e:
        raise LowbitError(f"{flag} {spec}: {e}") from None


def _same_geometry(a, b) -> str | None:
    if a.num_layers != b.num_layers:
        return f"{a.num_layers} layers vs {b.num_layers}"
    for x, y in zip(a.layers, b.layers):
        for k in ("attention", "window", "num_q_heads", "num_kv_heads", "head_dim_k", "head_dim_v"):
            if getattr(x, k) != getattr(y, k):
                return f"layer {x.index} {k} {getattr(x, k)} vs {getattr(y, k)}"
    return None


def _plan_checks(ctx: Context, st: _Stage, scheme, geometry) -> None:
    from lowbit.kv.plan import resolve

    ctx.plan = resolve(scheme, geometry, device=ctx.opts.device)
    dec = sorted(ctx.plan.backend_names("decode"))
    st.check("plan", True, f"{scheme.describe()} on {geometry.num_layers} layers; decode on {ctx.opts.device}: "
             f"{', '.join(dec)}")


def _weights_checks(ctx: Context, st: _Stage, d: Path, cfg: dict) -> None:
    """quantization_config -> WeightScheme; every quantized tensor's shape fits the scheme's groups."""
    from safetensors import safe_open

    from lowbit.weights.load import scheme_from_ct

    ws = ctx.weight_scheme = scheme_from_ct(cfg["quantization_config"])
    n, bad = 0, []
    for f in sorted(d.glob("*.safetensors")):
        with safe_open(str(f), framework="pt") as sf:
            names = set(sf.keys())
            for key in sorted(k for k in names if k.endswith(".weight_scale")):
                p = key[: -len(".weight_scale")]
                if f"{p}.weight_shape" in names:
                    out, inp = (int(x) for x in sf.get_tensor(f"{p}.weight_shape"))
                elif f"{p}.weight" in names:
                    out, inp = sf.get_slice(f"{p}.weight").get_shape()
                else:
                    bad.append(f"{p}: no weight_packed/weight_shape or weight")
                    continue
                sshape = list(sf.get_slice(key).get_shape())
                groups = 1 if ws.group is None else inp // ws.group
                if ws.group is not None and inp % ws.group:
                    bad.append(f"{p}: {inp} inputs are not a multiple of group {ws.group}")
                elif sshape not in ([out, groups], [out] if groups == 1 else None):
                    bad.append(f"{p}: weight_scale {sshape}, scheme {ws.name} on [{out}, {inp}] needs [{out}, {groups}]")
                n += 1
    if not n:
        bad.append("no quantized tensors (*.weight_scale) in the safetensors")
    st.check("weights", not bad, "; ".join(bad[:3]) + "; the checkpoint does not match its quantization_config: "
             "re-run `lowbit quantize`" if bad else f"{ws.name}: {n} quantized linears, groups fit every input width")


def _cpu_kv_export(ctx: Context, st: _Stage) -> None:
    from lowbit.vllm_plugin import slot as _slot  # noqa: F401 (registers the vllm-slot backend)

    side = sidecar.read(ctx.root)
    cfg = _config(ctx.root)
    geometry = ModelGeometry.from_config(cfg, name=side["model"]["name"])
    sidecar.check_against(side, geometry)
    st.check("sidecar", True, f"{sidecar.SIDECAR_NAME} matches config.json's geometry ({geometry.num_layers} layers)")
    mk = ctx.manifest.recipe.get("kv")
    st.check("manifest recipe", mk == side["kv_scheme"], "manifest recipe.kv equals the sidecar's kv_scheme"
             if mk == side["kv_scheme"] else "manifest recipe.kv differs from the sidecar's kv_scheme: export again")
    scheme = sidecar.scheme_of(side, ctx.root)
    _plan_checks(ctx, st, scheme, geometry)
    ctx.geometry = geometry
    slot = backends.get("vllm-slot")
    why = [f"layer {lp.index}: {r}" for lp in ctx.plan.layers if (r := slot.why_not(lp, "paged", "cpu"))]
    st.check("vllm plugin", not why, "; ".join(why[:2]) if why else "every layer fits the plugin's packed slot (page 1)")
    ctx.test_src = str(ctx.root)
    if isinstance(cfg.get("quantization_config"), dict):
        _weights_checks(ctx, st, ctx.root, cfg)
        base = ctx.opts.base or ctx.manifest.inputs.get("model_dir") or ctx.manifest.inputs.get("model")
        bdir, _ = _model_ref(base, "--base", "unquantized base model")
        diff = _same_geometry(ModelGeometry.from_config(_config(bdir)), geometry)
        st.check("base", diff is None, f"{bdir}: same attention geometry" if diff is None else
                 f"{bdir} is another model than the export's ({diff}); pass the model it was exported from as --base")
        ctx.ref_src = str(bdir)
    else:
        if ctx.opts.base is not None:
            raise LowbitError("--base: this export ships the model's own unquantized weights, which are their own "
                              "reference; drop --base")
        st.check("weights", True, "the model's own (unquantized) weights; reference = the same model, plain cache")


def _cpu_weights(ctx: Context, st: _Stage) -> None:
    cfg = _config(ctx.root)
    if not isinstance(cfg.get("quantization_config"), dict):
        raise LowbitError(f"{ctx.root}/config.json has no quantization_config: not a quantized checkpoint; re-create it")
    _weights_checks(ctx, st, ctx.root, cfg)
    _recipe_check(ctx, st)
    ctx.geometry = ModelGeometry.from_config(cfg, name=ctx.root.resolve().name)
    bdir, _ = _model_ref(ctx.opts.base or ctx.manifest.inputs.get("model"), "--base", "unquantized base model")
    bcfg = _config(bdir)
    diff = _same_geometry(ModelGeometry.from_config(bcfg), ctx.geometry)
    for k in ("hidden_size", "intermediate_size", "vocab_size"):
        if diff is None and bcfg.get(k) != cfg.get(k):
            diff = f"{k} {bcfg.get(k)} vs {cfg.get(k)}"
    st.check("base", diff is None, f"{bdir}: same geometry, hidden and vocabulary sizes" if diff is None else
             f"{bdir} is another model than the checkpoint's ({diff}); pass the model it was quantized from as --base")
    ctx.test_src, ctx.ref_src = str(ctx.root), str(bdir)
    ctx.ref_sha256 = ctx.manifest.inputs.get("weights_sha256")


def _recipe_check(ctx: Context, st: _Stage) -> None:
    rs = ctx.manifest.recipe.get("scheme") or {}
    ws = ctx.weight_scheme
    same = all(rs.get(k) == getattr(ws, k) for k in ("w_bits", "group", "symmetric", "a_bits"))
    st.check("manifest recipe", same, f"recipe.scheme {rs.get('name')} = config.json's {ws.name}" if same else
             f"manifest recipe.scheme {rs.get('name')!r} differs from config.json's {ws.name!r}: re-run `lowbit quantize`")


def _cpu_dit(ctx: Context, st: _Stage) -> None:
    """model_index.json names a transformer and a scheduler; the quantized component's tensors fit its
    quantization_config and the manifest's recipe (config files and safetensors headers only)."""
    from lowbit.diffusion.load import pipeline_components

    comps = pipeline_components(ctx.root)
    missing = sorted({"transformer", "scheduler"} - set(comps))
    st.check("pipeline", not missing, f"model_index.json lacks {', '.join(missing)}; re-run `lowbit quantize`"
             if missing else f"components {', '.join(sorted(comps))}")
    comp = ctx.manifest.inputs.get("component") or "transformer"
    cfg = _config(ctx.root / comp)
    if not isinstance(cfg.get("quantization_config"), dict):
        raise LowbitError(f"{ctx.root}/{comp}/config.json has no quantization_config: not a quantized checkpoint; "
                          "re-run `lowbit quantize --component ...`")
    _weights_checks(ctx, st, ctx.root / comp, cfg)
    _recipe_check(ctx, st)


def _cpu_rotations(ctx: Context, st: _Stage) -> None:
    from lowbit.rotation.rotation_set import RotationSet

    rs = RotationSet.load(ctx.root)  # sha256 against the manifest, format, orthogonality
    st.check("rotations", True, f"{rs.num_layers} layers, {'per KV head (v2)' if rs.per_head else 'per layer (v1)'}, "
             f"orthogonal, fitted for {rs.model!r}")
    mdir, name = _model_ref(ctx.opts.model or ctx.manifest.inputs.get("model") or rs.model, "--model",
                            "model the rotation set was fitted for")
    geometry = ModelGeometry.from_config(_config(mdir), name=name)
    rs.validate_against(geometry)
    st.check("model", True, f"{mdir} ({name}): layers, KV heads and head dims fit the rotations")
    scheme = parse_kv_scheme(ctx.opts.kv or DEFAULT_ROTATION_KV, rotation=str(ctx.root))
    _plan_checks(ctx, st, scheme, geometry)
    ctx.geometry = geometry
    ctx.test_src = str(mdir)
    ctx.ref_sha256 = ctx.manifest.inputs.get("weights_sha256")


# ------------------------------------------------------------------ stage 2: kernel audit
def kernel_cases(plan, device: str) -> tuple[list, list[str]]:
    """(audit cases [(name, make_case kwargs)], notes) for the decode kernel at exactly the plan's shapes.

    A layer is audited when the fused kernel takes it on CUDA (on CPU the plan decodes through the
    torch path, and the kernel is run in the Triton interpreter at the same bits / head_dim / group /
    GQA, small T); layers it does not take are noted with the rule. Same shapes are audited once."""
    kern = backends.get("triton-decode")
    cases, notes, seen = [], [], {}
    for lp in plan.layers:
        why = kern.why_not(lp, "decode", "cuda")
        if why:
            notes.append(f"layer {lp.index}: torch path only ({why})")
            continue
        g = lp.geometry
        key = (g.num_q_heads, g.num_kv_heads, g.head_dim_k, g.head_dim_v, lp.k.cbits, lp.v.cbits, lp.k.group,
               lp.v.group, lp.sink > 0)
        if key in seen:
            seen[key].append(lp.index)
            continue
        seen[key] = [lp.index]
        if g.head_dim_k != g.head_dim_v or lp.k.group != lp.v.group:
            notes.append(f"layer {lp.index}: NOT AUDITED (K/V head_dim {g.head_dim_k}/{g.head_dim_v}, group "
                         f"{lp.k.group}/{lp.v.group}: the audit's case builder takes one head_dim and group)")
            seen[key] = None
            continue
        base = {"Hq": g.num_q_heads, "Hkv": g.num_kv_heads, "D": g.head_dim_k, "kbits": lp.k.cbits,
                "vbits": lp.v.cbits, "group": lp.k.group}
        if device == "cuda":
            sizes = [(16, 8192, True), (1, 32768, False)]
            tiers = {"sink": lp.sink, "recent": lp.recent}
        else:  # the interpreter runs every program in Python: small T, the same tiling
            sizes = [(3, 37, True)]
            tiers = {"sink": min(lp.sink, 3), "recent": min(lp.recent, 5)}
        tiers = {k: v for k, v in tiers.items() if v}
        for B, T, ragged in sizes:
            name = (f"B{B} Hq{g.num_q_heads}/Hkv{g.num_kv_heads} D{g.head_dim_k} T{T} k{lp.k.cbits}v{lp.v.cbits} "
                    f"g{lp.k.group}" + (" +tiers" if tiers else "") + (" ragged" if ragged else ""))
            cases.append((name, {**base, "B": B, "T": T, "ragged": ragged, **tiers}))
    for key, layers in seen.items():
        if layers:
            notes.append(f"layers {','.join(map(str, layers))}: k{key[4]}v{key[5]} D{key[2]} g{key[6]} "
                         f"Hq{key[0]}/Hkv{key[1]} audited")
    return cases, notes


def _audit_rows(cases: list, device: str) -> list[dict]:
    """Run the kernel audit on `cases`; on CPU without the interpreter switched on, in a child process
    that has it (Triton reads TRITON_INTERPRET when the kernel module is imported)."""
    if device == "cpu" and os.environ.get("TRITON_INTERPRET") != "1":
        code = ("import json, sys; from lowbit.tools.validate import _audit_rows; "
                "print(json.dumps(_audit_rows(json.load(sys.stdin), 'cpu')))")
        env = dict(os.environ, TRITON_INTERPRET="1")
        p = subprocess.run([sys.executable, "-c", code], input=json.dumps(cases), capture_output=True, text=True,
                           env=env, timeout=3600, check=False)
        if p.returncode:
            tail = " ".join((p.stderr or p.stdout).strip().splitlines()[-1:])
            raise LowbitError(f"the kernel audit (Triton interpreter) failed: {tail}")
        return json.loads(p.stdout.strip().splitlines()[-1])
    from lowbit.tools.audit.attention import audit

    return [r.as_dict() for r in audit(device, cases=[(n, kw) for n, kw in cases])]


def stage_kernel_audit(ctx: Context) -> dict:
    from lowbit.tools.audit.attention import TOL

    st = _Stage(2)
    if ctx.weight_scheme is not None:
        st.check("weight kernels", True, f"no weight kernel is used by this artifact on this device "
                 f"({ctx.weight_scheme.name}); twin only (QuantLinear: dequantize + matmul in torch)")
    if ctx.plan is None:
        return st.result()
    cases, notes = kernel_cases(ctx.plan, ctx.opts.device)
    where = ("on cuda" if ctx.opts.device == "cuda" else
             "on cpu the plan decodes through torch-stream; the kernel is run in the Triton interpreter")
    if not cases:
        st.check("decode kernel", not any("NOT AUDITED" in n for n in notes),
                 "the fused decode kernel takes no layer of this plan; torch path only: " + "; ".join(notes[:3]))
        return st.result()
    try:
        rows = _audit_rows(cases, ctx.opts.device)
    except Exception as e:  # noqa: BLE001 -- a kernel that does not compile or crashes is this stage's failure
        st.check("decode kernel", False, _one_line(e))
        return st.result()
    for r in rows:
        st.check(f"decode_attention {r['case']}", r["ok"], f"rel L2 {r['rel_l2']:.2e} (<= {TOL:g}), max rel "
                 f"{r['max_rel']:.2e}, finite {r['finite']}, {r['seconds']:.2f} s")
    st.check("coverage", not any("NOT AUDITED" in n for n in notes), f"{where}; " + "; ".join(notes))
    return st.result()


# ------------------------------------------------------------------ models for stages 3 and 4
def _models(ctx: Context) -> dict:
    """{"test": (model, tokenizer), "ref": (model, tokenizer), "dtype"}: loaded once, on the device."""
    if ctx.loaded:
        return ctx.loaded
    import torch

    from lowbit.runtime.load import resolve

    dtype = torch.bfloat16 if ctx.opts.device == "cuda" else torch.float32
    test = resolve(ctx.test_src, dtype=dtype, device=ctx.opts.device)
    ref = test if ctx.ref_src is None else resolve(ctx.ref_src, dtype=dtype, device=ctx.opts.device)
    if ctx.ref_sha256 and ref.weights_sha256 != ctx.ref_sha256:
        raise LowbitError(f"{ref.path} has weights sha256 {ref.weights_sha256[:12]}... but the artifact was made from "
                          f"{ctx.ref_sha256[:12]}...: pass the model it was made from "
                          f"({'--base' if ctx.label == 'weights' else '--model'})")
    tok = test.tokenizer or ref.tokenizer
    if tok is None:
        raise LowbitError(f"no tokenizer in {ctx.test_src} nor {ctx.ref_src}; the smoke and accuracy stages read text")
    ctx.loaded = {"test": test.model, "ref": ref.model, "tokenizer": tok, "dtype": str(dtype).replace("torch.", ""),
                  "ref_sha256": ref.weights_sha256}
    return ctx.loaded


def _new_cache(ctx: Context, model, which: str):
    from transformers import DynamicCache

    if which == "test" and ctx.plan is not None:
        from lowbit.runtime.cache import QuantizedKVCache

        return QuantizedKVCache.from_plan(model, ctx.plan)
    return DynamicCache(config=model.config)


def _forward(model, ids, cache):
    from lowbit.eval.perplexity import forward_chunk

    return forward_chunk(model, ids, cache)  # [1, C, V] float32


def _text_ids(tok, n: int):
    """The first n tokens of the stdlib corpus (English prose shipped with Python), [1, n] int64."""
    from lowbit.calib.corpora import load_text, token_windows

    return token_windows(tok, load_text("stdlib"), n, 1)


def _kv_quantized(ctx: Context) -> bool:
    return ctx.plan is not None and ctx.plan.scheme.quantized


def _max_positions(model) -> int:
    cfg = model.config
    cfg = cfg.get_text_config(decoder=True) if hasattr(cfg, "get_text_config") else cfg
    return int(getattr(cfg, "max_position_embeddings", 0) or 0) or 4096


# ------------------------------------------------------------------ stage 3: smoke
def stage_smoke(ctx: Context) -> dict:
    import torch

    st = _Stage(3)
    try:
        with torch.no_grad():
            _smoke(ctx, st)
    except Exception as e:  # noqa: BLE001 -- a model that does not load or run fails this stage, named
        st.check("run", False, _one_line(e))
    return st.result()


def _smoke(ctx: Context, st: _Stage) -> None:
    import torch

    m = _models(ctx)
    test, ref = m["test"], m["ref"]
    dev = ctx.opts.device
    # long enough that pages leave the recent ring for the packed middle tier: the path under test
    n = 16
    if _kv_quantized(ctx):
        s = ctx.plan.scheme
        n = s.sink + s.recent + 2 * max(s.page, 1) + 7
    n = min(n, _max_positions(test) - SMOKE_DECODE - 1)
    ids = _text_ids(m["tokenizer"], n).to(dev)
    st.check("load", True, f"artifact model {ctx.test_src}" + (f", reference {ctx.ref_src}" if ctx.ref_src else
             ", reference = the same model with a plain cache") + f" ({m['dtype']}, {dev})")
    out = {}
    for which, model in (("test", test), ("ref", ref)):
        cache = _new_cache(ctx, model, which)
        logits = _forward(model, ids, cache)[0, -1]
        first = torch.log_softmax(logits.float(), -1)  # [V] after the prefill
        finite, toks = bool(torch.isfinite(logits).all()), []
        for _ in range(SMOKE_DECODE):
            t = int(torch.argmax(logits))
            toks.append(t)
            logits = _forward(model, torch.tensor([[t]], device=dev), cache)[0, -1]
            finite = finite and bool(torch.isfinite(logits).all())
        out[which] = (toks, finite, cache, first)
    toks, finite, cache, _ = out["test"]
    rtoks, ref_first = out["ref"][0], out["ref"][3]
    st.check("finite logits", finite, f"prefill {n} tokens + {SMOKE_DECODE} decode steps: every logit finite"
             if finite else "NaN/Inf in the artifact's logits")
    if _kv_quantized(ctx):
        rows = cache.quantized_rows_total()
        calls = dict(cache.backend_calls)
        st.check("packed tier", rows > 0, f"{rows} K+V rows encoded into the packed middle tier; attention calls {calls}"
                 if rows else f"no row reached the packed middle tier after {n} tokens (sink + recent hold them all)")
        want = "triton" if "triton-decode" in ctx.plan.backend_names("decode") else None
        if want:
            st.check("decode backend", calls.get("triton", 0) > 0, f"the fused kernel ran {calls.get('triton', 0)} "
                     "times as the plan says" if calls.get("triton") else f"the plan chose the kernel but it never "
                     f"ran: {'; '.join(cache.backend_notes[:2])}")
    agree = sum(a == b for a, b in zip(toks, rtoks))
    seq = f"{agree}/{len(toks)} decoded tokens agree (artifact {toks}, reference {rtoks})"
    # how far below its own top-1 the reference puts the artifact's token: a near-tie may go either way
    gap = float(ref_first[rtoks[0]] - ref_first[toks[0]])
    if toks[0] == rtoks[0]:
        st.check("greedy token", True, f"first greedy token {toks[0]} = reference's; {seq}")
    else:
        st.check("greedy token", gap <= SMOKE_TIE_NATS, f"first greedy token {toks[0]}, reference {rtoks[0]}: "
                 f"{'a near-tie' if gap <= SMOKE_TIE_NATS else 'not a near-tie'} ({gap:.3f} nats apart in the "
                 f"reference, tie tolerance {SMOKE_TIE_NATS:g}); {seq}")


# ------------------------------------------------------------------ stage 4: accuracy
def stage_accuracy(ctx: Context) -> dict:
    import torch

    st = _Stage(4)
    try:
        with torch.no_grad():
            _accuracy(ctx, st)
    except Exception as e:  # noqa: BLE001 -- as in stage 3
        st.check("run", False, _one_line(e))
    return st.result()


def _accuracy(ctx: Context, st: _Stage) -> None:
    import torch

    from lowbit.eval.perplexity import Scores, chunk_targets

    m = _models(ctx)
    test, ref = m["test"], m["ref"]
    L = ACCURACY_MIN_TOKENS
    if _kv_quantized(ctx):
        s = ctx.plan.scheme
        L = max(L, s.sink + s.recent + 2 * max(s.page, 1) + 128)  # a quarter of the window or more is packed
    L = min(L, _max_positions(test))
    window = _text_ids(m["tokenizer"], L)[0]  # [L]
    caches = {"test": _new_cache(ctx, test, "test"), "ref": _new_cache(ctx, ref, "ref")}
    sc, sr = Scores(), Scores()
    for start in range(0, L, CHUNK):
        ids = window[None, start:start + CHUNK].to(ctx.opts.device)
        rl = torch.log_softmax(_forward(ref, ids, caches["ref"])[0], -1)
        tl = torch.log_softmax(_forward(test, ids, caches["test"])[0], -1)
        k, tgt = chunk_targets(window, start, start + CHUNK)
        if k:
            tgt = tgt.to(ctx.opts.device)
            sr.add(rl[:k], tgt)
            sc.add(tl[:k], tgt, ref_logp=rl[:k])
    dppl = 100.0 * (sc.ppl / sr.ppl - 1.0)
    finite = math.isfinite(sc.ppl) and math.isfinite(sc.mean_kl)
    st.check("window", finite, f"1 window x {L} tokens of stdlib text in chunks of {CHUNK}, {sc.n} scored; "
             f"reference PPL {sr.ppl:.4g}, artifact PPL {sc.ppl:.4g}" if finite else f"artifact PPL {sc.ppl} / KL "
             f"{sc.mean_kl} is not finite")
    if _kv_quantized(ctx):
        rows = caches["test"].quantized_rows_total()
        st.check("packed tier", rows > 0, f"{rows} K+V rows went through the packed middle tier" if rows else
                 "no row was quantized: the window never left the dense tiers (dead path)")
    st.check("ppl", finite and dppl <= ctx.opts.max_ppl_increase,
             f"PPL {dppl:+.2f}% vs the unquantized model (limit +{ctx.opts.max_ppl_increase:g}%)")
    st.check("kl", finite and sc.mean_kl <= ctx.opts.max_kl,
             f"mean KL(reference || artifact) {sc.mean_kl:.4g} nats/token (limit {ctx.opts.max_kl:g}); "
             f"top-1 agreement {sc.top1_pct:.1f}%")
    st.metrics = {"tokens": L, "scored": sc.n, "ppl_reference": sr.ppl, "ppl": sc.ppl, "dppl_pct": dppl,
                  "mean_kl": sc.mean_kl, "top1_pct": sc.top1_pct}


# ------------------------------------------------------------------ the order
def parse_stages(text: str) -> tuple:
    """'1,2,3,4' -> (1, 2, 3, 4). Stage 1 is required: every later stage builds on what it checked."""
    try:
        got = sorted({int(x) for x in str(text).split(",") if x.strip()})
    except ValueError:
        raise LowbitError(f"--stages {text!r}: give stage numbers 1-4 separated by commas, e.g. 1,2,3,4") from None
    if not got or any(s not in STAGES for s in got):
        raise LowbitError(f"--stages {text!r}: stages are 1 (cpu-checks), 2 (kernel-audit), 3 (smoke), 4 (accuracy)")
    if got[0] != 1:
        raise LowbitError(f"--stages {text!r}: stage 1 (the CPU checks) is what later stages build on; "
                          f"use --stages 1,{','.join(map(str, got))}")
    return tuple(got)


def check_output(path: str | None) -> None:
    """Refuse an existing report path before any work (a report is never overwritten)."""
    if path is not None:
        p = Path(path)
        if os.path.lexists(p):
            raise LowbitError(f"--json {p} already exists; reports are never overwritten: choose a new path")
        if not p.parent.is_dir():
            raise LowbitError(f"--json {p}: directory {p.parent} does not exist; create it or choose another path")


def _check_flags(root: Path, opts: Options) -> None:
    """A flag that this artifact's kind would ignore is refused (nothing is ignored silently)."""
    try:
        label = KINDS.get(load_manifest(root).kind, (None,))[0]
    except LowbitError:
        return  # a damaged manifest is stage 1's finding, not bad input
    for flag, value, kinds in (("--kv", opts.kv, ("rotations",)), ("--model", opts.model, ("rotations",)),
                               ("--base", opts.base, ("weights", "kv-export"))):
        if value is not None and label is not None and label not in kinds:
            raise LowbitError(f"{flag} is for {' and '.join(kinds)} artifacts but {root} is {label}; drop {flag}")


def validate(opts: Options) -> dict:
    """Run the asked stages in order, stopping at the first failing one. Returns the report (JSON-ready).

    Bad input (no such directory, no manifest.json, an unusable flag) raises LowbitError before any stage;
    a problem with the artifact itself is a failed stage in the report."""
    root = Path(opts.artifact).expanduser()
    sweep_stale(root.resolve().parent)  # killed writers' staging dirs beside it (one stderr line each)
    if root.is_dir() and not (root / "manifest.json").exists():
        sweep_stale(root)  # a parent of artifacts, not one (an artifact is never modified)
    if not root.is_dir():
        raise LowbitError(f"{root} is not a directory: pass an artifact directory (one holding manifest.json)")
    if not (root / "manifest.json").is_file():
        raise LowbitError(f"{root} has no manifest.json, so there is nothing to validate it against: pass a "
                          f"directory written by lowbit (export, quantize, fit-rotations), or `lowbit pin {root}` first")
    if opts.device not in ("cpu", "cuda"):
        raise LowbitError(f"--device {opts.device}: validate runs on cpu or cuda")
    if opts.device == "cuda":
        resolve_device("cuda")  # no CUDA -> one line, before any stage
    if opts.json is not None:  # a killed report write's staging dir (one line each), even if the report exists
        sweep_stale(Path(opts.json).expanduser().resolve().parent)
    check_output(opts.json)
    _check_flags(root, opts)
    ctx = Context(root=root, opts=opts)
    runners = {1: stage_cpu_checks, 2: stage_kernel_audit, 3: stage_smoke, 4: stage_accuracy}
    results, failed = [], None
    for n in opts.stages:
        if n > 1 and ctx.label == "dit":
            break  # skipped below, with DIT_STAGES_WHY
        r = runners[n](ctx)
        results.append(r)
        if not r["ok"]:
            failed = r
            break
    skipped = [{"stage": n, "name": STAGES[n], "why": "not asked" if n not in opts.stages else
                f"stage {failed['stage']} ({failed['name']}) failed" if failed else DIT_STAGES_WHY}
               for n in STAGES if n not in [r["stage"] for r in results]]
    return {
        "format": REPORT_FORMAT, "format_version": REPORT_VERSION, "artifact": str(root), "kind": ctx.label,
        "ok": failed is None, "failed_stage": failed["stage"] if failed else None,
        "error": f"stage {failed['stage']} ({failed['name']}): {failed['error']}" if failed else None,
        "stages": results, "skipped": skipped, "provenance": provenance(ctx),
    }


def write_report(report: dict, path, *, on_point=None) -> Path:
    """Write the report as strict JSON; appears whole or not at all, never over an existing file.

    Staged like an artifact (writer.write_new_file: a flock'ed `.<name>.tmp-<pid>/` beside it, hard-linked
    into place), so a killed write leaves at most a staging dir that the next validate --json into the
    same directory (or any sweep there) removes. `on_point`: test hook (writer.FILE_POINTS)."""
    p = Path(path)
    check_output(str(p))
    text = json.dumps(report, indent=1, allow_nan=False) + "\n"
    try:
        write_new_file(p, text.encode("utf-8"), on_point=on_point)
    except FileExistsError:
        raise LowbitError(f"--json {p} appeared while validating; reports are never overwritten") from None
    return p


def format_report(report: dict) -> str:
    """The table `lowbit validate` prints: one line per stage, then its checks."""
    head = f"validate {report['artifact']} ({report['kind'] or 'unknown kind'}) on {report['provenance']['device']['type']}"
    lines = [head]
    for r in report["stages"]:
        lines.append(f"stage {r['stage']} {r['name']:<13} {'ok' if r['ok'] else 'FAILED':<6} {r['seconds']:7.2f} s")
        for c in r["checks"]:
            lines.append(f"    {'ok  ' if c['ok'] else 'FAIL'} {c['name']}: {c['detail']}")
    for s in report["skipped"]:
        lines.append(f"stage {s['stage']} {s['name']:<13} skipped ({s['why']})")
    lb = report["provenance"]["lowbit"]
    lines.append(f"lowbit {lb['version']} commit {(lb['commit'] or 'none')[:12]}"
                 + (" (tree modified)" if lb.get("modified") else ""))
    if report["ok"]:
        lines.append(f"validate: {report['artifact']}: stages {','.join(str(r['stage']) for r in report['stages'])} passed")
    else:
        lines.append(f"validate: {report['artifact']}: FAILED at {report['error']}")
    return "\n".join(lines)
