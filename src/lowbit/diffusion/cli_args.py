"""The flags of `lowbit eval images` and `lowbit bench images` (imports nothing heavy: `--help` stays fast)."""

from __future__ import annotations

from lowbit.core.errors import LowbitError
from lowbit.diffusion.gate import DEFAULTS

THRESHOLD_FLAGS = {"opaque_min": "--opaque-min", "opaque_max": "--opaque-max", "std_min": "--std-min",
                   "flat_max": "--flat-max", "tile_energy_max": "--tile-energy-max", "psnr_min": "--psnr-min"}


def ints(text: str, what: str) -> tuple[int, ...]:
    """'0-7' / '0,1,5' / '3' -> ints."""
    out = []
    try:
        for part in text.split(","):
            part = part.strip()
            if "-" in part[1:]:
                a, b = part.split("-", 1)
                out.extend(range(int(a), int(b) + 1))
            elif part:
                out.append(int(part))
    except ValueError:
        raise LowbitError(f"{what} {text!r}: use integers, ranges or commas, e.g. 0-7 or 0,1,2") from None
    if not out:
        raise LowbitError(f"{what} {text!r} names nothing")
    return tuple(out)


def add_image_arguments(parser, *, eval_: bool) -> None:
    """Flags shared by eval images / bench images (added in a group named after the mode)."""
    g = parser.add_argument_group("images (lowbit eval images / lowbit bench images: a diffusers DiT pipeline)")
    g.add_argument("--checkpoints", default=None, metavar="DIR1,DIR2",
                   help="images: quantized pipeline directories (from `lowbit quantize --component transformer`) "
                        "compared with --model, the unquantized pipeline")
    g.add_argument("--classes", default="0-7", help="images: class ids (default 0-7)")
    g.add_argument("--seeds", default="0-3", help="images: noise seeds, one image per class x seed (default 0-3)")
    g.add_argument("--steps", type=int, default=25, help="images: DDIM steps (default 25)")
    g.add_argument("--guidance", type=float, default=2.0, help="images: classifier-free guidance scale (default 2)")
    if eval_:
        g.add_argument("--device", default="cpu", help="images: cpu (default) | cuda")
    g.add_argument("--image-dtype", choices=("fp32", "bf16", "fp16"), default="fp32",
                   help="images: dtype of the DiT's float tensors and activations (default fp32; quantized weights "
                        "keep their codes and scales)")
    if eval_:
        g.add_argument("--image-batch", type=int, default=None,
                       help="images: images per pipeline call (default all at once)")
        g.add_argument("--summary", default=None, metavar="JSON",
                       help="images: also write the summary rows {scheme, method, psnr_mean, psnr_min, gate, "
                            "weight_bytes, wall_s_per_image, peak_mb, device} here")
        g.add_argument("--calibrate", action="store_true",
                       help="images: gate with thresholds calibrated on this run's own reference images (the rule "
                            "in lowbit.diffusion.gate) instead of the defaults; the --*-min/max flags still override")

        for name, flag in THRESHOLD_FLAGS.items():
            g.add_argument(flag, dest=f"th_{name}", type=float, default=None,
                           help=f"images gate: {name.replace('_', ' ')} (default {getattr(DEFAULTS, name):.4g})")


def image_eval_options(args):
    from lowbit.diffusion.evaluate import ImageEvalOptions
    over = {n: getattr(args, f"th_{n}") for n in THRESHOLD_FLAGS}
    th = DEFAULTS.replace(**over)
    return ImageEvalOptions(
        model=args.model, checkpoints=[c.strip() for c in (args.checkpoints or "").split(",") if c.strip()],
        classes=ints(args.classes, "--classes"), seeds=ints(args.seeds, "--seeds"), steps=args.steps,
        guidance=args.guidance, thresholds=th, calibrate=args.calibrate, device=args.device,
        dtype=args.image_dtype,
        batch=args.image_batch, json_out=args.json_out, markdown_out=args.markdown_out, plot_out=args.plot_out,
        summary_out=args.summary, overwrite=args.overwrite, overrides={k: v for k, v in over.items() if v is not None},
    )
