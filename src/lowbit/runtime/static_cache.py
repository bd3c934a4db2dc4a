"""StaticKVCache: capacity-sized packed KV buffers for a batch of slots, written by index arithmetic.

    plan = lowbit.kv.plan.resolve(scheme, geometry, device="cuda")
    cache = StaticKVCache(model, plan, slots=16, max_context=32768)    # allocates everything once
    cache.begin_prefill(slot=0, start=0, length=n) ; model forward over the prompt chunk(s)
    cache.begin_decode(batch=16) ; one-token forward for slots [0, 16) ; cache.advance(active)

Layout per layer (slots B, KV heads H, head_dim D; one trash row at the end of every tier takes the
writes that must go nowhere, so no write needs a branch):

    full layer, quantized:  sink  [B, H, S+1, D]      positions [0, S)                  model dtype
                            ring  [B, H, R+1, D]      the last R positions >= S, circular: position p
                                                      in row (p - S) mod R                model dtype
                            middle codec fields [B, H, C+1, w]  positions [S, n - R) in row p - S
                                                      (codes uint8 "strided", scale/zero fp16; no
                                                      zero for scale-only groups, zero 'none')
    sliding layer (window W): ring [B, H, W+1, D] of the last W positions (row p mod W); nothing else
    nothing quantized (bf16):  one dense buffer [B, H, max_context+1, D], position p in row p

A decode step writes one token per slot at position p = lens[b]: the token leaving the ring
(position p - R) is encoded by the layer's codec (the one quantizer) into middle row p - R - S, and
the new token takes its ring row. These are fixed-shape gathers and scatters on device tensors: no
host synchronisation and no Python branch on a length, so a whole decode step can be captured in a
CUDA graph. The tiers equal QuantizedKVCache's at page 1 (same codes), so the eager cache is this
cache's reference. Per-slot lengths make ragged batches: slot b holds lens[b] tokens.
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from lowbit.backends import torch_stream as attn
from lowbit.core.errors import LowbitError
from lowbit.kernels.ops import decode_attention_op, decode_attention_vq_op
from lowbit.kv.key_affine import KeyAffine, map_keys, map_queries
from lowbit.runtime.cache import _check_key_affine, _split_model, model_device

_ROW_ALIGN = 64  # rows per (slot, head) rounded up so every head starts 64 rows (>= 128 B) aligned
# rows (all heads and batch slots together) up to which a traced rotation is a fused product-sum, not a GEMM
# (_rot). Inductor makes the product-sum one reduction kernel with RoPE inlined, which saves a kernel at B = 1
# (32 query rows of a Llama-3-8B layer), but it re-reads R per output element: at B = 16 (512 rows) that
# kernel took 17 us a layer on the H200 (git history: benchmarks/results/runtime/decode_e2e_B16_s15_NVIDIA_H200.log), where a GEMM
# of [512, 128] x [128, 128] is a few us.
_ROT_SUM_ROWS = 64


def _rows(n: int) -> int:
    """Rows to allocate for n valid rows plus the trash row, rounded up to _ROW_ALIGN."""
    return -(-(n + 1) // _ROW_ALIGN) * _ROW_ALIGN


def _rot(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    """x [B, H, T, D] @ r ([D, D] or per head [H, D, D]) in r's dtype (the model's: the rotated K/V are
    stored and the queries read in it, so a float32 product would only be rounded back)."""
    if r is None:
        return x
    x = x.to(r.dtype)
    if torch.compiler.is_compiling() and x.numel() // x.shape[-1] <= _ROT_SUM_ROWS:
        # a small decode step's few rows: a broadcast product summed over D, which Inductor generates as
        # one reduction kernel with its producer (RoPE) inlined, where a GEMM would be a kernel of its
        # own; float32 products and sums, as the GEMM accumulates
        rr = r if r.dim() == 2 else r[None, :, None]  # [D, D] or [1, H, 1, D, D]
        return (x.float().unsqueeze(-1) * rr.float()).sum(-2).to(r.dtype)
    return torch.matmul(x, r) if r.dim() == 2 else torch.matmul(x, r.unsqueeze(0))


def _unrot(x: torch.Tensor, r: torch.Tensor | None) -> torch.Tensor:
    return x if r is None else _rot(x, r.transpose(-1, -2))


def static_reason(layer) -> str | None:
    """Why the static runtime cannot hold lowbit.kv.plan.LayerPlan `layer` (None: it can)."""
    for which, c in (("K", layer.k), ("V", layer.v)):
        if c.quantized and c.tq.axis != "token":
            return f"{which} is grouped per channel over pages (the static runtime writes one token at a time)"
    if layer.k.quantized != layer.v.quantized:
        return "only one of K and V is quantized (the static runtime stores both packed or both dense)"
    return None


def _mid_tier(codec, mid: dict, B: int, C: int) -> tuple:
    """(codes, scale, zero, centre) of a packed middle tier's first B slots and C rows, as the fused kernel
    takes them: zero None and the centre code for scale-only groups (zero 'none': the kernel computes
    zero = -centre * scale), the stored zero and centre None otherwise."""
    zero = mid["zero"][:B, :, :C] if codec.stores_zero else None
    return mid["codes"][:B, :, :C], mid["scale"][:B, :, :C], zero, None if codec.stores_zero else codec.centre


def _keys_in(layer, k: torch.Tensor) -> torch.Tensor:
    """Post-RoPE keys [B, H, c, D] as the layer stores them: the key affine (if any: (k - shift) / scale, in
    float32 as the eager cache maps them), then R_k; in the cache dtype."""
    if layer.k_affine is None:
        return _rot(k, layer.rot_k).to(layer.dtype)
    mk = map_keys(k, layer.k_affine)  # float32
    return _rot(mk, None if layer.rot_k is None else layer.rot_k.float()).to(layer.dtype)


def _queries_in(layer, q: torch.Tensor) -> torch.Tensor:
    """Queries [B, H, N, D] (a KV head's query heads stacked as rows) mapped to match the stored keys:
    q * scale (the key map's inverse transpose), then R_k; in q's dtype."""
    if layer.k_affine is None:
        return _rot(q, layer.rot_k)
    mq = map_queries(q, layer.k_affine)  # float32
    return _rot(mq, None if layer.rot_k is None else layer.rot_k.float()).to(q.dtype)


def _write_rows(kind, S, R, C, k_codec, v_codec, dtype, checks,
                sink_k, sink_v, ring_k, ring_v, mid_k: dict, mid_v: dict, k, v, b, p) -> None:
    """The write of StaticLayer (see its docstring); a free function so one compiled copy serves every
    layer of the same configuration. buf[b[i], :, row[i]] = value[i] scatters; no host sync."""
    if kind == "dense":
        rows = p.clamp(max=C)
        mid_k["dense"][b, :, rows] = k.to(dtype)
        mid_v["dense"][b, :, rows] = v.to(dtype)
        return
    if kind == "ring":
        rows = p % R
        ring_k[b, :, rows] = k.to(dtype)
        ring_v[b, :, rows] = v.to(dtype)
        return
    in_sink = p < S
    srow = torch.where(in_sink, p, S)
    sink_k[b, :, srow] = k.to(dtype)
    sink_v[b, :, srow] = v.to(dtype)
    ring_row = torch.where(in_sink, R, (p - S) % R)
    # the token leaving the ring (position p - R) goes to the middle, through the codec
    leaving = p - R
    mid_row = torch.where(leaving >= S, (leaving - S).clamp(0, C), C)
    for codec, mid, ring in ((k_codec, mid_k, ring_k), (v_codec, mid_v, ring_v)):
        enc = codec.encode(ring[b, :, ring_row].unsqueeze(2), dtype, checks=checks)  # fields [N, H, 1, w]
        for name, val in enc.items():
            mid[name][b, :, mid_row] = val[:, :, 0]
    ring_k[b, :, ring_row] = k.to(dtype)
    ring_v[b, :, ring_row] = v.to(dtype)


_WRITERS: dict = {}


def _writer(layer, checks: bool, compiled: bool):
    """The write function for `layer`'s configuration (compiled once per configuration when asked)."""
    key = (layer.kind, layer.S, layer.R, layer.C, layer.k_codec.tq, layer.v_codec.tq, layer.Dk, layer.Dv,
           layer.dtype, checks, compiled)
    fn = _WRITERS.get(key)
    if fn is None:
        import functools

        body = _write_rows
        if compiled:
            import types

            # one code object per configuration: dynamo counts recompiles per code object, and every
            # configuration (tier shapes, codecs, and the strides its K/V arrive in: fused projections hand
            # over slices) through one shared code object hit its recompile limit of 8 in a long-lived process
            code = _write_rows.__code__.replace(co_name=f"_write_rows_{len(_WRITERS)}")
            body = types.FunctionType(code, _write_rows.__globals__, code.co_name, _write_rows.__defaults__)
            # and a higher limit: the H200 run still hit 8 recompiles of one configuration in a test that drives
            # a fused and an unfused model through it (cause not isolated); a recompile costs seconds, a hit limit
            # fails the step (fullgraph)
            cfg = torch._dynamo.config
            name = "recompile_limit" if hasattr(cfg, "recompile_limit") else "cache_size_limit"
            setattr(cfg, name, max(int(getattr(cfg, name)), 64))
        fn = functools.partial(body, layer.kind, layer.S, layer.R, layer.C, layer.k_codec, layer.v_codec,
                               layer.dtype, checks)
        if compiled:
            # emulate_precision_casts: keep the fp16 rounding of scales and zeros the codec does (inductor
            # would otherwise fold the float32 -> fp16 -> float32 round trip away)
            # dynamic=False: with automatic dynamic shapes, a second configuration through the same code
            # (int4 after int2) turned the bit width into a symbol and failed to trace (H200 run, 2026-12-01)
            fn = torch.compile(fn, dynamic=False, fullgraph=True, options={"emulate_precision_casts": True})
        _WRITERS[key] = fn
    return fn


class StaticLayer(CacheLayerMixin):
    """One layer's static buffers (see the module docstring)."""

    is_compileable = True

    def __init__(self, plan, slots: int, max_context: int, device, dtype):
        super().__init__()
        self.plan = plan
        g = plan.geometry
        self.layer_idx = g.index
        self.is_sliding = g.attention == "sliding"
        self.window = plan.window
        self.H, self.Dk, self.Dv = g.num_kv_heads, g.head_dim_k, g.head_dim_v
        self.k_codec, self.v_codec = plan.k, plan.v
        self.quantized = plan.k.quantized
        # VQ rows (lowbit.kernels.attention.vq): their codebooks on the device once
        self.k_codebook = plan.k.codebook_on(device) if plan.k.quantized and plan.k.vq else None
        self.v_codebook = plan.v.codebook_on(device) if plan.v.quantized and plan.v.vq else None
        # VQ rows or a 1-bit residual: read by lowbit.kernels.attention.vq (through its op), not decode_attention
        self.vq = (self.k_codebook is not None or self.v_codebook is not None
                   or any(c.quantized and c.residual is not None for c in (plan.k, plan.v)))
        self.device, self.dtype = device, dtype
        kw = {"device": device, "dtype": dtype}
        B, H = slots, self.H
        if self.is_sliding:
            self.kind, self.S, self.R, self.C = "ring", 0, self.window, 0
        elif self.quantized:
            self.kind, self.S, self.R = "tiers", plan.sink, plan.recent
            self.C = max(0, max_context - plan.sink - plan.recent)
            if self.R == 0:
                raise LowbitError(f"layer {self.layer_idx}: the static runtime needs recent > 0 (the new token "
                                  "is read from the ring); use --recent 16 or more")
        else:
            self.kind, self.S, self.R, self.C = "dense", 0, 0, max_context
        # row S / R / C of each tier is the trash row; rows beyond it only pad heads to alignment
        self.sink_k = torch.zeros(B, H, _rows(self.S), self.Dk, **kw)
        self.sink_v = torch.zeros(B, H, _rows(self.S), self.Dv, **kw)
        self.ring_k = torch.zeros(B, H, _rows(self.R), self.Dk, **kw)
        self.ring_v = torch.zeros(B, H, _rows(self.R), self.Dv, **kw)
        self.mid: dict[str, dict[str, torch.Tensor]] = {"k": {}, "v": {}}
        if self.kind == "dense":
            self.mid = {"k": {"dense": torch.zeros(B, H, _rows(self.C), self.Dk, **kw)},
                        "v": {"dense": torch.zeros(B, H, _rows(self.C), self.Dv, **kw)}}
        elif self.kind == "tiers":
            for t, codec in (("k", self.k_codec), ("v", self.v_codec)):
                for name, width in codec.fields().items():
                    dt = codec.field_dtype(name, dtype)
                    self.mid[t][name] = torch.zeros(B, H, _rows(self.C), width, device=device, dtype=dt)
        self.rot_k = None if plan.rot_k is None else plan.rot_k.to(device, dtype)
        self.rot_v = None if plan.rot_v is None else plan.rot_v.to(device, dtype)
        ka = getattr(plan, "k_affine", None)  # lowbit.kv.key_affine: keys mapped at ingest, queries at read
        self.k_affine = None if ka is None else KeyAffine(ka.scale.to(device), ka.shift.to(device))
        self.is_initialized = True
        self.keys = self.values = None

    # ------------------------------------------------------------- bytes
    def nbytes(self) -> int:
        ts = [self.sink_k, self.sink_v, self.ring_k, self.ring_v] + [x for d in self.mid.values() for x in d.values()]
        return sum(t.numel() * t.element_size() for t in ts)

    # ------------------------------------------------------------- lengths
    def tier_lens(self, n: torch.Tensor):
        """(sink, middle, ring) valid rows per slot for n [B] tokens stored (int32 device tensors)."""
        if self.kind == "ring":
            z = torch.zeros_like(n)
            return z, z, n.clamp(max=self.R)
        if self.kind == "dense":
            z = torch.zeros_like(n)
            return z, n.clamp(max=self.C), z
        S, R = self.S, self.R
        return n.clamp(max=S), (n - S - R).clamp(0, self.C), (n - S).clamp(0, R)

    # ------------------------------------------------------------- write
    def _put(self, buf: torch.Tensor, b: torch.Tensor, rows: torch.Tensor, val: torch.Tensor) -> None:
        """buf[b[i], :, rows[i]] = val[i] for every i (val [N, H, w]); one scatter, no sync."""
        buf[b, :, rows] = val.to(buf.dtype)

    def write(self, k: torch.Tensor, v: torch.Tensor, b: torch.Tensor, p: torch.Tensor, *, checks: bool,
              compiled: bool = False) -> None:
        """Store tokens k [N, H, Dk], v [N, H, Dv] (rotated, model dtype) of slots b [N] at positions p [N].

        The N writes must not collide: in a decode step one token per slot; in a prefill, positions
        of one slot in order, chunked so that no two of them share a ring row (len <= R).
        compiled: run the write as one torch.compile'd function (CUDA decode steps: a few fused kernels
        instead of ~60 small ones per layer). The same code; its reductions (group mean / std) may round
        in another order, so a code can differ by one step from the eager codec's at a rounding tie
        (tests/runtime/test_gpu_runtime.py measures how often). Eager and captured runtime steps on CUDA
        both use it, so they hold the same codes."""
        fn = _writer(self, checks, compiled)
        fn(self.sink_k, self.sink_v, self.ring_k, self.ring_v, self.mid["k"], self.mid["v"], k, v, b, p)

    def write_chunk(self, k: torch.Tensor, v: torch.Tensor, slot: int, start: int, *, checks: bool) -> None:
        """A prefill chunk k [c, H, Dk], v [c, H, Dv] (rotated) of `slot` at positions [start, start + c)
        (python ints): the same final tiers as c one-token writes, with one codec call per tensor for
        everything that reaches the middle (the old ring rows that leave it, then the chunk's own)."""
        c = k.shape[0]
        dev = k.device
        end = start + c
        if self.kind == "dense":
            self.mid["k"]["dense"][slot, :, start:end] = k.transpose(0, 1).to(self.dtype)
            self.mid["v"]["dense"][slot, :, start:end] = v.transpose(0, 1).to(self.dtype)
            return
        if self.kind == "ring":
            m = min(c, self.R)
            rows = (torch.arange(end - m, end, device=dev) % self.R)
            self.ring_k[slot, :, rows] = k[c - m:].transpose(0, 1).to(self.dtype)
            self.ring_v[slot, :, rows] = v[c - m:].transpose(0, 1).to(self.dtype)
            return
        S, R, C = self.S, self.R, self.C
        if start < S:  # sink
            n = min(S, end) - start
            self.sink_k[slot, :, start:start + n] = k[:n].transpose(0, 1).to(self.dtype)
            self.sink_v[slot, :, start:start + n] = v[:n].transpose(0, 1).to(self.dtype)
        # positions that end in the middle: [S, end - R); from the old ring those < start, then the chunk's
        lo, hi = max(S, start - R), min(end - R, S + C)
        if hi > lo:
            old = torch.arange(lo, max(lo, min(hi, start)), device=dev)
            rows_old = (old - S) % R
            new_lo = max(lo, start)
            parts_k = [self.ring_k[slot, :, rows_old]] if old.numel() else []
            parts_v = [self.ring_v[slot, :, rows_old]] if old.numel() else []
            if hi > new_lo:
                parts_k.append(k[new_lo - start:hi - start].transpose(0, 1).to(self.dtype))
                parts_v.append(v[new_lo - start:hi - start].transpose(0, 1).to(self.dtype))
            for t, codec, parts in (("k", self.k_codec, parts_k), ("v", self.v_codec, parts_v)):
                x = torch.cat(parts, 1)[None]  # [1, H, hi - lo, D]
                for name, val in codec.encode(x, self.dtype, checks=checks).items():
                    self.mid[t][name][slot, :, lo - S:hi - S] = val[0]
        # the ring: the last R positions >= S
        r_lo = max(S, end - R, start)
        if end > r_lo:
            pos = torch.arange(r_lo, end, device=dev)
            rows = (pos - S) % R
            self.ring_k[slot, :, rows] = k[r_lo - start:].transpose(0, 1).to(self.dtype)
            self.ring_v[slot, :, rows] = v[r_lo - start:].transpose(0, 1).to(self.dtype)

    # ------------------------------------------------------------- read
    def dense_history(self, b: int, n: int):
        """Every stored token of slot b (python ints: the prefill path), in position order, rotated:
        (k [1, H, n', Dk], v, positions [n']) with n' = tokens still held (window for sliding)."""
        if self.kind == "dense":
            return self.mid["k"]["dense"][b:b + 1, :, :n], self.mid["v"]["dense"][b:b + 1, :, :n], torch.arange(n)
        if self.kind == "ring":
            m = min(n, self.R)
            pos = torch.arange(n - m, n)
            rows = (pos % self.R).to(self.ring_k.device)
            return self.ring_k[b:b + 1, :, rows], self.ring_v[b:b + 1, :, rows], pos
        S, R = self.S, self.R
        ns, nm, nr = min(n, S), max(0, min(n - S - R, self.C)), max(0, min(n - S, R))
        ks, vs = [self.sink_k[b:b + 1, :, :ns]], [self.sink_v[b:b + 1, :, :ns]]
        if nm:
            fk = {name: x[b:b + 1, :, :nm] for name, x in self.mid["k"].items()}
            fv = {name: x[b:b + 1, :, :nm] for name, x in self.mid["v"].items()}
            ks.append(self.k_codec.decode(fk, self.dtype))
            vs.append(self.v_codec.decode(fv, self.dtype))
        pos_r = torch.arange(n - nr, n)
        rows = ((pos_r - S) % R).to(self.ring_k.device)
        ks.append(self.ring_k[b:b + 1, :, rows])
        vs.append(self.ring_v[b:b + 1, :, rows])
        return torch.cat(ks, 2), torch.cat(vs, 2), torch.cat([torch.arange(ns), torch.arange(S, S + nm), pos_r])

    # ------------------------------------------------------------- HF API
    def lazy_initialization(self, key_states, value_states):
        pass

    def update(self, key_states, value_states, *args, **kwargs):
        raise LowbitError("internal: StaticLayer is written through StaticKVCache.update")

    def get_seq_length(self) -> int:
        return 0

    def get_max_length(self) -> int:
        return -1

    def get_mask_sizes(self, *args, **kwargs):
        raise LowbitError("the static lowbit cache builds its own masks; run the model with the 'lowbit' attention")

    def reset(self) -> None:
        pass

    def crop(self, n):
        raise LowbitError("the static lowbit cache cannot be cropped; reset the slot instead")

    def offload(self):
        raise LowbitError("the static lowbit cache does not support offloading")

    def prefetch(self):
        pass


class StaticKVCache(Cache):
    """Static tiered KV cache for `slots` sequences of up to `max_context` tokens (module docstring).

    model_or_config: the transformers model (its attention is switched to "lowbit") or its config.
    plan: lowbit.kv.plan.Plan resolved for this device. lens: int32 [slots] tokens held per slot.
    Before a forward, say what it is: `begin_decode(batch)` (one token for each of slots [0, batch),
    at positions lens[:batch]) or `begin_prefill(slot, start, length)`; after a decode forward,
    `advance(active)` adds one token to the slots that are live.
    """

    def __init__(self, model_or_config, plan, *, slots: int, max_context: int, device=None, dtype=None):
        model, _ = _split_model(model_or_config)
        if slots < 1 or max_context < 1:
            raise LowbitError(f"slots ({slots}) and max_context ({max_context}) must be positive")
        for lp in plan.layers:
            r = static_reason(lp)
            if r:
                raise LowbitError(f"layer {lp.index}: {r}; use a per-token scheme (e.g. --kv int2, k4v2)")
        if device is None:
            device = torch.device(model_device(model)) if model is not None else torch.device(plan.device)
        device = torch.device(device)
        if device.type != plan.device:
            raise LowbitError(f"the plan was resolved for {plan.device} but the cache is for {device.type}; "
                              f"resolve it with device={device.type!r}")
        if dtype is None:
            dtype = next(model.parameters()).dtype if model is not None else torch.float32
        if model is not None and any(lp.k_affine is not None and bool((lp.k_affine.shift != 0).any())
                                     for lp in plan.layers):
            _check_key_affine(model.config)  # a shift is exact only without logit soft-capping
        super().__init__(layers=[StaticLayer(lp, slots, max_context, device, dtype) for lp in plan.layers])
        self.plan, self.scheme, self.geometry = plan, plan.scheme, plan.geometry
        self.slots, self.max_context, self.device, self.dtype = slots, max_context, device, dtype
        # True: the eager torch decode reads only the middle rows some slot holds (see _torch_decode). Off by
        # default, so the eager step stays the bit-exact twin of the captured / compiled fixed-shape step; the
        # batching engine turns it on when it serves eagerly on the CPU
        self.read_held_rows = False
        self.lens = torch.zeros(slots, dtype=torch.int32, device=device)
        quantized = [lp for lp in plan.layers if lp.k.quantized]
        self.use_kernel = device.type == "cuda" and bool(quantized) and all(
            lp.backends["decode"].name == "triton-decode" for lp in quantized)
        # decode-step writes as one compiled function per layer configuration on CUDA (eager on CPU)
        self.compile_writes = device.type == "cuda"
        self._mode: tuple | None = None
        self._step: dict = {}
        self._pending: int | None = None
        self.checks = device.type != "cuda"  # input checks synchronise: never inside a GPU step
        # the fused kernel through its custom op even when not traced (GenerateCache); a traced step always uses it
        self.kernel_op = False
        if model is not None:
            attn.install_attention(model)

    # ------------------------------------------------------------- control
    def begin_decode(self, batch: int) -> None:
        if not 1 <= batch <= self.slots:
            raise LowbitError(f"decode batch {batch} outside 1..{self.slots} slots")
        self._mode = ("decode", batch)
        # per-step index tensors, made here once and read by every layer: a layer compiled on its own (the
        # runtime's per-layer regions) then traces the same way whichever layer it is
        self._step = {}
        self._step_index(batch, self.lens.device)
        for layer in self.layers:
            self._step_tier_lens(layer, batch)

    def begin_prefill(self, slot: int, start: int, length: int) -> None:
        if not 0 <= slot < self.slots:
            raise LowbitError(f"slot {slot} outside 0..{self.slots - 1}")
        if start + length > self.max_context:
            raise LowbitError(f"slot {slot}: {start + length} tokens exceed the cache capacity {self.max_context}; "
                              "build the cache with a larger max_context")
        self._mode = ("prefill", slot, start, length)

    def advance(self, active: torch.Tensor) -> None:
        """lens[:batch] += active (bool/int [batch]) after a decode forward."""
        b = active.shape[0]
        self.lens[:b] += active.to(self.lens.dtype)

    def reset_slot(self, slot: int) -> None:
        self.lens[slot] = 0

    def bytes_held(self) -> int:
        return sum(layer.nbytes() for layer in self.layers)

    # ------------------------------------------------------------- write
    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, layer_idx: int, *args, **kwargs):
        if self._mode is None:
            raise LowbitError("StaticKVCache: call begin_decode / begin_prefill before the forward")
        layer: StaticLayer = self.layers[layer_idx]
        k = _keys_in(layer, key_states)  # [B, H, c, D]
        v = _rot(value_states, layer.rot_v).to(self.dtype)
        if self._mode[0] == "decode":
            batch = self._mode[1]
            if k.shape[0] != batch or k.shape[2] != 1:
                raise LowbitError(f"decode step: expected K/V [{batch}, H, 1, D], got {tuple(k.shape)}")
            b, p = self._step_index(batch, k.device)
            layer.write(k[:, :, 0], v[:, :, 0], b, p, checks=self.checks, compiled=self.compile_writes)
            self._chunk = None
        else:
            _, slot, start, length = self._mode
            c = k.shape[2]
            if k.shape[0] != 1 or c != length:
                raise LowbitError(f"prefill of slot {slot}: expected K/V [1, H, {length}, D], got {tuple(k.shape)}")
            # a sliding ring overwrites rows the chunk's first queries still see: read its history first
            # (dense rows, nothing quantized there); tiers are read after the writes, as the eager cache does
            before = layer.dense_history(slot, start) if layer.kind == "ring" else None
            layer.write_chunk(k[0].transpose(0, 1), v[0].transpose(0, 1), slot, start, checks=self.checks)
            self._chunk = (k, v, before)
        attn.post_handoff(self, layer_idx, key_states, value_states)
        return key_states, value_states

    # ------------------------------------------------------------- per-step indices
    # Every layer of one decode step writes at the same positions and reads the same tier lengths (per
    # layer kind): computed once per step, not once per layer (in a captured step each is a few kernels).
    def _step_index(self, batch: int, device) -> tuple[torch.Tensor, torch.Tensor]:
        """(slot indices [batch], positions lens[:batch]) of this decode step."""
        if "index" not in self._step:
            self._step["index"] = (torch.arange(batch, device=device), self.lens[:batch].long())
        return self._step["index"]

    def _step_tier_lens(self, layer, batch: int):
        """(sink, middle, ring) valid rows per slot after this step's write, for layer's tier shape."""
        key = (layer.kind, layer.S, layer.R, layer.C)
        if key not in self._step:
            self._step[key] = layer.tier_lens(self.lens[:batch] + 1)  # the token just written is visible
        return self._step[key]

    # ------------------------------------------------------------- read
    def attend(self, layer_idx: int, query: torch.Tensor, attention_mask, *, scaling: float, softcap=None):
        """query [B, Hq, Lq, D] -> [B, Lq, Hq, Dv] over the slot(s) of the current step."""
        layer: StaticLayer = self.layers[layer_idx]
        B, Hq, Lq, D = query.shape
        G = Hq // layer.H
        qg = _queries_in(layer, query.reshape(B, layer.H, G * Lq, D))  # [B, H, G*Lq, D]
        if self._mode[0] == "decode":
            out = self._decode_attention(layer, qg, scaling, softcap)  # [B, H, G, Dv]
        else:
            out = self._prefill_attention(layer, qg.reshape(1, layer.H, G, Lq, D), scaling, softcap)
        Dv = out.shape[-1]
        out = _unrot(out.reshape(B, layer.H, G * Lq, Dv), layer.rot_v)
        return out.reshape(B, Hq, Lq, Dv).transpose(1, 2).to(query.dtype).contiguous()

    def _decode_attention(self, layer: StaticLayer, qg: torch.Tensor, scaling: float, softcap) -> torch.Tensor:
        B, H = qg.shape[:2]
        sl, ml, rl = self._step_tier_lens(layer, B)
        if self.use_kernel and layer.kind == "tiers" and not softcap and (
                self.kernel_op or torch.compiler.is_compiling() or layer.vq):  # VQ rows: always through their op
            return self._kernel_op_attention(layer, qg, scaling, sl, ml, rl)
        if self.use_kernel and layer.kind == "tiers" and not softcap:
            from lowbit.kernels.attention.tiers import decode_attention

            C = layer.C
            kc, ks, kz, k_centre = _mid_tier(layer.k_codec, layer.mid["k"], B, C)
            vc, vs, vz, v_centre = _mid_tier(layer.v_codec, layer.mid["v"], B, C)
            mid = (kc, ks, kz, vc, vs, vz) if C else (None,) * 6
            dense = {"recent_k": layer.ring_k[:B, :, :layer.R], "recent_v": layer.ring_v[:B, :, :layer.R],
                     "recent_lens": rl}
            if layer.S:
                dense.update(sink_k=layer.sink_k[:B, :, :layer.S], sink_v=layer.sink_v[:B, :, :layer.S], sink_lens=sl)
            q = qg.to(self.dtype).reshape(B, -1, qg.shape[-1]).contiguous()
            out = decode_attention(q, *mid, mid_lens=ml if C else None, k_bits=layer.k_codec.cbits,
                                   v_bits=layer.v_codec.cbits, sm_scale=scaling,
                                   k_centre=k_centre if C else None, v_centre=v_centre if C else None, **dense)
            return out.float().reshape(B, H, -1, out.shape[-1])
        return self._torch_decode(layer, qg, sl, ml, rl, scaling, softcap)

    def _kernel_op_attention(self, layer, qg: torch.Tensor, scaling: float, sl, ml, rl) -> torch.Tensor:
        """The fused kernel through the custom op lowbit::decode_attention_tiers (lowbit.kernels.ops; a layer with
        VQ rows: lowbit::decode_attention_vq_tiers, its codebooks in place of the zeros): one opaque node when
        the step is traced by torch.compile (dynamo would break on the launcher's host logic).
        qg [B, H, G, D] -> [B, H, G, Dv] float32."""
        B, H = qg.shape[:2]
        C, S, R = layer.C, layer.S, layer.R
        kc, ks, kz, k_centre = _mid_tier(layer.k_codec, layer.mid["k"], B, C)
        vc, vs, vz, v_centre = _mid_tier(layer.v_codec, layer.mid["v"], B, C)
        op, res = decode_attention_op, ()
        if layer.vq:
            kz, vz, op = layer.k_codebook, layer.v_codebook, decode_attention_vq_op
            res = tuple(layer.mid[t][n][:B, :, :C] if n in layer.mid[t] else None
                        for t in ("k", "v") for n in ("rbits", "rgain"))
        q = qg.to(self.dtype).reshape(B, -1, qg.shape[-1]).contiguous()
        out = op(
            q, kc, ks, kz, vc, vs, vz, ml,
            layer.sink_k[:B, :, :S] if S else None, layer.sink_v[:B, :, :S] if S else None, sl if S else None,
            layer.ring_k[:B, :, :R], layer.ring_v[:B, :, :R], rl,
            layer.k_codec.cbits, layer.v_codec.cbits, float(scaling), float(k_centre or 0.0),
            float(v_centre or 0.0), *res)
        return out.float().reshape(B, H, -1, out.shape[-1])

    def _torch_decode(self, layer, qg, sl, ml, rl, scaling, softcap):
        """Fixed-shape torch attention over every row of every tier, invalid rows masked (the CPU path,
        the bf16 path on CUDA, and the torch twin of the kernel path)."""
        B = qg.shape[0]
        ks, vs, valid = [], [], []
        C = layer.C
        if C and self.read_held_rows and not torch.compiler.is_compiling():
            # An eager step that is never captured may read only the middle rows some slot holds: the fixed
            # shape (every row of max_context, for CUDA graphs) decoded ~7,900 int2 rows per layer and step
            # for a 72-token request on smollm2-135m, and `--engine batch` on CPU ran ~10-20x slower than single.
            # (A traced step keeps the fixed shape: the row count would be data-dependent there.)
            C = min(C, int(ml.max()))
        if layer.S:
            ks.append(layer.sink_k[:B, :, :layer.S])
            vs.append(layer.sink_v[:B, :, :layer.S])
            valid.append(torch.arange(layer.S, device=qg.device)[None] < sl[:, None])
        if C:
            mk = {name: x[:B, :, :C] for name, x in layer.mid["k"].items()}
            mv = {name: x[:B, :, :C] for name, x in layer.mid["v"].items()}
            ks.append(layer.k_codec.decode(mk, self.dtype) if layer.kind == "tiers" else mk["dense"])
            vs.append(layer.v_codec.decode(mv, self.dtype) if layer.kind == "tiers" else mv["dense"])
            valid.append(torch.arange(C, device=qg.device)[None] < ml[:, None])
        if layer.R:
            ks.append(layer.ring_k[:B, :, :layer.R])
            vs.append(layer.ring_v[:B, :, :layer.R])
            valid.append(torch.arange(layer.R, device=qg.device)[None] < rl[:, None])
        K, V = (ks[0], vs[0]) if len(ks) == 1 else (torch.cat(ks, 2), torch.cat(vs, 2))  # [B, H, N, D]
        keep = valid[0] if len(valid) == 1 else torch.cat(valid, 1)  # [B, N]
        if layer.kind == "dense" and not softcap and qg.is_cuda:
            # SDPA with a length mask (cudnn): 21 ms of the 28.7 ms step at B1 L32k but the faster of the two
            # tried at B16 (batched GEMVs in bf16: 20.0 ms at B1, 50.0 ms at B16; docs/DESIGN_NOTES.md)
            o = torch.nn.functional.scaled_dot_product_attention(qg.to(K.dtype), K, V, attn_mask=keep[:, None, None, :],
                                                                 scale=scaling)
            return o.float()
        s = torch.matmul(qg.float() * scaling, K.float().transpose(-1, -2))  # [B, H, G, N]
        if softcap:
            s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~keep[:, None, None, :], float("-inf"))
        return torch.matmul(torch.softmax(s, -1), V.float())

    def _prefill_attention(self, layer: StaticLayer, qg: torch.Tensor, scaling: float, softcap) -> torch.Tensor:
        """Queries of the chunk just written (slot, positions [start, start + c)) over the slot's
        history as stored before the chunk plus the chunk exact: what QuantizedKVCache computes."""
        _, slot, start, length = self._mode
        ck, cv, before = self._chunk
        # history: rows of positions < start, read back from the tiers after this chunk's writes
        # (tokens that left the ring during the chunk are seen quantized, as in the eager cache)
        hk, hv, hpos = before if before is not None else layer.dense_history(slot, start + length)
        hist = hpos < start
        hk, hv, hpos = hk[:, :, hist], hv[:, :, hist], hpos[hist]
        K = torch.cat([hk, ck], 2)
        V = torch.cat([hv, cv], 2)
        kpos = torch.cat([hpos, torch.arange(start, start + length)]).to(qg.device)
        qpos = torch.arange(start, start + length, device=qg.device)
        keep = kpos[None, :] <= qpos[:, None]  # [c, N] causal
        if layer.window is not None:
            keep &= kpos[None, :] > qpos[:, None] - layer.window
        _, H, G, Lq, D = qg.shape
        q = qg.reshape(1, H, G * Lq, D)
        mask = keep.repeat(G, 1)[None, None]  # query row g*Lq + i is position i
        if not softcap:
            o = torch.nn.functional.scaled_dot_product_attention(
                q.to(self.dtype), K, V, attn_mask=mask, scale=scaling)
            return o.float().reshape(1, H, G, Lq, -1)
        s = torch.matmul(q.float() * scaling, K.float().transpose(-1, -2))
        s = torch.tanh(s / softcap) * softcap
        s = s.masked_fill(~mask, float("-inf"))
        return torch.matmul(torch.softmax(s, -1), V.float()).reshape(1, H, G, Lq, -1)

    # ------------------------------------------------------------- HF API
    @property
    def is_compileable(self) -> bool:
        return False

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return int(self.lens.max())

    def crop(self, max_length: int):
        raise LowbitError("the static lowbit cache cannot be cropped; reset the slot instead")
