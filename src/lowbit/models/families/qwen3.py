"""Qwen3 decoders: the runtime step as Llama's (one rotary); no weight-quantization ArchSpec yet."""

from lowbit.models.families import Family, register

FAMILY = register(Family("qwen3", ("qwen3",), step="shared", module=__name__))
