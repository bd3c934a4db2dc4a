"""lowbit's own loader for compressed-tensors checkpoints: QuantLinear modules, no decompression.

    model, tokenizer = load_quantized(dir)

Reads config.json's quantization_config (one config group targeting Linear, the schemes lowbit
writes -- and llm-compressor's W4A16 / W8A16 / W8A8 int checkpoints of the same shape), builds
the model from its config, puts a QuantLinear wherever the safetensors hold `PREFIX.weight_scale`,
and loads every other tensor as is. A lowbit artifact (manifest.json) is verified first: a file
whose sha256 does not match is refused, and so is a lowbit checkpoint that lost its manifest.json
(export.MARKER_KEY in its safetensors header says lowbit wrote it).

transformers can load the same directory on its own (compressed-tensors decompresses it):
    AutoModelForCausalLM.from_pretrained(dir)                       # w4a16 (symmetric), w8a16, w8a8, w4a8
    AutoModelForCausalLM.from_pretrained(dir, quantization_config=CompressedTensorsConfig(dequantize=True))
The `dequantize=True` form (transformers 5.24; `run_compressed=False` is its deprecated spelling)
is the one that loads asymmetric W4 (`-asym`, packed weight_zero_point) on transformers 5.24: its
plain load reports weight_zero_point MISMATCH and raises, for llm-compressor's checkpoints too (an
upstream bug; transformers 5.17 loads it plainly). See lowbit.weights.scheme.

A damaged directory is one LowbitError naming the bad file: a file that no longer matches the
manifest, or (no manifest) a safetensors file that cannot be read (truncated, not safetensors).
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn

from lowbit.artifacts import all_ok, verify
from lowbit.artifacts.verify import OK
from lowbit.core.errors import LowbitError
from lowbit.models.auto import causal_lm_class
from lowbit.weights.export import MARKER_KEY
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import WeightScheme

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def scheme_from_ct(qc: dict) -> WeightScheme:
    """The WeightScheme of a compressed-tensors quantization_config dict (one Linear group)."""
    if qc.get("quant_method") != "compressed-tensors":
        raise LowbitError(f"quantization_config.quant_method is {qc.get('quant_method')!r}, not compressed-tensors")
    groups = qc.get("config_groups") or {}
    if len(groups) != 1:
        raise LowbitError(f"lowbit loads checkpoints with one quantization config group, found {len(groups)}")
    g = next(iter(groups.values()))
    w, a = g.get("weights") or {}, g.get("input_activations")
    if w.get("type") != "int" or w.get("num_bits") not in (4, 8):
        raise LowbitError(f"unsupported weight quantization {w.get('type')}{w.get('num_bits')}; lowbit loads int4/int8")
    if w.get("actorder") not in (None, "static", "weight") or w.get("strategy") not in ("group", "channel"):
        raise LowbitError(f"unsupported weight layout (strategy {w.get('strategy')}, actorder {w.get('actorder')})")
    group = w.get("group_size") if w["strategy"] == "group" else None
    a_bits = 16
    if a is not None:
        if not (a.get("type") == "int" and a.get("num_bits") == 8 and a.get("dynamic") in (True, "local")
                and a.get("strategy") == "token" and a.get("symmetric", True)):
            raise LowbitError("unsupported activation quantization; lowbit runs dynamic per-token int8 only")
        a_bits = 8
    bits, sym = int(w["num_bits"]), bool(w.get("symmetric", True))
    name = f"w{bits}a{a_bits}" + (f"-g{group}" if group else "") + ("" if sym else "-asym")  # parse_weight_scheme's names
    return WeightScheme(name, bits, group, sym, a_bits)


def _quantlinear(prefix: str, sd: dict, scheme: WeightScheme) -> QuantLinear:
    from compressed_tensors.compressors.pack_quantized.helpers import unpack_from_int32

    b = scheme.w_bits
    scale = sd.pop(f"{prefix}.weight_scale")
    if f"{prefix}.weight_packed" in sd:
        shape = [int(x) for x in sd.pop(f"{prefix}.weight_shape")]
        q = unpack_from_int32(sd.pop(f"{prefix}.weight_packed"), b, torch.Size(shape))
    else:
        q = sd.pop(f"{prefix}.weight")
        shape = list(q.shape)
    if q.dtype != torch.int8:
        raise LowbitError(f"{prefix}: expected int8 codes, found {q.dtype}")
    out, n = shape
    if scale.dim() == 1:
        scale = scale.unsqueeze(1)
    zp = sd.pop(f"{prefix}.weight_zero_point", None)
    if zp is not None and zp.dtype == torch.int32 and not scheme.symmetric:
        zp = unpack_from_int32(zp, b, torch.Size([out, scale.shape[1]]), packed_dim=0)
    bias = sd.pop(f"{prefix}.bias", None)
    m = QuantLinear(n, out, scheme, bias=bias is not None, scale_dtype=scale.dtype)
    if tuple(scale.shape) != tuple(m.scale.shape):
        raise LowbitError(f"{prefix}: weight_scale shape {tuple(scale.shape)} does not fit scheme {scheme.name}")
    m.codes.copy_((q.to(torch.int16) + (1 << (b - 1))).to(torch.uint8))
    m.scale.copy_(scale)
    if zp is not None:
        m.zero_point.copy_(zp.reshape(out, -1).to(torch.int8))
    if bias is not None:
        m.bias.copy_(bias)
    return m


def _verify_artifact(path: Path) -> None:
    if not (path / "manifest.json").is_file():
        # A plain compressed-tensors dir (e.g. from llm-compressor): nothing to verify. Unless lowbit wrote it
        # (export marks its safetensors header): then manifest.json was lost and nothing vouches for the files.
        from safetensors import SafetensorError, safe_open

        for f in sorted(path.glob("*.safetensors")):
            try:
                with safe_open(str(f), framework="pt") as st:
                    kind = (st.metadata() or {}).get(MARKER_KEY)
            except (SafetensorError, OSError):
                continue  # unreadable: _read_safetensors names it
            if kind:
                raise LowbitError(f"{path} was written by lowbit ({f.name}: {kind}) but its manifest.json is "
                                  "missing, so its files cannot be verified: copy the checkpoint again with "
                                  "manifest.json, or re-run `lowbit quantize`")
        return
    status = verify(path)
    if not all_ok(status):
        bad = [f"{s.path} {s.status}" for s in status if s.status != OK]  # the files that failed, not the good ones
        more = f" and {len(bad) - 3} more" if len(bad) > 3 else ""
        raise LowbitError(f"{path} does not match its manifest ({', '.join(bad[:3])}{more}): the checkpoint is "
                          "corrupt; re-run `lowbit quantize` or copy it again")


def _read_safetensors(f: Path) -> dict[str, torch.Tensor]:
    """load_file, with an unreadable file (truncated, not safetensors) as one LowbitError naming it."""
    from safetensors import SafetensorError

    try:
        return load_file(str(f))
    except (SafetensorError, OSError) as e:
        why = " ".join(str(e).split()) or type(e).__name__  # one line
        raise LowbitError(f"{f} is not a readable safetensors file ({why}): the checkpoint is truncated or "
                          "corrupt; re-run `lowbit quantize` or copy it again") from None


def load_quantized(path, *, dtype: torch.dtype | None = None) -> tuple[nn.Module, object]:
    """(model with QuantLinear modules, eval mode; tokenizer or None) from a compressed-tensors dir.

    dtype: of the non-quantized tensors (default: the checkpoint's).
    """
    from transformers import AutoConfig, AutoTokenizer

    path = Path(path)
    if not (path / "config.json").is_file():
        raise LowbitError(f"{path} has no config.json: pass a directory written by `lowbit quantize`")
    _verify_artifact(path)
    raw = json.loads((path / "config.json").read_text())
    qc = raw.get("quantization_config")
    if not qc:
        raise LowbitError(f"{path}/config.json has no quantization_config: not a quantized checkpoint")
    scheme = scheme_from_ct(qc)
    files = sorted(path.glob("*.safetensors"))
    if not files:
        raise LowbitError(f"{path} holds no .safetensors files")
    sd: dict[str, torch.Tensor] = {}
    for f in files:
        sd.update(_read_safetensors(f))

    config = AutoConfig.from_pretrained(path)
    if hasattr(config, "quantization_config"):
        del config.quantization_config  # we build the quantized modules ourselves
    dt = dtype or _DTYPES.get(str(raw.get("dtype") or raw.get("torch_dtype")), torch.float32)

    model = causal_lm_class(config).from_config(config, dtype=dt, attn_implementation="sdpa")
    install_quantlinears(model, sd, scheme, path)
    _load_rest(model, sd, path)
    model.eval()
    tok = AutoTokenizer.from_pretrained(path) if (path / "tokenizer_config.json").is_file() else None
    return model, tok


def install_quantlinears(model: nn.Module, sd: dict, scheme: WeightScheme, path: Path) -> None:
    """Replace every nn.Linear whose PREFIX.weight_scale is in `sd` by a QuantLinear built from (and
    popping) its tensors; `path` names the checkpoint in errors."""
    prefixes = [k[: -len(".weight_scale")] for k in list(sd) if k.endswith(".weight_scale")]
    if not prefixes:
        raise LowbitError(f"{path}: no quantized tensors (*.weight_scale) in the safetensors")
    for prefix in prefixes:
        try:
            old = model.get_submodule(prefix)
        except AttributeError:
            raise LowbitError(f"{path}: tensor {prefix}.weight_scale has no module {prefix} in the model") from None
        if not isinstance(old, nn.Linear):
            raise LowbitError(f"{path}: {prefix} is a {type(old).__name__}, not a Linear")
        parent, _, child = prefix.rpartition(".")
        setattr(model.get_submodule(parent) if parent else model, child, _quantlinear(prefix, sd, scheme))


def _load_rest(model: nn.Module, sd: dict, path: Path) -> None:
    """Load the non-quantized tensors; every model tensor must be covered (tied ones by their twin)."""
    qnames = tuple(n + "." for n in _qlinear_names(model))
    own = {k: v for k, v in model.state_dict(keep_vars=True).items() if not k.startswith(qnames)}
    unexpected = sorted(set(sd) - set(own))
    if unexpected:
        raise LowbitError(f"{path}: tensors with no place in the model: {', '.join(unexpected[:3])}")
    loaded_ids = set()
    with torch.no_grad():
        for k, t in sd.items():
            dst = own[k]
            if tuple(dst.shape) != tuple(t.shape):
                raise LowbitError(f"{path}: {k} has shape {tuple(t.shape)}, the model expects {tuple(dst.shape)}")
            dst.copy_(t)
            loaded_ids.add(id(dst))
    missing = sorted(k for k, v in own.items() if id(v) not in loaded_ids)
    if missing:
        raise LowbitError(f"{path}: tensors missing from the checkpoint: {', '.join(missing[:3])}")


def _qlinear_names(model: nn.Module) -> list[str]:
    return [n for n, m in model.named_modules() if isinstance(m, QuantLinear)]
