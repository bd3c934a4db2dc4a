"""DigitsDiTPipeline: class-conditional sampling in pixel space with a DiTTransformer2DModel and DDIM.

    pipe = DigitsDiTPipeline(transformer=dit, scheduler=DDIMScheduler(...))
    images = pipe(classes=[3, 7], seeds=[0, 1], num_inference_steps=25)   # float32 [2, 4, S, S] in [0, 1]

A diffusers DiffusionPipeline (save_pretrained / from_pretrained, model_index.json), with no VAE: the
DiT denoises RGBA pixels directly (the images are small). The transformer predicts what the
scheduler's prediction_type says (the trained model: the clean image); classifier-free guidance mixes
the class and the null-class (index num_classes, the class embedding's dropout slot) predictions:
p = p_null + guidance * (p_class - p_null) (linear in x_t for every prediction type, so the same rule).

Image i's starting noise comes from its own torch.Generator seeded with seeds[i], so the image of
(class, seed) does not depend on which other images share its batch: a quantized checkpoint's image is
compared with the unquantized image of the same seed, and the capacity bench can batch freely.
"""

from __future__ import annotations

import torch
from diffusers import DiffusionPipeline

DEFAULT_STEPS = 25
DEFAULT_GUIDANCE = 2.0


def initial_noise(seeds, channels: int, size: int) -> torch.Tensor:
    """float32 [B, C, size, size]: image i's noise from torch.Generator().manual_seed(seeds[i])."""
    return torch.stack([torch.randn(channels, size, size, generator=torch.Generator().manual_seed(int(s)))
                        for s in seeds])


class DigitsDiTPipeline(DiffusionPipeline):
    """transformer: DiTTransformer2DModel (out_channels = in_channels); scheduler: DDIMScheduler."""

    model_cpu_offload_seq = "transformer"

    def __init__(self, transformer, scheduler):
        super().__init__()
        self.register_modules(transformer=transformer, scheduler=scheduler)

    @property
    def num_classes(self) -> int:
        return int(self.transformer.config.num_embeds_ada_norm)

    @torch.no_grad()
    def __call__(self, classes, seeds, *, num_inference_steps: int = DEFAULT_STEPS,
                 guidance_scale: float = DEFAULT_GUIDANCE, size: int | None = None) -> torch.Tensor:
        """classes, seeds: equal-length int sequences -> float32 [B, C, size, size] in [0, 1] (CPU tensor).

        size: image side in pixels (default the transformer's sample_size; other multiples of the patch size
        run with re-computed position embeddings, off the training distribution)."""
        classes, seeds = list(classes), list(seeds)
        if len(classes) != len(seeds) or not classes:
            raise ValueError("classes and seeds must be non-empty and of equal length")
        tr = self.transformer
        cfg = tr.config
        size = int(size or cfg.sample_size)
        dev = next(tr.parameters()).device
        dtype = next((p.dtype for p in tr.parameters() if p.is_floating_point()), torch.float32)
        x = initial_noise(seeds, cfg.in_channels, size).to(dev)  # [B, C, S, S] float32
        labels = torch.tensor(classes, dtype=torch.long, device=dev)
        guided = guidance_scale != 1.0
        if guided:
            labels = torch.cat([labels, torch.full_like(labels, self.num_classes)])  # [2B]: class, then null
        self.scheduler.set_timesteps(num_inference_steps, device=dev)
        for t in self.scheduler.timesteps:
            inp = torch.cat([x, x]) if guided else x
            tt = torch.full((inp.shape[0],), int(t), dtype=torch.long, device=dev)
            pred = tr(inp.to(dtype), timestep=tt, class_labels=labels).sample.float()  # [B or 2B, C, S, S]
            if guided:
                p_c, p_u = pred.chunk(2)
                pred = p_u + guidance_scale * (p_c - p_u)
            x = self.scheduler.step(pred, t, x).prev_sample
        return ((x.clamp(-1, 1) + 1) / 2).cpu()
