"""lowbit's packed KV cache as a CUDA attention backend of vLLM 0.26.x (imports vLLM).

Registered by lowbit.vllm_plugin.register() on vLLM's CUDA platform with a 0.26 vLLM:

  - as AttentionBackendEnum.CUSTOM (register_backend), and chosen automatically for a model directory
    that carries lowbit_kv.json (CudaPlatform.get_attn_backend_cls is wrapped: no --attention-backend
    given, or CUSTOM -> this backend; every other model, or an explicit other backend, is untouched).
    So `vllm serve EXPORT_DIR` (a `lowbit export --for vllm` directory) serves lowbit's packed cache.
  - the layer's KV spec (Attention.get_kv_cache_spec is wrapped for this backend's layers only): a
    TQFullAttentionSpec (vLLM's full-attention spec whose page is block_size x H_kv x slot bytes) with
    slot = lowbit's cell (SlotFormat.slot_bytes), so vLLM's block manager sizes the cache -- and reports
    capacity -- from the packed size. vLLM's allocator hands each layer uint8-compatible storage viewed
    as [num_blocks, H_kv, block_size, slot_bytes / dtype bytes] in the model dtype; the backend reads it
    as bytes: the CPU plugin's cell layout (slot.py), one cell per (token, KV head).

Per step (forward includes the cache write; no host synchronisation anywhere):
  - write (cuda_write.write): one fused Triton kernel rotates K/V (R_k, R_v), quantizes with lowbit's
    one quantizer's arithmetic, packs, stores the cells at slot_mapping, and stores the exact-tier rows
    (position < sink, or >= seq_len - recent) dense into the tier pool.
  - attention: queries rotated by R_k; the history [0, seq - q_len) read through vLLM's block table (codes,
    or the tier pool's dense rows), the step's own new tokens exact (as they arrived, rotated, causal) --
    lowbit's runtime semantics; output un-rotated by R_v^T.
      decode requests: cuda_kernels.paged_attention, split-K over the history (static split count from the
      block table's width), all G query heads of a KV head per program, LSE merge;
      prefill chunks (eager batches): cuda_kernels.prefill_attention_sdpa -- the stored history gathered dense
      (one Triton kernel, rotated, model dtype) and the chunk's own rows, through torch SDPA with a lower-right
      causal mask (FlashAttention on the GPU); with logit soft-capping every request takes the Triton kernel.
  - the exact tiers: a dense pool per layer [S, block_size, H_kv, D] in the model dtype (allocated when the
    layer is built, so vLLM's memory profile counts it: S = max_num_seqs x blocks a request's tiers span),
    keyed by physical block through a device map (dmap) the metadata builder maintains with torch ops
    (no sync): blocks holding a running request's sink or recent rows keep (or get) a pool slot, the others
    are released. A tier row whose block has no slot is read from its codes (every row is also packed).
  - CUDA graphs: AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE -- FULL graphs for pure decode batches
    (grids from static maxima, tile lists from a persistent arange, every length read on the device);
    mixed / prefill batches run the attention eagerly (PIECEWISE).
Refused at load, by name: what SlotFormat refuses (VQ rows, the 1-bit residual, KIVI, Lloyd-Max,
scale-only groups, fold_v_rotation), and on CUDA also: 16-bit K or V, key affines, head dims / groups
that are not powers of two, sliding-window layers, alibi, attention sinks, --kv-cache-dtype other than auto.
Prefix caching: the scheduler holds back a hit's recent tier (prefix.py, as on CPU); a hit's sink rows are
exact while some running request holds their block, else read from codes (no hold of finished requests'
sink blocks, unlike the CPU arena).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import ClassVar

import torch
from vllm.config import get_current_vllm_config
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadata,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
)

from lowbit.core.errors import LowbitError
from lowbit.vllm_plugin import cuda_kernels, cuda_write, sidecar
from lowbit.vllm_plugin.cuda_model import CudaModel, load
from lowbit.vllm_plugin.cuda_tiers import TierSlots, tier_blocks
from lowbit.vllm_plugin.tp import kv_heads_for_rank, slice_heads

log = logging.getLogger("lowbit.vllm_plugin")
_LAYER_RE = re.compile(r"layers\.(\d+)\.")
BLOCK_SIZE = 16
BLOCKS_PER_SPLIT = 32  # history blocks per decode split (512 tokens)
PREFILL_TILE = 16  # query tokens per prefill program


_ONLY: dict = {}


def current_model() -> CudaModel | None:
    """The lowbit model of the vLLM config in force; outside one, the one this process loaded."""
    try:
        cfg = get_current_vllm_config()
        mc = getattr(cfg, "model_config", None)
    except AssertionError:
        mc = None
    if mc is None:
        if len(_ONLY) == 1:
            return next(iter(_ONLY.values()))
        raise LowbitError("lowbit plugin (CUDA): vLLM asked about the backend outside a model config before a model "
                          "was loaded; report this with the vLLM version")
    m = load(str(mc.model), mc.dtype)
    _ONLY[(str(mc.model), mc.dtype)] = m
    return m


# ------------------------------------------------------------------- metadata
@dataclass
class LowbitCudaMetadata(AttentionMetadata):
    num_actual_tokens: int
    num_reqs: int
    max_query_len: int
    query_start_loc: torch.Tensor  # int32 [R + 1] (device)
    seq_lens: torch.Tensor  # int32 [R] (device)
    block_table: torch.Tensor  # int32 [R, MB] (device)
    slot_mapping: torch.Tensor  # int64 [T] (device)
    tile_req: torch.Tensor  # int32 [n_tiles]
    tile_t0: torch.Tensor
    bm: int
    tiers: TierSlots | None = None
    prefills: list = field(default_factory=list)  # [(request, first token, end token, seq_len)] (host ints)
    memo: dict = field(default_factory=dict)


class LowbitCudaMetadataBuilder(AttentionMetadataBuilder[LowbitCudaMetadata]):
    _cudagraph_support: ClassVar[AttentionCGSupport] = AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE

    def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        sched = vllm_config.scheduler_config
        self.max_tokens = int(getattr(sched, "max_num_batched_tokens", 8192) or 8192) + 64
        self.arange = torch.arange(self.max_tokens, dtype=torch.int32, device=device)  # decode tiles (static)
        self.tile_req = torch.zeros(self.max_tokens, dtype=torch.int32, device=device)
        self.tile_t0 = torch.zeros(self.max_tokens, dtype=torch.int32, device=device)
        self.model = current_model()
        hf = getattr(getattr(vllm_config, "model_config", None), "hf_config", None)
        self.softcap_layers = bool(getattr(hf, "attn_logit_softcapping", None) or 0)
        self.tiers: TierSlots | None = None
        sch = self.model.scheme if self.model is not None else None
        if sch is not None and (sch.sink or sch.recent):
            nb = max(int(getattr(vllm_config.cache_config, "num_gpu_blocks", None) or 0), 1 << 22)  # 16 MiB map
            self.tiers = TierSlots(int(nb), tier_pool_slots(vllm_config, sch), kv_cache_spec.block_size,
                                   sch.sink, sch.recent, device)

    def build(self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata,
              fast_build: bool = False) -> LowbitCudaMetadata:
        m = common_attn_metadata
        T, R = int(m.num_actual_tokens), int(m.num_reqs)
        prefills: list = []
        if m.max_query_len <= 1:
            bm, treq, tt0 = 1, self.arange[:T], self.arange[:T]
        else:  # a mixed / prefill batch (eager): decode requests on the kernel, prefill chunks through SDPA
            import numpy as np

            qsl = np.asarray(m.query_start_loc_cpu[: R + 1], dtype=np.int64)
            lens = qsl[1:] - qsl[:-1]
            up = getattr(m, "seq_lens_cpu_upper_bound", None)  # precise for prefill rows (vLLM 0.26)
            seq_cpu = (up if up is not None else m.seq_lens.cpu())[:R].tolist()  # (.cpu(): only without it)
            if self.softcap_layers:  # the scores need the cap: every request on the Triton kernel, 16-token tiles
                bm = PREFILL_TILE
                tr, t0 = cuda_kernels.tiles_for(m.query_start_loc_cpu[: R + 1], bm)
            else:
                bm = 1
                dec = np.nonzero(lens == 1)[0]
                prefills = [(int(r), int(qsl[r]), int(qsl[r + 1]), int(seq_cpu[r])) for r in np.nonzero(lens > 1)[0]]
                tr = torch.from_numpy(dec.astype(np.int32))
                t0 = torch.from_numpy(qsl[dec].astype(np.int32))
            n = tr.numel()
            pin = torch.cuda.is_available()  # pinned: an async copy that never waits on the device
            if n:
                self.tile_req[:n].copy_(tr.pin_memory() if pin else tr, non_blocking=True)
                self.tile_t0[:n].copy_(t0.pin_memory() if pin else t0, non_blocking=True)
            treq, tt0 = self.tile_req[:n], self.tile_t0[:n]
        table = m.block_table_tensor
        seq = m.seq_lens
        if self.tiers is not None:
            self.tiers.update(table[:R], seq[:R])
        return LowbitCudaMetadata(num_actual_tokens=T, num_reqs=R, max_query_len=int(m.max_query_len),
                                  query_start_loc=m.query_start_loc, seq_lens=seq, block_table=table,
                                  slot_mapping=m.slot_mapping, tile_req=treq, tile_t0=tt0, bm=bm, tiers=self.tiers,
                                  prefills=prefills)


def tier_pool_slots(vllm_config, scheme) -> int:
    """Pool slots (blocks) for max_num_seqs requests' sink + recent tiers."""
    seqs = int(getattr(vllm_config.scheduler_config, "max_num_seqs", 256) or 256)
    ns, nr = tier_blocks(scheme.sink, scheme.recent, BLOCK_SIZE)
    return seqs * (ns + nr) + 8


# ------------------------------------------------------------------- impl
class LowbitCudaImpl(AttentionImpl[LowbitCudaMetadata]):
    def __init__(self, num_heads: int, head_size: int, scale: float, num_kv_heads: int | None = None,
                 alibi_slopes=None, sliding_window: int | None = None, kv_cache_dtype: str = "auto",
                 logits_soft_cap: float | None = None, attn_type: str = AttentionType.DECODER,
                 kv_sharing_target_layer_name: str | None = None, sinks=None, **kwargs):
        if attn_type != AttentionType.DECODER:
            raise LowbitError(f"the lowbit CUDA backend serves decoder attention only, not {attn_type}")
        if alibi_slopes is not None or sinks is not None:
            raise LowbitError("the lowbit CUDA backend does not support alibi or attention sinks")
        if sliding_window is not None:
            raise LowbitError("the lowbit CUDA backend serves full-attention layers only (sliding window given)")
        if kv_cache_dtype not in ("auto", None):
            raise LowbitError(f"--kv-cache-dtype {kv_cache_dtype} conflicts with the lowbit sidecar; leave it 'auto'")
        if kv_sharing_target_layer_name is not None:
            raise LowbitError("the lowbit CUDA backend does not support KV sharing between layers")
        self.model = current_model()
        if self.model is None:
            raise LowbitError("internal: lowbit CUDA attention built for a model without a sidecar")
        self.num_heads, self.head_size, self.scale = num_heads, head_size, float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.head_size_v = kwargs.get("head_size_v", head_size)
        self.kv_cache_dtype = kv_cache_dtype
        self.kv_sharing_target_layer_name = None
        self.sliding_window = None
        self.softcap = float(logits_soft_cap or 0.0)
        self.attn_type = attn_type
        self.fmt = self.model.layer_formats[0]
        self.slot_bytes = self.model.slot_bytes
        self._layer: int | None = None
        self._dev: dict = {}
        cfg = get_current_vllm_config()
        self.dtype = cfg.model_config.dtype
        sch = self.model.scheme
        self.sink, self.recent = int(sch.sink), int(sch.recent)
        self.pool = None
        if self.sink or self.recent:
            if cfg.cache_config.block_size != BLOCK_SIZE:
                raise LowbitError(f"the lowbit CUDA backend runs with --block-size {BLOCK_SIZE}, not "
                                  f"{cfg.cache_config.block_size}")
            S = tier_pool_slots(cfg, sch) + 1
            dev = torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else "cpu"
            self.pool = (torch.zeros(S, BLOCK_SIZE, self.num_kv_heads, head_size, dtype=self.dtype, device=dev),
                         torch.zeros(S, BLOCK_SIZE, self.num_kv_heads, self.head_size_v, dtype=self.dtype,
                                     device=dev))

    def _layer_state(self, layer, device):
        """(fmt, R_k, R_v) of this layer on the device, resolved once."""
        if self._layer is None:
            m = _LAYER_RE.search(getattr(layer, "layer_name", ""))
            if m is None:
                raise LowbitError(f"cannot tell the layer index of {getattr(layer, 'layer_name', '')!r}")
            i = int(m.group(1))
            g = self.model.geometry.layers[i]
            tp_size, tp_rank = _tensor_parallel()
            heads = kv_heads_for_rank(g.num_kv_heads, tp_size, tp_rank)  # this rank's KV heads, as vLLM splits them
            if (g.head_dim_k, len(heads)) != (self.head_size, self.num_kv_heads):
                raise LowbitError(f"layer {i}: vLLM has {self.num_kv_heads} KV heads x {self.head_size} on rank "
                                  f"{tp_rank} of {tp_size} but the sidecar's {g.num_kv_heads} x {g.head_dim_k} give "
                                  f"{len(heads)}; export again for this model")
            self._layer = i
            self.fmt = self.model.layer_formats[i]
            # per-KV-head rotations [H, D, D] are sliced to the rank's heads (one export serves every rank);
            # a per-layer [D, D] rotation is the same on every rank
            rk, rv = (r if r is None or r.dim() == 2 else slice_heads(r, g.num_kv_heads, tp_size, tp_rank)
                      for r in self.model.rotations[i])
            prep = (lambda r: None if r is None else r.to(device=device, dtype=torch.float32).contiguous())
            self._dev = {"rk": prep(rk), "rv": prep(rv),
                         "rvT": None if rv is None else prep(rv.transpose(-1, -2))}
        return self.fmt, self._dev["rk"], self._dev["rv"], self._dev["rvT"]

    @staticmethod
    def _rot(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
        """x [T, H, G, D] @ r ([D, D] or [H, D, D]) in float32."""
        if r is None:
            return x.float()
        if r.dim() == 2:
            return x.float() @ r
        return torch.einsum("thgd,hde->thge", x.float(), r)

    def forward(self, layer, query, key, value, kv_cache, attn_metadata, output, output_scale=None,
                output_block_scale=None):
        if output_scale is not None or output_block_scale is not None:
            raise NotImplementedError("fused output quantization is not supported by the lowbit backend")
        if attn_metadata is None or kv_cache is None or kv_cache.numel() == 0:  # profiling / no cache yet
            return output
        md = attn_metadata
        n = md.num_actual_tokens
        H, G, D, Dv = self.num_kv_heads, self.num_heads // self.num_kv_heads, self.head_size, self.head_size_v
        fmt, rk, rv, rvT = self._layer_state(layer, query.device)
        cache = kv_cache.view(torch.uint8)
        if cache.shape[-1] != fmt.slot_bytes:
            raise LowbitError(f"internal: vLLM gave {cache.shape[-1]} B cells, the lowbit cell is {fmt.slot_bytes} B")
        q = query[:n].view(n, self.num_heads, D)
        k = key[:n].view(n, H, D)
        v = value[:n].view(n, H, Dv)
        R = md.num_reqs
        qsl = md.query_start_loc[: R + 1]
        seq = md.seq_lens[:R]
        pk = ("pos", n)
        if pk not in md.memo:  # token positions and their request's length: device ops, once per step
            tok = torch.arange(n, device=q.device, dtype=torch.int32)
            req = torch.searchsorted(qsl[1:].contiguous(), tok, right=True).clamp(max=max(R - 1, 0))
            valid = tok < qsl[R]
            pos = seq[req] - (qsl[req + 1] - tok)
            md.memo[pk] = (torch.where(valid, pos, -1).to(torch.int32).contiguous(),
                           torch.where(valid, seq[req], 0).to(torch.int32).contiguous())
        positions, row_seq = md.memo[pk]
        tiers = None
        if self.pool is not None and md.tiers is not None:
            tiers = (self.pool[0], self.pool[1], md.tiers.dmap, md.tiers.dvalid)
        kr = torch.empty(n, H, D, dtype=self.dtype, device=q.device)
        vr = torch.empty(n, H, Dv, dtype=self.dtype, device=q.device)
        cuda_write.write(cache, fmt, k, v, md.slot_mapping[:n], rk, rv, positions=positions, row_seq=row_seq,
                         sink=self.sink, recent=self.recent, tiers=tiers, rows_out=(kr, vr))
        qr = self._rot(q.view(n, H, G, D), rk).reshape(n, self.num_heads, D)
        if md.bm == 1:
            nsplit = None  # block table width / BLOCKS_PER_SPLIT: static
            bps = BLOCKS_PER_SPLIT
        else:
            nsplit, bps = 1, BLOCKS_PER_SPLIT
        o = None
        if md.prefills or not md.tile_req.numel():
            o = torch.zeros(n, self.num_heads, Dv, dtype=torch.float32, device=q.device)
        if md.tile_req.numel():  # decode requests (all of a decode batch; a mixed batch's qlen-1 requests)
            o = cuda_kernels.paged_attention(qr, kr, vr, cache, fmt, md.block_table, seq, qsl, md.tile_req,
                                             md.tile_t0, bm=md.bm, scale=self.scale, sink=self.sink,
                                             recent=self.recent, tiers=tiers, softcap=self.softcap,
                                             blocks_per_split=bps, n_splits=nsplit, out=o)
        for r, a, b, sq in md.prefills:  # prefill chunks: stored history dense + own rows exact, SDPA (eager)
            o[a:b] = cuda_kernels.prefill_attention_sdpa(qr[a:b], kr[a:b], vr[a:b], cache, fmt, md.block_table[r],
                                                         sq - (b - a), sq, scale=self.scale, sink=self.sink,
                                                         recent=self.recent, tiers=tiers)
        o = self._rot(o.view(n, H, G, Dv), rvT)  # un-rotate by R_v^T
        output[:n].copy_(o.reshape(output[:n].shape))
        return output


# ------------------------------------------------------------------- backend
class LowbitCUDABackend(AttentionBackend):
    """lowbit's packed KV cache on vLLM 0.26's CUDA platform (AttentionBackendEnum.CUSTOM)."""

    accept_output_buffer: bool = True
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16]

    @staticmethod
    def get_name() -> str:
        return "CUSTOM"

    @staticmethod
    def get_supported_kernel_block_sizes():
        return [BLOCK_SIZE]

    @staticmethod
    def get_impl_cls():
        return LowbitCudaImpl

    @staticmethod
    def get_builder_cls():
        return LowbitCudaMetadataBuilder

    @staticmethod
    def get_kv_cache_shape(num_blocks: int, block_size: int, num_kv_heads: int, head_size: int,
                           cache_dtype_str: str = "auto") -> tuple[int, ...]:
        m = current_model()
        if m is None:
            raise LowbitError("internal: the lowbit CUDA backend asked for a model without a sidecar")
        elt = torch.empty((), dtype=_model_dtype()).element_size()
        if m.slot_bytes % elt:
            raise LowbitError(f"lowbit cell of {m.slot_bytes} B is not a whole number of {elt}-byte elements")
        return (num_blocks, num_kv_heads, block_size, m.slot_bytes // elt)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        raise NotImplementedError  # the logical shape is the physical one

    @classmethod
    def supports_head_size(cls, head_size: int) -> bool:
        return head_size >= 16 and head_size & (head_size - 1) == 0

    @classmethod
    def supports_kv_cache_dtype(cls, kv_cache_dtype) -> bool:
        return kv_cache_dtype in (None, "auto")

    @classmethod
    def supports_kv_connector(cls) -> bool:
        return False


def _model_dtype() -> torch.dtype:
    try:
        return get_current_vllm_config().model_config.dtype
    except Exception:  # noqa: BLE001  (outside a config: the loaded model's)
        if len(_ONLY) == 1:
            return next(iter(_ONLY))[1]
        return torch.bfloat16


# ------------------------------------------------------------------- registration (called by register())
CLASS_PATH = f"{__name__}.LowbitCUDABackend"


def install() -> None:
    """Register the backend as CUSTOM, choose it for lowbit directories, size their KV spec. Idempotent."""
    from vllm.model_executor.layers.attention import attention as attn_mod
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    register_backend(AttentionBackendEnum.CUSTOM, CLASS_PATH)
    plat = type(current_platform)
    orig_sel = plat.get_attn_backend_cls
    if not getattr(orig_sel, "lowbit_wrapped", False):
        fn = orig_sel.__func__ if hasattr(orig_sel, "__func__") else orig_sel

        def get_attn_backend_cls(cls, selected_backend, attn_selector_config, num_heads=None):
            try:
                mc = get_current_vllm_config().model_config
                lowbit_dir = mc is not None and sidecar.has_sidecar(str(mc.model))
            except Exception:  # noqa: BLE001
                lowbit_dir = False
            if lowbit_dir and (selected_backend is None or selected_backend == AttentionBackendEnum.CUSTOM):
                log.warning("lowbit plugin (CUDA): %s has %s: attention backend = lowbit's packed KV cache",
                            mc.model, sidecar.SIDECAR_NAME)
                return CLASS_PATH
            if lowbit_dir:
                log.warning("lowbit plugin (CUDA): --attention-backend %s given for a lowbit directory: vLLM serves "
                            "it with its own KV cache, not the packed one", selected_backend)
            return fn(cls, selected_backend, attn_selector_config, num_heads)

        get_attn_backend_cls.lowbit_wrapped = True
        plat.get_attn_backend_cls = classmethod(get_attn_backend_cls)
    cls = attn_mod.Attention
    orig_spec = cls.get_kv_cache_spec
    if not getattr(orig_spec, "lowbit_wrapped", False):
        def get_kv_cache_spec(self, vllm_config):
            impl = getattr(self, "impl", None)
            if not isinstance(impl, LowbitCudaImpl):
                return orig_spec(self, vllm_config)
            from vllm.v1.kv_cache_interface import TQFullAttentionSpec

            return TQFullAttentionSpec(block_size=vllm_config.cache_config.block_size,
                                       num_kv_heads=self.num_kv_heads, head_size=self.head_size,
                                       head_size_v=self.head_size_v, dtype=self.kv_cache_torch_dtype,
                                       tq_slot_size=impl.slot_bytes)

        get_kv_cache_spec.lowbit_wrapped = True
        cls.get_kv_cache_spec = get_kv_cache_spec


def _tensor_parallel() -> tuple[int, int]:
    """(world size, rank) of vLLM's tensor-parallel group; (1, 0) before vLLM set one up (a single process)."""
    from vllm.distributed import parallel_state as ps

    if not ps.model_parallel_is_initialized():
        return 1, 0
    return ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
