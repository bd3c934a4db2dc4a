"""Does an asymmetric W4A16 checkpoint open in plain transformers? llm-compressor's vs lowbit's.

Two modes, two interpreters (llm-compressor lives in its own venv, see scripts/llmcompressor_compare.sh):

    <llmc venv>/bin/python scripts/asym_plain_load_check.py llmc MODEL_DIR OUT
        llm-compressor RTN W4A16 g32 asymmetric (QuantizationModifier, no calibration) -> OUT
    <any venv>/bin/python scripts/asym_plain_load_check.py plain CKPT_DIR
        AutoModelForCausalLM.from_pretrained(CKPT_DIR), nothing else; prints the versions, the
        zero-point layout on disk, and OK + 8 greedy tokens or FAIL + the error

Recorded in benchmarks/results/weights/asym-plain-load-check.txt.
"""

from __future__ import annotations

import sys


def llmc(model_dir: str, out: str) -> None:
    import torch
    from llmcompressor import oneshot
    from llmcompressor.modifiers.quantization import QuantizationModifier
    from transformers import AutoModelForCausalLM

    m = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    groups = {"group_0": {"targets": ["Linear"], "weights": {"num_bits": 4, "type": "int", "symmetric": False,
                                                             "strategy": "group", "group_size": 32}}}
    oneshot(model=m, recipe=[QuantizationModifier(config_groups=groups, ignore=["lm_head"])])
    m.save_pretrained(out, save_compressed=True)


def plain(ckpt: str) -> None:
    import compressed_tensors
    import torch
    import transformers
    from safetensors import safe_open
    from transformers import AutoModelForCausalLM

    print(f"transformers {transformers.__version__}, compressed-tensors {compressed_tensors.__version__}: {ckpt}")
    with safe_open(f"{ckpt}/model.safetensors", "pt") as f:
        k = next(k for k in sorted(f.keys()) if k.endswith("weight_zero_point"))
        print(f"  on disk: {k} {f.get_slice(k).get_shape()} {f.get_slice(k).get_dtype()}")
    try:
        hf = AutoModelForCausalLM.from_pretrained(ckpt)
    except Exception as e:  # the point is to show what a user sees
        print(f"  FAIL {type(e).__name__}: {' '.join(str(e).split())[:200]}")
        return
    ids = torch.tensor([[1, 5, 7, 11, 13, 17, 19]])
    print("  OK greedy", hf.generate(ids, max_new_tokens=8, do_sample=False)[0, ids.shape[1]:].tolist())


if __name__ == "__main__":
    {"llmc": llmc, "plain": plain}[sys.argv[1]](*sys.argv[2:])
