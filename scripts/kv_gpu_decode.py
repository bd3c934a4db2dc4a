"""Decode-step timing of QuantizedKVCache on CUDA (random Llama-3-8B-like layer): torch path vs fused kernel.

    python scripts/kv_gpu_decode.py --batch 4 --context 8192 --layers 2

Prints per-step wall time (eager, CUDA-synchronised) of the torch reference path and of the fused kernel
behind decode_backend="auto", with DynamicCache (SDPA) for scale, and the logit difference between them.
"""

import argparse
import time

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from lowbit.kv import QuantizedKVCache
from lowbit.recipe import parse_kv_scheme


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--context", type=int, default=8192)
    ap.add_argument("--layers", type=int, default=2)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--kv", default="int2,int4")
    a = ap.parse_args()
    cfg = LlamaConfig(hidden_size=4096, intermediate_size=1024, num_attention_heads=32, num_key_value_heads=8,
                      head_dim=128, num_hidden_layers=a.layers, vocab_size=1024, max_position_embeddings=1 << 17)
    torch.manual_seed(0)
    model = LlamaForCausalLM(cfg).to("cuda", torch.bfloat16).eval()
    ids = torch.randint(0, 1024, (a.batch, a.context), device="cuda")
    step = torch.randint(0, 1024, (a.batch, 1), device="cuda")

    def timed(cache):
        with torch.no_grad():
            for s in range(0, a.context, 2048):
                model(ids[:, s : s + 2048], past_key_values=cache)
            outs = []
            for _ in range(3):
                outs.append(model(step, past_key_values=cache).logits)
            torch.cuda.synchronize()
            t = time.perf_counter()
            for _ in range(a.steps):
                outs.append(model(step, past_key_values=cache).logits)
            torch.cuda.synchronize()
        return (time.perf_counter() - t) / a.steps * 1e3, torch.cat(outs, 1).float()

    model.set_attn_implementation("sdpa")
    t_ref, _ = timed(DynamicCache(config=cfg))
    print(f"B{a.batch} L{a.context} {a.layers} layers: DynamicCache+SDPA {t_ref:.2f} ms/step")
    for name in a.kv.split(","):
        s = parse_kv_scheme(name)
        t_torch, lt = timed(QuantizedKVCache(model, s, decode_backend="torch"))
        c = QuantizedKVCache(model, s, decode_backend="auto")
        t_k, lk = timed(c)
        err = float((lk - lt).norm() / lt.norm())
        print(f"  {name}: torch path {t_torch:.2f} ms/step, fused kernel {t_k:.2f} ms/step "
              f"(calls {dict(c.backend_calls)}), logits rel diff {err:.2e}; {c.summary()}")


if __name__ == "__main__":
    main()
