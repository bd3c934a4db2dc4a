"""Load what `lowbit serve` serves: model + tokenizer + KV scheme (+ quantized weights).

MODEL_OR_ARTIFACT is a built-in name (smollm2-135m), a Hugging Face model directory, or a
directory written by `lowbit export --for vllm` (it carries lowbit_kv.json, the KV sidecar,
whose scheme is used unless --kv is given; the sidecar is checked against the model). A
directory whose config.json has a `quantization_config` (a compressed-tensors checkpoint from
`lowbit quantize`) and `--weights DIR` are loaded by lowbit.runtime.load.resolve, through lowbit.weights.load_quantized.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from lowbit.artifacts import load_manifest, require_intact
from lowbit.core.errors import LowbitError
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models import load_tokenizer
from lowbit.models.geometry import ModelGeometry
from lowbit.models.random import GEOMETRIES, build_model, word_tokenizer
from lowbit.vllm_plugin import sidecar

log = logging.getLogger("lowbit.serve")


@dataclass
class Runtime:
    model: object
    tokenizer: object
    geometry: object
    name: str
    scheme: object  # KVScheme
    weights: dict | None  # what weight quantization is served (None: the model's own weights)
    max_context: int
    eos_token_ids: list[int]


def _eos_ids(model, tokenizer) -> list[int]:
    ids = set()
    for src in (getattr(model, "generation_config", None), getattr(model, "config", None)):
        e = getattr(src, "eos_token_id", None)
        if isinstance(e, int):
            ids.add(e)
        elif isinstance(e, (list, tuple)):
            ids.update(int(x) for x in e)
    if tokenizer is not None and getattr(tokenizer, "eos_token_id", None) is not None:
        ids.add(int(tokenizer.eos_token_id))
    return sorted(ids)


RANDOM_PREFIX = "random:"


def _random_model(spec: str, dtype, device):
    """(model, geometry, tokenizer) for `random:GEOMETRY`: the random-weight model `lowbit bench decode`
    builds (lowbit.models.random, seed 0), built on `device`, with a word tokenizer ("t123" per id)."""
    geo = spec[len(RANDOM_PREFIX):]
    if geo not in GEOMETRIES:
        raise LowbitError(f"--model {spec}: unknown geometry {geo!r}; use random:{' or random:'.join(GEOMETRIES)}")
    try:
        model, cfg = build_model(geo, str(device), dtype=dtype)
    except torch.OutOfMemoryError:
        raise LowbitError(f"--model {spec} does not fit in {device} memory; use a smaller geometry") from None
    return model, ModelGeometry.from_config(cfg, name=f"random-{geo}"), word_tokenizer(cfg.vocab_size)


def load_runtime(model_or_artifact: str, *, kv=None, weights: str | None = None, dtype=torch.float32,
                 max_context: int | None = None, name: str | None = None, device=None) -> Runtime:
    """kv: a KVScheme, or None (the artifact's sidecar, else bf16). device: where the model runs (None: CPU).

    `random:GEOMETRY` (e.g. random:llama3-8b) serves a random-weight model of that geometry with a word
    tokenizer and no EOS (every request runs to max_tokens): for load tests, not for text."""
    from lowbit.runtime.load import resolve
    if str(model_or_artifact).startswith(RANDOM_PREFIX):
        if weights is not None:
            raise LowbitError(f"--weights cannot be combined with --model {model_or_artifact} (random weights)")
        model, geometry, tok = _random_model(str(model_or_artifact), dtype, device or "cpu")
        return _finish(model, tok, geometry, name or str(model_or_artifact), kv or parse_kv_scheme("bf16"), None,
                       max_context, eos=[])
    src = Path(model_or_artifact).expanduser()
    if src.is_dir() and (sidecar.has_sidecar(src) or (src / "manifest.json").is_file()):
        if not (src / "manifest.json").is_file():
            raise LowbitError(f"{src} has {sidecar.SIDECAR_NAME} but no manifest.json: the export is incomplete "
                              "or damaged; export it again with `lowbit export --for vllm`")
        if sidecar.has_sidecar(src) or load_manifest(src).kind == "vllm-model":
            require_intact(src, "export")  # a changed, missing or added file is named before any is read
    side = sidecar.read(src) if src.is_dir() and sidecar.has_sidecar(src) else None
    if weights is not None:
        wdir = Path(weights).expanduser()
        if not wdir.is_dir():
            raise LowbitError(f"--weights {weights}: not a directory; pass a checkpoint written by `lowbit quantize`")
        loaded = resolve(wdir, dtype=dtype, device=device)
        if loaded.provenance.get("source") != "quantized-checkpoint":
            raise LowbitError(f"--weights {weights}: its config.json has no quantization_config; "
                              "pass a checkpoint written by `lowbit quantize`")
        tok = loaded.tokenizer or load_tokenizer(model_or_artifact)
        if tok is None:
            tok = resolve(model_or_artifact, dtype=dtype).tokenizer
    else:
        loaded = resolve(model_or_artifact, dtype=dtype, device=device)  # a quantized checkpoint: lowbit.weights
        tok = loaded.tokenizer
    model, geometry, served_name = loaded.model, loaded.geometry, name or loaded.name
    weights_info = None
    if loaded.provenance.get("source") == "quantized-checkpoint":
        weights_info = {"path": loaded.provenance["path"], "quantization_config": loaded.provenance["quantization_config"]}
        # quantized weights are served under the model's name (the folder or built-in given first)
        served_name = name or (src.name if src.is_dir() else str(model_or_artifact))
        geometry = replace(geometry, name=name or src.name)
    if tok is None:
        raise LowbitError(f"{model_or_artifact} has no tokenizer files; serve a model directory that includes them")
    if side is not None:
        sidecar.check_against(side, geometry)
        # a RotationSet in the sidecar was fitted for the model the export names, not this folder
        geometry = replace(geometry, name=side["model"]["name"])
        side_scheme = sidecar.scheme_of(side, src)
        if kv is None:
            kv = side_scheme
        elif kv != side_scheme:
            log.warning("--kv %s overrides the artifact's sidecar scheme %s", kv.name, side_scheme.name)
    if kv is None:
        kv = parse_kv_scheme("bf16")
    return _finish(model, tok, geometry, served_name, kv, weights_info, max_context)


def _finish(model, tok, geometry, served_name, kv, weights_info, max_context, eos=None) -> Runtime:
    """The Runtime, with max_context checked against the model's positions (eos None: the model's own)."""
    ctx = int(getattr(model.config, "max_position_embeddings", 0) or 0) or 2048
    if max_context is not None:
        if max_context < 2:
            raise LowbitError(f"--max-context {max_context} is too small; give at least 2 tokens")
        if max_context > ctx:
            raise LowbitError(f"--max-context {max_context} exceeds the model's {ctx} positions; use at most {ctx}")
        ctx = max_context
    model.eval()
    return Runtime(model=model, tokenizer=tok, geometry=geometry, name=served_name, scheme=kv,
                   weights=weights_info, max_context=ctx, eos_token_ids=_eos_ids(model, tok) if eos is None else eos)
