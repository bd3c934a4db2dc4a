"""DecodeGraphs(compile=True) on CUDA (skipped elsewhere): the Inductor-compiled body, captured, follows the
eager step. Inductor fuses bf16 ops (RMSNorm, RoPE, SiLU*mul, casts) and rounds unlike eager, so the two
are fed the same tokens (the eager step's greedy ones) and compared at fp tolerance per step; the stored
codes agree but for rounding ties. Mirrors test_gpu_runtime.py (the eager captured step)."""

import pytest
import torch

from tests.runtime.test_gpu_runtime import _kernels_compiled, _model

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
pytestmark = [pytest.mark.gpu, cuda]


def _with_key_affine(plan):
    """Every layer of `plan` with a synthetic key affine (pair-equal scales, a shift): what lowbit tune's
    key-affine recipes give the runtime, without fitting one."""
    from dataclasses import replace

    from lowbit.kv.key_affine import KeyAffine

    g = torch.Generator().manual_seed(5)
    layers = []
    for lp in plan.layers:
        H, D = lp.geometry.num_kv_heads, lp.geometry.head_dim_k
        half = torch.exp(0.3 * torch.randn(H, D // 2, generator=g))
        layers.append(replace(lp, k_affine=KeyAffine(torch.cat([half, half], -1), 0.5 * torch.randn(H, D, generator=g))))
    return replace(plan, layers=tuple(layers))


def _follow(model, cfg, kv, steps=40, key_affine=False, inductor_pdl=False, regions="whole"):
    """Eager reference cache and compiled captured cache over 3 ragged prompts + 1 inactive slot, teacher
    forced by the reference's tokens -> (ref cache, captured cache, graphs, max relative logit error)."""
    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.runtime.static_cache import StaticKVCache
    from lowbit.runtime.step import DecodeGraphs, ModelStep, eager_decode, prefill

    plan = resolve(kv, ModelGeometry.from_config(cfg, name="tiny"), device="cuda")
    if key_affine:
        plan = _with_key_affine(plan)
    step = ModelStep(model)
    g = torch.Generator(device="cuda").manual_seed(0)
    prompts = [torch.randint(0, cfg.vocab_size, (n,), device="cuda", generator=g) for n in (700, 333, 999)]
    ref_c, cap_c = (StaticKVCache(model, plan, slots=4, max_context=1200) for _ in range(2))
    torch._dynamo.reset()
    graphs = DecodeGraphs(step, cap_c, buckets=(1, 4), compile=True, inductor_pdl=inductor_pdl,  # on the empty cache
                          regions=regions)
    assert graphs.compiled and sorted(graphs.compile_s) == [1, 4]
    for c in (ref_c, cap_c):
        for b, p in enumerate(prompts):
            prefill(step, c, b, p, chunk=256)
    ids = torch.stack([p[-1] for p in prompts] + [prompts[0][0]])[:, None]
    active = torch.tensor([True, True, True, False], device="cuda")
    graphs.active[:4] = active
    err = 0.0
    for _ in range(steps):
        graphs.ids[:4] = ids
        lg = eager_decode(step, ref_c, ids, active)
        graphs.replay(4)
        err = max(err, float((lg[:3] - graphs.logits[:3]).abs().max() / lg[:3].abs().max()))
        ids = torch.where(active[:, None], lg.argmax(-1, keepdim=True), ids)
    assert torch.equal(ref_c.lens, cap_c.lens) and ref_c.lens.tolist() == [700 + steps, 333 + steps, 999 + steps, 0]
    return ref_c, cap_c, graphs, err


@pytest.mark.parametrize("kv", ["int2", "int4", "bf16", "int2-scale-only", "int2-scale-only-mse"])
def test_compiled_captured_step_follows_the_eager_step(kv):
    if kv != "bf16" and not _kernels_compiled():
        pytest.skip("the fused kernel was imported under the Triton interpreter")
    model, cfg = _model()
    if kv.startswith("int2-scale-only"):  # no zero stored; the kernel and its op take the centre code
        from lowbit.kv.scheme import parse_kv_scheme

        # grid mse: each group's step searched at write time, inside the captured step (what is stored is the same)
        kv = parse_kv_scheme("int2", zero="none", grid="mse" if kv.endswith("-mse") else None)
    ref_c, cap_c, _, err = _follow(model, cfg, kv)
    assert err < 2e-2, err
    assert cap_c.use_kernel == (kv != "bf16")
    if not isinstance(kv, str):
        assert all("zero" not in lay.mid[t] for lay in cap_c.layers for t in ("k", "v"))
    for a, b in zip(ref_c.layers, cap_c.layers):
        for t in ("k", "v"):
            for name in a.mid[t]:
                x, y = a.mid[t][name][:3, :, :a.C], b.mid[t][name][:3, :, :a.C]
                assert float((x == y).float().mean()) > 0.995, (t, name)


def test_compiled_captured_step_with_a_key_affine():
    """A key-affine int2 plan: keys mapped at ingest and queries at read inside the compiled, captured step
    follow the eager step (the CPU test checks the eager step against QuantizedKVCache)."""
    if not _kernels_compiled():
        pytest.skip("the fused kernel was imported under the Triton interpreter")
    model, cfg = _model()
    ref_c, cap_c, _, err = _follow(model, cfg, "int2", steps=12, key_affine=True)
    assert err < 2e-2, err
    assert cap_c.use_kernel and all(layer.k_affine is not None for layer in cap_c.layers)


@pytest.mark.parametrize("inductor_pdl", [False, True])
def test_compiled_captured_step_with_w4a16_linears(inductor_pdl):
    """The packed-weight linears (CUDA weight kernels, PDL-launched) as the lowbit::packed_linear op inside the
    compiled graph: the same logits as the eager step over the same quantized model; also with Inductor's PDL
    codegen, whose kernels then sit between lowbit's PDL-aware CUDA kernels and its Triton attention kernels."""
    if not _kernels_compiled():
        pytest.skip("the fused kernel was imported under the Triton interpreter")
    from lowbit.runtime.step import inductor_pdl_missing
    from lowbit.tools.bench.runtime import quantize_linears

    if inductor_pdl and inductor_pdl_missing():
        pytest.skip(inductor_pdl_missing())
    model, cfg = _model()
    quantize_linears(model, "w4a16-g128", log=lambda *a: None)
    _, _, graphs, err = _follow(model, cfg, "int2", steps=12, inductor_pdl=inductor_pdl)
    assert err < 2e-2, err
    assert graphs.inductor_pdl == inductor_pdl


def test_compiled_captured_step_with_inductor_pdl():
    """Inductor's PDL codegen over the int2 step (bf16 linears): follows the eager step as without it."""
    from lowbit.runtime.step import inductor_pdl_missing

    if not _kernels_compiled():
        pytest.skip("the fused kernel was imported under the Triton interpreter")
    if inductor_pdl_missing():
        pytest.skip(inductor_pdl_missing())
    model, cfg = _model()
    _, _, _, err = _follow(model, cfg, "int2", inductor_pdl=True)
    assert err < 2e-2, err


def test_per_layer_regions_follow_the_eager_step():
    """regions="layers" (one compiled decoder layer for every layer: the faster compile) follows the eager step as
    the one-graph default does."""
    if not _kernels_compiled():
        pytest.skip("the fused kernel was imported under the Triton interpreter")
    model, cfg = _model()
    _, _, graphs, err = _follow(model, cfg, "int2", steps=12, regions="layers")
    assert err < 2e-2, err
    assert graphs.regions == "layers"


def test_a_recompile_is_an_error_not_an_eager_step():
    """A dynamo state that cannot compile another graph (the recompile limit, one graph per bucket, already used
    by another cache's graph): DecodeGraphs(compile=True) raises instead of capturing an eager body."""
    from lowbit.core.errors import LowbitError
    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry
    from lowbit.runtime.static_cache import StaticKVCache
    from lowbit.runtime.step import DecodeGraphs, ModelStep

    model, cfg = _model()
    plan = resolve("int2", ModelGeometry.from_config(cfg, name="tiny"), device="cuda")
    step = ModelStep(model)
    torch._dynamo.reset()
    DecodeGraphs(step, StaticKVCache(model, plan, slots=2, max_context=300), buckets=(2,), compile=True)
    with pytest.raises(LowbitError, match="graph"):
        DecodeGraphs(step, StaticKVCache(model, plan, slots=2, max_context=300), buckets=(1,), compile=True)
