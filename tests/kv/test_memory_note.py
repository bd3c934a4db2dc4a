"""The summary says so, in one line, when a quantizing scheme has quantized nothing yet."""

import pytest

from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache

from .helpers import make_model, run_chunks, scheme


@pytest.fixture(scope="module")
def llama():
    return make_model("smollm2-135m", num_layers=1)


@pytest.mark.parametrize("name,sink,recent,page,tokens,note", [
    ("int4", 64, 256, 16, 37, True),   # a short prompt under the defaults: all in sink + recent
    ("int2", 4, 8, 4, 15, True),       # one short of sink + recent + page
    ("int2", 4, 8, 4, 16, False),      # the first page leaves the ring
    ("bf16", 4, 8, 4, 15, False),      # nothing to quantize: no note
])
def test_nothing_quantized_note(llama, name, sink, recent, page, tokens, note):
    cache = QuantizedKVCache(llama, scheme(name, sink=sink, recent=recent, page=page))
    ids = tiny_tokenizer_free_inputs(llama.config, 1, tokens, seed=0)
    run_chunks(llama, cache, ids, None, [tokens - 1, 1])
    lines = cache.summary().split("\n")
    assert lines[-1].startswith(f"kv {cache.scheme.name}: {tokens} tokens")
    if note:
        assert len(lines) == 2 and lines[0].startswith("note: nothing quantized")
        assert f"all {tokens} tokens sit in the sink ({sink}) and recent ({recent})" in lines[0]
        assert f"quantizing starts at {sink + recent + page} tokens" in lines[0] and "--sink / --recent" in lines[0]
    else:
        assert len(lines) == 1
