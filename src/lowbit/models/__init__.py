"""Models: per-layer geometry from HF configs, the built-in registry, loading, tiny test models.

    from lowbit.models import resolve, ModelGeometry, BUILTINS
    lm = resolve("smollm2-135m")         # LoadedModel(model, tokenizer, name, weights_sha256, geometry, provenance)
    lm = resolve("path/to/hf-dir")       # a local HF dir, or a `lowbit quantize` checkpoint (QuantLinear modules)
    from lowbit.models.tiny import tiny_model
    model, config = tiny_model("gemma3-270m", vocab_size=99)
"""

from lowbit.models.geometry import LayerGeometry, ModelGeometry
from lowbit.models.load import (
    TOKENIZER_FILES,
    LoadedModel,
    ResolvedModel,
    has_tokenizer,
    is_quantized_checkpoint,
    load,
    load_tokenizer,
    model_dir,
    model_name,
    resolve,
)
from lowbit.models.registry import BUILTINS, BuiltinModel, get_builtin

__all__ = ["BUILTINS", "TOKENIZER_FILES", "BuiltinModel", "LayerGeometry", "LoadedModel", "ModelGeometry", "ResolvedModel",
           "get_builtin", "has_tokenizer", "is_quantized_checkpoint", "load", "load_tokenizer", "model_dir", "model_name",
           "resolve"]
