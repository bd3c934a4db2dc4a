"""The model step the runtime runs: transformers' own modules and weights, driven without generate().

    step = ModelStep(model)                       # refuses a family it has no path for (names those it has)
    logits = step(input_ids, position_ids, cache)  # embeddings -> every decoder layer -> norm -> lm_head
    step = ModelStep(model, fuse=True)            # q/k/v and gate/up as one GEMM each (runtime.fuse), in place
    graphs = DecodeGraphs(step, cache, buckets=(1, 2, 4, 8, 16))   # one CUDA graph per batch bucket
    graphs.replay(batch)                          # one greedy decode step for slots [0, bucket)
    graphs = DecodeGraphs(step, cache, compile=True)  # the same step torch.compile'd (Inductor), then captured

Why not model.forward: the top-level forward builds masks and reads lengths on the host (a sync per
step); the runtime's cache builds its own masks from device lengths, so the step calls the decoder
layers directly with attention_mask None. The model code stays transformers' (attention, RoPE, MLP,
norms): only the loop over layers is here. Families (FAMILIES) differ only in how position
embeddings are made (one rotary for all layers, or one per layer type) and in final soft-capping.
"""

from __future__ import annotations

import functools
import inspect

import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.ops import register_packed_linears
from lowbit.models import families
from lowbit.runtime.fuse import fuse_projections

# model_type -> how its position embeddings are built ("shared": one rotary for every layer;
# "per-type": rotary_emb(x, pos, layer_type) or a separate local rotary for sliding layers), declared by
# each family (lowbit.models.families: one file per family)
FAMILIES = families.by_model_type("step")


class ModelStep:
    """One forward of a transformers causal LM over the lowbit runtime cache (module docstring)."""

    def __init__(self, model, *, fuse: bool = False):
        cfg = getattr(model, "config", None)
        mt = getattr(cfg, "model_type", None)
        if mt not in FAMILIES:
            raise LowbitError(f"model type {mt!r} has no runtime step; families with one: {', '.join(sorted(FAMILIES))}")
        inner = getattr(model, "model", None)
        if inner is not None and hasattr(inner, "language_model"):
            inner = inner.language_model
        if inner is None or not hasattr(inner, "layers") or not hasattr(model, "lm_head"):
            raise LowbitError(f"{type(model).__name__}: expected .model.layers and .lm_head (a causal LM)")
        self.model, self.inner, self.lm_head = model, inner, model.lm_head
        self.config = getattr(inner, "config", cfg)
        params = inspect.signature(inner.layers[0].forward).parameters
        self.cache_kw = "cache" if "cache" in params else "past_key_values"  # 5.24 renamed it
        self.layer_types = list(getattr(self.config, "layer_types", None) or ["full_attention"] * len(inner.layers))
        self.kind = FAMILIES[mt]
        rot = getattr(inner, "rotary_emb", None)
        self.typed_rotary = rot is not None and "layer_type" in inspect.signature(rot.forward).parameters
        self.softcap = getattr(self.config, "final_logit_softcapping", None)
        # fuse=True: q/k/v and gate/up as one GEMM each (lowbit.runtime.fuse), in place until unfuse()
        self.fused = None
        if fuse:
            self.fused = fuse_projections(model)

    def unfuse(self) -> None:
        """Put the model's original projection modules back (after fuse=True)."""
        if self.fused is not None:
            self.fused.undo()
            self.fused = None

    def _position_embeddings(self, h: torch.Tensor, position_ids: torch.Tensor) -> list:
        inner = self.inner
        if self.kind == "shared":
            pe = inner.rotary_emb(h, position_ids)
            return [pe] * len(inner.layers)
        if self.typed_rotary:
            per = {t: inner.rotary_emb(h, position_ids, t) for t in set(self.layer_types)}
            return [per[t] for t in self.layer_types]
        glob = inner.rotary_emb(h, position_ids)
        local = inner.rotary_emb_local(h, position_ids) if hasattr(inner, "rotary_emb_local") else glob
        return [local if t == "sliding_attention" else glob for t in self.layer_types]

    def __call__(self, input_ids: torch.Tensor, position_ids: torch.Tensor, cache, *, last_only: bool = True):
        """input_ids, position_ids [B, L] -> logits [B, V] (last position) or [B, L, V], float32."""
        h, pes = self.embed(input_ids, position_ids)
        for layer, pe in zip(self.inner.layers, pes):
            h = self.layer_forward(layer, h, position_ids, pe, cache)
        return self.head(h, last_only=last_only)

    def embed(self, input_ids: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, list]:
        """input_ids, position_ids [B, L] -> (hidden [B, L, hidden], one (cos, sin) per layer)."""
        h = self.inner.embed_tokens(input_ids)
        return h, self._position_embeddings(h, position_ids)

    def layer_forward(self, layer, h: torch.Tensor, position_ids: torch.Tensor, pe, cache) -> torch.Tensor:
        """One transformers decoder layer over the runtime cache: hidden [B, L, hidden] -> [B, L, hidden]."""
        out = layer(h, attention_mask=None, position_ids=position_ids, position_embeddings=pe,
                    **{self.cache_kw: cache})
        return out[0] if isinstance(out, tuple) else out

    def head(self, h: torch.Tensor, *, last_only: bool = True) -> torch.Tensor:
        """hidden [B, L, hidden] -> logits [B, V] (last position) or [B, L, V], float32 (final norm, soft-cap)."""
        h = self.inner.norm(h)
        if last_only:
            h = h[:, -1]
        logits = self.lm_head(h).float()
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits


DEFAULT_BUCKETS = (1, 2, 4, 8, 16, 32, 64)


def decode_body(step: ModelStep, cache, ids: torch.Tensor, active: torch.Tensor, logits: torch.Tensor, b: int) -> None:
    """One greedy decode step for slots [0, b), in place: what a DecodeGraphs graph holds (eager or compiled).

    ids [>=b, 1] long: the last token of each slot in, the argmax out where active [>=b] (else kept);
    logits [>=b, V] float32: this step's logits; cache.lens[:b] += active[:b]. b: a python int (the bucket).
    """
    h, pos, pes = decode_in(step, cache, ids, b)
    for layer, pe in zip(step.inner.layers, pes):
        h = step.layer_forward(layer, h, pos, pe, cache)
    decode_out(step, cache, h, ids, active, logits, b)


def decode_in(step: ModelStep, cache, ids: torch.Tensor, b: int):
    """The step's prologue: -> (hidden [b, 1, hidden], positions [b, 1], one (cos, sin) per layer). The cache's
    per-step indices are made here, once, so every layer reads them (and traces the same way)."""
    cache.begin_decode(b)
    pos = cache.lens[:b].long().unsqueeze(1)
    h, pes = step.embed(ids[:b], pos)
    return h, pos, pes


def decode_out(step: ModelStep, cache, h: torch.Tensor, ids: torch.Tensor, active: torch.Tensor,
               logits: torch.Tensor, b: int) -> None:
    """The step's epilogue: logits, the greedy token where active, lens += active."""
    lg = step.head(h)
    logits[:b].copy_(lg)
    ids[:b, 0].copy_(torch.where(active[:b], lg.argmax(-1), ids[:b, 0]))
    cache.advance(active[:b])


def inductor_pdl_missing() -> str | None:
    """None when this torch's Inductor can emit programmatic-dependent-launch kernels (config.triton.enable_pdl),
    else why not."""
    try:
        from torch._inductor import config
    except ImportError as e:
        return f"no Inductor in this torch ({e})"
    if not hasattr(config.triton, "enable_pdl"):
        return f"torch {torch.__version__}'s Inductor has no config.triton.enable_pdl"
    return None


def resolve_inductor_pdl(requested: bool | None, backend) -> bool:
    """Whether a compiled decode body uses Inductor's PDL codegen: `requested` True / False as asked (True without
    it is an error), None (the default) -> on exactly when the backend is Inductor and this torch has the option.
    Its GPU correctness test (tests/runtime/test_gpu_compiled.py) passed on the H200 (s15), and it shortened the
    captured step there (W4A16 + int2 B=1 4.03 -> 3.60 ms, int2 B=16 10.22 -> 9.93 ms; docs/DESIGN_NOTES.md)."""
    if requested is None:
        return backend == "inductor" and inductor_pdl_missing() is None
    if requested:
        why = "backend is not inductor" if backend != "inductor" else inductor_pdl_missing()
        if why:
            raise LowbitError(f"inductor_pdl needs Inductor's PDL codegen: {why}; compile without it")
    return bool(requested)


REGIONS = ("whole", "layers")


class CompiledDecode:
    """decode_body(step, cache, ...) torch.compile'd: call as fn(ids, active, logits, b).

    regions "whole" (the default): decode_body as one graph; Inductor fuses across layer boundaries (one layer's
    residual add with the next layer's norm and RoPE), the faster step: Llama-3-8B int2 B1 L32k 5.32 ms/step on
    the H200, but ~115 s to compile a bucket. regions "layers": three compiled regions, the prologue
    (decode_in), one decoder layer (ModelStep.layer_forward, one compiled function for every layer) and the
    epilogue (decode_out); dynamo traces each layer (its index picks its cache tensors), but the layers' graphs
    are the same graph, so Inductor compiles one and its FX graph cache serves the rest: 22-84 s a bucket, 5.76-6.03
    ms/step (results/runtime/decode_e2e_*_one_graph_NVIDIA_H200.json).

    Inductor fuses what the eager step runs as ~30 small kernels per layer (RMSNorm, RoPE, SiLU*mul,
    residual adds, casts, the cache writes); the fused decode kernel and packed-weight linears are
    custom ops (lowbit.kernels.ops), one node each. fullgraph: a graph break is an error, never a partly
    eager step. dynamic=False: graphs per bucket b (a python int, guarded). No Inductor CUDA graphs
    (DecodeGraphs captures the step itself). emulate_precision_casts: the codec's float32 -> fp16 ->
    float32 rounding of scales is kept (as the compiled writes keep it), so codes match the eager step.
    backend: "inductor", or another torch.compile backend (a name such as "aot_eager": the same trace
    without code generation, what the CPU tests use; or a callable backend).
    inductor_pdl: Inductor's programmatic-dependent-launch codegen (torch's config.triton.enable_pdl, a prototype):
    each generated kernel may start while the previous one drains and waits in-kernel for what it reads; None (the
    default) resolves it with resolve_inductor_pdl: on where Inductor has it.
    max_buckets: how many buckets this function will compile (dynamo's recompile limit for the layer region is
    layers x max_buckets; one more bucket is an error, not an eager step).

    Sets on the cache what a traced step needs: no host-synchronising input checks, the decode writes
    traced into this graph (not a nested compiled writer), and the writers made before the first trace
    (made inside it, their registry would change under the guards and force a recompile)."""

    def __init__(self, step: ModelStep, cache, *, backend="inductor", inductor_pdl: bool | None = None,
                 regions: str = "whole", max_buckets: int = len(DEFAULT_BUCKETS)):
        from lowbit.runtime.static_cache import _writer

        if regions not in REGIONS:
            raise LowbitError(f"compile regions {regions!r} unknown; use one of {', '.join(REGIONS)}")
        cache.checks = False
        cache.compile_writes = False
        for layer in cache.layers:
            _writer(layer, cache.checks, cache.compile_writes)
        register_packed_linears(step.model)
        self.step, self.cache, self.regions = step, cache, regions
        opts = {"emulate_precision_casts": True, "triton.cudagraphs": False} if backend == "inductor" else None
        self.inductor_pdl = resolve_inductor_pdl(inductor_pdl, backend)
        if self.inductor_pdl:
            opts["triton.enable_pdl"] = True

        def compiled(fn):
            return torch.compile(fn, backend=backend, fullgraph=True, dynamic=False, options=opts)

        n = len(step.inner.layers)
        if regions == "whole":
            self._whole = compiled(functools.partial(decode_body, step, cache))
            self.graphs_per_bucket, limit = 1, max_buckets
        else:
            self._in = compiled(functools.partial(decode_in, step, cache))
            self._layer = compiled(step.layer_forward)
            self._out = compiled(functools.partial(decode_out, step, cache))
            self.graphs_per_bucket, limit = n + 2, n * max_buckets
        key = "recompile_limit" if hasattr(torch._dynamo.config, "recompile_limit") else "cache_size_limit"
        acc = ("accumulated_recompile_limit" if hasattr(torch._dynamo.config, "accumulated_recompile_limit")
               else "accumulated_cache_size_limit")
        self._limits = {key: limit, acc: max(limit * 2, getattr(torch._dynamo.config, acc))}

    def __call__(self, ids: torch.Tensor, active: torch.Tensor, logits: torch.Tensor, b: int) -> None:
        with torch._dynamo.config.patch(**self._limits):
            if self.regions == "whole":
                self._whole(ids, active, logits, b)
                return
            step, cache = self.step, self.cache
            h, pos, pes = self._in(ids, b)
            for layer, pe in zip(step.inner.layers, pes):
                h = self._layer(layer, h, pos, pe, cache)
            self._out(h, ids, active, logits, b)


def compile_decode(step: ModelStep, cache, *, backend="inductor", inductor_pdl: bool | None = None,
                   regions: str = "whole", max_buckets: int = len(DEFAULT_BUCKETS)) -> CompiledDecode:
    """decode_body(step, cache, ...) torch.compile'd (CompiledDecode): fn(ids, active, logits, b)."""
    return CompiledDecode(step, cache, backend=backend, inductor_pdl=inductor_pdl, regions=regions,
                          max_buckets=max_buckets)


def first_compiled_call(fn: CompiledDecode, ids: torch.Tensor, active: torch.Tensor, logits: torch.Tensor,
                        b: int) -> float:
    """The call of a compile_decode function that compiles bucket b -> its seconds. It must add exactly
    fn.graphs_per_bucket graphs and no graph break; anything else (a break, dynamo's recompile limit hit,
    which would run the body eagerly or fail) raises a LowbitError."""
    import time

    exc = torch._dynamo.exc
    counters = torch._dynamo.utils.counters
    graphs0 = int(counters["stats"].get("unique_graphs", 0))
    breaks0 = sum(counters["graph_break"].values())
    t = time.perf_counter()
    try:
        fn(ids, active, logits, b)
    except (exc.TorchDynamoException, exc.FailOnRecompileLimitHit) as e:
        raise LowbitError(f"compiling the decode step for bucket {b} failed ({type(e).__name__}: "
                          f"{str(e).splitlines()[0][:160]}); no graph, no eager fallback") from e
    s = time.perf_counter() - t
    new = int(counters["stats"].get("unique_graphs", 0)) - graphs0
    breaks = sum(counters["graph_break"].values()) - breaks0
    if new != fn.graphs_per_bucket or breaks:
        raise LowbitError(f"compiling the decode step for bucket {b} gave {new} graph(s) and {breaks} graph "
                          f"break(s), expected {fn.graphs_per_bucket} and 0 (the body would run partly eagerly); if "
                          "dynamo's recompile limit was hit, call torch._dynamo.reset() or capture fewer buckets")
    return s


class DecodeGraphs:
    """One captured greedy decode step per batch bucket over a StaticKVCache (CUDA only).

    A replay of bucket b reads ids[:b] (the last token of each slot), writes every layer's K/V at
    positions lens[:b], computes the logits, puts argmax into ids[:b] and adds active[:b] to lens:
    the next replay continues without the host. logits[:b] holds the last step's logits.

    compile=True: the captured body is decode_body through torch.compile (compile_decode: Inductor,
    full graph, static shapes, one graph unless regions="layers"), compiled by the first warm-up call
    of each bucket, then captured as the eager body is. A graph break, a bucket that did not compile (e.g. dynamo's recompile limit hit,
    which would run the body eagerly) or a recompile at a later warm-up or at capture raises.
    `compiled` says which body the graphs hold.
    """

    def __init__(self, step: ModelStep, cache, buckets=DEFAULT_BUCKETS, *, warmup: int = 2, compile: bool = False,
                 backend: str = "inductor", inductor_pdl: bool | None = None, regions: str = "whole"):
        if cache.device.type != "cuda":
            raise LowbitError("CUDA graph capture needs a CUDA cache; on CPU run the step eagerly (ModelStep)")
        if bool(cache.lens.any()):
            # warm-up runs write a token at each slot's position: on an empty cache those land in rows
            # a prefill overwrites, on a filled one they would replace held tokens
            raise LowbitError("capture the decode graphs on an empty cache (before any prefill)")
        buckets = sorted({int(b) for b in buckets if b <= cache.slots})
        if not buckets:
            raise LowbitError(f"no batch bucket fits the cache's {cache.slots} slots")
        self.step, self.cache, self.buckets = step, cache, buckets
        self.compiled = bool(compile)
        dev = cache.device
        B = max(buckets)
        self.ids = torch.zeros(B, 1, dtype=torch.long, device=dev)
        self.active = torch.zeros(B, dtype=torch.bool, device=dev)
        V = getattr(step.lm_head, "out_features", None) or step.lm_head.weight.shape[0]
        self.logits = torch.zeros(B, V, dtype=torch.float32, device=dev)
        if inductor_pdl and not compile:
            raise LowbitError("inductor_pdl is an option of the compiled body: pass compile=True")
        self.inductor_pdl = bool(compile) and resolve_inductor_pdl(inductor_pdl, backend)  # what the graphs hold
        self.regions = regions if compile else None  # CompiledDecode's regions: "whole" | "layers"
        self._fn = (compile_decode(step, cache, backend=backend, inductor_pdl=self.inductor_pdl, regions=regions,
                                   max_buckets=len(buckets)) if compile
                    else functools.partial(decode_body, step, cache))
        self.compile_s: dict[int, float] = {}  # bucket -> seconds of its first (compiling) warm-up call
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.pool = None
        lens0 = cache.lens.clone()
        for b in reversed(buckets):  # largest first: smaller graphs reuse its memory pool
            s = torch.cuda.Stream()
            s.wait_stream(torch.cuda.current_stream())
            with torch.cuda.stream(s), torch.no_grad():
                for i in range(max(2, warmup)):
                    # after a first call (lazy inits may synchronise once; a compiled body compiles), any host
                    # sync in the step is an error here, with its traceback, instead of an invalidated capture
                    # later, and so is a recompile of the compiled body
                    torch.cuda.set_sync_debug_mode("error" if i else "default")
                    try:
                        if self.compiled and i == 0:
                            self._first_compiled_call(b)
                        else:
                            with self._no_recompile():
                                self._body(b)
                    finally:
                        torch.cuda.set_sync_debug_mode("default")
                    cache.lens.copy_(lens0)
            torch.cuda.current_stream().wait_stream(s)
            g = torch.cuda.CUDAGraph()
            with self._no_recompile(), torch.cuda.graph(g, pool=self.pool), torch.no_grad():
                self._body(b)
            self.pool = g.pool()
            self.graphs[b] = g
            cache.lens.copy_(lens0)
        torch.cuda.synchronize()

    def _no_recompile(self):
        import contextlib

        return torch.compiler.set_stance("fail_on_recompile") if self.compiled else contextlib.nullcontext()

    def _first_compiled_call(self, b: int) -> None:
        self.compile_s[b] = first_compiled_call(self._fn, self.ids, self.active, self.logits, b)

    def _body(self, b: int) -> None:
        self._fn(self.ids, self.active, self.logits, b)
    def bucket_for(self, batch: int) -> int:
        for b in self.buckets:
            if b >= batch:
                return b
        raise LowbitError(f"batch {batch} is larger than the largest captured bucket ({self.buckets[-1]}); "
                          "capture larger buckets or lower the batch")

    def replay(self, batch: int) -> int:
        """Run one decode step for slots [0, bucket(batch)); returns the bucket used."""
        b = self.bucket_for(batch)
        self.graphs[b].replay()
        return b


@torch.no_grad()
def eager_decode(step: ModelStep, cache, ids: torch.Tensor, active: torch.Tensor) -> torch.Tensor:
    """The same decode step without a graph (CPU, or the captured step's reference): ids [b, 1] ->
    logits [b, V]; lens[:b] += active."""
    b = ids.shape[0]
    cache.begin_decode(b)
    logits = step(ids, cache.lens[:b].long().unsqueeze(1), cache)
    cache.advance(active)
    return logits


@torch.no_grad()
def prefill(step: ModelStep, cache, slot: int, ids: torch.Tensor, *, chunk: int = 2048) -> torch.Tensor:
    """Feed prompt ids [L] into `slot` (from its current length) in chunks -> logits [V] of the last token."""
    start = int(cache.lens[slot])
    L = int(ids.shape[0])
    if L == 0:
        raise LowbitError("prefill of an empty prompt")
    logits = None
    for a in range(0, L, chunk):
        c = min(chunk, L - a)
        cache.begin_prefill(slot, start + a, c)
        pos = torch.arange(start + a, start + a + c, device=ids.device)[None]
        logits = step(ids[None, a:a + c], pos, cache)[0]
    cache.lens[slot] = start + L
    return logits
