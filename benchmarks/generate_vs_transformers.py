"""`lowbit generate` against plain transformers on one long prompt: same model, dtype, threads, tokens.

    PYTHONPATH=src python benchmarks/generate_vs_transformers.py --model smollm2-135m --kv int2 \
        --prompt-tokens 3000 --max-new-tokens 32 --dtype fp32 --threads 1

Both sides get the same token ids (the first --prompt-tokens tokens of --data, default the stdlib
corpus) and greedy-decode --max-new-tokens tokens:
  transformers  model.generate with its own DynamicCache and SDPA attention (a freshly loaded model)
  lowbit        lowbit.runtime.generate.generate (what `lowbit generate` runs): a QuantizedKVCache, the
                "lowbit" attention (a second, freshly loaded model: the cache switches the model's
                attention, so the two never share one)
Prints each side's wall seconds (best of --repeats), time to first token and the ratio lowbit /
transformers. A measurement, not a test: the numbers depend on the machine and its load.
"""

from __future__ import annotations

import argparse
import sys
import time


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--model", default="smollm2-135m")
    p.add_argument("--kv", default="int2", help="lowbit KV scheme (default int2)")
    p.add_argument("--data", default="stdlib", help="text the prompt is cut from (stdlib | wikitext2 | PATH)")
    p.add_argument("--prompt-tokens", type=int, default=3000)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--dtype", default="fp32", choices=("fp32", "bf16"))
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--repeats", type=int, default=1, help="runs per side; the best is reported (default 1)")
    a = p.parse_args(argv)

    import torch

    from lowbit.calib.corpora import load_text
    from lowbit.core.flags import torch_dtype
    from lowbit.runtime.generate import generate
    from lowbit.models import resolve
    from lowbit.kv.scheme import parse_kv_scheme

    torch.set_num_threads(a.threads)
    dtype = torch_dtype(a.dtype)
    ref = resolve(a.model, dtype=dtype, device="cpu")
    ids = ref.tokenizer(load_text(a.data), return_tensors="pt")["input_ids"][:, : a.prompt_tokens]
    if ids.shape[1] < a.prompt_tokens:
        sys.exit(f"--data has only {ids.shape[1]} tokens; lower --prompt-tokens")
    prompt = ref.tokenizer.decode(ids[0])
    # the lowbit side tokenizes the text again: use the ids that text gives on both sides
    enc = ref.tokenizer(prompt, return_tensors="pt")
    n_prompt = int(enc["input_ids"].shape[1])
    pad = ref.tokenizer.pad_token_id if ref.tokenizer.pad_token_id is not None else ref.tokenizer.eos_token_id

    def run_transformers():
        t0 = time.perf_counter()
        with torch.no_grad():
            out = ref.model.generate(**enc, max_new_tokens=a.max_new_tokens, min_new_tokens=a.max_new_tokens,
                                     do_sample=False, pad_token_id=pad)
        return time.perf_counter() - t0, out[0, n_prompt:].tolist()

    hf = [run_transformers() for _ in range(a.repeats)]
    hf_s, hf_ids = min(hf)[0], hf[0][1]

    lm = resolve(a.model, dtype=dtype, device="cpu")
    scheme = parse_kv_scheme(a.kv)
    scheme.validate(lm.geometry)

    def run_lowbit():
        t: dict = {}
        t0 = time.perf_counter()
        new, cache = generate(lm, scheme, prompt, a.max_new_tokens, timing=t)
        return time.perf_counter() - t0, new.tolist(), t, cache

    lb = [run_lowbit() for _ in range(a.repeats)]
    best = min(lb, key=lambda r: r[0])
    lb_s, lb_ids, lb_t, cache = best
    same = sum(x == y for x, y in zip(hf_ids, lb_ids, strict=False))
    print(f"{a.model} {a.dtype}, {torch.get_num_threads()} thread(s), prompt {n_prompt} tokens, "
          f"{a.max_new_tokens} new tokens, best of {a.repeats}")
    print(f"transformers (DynamicCache, sdpa): {hf_s:.2f} s")
    print(f"lowbit generate (--kv {a.kv}):      {lb_s:.2f} s  (time to first token {lb_t['ttft_s']:.2f} s, "
          f"decode {lb_t['decode_tokens_per_s'] or 0:.1f} tokens/s)")
    print(f"ratio lowbit / transformers: {lb_s / hf_s:.2f}x")
    print(f"greedy tokens equal to transformers': {same}/{len(hf_ids)} (a quantized cache may differ)")
    print(cache.summary())
    return 0


if __name__ == "__main__":
    sys.exit(main())
