"""The `lowbit` command.

Each subcommand lives in its own module under `lowbit.commands` and exposes
  NAME: str, HELP: str, add_arguments(parser), run(args) -> int | None
and is listed in lowbit.commands.COMMANDS (name -> module, help). Building the parser imports no
command module: a command's module (and with it torch / transformers) is imported only when that
command is parsed, so `lowbit --help` stays fast.

Around every command: the thread policy (lowbit.core.threads, `--threads`), LowbitError -> `error: ...`
and exit 2, Ctrl-C -> exit 130 and SIGTERM -> exit 143 with one line that says what was kept.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
from pathlib import Path

import lowbit
from lowbit import __version__
from lowbit.commands import COMMANDS, TORCH_FREE
from lowbit.commands import load as load_command
from lowbit.core import threads
from lowbit.core.errors import LowbitError

EXIT_ERROR = 2
EXIT_SIGINT = 130  # 128 + SIGINT, what shells report for Ctrl-C
EXIT_SIGTERM = 143  # 128 + SIGTERM

# args attributes that name what a command writes (artifact dirs, report files)
OUTPUT_ATTRS = ("out", "json_out", "markdown_out", "plot_out", "json")


class Terminated(KeyboardInterrupt):
    """SIGTERM, raised in the main thread so `with` blocks (lowbit.artifacts' writer) clean up as on Ctrl-C."""


class _TopParser(argparse.ArgumentParser):
    def format_help(self) -> str:
        # the first line says what lowbit (or the command) is, before argparse's usage line
        desc, self.description = self.description, None
        try:
            text = super().format_help()
        finally:
            self.description = desc
        return f"{desc}\n\n{text}" if desc else text


class _LazySubParsers(argparse._SubParsersAction):
    """Subcommands whose arguments are added only when the command is parsed (imports its module then)."""

    def __call__(self, parser, namespace, values, option_string=None):
        name = values[0]
        sub = self._name_parser_map.get(name)
        if sub is not None and not sub.get_default("_run"):
            _populate(name, sub)
        return super().__call__(parser, namespace, values, option_string)


def _populate(name: str, sub: argparse.ArgumentParser) -> None:
    mod = load_command(name)
    mod.add_arguments(sub)
    if not any("--threads" in a.option_strings for a in sub._actions):
        sub.add_argument("--threads", type=threads.parse_threads, default=None, metavar="N", help=threads.HELP)
    sub.set_defaults(_run=mod.run, _command=name)


def build_parser(*, eager: bool = False) -> argparse.ArgumentParser:
    """The `lowbit` parser. eager=True adds every command's arguments now (imports every module)."""
    parser = _TopParser(prog="lowbit", description=lowbit.__doc__.strip().splitlines()[0],
                        epilog="`lowbit COMMAND --help` for a command's flags.")
    parser.add_argument("--version", action="version", version=f"lowbit {__version__}")
    parser.add_argument("--threads", dest="global_threads", type=threads.parse_threads, default=None, metavar="N",
                        help=threads.HELP)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", action=_LazySubParsers)
    for name, (_, help_) in COMMANDS.items():
        p = sub.add_parser(name, help=help_, description=help_)
        if eager:
            _populate(name, p)
    return parser


def _outputs(args) -> list[Path]:
    return [Path(v) for a in OUTPUT_ATTRS if isinstance(v := getattr(args, a, None), (str, Path))]


def interrupted_message(command: str, how: str, outputs: list[Path], existed: set[Path]) -> str:
    """One line: the job was interrupted, what it kept and what it removed."""
    kept = [str(p) for p in outputs if p.exists() and p not in existed]
    absent = [str(p) for p in outputs if not p.exists()]
    # lowbit.artifacts' writer stages into .NAME.tmp-PID beside NAME and removes it on any exception
    staging = [str(s) for p in outputs if (s := p.parent / f".{p.name}.tmp-{os.getpid()}").exists()]
    parts = [f"interrupted ({how}): `lowbit {command}` stopped"]
    if kept:
        parts.append(f"kept {', '.join(kept)} (written before the interrupt)")
    if absent:
        parts.append(f"not written: {', '.join(absent)} (artifact staging directories are removed, "
                     "so nothing half-written is left)")
    if staging:
        parts.append(f"delete the leftover staging {', '.join(staging)}")
    if not outputs:
        parts.append("it writes no files, so nothing was left behind")
    return "; ".join(parts)


def _on_sigterm(signum, frame):
    raise Terminated()


def main(argv: list[str] | None = None) -> int:
    try:
        previous = signal.signal(signal.SIGTERM, _on_sigterm)
    except ValueError:  # not the main thread (main() called from a worker): leave signals alone
        previous = None
    try:
        return _main(argv)
    finally:
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)


def _main(argv: list[str] | None) -> int:
    try:
        parser = build_parser()
        args = parser.parse_args(argv)  # imports the command's module (torch, transformers): seconds
        if not getattr(args, "_run", None):
            parser.print_help()
            return EXIT_ERROR
        n = threads.resolve(getattr(args, "threads", None), args.global_threads)
        if args._command in TORCH_FREE and n == threads.DEFAULT_THREADS:
            args.threads = n  # these never import torch; leave it unimported
        else:
            args.threads = threads.apply(n)
    except KeyboardInterrupt as e:
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(f"interrupted ({how}) while starting `lowbit`: no command ran, nothing was written", file=sys.stderr)
        return EXIT_SIGTERM if isinstance(e, Terminated) else EXIT_SIGINT
    outputs = _outputs(args)
    existed = {p for p in outputs if p.exists()}
    try:
        rc = args._run(args)
    except LowbitError as e:
        print(f"error: {e}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt as e:
        how = "SIGTERM" if isinstance(e, Terminated) else "Ctrl-C"
        print(interrupted_message(args._command, how, outputs, existed), file=sys.stderr)
        return EXIT_SIGTERM if isinstance(e, Terminated) else EXIT_SIGINT
    return int(rc or 0)


if __name__ == "__main__":
    sys.exit(main())
