"""`lowbit bench decode-attention`: the fused decode kernel against bf16 SDPA (flash) on the GPU.

Results go to `--out`, by default `lowbit-results/<benchmark>_<gpu>.json` under the current working
directory (never beside the package's source), and are never overwritten: a path that exists is refused
before any GPU time is spent. Curated results are copied into results/ by hand (RESULTS.md cites them).
"""

from __future__ import annotations

import json
import os
import re
from pathlib import Path

from lowbit.core.errors import LowbitError

NAME = "bench"
HELP = ("GPU benchmarks: `bench decode-attention` (the kernel vs bf16 SDPA flash), `bench decode` (end-to-end "
        "decode steps vs transformers eager and compiled bf16); `bench images`: the DiT capacity matrix (CPU or GPU)")


def _bit_specs(s: str) -> tuple[tuple, ...]:
    """--bits "2,2so,2s8,4" -> ((2, 2), (2, 2, "so"), (2, 2, "s8"), (4, 4)), or a one-line error."""
    out = []
    for tok in (t.strip() for t in s.split(",") if t.strip()):
        tag = tok[-2:] if tok[-2:] in ("so", "s8", "vq", "rs") else ""
        b = tok[:-2] if tag else tok
        if b not in (("2",) if tag in ("vq", "rs") else ("2", "4") if tag else ("2", "4", "8")):
            raise LowbitError(f"--bits takes 2, 4, 8, 2so, 4so (scale-only groups), 2s8, 4s8 (scale-only with "
                              f"one-byte ue5m3 scales), 2vq (VQ 2x16 keys, 4x256 values) and 2rs (2s8 plus a 1-bit "
                              f"residual), got {tok!r}")
        out.append((int(b), int(b), tag) if tag else (int(b), int(b)))
    if not out:
        raise LowbitError("--bits is empty; e.g. --bits 2,4,8 or --bits 2,2so")
    return tuple(out)


def _ints(s: str) -> tuple[int, ...]:
    """'1,16,4k' -> (1, 16, 4096)."""
    out = []
    for part in s.split(","):
        part = part.strip().lower()
        mult = 1024 if part.endswith("k") else 1
        try:
            out.append(int(part.removesuffix("k")) * mult)
        except ValueError:
            raise LowbitError(f"{part!r} in {s!r} is not a count: use integers, optionally with k "
                              "(e.g. 1,16,4k)") from None
    return tuple(out)


def add_arguments(parser) -> None:
    parser.add_argument("what", choices=["decode-attention", "decode", "serve-engine", "gemm", "images", "vllm"],
                        help="decode-attention: the kernel vs SDPA flash; decode: end-to-end decode steps "
                             "(transformers eager / compiled bf16, lowbit runtime bf16 / int4 / int2); serve-engine: "
                             "the continuous-batching engine in-process at --concurrency levels; gemm: the weight "
                             "GEMMs (W4A16/W8A16/W8A8/W4A8) vs cuBLAS bf16 over the audit's M sweep; images: the "
                             "diffusion capacity matrix (--batch x --resolution x checkpoint, each cell gated; CPU "
                             "or --device cuda); vllm: lowbit's KV backend inside vLLM vs vLLM's own --kv-cache-dtype "
                             "paths on one GPU (capacity, decode ms/step, TTFT; each dtype in its own process)")
    v = parser.add_argument_group("vllm (lowbit bench vllm; GPU vLLM 0.26.x)")
    v.add_argument("--kv-dtypes", default=None, metavar="A,B,...",
                   help="vllm: vLLM dtypes (auto, fp8, int4_per_token_head, turboquant_3bit_nc, ...) and lowbit-<scheme> "
                        "rows (lowbit-int2, lowbit-int4) (default: all of them)")
    v.add_argument("--gpu-mem", type=float, default=0.9, help="vllm: gpu_memory_utilization of every row (default 0.9)")
    v.add_argument("--site", default=None, metavar="DIR",
                   help="vllm: a --target directory vLLM was installed into; lowbit's vLLM entry point is written there")
    v.add_argument("--per-row-timeout", type=int, default=540, help="vllm: seconds per dtype's process (default 540)")
    v.add_argument("--check", action="store_true",
                   help="vllm: correctness only (kernels vs their twins on the GPU, vLLM greedy tokens vs lowbit's runtime)")
    v.add_argument("--profile", action="store_true", help="vllm: print the top CUDA kernels of one timed decode run")
    g = parser.add_argument_group("images (lowbit bench images)")
    g.add_argument("--model", default=None, help="images: the unquantized diffusers pipeline directory")
    g.add_argument("--checkpoints", default=None, metavar="DIR1,DIR2", help="images: quantized pipeline directories")
    g.add_argument("--resolution", default=None, help="images: image sides in pixels (default: the model's, e.g. 32)")
    g.add_argument("--device", default="cpu", help="images: cpu (default) | cuda")
    g.add_argument("--image-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="images: dtype of the DiT's float tensors and activations (default fp32)")
    parser.add_argument("--concurrency", default="1,8,32", help="serve-engine: concurrent requests (default 1,8,32)")
    parser.add_argument("--prompt-len", type=int, default=4096, help="serve-engine: prompt tokens (default 4096)")
    parser.add_argument("--max-tokens", type=int, default=64, help="serve-engine: tokens per request (default 64)")
    parser.add_argument("--paths", default="hf-eager-bf16,hf-static-compile-bf16,lowbit-bf16,lowbit-int4,lowbit-int2",
                        help="decode: which paths to time (default these five; also lowbit-w4a16-int2 and "
                             "hf-generate-compile-lowbit-int2/-int4/-bf16: transformers' compiled generate over "
                             "lowbit's GenerateCache)")
    parser.add_argument("--compile", choices=("whole", "layers", "off"), default="whole",
                        help="decode: how the lowbit rows run their captured step: whole (default) torch.compile'd as "
                             "one graph (the faster step; ~2 min a row on an 8B model), layers compiled per decoder "
                             "layer (22-84 s a row, a slower step), off the eager step captured; rows record compiled "
                             "and compile_regions")
    parser.add_argument("--steps", type=int, default=20, help="decode: timed steps per row (default 20)")
    parser.add_argument("--no-fuse", action="store_true",
                        help="decode: the lowbit runtime rows without fused q/k/v and gate/up GEMMs (what the runtime "
                             "runs on CUDA by default; rows record fused_projections)")
    parser.add_argument("--no-fold", action="store_true",
                        help="decode: the lowbit runtime rows with V's rotation applied by the cache instead of folded "
                             "into v_proj / o_proj (what the runtime runs on CUDA by default; rows record "
                             "folded_value_rotation)")
    parser.add_argument("--inductor-pdl", choices=("auto", "on", "off"), default="auto",
                        help="decode: Inductor's programmatic-dependent-launch codegen in the compiled rows (torch's "
                             "prototype config.triton.enable_pdl): auto (default) = on where this torch has it, as the "
                             "runtime runs; rows record it in ran.compile")
    parser.add_argument("--prefill", type=int, default=0, metavar="TOKENS",
                        help="decode: also time the prefill of one prompt of this many tokens (default 0: no)")
    parser.add_argument("--batch", default="1,16,64", help="batch sizes (default 1,16,64)")
    parser.add_argument("--length", default="4k,32k,128k", help="context lengths (default 4k,32k,128k)")
    parser.add_argument("--geometry", default=None,
                        help="decode-attention: llama3-8b,gemma3-1b (default both; Hq 32 / Hkv 8 / D 128 and "
                             "Hq 4 / Hkv 1 / D 256), or the geometry kernel's deepseek-v3-latent, "
                             "deepseek-v3-latent-tp8, kimi-k192v128, gemma4-full512; decode: one random-weight model "
                             "geometry (default llama3-8b)")
    parser.add_argument("--bits", default="2,4,8", help="decode-attention: K=V bit widths to time (default 2,4,8); "
                        "2so / 4so: scale-only groups (no zero stored: the shipped @2.5 recipes' format); "
                        "2s8 / 4s8: those with one-byte ue5m3 scales (scale_format ue5m3); 2rs: 2s8 plus a 1-bit sign residual on K "
                        "and V (the decode_vq kernel); 2vq: VQ 2x16 keys and "
                        "4x256 values with one-byte row scales (the decode_vq kernel)")
    g = parser.add_argument_group("gemm (lowbit bench gemm)")
    g.add_argument("--schemes", default=None, metavar="S1,S2",
                   help="gemm: weight schemes to time (default w4a16-g128,w8a16,w8a8,w4a16-g64-asym,w4a8)")
    g.add_argument("--m", default=None, metavar="M1,M2", help="gemm: only these M of the audit's sweep (default all)")
    g.add_argument("--shapes", default=None, metavar="NAME;NAME",
                   help="gemm: only these shapes, by the audit's names, ';'-separated (e.g. 'llama3-8b gate/up')")
    g.add_argument("--read-floor", action="store_true",
                   help="gemm: also time the fastest single read of each packed weight (read_ms) and report "
                        "ceiling = bf16_ms / read_ms, the best ratio any kernel reading the weight once could reach")
    g.add_argument("--candidates", default=None, metavar="C1,C2",
                   help="gemm: audit and time each of these per (scheme, shape, M) and pick the fastest passing one: "
                        "table (lowbit's current cell), humming (humming-kernels, in the CUDA graph), dequant-cublas; "
                        "or all (default shapes: llama3-8b qkv/o, gate/up, down; default M 1,16,64,256,4096)")
    g.add_argument("--table", default=None, metavar="JSON",
                   help="gemm --candidates: also write the dispatch table of the winners for this card (a new file)")
    g.add_argument("--budget-s", type=float, default=None,
                   help="gemm --candidates: start no new (scheme, shape) after this many seconds")
    parser.add_argument("--mem-cap-gb", type=float, default=60.0, help="skip shapes whose bf16 KV exceeds this")
    parser.add_argument("--out", metavar="JSON",
                        help="write results to this new file "
                             "(default ./lowbit-results/decode_attention_<gpu>.json)")


RESULTS_DIR = "lowbit-results"


def default_out(what: str, gpu: str, cwd: str | os.PathLike | None = None) -> Path:
    """cwd/lowbit-results/<what>_<gpu>.json, e.g. lowbit-results/decode_attention_NVIDIA_H200.json
    (dashes in `what` and anything but letters, digits, '.', '_', '-' in the GPU name become '_')."""
    tag = re.sub(r"[^A-Za-z0-9._-]+", "_", gpu.strip()) or "gpu"
    return Path(cwd or os.getcwd()) / RESULTS_DIR / f"{what.replace('-', '_')}_{tag}.json"


def resolve_out(out: str | None, what: str, gpu: str, cwd: str | os.PathLike | None = None) -> Path:
    """The path results will be written to: `out` (relative to cwd) or default_out(). Raises
    LowbitError if it exists (results, like artifacts, are never overwritten) or is a directory."""
    path = Path(out) if out else default_out(what, gpu, cwd)
    if not path.is_absolute():
        path = Path(cwd or os.getcwd()) / path
    if path.exists():
        raise _exists(path)
    return path


def _exists(path: Path):
    return LowbitError(f"{path} exists and results are never overwritten: pass a new path with --out")


def write_new(path: Path, res: dict) -> None:
    """Write JSON to a path that must not exist yet: a temporary file in the same directory, then a
    hard link (fails if the path appeared meanwhile), so a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    text = json.dumps(res, indent=1)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_text(text)
        try:
            os.link(tmp, path)
        except FileExistsError:
            raise _exists(path) from None
        except OSError:  # a filesystem without hard links: exclusive create still never overwrites
            with open(path, "x") as f:
                f.write(text)
    finally:
        tmp.unlink(missing_ok=True)


def run(args) -> int:
    import torch

    if args.out and args.what != "vllm":  # bench vllm adds its rows to --out across device calls
        resolve_out(args.out, args.what, "")  # refuse an existing file before anything else
    if args.what == "gemm":
        from lowbit.tools.bench import gemm as weight_bench

        gemm_sel = (tuple(x.strip() for x in args.schemes.split(",")) if args.schemes else weight_bench.BENCH_SCHEMES,
                    _ints(args.m) if args.m else None,
                    tuple(x.strip() for x in args.shapes.split(";")) if args.shapes else None)
        weight_bench.check_selection(*gemm_sel)
        if args.candidates:
            from lowbit.tools.bench import gemm_candidates

            gemm_cands = gemm_candidates.check_candidates(
                None if args.candidates == "all" else tuple(x.strip() for x in args.candidates.split(",")))
        elif args.table:
            raise LowbitError("bench gemm: --table is built from --candidates; pass --candidates all (or a list)")
    if args.what == "images":
        return _images(args)
    if not torch.cuda.is_available():
        raise LowbitError(f"bench {args.what} needs a CUDA GPU (it times GPU kernels against their bf16 baselines)")
    if args.what == "vllm":
        from lowbit.tools.bench import vllm_gpu

        return vllm_gpu.main(_vllm_argv(args))
    if args.what == "gemm":
        path = resolve_out(args.out, "gemm", torch.cuda.get_device_name(0))
        if args.candidates:
            table = resolve_out(args.table, "gemm_table", torch.cuda.get_device_name(0)) if args.table else None
            return gemm_candidates.bench_cli(gemm_sel[0], gemm_sel[1], gemm_sel[2], gemm_cands, path, table,
                                             args.budget_s, write_new)
        res = weight_bench.run(schemes=gemm_sel[0], ms=gemm_sel[1], shapes=gemm_sel[2], read_floor=args.read_floor)
        write_new(path, res)
        print(f"wrote {path}")
        return 0
    if args.what == "serve-engine":
        from lowbit.tools.bench import runtime as e2e

        path = resolve_out(args.out, "serve_engine", torch.cuda.get_device_name(0))
        res = e2e.engine_load(args.geometry or "llama3-8b", _ints(args.concurrency), prompt_len=args.prompt_len,
                              max_tokens=args.max_tokens)
        res["env"] = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__}
        write_new(path, res)
        print(f"wrote {path}")
        return 0
    if args.what == "decode":
        from lowbit.tools.bench import runtime as e2e

        path = resolve_out(args.out, "decode_e2e", torch.cuda.get_device_name(0))
        res = e2e.run(args.geometry or "llama3-8b", _ints(args.batch), _ints(args.length),
                      tuple(p.strip() for p in args.paths.split(",") if p.strip()), steps=args.steps,
                      prefill_len=args.prefill, fuse=not args.no_fuse, fold=not args.no_fold,
                      inductor_pdl={"auto": None, "on": True, "off": False}[args.inductor_pdl], compile=args.compile)
        write_new(path, res)
        print(f"wrote {path}")
        return 0
    from lowbit.tools.bench import attention as bench
    from lowbit.tools.bench import geometry as geo_bench

    geos = tuple(g.strip() for g in (args.geometry or "llama3-8b,gemma3-1b").split(","))
    bad = [g for g in geos if g not in bench.GEOMETRIES and g not in geo_bench.GEOMETRIES]
    if bad:
        raise LowbitError(f"unknown geometry {bad}; use {sorted(bench.GEOMETRIES) + sorted(geo_bench.GEOMETRIES)}")
    bits = _bit_specs(args.bits)
    path = resolve_out(args.out, args.what, torch.cuda.get_device_name(0))
    classic = tuple(g for g in geos if g in bench.GEOMETRIES)
    new = tuple(g for g in geos if g in geo_bench.GEOMETRIES)  # issue-19 geometries: the geometry kernel
    if new and any(len(b) > 2 for b in bits):
        raise LowbitError(f"--bits 2so / 4so / 2s8 / 4s8 / 2vq (scale-only groups, VQ rows) are timed on {sorted(bench.GEOMETRIES)}, not on the "
                          f"geometry kernel's {list(new)}; drop them or time those geometries separately")
    res = {"env": None, "rows": []}
    if classic:
        res = bench.run(_ints(args.batch), _ints(args.length), classic, bits, mem_cap_gb=args.mem_cap_gb)
    if new:
        geo_bits = tuple(b[0] for b in bits if b[0] in (2, 4, 8))
        more = geo_bench.run(_ints(args.batch), _ints(args.length), new, geo_bits, mem_cap_gb=args.mem_cap_gb)
        res = {"env": res["env"] or more["env"], "rows": res["rows"] + more["rows"]}
    write_new(path, res)
    print(f"wrote {path}")
    return 0


def _images(args) -> int:
    """`bench images`: lowbit.tools.bench.diffusion.capacity_matrix (--steps = DDIM steps here)."""
    import json as _json
    import platform

    import torch

    from lowbit.core.device import resolve_device
    from lowbit.tools.bench.diffusion import capacity_matrix

    if not args.model:
        raise LowbitError("bench images needs --model (the unquantized diffusers pipeline directory)")
    dev = resolve_device(args.device)
    cfg = Path(args.model) / "transformer" / "config.json"
    size = _json.loads(cfg.read_text()).get("sample_size", 32) if cfg.is_file() else 32
    sizes = _ints(args.resolution) if args.resolution else (int(size),)
    name = torch.cuda.get_device_name(0) if dev.type == "cuda" else "cpu_" + (platform.machine() or "unknown")
    path = resolve_out(args.out, "images", name)
    res = capacity_matrix(args.model, [c.strip() for c in (args.checkpoints or "").split(",") if c.strip()],
                          batches=_ints(args.batch), sizes=sizes, steps=args.steps, device=str(dev),
                          dtype=args.image_dtype)
    write_new(path, res)
    print(f"wrote {path}")
    return 0


def _vllm_argv(args) -> list[str]:
    """`lowbit bench vllm` flags -> the arguments of lowbit.tools.bench.vllm_gpu (one length; batches as given)."""
    lengths = _ints(args.length)
    if len(lengths) != 1:
        raise LowbitError(f"bench vllm takes one --length (e.g. --length 32k), got {args.length!r}")
    argv = ["--L", str(lengths[0]), "--batches", ",".join(map(str, _ints(args.batch))),
            "--gpu-mem", str(args.gpu_mem), "--timeout", str(args.per_row_timeout)]
    for flag, val in (("--kvs", args.kv_dtypes), ("--site", args.site), ("--out", args.out)):
        if val:
            argv += [flag, str(val)]
    if args.budget_s:
        argv += ["--total-budget", str(int(args.budget_s))]
    return argv + (["--check"] if args.check else []) + (["--profile"] if args.profile else [])
