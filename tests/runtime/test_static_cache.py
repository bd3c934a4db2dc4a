"""The static runtime cache and model step on CPU (eager): the same logits as the eager QuantizedKVCache
at page 1 (the same codes), scale-only groups (zero 'none') included, through the torch path and the fused
kernel (Triton interpreter); ragged batches equal to each sequence alone, every middle row through the one
quantizer, and the bad inputs named."""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.codec import TensorCodec
from lowbit.kv.plan import resolve
from lowbit.models.geometry import ModelGeometry
from lowbit.models.tiny import tiny_tokenizer_free_inputs
from lowbit.runtime.cache import QuantizedKVCache
from lowbit.runtime.static_cache import StaticKVCache
from lowbit.runtime.step import DecodeGraphs, ModelStep, eager_decode, prefill
from tests.kv.helpers import fast_model, rel_err, run_chunks, scheme

GEMMA_FULL = {"layer_types": ["full_attention", "full_attention"]}
CASES = [("smollm2-135m", {}, "bf16"), ("smollm2-135m", {}, "int2"), ("smollm2-135m", {}, "k4v2"),
         ("gemma3-270m", {}, "bf16"), ("gemma3-270m", GEMMA_FULL, "int2"), ("gemma3-270m", GEMMA_FULL, "int8")]


def _setup(name, over, sname, sink=4, recent=8, **kw):
    m = fast_model(name, **over)
    geo = ModelGeometry.from_config(m.config, name=name)
    return m, geo, resolve(scheme(sname, sink=sink, recent=recent, page=1, **kw), geo)


def _static_run(m, plan, ids, prompt_len, chunk, steps, slots=None):
    """Prefill each row of ids (prompt_len tokens, in chunks), then `steps` teacher-forced decode steps for
    all rows together -> logits [B, 1 + steps, V] (the last prompt position, then each step)."""
    B = ids.shape[0]
    st = StaticKVCache(m, plan, slots=slots or B, max_context=64)
    step = ModelStep(m)
    P = prompt_len
    outs = [[] for _ in range(B)]
    for b in range(B):
        outs[b].append(prefill(step, st, b, ids[b, :P], chunk=chunk))
    for t in range(steps):
        lg = eager_decode(step, st, ids[:, P + t:P + t + 1], torch.ones(B, dtype=torch.bool))
        for b in range(B):
            outs[b].append(lg[b])
    return torch.stack([torch.stack(o) for o in outs]), st


def _eager_ref(m, plan, ids):
    """The eager QuantizedKVCache's logits for what _static_run(m, plan, ids, 30, 13, 10) feeds it."""
    return torch.stack([run_chunks(m, QuantizedKVCache.from_plan(m, plan), ids[b:b + 1], None,
                                   [13, 13, 4] + [1] * 10)[0, 29:] for b in range(ids.shape[0])])


@pytest.mark.parametrize("name,over,sname", CASES)
def test_static_runtime_matches_the_eager_cache(name, over, sname):
    m, _geo, plan = _setup(name, over, sname)
    ids = tiny_tokenizer_free_inputs(m.config, 2, 40, seed=1)
    ref = _eager_ref(m, plan, ids)
    out, st = _static_run(m, plan, ids, 30, 13, 10)
    assert rel_err(out, ref) < 1e-4
    assert st.lens.tolist() == [40, 40]
    if sname == "bf16":  # and transformers' own cache, through its own forward
        from transformers import DynamicCache

        for b in range(2):
            dyn = run_chunks(m, DynamicCache(config=m.config), ids[b:b + 1], None, [30] + [1] * 10, impl="sdpa")[0, 29:]
            assert rel_err(out[b], dyn) < 1e-4


@pytest.mark.parametrize("name,over,sname", [("smollm2-135m", {}, "int2"), ("smollm2-135m", {}, "k4v2"),
                                             ("gemma3-270m", GEMMA_FULL, "int2")])
def test_scale_only_groups_match_the_eager_cache(name, over, sname):
    """zero 'none' (lowbit.kv.codec: only the fp16 scale is stored): the buffers hold no zero (fewer bytes than
    with one) and the logits are the eager cache's (the same codec writes both)."""
    m, _geo, plan = _setup(name, over, sname, zero="none")
    assert all(not lp.k.stores_zero and not lp.v.stores_zero for lp in plan.layers)
    ids = tiny_tokenizer_free_inputs(m.config, 2, 40, seed=1)
    out, st = _static_run(m, plan, ids, 30, 13, 10)
    assert rel_err(out, _eager_ref(m, plan, ids)) < 1e-4
    assert all("zero" not in layer.mid[t] for layer in st.layers for t in "kv")
    _, zeroed = _static_run(m, _setup(name, over, sname)[2], ids, 30, 13, 10)
    assert st.bytes_held() < zeroed.bytes_held()


def test_fused_kernel_reads_scale_only_static_tiers_like_the_torch_path():
    """use_kernel (what a CUDA plan sets; here the Triton interpreter): with scale-only groups the decode step
    through the kernel's wrapper and through the custom op (kernel_op) gives the torch path's logits (k4v2:
    both code widths read; the kernel computes zero = -centre * scale; stored zeros: test_compiled_step)."""
    from lowbit.kernels.attention.common import interpreted

    if not interpreted():
        pytest.skip("the kernels were imported for CUDA (TRITON_INTERPRET=0)")
    m, _geo, plan = _setup("smollm2-135m", {}, "k4v2", zero="none")
    ids = tiny_tokenizer_free_inputs(m.config, 2, 24, seed=4)
    step = ModelStep(m)
    outs = []
    for use_kernel, kernel_op in ((False, False), (True, False), (True, True)):
        st = StaticKVCache(m, plan, slots=2, max_context=32)
        st.use_kernel, st.kernel_op = use_kernel, kernel_op
        for b, n in enumerate((20, 15)):
            prefill(step, st, b, ids[b, :n], chunk=8)
        on = torch.ones(2, dtype=torch.bool)
        outs.append(torch.stack([eager_decode(step, st, ids[:, 20 + t:21 + t], on) for t in range(3)]))
    assert rel_err(outs[1], outs[0]) < 1e-3 and rel_err(outs[2], outs[0]) < 1e-3


def test_ragged_batch_equals_each_sequence_alone():
    m, _geo, plan = _setup("smollm2-135m", {}, "int2")
    ids = tiny_tokenizer_free_inputs(m.config, 3, 50, seed=2)
    step = ModelStep(m)
    st = StaticKVCache(m, plan, slots=3, max_context=64)
    lens = [9, 30, 17]
    for b, n in enumerate(lens):
        prefill(step, st, b, ids[b, :n], chunk=7)
    outs = [eager_decode(step, st, torch.stack([ids[b, n + t] for b, n in enumerate(lens)])[:, None],
                         torch.ones(3, dtype=torch.bool)) for t in range(6)]
    out = torch.stack(outs, 1)  # [3, 6, V]
    for b, n in enumerate(lens):
        alone, _ = _static_run(m, plan, ids[b:b + 1, :n + 6], n, 7, 6)
        assert rel_err(out[b], alone[0, 1:]) < 1e-5
    # an inactive slot does not advance
    eager_decode(step, st, ids[:, :1], torch.tensor([True, False, True]))
    assert st.lens.tolist() == [n + 7 if b != 1 else n + 6 for b, n in enumerate(lens)]


def test_every_middle_row_goes_through_the_quantizer(monkeypatch):
    sentinel = 7.0
    orig = TensorCodec.encode

    def poisoned(self, x, dense_dtype, **kw):
        return orig(self, torch.full_like(x, sentinel), dense_dtype, **kw)

    monkeypatch.setattr(TensorCodec, "encode", poisoned)
    m, _geo, plan = _setup("smollm2-135m", {}, "int4")
    ids = tiny_tokenizer_free_inputs(m.config, 2, 40, seed=3)
    _, st = _static_run(m, plan, ids, 30, 11, 10)
    for layer in st.layers:
        _, nm, _ = layer.tier_lens(st.lens)
        assert int(nm.min()) > 0
        for b in range(2):
            k, v, pos = layer.dense_history(b, int(st.lens[b]))
            mid = (pos >= layer.S) & (pos < int(st.lens[b]) - layer.R)
            assert torch.all(k[:, :, mid] == sentinel) and torch.all(v[:, :, mid] == sentinel)
            assert not torch.any(k[:, :, ~mid] == sentinel)


def test_bad_inputs_are_named():
    m, geo, plan = _setup("smollm2-135m", {}, "int2")
    st = StaticKVCache(m, plan, slots=2, max_context=32)
    with pytest.raises(LowbitError, match="decode batch 3 outside 1..2"):
        st.begin_decode(3)
    with pytest.raises(LowbitError, match="exceed the cache capacity 32"):
        st.begin_prefill(0, 20, 13)
    with pytest.raises(LowbitError, match="needs a CUDA cache"):
        DecodeGraphs(ModelStep(m), st)
    kivi = resolve(scheme("kivi2", sink=4, recent=8, page=4, group=4), geo)
    with pytest.raises(LowbitError, match="per channel"):
        StaticKVCache(m, kivi, slots=1, max_context=32)
    with pytest.raises(LowbitError, match="resolve it with device='cuda'"):
        StaticKVCache(m, plan, slots=1, max_context=32, device="cuda")

    class NotAFamily(torch.nn.Module):
        config = type("C", (), {"model_type": "gpt2"})()

    with pytest.raises(LowbitError, match="model type 'gpt2' has no runtime step; families with one: gemma3"):
        ModelStep(NotAFamily())
