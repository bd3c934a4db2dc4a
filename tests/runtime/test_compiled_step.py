"""The compiled decode body (lowbit.runtime.step.compile_decode: what DecodeGraphs(compile=True) captures) on
CPU with the aot_eager backend (dynamo's full-graph trace and functionalization, as Inductor gets them,
without Inductor's CPU compile time): the same logits, tokens, lengths and stored codes as the eager step
(eager_decode) over ragged slots, one graph per bucket, no recompile over the steps; the kernel op and the
packed-linear op trace as single nodes."""

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve
from lowbit.models.geometry import ModelGeometry
from lowbit.runtime.static_cache import StaticKVCache
from lowbit.runtime.step import ModelStep, compile_decode, eager_decode, prefill
from tests.kv.helpers import scheme
from tests.runtime.test_generate import _model

STEPS = 11
LENS = (5, 13, 9)  # ragged prompts; with sink 4 + recent 8 slot 1 reaches the packed middle at once


def _plan(m, sname):
    kv = "bf16" if sname == "bf16" else scheme(sname, sink=4, recent=8, page=1)
    return resolve(kv, ModelGeometry.from_config(m.config))


@pytest.mark.parametrize("family,sname,regions", [("llama", "int2", "layers"), ("llama", "int2", "whole"),
                                                  ("llama", "bf16", "layers"), ("qwen2", "int4", "layers"),
                                                  ("gemma3", "int2", "layers"), ("gemma3", "int2", "whole")])
def test_compiled_body_equals_the_eager_step(family, sname, regions):
    m = _model(family)
    plan = _plan(m, sname)
    step = ModelStep(m)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(3, 99, (n,), generator=g) for n in LENS]
    ref_c, cmp_c = (StaticKVCache(m, plan, slots=4, max_context=64) for _ in range(2))
    first = []
    for c in (ref_c, cmp_c):
        first = [prefill(step, c, b, p).argmax() for b, p in enumerate(prompts)]
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = compile_decode(step, cmp_c, backend="aot_eager", regions=regions)
    assert fn.graphs_per_bucket == (len(m.model.layers) + 2 if regions == "layers" else 1)
    ids = torch.stack(first + [torch.tensor(7)])[:, None]  # [4, 1]; slot 3 holds nothing and stays inactive
    active = torch.tensor([True, True, True, False])
    buf_ids, logits = ids.clone(), torch.zeros(4, m.config.vocab_size)
    ref_ids, toks = ids.clone(), []
    with torch.no_grad():
        for i in range(STEPS):
            ref = eager_decode(step, ref_c, ref_ids, active)
            ref_ids = torch.where(active[:, None], ref.argmax(-1, keepdim=True), ref_ids)
            if i == 0:
                fn(buf_ids, active, logits, 4)  # compiles
            else:
                with torch.compiler.set_stance("fail_on_recompile"):
                    fn(buf_ids, active, logits, 4)
            err = float((logits[:3] - ref[:3]).abs().max() / ref[:3].abs().max())
            assert err < 1e-5, (i, err)
            toks.append(ref_ids[:3, 0].clone())
    assert counters["stats"]["unique_graphs"] == fn.graphs_per_bucket and not counters["graph_break"]
    assert torch.equal(buf_ids, ref_ids) and int(buf_ids[3]) == 7
    assert len(set(torch.stack(toks).flatten().tolist())) > 4  # the tokens vary: a comparison that can fail
    assert cmp_c.lens.tolist() == ref_c.lens.tolist() == [n + STEPS for n in LENS] + [0]
    quantized = 0
    for a, b in zip(ref_c.layers, cmp_c.layers):  # the same stored rows in every tier
        for t in ("k", "v"):
            for name in a.mid[t]:
                assert torch.equal(a.mid[t][name][:3], b.mid[t][name][:3]), (t, name)
        # dense rows to fp32 rounding: a traced step rotates a decode token as a product-sum (static_cache._rot),
        # the eager step by a GEMM (another summation order)
        for x, y in ((a.ring_k, b.ring_k), (a.ring_v, b.ring_v), (a.sink_k, b.sink_k), (a.sink_v, b.sink_v)):
            assert torch.allclose(x[:3], y[:3], rtol=1e-5, atol=1e-5), float((x[:3] - y[:3]).abs().max())
        quantized += int(a.tier_lens(ref_c.lens)[1].sum()) if a.kind == "tiers" else 0
    assert (quantized > 0) == (sname != "bf16")
    assert cmp_c.checks is False and cmp_c.compile_writes is False


def test_one_graph_per_bucket_and_a_smaller_bucket_leaves_other_slots_alone():
    m = _model("llama")
    plan = _plan(m, "int2")
    step = ModelStep(m)
    cache = StaticKVCache(m, plan, slots=3, max_context=40)
    for b, n in enumerate((6, 14, 3)):
        prefill(step, cache, b, torch.arange(3, 3 + n))
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    fn = compile_decode(step, cache, backend="aot_eager")
    ids, active, logits = torch.tensor([[5], [6], [8]]), torch.ones(3, dtype=torch.bool), torch.zeros(3, 99)
    with torch.no_grad():
        fn(ids, active, logits, 3)
        fn(ids, active, logits, 1)  # a second bucket: its own graph
        with torch.compiler.set_stance("fail_on_recompile"):
            fn(ids, active, logits, 1)
            fn(ids, active, logits, 3)
    assert counters["stats"]["unique_graphs"] == 2 * fn.graphs_per_bucket and not counters["graph_break"]
    assert cache.lens.tolist() == [6 + 4, 14 + 2, 3 + 2]


def test_decode_graphs_refuses_cpu_and_bench_paths_are_the_schema_names():
    from lowbit.runtime.step import DecodeGraphs
    from lowbit.tools.bench import runtime as bench

    m = _model("llama")
    cache = StaticKVCache(m, _plan(m, "int2"), slots=1, max_context=16)
    with pytest.raises(LowbitError, match="needs a CUDA cache"):
        DecodeGraphs(ModelStep(m), cache, buckets=(1,), compile=True)
    with pytest.raises(LowbitError, match="compile regions 'all' unknown"):
        compile_decode(ModelStep(m), cache, backend="aot_eager", regions="all")
    # the decode_e2e schema's path names; how the lowbit rows ran is a field of each row, not a path suffix
    schema = {"hf-eager-bf16", "hf-static-compile-bf16", "lowbit-bf16", "lowbit-int4", "lowbit-int2", "lowbit-w4a16-int2"}
    assert schema <= set(bench.PATHS) and not any(p.endswith("-compiled") for p in bench.PATHS)
    with pytest.raises(LowbitError, match="compile 'yes' unknown"):
        bench.run("tiny-llama", (1,), (64,), ("lowbit-int2",), compile="yes")


def test_inductor_pdl_is_an_inductor_option_with_a_clear_error():
    from lowbit.runtime import step as st

    m = _model("llama")
    cache = StaticKVCache(m, _plan(m, "int2"), slots=1, max_context=16)
    with pytest.raises(LowbitError, match="backend is not inductor"):
        compile_decode(ModelStep(m), cache, backend="aot_eager", inductor_pdl=True)
    assert st.inductor_pdl_missing() is None  # torch 2.11 (the GPU host) and 2.13 (here) have the option
    compile_decode(ModelStep(m), cache, backend="inductor", inductor_pdl=True)  # lazily compiled: nothing runs yet
    # the default (None) resolves once: on for Inductor where torch has it, off for any other backend; asked-for
    # values stay as asked
    assert st.resolve_inductor_pdl(None, "inductor") is True
    assert st.resolve_inductor_pdl(None, "aot_eager") is False
    assert st.resolve_inductor_pdl(False, "inductor") is False
    with pytest.raises(LowbitError, match="backend is not inductor"):
        st.resolve_inductor_pdl(True, "aot_eager")


def test_packed_linear_traces_as_one_op():
    """A packed QuantLinear (the torch twin dispatch: CPU) inside a full-graph trace goes through the
    lowbit::packed_linear op, with the same output as its eager forward; unregistered it is refused."""
    from lowbit.kernels.gemm.prepare import attach
    from lowbit.kernels.ops import register_packed_linears
    from lowbit.weights.grid import grid_for_clip, quantize_on
    from lowbit.weights.qlinear import QuantLinear
    from lowbit.weights.scheme import parse_weight_scheme

    sch = parse_weight_scheme("w4a16-g128")
    w = torch.randn(67, 256, generator=torch.Generator().manual_seed(3))
    grid = grid_for_clip(w, sch.w_bits, sch.group_for(256), sch.symmetric, 1.0, torch.float32)
    q = QuantLinear.from_codes(quantize_on(w, grid), grid, sch, bias=None, scale_dtype=torch.float32)
    attach(q, "twin")  # what prepare_cuda(kernel="twin") sets, without a GPU
    x = torch.randn(3, 5, 256, generator=torch.Generator().manual_seed(4))
    eager = q(x)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="kernel op key"):
        torch.compile(q, backend="aot_eager", fullgraph=True)(x)
    model = torch.nn.Sequential(q)
    assert register_packed_linears(model) == 1
    torch._dynamo.reset()
    ops = []

    def backend(gm, inputs):
        ops.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return gm.forward

    out = torch.compile(model, backend=backend, fullgraph=True)(x)
    assert torch.equal(out, eager) and out.shape == (3, 5, 67)
    assert any("packed_linear" in o for o in ops), ops


def test_compiled_body_runs_the_fused_kernel_as_one_op():
    """use_kernel (what a CUDA plan sets; here the Triton interpreter runs the kernel): the compiled body's graph
    holds lowbit::decode_attention_tiers (one node per layer, no trace into the launcher) and gives the eager
    step's logits (the eager step calls the kernel's Python wrapper directly)."""
    from torch._dynamo.backends.registry import lookup_backend

    from lowbit.kernels.attention.common import interpreted

    if not interpreted():
        pytest.skip("the kernels were imported for CUDA (TRITON_INTERPRET=0)")
    m = _model("llama")
    plan = _plan(m, "int2")
    step = ModelStep(m)
    caches = [StaticKVCache(m, plan, slots=2, max_context=40) for _ in range(2)]
    for c in caches:
        c.use_kernel = True
        for b, n in enumerate((17, 6)):
            prefill(step, c, b, torch.arange(3, 3 + n))
    torch._dynamo.reset()
    targets = []

    def backend(gm, inputs):
        targets.extend(str(n.target) for n in gm.graph.nodes if n.op == "call_function")
        return lookup_backend("aot_eager")(gm, inputs)

    fn = compile_decode(step, caches[1], backend=backend)
    ids, active, logits = torch.tensor([[4], [9]]), torch.ones(2, dtype=torch.bool), torch.zeros(2, 99)
    ref_ids = ids.clone()
    with torch.no_grad():
        for _ in range(3):
            ref = eager_decode(step, caches[0], ref_ids, active)
            ref_ids = ref.argmax(-1, keepdim=True)
            fn(ids, active, logits, 2)
            assert float((logits - ref).abs().max() / ref.abs().max()) < 1e-5
    assert sum("decode_attention_tiers" in t for t in targets) == len(m.model.layers), targets
    assert torch.equal(ids, ref_ids) and caches[1].lens.tolist() == [20, 9]


def test_a_bucket_that_does_not_compile_is_an_error():
    """What DecodeGraphs(compile=True) runs for each bucket's first call: a body that dynamo cannot compile
    again (built for one bucket, which the first call used) raises, and so does a call that made no new graph."""
    from lowbit.runtime.step import first_compiled_call

    m = _model("llama")
    step = ModelStep(m)
    cache = StaticKVCache(m, _plan(m, "int2"), slots=2, max_context=24)
    torch._dynamo.reset()
    fn = compile_decode(step, cache, backend="aot_eager", max_buckets=1)
    ids, active, logits = torch.tensor([[4], [9]]), torch.ones(2, dtype=torch.bool), torch.zeros(2, 99)
    with torch.no_grad():
        assert first_compiled_call(fn, ids, active, logits, 2) > 0
        with pytest.raises(LowbitError, match="gave 0 graph"):  # bucket 2 again: compiled already, no new graph
            first_compiled_call(fn, ids, active, logits, 2)
        with pytest.raises(LowbitError, match="bucket 1 failed"):
            first_compiled_call(fn, ids, active, logits, 1)
    assert cache.lens.tolist() == [2, 2]
