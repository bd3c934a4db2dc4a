"""`lowbit bench decode`: end-to-end decode steps of a random-weight model of a named geometry, side by side.

Paths (one run, same model weights):
    hf-eager-bf16           transformers model.forward, DynamicCache, SDPA (what a user gets by default)
    hf-static-compile-bf16  transformers StaticCache + torch.compile(model.forward, mode="reduce-overhead")
    lowbit-bf16             lowbit runtime: StaticKVCache with nothing quantized, one CUDA graph per step
    lowbit-int4 / -int2     lowbit runtime, the packed middle read by the fused kernel, one CUDA graph
    lowbit-w4a16-int2       lowbit-int2 with the decoder linears W4A16 (RTN) on the CUDA weight kernels
    The lowbit rows run the step as `compile` says (one run, every lowbit row alike): "whole" (the default)
    torch.compile'd as one graph (Inductor, full graph, static shapes, the kernels as custom ops) before
    capture, "layers" compiled per decoder layer (runtime.step.CompiledDecode: faster to compile, a slower
    step), "off" the eager step captured; a row records compiled, compile_regions, the compile seconds and
    the graphs dynamo made.
    hf-generate-compile-lowbit-int2 / -int4 / -bf16
                            transformers' own model.generate with the lowbit GenerateCache as its cache and
                            transformers' own compile of the decode forward (its default CompileConfig:
                            torch.compile "reduce-overhead"); a row records that every decode step ran
                            compiled (else it raises), the graphs, graph breaks and CUDA-graph skips

Context: L tokens of random K/V written into each cache directly (prefill compute is not what is
timed); then decode steps, each one token per sequence. ms_per_step: median wall time of a step
(CUDA events around each step / graph replay, each started on an idle GPU, so it includes the host's
launch); gpu_ms_per_step: the kernels' own time (profiler). The captured lowbit rows add host_launch_ms and
ms_per_step_back_to_back (steps queued with no sync between them; see _launch_cost).
A row whose KV would not fit in the GPU memory left says so (fits: false) instead of running.
"""

from __future__ import annotations

import itertools
import statistics
import time

import torch

from lowbit.core.errors import LowbitError
from lowbit.kv.plan import resolve as plan_resolve
from lowbit.kv.scheme import parse_kv_scheme
from lowbit.models.geometry import ModelGeometry
from lowbit.models.random import build_model, word_tokenizer
from lowbit.runtime.fold import fold_value_rotation
from lowbit.runtime.fuse import FusedHead, fuse_projections
from lowbit.runtime.step import DecodeGraphs, ModelStep, prefill
from lowbit.serve.batch_engine import BatchEngine
from lowbit.serve.engine import GenParams, Request
from lowbit.serve.loader import Runtime
from lowbit.weights.grid import grid_for_clip, quantize_on
from lowbit.weights.qlinear import QuantLinear
from lowbit.weights.scheme import parse_weight_scheme

# transformers' generate + compile over the lowbit cache (lowbit.runtime.generate.GenerateCache)
GEN_PATHS = {"hf-generate-compile-lowbit-int2": "int2", "hf-generate-compile-lowbit-int4": "int4",
             "hf-generate-compile-lowbit-bf16": "bf16"}
PATHS = ("hf-eager-bf16", "hf-static-compile-bf16", "lowbit-bf16", "lowbit-int4", "lowbit-int2", "lowbit-w4a16-int2",
         *GEN_PATHS)
SCHEMES = {"lowbit-bf16": "bf16", "lowbit-int4": "int4", "lowbit-int2": "int2", "lowbit-w4a16-int2": "int2",
           **GEN_PATHS}
# paths whose decoder linears are weight-quantized (RTN of the random weights, through lowbit.weights.grid),
# run after the bf16-weight paths: the model is converted in place once
WEIGHT_PATHS = {"lowbit-w4a16-int2": "w4a16-g128"}
# how the lowbit rows run their captured step: DecodeGraphs(compile=..., regions=...)
COMPILE_MODES = ("whole", "layers", "off")


def quantize_linears(model, scheme_name: str, log=print, *, fuse: bool = True) -> dict:
    """Replace every decoder nn.Linear (not lm_head) by a QuantLinear (RTN on the one weight grid) and
    prepare it for the CUDA weight kernels; returns prepare_cuda's report (+ "fused_groups").
    fuse: q/k/v and gate/up stacked into one QuantLinear each before packing (lowbit.runtime.fuse), so
    each group is one W4/W8 GEMM; permanent for this model."""
    from torch import nn

    from lowbit.kernels.gemm.prepare import prepare_cuda
    sch = parse_weight_scheme(scheme_name)
    names = [n for n, m in model.model.layers.named_modules() if isinstance(m, nn.Linear)]
    for n in names:
        parent, _, child = n.rpartition(".")
        owner = model.model.layers.get_submodule(parent)
        lin = getattr(owner, child)
        w = lin.weight.detach()
        grid = grid_for_clip(w, sch.w_bits, sch.group_for(w.shape[1]), sch.symmetric, 1.0, torch.bfloat16)
        with torch.device(w.device):
            q = QuantLinear.from_codes(quantize_on(w, grid), grid, sch, bias=lin.bias, scale_dtype=torch.bfloat16)
        setattr(owner, child, q)
        del lin, w
    fused = 0
    if fuse:
        fused = fuse_projections(model).groups
    torch.cuda.empty_cache()
    rep = prepare_cuda(model, log=log)
    rep["fused_groups"] = fused
    log(f"weights {scheme_name}: {rep['modules']} linears, packed {rep['packed_bytes'] / 1e9:.2f} GB "
        f"(bf16 {rep['bf16_bytes'] / 1e9:.2f} GB), dispatch {rep['dispatch']}, "
        f"{fused} fused q/k/v + gate/up groups")
    return rep


def kv_bytes(path: str, cfg, B: int, L: int) -> int:
    """Bytes of KV the path holds for B sequences at capacity L (what decides `fits`)."""
    H, D, n = cfg.num_key_value_heads, cfg.head_dim, cfg.num_hidden_layers
    if path in ("hf-eager-bf16", "hf-static-compile-bf16", "lowbit-bf16", "hf-generate-compile-lowbit-bf16"):
        return B * L * n * H * 2 * D * 2

    s = parse_kv_scheme(SCHEMES[path])
    dense = min(L, s.sink + s.recent)
    bpe = sum(s.bits_per_element(D))  # K + V middle bits per element, scales included
    return int(B * n * H * (dense * 2 * D * 2 + max(0, L - dense) * D * bpe / 8))


def _events_time(fn, steps: int, warmup: int = 3) -> tuple[float, list[float]]:
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(steps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(a.elapsed_time(b))
    return statistics.median(times), times


def _launch_cost(fn, steps: int) -> dict:
    """What the host's launch of a step costs beside ms_per_step (each step timed from an idle GPU, so its time
    includes the launch): host_launch_ms, the median host time of one launch call started on an idle GPU; and
    ms_per_step_back_to_back, `steps` launches queued with no sync between them, / steps (a decode loop that
    keeps the next step queued hides the launch this way)."""
    host = []
    for _ in range(steps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        host.append((time.perf_counter() - t) * 1e3)
    torch.cuda.synchronize()
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    for _ in range(steps):
        fn()
    b.record()
    b.synchronize()
    return {"host_launch_ms": statistics.median(host), "ms_per_step_back_to_back": a.elapsed_time(b) / steps}


def _gpu_busy(fn, n: int = 3, top: int = 0):
    """(kernel ms per call, [(kernel, ms per call, launches per call)] of the `top` largest) from the profiler."""
    try:
        with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
            for _ in range(n):
                fn()
            torch.cuda.synchronize()
        ev = prof.key_averages()
        busy = sum(e.self_device_time_total for e in ev) / n / 1e3
        rows = sorted(((e.key[:80], e.self_device_time_total / n / 1e3, e.count / n) for e in ev
                       if e.self_device_time_total > 0), key=lambda r: -r[1])
        return busy, [[k, round(ms, 4), c] for k, ms, c in rows[:top]]
    except Exception:  # noqa: BLE001 -- a profiler that cannot trace graphs: say "not measured"
        return None, []


def _fill_static(cache, L: int, gen) -> None:
    """Random K/V for positions [0, L) of every slot, written into the tiers (middle through the codec)."""
    dt = cache.dtype

    def r(*shape):
        return torch.randn(*shape, device=cache.device, dtype=dt, generator=gen)

    for layer in cache.layers:
        B, H = cache.slots, layer.H
        layer.sink_k.copy_(r(*layer.sink_k.shape))
        layer.sink_v.copy_(r(*layer.sink_v.shape))
        layer.ring_k.copy_(r(*layer.ring_k.shape))
        layer.ring_v.copy_(r(*layer.ring_v.shape))
        if layer.kind == "dense":
            for t in ("k", "v"):
                buf = layer.mid[t]["dense"]
                for a in range(0, L, 4096):
                    c = min(4096, L - a)
                    buf[:, :, a:a + c] = r(B, H, c, buf.shape[-1])
        elif layer.kind == "tiers":
            n_mid = max(0, min(L - layer.S - layer.R, layer.C))
            for t, codec in (("k", layer.k_codec), ("v", layer.v_codec)):
                for a in range(0, n_mid, 2048):
                    c = min(2048, n_mid - a)
                    enc = codec.encode(r(B, H, c, codec.head_dim), dt, checks=False)
                    for name, val in enc.items():
                        layer.mid[t][name][:, :, a:a + c] = val
    cache.lens.fill_(L)


def _row_lowbit(path, model, cfg, B, L, steps, *, fuse=True, fold=True, inductor_pdl=None, compile="whole"):
    from lowbit.runtime.static_cache import StaticKVCache
    geo = ModelGeometry.from_config(cfg, name="random-llama")
    plan = plan_resolve(SCHEMES[path], geo, device="cuda")
    # every replay writes one token a slot: the warm-up (3), the timed steps, the profiler's (3) and _launch_cost's
    # (2 x steps) all stay inside the capacity (past it the step writes a spare row and its tiers stop growing)
    cache = StaticKVCache(model, plan, slots=B, max_context=L + 3 * steps + 16)
    compiled = compile != "off"
    if compiled:  # a fresh dynamo state: each row's new cache object would count as a recompile of the body
        torch._dynamo.reset()
        torch._dynamo.utils.counters.clear()
    t = time.perf_counter()
    step = ModelStep(model, fuse=fuse)  # in place for this row only: the hf rows run the model as it was built
    folded = None
    try:
        # V's rotation into v_proj / o_proj (lowbit.runtime.fold), undone after the row as the fusion is
        folded = fold_value_rotation(model, cache) if fold else None
        graphs = DecodeGraphs(step, cache, buckets=(B,), compile=compiled,  # on the empty cache, then fill
                              inductor_pdl=inductor_pdl if compiled else False,
                              regions=compile if compiled else "whole")
        capture_s = time.perf_counter() - t
        row = _time_lowbit_row(graphs, cache, plan, step, B, L, steps, capture_s)
        row["folded_value_rotation"] = len(folded.layers) if folded else 0
        row["fold_skipped"] = folded.skipped[:3] if folded else []
        return row
    finally:
        if folded is not None:
            folded.undo()
        step.unfuse()


def _time_lowbit_row(graphs, cache, plan, step, B, L, steps, capture_s) -> dict:
    _fill_static(cache, L, torch.Generator(device="cuda").manual_seed(1))
    graphs.active[:B] = True

    def fn():
        graphs.replay(B)

    ms, times = _events_time(fn, steps)
    busy, top = _gpu_busy(fn, top=12)
    row = {"ms_per_step": ms, "step_ms": times, "gpu_ms_per_step": busy, "top_kernels": top,
           **_launch_cost(fn, steps), "kv_bytes": cache.bytes_held(), "compiled_writes": cache.compile_writes,
           "capture_s": capture_s, "decode_backends": sorted(plan.backend_names("decode")),
           "attention": "fused Triton kernel" if cache.use_kernel else "SDPA with a length mask",
           "compiled": graphs.compiled, "compile_regions": graphs.regions,
           "fused_projections": sum(isinstance(m, FusedHead) for m in step.model.modules()),
           "unfused": step.fused.skipped[:3] if step.fused else []}
    if graphs.compiled:
        counters = torch._dynamo.utils.counters
        row["ran"] = {"compile": "torch.compile inductor fullgraph dynamic=False, no inductor cudagraphs, "
                                 "emulate_precision_casts" + (", inductor PDL" if graphs.inductor_pdl else "")
                                 + "; then one torch.cuda.CUDAGraph",
                      "compile_s": graphs.compile_s, "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
                      "graph_breaks": {k: int(v) for k, v in counters["graph_break"].items()}}
    return row


def _row_hf(path, model, cfg, B, L, steps):
    from transformers import DynamicCache, StaticCache

    from lowbit.runtime.cache import cache_kwargs

    model.set_attn_implementation("sdpa")
    H, D = cfg.num_key_value_heads, cfg.head_dim
    gen = torch.Generator(device="cuda").manual_seed(1)
    if path == "hf-eager-bf16":
        cache = DynamicCache(config=cfg)
    else:
        cache = StaticCache(config=cfg, max_cache_len=L + steps + 16)
    for i in range(cfg.num_hidden_layers):
        for a in range(0, L, 4096):
            c = min(4096, L - a)
            k = torch.randn(B, H, c, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            v = torch.randn(B, H, c, D, device="cuda", dtype=torch.bfloat16, generator=gen)
            cache.update(k, v, i, {"cache_position": torch.arange(a, a + c, device="cuda")})
    ids = torch.randint(0, cfg.vocab_size, (B, 1), device="cuda")
    pos = [L]
    kw = cache_kwargs(model, cache)
    fwd = model.forward
    capture_s = None
    if path == "hf-static-compile-bf16":
        fwd = torch.compile(model.forward, mode="reduce-overhead")

    @torch.no_grad()
    def fn():
        p = pos[0]
        cp = torch.tensor([p], device="cuda")
        out = fwd(input_ids=ids, position_ids=cp.expand(B, 1), cache_position=cp, use_cache=True, **kw)
        ids.copy_(out.logits[:, -1:].argmax(-1))
        pos[0] = p + 1

    t = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    capture_s = time.perf_counter() - t
    ms, times = _events_time(fn, steps)
    busy, top = _gpu_busy(fn, top=8)
    row = {"ms_per_step": ms, "step_ms": times, "gpu_ms_per_step": busy, "top_kernels": top,
           "kv_bytes": kv_bytes(path, cfg, B, L), "capture_s": capture_s, "attention": "sdpa"}
    del cache
    return row


def _row_hf_generate(path, model, cfg, B, L, steps, warm: int = 6, compile_config=None):
    """transformers' model.generate over a GenerateCache holding L random tokens per sequence (written into
    the tiers as _fill_static does), continued by `steps` greedy tokens with transformers' own compile of the
    decode forward. Per step: CUDA events recorded by a logits processor (once per generate iteration, on
    the stream, no sync), so ms_per_step is the whole iteration a user gets (compiled forward + generate's
    own per-token work). gpu_ms_per_step: profiler kernel time of a generate of warm + steps tokens minus one
    of warm tokens, per token (the one-token continuation prefill cancels out). compile_config: None for
    transformers' default (what a user who only swaps the cache gets), or a transformers.CompileConfig."""
    from transformers import LogitsProcessor, LogitsProcessorList

    from lowbit.runtime.cache import cache_kwargs
    from lowbit.runtime.generate import GenerateCache

    dev = next(model.parameters()).device  # cuda; cpu only for the CPU smoke test of this harness
    cuda = dev.type == "cuda"
    geo = ModelGeometry.from_config(cfg, name="random-llama")
    plan = plan_resolve(GEN_PATHS[path], geo, device=dev.type)
    cache = GenerateCache(model, plan, batch=B, max_context=L + 1 + warm + steps + 16)
    _fill_static(cache, L, torch.Generator(device=dev).manual_seed(1))
    # the whole sequence, as transformers continues a cache: it slices off the L tokens the cache holds
    # ids >= 3: a pad id (0) in the prompt would make generate infer a padding mask
    ids = torch.randint(3, cfg.vocab_size, (B, L + 1), device=dev, generator=torch.Generator(device=dev).manual_seed(2))

    class Stamp(LogitsProcessor):
        def __init__(self):
            self.events = []

        def __call__(self, input_ids, scores):
            if cuda:
                e = torch.cuda.Event(enable_timing=True)
                e.record()
            else:
                e = time.perf_counter()
            self.events.append(e)
            return scores

    def sync():
        if cuda:
            torch.cuda.synchronize()

    def gen(n, stamp=None):
        cache.lens.fill_(L)  # the same context every call (the tiers keep the random history)
        cache._decoding = False
        procs = LogitsProcessorList([stamp] if stamp else [])
        eos = model.generation_config.eos_token_id
        model.generation_config.eos_token_id = None  # exactly n tokens, no end-of-sequence bookkeeping
        try:
            with torch.no_grad():
                model.generate(ids, max_new_tokens=n, do_sample=False, pad_token_id=0, logits_processor=procs,
                               compile_config=compile_config, **cache_kwargs(model, cache))
        finally:
            model.generation_config.eos_token_id = eos

    # a fresh compile: the hf-static-compile row compiled the same forward (transformers' decorated
    # LlamaForCausalLM.forward), and a recompile of it would be made shape-dynamic ("automatic dynamic")
    torch._dynamo.reset()
    counters = torch._dynamo.utils.counters
    counters.clear()
    t = time.perf_counter()
    gen(warm)  # transformers compiles the decode forward here (and CUDA graphs record on the next calls)
    sync()
    compile_s = time.perf_counter() - t
    gen(warm)
    cache.reset_runs()
    stamp = Stamp()
    t = time.perf_counter()
    gen(steps + 1, stamp)
    sync()
    wall = time.perf_counter() - t
    cache.check()  # no step ran past the capacity
    if cache.runs["eager_decode_steps"] or not hasattr(model, "_compiled_call"):
        raise LowbitError(f"{path}: {cache.runs['eager_decode_steps']} decode steps ran eagerly: transformers did not "
                          "compile the decode forward (a result must name what ran)")
    ev = stamp.events
    times = [a.elapsed_time(b) if cuda else (b - a) * 1e3 for a, b in itertools.pairwise(ev[1:])]  # after the first
    busy_a, _ = _gpu_busy(lambda: gen(warm), n=1) if cuda else (None, [])
    busy_b, top = _gpu_busy(lambda: gen(warm + steps), n=1, top=12) if cuda else (None, [])
    busy = (busy_b - busy_a) / steps if busy_a is not None and busy_b is not None else None
    top = [[k, round(ms / (warm + steps), 4), c / (warm + steps)] for k, ms, c in top]  # per token, prefill included
    skips = int(counters["inductor"].get("cudagraph_skips", 0))
    row = {"ms_per_step": statistics.median(times), "step_ms": times, "gpu_ms_per_step": busy, "top_kernels": top,
           "kv_bytes": cache.bytes_held(), "capture_s": compile_s, "wall_ms_per_step": wall * 1e3 / (steps + 1),
           "decode_backends": sorted(plan.backend_names("decode")),
           "attention": "fused Triton kernel (custom op in the compiled graph)" if cache.use_kernel else
                        "torch over the tiers (compiled)",
           "ran": {"compiled_decode_steps": steps, "eager_decode_steps": cache.runs["eager_decode_steps"],
                   "compile_config": "transformers default (torch.compile mode reduce-overhead, fullgraph False)"
                                     if compile_config is None else str(compile_config.to_dict()),
                   "unique_graphs": int(counters["stats"].get("unique_graphs", 0)),
                   "graph_breaks": {k: int(v) for k, v in counters["graph_break"].items()},
                   "cudagraph_skips": skips,
                   "cudagraphs": skips == 0}}
    return row


def prefill_rows(model, cfg, L: int, chunk: int, log=print) -> list[dict]:
    """One L-token prompt: transformers' own bf16 forward (SDPA, DynamicCache, chunks of `chunk`) against
    the lowbit runtime's prefill into a StaticKVCache slot (bf16 and int2), tokens/s of each."""
    from transformers import DynamicCache

    from lowbit.runtime.cache import cache_kwargs
    from lowbit.runtime.static_cache import StaticKVCache
    ids = torch.randint(0, cfg.vocab_size, (L,), device="cuda", generator=torch.Generator(device="cuda").manual_seed(2))
    out = []

    def timed(fn):
        fn()  # warm-up (kernel compilation, lazy inits)
        torch.cuda.synchronize()
        t = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        return time.perf_counter() - t

    def hf():
        model.set_attn_implementation("sdpa")
        cache = DynamicCache(config=cfg)
        with torch.no_grad():
            for a in range(0, L, chunk):
                model(ids[None, a:a + chunk], use_cache=True, logits_to_keep=1, **cache_kwargs(model, cache))

    s = timed(hf)
    out.append({"path": "hf-bf16-prefill", "L": L, "chunk": chunk, "seconds": s, "tok_s": L / s})
    log(f"prefill hf-bf16 L{L} chunk {chunk}: {L / s:.0f} tok/s")
    geo = ModelGeometry.from_config(cfg, name="random-llama")
    def lowbit_seconds(kv: str) -> float:
        cache = StaticKVCache(model, plan_resolve(kv, geo, device="cuda"), slots=1, max_context=L + 16)
        step = ModelStep(model)

        def go():
            cache.reset_slot(0)
            prefill(step, cache, 0, ids, chunk=chunk)

        return timed(go)

    for kv in ("bf16", "int2"):
        s = lowbit_seconds(kv)
        torch.cuda.empty_cache()
        out.append({"path": f"lowbit-{kv}-prefill", "L": L, "chunk": chunk, "seconds": s, "tok_s": L / s})
        log(f"prefill lowbit-{kv} L{L} chunk {chunk}: {L / s:.0f} tok/s")
    return out


def run(geometry: str, batches, contexts, paths, *, steps: int = 20, log=print, prefill_len: int = 0,
        prefill_chunk: int = 2048, fuse: bool = True, fold: bool = True, inductor_pdl: bool | None = None,
        compile: str = "whole") -> dict:
    """Every (path, B, L) row; rows that do not fit in the GPU memory left are recorded with fits false.
    prefill_len > 0 also times one prompt of that many tokens (`prefill` list of the result). fuse: the
    lowbit runtime rows with q/k/v and gate/up as one GEMM each (lowbit.runtime.fuse), as the runtime runs;
    fold: with V's rotation folded into v_proj / o_proj (lowbit.runtime.fold), likewise. inductor_pdl: the
    compiled rows with Inductor's PDL codegen (True / False; None: where this torch has it, as the runtime runs;
    runtime.step.resolve_inductor_pdl). compile: how every lowbit row runs its step (COMPILE_MODES, module
    docstring)."""
    import transformers

    if compile not in COMPILE_MODES:
        raise LowbitError(f"compile {compile!r} unknown; use one of {', '.join(COMPILE_MODES)}")

    for p in paths:
        if p not in PATHS:
            raise LowbitError(f"unknown path {p!r}; use {', '.join(PATHS)}")
    if not torch.cuda.is_available():
        raise LowbitError("bench decode needs a CUDA GPU (it times captured decode steps)")
    model, cfg = build_model(geometry, "cuda")
    weights = sum(p.numel() * p.element_size() for p in model.parameters())
    env = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "transformers": transformers.__version__,
           "geometry": geometry, "weights_bytes": weights, "steps": steps, "fuse_projections": fuse,
           "fold_value_rotation": fold, "lowbit_compile": compile}
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    rows = []
    pre = prefill_rows(model, cfg, prefill_len, prefill_chunk, log) if prefill_len else []
    order = [p for p in paths if p not in WEIGHT_PATHS] + [p for p in paths if p in WEIGHT_PATHS]
    if len({WEIGHT_PATHS[p] for p in order if p in WEIGHT_PATHS}) > 1:
        raise LowbitError("one weight-quantized path per run (the model is converted in place)")
    groups = [[p for p in order if p not in WEIGHT_PATHS], [p for p in order if p in WEIGHT_PATHS]]
    for group in groups:
        if group and group[0] in WEIGHT_PATHS:
            env["weights"] = {"scheme": WEIGHT_PATHS[group[0]],
                              **quantize_linears(model, WEIGHT_PATHS[group[0]], log, fuse=fuse)}
        _rows_for(group, model, cfg, contexts, batches, steps, rows, log, fuse, fold, inductor_pdl, compile)
    return {"env": env, "rows": rows, "prefill": pre}


def _rows_for(paths, model, cfg, contexts, batches, steps, rows, log, fuse=True, fold=True, inductor_pdl=None,
              compile="whole"):
    for L in contexts:
        for B in batches:
            for path in paths:
                need = kv_bytes(path, cfg, B, L)
                free, _ = torch.cuda.mem_get_info()
                base = {"path": path, "B": B, "L": L}
                if need > free - 6 * 2**30:
                    rows.append({**base, "fits": False, "kv_bytes": need, "ms_per_step": None, "tok_s": None,
                                 "gpu_ms_per_step": None, "peak_gb": None,
                                 "note": f"KV {need / 1e9:.1f} GB > {free / 1e9:.1f} GB free - 6 GiB"})
                    log(f"{path} B{B} L{L}: does not fit ({need / 1e9:.1f} GB KV)")
                    continue
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats()
                try:
                    if path in GEN_PATHS or path.startswith("hf-"):
                        r = (_row_hf_generate if path in GEN_PATHS else _row_hf)(path, model, cfg, B, L, steps)
                    else:
                        r = _row_lowbit(path, model, cfg, B, L, steps, fuse=fuse, fold=fold, inductor_pdl=inductor_pdl,
                                        compile=compile)
                except torch.cuda.OutOfMemoryError as e:
                    rows.append({**base, "fits": False, "kv_bytes": need, "ms_per_step": None, "tok_s": None,
                                 "gpu_ms_per_step": None, "peak_gb": None, "note": f"out of memory: {str(e)[:120]}"})
                    log(f"{path} B{B} L{L}: out of memory")
                    continue
                r = {**base, "fits": True, "tok_s": B * 1e3 / r["ms_per_step"],
                     "peak_gb": torch.cuda.max_memory_allocated() / 1e9, **r}
                rows.append(r)
                for k, ms, c in r.get("top_kernels", [])[:12]:
                    log(f"    {ms:7.3f} ms  x{c:<6g} {k}")
                launch = (f", host launch {r['host_launch_ms']:.2f} ms, back to back {r['ms_per_step_back_to_back']:.2f}"
                          f" ms/step" if "host_launch_ms" in r else "")
                log(f"{path} B{B} L{L}: {r['ms_per_step']:.2f} ms/step ({r['tok_s']:.0f} tok/s), GPU busy "
                    f"{r['gpu_ms_per_step'] or float('nan'):.2f} ms, KV {r['kv_bytes'] / 1e9:.2f} GB{launch}")
                torch.cuda.empty_cache()


def engine_load(geometry: str, concurrency, *, prompt_len: int, max_tokens: int, kv: str = "int2",
                device: str = "cuda", prefill_chunk: int = 2048, log=print) -> dict:
    """The serving engine (lowbit.serve.batch_engine.BatchEngine) in-process at each concurrency C:
    C requests of a random `prompt_len`-token prompt, greedy, `max_tokens` each, submitted at once.
    Per C: end-to-end output tok/s, steady decode tok/s (while all C decode), time to first token and
    inter-token latency p50/p99 (from the streamed deltas). No HTTP: the engine the server runs."""
    import threading

    model, cfg = build_model(geometry, device, dtype=torch.bfloat16 if device == "cuda" else torch.float32)
    slots = max(concurrency)
    rt = Runtime(model=model, tokenizer=word_tokenizer(cfg.vocab_size), geometry=ModelGeometry.from_config(cfg, name=geometry),
                 name=geometry, scheme=parse_kv_scheme(kv), weights=None, max_context=prompt_len + max_tokens + 16,
                 eos_token_ids=[])
    t0 = time.perf_counter()
    engine = BatchEngine(rt, slots=slots, prefill_chunk=prefill_chunk)
    start_s = time.perf_counter() - t0
    engine.start()
    g = torch.Generator().manual_seed(5)
    rows = []
    try:
        for C in concurrency:
            done = threading.Event()
            stamps: dict[str, list[float]] = {}
            left = [C]
            lock = threading.Lock()

            def make_emit(rid, stamps=stamps, lock=lock, left=left, done=done):
                def emit(kind, payload):
                    now = time.perf_counter()
                    if kind == "delta":
                        stamps[rid].append(now)
                    elif kind in ("done", "error"):
                        with lock:
                            left[0] -= 1
                            if left[0] == 0:
                                done.set()
                return emit

            t_submit = time.perf_counter()
            for i in range(C):
                rid = f"r{C}-{i}"
                stamps[rid] = []
                ids = torch.randint(0, cfg.vocab_size, (prompt_len,), generator=g).tolist()
                engine.submit(Request(prompt_ids=ids, params=GenParams(max_tokens=max_tokens, temperature=0.0),
                                      emit=make_emit(rid), id=rid))
            done.wait()
            t_end = time.perf_counter()
            ttft = sorted(s[0] - t_submit for s in stamps.values() if s)
            itl = sorted(b - a for s in stamps.values() for a, b in itertools.pairwise(s))
            tokens = sum(len(s) for s in stamps.values())
            all_in = max(s[0] for s in stamps.values() if s)  # every request is decoding from here ...
            first_out = min(s[-1] for s in stamps.values() if s)  # ... until the first one finishes
            steady = sum(sum(1 for t in s if all_in < t <= first_out) for s in stamps.values())

            def pct(xs, q):
                return 1e3 * xs[min(len(xs) - 1, int(q * len(xs)))] if xs else None

            row = {"concurrency": C, "prompt_tokens": prompt_len, "max_tokens": max_tokens, "out_tokens": tokens,
                   "wall_s": t_end - t_submit, "out_tok_s": tokens / (t_end - t_submit),
                   "decode_tok_s": steady / (first_out - all_in) if first_out > all_in else None,
                   "ttft_p50_ms": pct(ttft, 0.5), "ttft_p99_ms": pct(ttft, 0.99),
                   "itl_p50_ms": pct(itl, 0.5), "itl_p99_ms": pct(itl, 0.99), "path": engine.path}
            rows.append(row)
            log(f"engine C{C}: {row['out_tok_s']:.0f} out tok/s, decode {row['decode_tok_s'] or float('nan'):.0f} tok/s, "
                f"TTFT p50 {row['ttft_p50_ms']:.0f} ms p99 {row['ttft_p99_ms']:.0f} ms, "
                f"ITL p50 {row['itl_p50_ms']:.1f} ms p99 {row['itl_p99_ms']:.1f} ms")
    finally:
        engine.stop()
    path = engine.path
    del engine
    ref = None
    if device == "cuda":  # the captured decode benchmark at B = slots, same context, same process
        torch.cuda.empty_cache()
        ref = {"path": f"lowbit-{kv}", "B": slots, "L": prompt_len,
               **_row_lowbit(f"lowbit-{kv}", model, cfg, slots, prompt_len, max_tokens)}
        ref["tok_s"] = slots * 1e3 / ref["ms_per_step"]
        log(f"decode benchmark B{slots} L{prompt_len}: {ref['ms_per_step']:.2f} ms/step ({ref['tok_s']:.0f} tok/s)")
    return {"geometry": geometry, "kv": kv, "slots": slots, "engine": path, "engine_start_s": start_s,
            "rows": rows, "decode_benchmark": ref}
