"""The `lowbit` subcommands: one module each, discovered so that `lowbit --help` imports none of them.

Each module exposes NAME: str, HELP: str, add_arguments(parser), run(args) -> int | None; a new
module is found automatically. COMMANDS (NAME -> module, HELP) is read from the modules' source, not
by importing them, so the top-level help costs no import of torch or transformers (importing every
module took ~5 s); a module is imported only when its command is parsed (`lowbit eval ...`,
`lowbit eval --help`). Keep NAME and HELP plain string literals (implicit concatenation is fine).
"""

from __future__ import annotations

import ast
import importlib
import pkgutil
from pathlib import Path


def _literal_str(node) -> str | None:
    return node.value if isinstance(node, ast.Constant) and isinstance(node.value, str) else None


def discover() -> dict[str, tuple[str, str]]:
    """name -> (module, HELP) of every lowbit.commands module, sorted by name, without importing any:
    NAME and HELP are read from each module's source as string literals (ast; ~1 ms a module). A
    module whose NAME or HELP is not a literal is imported to read them (slower --help, same answer)."""
    found = {}
    for info in pkgutil.iter_modules(__path__):
        if info.name.startswith("_"):
            continue
        src = Path(__path__[0]) / f"{info.name}.py"
        consts = {}
        try:
            for node in ast.parse(src.read_text(encoding="utf-8")).body:
                if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
                    consts[node.targets[0].id] = _literal_str(node.value)
        except (OSError, SyntaxError):
            consts = {}
        name, help_ = consts.get("NAME"), consts.get("HELP")
        if name is None or help_ is None:
            mod = importlib.import_module(f"lowbit.commands.{info.name}")
            name, help_ = mod.NAME, mod.HELP
        found[name] = (info.name, help_)
    return dict(sorted(found.items()))


# name -> (module under lowbit.commands, one-line help), as `lowbit --help` lists them
COMMANDS: dict[str, tuple[str, str]] = discover()

# commands that never import torch: the thread policy leaves torch unimported for them (~2 s saved)
TORCH_FREE = frozenset({"pin", "verify"})


def load(name: str):
    """The module of command `name` (imported now: this is where torch/transformers get imported)."""
    return importlib.import_module(f"lowbit.commands.{COMMANDS[name][0]}")
