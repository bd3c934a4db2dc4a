"""The CUDA backend's vLLM glue (builder.build + impl.forward) driven on CPU under TRITON_INTERPRET=1 against
minimal stand-ins for the vLLM 0.26 classes it subclasses: a prefill batch and decode steps of ragged requests
on a tiny GQA model with a Hadamard-rotated int8 cache (rotation, un-rotation, positions, tiles, tier slots,
GQA head mapping). int8 keeps the codes' error small, so the output must match exact attention over the
unquantized K/V; the kv spec / shape hooks give vLLM the packed cell."""

from __future__ import annotations

import json
import sys
import types
from enum import Enum
from typing import Generic, TypeVar

import pytest
import torch

from lowbit.core.errors import LowbitError
from lowbit.kernels.attention.common import interpreted

cpu_only = pytest.mark.skipif(not interpreted(), reason="kernels imported without TRITON_INTERPRET=1")
BS, NB = 16, 40
TINY = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 192, "intermediate_size": 256,
        "num_hidden_layers": 2, "num_attention_heads": 6, "num_key_value_heads": 2, "head_dim": 32,
        "vocab_size": 300, "max_position_embeddings": 2048, "rms_norm_eps": 1e-5, "torch_dtype": "float16"}
M = TypeVar("M")


def _fake_vllm(monkeypatch, config, tp=None):
    """Stand-ins for the vLLM 0.26 names the backend imports; tp: (world size, rank) of a tensor-parallel group."""
    class AttentionCGSupport(Enum):
        ALWAYS = 3
        UNIFORM_BATCH = 2
        UNIFORM_SINGLE_TOKEN_DECODE = 1
        NEVER = 0

    class AttentionType(str, Enum):
        DECODER = "decoder"

    class AttentionMetadata:
        pass

    class AttentionMetadataBuilder(Generic[M]):
        def __init__(self, kv_cache_spec, layer_names, vllm_config, device):
            self.kv_cache_spec, self.layer_names, self.vllm_config, self.device = (kv_cache_spec, layer_names,
                                                                                  vllm_config, device)

    class AttentionImpl(Generic[M]):
        pass

    class AttentionBackend:
        pass

    def mod(name, **kw):
        m = types.ModuleType(name)
        m.__dict__.update(kw)
        monkeypatch.setitem(sys.modules, name, m)
        return m

    mod("vllm")
    mod("vllm.config", get_current_vllm_config=lambda: config)
    mod("vllm.distributed")
    ps = mod("vllm.distributed.parallel_state", model_parallel_is_initialized=lambda: tp is not None,
             get_tensor_model_parallel_world_size=lambda: tp[0], get_tensor_model_parallel_rank=lambda: tp[1])
    sys.modules["vllm.distributed"].parallel_state = ps
    mod("vllm.v1")
    mod("vllm.v1.attention")
    mod("vllm.v1.attention.backend", AttentionBackend=AttentionBackend, AttentionCGSupport=AttentionCGSupport,
        AttentionImpl=AttentionImpl, AttentionMetadata=AttentionMetadata,
        AttentionMetadataBuilder=AttentionMetadataBuilder, AttentionType=AttentionType,
        CommonAttentionMetadata=types.SimpleNamespace)
    monkeypatch.delitem(sys.modules, "lowbit.vllm_plugin.cuda_backend", raising=False)


def _export(tmp_path):
    from transformers import AutoConfig

    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.models.geometry import ModelGeometry
    from lowbit.vllm_plugin import sidecar

    d = tmp_path / "m"
    d.mkdir(parents=True)
    (d / "config.json").write_text(json.dumps(TINY))
    g = ModelGeometry.from_config(AutoConfig.from_pretrained(d), name="tiny")
    s = parse_kv_scheme("int8", sink=5, recent=9, page=1, rotation="hadamard")
    sidecar.write(d, sidecar.build(s, g, model_name="tiny", weights_sha256=None, rotation_rel=None))
    return d


def _exact(q, ks, vs, G, scale):
    """Causal attention of q [lq, Hq, D] (the last lq positions) over ks / vs [n, H, D] in float32."""
    lq, n = q.shape[0], ks.shape[0]
    k = ks.float().repeat_interleave(G, 1).transpose(0, 1)  # [Hq, n, D]
    v = vs.float().repeat_interleave(G, 1).transpose(0, 1)
    s = torch.einsum("qhd,hkd->hqk", q.float(), k) * scale
    qpos = n - lq + torch.arange(lq)
    s = s.masked_fill(torch.arange(n)[None, :] > qpos[:, None], float("-inf"))
    return torch.einsum("hqk,hkd->qhd", torch.softmax(s, -1), v)


@cpu_only
def test_builder_and_impl_match_exact_attention(tmp_path, monkeypatch):
    d = _export(tmp_path)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=str(d), dtype=torch.float16),
        cache_config=types.SimpleNamespace(block_size=BS, num_gpu_blocks=NB, enable_prefix_caching=False),
        scheduler_config=types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256))
    _fake_vllm(monkeypatch, cfg)
    from lowbit.vllm_plugin import cuda_backend as cb

    cb.load.cache_clear()
    Hq, H, D = 6, 2, 32
    G = Hq // H
    impl = cb.LowbitCudaImpl(Hq, D, D ** -0.5, H)
    spec = types.SimpleNamespace(block_size=BS)
    builder = cb.LowbitCudaMetadataBuilder(spec, ["model.layers.1.self_attn.attn"], cfg, torch.device("cpu"))
    shape = cb.LowbitCUDABackend.get_kv_cache_shape(NB, BS, H, D)
    assert shape[:3] == (NB, H, BS) and shape[3] * 2 == impl.slot_bytes  # fp16 elements of the packed cell
    kv_cache = torch.zeros(shape, dtype=torch.float16)
    layer = types.SimpleNamespace(layer_name="model.layers.1.self_attn.attn")
    g = torch.Generator().manual_seed(0)
    prompts = [23, 4, 40]
    free = torch.randperm(NB, generator=g).tolist()
    blocks = {r: [] for r in range(3)}
    hist_k = {r: torch.zeros(0, H, D, dtype=torch.float16) for r in range(3)}
    hist_v = {r: torch.zeros(0, H, D, dtype=torch.float16) for r in range(3)}
    for step in range(6):
        q_lens = prompts if step == 0 else [1, 1, 5] if step == 3 else [1, 1, 1]  # step 3: a mixed batch
        held = [hist_k[r].shape[0] for r in range(3)]
        for r in range(3):
            while len(blocks[r]) * BS < held[r] + q_lens[r]:
                blocks[r].append(free.pop())
        table = torch.zeros(4, 6, dtype=torch.int32)  # a row more than the batch (a persistent buffer)
        for r in range(3):
            table[r, : len(blocks[r])] = torch.tensor(blocks[r], dtype=torch.int32)
        seq = torch.tensor([held[r] + q_lens[r] for r in range(3)] + [0], dtype=torch.int32)
        qsl = torch.tensor([0, *torch.tensor(q_lens).cumsum(0).tolist()], dtype=torch.int32)
        T = int(qsl[-1])
        slot = torch.tensor([blocks[r][p // BS] * BS + p % BS for r in range(3)
                             for p in range(held[r], held[r] + q_lens[r])])
        common = types.SimpleNamespace(num_actual_tokens=T, num_reqs=3, max_query_len=max(q_lens),
                                       query_start_loc=qsl, query_start_loc_cpu=qsl, seq_lens=seq[:3],
                                       block_table_tensor=table[:3], slot_mapping=slot)
        md = builder.build(0, common)
        q = torch.randn(T, Hq * D, generator=g).half()
        k = torch.randn(T, H * D, generator=g).half()
        v = torch.randn(T, H * D, generator=g).half()
        out = torch.full((T, Hq, D), float("nan"), dtype=torch.float16)
        impl.forward(layer, q.view(T, Hq, D), k.view(T, H, D), v.view(T, H, D), kv_cache, md, out)
        for r in range(3):
            a, b = int(qsl[r]), int(qsl[r + 1])
            hist_k[r] = torch.cat([hist_k[r], k.view(T, H, D)[a:b]])
            hist_v[r] = torch.cat([hist_v[r], v.view(T, H, D)[a:b]])
            want = _exact(q.view(T, Hq, D)[a:b], hist_k[r], hist_v[r], G, D ** -0.5)
            err = (out[a:b].float() - want).abs().max().item()
            assert err < 3e-2, f"step {step} request {r}: max abs err {err}"


@cpu_only
@pytest.mark.parametrize("rank", [0, 1])
def test_a_tensor_parallel_rank_takes_its_share_of_kv_heads(tmp_path, monkeypatch, rank):
    d = _export(tmp_path)
    cfg = types.SimpleNamespace(
        model_config=types.SimpleNamespace(model=str(d), dtype=torch.float16),
        cache_config=types.SimpleNamespace(block_size=BS, num_gpu_blocks=NB, enable_prefix_caching=False),
        scheduler_config=types.SimpleNamespace(max_num_seqs=4, max_num_batched_tokens=256))
    _fake_vllm(monkeypatch, cfg, tp=(2, rank))
    from lowbit.vllm_plugin import cuda_backend as cb

    cb.load.cache_clear()
    layer = types.SimpleNamespace(layer_name="model.layers.1.self_attn.attn")
    D = 32
    fmt, rk, _, _ = cb.LowbitCudaImpl(3, D, D ** -0.5, 1)._layer_state(layer, torch.device("cpu"))  # 6 q, 2 KV, TP 2
    assert rk.shape[-1] == D and fmt is not None
    with pytest.raises(LowbitError, match=f"rank {rank} of 2"):  # the whole model's heads on one rank: refused
        cb.LowbitCudaImpl(6, D, D ** -0.5, 2)._layer_state(layer, torch.device("cpu"))
