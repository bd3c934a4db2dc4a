"""Gemma 3 (gemma3-270m; the text decoder of the multimodal gemma3): a rotary per layer type (sliding / full)."""

from lowbit.models.families import ArchSpec, Family, register

ARCH = ArchSpec(
    layers="model.layers",
    rotation_refusal=(
        "Gemma3 norms are y = (1 + w) * x / rms(x), post-attention / post-feedforward norms sit on the "
        "residual branches and the embeddings are scaled by sqrt(hidden); the residual rotation cannot "
        "be folded into its weights"
    ),
)

FAMILY = register(Family("gemma3", ("gemma3_text", "gemma3"), step="per-type", arch=ARCH, module=__name__))
