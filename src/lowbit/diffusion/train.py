"""Deterministic training of the small class-conditional DiT on the RGBA digits (data.py).

    manifest = train(TrainConfig(steps=3000), "artifacts/dit-digits32")

What is trained: diffusers' DiTTransformer2DModel (adaLN-zero blocks, class embedding with a null slot for
classifier-free guidance: labels are dropped to the null class with p = 0.1 during training, inside
the model) on 32x32 RGBA images in [-1, 1], patch 8 (16 tokens), predicting the clean image (x0,
diffusers' prediction_type "sample") under a cosine (squaredcos_cap_v2) 1000-step schedule. Why x0 and
not v or epsilon: a patch token carries 8 x 8 x 4 = 256 pixel values through a 128-wide hidden state, so
the model cannot pass per-pixel noise through to predict it (a v-prediction run of the same size drew
the right colours covered in pixel noise); the clean images are smooth (bilinear from 8x8) and fit. AdamW, linear warm-up then cosine decay to min_lr_frac; the
weights written are an exponential moving average (decay warmed up as (1+k)/(10+k), capped at `ema`).
As in the DiT paper the adaLN modulation linears and the output projection start at zero, so every
block starts as the identity.

Every linear's in_features is a multiple of 64 (hidden 128, MLP 512, timestep features 256), so
w4a16-g64 and per-channel schemes apply to all of them.

Determinism: one torch.manual_seed(seed) before the model is built (init and the model's own label
dropout), and one torch.Generator(seed) for batch order, timesteps and noise. On one machine, at a
fixed thread count, the same config writes the same bytes (tests/diffusion/test_train.py checks it on
a tiny config); a different CPU or thread count may differ in the last bits of float sums.

Output: a diffusers directory (DigitsDiTPipeline.save_pretrained: model_index.json, transformer/,
scheduler/) + samples.png (10 classes x 8 seeds) inside a lowbit artifact (manifest: sha256 of every
file, inputs = data source + training commit, recipe = this config, counts = steps, params, losses).
"""

from __future__ import annotations

import math
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path

from lowbit.artifacts import ArtifactWriter
from lowbit.core.errors import LowbitError
from lowbit.core.progress import bar

# torch is imported inside the functions: `lowbit train-dit`'s parser reads TrainConfig's defaults, and a
# mistyped flag must not wait for torch

ARTIFACT_KIND = "diffusers-pipeline"
SAMPLE_SEEDS = tuple(range(8))


@dataclass(frozen=True)
class TrainConfig:
    """size: image side (multiple of 8); patch: DiT patch side; hidden = heads * head_dim (multiple of 64)."""

    size: int = 32
    patch: int = 8
    hidden: int = 128
    heads: int = 4
    layers: int = 4
    steps: int = 2500
    batch: int = 64
    lr: float = 6e-4
    warmup: int = 100
    min_lr_frac: float = 0.1
    ema: float = 0.999
    seed: int = 0
    train_timesteps: int = 1000
    sample_steps: int = 25
    guidance: float = 2.0
    prediction: str = "sample"  # "sample" (x0) | "v_prediction" | "epsilon"
    version: int = 1

    def check(self) -> None:
        if self.hidden % 64 or self.hidden % self.heads:
            raise LowbitError(f"hidden {self.hidden} must be a multiple of 64 (w4a16-g64 on every linear) and of "
                              f"heads {self.heads}")
        if self.size % 8 or self.size % self.patch:
            raise LowbitError(f"size {self.size} must be a multiple of 8 and of patch {self.patch}")
        if self.steps < 1 or self.batch < 1 or self.layers < 1:
            raise LowbitError("steps, batch and layers must be >= 1")
        if self.prediction not in ("sample", "v_prediction", "epsilon"):
            raise LowbitError(f"prediction {self.prediction!r}: use sample, v_prediction or epsilon")
        if not (0 < self.lr < 1) or not (0 <= self.ema < 1):
            raise LowbitError(f"lr {self.lr} must be in (0, 1) and ema {self.ema} in [0, 1)")

    def to_dict(self) -> dict:
        return asdict(self)


def build_transformer(cfg: TrainConfig):
    """A fresh DiTTransformer2DModel for cfg (adaLN-zero init), float32."""
    import torch
    from diffusers import DiTTransformer2DModel

    from lowbit.diffusion.data import CHANNELS, NUM_CLASSES

    m = DiTTransformer2DModel(
        num_attention_heads=cfg.heads, attention_head_dim=cfg.hidden // cfg.heads, in_channels=CHANNELS,
        out_channels=CHANNELS, num_layers=cfg.layers, sample_size=cfg.size, patch_size=cfg.patch,
        num_embeds_ada_norm=NUM_CLASSES,
    )
    with torch.no_grad():
        for blk in m.transformer_blocks:
            blk.norm1.linear.weight.zero_()
            blk.norm1.linear.bias.zero_()
        for lin in (m.proj_out_1, m.proj_out_2):
            lin.weight.zero_()
            lin.bias.zero_()
    return m


def make_schedulers(cfg: TrainConfig):
    """(DDPMScheduler for training, DDIMScheduler for sampling) on the same cosine schedule and prediction type."""
    from diffusers import DDIMScheduler, DDPMScheduler

    common = {"num_train_timesteps": cfg.train_timesteps, "beta_schedule": "squaredcos_cap_v2",
                  "prediction_type": cfg.prediction, "clip_sample": True, "clip_sample_range": 1.0}
    # trailing spacing: the first of few sampling steps is t = T-1 (pure noise), not T - T/n
    return DDPMScheduler(**common), DDIMScheduler(**common, timestep_spacing="trailing", set_alpha_to_one=False)


def training_commit() -> dict:
    """The git commit the training code came from, and whether lowbit/diffusion had local changes."""
    here = Path(__file__).resolve().parent
    try:
        sha = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True,
                             timeout=10, check=True).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "."], cwd=here, capture_output=True,
                               text=True, timeout=10, check=True).stdout.strip() != ""
    except (OSError, subprocess.SubprocessError):
        return {"commit": None, "dirty": None}
    return {"commit": sha, "dirty": dirty}


def _lr_at(cfg: TrainConfig, k: int) -> float:
    if k < cfg.warmup:
        return cfg.lr * (k + 1) / cfg.warmup
    p = (k - cfg.warmup) / max(1, cfg.steps - cfg.warmup)
    return cfg.lr * (cfg.min_lr_frac + (1 - cfg.min_lr_frac) * 0.5 * (1 + math.cos(math.pi * p)))


def train_model(cfg: TrainConfig, *, progress: bool | None = None, log_every: int = 250):
    """Train; returns (EMA transformer in eval mode, sampling scheduler, stats dict)."""
    import torch

    from lowbit.diffusion.data import digits_rgba

    cfg.check()
    images, labels = digits_rgba(cfg.size)
    x_all = images * 2 - 1  # [N, 4, S, S] in [-1, 1]
    n = x_all.shape[0]
    torch.manual_seed(cfg.seed)
    model = build_transformer(cfg)
    model.train()
    ema = build_transformer(cfg)
    ema.load_state_dict(model.state_dict())
    ema.eval().requires_grad_(False)
    noise_sched, sample_sched = make_schedulers(cfg)
    acp = noise_sched.alphas_cumprod  # [T] float32
    opt = torch.optim.AdamW(model.parameters(), lr=cfg.lr, weight_decay=0.0)
    gen = torch.Generator().manual_seed(cfg.seed)
    perm, pos = torch.randperm(n, generator=gen), 0
    losses, t0 = [], time.perf_counter()
    with bar(cfg.steps, "train DiT", "step", progress) as pb:
        for k in range(cfg.steps):
            if pos + cfg.batch > n:
                perm, pos = torch.randperm(n, generator=gen), 0
            idx = perm[pos:pos + cfg.batch]
            pos += cfg.batch
            x0, y = x_all[idx], labels[idx]
            t = torch.randint(0, cfg.train_timesteps, (len(idx),), generator=gen)
            eps = torch.randn(x0.shape, generator=gen)
            a = acp[t].sqrt().view(-1, 1, 1, 1)
            s = (1 - acp[t]).sqrt().view(-1, 1, 1, 1)
            xt = a * x0 + s * eps  # noised input
            target = {"sample": x0, "epsilon": eps}.get(cfg.prediction, a * eps - s * x0)  # else velocity
            for g in opt.param_groups:
                g["lr"] = _lr_at(cfg, k)
            loss = torch.nn.functional.mse_loss(model(xt, timestep=t, class_labels=y).sample, target)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            d = min(cfg.ema, (1 + k) / (10 + k))
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1 - d)
            losses.append(float(loss.detach()))
            pb.update(1)
            if not pb.enabled and log_every and (k + 1) % log_every == 0:
                print(f"step {k + 1}/{cfg.steps} loss {sum(losses[-log_every:]) / log_every:.4f} "
                      f"({time.perf_counter() - t0:.0f}s)", flush=True)
    w = min(100, len(losses))
    stats = {"steps": cfg.steps, "params": sum(p.numel() for p in ema.parameters()),
             "loss_first": round(sum(losses[:w]) / w, 5), "loss_last": round(sum(losses[-w:]) / w, 5),
             "train_seconds": round(time.perf_counter() - t0, 1), "threads": torch.get_num_threads()}
    return ema, sample_sched, stats


def train(cfg: TrainConfig, out, *, progress: bool | None = None) -> dict:
    """Train and write the artifact directory `out` (new; refused if it exists). Returns the manifest as a dict."""
    import os

    from lowbit.diffusion.data import NUM_CLASSES, digits_source
    from lowbit.diffusion.grid import save_grid
    from lowbit.diffusion.pipeline import DigitsDiTPipeline

    cfg.check()
    if os.path.lexists(out):
        raise LowbitError(f"{out} already exists; artifacts are never overwritten: choose a new --out")
    inputs = {"data": digits_source(), "training": training_commit()}
    ema, sched, stats = train_model(cfg, progress=progress)
    pipe = DigitsDiTPipeline(transformer=ema, scheduler=sched)
    classes = [c for c in range(NUM_CLASSES) for _ in SAMPLE_SEEDS]
    seeds = [s for _ in range(NUM_CLASSES) for s in SAMPLE_SEEDS]
    imgs = pipe(classes, seeds, num_inference_steps=cfg.sample_steps, guidance_scale=cfg.guidance)
    rows = [imgs[c * len(SAMPLE_SEEDS):(c + 1) * len(SAMPLE_SEEDS)] for c in range(NUM_CLASSES)]
    return save_pipeline_artifact(
        pipe, out, inputs=inputs, counts=stats,
        recipe={"train": cfg.to_dict(), "model": "DiTTransformer2DModel",
                "pipeline": "lowbit.diffusion.pipeline.DigitsDiTPipeline"},
        samples=lambda path: save_grid(rows, path, labels=[str(c) for c in range(NUM_CLASSES)]))


def save_pipeline_artifact(pipe, out, *, inputs: dict, recipe: dict, counts: dict, samples=None) -> dict:
    """Write an (unquantized) pipeline as a generic lowbit artifact: save_pretrained's files + manifest.json;
    samples(path) may write samples.png beside them. Returns the manifest as a dict."""
    with ArtifactWriter(out, kind=ARTIFACT_KIND, artifact_class="generic", inputs=inputs, recipe=recipe) as w:
        pipe.save_pretrained(w.path, safe_serialization=True)
        if samples is not None:
            samples(w.path / "samples.png")
        w.counts = dict(counts)
    return w.manifest.to_dict()
