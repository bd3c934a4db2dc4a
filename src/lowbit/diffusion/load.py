"""lowbit's loader for diffusers directories, quantized or not.

    pipe = load_pipeline(dir)            # DigitsDiTPipeline; quantized components hold QuantLinear modules

A directory written by `lowbit quantize --component C` (or `lowbit train-dit`) is a lowbit artifact: its
manifest is checked first (every file's sha256; a damaged file is one LowbitError naming it). A
component whose config.json carries a compressed-tensors `quantization_config` is built from its
config and every linear with `PREFIX.weight_scale` in the safetensors becomes a QuantLinear (the same
tensor reader as lowbit.weights.load, so LM and DiT checkpoints share one format and one decoder);
every other component loads with diffusers' own from_pretrained. A directory whose components are
quantized must be a native-packed artifact: anything else (no manifest, another class) is refused; one
that lowbit wrote (its header marker, as lowbit.weights.export) but whose manifest.json was lost is named so.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from lowbit.artifacts import load_manifest, require_intact
from lowbit.core.errors import LowbitError
from lowbit.weights.qlinear import QuantLinear

WEIGHTS_NAME = "diffusion_pytorch_model.safetensors"


def pipeline_components(path: Path) -> dict[str, tuple[str, str]]:
    """model_index.json's components: name -> (library, class); LowbitError if it is not a diffusers dir."""
    idx = path / "model_index.json"
    if not idx.is_file():
        raise LowbitError(f"{path} has no model_index.json: pass a diffusers pipeline directory "
                          "(e.g. one written by `lowbit train-dit`)")
    try:
        d = json.loads(idx.read_text())
    except (OSError, ValueError) as e:
        raise LowbitError(f"{idx} is not readable JSON ({e}); copy the pipeline again") from None
    return {k: tuple(v) for k, v in d.items()
            if not k.startswith("_") and isinstance(v, list) and len(v) == 2 and v[0] is not None}


def is_quantized_component(path: Path) -> bool:
    cfg = path / "config.json"
    if not cfg.is_file():
        return False
    try:
        return bool(json.loads(cfg.read_text()).get("quantization_config"))
    except (OSError, ValueError, AttributeError) as e:  # AttributeError: JSON that is not an object
        raise LowbitError(f"{cfg} is not a readable JSON object ({' '.join(str(e).split())}); copy the "
                          "pipeline again") from None


def quantized_components(path: Path) -> list[str]:
    return [c for c in pipeline_components(path) if is_quantized_component(path / c)]


def lowbit_marker(path: Path) -> tuple[str, str] | None:
    """(file, kind) of the first component safetensors whose header lowbit marked (MARKER_KEY), else None."""
    from safetensors import SafetensorError, safe_open

    from lowbit.weights.export import MARKER_KEY

    for f in sorted(path.glob("*/*.safetensors")):
        try:
            with safe_open(str(f), framework="pt") as st:
                kind = (st.metadata() or {}).get(MARKER_KEY)
        except (SafetensorError, OSError):
            continue  # unreadable: the tensor reader names it
        if kind:
            return f.relative_to(path).as_posix(), kind
    return None


def check_artifact(path: Path, *, need_native: bool) -> str | None:
    """Verify the manifest (if any) and return its class. need_native: refuse anything but native-packed."""
    return require_native(path, verified_class(path)) if need_native else verified_class(path)


def verified_class(path: Path) -> str | None:
    """Every file's sha256 against the manifest (a damaged file is one LowbitError naming it); its class.
    None: no manifest.json."""
    if not (path / "manifest.json").is_file():
        return None
    require_intact(path, "diffusers checkpoint")
    return load_manifest(path).artifact_class


def require_native(path: Path, cls: str | None) -> str:
    """A quantized pipeline must be a native-packed lowbit artifact (cls: verified_class's answer)."""
    if cls is None:
        mark = lowbit_marker(path)
        if mark:  # lowbit wrote it (quantize marks the header) and the manifest was lost: nothing vouches for it
            raise LowbitError(f"{path} was written by lowbit ({mark[0]}: {mark[1]}) but its manifest.json is "
                              "missing, so its files cannot be verified: copy the checkpoint again with "
                              "manifest.json, or re-run `lowbit quantize --component ...`")
        raise LowbitError(f"{path} has quantized components but no manifest.json: not a lowbit native-packed "
                          "checkpoint; write it with `lowbit quantize --component ...`")
    if cls != "native-packed":
        raise LowbitError(f"{path}: manifest class is {cls!r}, not 'native-packed'; quantized pipelines are "
                          "native-packed artifacts written by `lowbit quantize --component ...`")
    return cls


def load_quantized_transformer(comp_dir: Path, *, dtype: torch.dtype | None = None):
    """A diffusers model (DiTTransformer2DModel, ...) from a compressed-tensors component directory."""
    import diffusers

    from lowbit.weights.load import _load_rest, _read_safetensors, install_quantlinears, scheme_from_ct

    raw = json.loads((comp_dir / "config.json").read_text())
    scheme = scheme_from_ct(raw["quantization_config"])
    cls = getattr(diffusers, raw.get("_class_name", ""), None)
    if cls is None:
        raise LowbitError(f"{comp_dir}/config.json names class {raw.get('_class_name')!r}, which diffusers lacks")
    files = sorted(comp_dir.glob("*.safetensors"))
    if not files:
        raise LowbitError(f"{comp_dir} holds no .safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_read_safetensors(f))
    cfg = {k: v for k, v in raw.items() if k != "quantization_config"}
    model = cls.from_config(cfg)
    install_quantlinears(model, sd, scheme, comp_dir)
    _load_rest(model, sd, comp_dir)
    if dtype is not None:  # the float tensors outside QuantLinear; codes and scales stay as the checkpoint has them

        for mod in model.modules():
            if isinstance(mod, QuantLinear):
                continue
            for k, t in list(mod._parameters.items()) + list(mod._buffers.items()):
                if t is not None and t.is_floating_point() and k in mod._parameters:
                    t.data = t.data.to(dtype)
                elif t is not None and t.is_floating_point():
                    mod._buffers[k] = t.to(dtype)
    return model.eval()


def load_pipeline(path, *, device: str | torch.device = "cpu", dtype: torch.dtype | None = None,
                  weight_kernel: str = "auto"):
    """The DigitsDiTPipeline of a diffusers directory (see module docstring), on `device`, eval mode.

    On CUDA a quantized transformer is handed to lowbit.kernels.gemm.prepare.prepare_cuda(kernel=weight_kernel)
    (the weight kernels' dispatch, self-checked against the torch twin); on the CPU QuantLinear runs its
    torch forward. `pipe.lowbit_backend` says which ran: "fp" (nothing quantized), "torch-twin (cpu)",
    or prepare_cuda's report."""
    import diffusers

    from lowbit.diffusion.pipeline import DigitsDiTPipeline

    path = Path(path)
    cls = verified_class(path)  # digests before any file is parsed: a damaged one is named, not mis-parsed
    comps = pipeline_components(path)
    quantized = [c for c in comps if is_quantized_component(path / c)]
    if quantized:
        require_native(path, cls)
    missing = {"transformer", "scheduler"} - set(comps)
    if missing:
        raise LowbitError(f"{path}/model_index.json lacks component(s) {', '.join(sorted(missing))}")
    parts = {}
    for name, (lib, cls_name) in comps.items():
        if name in quantized:
            parts[name] = load_quantized_transformer(path / name, dtype=dtype)
            continue
        cls = getattr(diffusers, cls_name, None)
        if lib != "diffusers" or cls is None:
            raise LowbitError(f"{path}: component {name} is {lib}.{cls_name}; lowbit loads diffusers classes only")
        kw = {"torch_dtype": dtype} if dtype is not None and issubclass(cls, diffusers.ModelMixin) else {}
        parts[name] = cls.from_pretrained(path, subfolder=name, **kw)
    pipe = DigitsDiTPipeline(transformer=parts["transformer"], scheduler=parts["scheduler"])
    pipe.transformer.to(device).eval()
    pipe.lowbit_backend = "fp" if not quantized else "torch-twin (cpu)"
    if quantized and torch.device(device).type == "cuda":
        from lowbit.kernels.gemm.prepare import prepare_cuda

        rep = prepare_cuda(pipe.transformer, kernel=weight_kernel)
        pipe.lowbit_backend = {k: (v if isinstance(v, (int, float, str, list, dict)) or v is None else str(v))
                               for k, v in rep.items()}
    return pipe
