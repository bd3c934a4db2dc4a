"""Generation over lowbit's caches: generation (greedy by default; the CLI's and the demo's), and GenerateCache.

    lm = lowbit.runtime.load.resolve("smollm2-135m")
    new_ids, cache = generate(lm, parse_kv_scheme("int4"), "The capital of France is", 12)   # QuantizedKVCache
    new_ids, cache = generate(lm, scheme, prompt, 12, temperature=0.7, top_p=0.9, seed=1, timing=t)  # sampled
    print(lm.tokenizer.decode(new_ids), cache.summary())
    text = greedy_continuation(lm, "The capital of France is", 20)   # the model's own DynamicCache, text only

`lowbit generate` and `lowbit demo` parse their flags and call these.

GenerateCache: the runtime's static packed cache as the `past_key_values` of transformers' `generate`.

    cache = GenerateCache(model, "int2", batch=B, max_context=prompt_len + max_new_tokens)
    out = model.generate(input_ids, max_new_tokens=N, do_sample=False, **cache_kwargs(model, cache))

The same buffers and write paths as StaticKVCache (one quantizer: the layer codec), driven by what
transformers does instead of by begin_prefill / begin_decode:
    prefill  (the first forward, eager in generate): K/V [B, H, L, D] of B equal-length prompts; each
             sequence is written into its slot by StaticLayer.write_chunk and its queries attend as the
             runtime's prefill does (history from the tiers + the chunk exact).
    decode   (every later one-token forward): one token per slot at positions lens[:B] (device tensor),
             the tier lengths read from lens, lens += 1 after the last layer: no host sync and no
             Python value that changes per step, so transformers' compiled forward traces it once.
is_compileable is True, so generate compiles the decode forward where transformers allows it (CUDA;
other devices with compile_config._compile_all_devices), with its default CompileConfig unless told;
`compile_config()` gives a stricter one (full graph, CUDA graphs, the codec's fp16 rounding kept).

Supported: B prompts of equal length, no padding (an attention_mask with a zero is refused at prefill);
greedy decoding is what is tested (sampling happens in generate after the forward, untested). A new
generate call on a used cache: `reset()` first, or pass the whole sequence so far (held tokens + new
ones) to continue it, as with transformers' StaticCache (generate slices off what the cache holds;
`lowbit bench decode` does this). Not supported: left padding, beam search (reorder_cache), chunked
prefill through the compiled forward (generation_config.prefill_chunk_size), more tokens than
max_context (refused at prefill when the prompt alone overflows; a decode past capacity is counted on
the device and raised by `check()` and by the next prefill -- a step cannot raise without a host sync).
"""

import math
import os
import time
from pathlib import Path

import torch

from lowbit.backends import torch_stream as attn
from lowbit.core.errors import LowbitError
from lowbit.kernels.ops import decode_attention_op
from lowbit.kv.plan import Plan
from lowbit.kv.plan import resolve as plan_resolve
from lowbit.models.geometry import ModelGeometry
from lowbit.runtime.cache import QuantizedKVCache, cache_kwargs, model_device
from lowbit.runtime.static_cache import StaticKVCache, _rot, _writer

# the fused kernel as one opaque node of the compiled step (lowbit.kernels.ops; DecodeGraphs(compile=True)
# uses the same op): kept under its old name for callers of this module
_decode_attention_op = decode_attention_op


class GenerateCache(StaticKVCache):
    """StaticKVCache for `model.generate` (module docstring): `batch` sequences of up to `max_context` tokens.

    model: the transformers causal LM (its attention is switched to "lowbit"). scheme: a KVScheme, a
    scheme string ("bf16", "int4", "int2", "k4v2", ...) or a Plan resolved for the model's device.
    """

    def __init__(self, model, scheme="bf16", *, batch: int, max_context: int, device=None, dtype=None):
        if isinstance(scheme, Plan):
            plan = scheme
        else:
            geo = ModelGeometry.from_config(model.config, name=getattr(model.config, "name_or_path", None) or None)
            plan = plan_resolve(scheme, geo, device=str(device or model_device(model)).split(":")[0])
        super().__init__(model, plan, slots=batch, max_context=max_context, device=device, dtype=dtype)
        # transformers compiles the whole step, writes included (a nested torch.compile would only be inlined);
        # no host-synchronising input checks inside a step that may be traced
        self.compile_writes = False
        self.checks = False
        self.kernel_op = True  # the fused kernel through the custom op, traced or not (one path)
        self.batch = batch
        self._decoding = False  # after a prefill: one-token forwards are decode steps (a constant while decoding)
        self._last_layer = len(self.layers) - 1
        self.overflow = torch.zeros((), dtype=torch.int32, device=self.device)  # decode steps past capacity
        # what ran (see `runs`); plain attributes: a dict written inside a trace would be guarded on all its
        # values, and a count that changes between generate calls would then force a retrace
        self._n_prefill = self._n_eager = 0
        self._traced = False
        # every buffer keeps its address: the compiled step mutates them in place, and CUDA graphs would
        # otherwise copy each one (the whole KV cache) into graph memory on every replay, or skip the graph
        for t in self._tensors():
            torch._dynamo.mark_static_address(t)
        # the decode writers exist before the first trace: made inside it, their registry would change
        # under the trace's guards and force one recompile of the whole step
        for layer in self.layers:
            _writer(layer, self.checks, self.compile_writes)

    def _tensors(self):
        yield self.lens
        yield self.overflow
        for layer in self.layers:
            yield from (layer.sink_k, layer.sink_v, layer.ring_k, layer.ring_v)
            for fields in layer.mid.values():
                yield from fields.values()
            for r in (layer.rot_k, layer.rot_v):
                if r is not None:
                    yield r

    # ------------------------------------------------------------- control
    @property
    def runs(self) -> dict:
        """What ran: prefills, decode steps whose body ran as Python (eagerly, not from a compiled graph),
        and whether a decode step was traced by torch.compile."""
        return {"prefill": self._n_prefill, "eager_decode_steps": self._n_eager, "traced_decode": self._traced}

    def reset_runs(self) -> None:
        self._n_prefill = self._n_eager = 0

    def reset(self) -> None:
        """Empty every slot (a new generate call with new prompts)."""
        self.lens.zero_()
        self.overflow.zero_()
        self._decoding = False

    def check(self) -> None:
        """Raise if a decode step ran past max_context (a host sync: call it after generate)."""
        n = int(self.overflow)
        if n:
            raise LowbitError(f"generate ran {n} decode step(s) past the cache capacity {self.max_context}; "
                              "build the GenerateCache with max_context >= prompt + max_new_tokens")

    @staticmethod
    def compile_config(fullgraph: bool = True, backend: str = "inductor", all_devices: bool = False):
        """transformers.CompileConfig for generate with this cache: the whole decode step as one graph
        (fullgraph: a graph break is an error, not a slower step), CUDA graphs (what "reduce-overhead"
        asks for; torch.compile takes mode or options, not both), and the codec's float32 -> fp16 ->
        float32 rounding of scales kept (emulate_precision_casts), so compiled codes match eager ones on CUDA
        (on CPU inductor's code still rounds about half the scales one fp16 ulp away: test_generate.py).
        backend: another torch.compile backend (e.g. "aot_eager" to check tracing on CPU; no options then).
        all_devices: compile on CPU too (transformers compiles only on CUDA-like devices by default)."""
        from transformers import CompileConfig

        opts = {"triton.cudagraphs": True, "emulate_precision_casts": True} if backend == "inductor" else None
        cc = CompileConfig(fullgraph=fullgraph, dynamic=False, backend=backend, mode=None, options=opts)
        if all_devices:
            cc._compile_all_devices = True
        return cc

    # ------------------------------------------------------------- write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        B, _, L, _ = key_states.shape
        if B != self.batch:
            raise LowbitError(f"GenerateCache holds {self.batch} sequences but the forward has {B}; "
                              "build it with batch equal to the number of prompts")
        if self._decoding and L == 1:
            if layer_idx == 0:
                self.begin_decode(B)
                if torch.compiler.is_compiling():  # resolved at trace time: a compiled step never counts
                    self._traced = True
                else:
                    self._n_eager += 1
            return super().update(key_states, value_states, layer_idx)
        if layer_idx == 0:
            self._begin_prefill(L)
        layer = self.layers[layer_idx]

        k = _rot(key_states, layer.rot_k).to(self.dtype)  # [B, H, L, D]
        v = _rot(value_states, layer.rot_v).to(self.dtype)
        start = self._start
        chunks = []
        for b in range(B):  # each prompt into its slot, as the runtime's prefill writes it
            before = layer.dense_history(b, start) if layer.kind == "ring" else None
            layer.write_chunk(k[b].transpose(0, 1), v[b].transpose(0, 1), b, start, checks=True)
            chunks.append((k[b:b + 1], v[b:b + 1], before))
        self._chunks = chunks
        attn.post_handoff(self, layer_idx, key_states, value_states)
        return key_states, value_states

    def _begin_prefill(self, L: int) -> None:
        self.check()
        starts = self.lens.tolist()
        if len(set(starts)) != 1:
            raise LowbitError(f"GenerateCache: the slots hold different lengths {starts}; call reset()")
        self._start = starts[0]
        self._mode = None
        if self._start + L > self.max_context:
            raise LowbitError(f"the prompt ({L} tokens after {self._start} held) exceeds the cache capacity "
                              f"{self.max_context}; build the GenerateCache with a larger max_context")
        self._n_prefill += 1

    # ------------------------------------------------------------- read
    def attend(self, layer_idx: int, query: torch.Tensor, attention_mask, *, scaling: float, softcap=None):
        if self._mode is not None and self._mode[0] == "decode":
            out = super().attend(layer_idx, query, None, scaling=scaling, softcap=softcap)
            if layer_idx == self._last_layer:  # every layer has read this step's lengths: commit the token
                self.overflow.add_((self.lens[:self.batch] >= self.max_context).any().to(torch.int32))
                self.lens[:self.batch] += 1
                self._step = {}
            return out
        if isinstance(attention_mask, torch.Tensor) and attention_mask.dim() == 2 and not bool(attention_mask.all()):
            raise LowbitError("GenerateCache takes prompts of equal length without padding; pad-free batches only "
                              "(or use lowbit.runtime.cache.QuantizedKVCache, which takes left padding)")
        L = query.shape[2]
        outs = []
        for b, chunk in enumerate(self._chunks):
            self._mode, self._chunk = ("prefill", b, self._start, L), chunk
            outs.append(super().attend(layer_idx, query[b:b + 1], None, scaling=scaling, softcap=softcap))
        self._mode = None
        if layer_idx == self._last_layer:
            self.lens[:self.batch] += L
            self._decoding = True
            self._chunks = None
        return torch.cat(outs, 0)

    # ------------------------------------------------------------- HF API
    @property
    def is_compileable(self) -> bool:
        return True

    def get_seq_length(self, layer_idx: int = 0):
        """Tokens held by slot 0 (all slots hold the same): a 0-d device tensor, as transformers' StaticCache
        returns, so reading it inside a compiled step is no host sync."""
        return self.lens[0]

    def get_mask_sizes(self, query_length: int, layer_idx: int = 0) -> tuple[int, int]:
        # the lowbit attention builds its masks from the tiers; transformers only needs a fixed size
        return self.max_context, 0

    @property
    def max_cache_len(self) -> int:  # transformers 5.17 reads it as a Cache property
        return self.max_context

    def get_max_cache_shape(self, layer_idx: int = 0) -> int:
        return self.max_context

    def get_max_length(self, layer_idx: int | None = None) -> int:
        return self.max_context

    def reorder_cache(self, beam_idx):
        raise LowbitError("GenerateCache does not reorder sequences (beam search); use num_beams=1")


# ------------------------------------------------------------------ generation (greedy by default)
PROMPT = "The capital of France is"  # the demo's prompt: one short, checkable continuation


def read_prompt(prompt: str | None = None, prompt_file: str | Path | None = None) -> str:
    """The prompt text: `prompt`, else the UTF-8 contents of `prompt_file`. Refuses a missing file or blank text."""
    if prompt is not None:
        text = prompt
    elif prompt_file is not None:
        p = Path(prompt_file)
        if not p.is_file():
            raise LowbitError(f"prompt file {p} not found")
        try:
            text = p.read_text(encoding="utf-8")
        except UnicodeDecodeError as e:
            # a traceback here told the user nothing they could act on; name the byte and the fix
            raise LowbitError(f"prompt file {p} is not UTF-8 text (byte {e.object[e.start]:#04x} at offset "
                              f"{e.start}); convert it, e.g. `iconv -f latin1 -t utf-8 {p}`") from None
    else:
        raise LowbitError("no prompt: pass --prompt TEXT or --prompt-file PATH")
    if not text.strip():
        raise LowbitError("the prompt is empty; pass some text")
    return text


def _pad_id(tokenizer) -> int | None:
    # generate() warns (and guesses) without a pad id; eos is the usual stand-in for causal LMs
    return tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id


def context_length(model) -> int | None:
    """The model's context in tokens (config max_position_embeddings, or its text config's), else None."""
    for cfg in (model.config, getattr(model.config, "text_config", None)):
        n = getattr(cfg, "max_position_embeddings", None) if cfg is not None else None
        if isinstance(n, int) and n > 0:
            return n
    return None


def check_context(n_prompt: int, max_new_tokens: int, context: int | None, name: str) -> None:
    """Refuse a prompt + continuation longer than the model's context, before any cache is built: a
    30,858-token prompt on smollm2-135m (context 8,192) died allocating 34 GB in attention."""
    if context is None or n_prompt + max_new_tokens <= context:
        return
    if n_prompt >= context:
        raise LowbitError(f"the prompt is {n_prompt} tokens but {name}'s context is {context} tokens; shorten it to "
                          f"at most {context - max_new_tokens} tokens (with --max-new-tokens {max_new_tokens})")
    raise LowbitError(f"the prompt is {n_prompt} tokens and --max-new-tokens {max_new_tokens} makes "
                      f"{n_prompt + max_new_tokens}, beyond {name}'s context of {context} tokens; lower "
                      f"--max-new-tokens to {context - n_prompt} or shorten the prompt")


def check_sampling(temperature: float, top_p: float) -> bool:
    """True when these ask for sampling (temperature > 0); greedy is temperature 0. Refuses what would be
    silently ignored (a top-p under greedy) or is out of range."""
    if not math.isfinite(temperature) or temperature < 0:
        raise LowbitError(f"--temperature must be 0 (greedy) or more, got {temperature}")
    if not (0 < top_p <= 1):
        raise LowbitError(f"--top-p must be in (0, 1], got {top_p}")
    if temperature == 0 and top_p != 1:
        raise LowbitError(f"--top-p {top_p} needs sampling: add --temperature T (T > 0; greedy is the default)")
    return temperature > 0


class _Clock:
    """A transformers streamer that only timestamps: generate() puts the prompt first, then each new
    token as it is chosen, so the second put marks the first token (time to first token)."""

    def __init__(self):
        self.times: list[float] = []

    def put(self, value) -> None:
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass


def generate(lm, scheme, prompt: str, max_new_tokens: int, *, decode_backend: str = "auto",
             temperature: float = 0.0, top_p: float = 1.0, seed: int | None = None, timing: dict | None = None):
    """Generate through a fresh QuantizedKVCache: greedy by default, sampled when temperature > 0.
    Returns (new token ids [N], cache).

    lm: a lowbit.models.LoadedModel (model, tokenizer, geometry); scheme: a KVScheme valid for it.
    seed: the sampling seed (torch.manual_seed); None with sampling draws one and reports it in `timing`.
    timing: a dict to fill with prompt_tokens, new_tokens, ttft_s (prompt in -> first token out),
        decode_tokens_per_s (the tokens after the first), total_s, seed (when sampling).
    """
    if lm.tokenizer is None:
        raise LowbitError(f"model {lm.name} has no tokenizer; generate needs one")
    sample = check_sampling(temperature, top_p)
    model = lm.model
    enc = lm.tokenizer(prompt, return_tensors="pt")
    n_prompt = int(enc["input_ids"].shape[1])
    check_context(n_prompt, max_new_tokens, context_length(model), lm.name)  # before the cache and any forward
    cache = QuantizedKVCache(model, scheme, geometry=lm.geometry, decode_backend=decode_backend)
    dev = next(model.parameters()).device
    enc = enc.to(dev)
    kw = {"do_sample": False}
    if sample:
        if seed is None:
            seed = int.from_bytes(os.urandom(4), "little")
        torch.manual_seed(seed)
        kw = {"do_sample": True, "temperature": temperature, "top_p": top_p, "top_k": None}
    clock = _Clock()
    t0 = time.perf_counter()
    with torch.no_grad():
        out = model.generate(
            **enc, max_new_tokens=max_new_tokens, pad_token_id=_pad_id(lm.tokenizer), streamer=clock,
            **kw, **cache_kwargs(model, cache),
        )
    t1 = time.perf_counter()
    new = out[0, n_prompt:]
    if timing is not None:
        first = clock.times[1] if len(clock.times) > 1 else t1
        n_after = len(new) - 1
        timing.update(prompt_tokens=n_prompt, new_tokens=len(new), ttft_s=first - t0, total_s=t1 - t0,
                      decode_tokens_per_s=(n_after / (t1 - first)) if n_after > 0 and t1 > first else None,
                      seed=seed if sample else None)
    return new, cache


def greedy_continuation(lm, prompt: str, max_new_tokens: int) -> str:
    """Greedy-decode `max_new_tokens` after `prompt` with the model's own cache; returns only the new text."""
    if lm.tokenizer is None:
        raise LowbitError(f"{lm.name} has no tokenizer files: add them to the model directory")
    enc = lm.tokenizer(prompt, return_tensors="pt").to(lm.model.device)
    with torch.no_grad():
        out = lm.model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                pad_token_id=_pad_id(lm.tokenizer))
    return lm.tokenizer.decode(out[0, enc["input_ids"].shape[1]:], skip_special_tokens=True)
