"""vLLM glue: an attention backend that stores lowbit's packed slots in vLLM's paged KV cache.

Registered by lowbit.vllm_plugin.register() in place of vLLM's CPU_ATTN backend. For a model
directory WITHOUT lowbit_kv.json it is vLLM's own CPU backend, unchanged (and says so in the log).
For a directory with the sidecar:

  - customize_spec: each (token, KV head) cell is SlotFormat.slot_bytes (state_content_bytes),
    so vLLM's block manager sizes the cache -- and reports its capacity in tokens -- from the
    packed size: int2 on head_dim 64 is 40 B against 256 B for bf16 'auto'.
  - do_kv_cache_update: rotate -> lowbit's quantizer -> pack, into the slots of slot_mapping
    (paged.write). vLLM calls it before forward() for every layer (forward_includes_kv_cache_update
    is False), so there is no path that stores K/V without quantizing them.
  - forward: per request, attention of the new queries over the packed history (paged.attend),
    queries rotated by R_k, output un-rotated by R_v^T.

  - the exact tiers: each request's first `sink` and last `recent` tokens are also kept dense
    (rotated, model dtype) in a per-layer paged.TierArena beside vLLM's cache and read from there;
    blocks leave it when they fall behind a request's window or no running request holds them.
    That memory is outside vLLM's KV budget (--kv-cache-memory-bytes) and is logged at start-up.
  - prefix caching: a hit hands a request the cached blocks of its prompt's start. Their sink rows
    stay in the arena with those blocks while vLLM may hand them out (TierArena.hold); vLLM's
    scheduler holds back the last `recent` tokens of every hit (prefix.py), so the request computes
    the rows its recent window holds itself. A hit at P is then a miss whose prefill had a chunk
    boundary at P: same codes, same sink rows, same recent rows (tests/serve/test_vllm_prefix.py).
  - a chunk's queries attend to their own chunk as it arrived and to the history as stored,
    as lowbit's runtime does.
  - sliding-window layers (gemma3: 5 of 6 layers, window 512): a query sees the last `window`
    positions only. vLLM frees the blocks before the window (and may reuse them at once), so
    for such a layer the attention reads a request's packed cache and its arena only from the
    block holding the lowest position its first query can see, and the arena drops dense rows
    once no future query can see them (paged.py). Sink tokens of a sliding layer are exact
    while inside the window and not attended after, as in lowbit's runtime (kv/layer.py); the
    recent tier is exact inside the window. Tested against lowbit's runtime on gemma3-270m
    (RESULTS.md, Serving).

Per-layer bits (layer_bits): each layer encodes with its own bits, in a cell padded to the widest
layer's (vLLM sizes one cell per KV cache group); the padding is logged and counted by vLLM.
Not supported (refused at start-up, never silently served otherwise): per-channel (KIVI) keys,
Lloyd-Max levels, alibi, attention sinks, encoder attention, CUDA.
Decode attention: a fused C++ kernel over the packed pages (csrc/paged_decode.cpp, built with
torch.utils.cpp_extension; its torch twin in paged.py serves prefill chunks, 16-bit tensors, and
decode when the kernel cannot build -- said in the log).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field, replace
from functools import lru_cache
from pathlib import Path
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)
from vllm.v1.attention.backends.cpu_attn import (
    CPUAttentionBackend,
    CPUAttentionBackendImpl,
    CPUAttentionMetadataBuilder,
)
from vllm.v1.kv_cache_interface import AttentionSpec, KVCacheLayout

from lowbit.core.errors import LowbitError
from lowbit.vllm_plugin import paged, sidecar
from lowbit.vllm_plugin import slot as slot_mod
from lowbit.vllm_plugin.slot import SlotFormat, layer_formats

log = logging.getLogger("lowbit.vllm_plugin")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")


@dataclass
class LowbitModel:
    """What the backend knows about the served model: its sidecar scheme and per-layer slot formats."""

    path: str
    scheme: object
    geometry: object
    formats: dict  # (head_dim_k, head_dim_v) -> SlotFormat (the cell vLLM sizes: the widest layer's)
    rotations: list  # [(R_k, R_v)] per layer
    key_affines: list = field(default_factory=list)  # lowbit.kv.key_affine.KeyAffine or None per layer
    layer_formats: list = field(default_factory=list)  # SlotFormat per layer (own bits, padded cell)
    windows_logged: set = field(default_factory=set)  # sliding windows whose layers were described in the log
    kernel_logged: bool = False
    prefix_logged: bool = False

    def fmt(self, dk: int, dv: int) -> SlotFormat:
        return self.formats[(dk, dv)]


@lru_cache(maxsize=8)
def _load(path: str, dense_dtype: torch.dtype) -> LowbitModel | None:
    """The lowbit view of the model at `path`, or None when it carries no sidecar (stock vLLM)."""
    p = Path(path)
    if not sidecar.has_sidecar(p):
        log.warning("lowbit plugin: %s has no %s; serving with vLLM's own CPU attention", path, sidecar.SIDECAR_NAME)
        return None
    from transformers import AutoConfig

    from lowbit.kv.plan import resolve
    from lowbit.models.geometry import ModelGeometry

    side = sidecar.read(p)
    geometry = ModelGeometry.from_config(AutoConfig.from_pretrained(p), name=side["model"]["name"])
    sidecar.check_against(side, geometry)  # layers, heads, dims: a sidecar for another model is refused
    scheme = sidecar.scheme_of(side, p)
    if scheme.page != 1:
        raise LowbitError(f"{p}: the sidecar has page {scheme.page}; the vLLM plugin packs every token on write "
                          "(page 1): export again with `lowbit export --for vllm`")
    plan = resolve(scheme, geometry, device="cpu")  # opens and checks the exported rotation set once
    scheme = plan.scheme
    per_layer = layer_formats(plan, dense_dtype)
    formats = {}
    for lp, f in zip(plan.layers, per_layer):
        formats.setdefault((lp.geometry.head_dim_k, lp.geometry.head_dim_v), f)
    rots = [(lp.rot_k, lp.rot_v) for lp in plan.layers]
    affines = [getattr(lp, "k_affine", None) for lp in plan.layers]
    if any(a is not None for a in affines):
        from lowbit.runtime.cache import _check_key_affine

        _check_key_affine(AutoConfig.from_pretrained(p))  # a shift is exact only without logit soft-capping
    for d, f in formats.items():
        log.warning("lowbit plugin: %s KV %s | head_dim %s: %s", p.name, scheme.describe(), d, f.describe())
    if scheme.layer_bits:
        real = sum(f.content_bytes for f in per_layer) / len(per_layer)
        log.warning("lowbit plugin: per-layer bits (%s): every cell padded to the widest layer's %d B; the layers' "
                    "codes use %.1f B on average -- vLLM's capacity counts the padded %d B",
                    ", ".join(f"{lp.index}=k{lp.k.bits}v{lp.v.bits}" for lp in plan.layers
                              if lp.index in dict(scheme.layer_bits)), max(f.slot_bytes for f in per_layer),
                    real, max(f.slot_bytes for f in per_layer))
    if scheme.sink or scheme.recent:
        elt = torch.empty((), dtype=dense_dtype).element_size()
        per_tok = sum(g.num_kv_heads * (g.head_dim_k + g.head_dim_v) * elt for g in geometry.layers)
        log.warning("lowbit plugin: exact tiers (sink %d + recent %d tokens) dense beside vLLM's cache: up to "
                    "%.2f MiB per request, outside --kv-cache-memory-bytes", scheme.sink, scheme.recent,
                    (scheme.sink + scheme.recent) * per_tok / 2**20)
    return LowbitModel(path=str(p), scheme=scheme, geometry=geometry, formats=formats, rotations=rots,
                       key_affines=affines, layer_formats=per_layer)


class ResolvedModels:
    """The models resolved from a vLLM config in force, {(path, dtype): LowbitModel | None}.

    vLLM asks some backend questions (customize_spec from the worker's get_kv_cache_spec, for one)
    without a config in force. vLLM runs one model per process, so such a question is answered
    from the one model resolved here; with none resolved yet, or several, it is an error naming
    them -- never the last one seen."""

    def __init__(self):
        self.models: dict = {}

    def resolve(self, path: str, dtype: torch.dtype) -> LowbitModel | None:
        m = _load(path, dtype)
        self.models[(path, dtype)] = m
        return m

    def only(self) -> LowbitModel | None:
        if len(self.models) == 1:
            return next(iter(self.models.values()))
        if not self.models:
            raise LowbitError("lowbit plugin: vLLM asked about the attention backend outside a model config "
                              "before any model was loaded in this process; report this with the vLLM version")
        names = ", ".join(sorted(f"{p} ({d})" for p, d in self.models))
        raise LowbitError(f"lowbit plugin: this process loaded several models ({names}) and vLLM asked outside a "
                          "model config which one: serve one model per vLLM process")


RESOLVED = ResolvedModels()  # this process's models (vLLM serves one per process)


def current_model(resolved: ResolvedModels = RESOLVED) -> LowbitModel | None:
    """The lowbit model of the vLLM config in force (None: its directory has no sidecar, stock vLLM).
    Outside a config context: the one model this process resolved (ResolvedModels.only), else LowbitError."""
    try:
        cfg = get_current_vllm_config()
    except AssertionError:
        return resolved.only()
    mc = getattr(cfg, "model_config", None)
    if mc is None:
        return resolved.only()
    return resolved.resolve(str(mc.model), mc.dtype)


# ------------------------------------------------------------------- metadata
@dataclass
class LowbitMetadata(AttentionMetadata):
    num_actual_tokens: int
    query_start_loc: torch.Tensor  # [R + 1]
    seq_lens: torch.Tensor  # [R]
    block_table: torch.Tensor  # [R, max_blocks]
    slot_mapping: torch.Tensor  # [T]
    memo: dict = field(default_factory=dict)  # index tensors shared by this step's layers (paged._decode_index)


class LowbitMetadataBuilder(AttentionMetadataBuilder[LowbitMetadata]):
    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self._layers_config = vllm_config
        self._reuse_logged = False

    def arenas(self) -> list[paged.TierArena]:
        """The tier arenas of this group's layers, each owned by its layer's LowbitAttentionImpl (made on
        its first write), found through vLLM's own table of layers (static_forward_context)."""
        ctx = getattr(getattr(self._layers_config, "compilation_config", None), "static_forward_context", None) or {}
        found = (getattr(getattr(ctx.get(n), "impl", None), "arena", None) for n in self.layer_names)
        return [a for a in found if a is not None]

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LowbitMetadata:
        m = common_attn_metadata
        arenas = self.arenas()
        if arenas:  # drop the dense blocks no running request needs (finished requests, rows out of a window)
            table, lens = m.block_table_tensor, m.seq_lens.cpu().tolist()
            qsl = m.query_start_loc_cpu.tolist()
            paged.retain_step(arenas, table, lens, [qsl[r + 1] - qsl[r] for r in range(len(lens))])
            w = arenas[0].window
            if w and not self._reuse_logged and len(lens) > 1:  # evidence in the log that freed blocks get reused
                below, held = set(), set()
                for r, n in enumerate(lens):
                    vis = paged.visible_from(n - (qsl[r + 1] - qsl[r]), w)
                    below |= {int(b) for b in table[r, : vis // arenas[0].bs].tolist()}
                    held |= {int(b) for b in table[r, vis // arenas[0].bs: -(-n // arenas[0].bs)].tolist()}
                if below & held:
                    self._reuse_logged = True
                    log.warning("lowbit plugin: %s", f"sliding window {w}: a block vLLM freed below one request's "
                                "window now holds another request's tokens (never read by the first)")
        return LowbitMetadata(num_actual_tokens=m.num_actual_tokens, query_start_loc=m.query_start_loc_cpu,
                              seq_lens=m.seq_lens.cpu(), block_table=m.block_table_tensor,
                              slot_mapping=m.slot_mapping)


# ------------------------------------------------------------------- impl
class LowbitAttentionImpl(AttentionImpl[LowbitMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs):
        if attn_type != AttentionType.DECODER:
            raise LowbitError(f"the lowbit vLLM plugin serves decoder attention only, not {attn_type}")
        if alibi_slopes is not None or sinks is not None:
            raise LowbitError("the lowbit vLLM plugin does not support alibi or attention sinks")
        if kv_cache_dtype not in ("auto", None):
            raise LowbitError(f"--kv-cache-dtype {kv_cache_dtype} conflicts with the lowbit sidecar; leave it 'auto'")
        self.model = current_model()
        if self.model is None:
            raise LowbitError("internal: lowbit attention built for a model without a sidecar")
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.sliding_window = sliding_window
        self.softcap = logits_soft_cap or None
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.attn_type = attn_type
        self.head_size_v = kwargs.get("head_size_v", head_size)
        self.fmt = self.model.fmt(head_size, self.head_size_v)
        self._rot: dict[int, tuple] = {}
        self.k_affine = None  # the layer's key affine (lowbit.kv.key_affine), set with its rotations
        self.tokens_written = 0
        cfg = get_current_vllm_config()
        self.dense_dtype = cfg.model_config.dtype
        sch = self.model.scheme
        self.prefix_caching = bool(getattr(cfg.cache_config, "enable_prefix_caching", False))
        self._max_seqs = int(getattr(getattr(cfg, "scheduler_config", None), "max_num_seqs", 0) or 256)
        if sch.recent and self.prefix_caching:
            from lowbit.vllm_plugin import prefix

            if prefix.PATCHED is not True:  # the scheduler must hold back a hit's recent window (prefix.py)
                raise LowbitError(f"lowbit plugin: prefix caching with a recent tier needs vLLM's scheduler to hold "
                                  f"back a hit's last {sch.recent} tokens, which failed ({prefix.PATCHED}): start "
                                  "vLLM with --no-enable-prefix-caching")
        from lowbit.vllm_plugin.slot import check_budget

        check_budget(getattr(cfg.cache_config, "kv_cache_memory_bytes", None), sch, self.model.geometry,
                     self.model.layer_formats)
        self.arena: paged.TierArena | None = None  # made on the first write, once the block size is known
        self._rotated: dict = {}  # this step's new rows as write rotated them (forward reuses them)
        from lowbit.vllm_plugin import cpu_kernel

        mod, why = cpu_kernel.load()  # built once per machine (cached); the first process pays ~1-2 min
        self.kernel = "cpu-fused" if mod is not None else "torch"
        if not self.model.kernel_logged:
            self.model.kernel_logged = True
            log.warning("lowbit plugin: %s", "decode attention: fused CPU kernel over the packed pages "
                        "(csrc/paged_decode.cpp); prefill chunks: vectorised torch" if mod is not None else
                        f"decode attention: vectorised torch ({why})")
            enc = self.fmt._encoder()  # builds csrc/cell_encode.cpp now, not in the first decode step
            log.warning("lowbit plugin: %s", f"writes of <= {slot_mod.FAST_ROWS} rows (decode steps): "
                        "csrc/cell_encode.cpp, TensorCodec's bytes in one op; longer writes: TensorCodec.encode"
                        if enc is not None else "every write: TensorCodec.encode (" +
                        (cpu_kernel.load_encoder()[1] or "a grid the C++ encoder does not mirror") + ")")
        if sliding_window not in self.model.windows_logged:
            self.model.windows_logged.add(sliding_window)
            log.warning("lowbit plugin: %s", f"sliding-window layers (window {sliding_window}): the attention and "
                        "the exact tiers read only the window" if sliding_window else "full-attention layers")

    def _rotations(self, layer) -> tuple:
        name = getattr(layer, "layer_name", "")
        m = _LAYER_RE.search(name)
        if m is None:
            raise LowbitError(f"cannot tell the layer index of attention layer {name!r}; the rotations are per layer")
        i = int(m.group(1))
        if i not in self._rot:
            rk, rv = self.model.rotations[i]
            g = self.model.geometry.layers[i]
            if (g.head_dim_k, g.num_kv_heads) != (self.head_size, self.num_kv_heads):
                raise LowbitError(f"layer {i}: vLLM has {self.num_kv_heads} KV heads x {self.head_size} but the "
                                  f"sidecar says {g.num_kv_heads} x {g.head_dim_k}; export again for this model")
            self._rot[i] = (rk, rv)
            self.k_affine = self.model.key_affines[i] if self.model.key_affines else None  # keys / queries mapped
            fmt = self.model.layer_formats[i]  # this layer's own bits (per-layer bits), same cell size
            if fmt.slot_bytes != self.fmt.slot_bytes:
                raise LowbitError(f"internal: layer {i}'s cell is {fmt.slot_bytes} B, the group's {self.fmt.slot_bytes} B")
            self.fmt = fmt
        return self._rot[i]

    @staticmethod
    def _bytes(kv_cache: torch.Tensor) -> torch.Tensor:
        """vLLM's [num_blocks, H, block_size, C in dtype units] view -> the same cells as bytes."""
        return kv_cache.view(torch.uint8)

    def _hold_cap(self, bs: int) -> int | None:
        """Prefix caching: how many blocks with sink rows the arena keeps for later hits (paged.TierArena.hold):
        2 x max_num_seqs prompt starts; logged once with what they cost."""
        sch = self.model.scheme
        if not (self.prefix_caching and sch.sink):
            return None
        seqs = self._max_seqs
        cap = 2 * seqs * -(-sch.sink // bs)
        if not self.model.prefix_logged:
            self.model.prefix_logged = True
            elt = torch.empty((), dtype=self.dense_dtype).element_size()
            per = bs * sum(g.num_kv_heads * (g.head_dim_k + g.head_dim_v) * elt for g in self.model.geometry.layers)
            log.warning("lowbit plugin: %s", f"prefix caching: the sink rows of up to {2 * seqs} cached prompt starts "
                        f"stay exact ({cap} blocks, up to {cap * per / 2**20:.1f} MiB beside vLLM's cache); a hit on an "
                        "older one reads them from their codes (logged)")
        return cap

    def do_kv_cache_update(self, layer, key, value, kv_cache, slot_mapping) -> None:
        if self.kv_sharing_target_layer_name is not None:
            return
        rk, rv = self._rotations(layer)
        cache = self._bytes(kv_cache)
        if cache.shape[-1] != self.fmt.slot_bytes:
            raise LowbitError(f"internal: vLLM gave {cache.shape[-1]} B cells, the lowbit slot is {self.fmt.slot_bytes} B")
        positions = row_lens = memo = None
        sch = self.model.scheme
        if sch.sink or sch.recent:
            from vllm.model_executor.layers.attention.attention import get_attention_context

            md = get_attention_context(layer.layer_name)[0]
            if md is None:  # profiling / warm-up pass: nothing real to keep
                return
            if self.arena is None:
                # owned by this impl; the metadata builder finds it through vLLM's layer table
                self.arena = paged.TierArena(sch.sink, sch.recent, cache.shape[2], self.dense_dtype,
                                             window=self.sliding_window, hold_prefix=self.prefix_caching,
                                             hold_cap=self._hold_cap(cache.shape[2]))
            memo = md.memo  # the step's metadata: positions and write indices built by the group's first layer
            pk = ("positions", key.shape[0])
            if pk not in memo:
                memo[pk] = paged.token_positions(md.query_start_loc, md.seq_lens, key.shape[0])
            positions, row_lens = memo[pk]
        self.tokens_written += paged.write(cache, self.fmt, key, value, slot_mapping, rk, rv, positions=positions,
                                           row_seq_lens=row_lens, arena=self.arena, rotated=self._rotated,
                                           memo=memo, k_affine=self.k_affine)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the lowbit plugin")
        if attn_metadata is None:  # warm-up / profiling run
            return output
        n = attn_metadata.num_actual_tokens
        rk, rv = self._rotations(layer)
        q = query[:n].view(n, self.num_heads, self.head_size)
        nk = key[:n].view(n, self.num_kv_heads, self.head_size)
        nv = value[:n].view(n, self.num_kv_heads, self.head_size_v)
        rot = self._rotated if self._rotated.get("n") == n else {}  # written this step, no padding rows
        self._rotated = {}
        out = paged.attend(q, self._bytes(kv_cache), self.fmt, block_table=attn_metadata.block_table,
                           seq_lens=attn_metadata.seq_lens, query_start_loc=attn_metadata.query_start_loc,
                           scale=self.scale, rot_k=rk, rot_v=rv, window=self.sliding_window, softcap=self.softcap,
                           arena=self.arena, new_k=nk, new_v=nv, kernel=self.kernel, memo=attn_metadata.memo,
                           evict=False,  # stale dense blocks: dropped once per step in the builder (retain)
                           new_kr=rot.get("k"), new_vr=rot.get("v"), k_affine=self.k_affine)
        output[:n].copy_(out.reshape(output[:n].shape))  # to the model dtype in the copy
        return output


# ------------------------------------------------------------------- backend
class LowbitCPUAttentionBackend(CPUAttentionBackend):
    """vLLM's CPU_ATTN, replaced: lowbit's packed cache for sidecar models, stock CPU attention otherwise."""

    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float32, torch.bfloat16, torch.float16]

    @classmethod
    def customize_spec(cls, spec: AttentionSpec) -> AttentionSpec:
        m = current_model()
        if m is None:
            return super().customize_spec(spec)
        fmt = m.fmt(spec.head_size, spec.head_size_v)
        elt = torch.empty((), dtype=spec.dtype).element_size()
        if fmt.slot_bytes % elt:
            raise LowbitError(f"lowbit slot of {fmt.slot_bytes} B is not a whole number of {spec.dtype} elements")
        return replace(spec, state_content_bytes=fmt.slot_bytes)

    @classmethod
    def supported_kv_cache_layouts(cls) -> tuple[KVCacheLayout, ...]:
        return (KVCacheLayout.LBHNC,)

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return True if current_model() is not None else super().supports_head_size(head_size)

    @staticmethod
    def get_impl_cls():
        return LowbitAttentionImpl if current_model() is not None else CPUAttentionBackendImpl

    @staticmethod
    def get_builder_cls():
        return LowbitMetadataBuilder if current_model() is not None else CPUAttentionMetadataBuilder
