"""`lowbit train-dit`: train the small class-conditional DiT on the RGBA digits, deterministically.

    lowbit train-dit --out artifacts/dit-digits32          # the committed model: 2500 steps, seed 0, 1 thread

See lowbit.diffusion.train for what is trained and how; the output is a diffusers directory inside a
lowbit artifact (manifest: sha256 of every file, training commit, steps, seed) plus samples.png.
"""

from __future__ import annotations

NAME = "train-dit"
HELP = "train the small class-conditional DiT (diffusers) on scikit-learn's digits as RGBA images (deterministic)"


def add_arguments(p) -> None:
    from lowbit.diffusion.train import TrainConfig

    d = TrainConfig()
    p.add_argument("--out", required=True, help="new output directory (never overwritten)")
    p.add_argument("--steps", type=int, default=d.steps, help=f"optimizer steps (default {d.steps})")
    p.add_argument("--batch", type=int, default=d.batch, help=f"images per step (default {d.batch})")
    p.add_argument("--lr", type=float, default=d.lr, help=f"peak learning rate (default {d.lr})")
    p.add_argument("--seed", type=int, default=d.seed, help=f"seed of init, batches, timesteps, noise (default {d.seed})")
    p.add_argument("--size", type=int, default=d.size, help=f"image side in pixels (default {d.size})")
    p.add_argument("--patch", type=int, default=d.patch, help=f"DiT patch side (default {d.patch})")
    p.add_argument("--hidden", type=int, default=d.hidden, help=f"hidden width, a multiple of 64 (default {d.hidden})")
    p.add_argument("--heads", type=int, default=d.heads, help=f"attention heads (default {d.heads})")
    p.add_argument("--layers", type=int, default=d.layers, help=f"DiT blocks (default {d.layers})")
    p.add_argument("--no-progress", action="store_true", help="log lines instead of a progress bar")


def run(args) -> int:
    from lowbit.diffusion.train import TrainConfig, train

    cfg = TrainConfig(steps=args.steps, batch=args.batch, lr=args.lr, seed=args.seed, size=args.size,
                      patch=args.patch, hidden=args.hidden, heads=args.heads, layers=args.layers)
    m = train(cfg, args.out, progress=False if args.no_progress else None)
    c = m["counts"]
    print(f"trained {c['params']} params for {c['steps']} steps in {c['train_seconds']}s: loss {c['loss_first']} -> "
          f"{c['loss_last']}; wrote {args.out} (samples.png)")
    return 0
