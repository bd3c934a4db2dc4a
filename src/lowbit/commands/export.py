"""`lowbit export --for vllm`: a model directory vLLM serves with lowbit's packed KV cache (via the plugin).

    lowbit export --for vllm --model smollm2-135m --kv int4 --out DIR [--rotation DIR] [--weights DIR]

DIR holds: config.json, the tokenizer files (and chat template), the weights -- the model's own
safetensors, or with --weights the compressed-tensors checkpoint from `lowbit quantize` (its
config.json carries quantization_config, which vLLM's own kernels serve) -- plus lowbit_kv.json
(the KV sidecar: scheme, resolved groups, bits per element, sink/recent, the model's geometry),
rotations/ (the RotationSet, when the scheme uses one) and manifest.json (ArtifactWriter:
every file with bytes + sha256, the recipe and the inputs).

The vLLM plugin packs every token as it is written to vLLM's paged cache (page 1) and keeps the
first `--sink` and last `--recent` tokens of each request dense beside it (defaults 64 / 256, as
lowbit's runtime), so the exported scheme has page 1. What the plugin cannot serve (KIVI channel
groups, Lloyd-Max, folded V rotations) is refused here rather than exported; per-layer bits are served
with every cell padded to the widest layer's (the plugin logs the padding).
Sliding-window models (gemma3: window 512 on 5 of 6 layers) export the same way: the sidecar
records each layer's window and the plugin attends, and keeps the exact tiers, inside it only. `lowbit serve DIR` serves the same directory with these exact semantics, which
is how the plugin's tokens are checked against lowbit's own runtime.
"""

from __future__ import annotations

import json
import shutil
from dataclasses import replace
from pathlib import Path

from lowbit.core.errors import LowbitError
from lowbit.models.load import TOKENIZER_FILES, model_dir, model_name

NAME = "export"
HELP = "write a model directory for another engine: --for vllm (config, tokenizer, weights, KV sidecar, manifest)"

TARGETS = ("vllm",)
# What vLLM's loader reads from a model directory (weights matched by suffix below); the tokenizer
# files are lowbit.models' one list.
_COPY_NAMES = ("config.json", "generation_config.json", *TOKENIZER_FILES, "recipe.yaml")
_WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json")


def add_arguments(p) -> None:
    from lowbit.commands.serve import add_kv_flags

    p.add_argument("--for", dest="target", required=True, choices=TARGETS, help="engine the directory is for")
    p.add_argument("--model", required=True, help="built-in name (smollm2-135m, gemma3-270m) or a local HF model dir")
    add_kv_flags(p)
    p.add_argument("--weights", default=None, metavar="DIR",
                   help="compressed-tensors checkpoint from `lowbit quantize` to ship instead of the model's weights")
    p.add_argument("--out", required=True, help="new directory to write (never overwritten)")


def vllm_scheme(scheme):
    """The scheme the vLLM plugin serves: every token packed on write (page 1), dense sink and recent tiers.

    Refuses what the plugin does not implement (named), instead of exporting a sidecar it would
    serve differently."""
    from lowbit.vllm_plugin.slot import scheme_reason

    reason = scheme_reason(scheme)
    if reason:
        raise LowbitError(reason)
    return replace(scheme, page=1)


def run(args) -> int:
    from lowbit.artifacts import ArtifactWriter, sha256_file
    from lowbit.commands.serve import kv_scheme_from_args
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin import sidecar

    if args.kv is None and getattr(args, "recipe", None) is None:
        raise LowbitError("--kv SCHEME (or --recipe FILE) is required: the sidecar says how vLLM holds the KV cache")
    if getattr(args, "recipe", None) is None and getattr(args, "page", None) not in (None, 1):
        raise LowbitError(f"--page {args.page}: the vLLM plugin packs every token on write (page 1); drop --page")
    scheme = kv_scheme_from_args(args)
    if scheme is None:
        scheme = parse_kv_scheme(args.kv)
    scheme = vllm_scheme(scheme)
    try:
        src = model_dir(args.model)  # a built-in's converted cache dir, or the local HF dir
    except LowbitError as e:
        raise LowbitError(f"--model: {e}") from None
    wdir = None
    if args.weights is not None:
        wdir = Path(args.weights).expanduser()
        cfg = wdir / "config.json"
        if not cfg.is_file() or "quantization_config" not in json.loads(cfg.read_text()):
            raise LowbitError(f"--weights {args.weights}: no config.json with quantization_config; "
                              "pass a checkpoint written by `lowbit quantize`")
    config_dir = wdir or src
    config = json.loads((config_dir / "config.json").read_text())
    # the name RotationSets are checked against (lowbit.models names a local dir by its folder name)
    name = model_name(args.model)
    geometry = ModelGeometry.from_config(config, name=name)
    # group, rotation file + shapes, attention kinds, the plugin's rules: refuse before writing anything
    from lowbit import backends
    from lowbit.kv.plan import resolve
    from lowbit.vllm_plugin import slot as _slot  # noqa: F401 (registers the vllm-slot backend)

    plan = resolve(scheme, geometry, device="cpu")
    slot = backends.get("vllm-slot")
    for lp in plan.layers:
        reason = slot.why_not(lp, "paged", "cpu")
        if reason:
            raise LowbitError(f"layer {lp.index}: {reason}")
    scheme = plan.scheme  # the rotation pinned by its sha256
    if wdir is not None:
        base = ModelGeometry.from_config(json.loads((src / "config.json").read_text()))
        if [g for g in base.layers] != [replace(g) for g in geometry.layers]:
            raise LowbitError(f"--weights {wdir} was made for another model than {args.model} (geometry differs)")

    out = Path(args.out)
    rotation_rel = None
    inputs = {"model": args.model, "model_dir": str(src), "target": args.target}
    with ArtifactWriter(out, kind="vllm-model", artifact_class="native-packed", inputs=inputs,
                        recipe={"kv": None}) as w:
        copied = []
        for d, names in ((src, _COPY_NAMES), (wdir, _COPY_NAMES) if wdir else (None, ())):
            if d is None:
                continue
            for f in sorted(d.iterdir()):
                is_weight = f.name.endswith(_WEIGHT_SUFFIXES)
                if d is src and wdir is not None and (is_weight or f.name == "config.json"):
                    continue  # the checkpoint's weights and config replace the model's
                if d is wdir and f.name in TOKENIZER_FILES and (w.path / f.name).exists():
                    (w.path / f.name).unlink()  # the checkpoint's tokenizer wins
                if f.is_file() and (f.name in names or is_weight):
                    shutil.copyfile(f, w.path / f.name)
                    copied.append(f.name)
        weights = sorted(p for p in copied if p.endswith(".safetensors"))
        if not weights:
            raise LowbitError(f"{config_dir} has no *.safetensors weights; vLLM needs safetensors")
        if scheme.rotation not in ("none", "hadamard"):
            rs_src = Path(scheme.rotation.path)
            shutil.copytree(rs_src, w.path / sidecar.ROTATION_DIR)
            rotation_rel = sidecar.ROTATION_DIR
        wsha = sha256_file(w.path / weights[0]) if len(weights) == 1 else None
        side = sidecar.build(scheme, geometry, model_name=name, weights_sha256=wsha, rotation_rel=rotation_rel)
        sidecar.write(w.path, side)
        w.inputs = {**inputs, "weights_sha256": wsha, "weights": str(wdir) if wdir else None,
                    "rotation": scheme.rotation.path if rotation_rel else None}
        w.recipe = {"kv": side["kv_scheme"], "weights": config.get("quantization_config")}
        w.counts = {"layers": geometry.num_layers, "files": len(copied) + 1, "weight_files": len(weights),
                    "quantized_kv_layers": geometry.num_layers if scheme.quantized else 0}
    k_bpe = side["resolved"]["k"]["bits_per_element"]
    print(f"wrote {out}: {geometry.num_layers} layers, KV {scheme.describe()}, K bits/elt {k_bpe}, "
          f"weights {'compressed-tensors ' + str(wdir) if wdir else 'unquantized'}")
    print(f"serve with: vllm serve {out} (lowbit plugin installed), or: lowbit serve --model {out}")
    return 0
