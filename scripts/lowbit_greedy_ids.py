"""Greedy token ids from lowbit's own runtime for the KV scheme of a `lowbit export --for vllm` directory.

Runs lowbit.runtime.generate.generate -- what `lowbit generate` runs (it prints text only) -- and
prints the ids, so they can be compared with vLLM's (scripts/serve_vllm_cpu.sh records token_ids):

    python scripts/lowbit_greedy_ids.py --model gemma3-270m --export DIR --prompt-file F [F ...] [--max-new 12]
    python scripts/lowbit_greedy_ids.py --model gemma3-270m --kv bf16 --prompt-file F

One JSON line per prompt: prompt file, scheme, ids, text, seconds.
"""

from __future__ import annotations

import argparse
import json
import time

import torch


def main() -> int:
    from lowbit.runtime.generate import generate
    from lowbit.runtime.load import resolve
    from lowbit.kv.scheme import parse_kv_scheme
    from lowbit.vllm_plugin import sidecar

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", required=True, help="built-in name or HF directory")
    g = ap.add_mutually_exclusive_group(required=True)
    g.add_argument("--export", help="a `lowbit export --for vllm` directory: its sidecar gives the KV scheme")
    g.add_argument("--kv", help="a KV scheme name instead (e.g. bf16)")
    ap.add_argument("--prompt-file", nargs="+", required=True)
    ap.add_argument("--max-new", type=int, default=12)
    ap.add_argument("--threads", type=int, default=1, help="torch threads (the CPU is shared)")
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    scheme = sidecar.scheme_of(sidecar.read(a.export), a.export) if a.export else parse_kv_scheme(a.kv)
    lm = resolve(a.model, dtype=torch.float32, device="cpu")
    for f in a.prompt_file:
        t = time.time()
        with open(f, encoding="utf-8") as fh:
            prompt = fh.read()
        new, _ = generate(lm, scheme, prompt, a.max_new, decode_backend="torch")
        ids = new.tolist()
        print(json.dumps({"prompt_file": f, "scheme": scheme.describe(), "ids": ids,
                          "text": lm.tokenizer.decode(ids, skip_special_tokens=True),
                          "seconds": round(time.time() - t, 1)}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
