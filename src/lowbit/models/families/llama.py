"""Llama-style decoders: Llama, Mistral, Qwen2 (smollm2, qwen2.5-coder): one rotary for every layer, plain RMSNorm.

Qwen2's q/k/v biases ride along: a rotation of the inputs leaves output biases alone.
"""

from lowbit.models.families import ArchSpec, Family, register

FAMILY = register(Family("llama", ("llama", "mistral", "qwen2"), step="shared", arch=ArchSpec(), module=__name__))
