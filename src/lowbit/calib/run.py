"""Calibration: post-RoPE Q/K/V sufficient statistics per layer and KV head -> a calibration artifact.

    counts = calibrate(lowbit.models.resolve("smollm2-135m"), "stdlib", text, Path("calib"),
                       tokens=32768, seq_len=1024, skip=64)
    col = collect(model, windows[N, T])          # StatsCollector, every attention layer checked
    write_calibration(col, out, geometry, inputs, tokens=N*T, seq_len=T)

`lowbit calibrate` parses its flags and calls calibrate(); tests and other tools call collect() /
write_calibration() directly.
"""

from __future__ import annotations

import hashlib
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING

from lowbit.artifacts import ArtifactWriter, load_manifest
from lowbit.core.errors import LowbitError
from lowbit.core.progress import bar
from lowbit.models.geometry import ModelGeometry

if TYPE_CHECKING:
    import torch
# torch is imported where it runs: `lowbit calibrate`'s parser reads this module's defaults

DEFAULT_TOKENS = 32768
DEFAULT_SEQ_LEN = 1024
DEFAULT_SKIP = 64
# A D x D covariance needs well over D samples to be estimated; fewer than this many tokens per
# layer (after the skipped sink positions) is refused rather than fitted into a noisy rotation.
MIN_TOKENS_PER_DIM = 8


def min_tokens(geometry_dims: list[int], seq_len: int, skip: int) -> int:
    """Smallest --tokens accepted: MIN_TOKENS_PER_DIM x the widest head_dim after skipping the sink positions."""
    need_stats = MIN_TOKENS_PER_DIM * max(geometry_dims)
    per_seq = seq_len - skip
    n_seq = -(-need_stats // per_seq)
    return n_seq * seq_len


def check_tokens_arg(tokens: int, seq_len: int) -> int:
    """Number of sequences for --tokens/--seq-len; the tokens must fill whole sequences."""
    if seq_len < 1 or tokens < 1 or tokens % seq_len:
        raise LowbitError(f"--tokens {tokens} is not a positive multiple of --seq-len {seq_len}: "
                          f"pick e.g. {max(1, tokens // max(seq_len, 1)) * seq_len}")
    return tokens // seq_len


def collect(model, windows: torch.Tensor, *, skip: int = DEFAULT_SKIP, score_weighted: bool = True, sample_per_seq: int = 16,
            progress=None, geometry=None):
    """Feed windows [N, T] (one sequence per forward, no cache) through `model` under the capture.

    geometry: the cache geometry the statistics are for (default: ModelGeometry.from_config(model.config));
    layers it stores as an MLA latent report the latent (lowbit.calib.mla), the rest post-RoPE K/V.
    Returns the StatsCollector. Raises LowbitError unless every attention layer saw N*T tokens.
    """
    import torch

    from lowbit.calib.capture import attention_layers, capture_attention
    from lowbit.calib.mla import latent_capture, latent_layers
    from lowbit.calib.stats import StatsCollector
    geometry = geometry if geometry is not None else ModelGeometry.from_config(model.config)
    layers = [m.layer_idx for m in attention_layers(model)]
    col = StatsCollector(skip=skip, sample_per_seq=sample_per_seq, score_weighted=score_weighted)
    with (torch.no_grad(), latent_capture(model, col, latent_layers(geometry)) as observer,
          capture_attention(model, observer)):
        for n, w in enumerate(windows):
            # logits_to_keep=1: the lm_head over every position is wasted work for calibration
            model(w[None], use_cache=False, logits_to_keep=1)
            if progress:
                progress(n + 1, len(windows))
    col.check_tokens(layers, windows.numel())
    return col


def _collect_text(loaded, data_spec: str, text: str, *, tokens: int, seq_len: int, skip: int, score_weighted: bool,
                  sample_per_seq: int, progress: bool | None):
    """Tokenize `text` into windows and collect them with `loaded.model` -> (collector, seconds)."""
    geo = loaded.geometry
    if seq_len <= skip:
        raise LowbitError(f"--seq-len {seq_len} must exceed --skip {skip}")
    dims = [max(lg.head_dim_k, lg.head_dim_v) for lg in geo.layers]
    need = min_tokens(dims, seq_len, skip)
    if tokens < need:
        raise LowbitError(
            f"too few calibration tokens: {tokens} gives fewer than {MIN_TOKENS_PER_DIM} x head_dim ({max(dims)}) "
            f"statistics tokens per layer after skipping {skip} per sequence; use --tokens {need} or more"
        )
    from lowbit.calib.corpora import token_windows

    try:
        windows = token_windows(loaded.tokenizer, text, seq_len, check_tokens_arg(tokens, seq_len))
    except LowbitError as e:
        raise LowbitError(f"calibration data {data_spec}: {e}") from None
    t0 = time.time()

    pb = bar(len(windows), "calibrate", "seq", progress)

    def step(n, total):
        if pb.enabled:
            pb.update(1)
        elif n == total or n % max(1, total // 8) == 0:
            print(f"  {n}/{total} sequences, {time.time() - t0:.0f} s", file=sys.stderr, flush=True)

    with pb:
        col = collect(loaded.model, windows, skip=skip, score_weighted=score_weighted, sample_per_seq=sample_per_seq,
                      progress=step, geometry=geo)
    return col, time.time() - t0


def _inputs(loaded, data_spec: str, text: str) -> dict:
    return {"model": loaded.name, "weights_sha256": loaded.weights_sha256, "data": data_spec,
            "data_sha256": hashlib.sha256(text.encode()).hexdigest()}


def calibrate(loaded, data_spec: str, text: str, out: Path, *, tokens: int, seq_len: int, skip: int,
              score_weighted: bool = True, progress: bool | None = None) -> dict:
    """Tokenize `text`, collect statistics with `loaded.model`, write the artifact. Returns counts.
    progress: a bar over sequences with ETA (None: when stderr is a terminal; else a line per 1/8)."""
    col, seconds = _collect_text(loaded, data_spec, text, tokens=tokens, seq_len=seq_len, skip=skip,
                                 score_weighted=score_weighted, sample_per_seq=16, progress=progress)
    counts = write_calibration(col, out, loaded.geometry, _inputs(loaded, data_spec, text), tokens=tokens, seq_len=seq_len)
    return {**counts, "seconds": round(seconds, 1)}


def calibrate_vq(loaded, data_spec: str, text: str, out: Path, scheme, recipe_name: str, *, tokens: int, seq_len: int,
                 skip: int, progress: bool | None = None) -> dict:
    """Fit the VQ codebooks of `scheme` (lowbit.calib.vq) on `text` and write them as a levels artifact (kind
    "kv-levels", the recipe's `levels`). Returns counts with the sha256 a recipe pins."""
    from lowbit.calib.vq import VQ_SAMPLE_PER_SEQ, fit_codebooks, vq_tensors
    from lowbit.kv.plan import LEVELS_FILE, load_rotations, save_levels

    geo = loaded.geometry
    scheme.validate(geo)
    todo = vq_tensors(scheme, geo)
    if not todo:
        raise LowbitError(f"--vq-for {recipe_name}: the recipe has no vector-quantized tensor (vq = \"2x16\" on K or V)")
    rotations = load_rotations(scheme.rotation, geo)  # before the model work: a bad rotation fails first
    col, seconds = _collect_text(loaded, data_spec, text, tokens=tokens, seq_len=seq_len, skip=skip,
                                 score_weighted=False, sample_per_seq=VQ_SAMPLE_PER_SEQ, progress=progress)
    t0 = time.time()
    dtype = next(iter(loaded.model.parameters())).dtype
    cbs = fit_codebooks(col.layers, scheme, rotations, geo, dtype)
    inputs = {**_inputs(loaded, data_spec, text), "vq_for": recipe_name, "tokens": tokens, "seq_len": seq_len,
              "skip": skip, "rows_per_sequence": VQ_SAMPLE_PER_SEQ}
    save_levels(out, cbs, model=loaded.name, inputs=inputs)

    sha = load_manifest(out).file_map()[LEVELS_FILE].sha256
    return {"tensors": len(todo), "tokens": tokens, "seconds": round(seconds + time.time() - t0, 1), "sha256": sha}


def write_calibration(col, out: Path, geo, inputs: dict, *, tokens: int, seq_len: int) -> dict:
    """Write a collector's statistics as a calibration artifact (atomic; nothing left on error)."""
    if sorted(col.layers) != [lg.index for lg in geo.layers]:
        raise LowbitError(f"captured attention layers {sorted(col.layers)}, the model has {geo.num_layers}: "
                          "some layers bypassed the capture")
    recipe = {"tokens": tokens, "seq_len": seq_len, "skip": col.skip, "score_weighted": col.score_weighted,
              "dtype": str(next(iter(col.dtypes), "?"))}
    n_seq = tokens // seq_len
    with ArtifactWriter(out, kind="calibration", artifact_class="generic", inputs=inputs, recipe=recipe) as w:
        col.save(w.path, {**inputs, **recipe, "geometry": _geometry_doc(geo)})
        w.counts = {"layers": len(col.layers), "tokens": tokens, "sequences": n_seq,
                    "stats_tokens_per_layer": tokens - col.skip * n_seq}
    return dict(w.counts)


def _geometry_doc(geo) -> list[dict]:
    return [
        {"index": lg.index, "attention": lg.attention, "window": lg.window, "num_q_heads": lg.num_q_heads,
         "num_kv_heads": lg.num_kv_heads, "head_dim_k": lg.head_dim_k, "head_dim_v": lg.head_dim_v,
         "storage": getattr(lg, "storage", "mha"), "latent_dim": getattr(lg, "latent_dim", None)}
        for lg in geo.layers
    ]
