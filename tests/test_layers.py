"""The layer contract of src/lowbit, checked from the source text.

Every module under src/lowbit is parsed with `ast`; every import of a lowbit module, at the top
of a file or inside a function, is an edge. Each module maps to one layer:

    0 core                                  errors, device, threads, progress, flags
    1 quant / rotation / models             pure math, rotations, model geometry and families
    2 kv / weights                          what a KV or weight scheme is and how it is stored
    3 kernels                               decode attention and GEMM kernels, each with its torch twin
    4 backends                              who runs a decode step, found by scanning the package
    5 runtime / serve / integrations        static cache, captured step, server, vLLM and diffusers
    6 eval / calib / artifacts              measurements, calibration, manifests and verification
    7 tools                                 bench, audit, validate: only commands import tools
    8 commands                              argument parsing only (cli.py, __main__.py)

The rules: no import goes up a layer (same layer is fine), and no two modules import each other,
directly or through others (no cycles, counting top-level and function-local imports alike).
Function-local imports: commands may import anything lazily (so `lowbit --help` imports no torch);
elsewhere a lowbit module imports another inside a function only to keep an optional or heavy
third-party package (triton, fastapi, uvicorn, vllm, diffusers, openai, transformers, torch, ...) out
of its own import: the imported module must pull in one that the importing module does not (HEAVY).
Everything else sits at the top of the file, where readers and linters see the real graph.

Run `python tests/test_layers.py` to print the graph's violations, one per line, as
`a.b -> c.d (layer X -> layer Y)`.
"""
from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"
PKG = "lowbit"

LAYERS = ["core", "quant/rotation/models", "kv/weights", "kernels", "backends",
          "runtime/serve/integrations", "eval/calib/artifacts", "tools", "commands"]

# First dotted component under lowbit -> layer index. A module not named here fails the test:
# every new top-level package must say where it sits.
PACKAGE_LAYER = {
    "core": 0, "artifacts": 0,
    "quant": 1, "rotation": 1, "models": 1,
    "kv": 2, "weights": 2, "recipes": 2,
    "kernels": 3,
    "backends": 4,
    "runtime": 5, "serve": 5, "integrations": 5, "vllm_plugin": 5, "diffusion": 5,
    "eval": 6, "calib": 6,
    "tools": 7,
    "commands": 8, "cli": 8, "__main__": 8,
}

# Import edges that break the rule today and are still to be fixed, as "a.b -> c.d". Empty is
# the goal; an entry here that no longer occurs fails the test, so the list only shrinks.
ALLOWED: set[str] = set()

# The package root holds only __version__: it sits at the bottom, beside core.
ROOT_LAYER = 0


def modules() -> dict[str, Path]:
    out = {}
    for path in sorted((SRC / PKG).rglob("*.py")):
        parts = list(path.relative_to(SRC).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


def layer_of(mod: str) -> int:
    parts = mod.split(".")
    if len(parts) == 1:
        return ROOT_LAYER
    if parts[1] not in PACKAGE_LAYER:
        raise KeyError(f"{mod}: no layer for '{parts[1]}' (add it to PACKAGE_LAYER in tests/test_layers.py)")
    return PACKAGE_LAYER[parts[1]]


def layer_name(i: int) -> str:
    return LAYERS[i]


def _resolve(name: str, known: dict[str, Path]) -> str | None:
    """The longest known module that `name` names or lives in."""
    parts = name.split(".")
    while parts:
        cand = ".".join(parts)
        if cand in known:
            return cand
        parts.pop()
    return None


def imports(mod: str, path: Path, known: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """(imported lowbit module, function-local?, line) for each import of a lowbit module."""
    tree = ast.parse(path.read_text(), filename=str(path))
    is_pkg = path.name == "__init__.py"
    base = mod.split(".") if is_pkg else mod.split(".")[:-1]
    out: list[tuple[str, bool, int]] = []

    def visit(node: ast.AST, local: bool) -> None:
        for child in ast.iter_child_nodes(node):
            inner = local or isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.Lambda))
            if isinstance(child, ast.Import):
                for alias in child.names:
                    if alias.name == PKG or alias.name.startswith(PKG + "."):
                        target = _resolve(alias.name, known)
                        if target:
                            out.append((target, local, child.lineno))
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - (child.level - 1)]
                    name = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    name = child.module or ""
                if not (name == PKG or name.startswith(PKG + ".")):
                    continue
                for alias in child.names:
                    target = _resolve(f"{name}.{alias.name}", known)
                    if target:
                        out.append((target, local, child.lineno))
            # `if TYPE_CHECKING:` blocks are for readers and type checkers: they import nothing at run time.
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                for sub in child.orelse:
                    visit(ast.Module(body=[sub], type_ignores=[]), inner)
                continue
            visit(child, inner)

    visit(tree, False)
    return [(t, loc, line) for t, loc, line in out if t != mod]


def _is_type_checking(test: ast.AST) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def graph() -> dict[str, list[tuple[str, bool, int]]]:
    known = modules()
    return {m: imports(m, p, known) for m, p in known.items()}


def upward_violations(g=None) -> list[str]:
    g = g if g is not None else graph()
    out = set()
    for a, edges in g.items():
        la = layer_of(a)
        for b, _local, _line in edges:
            lb = layer_of(b)
            if lb > la:
                out.add(f"{a} -> {b} (layer {layer_name(la)} -> layer {layer_name(lb)})")
    return sorted(out)


# Third-party packages that are optional or slow to import. A lowbit module may import another lowbit
# module inside a function only to keep one of these out of its own import: the imported module pulls
# in (at its top level, directly or through lowbit modules) a heavy package the importing one does not.
HEAVY = {"torch", "triton", "transformers", "fastapi", "uvicorn", "vllm", "diffusers", "openai", "safetensors",
         "tokenizers", "numpy", "matplotlib", "sklearn", "gguf", "compressed_tensors", "accelerate", "hqq",
         "optimum", "rich", "tqdm"}


def third_party(path: Path) -> set[str]:
    """Top-level (module body, not function) imports of HEAVY packages in one file."""
    tree = ast.parse(path.read_text(), filename=str(path))
    out = set()

    def visit(body):
        for node in body:
            if isinstance(node, ast.Import):
                out.update(a.name.split(".")[0] for a in node.names)
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                out.add(node.module.split(".")[0])
            elif isinstance(node, (ast.If, ast.Try, ast.With)) and not (
                    isinstance(node, ast.If) and _is_type_checking(node.test)):
                for field in ("body", "orelse", "finalbody", "handlers"):
                    for sub in getattr(node, field, []) or []:
                        visit(sub.body if isinstance(sub, ast.ExceptHandler) else [sub])

    visit(tree.body)
    return out & HEAVY


def heavy_closure(g=None) -> dict[str, set[str]]:
    """Per module: the HEAVY packages importing it pulls in (its top-level imports, its packages' and
    those of every lowbit module it imports at the top level, transitively)."""
    g = g if g is not None else graph()
    known = modules()
    own = {m: third_party(p) for m, p in known.items()}
    deps = {m: {b for b, local, _ in g[m] if not local} for m in g}
    for m in g:  # importing a.b.c runs a/__init__ and a/b/__init__ first
        parts = m.split(".")
        deps[m] |= {".".join(parts[:i]) for i in range(1, len(parts)) if ".".join(parts[:i]) in known}
    memo: dict[str, set[str]] = {}

    def close(m, seen=()):
        if m in memo:
            return memo[m]
        out = set(own[m])
        for d in deps[m]:
            if d not in seen and d != m:
                out |= close(d, (*seen, m))
        memo[m] = out
        return out

    return {m: close(m) for m in g}


# The vLLM plugin is loaded by vLLM in every process it starts (lowbit.vllm_plugin:register, a general
# plugin): it keeps its imports lazy so that a model that is not lowbit's costs nothing; its modules are
# maintained beside the vLLM integration work and are left out of this rule until they are reviewed
# there. The entries below are module prefixes, not single imports.
LOCAL_IMPORTS_EXEMPT = ("lowbit.vllm_plugin",)


def local_import_violations(g=None) -> list[str]:
    """Function-local imports of lowbit modules outside commands that keep no heavy package out."""
    g = g if g is not None else graph()
    heavy = heavy_closure(g)
    out = set()
    for a, edges in g.items():
        if layer_of(a) == PACKAGE_LAYER["commands"] or a.startswith(LOCAL_IMPORTS_EXEMPT):
            continue
        for b, local, line in edges:
            if local and not (heavy[b] - heavy[a]):
                out.add(f"{a}:{line} imports {b} inside a function (it keeps no heavy package out: hoist it)")
    return sorted(out)


def cycles(g=None) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan, iterative)."""
    g = g if g is not None else graph()
    adj = {a: sorted({b for b, _l, _n in edges}) for a, edges in g.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on: set[str] = set()
    stack: list[str] = []
    comps: list[list[str]] = []
    counter = 0
    for root in sorted(adj):
        if root in index:
            continue
        work = [(root, iter(adj[root]))]
        index[root] = low[root] = counter
        counter += 1
        stack.append(root)
        on.add(root)
        while work:
            v, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter
                    counter += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(adj.get(nxt, []))))
                elif nxt in on:
                    low[v] = min(low[v], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[v])
            if low[v] == index[v]:
                comp = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    comp.append(w)
                    if w == v:
                        break
                if len(comp) > 1:
                    comps.append(sorted(comp))
    return sorted(comps)


def _key(v: str) -> str:
    return v.split(" (layer")[0]


# Optional packages (extras) and the folders whose modules may need them at import. Everything else must
# import on a plain install (torch + transformers), so a CPU user without Triton can plan, evaluate and
# generate, and `lowbit serve` / the vLLM plugin / diffusion pull in their extras only when used.
OPTIONAL = {"triton", "fastapi", "uvicorn", "vllm", "diffusers", "openai"}
OPTIONAL_HOMES = ("lowbit.kernels", "lowbit.tools", "lowbit.serve", "lowbit.vllm_plugin", "lowbit.diffusion",
                  "lowbit.integrations", "lowbit.commands", "lowbit.cli", "lowbit.__main__")


def optional_leaks(g=None) -> list[str]:
    heavy = heavy_closure(g)
    return sorted(f"{m} imports {', '.join(sorted(heavy[m] & OPTIONAL))} at import time"
                  for m in heavy if heavy[m] & OPTIONAL and not m.startswith(OPTIONAL_HOMES))


def test_optional_packages_stay_in_their_folders():
    found = optional_leaks()
    assert not found, "modules that need an optional package to import:\n" + "\n".join(found)


def test_every_module_has_a_layer():
    for m in modules():
        layer_of(m)


def test_no_import_goes_up_a_layer():
    found = upward_violations()
    bad = [v for v in found if _key(v) not in ALLOWED]
    stale = sorted(ALLOWED - {_key(v) for v in found})
    assert not bad, "imports that go up a layer:\n" + "\n".join(bad)
    assert not stale, "allow-list entries that no longer occur (delete them):\n" + "\n".join(stale)


def test_no_import_cycles():
    found = cycles()
    assert not found, "import cycles:\n" + "\n".join(" <-> ".join(c) for c in found)


def test_function_local_lowbit_imports_only_keep_heavy_packages_out():
    found = local_import_violations()
    assert not found, "function-local lowbit imports that keep nothing out:\n" + "\n".join(found)


if __name__ == "__main__":
    g = graph()
    up = upward_violations(g)
    cyc = cycles(g)
    loc = local_import_violations(g)
    print("\n".join(up))
    print(f"# {len(up)} upward imports")
    for c in cyc:
        print(f"cycle ({len(c)}): " + " <-> ".join(c))
    print(f"# {len(cyc)} cycles")
    print("\n".join(loc))
    print(f"# {len(loc)} function-local lowbit imports outside commands")
    opt = optional_leaks(g)
    print("\n".join(opt))
    print(f"# {len(opt)} modules outside their folder that need an optional package")
