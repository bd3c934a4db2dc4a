"""lowbit's packed KV cache inside GPU vLLM 0.26 against vLLM's own KV dtypes, on one card (issue 46).

    lowbit bench vllm [--length 32k] [--batch 1,16,64] [--kv-dtypes auto,fp8,...] [--gpu-mem 0.9] [--site DIR]
    lowbit bench vllm --check          # quick GPU correctness: kernels vs twins, vLLM greedy tokens

Every kv config runs in its own subprocess with a timeout (one failure or hang costs one row, never the run):
a random-weight Llama-3-8B geometry (load_format="dummy", an export directory holding config.json and, for
lowbit rows, lowbit_kv.json -- made here, no weights), max_num_seqs = the largest batch, prefix caching on.
Per batch B: B distinct random prompts of L tokens are prefilled once (one token generated: cached), then
decode is timed as (time of B requests x (1 + N) tokens - time of B x 1 token) / (N - 1 ... ) steps over the
cached prompts, so prefill is out of the difference. KV capacity is vLLM's own num_gpu_blocks x block_size.
A batch that does not fit (B x (L + N + 16) > capacity) is a row with fits=false. TTFT: the B=1 cold prefill.
Writes ./lowbit-results/vllm_gpu_<gpu>.json (or --out; curated copies go to results/vllm/) and prints a table with ratios vs fp8 and bf16 (auto).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from lowbit.kv.scheme import load_recipe, parse_kv_scheme
from lowbit.models.geometry import ModelGeometry
from lowbit.vllm_plugin import sidecar

# the directory holding the lowbit package: the children vLLM starts import lowbit from there
PKG_PARENT = Path(__file__).resolve().parents[3]
LLAMA3_8B = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 4096, "intermediate_size": 14336,
    "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
    "vocab_size": 128256, "max_position_embeddings": 131072, "rope_theta": 500000.0, "rms_norm_eps": 1e-5,
    "torch_dtype": "bfloat16", "tie_word_embeddings": False, "bos_token_id": 128000, "eos_token_id": 128001,
    "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
}
TINY = dict(LLAMA3_8B, hidden_size=256, intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
            num_key_value_heads=2, head_dim=64, vocab_size=512, max_position_embeddings=4096,
            bos_token_id=1, eos_token_id=2, torch_dtype="float16")
DEFAULT_KVS = ["auto", "fp8", "lowbit-int2", "lowbit-int4", "int4_per_token_head", "turboquant_3bit_nc",
               "turboquant_4bit_nc"]


def log(*a):
    print(time.strftime("%H:%M:%S"), *a, flush=True)


# ------------------------------------------------------------------------------------------- export directories
def make_export(directory: Path, config: dict, kv: str, name: str = "llama3-8b-geometry") -> Path:
    """A model directory for vLLM with load_format="dummy": config.json, and for kv 'lowbit-<scheme>' the
    lowbit_kv.json sidecar of that scheme (page 1, what `lowbit export --for vllm` writes). No weights."""
    directory.mkdir(parents=True, exist_ok=True)
    (directory / "config.json").write_text(json.dumps(config, indent=2))
    side = directory / "lowbit_kv.json"
    if side.exists():
        side.unlink()
    if kv.startswith("lowbit-"):
        from transformers import AutoConfig

        spec, *opts = kv[len("lowbit-"):].split(":")  # e.g. lowbit-int4:sink=4:recent=16
        kw = {k: int(v) for k, v in (o.split("=") for o in opts)}
        scheme = load_recipe(spec) if spec.endswith(".toml") else parse_kv_scheme(spec, page=1, **kw)
        geometry = ModelGeometry.from_config(AutoConfig.from_pretrained(directory), name=name)
        sidecar.write(directory, sidecar.build(scheme, geometry, model_name=name, weights_sha256=None,
                                               rotation_rel=None))
    return directory


def ensure_entry_point(site: str | None) -> str:
    """vLLM finds general plugins through entry points: a minimal dist-info for lowbit in `site` (no pip)."""
    if not site:
        return "no --site given: the lowbit plugin must already be installed"
    d = Path(site) / "lowbit-0.1.0.dist-info"
    d.mkdir(parents=True, exist_ok=True)
    (d / "METADATA").write_text("Metadata-Version: 2.1\nName: lowbit\nVersion: 0.1.0\n")
    (d / "entry_points.txt").write_text("[vllm.general_plugins]\nlowbit = lowbit.vllm_plugin:register\n")
    (d / "RECORD").write_text("")
    return f"entry point written to {d}"


# ------------------------------------------------------------------------------------------- one config (child)
def run_one(cfg: dict) -> dict:
    """Runs in its own process: one kv dtype, the batches in turn. Prints RESULT <json> per row."""
    import random

    from vllm import LLM, SamplingParams

    kv = cfg["kv"]
    L, steps, batches = cfg["L"], cfg["steps"], cfg["batches"]
    directory = Path(cfg["dir"])
    lowbit = kv.startswith("lowbit-")
    t0 = time.time()
    kwargs = {"model": str(directory), "load_format": "dummy", "skip_tokenizer_init": True, "dtype": "bfloat16",
                  "kv_cache_dtype": "auto" if lowbit else kv, "gpu_memory_utilization": cfg["gpu_mem"],
                  "max_model_len": L + steps + 64, "enable_prefix_caching": True, "max_num_seqs": max(batches),
                  "block_size": 16, "tensor_parallel_size": 1, "seed": 0, "max_num_batched_tokens": cfg.get("chunk", 8192)}
    if cfg.get("enforce_eager"):
        kwargs["enforce_eager"] = True
    llm = LLM(**kwargs)
    startup = time.time() - t0
    cc = llm.llm_engine.vllm_config.cache_config
    nblocks = getattr(cc, "num_gpu_blocks", None)
    capacity = int(nblocks) * int(cc.block_size) if nblocks else None
    log(f"[{kv}] engine up in {startup:.0f}s; capacity {capacity} tokens")
    rng = random.Random(0)
    vocab = cfg["vocab"]
    rows = []
    for B in batches:
        row = {"kv": kv, "B": B, "L": L, "fits": None, "capacity_tokens": capacity, "ms_per_step": None,
               "tok_s": None, "ttft_s": None, "mode": "decode", "tp": 1, "startup_s": round(startup, 1)}
        need = B * (L + steps + 16)
        if capacity is not None and need > capacity:
            row.update(fits=False, note=f"needs {need} tokens of KV, capacity {capacity}")
            print("RESULT " + json.dumps(row), flush=True)
            rows.append(row)
            continue
        prompts = [{"prompt_token_ids": [rng.randrange(10, vocab - 10) for _ in range(L)]} for _ in range(B)]
        one = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, detokenize=False)
        many = SamplingParams(max_tokens=steps + 1, temperature=0.0, ignore_eos=True, detokenize=False)
        try:
            t = time.time()
            llm.generate(prompts, one, use_tqdm=False)  # prefill: the prompts are cached from here on
            prefill = time.time() - t
            if B == 1:
                row["ttft_s"] = round(prefill, 3)
            log(f"[{kv}] B={B}: prefill {prefill:.1f}s")
            t = time.time()
            llm.generate(prompts, one, use_tqdm=False)  # cached prompt + 1 token (what the timed run also pays)
            base = time.time() - t
            t = time.time()
            outs = llm.generate(prompts, many, use_tqdm=False)
            full = time.time() - t
            n = min(len(o.outputs[0].token_ids) for o in outs)
            ms = (full - base) / max(1, n - 1) * 1000
            row.update(fits=True, ms_per_step=round(ms, 3), tok_s=round(B * 1000 / ms, 1), cached_run_s=round(base, 3),
                       prefill_s=round(prefill, 2), steps=n)
            log(f"[{kv}] B={B}: {ms:.2f} ms/step, {B * 1000 / ms:.0f} tok/s")
            if cfg.get("profile"):  # where a decode step's GPU time goes (the engine runs in this process)
                import torch

                with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA]) as prof:
                    llm.generate(prompts, many, use_tqdm=False)
                print(f"PROFILE {kv} B={B} ({n} steps)\n" + prof.key_averages().table(
                    sort_by="cuda_time_total", row_limit=18, max_name_column_width=70), flush=True)
        except Exception as e:  # noqa: BLE001  (a row that fails says why; the next batch still runs)
            row.update(fits=None, error=f"{type(e).__name__}: {e}"[:500])
            log(f"[{kv}] B={B}: FAILED {row['error']}")
        print("RESULT " + json.dumps(row), flush=True)
        rows.append(row)
    return {"rows": rows}


# ------------------------------------------------------------------------------------------- check mode
def check(args) -> int:
    """Quick GPU correctness: the CUDA kernels vs their twins, then vLLM greedy tokens with lowbit's backend vs
    lowbit's own runtime (HF model + QuantizedKVCache) on a tiny random model saved to disk."""
    import torch

    from lowbit.vllm_plugin.cuda_kernels import paged_attention, paged_attention_ref, tiles_for
    from lowbit.vllm_plugin.cuda_write import write
    from lowbit.vllm_plugin.slot import SlotFormat

    ok = True
    dev = "cuda"
    for scheme in ("int4", "int2"):
        D, H, G, BS, NB = 128, 8, 4, 16, 64
        fmt = SlotFormat(parse_kv_scheme(scheme, sink=16, recent=40, page=1), D, D, torch.bfloat16)
        g = torch.Generator().manual_seed(1)
        T = 300
        k = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
        v = torch.randn(T, H, D, generator=g).to(torch.bfloat16)
        cache = torch.zeros(NB, H, BS, fmt.slot_bytes, dtype=torch.uint8, device=dev)
        slots = torch.randperm(NB * BS, generator=g)[:T]
        write(cache, fmt, k.float().to(dev), v.float().to(dev), slots.to(dev))
        cells = fmt.encode_rotated(k.float().transpose(0, 1).unsqueeze(0), v.float().transpose(0, 1).unsqueeze(0),
                                   fast=False)
        exp = torch.zeros(NB, H, BS, fmt.slot_bytes, dtype=torch.uint8)
        exp[slots // BS, :, slots % BS, :] = cells
        same = (cache.cpu() == exp).float().mean().item()
        good = same > 0.97  # a code one step off at a rounding tie (FMA contraction, another sum order) is benign
        ok &= good
        print(f"CHECK write {scheme}: {same * 100:.3f}% of cell bytes equal TensorCodec.encode's -> "
              f"{'PASS' if good else 'FAIL'}", flush=True)
        lens = [1, 77, 300, 150]
        tables = torch.full((len(lens), 20), 0, dtype=torch.int32)
        for i, n in enumerate(lens):
            tables[i, : -(-n // BS)] = torch.randperm(NB, generator=g)[: -(-n // BS)].to(torch.int32)
        q = torch.randn(len(lens), H * G, D, generator=g)
        kn = torch.randn(len(lens), H, D, generator=g).to(torch.bfloat16)
        vn = torch.randn(len(lens), H, D, generator=g).to(torch.bfloat16)
        qsl = torch.arange(len(lens) + 1, dtype=torch.int32)
        seq = torch.tensor(lens, dtype=torch.int32)
        tr, t0 = tiles_for(qsl, 1)
        got = paged_attention(q.to(dev), kn.to(dev), vn.to(dev), cache, fmt, tables.to(dev), seq.to(dev),
                              qsl.to(dev), tr.to(dev), t0.to(dev), bm=1, scale=D ** -0.5)
        torch.cuda.synchronize()
        ref = paged_attention_ref(q, kn, vn, cache.cpu(), fmt, tables, seq, qsl, scale=D ** -0.5)
        err = (got.cpu() - ref).abs().max().item()
        good = err < 3e-2
        ok &= good
        print(f"CHECK paged attention {scheme} (decode, GQA {G}): max abs err {err:.2e} vs twin -> "
              f"{'PASS' if good else 'FAIL'}", flush=True)
    ok &= check_tokens(args)
    print("CHECK overall:", "PASS" if ok else "FAIL", flush=True)
    return 0 if ok else 1


def check_tokens(args) -> bool:
    """vLLM (lowbit backend) greedy tokens vs lowbit's runtime on a tiny random Llama saved with its weights."""
    import torch

    base = Path(args.export_root) / "tiny"
    kv = "lowbit-int4:sink=4:recent=16"  # small tiers: most of the 224 tokens are read from their codes
    make_export(base, TINY, kv, name="tiny-llama")
    if not (base / "model.safetensors").exists():
        from transformers import AutoConfig, AutoModelForCausalLM

        torch.manual_seed(0)
        model = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(base)).to(torch.float16)
        model.save_pretrained(base)
        make_export(base, TINY, kv, name="tiny-llama")  # save_pretrained rewrote config.json
    prompt = list(range(3, 3 + 200))
    n_new = 24
    code = (
        "import json,sys\n"
        "from vllm import LLM, SamplingParams\n"
        f"llm = LLM(model={str(base)!r}, skip_tokenizer_init=True, dtype='float16', gpu_memory_utilization=0.3, "
        "max_model_len=1024, enable_prefix_caching=False, max_num_batched_tokens=1024, block_size=16, seed=0)\n"
        f"o = llm.generate([{{'prompt_token_ids': {prompt}}}], SamplingParams(max_tokens={n_new}, temperature=0.0, "
        "ignore_eos=True, detokenize=False), use_tqdm=False)\n"
        "print('TOKENS ' + json.dumps(list(o[0].outputs[0].token_ids)), flush=True)\n"
    )
    try:
        p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=args.check_timeout,
                           env=child_env(args))
    except subprocess.TimeoutExpired:
        print(f"CHECK vLLM tokens: vLLM timed out after {args.check_timeout}s -> FAIL", flush=True)
        return False
    m = re.search(r"^TOKENS (.*)$", p.stdout, re.MULTILINE)
    used = "lowbit plugin (CUDA)" in p.stderr
    if m is None:
        print("CHECK vLLM tokens: vLLM failed -> FAIL\n" + (p.stderr[-3000:] or p.stdout[-3000:]), flush=True)
        return False
    got = json.loads(m.group(1))
    from transformers import AutoModelForCausalLM

    from lowbit.runtime.cache import QuantizedKVCache, cache_kwargs

    model = AutoModelForCausalLM.from_pretrained(base, torch_dtype=torch.float16).cuda().eval()
    geometry = ModelGeometry.from_config(model.config, name="tiny-llama")
    scheme = sidecar.scheme_of(sidecar.read(base), base)
    cache = QuantizedKVCache(model, scheme, geometry=geometry)
    ids = torch.tensor([prompt], device="cuda")
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=n_new, do_sample=False, pad_token_id=0, **cache_kwargs(model, cache))
    ref = out[0, len(prompt):].tolist()
    agree = next((i for i, (a, b) in enumerate(zip(got, ref)) if a != b), len(ref))
    good = used and agree >= n_new // 2
    print(f"CHECK vLLM greedy tokens (lowbit backend {'in use' if used else 'NOT in use'}): first {agree} of {n_new} "
          f"equal lowbit's runtime (random fp16 model: near-tied logits may split later) -> "
          f"{'PASS' if good else 'FAIL'}\n  vllm    {got}\n  runtime {ref}", flush=True)
    return good


# ------------------------------------------------------------------------------------------- parent
def child_env(args) -> dict:
    env = dict(os.environ)
    env.setdefault("PYTHONUNBUFFERED", "1")
    env.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # the engine in-process: its cache config is readable
    env["PYTHONPATH"] = os.pathsep.join([str(PKG_PARENT)] + ([args.site] if args.site else [])
                                        + ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
    return env


def fa2_importable() -> str | None:
    """None when vLLM's FlashAttention-2 imports (TurboQuant needs it), else why not."""
    code = ("from vllm.vllm_flash_attn.flash_attn_interface import FA2_AVAILABLE as a\n"
            "import sys; sys.exit(0 if a else 3)")
    try:
        p = subprocess.run([sys.executable, "-c", code], check=False, capture_output=True, text=True, timeout=120)
    except subprocess.TimeoutExpired:
        return "probing FlashAttention-2 timed out"
    if p.returncode == 0:
        return None
    return "FlashAttention-2 is not importable here (TurboQuant needs it): " + (p.stderr.strip().splitlines() or
                                                                                ["FA2_AVAILABLE is False"])[-1][:200]


def versions() -> dict:
    out = {}
    for mod in ("torch", "triton", "vllm", "transformers"):
        try:
            p = subprocess.run([sys.executable, "-c", f"import {mod}; print({mod}.__version__)"], check=False, capture_output=True,
                               text=True, timeout=120)
            out[mod] = p.stdout.strip() or p.stderr.strip().splitlines()[-1][:120]
        except Exception as e:  # noqa: BLE001
            out[mod] = f"?: {e}"
    return out


def card() -> str:
    try:
        p = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total", "--format=csv,noheader"],
                           check=False, capture_output=True, text=True, timeout=30)
        return p.stdout.strip().splitlines()[0]
    except Exception:  # noqa: BLE001
        return "unknown"


def git(*a) -> str:
    try:
        return subprocess.run(["git", *a], check=False, capture_output=True, text=True, timeout=30).stdout.strip()
    except Exception:  # noqa: BLE001
        return ""


def table(rows: list) -> str:
    ref = {(r["kv"], r["B"]): r for r in rows if r.get("tok_s")}
    lines = [(f"{'kv':24} {'B':>3} {'fits':>5} {'capacity':>10} {'ms/step':>8} {'tok/s':>8} {'x fp8':>6} {'x bf16':>6} "
             f"{'ttft_s':>7}  note")]
    for r in rows:
        f8 = ref.get(("fp8", r["B"]))
        bf = ref.get(("auto", r["B"]))
        x8 = f"{r['tok_s'] / f8['tok_s']:.2f}" if r.get("tok_s") and f8 else "-"
        xb = f"{r['tok_s'] / bf['tok_s']:.2f}" if r.get("tok_s") and bf else "-"
        lines.append(f"{r['kv']:24} {r['B']:>3} {r.get('fits')!s:>5} {r.get('capacity_tokens')!s:>10} "
                     f"{r.get('ms_per_step')!s:>8} {r.get('tok_s')!s:>8} {x8:>6} {xb:>6} "
                     f"{r.get('ttft_s')!s:>7}  {r.get('note') or r.get('error') or ''}"[:220])
    caps = {r["kv"]: r["capacity_tokens"] for r in rows if r.get("capacity_tokens")}
    if caps.get("auto"):
        lines.append("capacity vs bf16: " + ", ".join(f"{k} {v / caps['auto']:.2f}x" for k, v in caps.items()))
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--L", type=int, default=32768)
    ap.add_argument("--batches", default="1,16,64")
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--kvs", default=",".join(DEFAULT_KVS))
    ap.add_argument("--gpu-mem", type=float, default=0.9)
    ap.add_argument("--chunk", type=int, default=8192, help="max_num_batched_tokens (prefill chunk)")
    ap.add_argument("--timeout", type=int, default=540, help="seconds per kv config (its own process)")
    ap.add_argument("--total-budget", type=int, default=1080, help="stop starting configs after this many seconds")
    ap.add_argument("--site", default=None,
                    help="site dir where vLLM is installed: lowbit's entry point is written there")
    ap.add_argument("--export-root", default="/tmp/lowbit_vllm_exports")
    ap.add_argument("--out", default=None)
    ap.add_argument("--enforce-eager", action="store_true")
    ap.add_argument("--profile", action="store_true", help="print the top CUDA kernels of one timed decode run")
    ap.add_argument("--check", action="store_true", help="quick GPU correctness checks, then exit")
    ap.add_argument("--check-timeout", type=int, default=300)
    ap.add_argument("--one", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.one:
        run_one(json.loads(args.one))
        return 0
    log(ensure_entry_point(args.site if args.site and Path(args.site).is_dir() else None))
    if args.check:
        return check(args)
    batches = [int(b) for b in args.batches.split(",")]
    kvs = [k.strip() for k in args.kvs.split(",") if k.strip()]
    gpu = card()
    env = {"command": " ".join(["lowbit bench vllm", *(argv if argv is not None else sys.argv[1:])]),
           "git_commit": git("rev-parse", "HEAD"), "dirty": bool(git("status", "--porcelain")),
           "versions": versions(), "card": gpu, "gpu_memory_utilization": args.gpu_mem, "L": args.L,
           "steps": args.steps, "prefill_chunk": args.chunk, "kvs": kvs, "batches": batches}
    log("env", json.dumps(env))
    tq_why = fa2_importable() if any(k.startswith("turboquant") for k in kvs) else None
    rows: list = []
    start = time.time()
    for kv in kvs:
        if kv.startswith("turboquant") and tq_why:
            rows += [{"kv": kv, "B": B, "L": args.L, "fits": None, "capacity_tokens": None, "ms_per_step": None,
                      "tok_s": None, "ttft_s": None, "mode": "decode", "tp": 1, "note": tq_why} for B in batches]
            continue
        if time.time() - start > args.total_budget:
            rows += [{"kv": kv, "B": B, "L": args.L, "fits": None, "capacity_tokens": None, "ms_per_step": None,
                      "tok_s": None, "ttft_s": None, "mode": "decode", "tp": 1,
                      "note": f"not run: the run's budget of {args.total_budget}s was spent"} for B in batches]
            continue
        directory = make_export(Path(args.export_root) / re.sub(r"[^A-Za-z0-9_.-]+", "_", kv), LLAMA3_8B, kv)
        cfg = {"kv": kv, "L": args.L, "steps": args.steps, "batches": batches, "dir": str(directory),
               "gpu_mem": args.gpu_mem, "vocab": LLAMA3_8B["vocab_size"], "chunk": args.chunk,
               "enforce_eager": args.enforce_eager, "profile": args.profile}
        log(f"=== {kv}: starting (timeout {args.timeout}s)")
        got: dict = {}
        tail: list = []
        proc = subprocess.Popen([sys.executable, str(Path(__file__).resolve()), "--one", json.dumps(cfg)],
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=child_env(args),
                                start_new_session=True)
        deadline = time.time() + args.timeout
        import queue
        import threading

        lines: queue.Queue = queue.Queue()

        def pump(stream=proc.stdout, q=lines):  # a reader thread: a child stuck mid-line never blocks the deadline
            for ln in iter(stream.readline, ""):
                q.put(ln)
            q.put(None)

        threading.Thread(target=pump, daemon=True).start()
        cap_seen = None
        timed_out = False
        while True:
            if time.time() > deadline:
                timed_out = True
                break
            try:
                line = lines.get(timeout=5)
            except queue.Empty:
                continue
            if line is None:
                break
            line = line.rstrip("\n")
            tail = [*tail, line][-40:]
            if line.startswith("RESULT "):
                r = json.loads(line[7:])
                got[r["B"]] = r
                print(line, flush=True)
            elif (m := re.search(r"GPU KV cache size: ([\d,]+) tokens", line)):
                cap_seen = int(m.group(1).replace(",", ""))
                print(f"  [{kv}] {line[-160:]}", flush=True)
            elif args.profile and (line.startswith("PROFILE") or line.count("  ") > 4):  # the profile's table
                print(line[:200], flush=True)
            elif any(s in line for s in ("lowbit plugin", "Error", "error", "Traceback", "[" + kv + "]")):
                print(f"  [{kv}] {line[-300:]}", flush=True)
        if timed_out or proc.poll() is None:
            import signal

            try:
                os.killpg(proc.pid, signal.SIGKILL)  # its own session: vLLM's workers go with it
            except ProcessLookupError:
                pass
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                pass
        else:
            try:
                proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, 9)
        why = (f"timed out after {args.timeout}s" if timed_out else f"exit {proc.returncode}") + \
            (": " + " | ".join(t for t in tail[-6:])[-400:] if tail else "")
        for B in batches:
            r = got.get(B) or {"kv": kv, "B": B, "L": args.L, "fits": None, "capacity_tokens": cap_seen,
                               "ms_per_step": None, "tok_s": None, "ttft_s": None, "mode": "decode", "tp": 1,
                               "error": f"no result: {why}"}
            if r.get("capacity_tokens") is None and cap_seen:
                r["capacity_tokens"] = cap_seen
            rows.append(r)
        log(f"=== {kv}: done ({'timed out' if timed_out else 'exit ' + str(proc.returncode)})")
        write_results(args, env, rows, gpu)
    out = write_results(args, env, rows, gpu)
    print(table(json.loads(out.read_text())["rows"]), flush=True)
    log(f"wrote {out}")
    return 0


def write_results(args, env, rows, gpu) -> Path:
    """The results file; rows of kv configs this run did not touch are kept (one table over several calls)."""
    slug = re.sub(r"[^a-z0-9]+", "_", gpu.split(",")[0].lower()).strip("_") or "gpu"
    out = Path(args.out) if args.out else Path.cwd() / "lowbit-results" / f"vllm_gpu_{slug}.json"
    out.parent.mkdir(parents=True, exist_ok=True)
    mine = {r["kv"] for r in rows}
    kept, runs = [], []
    if out.is_file():
        try:
            old = json.loads(out.read_text())
            kept = [r for r in old.get("rows", []) if r.get("kv") not in mine]
            runs = [e for e in old.get("env", {}).get("runs", [old.get("env")]) if e and e.get("kvs") != env.get("kvs")]
        except (ValueError, AttributeError):
            kept, runs = [], []
    all_rows = kept + rows
    order = {k: i for i, k in enumerate(DEFAULT_KVS)}
    all_rows.sort(key=lambda r: (order.get(r["kv"], 99), r["kv"], r["B"]))
    out.write_text(json.dumps({"env": {**env, "runs": [*runs, env]}, "rows": all_rows}, indent=1) + "\n")
    return out


if __name__ == "__main__":
    sys.exit(main())
