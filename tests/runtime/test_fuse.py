"""Fused projections (lowbit.runtime.fuse): one GEMM for q/k/v and one for gate/up of each decoder layer.
The fused model gives the unfused model's logits (transformers' own forward and the runtime step, eager
and traced by dynamo in one graph), holds no second copy of the weights, and undo() restores it."""

import pytest
import torch
from torch import nn

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve
from lowbit.models.geometry import ModelGeometry
from lowbit.runtime.fuse import FusedHead, FusedTail, fuse_projections
from lowbit.runtime.static_cache import StaticKVCache
from lowbit.runtime.step import ModelStep, compile_decode, eager_decode, prefill
from tests.kv.helpers import scheme
from tests.runtime.test_generate import _model


def _params_bytes(m):
    seen = {}
    for p in m.parameters():
        seen[p.untyped_storage().data_ptr()] = p.untyped_storage().nbytes()
    return sum(seen.values())


@pytest.mark.parametrize("family", ["llama", "qwen2", "gemma3"])
def test_fused_model_gives_the_same_logits_and_undo_restores_it(family):
    m = _model(family)
    ids = torch.randint(3, 99, (2, 17), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        ref = m(ids).logits
    before = _params_bytes(m)
    h = fuse_projections(m)
    n = m.config.num_hidden_layers
    assert h.groups == 2 * n and not h.skipped
    attn = m.model.layers[0].self_attn
    assert isinstance(attn.q_proj, FusedHead) and isinstance(attn.v_proj, FusedTail)
    assert _params_bytes(m) == before  # the fused weight replaces the originals, no second copy
    with torch.no_grad():
        got = m(ids).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), float((got - ref).abs().max())
    h.undo()
    assert type(m.model.layers[0].mlp.up_proj) is nn.Linear
    with torch.no_grad():
        back = m(ids).logits
    assert torch.allclose(back, ref, rtol=1e-5, atol=1e-5)


def test_a_tail_called_before_its_head_is_an_error():
    m = _model("llama")
    fuse_projections(m)
    with pytest.raises(LowbitError, match="before its group's first"):
        m.model.layers[0].self_attn.k_proj(torch.zeros(1, m.config.hidden_size))


def test_packed_or_mixed_bias_groups_are_left_alone_and_named():
    m = _model("llama")
    attn = m.model.layers[1].self_attn
    attn.k_proj.bias = nn.Parameter(torch.zeros(attn.k_proj.out_features))
    h = fuse_projections(m)
    assert h.skipped == ["layer 1 self_attn: some have a bias, some not"]
    assert type(attn.q_proj) is nn.Linear and isinstance(m.model.layers[0].self_attn.q_proj, FusedHead)


@pytest.mark.parametrize("family,sname", [("llama", "int2"), ("qwen2", "int4")])
def test_fused_step_equals_the_unfused_step_traced_in_one_graph(family, sname):
    m, m_ref = _model(family), _model(family)  # the same weights; m is fused in place
    assert all(torch.equal(a, b) for a, b in zip(m.state_dict().values(), m_ref.state_dict().values()))
    kv = scheme(sname, sink=4, recent=8, page=1)
    plan = resolve(kv, ModelGeometry.from_config(m.config))
    prompts = [torch.randint(3, 99, (n,), generator=torch.Generator().manual_seed(n)) for n in (5, 13)]
    ref_c, cmp_c = StaticKVCache(m_ref, plan, slots=2, max_context=48), StaticKVCache(m, plan, slots=2, max_context=48)
    plain = ModelStep(m_ref)
    first = [prefill(plain, ref_c, b, p).argmax() for b, p in enumerate(prompts)]
    fused = ModelStep(m, fuse=True)
    assert fused.fused.groups == 2 * m.config.num_hidden_layers
    first_f = [prefill(fused, cmp_c, b, p).argmax() for b, p in enumerate(prompts)]
    assert [int(t) for t in first] == [int(t) for t in first_f]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = compile_decode(fused, cmp_c, backend="aot_eager")
    ids = torch.stack(first)[:, None]
    active = torch.tensor([True, True])
    buf, logits = ids.clone(), torch.zeros(2, m.config.vocab_size)
    with torch.no_grad():
        for i in range(6):
            ref = eager_decode(plain, ref_c, ids, active)
            ids = ref.argmax(-1, keepdim=True)
            fn(buf, active, logits, 2)
            assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-5, i
    assert counters["stats"]["unique_graphs"] == fn.graphs_per_bucket and not counters["graph_break"]
    assert torch.equal(buf, ids)


def _quantize(m, scheme_name="w4a16-g64"):
    """Every decoder nn.Linear -> an unpacked QuantLinear (RTN on the one grid), as bench.quantize_linears does."""
    from lowbit.weights.grid import grid_for_clip, quantize_on
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    sch = parse_weight_scheme(scheme_name)
    for n, lin in [(n, x) for n, x in m.model.layers.named_modules() if type(x) is nn.Linear]:
        parent, _, child = n.rpartition(".")
        owner = m.model.layers.get_submodule(parent)
        w = lin.weight.detach()
        grid = grid_for_clip(w, sch.w_bits, sch.group_for(w.shape[1]), sch.symmetric, 1.0, torch.float32)
        setattr(owner, child, QuantLinear.from_codes(quantize_on(w, grid), grid, sch, bias=lin.bias))
    return m


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_quantized_groups_fuse_into_one_quantlinear_with_the_same_logits(family):
    from lowbit.weights.qlinear import QuantLinear

    m = _quantize(_model(family))
    ids = torch.randint(3, 99, (2, 9), generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        ref = m(ids).logits
    attn = m.model.layers[0].self_attn
    parts = [attn.q_proj, attn.k_proj, attn.v_proj]
    h = fuse_projections(m)
    assert h.groups == 2 * m.config.num_hidden_layers and not h.skipped
    fused = m.model.layers[0].self_attn.q_proj.linear
    assert type(fused) is QuantLinear and fused.out_features == sum(p.out_features for p in parts)
    # the rows of the stacked codes / scales are the parts' rows, in order
    assert torch.equal(fused.codes, torch.cat([p.codes for p in parts])) and torch.equal(
        fused.scale, torch.cat([p.scale for p in parts]))
    with torch.no_grad():
        got = m(ids).logits
    assert torch.allclose(got, ref, rtol=1e-5, atol=1e-5), float((got - ref).abs().max())
    h.undo()  # quantized groups stay fused (their originals are not kept)
    assert isinstance(m.model.layers[0].mlp.gate_proj, FusedHead) and h.groups == 2 * m.config.num_hidden_layers
    assert fuse_projections(m).skipped[0].startswith("layer 0 self_attn: not plain nn.Linear")
