"""lowbit: low-bit KV cache and weights for Hugging Face models, with measured quality loss."""

__version__ = "0.1.0"
