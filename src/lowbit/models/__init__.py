"""Models: per-layer geometry from HF configs, the built-in registry, loading, tiny test models.

    from lowbit.models import load, ModelGeometry, BUILTINS
    lm = load("smollm2-135m")            # LoadedModel(model, tokenizer, name, weights_sha256, geometry)
    from lowbit.models.tiny import tiny_model
    model, config = tiny_model("gemma3-270m", vocab_size=99)
"""

from lowbit.models.geometry import LayerGeometry, ModelGeometry
from lowbit.models.load import LoadedModel, load
from lowbit.models.registry import BUILTINS, BuiltinModel, get_builtin

__all__ = ["BUILTINS", "BuiltinModel", "LayerGeometry", "LoadedModel", "ModelGeometry", "get_builtin", "load"]
