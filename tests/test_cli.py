"""The `lowbit` command itself: lazy discovery, the thread policy, interrupts, the first help line."""

import importlib
import os
import pkgutil
import signal
import subprocess
import sys
import types

import pytest

import lowbit.commands
from lowbit import cli
from lowbit.artifacts.writer import ArtifactWriter


def test_help_imports_no_command_module_nor_torch():
    # `lowbit --help` took ~5 s because it imported every command (and torch + transformers)
    code = ("import sys, lowbit.cli as c; p = c.build_parser(); h = p.format_help(); "
            "bad = [m for m in sys.modules if m.split('.')[0] in ('torch', 'transformers', 'numpy') "
            "or m.startswith('lowbit.commands.')]; print(h.splitlines()[0]); print('BAD', bad)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout
    first, bad = out.splitlines()[0], out.splitlines()[-1]
    assert bad == "BAD []"
    assert first.startswith("lowbit: low-bit KV cache and weights")  # the first line says what lowbit is


def test_command_table_matches_the_modules():
    # read from the sources without importing: must agree with what the imported modules say
    names = sorted(i.name for i in pkgutil.iter_modules(lowbit.commands.__path__) if not i.name.startswith("_"))
    assert sorted(m for m, _ in lowbit.commands.COMMANDS.values()) == names  # every module listed, once
    assert list(lowbit.commands.COMMANDS) == sorted(lowbit.commands.COMMANDS)
    for name, (module, help_) in lowbit.commands.COMMANDS.items():
        mod = importlib.import_module(f"lowbit.commands.{module}")
        assert mod.NAME == name and mod.HELP == help_, name


def test_command_help_still_lists_its_flags(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["eval", "--help"])
    assert e.value.code == 0
    out = capsys.readouterr().out
    assert out.splitlines()[0].startswith("perplexity, KL and top-1")
    assert "--kv" in out and "--seq-len" in out and "--threads N" in out


@pytest.fixture
def restore_threads():
    import torch

    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


@pytest.mark.parametrize("argv,want", [(["models"], 1), (["--threads", "3", "models"], 3),
                                       (["models", "--threads", "2"], 2),
                                       (["--threads", "3", "models", "--threads", "2"], 2)])
def test_one_thread_policy_for_every_command(argv, want, restore_threads, capsys):
    import torch

    torch.set_num_threads(4)  # whatever torch chose: the policy overrides it
    assert cli.main(argv) == 0
    assert torch.get_num_threads() == want


def test_threads_refuses_zero(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--threads", "0", "models"])
    assert e.value.code == 2
    assert "give 1 or more threads" in capsys.readouterr().err


def _fake_command(monkeypatch, run):
    """Register `lowbit fake --out DIR` whose run is `run(args)`."""
    mod = types.SimpleNamespace(NAME="fake", HELP="a test command",
                                add_arguments=lambda p: p.add_argument("--out", default=None), run=run)
    monkeypatch.setitem(lowbit.commands.COMMANDS, "fake", ("fake", "a test command"))
    real = cli.load_command
    monkeypatch.setattr(cli, "load_command", lambda name: mod if name == "fake" else real(name))


@pytest.mark.parametrize("how,code,word", [("int", 130, "Ctrl-C"), ("term", 143, "SIGTERM")])
def test_interrupt_removes_staging_and_says_so(how, code, word, tmp_path, monkeypatch, capsys):
    out = tmp_path / "art"

    def run(args):
        with ArtifactWriter(args.out, kind="t", artifact_class="generic", inputs={}, recipe={}) as w:
            (w.path / "half.bin").write_bytes(b"x" * 99)
            if how == "int":
                raise KeyboardInterrupt
            os.kill(os.getpid(), signal.SIGTERM)  # the handler raises in this (main) thread
            raise AssertionError("SIGTERM did not interrupt")

    _fake_command(monkeypatch, run)
    before = signal.getsignal(signal.SIGTERM)
    assert cli.main(["fake", "--out", str(out)]) == code
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert f"interrupted ({word})" in err and f"not written: {out}" in err
    assert not out.exists() and list(tmp_path.iterdir()) == []  # staging removed
    assert signal.getsignal(signal.SIGTERM) is before  # handler restored


def test_interrupt_after_outputs_says_what_was_kept(tmp_path, monkeypatch, capsys):
    out = tmp_path / "done"

    def run(args):
        with ArtifactWriter(args.out, kind="t", artifact_class="generic", inputs={}, recipe={}) as w:
            (w.path / "a.bin").write_bytes(b"1")
        raise KeyboardInterrupt

    _fake_command(monkeypatch, run)
    assert cli.main(["fake", "--out", str(out)]) == 130
    err = capsys.readouterr().err
    assert f"kept {out}" in err and (out / "manifest.json").is_file()


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="this machine has CUDA")
@pytest.mark.parametrize("argv", [["generate", "--model", "smollm2-135m", "--prompt", "x", "--kv", "int4"],
                                  ["quantize", "--model", "smollm2-135m", "--scheme", "w8a16", "--out", "never"],
                                  ["audit", "kernels"]])
def test_device_cuda_without_cuda_is_one_line(argv, tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main([*argv, "--device", "cuda"]) == 2  # before any model is loaded
    assert capsys.readouterr().err == "error: --device cuda: CUDA is not available on this machine; use --device cpu\n"
    assert list(tmp_path.iterdir()) == []


@pytest.mark.parametrize("name,msg", [("meta", "only cpu and cuda"), ("nonsense", "is not a device")])
def test_resolve_device_refuses(name, msg):
    from lowbit.core.device import resolve_device
    from lowbit.core.errors import LowbitError

    with pytest.raises(LowbitError, match=msg):
        resolve_device(name)
    assert resolve_device("cpu").type == "cpu" and resolve_device(None).type in ("cpu", "cuda")


def test_every_flag_of_every_command_has_help():
    parser = cli.build_parser(eager=True)
    sub = next(a for a in parser._actions if isinstance(a, cli._LazySubParsers))
    missing = [f"{name} {a.option_strings[0]}" for name, p in sub._name_parser_map.items()
               for a in p._actions if a.option_strings and not a.help]
    assert missing == []


def test_interrupt_while_starting(monkeypatch, capsys):
    def slow_import(name):
        raise KeyboardInterrupt  # Ctrl-C during the seconds a command's imports take

    monkeypatch.setattr(cli, "load_command", slow_import)
    assert cli.main(["models"]) == 130
    assert capsys.readouterr().err == "interrupted (Ctrl-C) while starting `lowbit`: no command ran, nothing was written\n"


# commands allowed to import torch while parsing: none (every parser reads only torch-free modules)
TORCH_AT_PARSE: set[str] = set()


def test_help_and_bad_flags_import_no_torch():
    # a mistyped flag took 12-18 s: the command's module imported torch before argparse looked at the flags
    code = """
import contextlib, io, sys
from lowbit import cli
from lowbit.commands import COMMANDS
skip = set(sys.argv[1].split(","))
for name in COMMANDS:
    if name in skip:
        continue
    for extra in (["--help"], ["--no-such-flag"]):
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()) as err:
            try:
                rc = cli.main([name, *extra])
            except SystemExit as e:
                rc = e.code
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in ("torch", "transformers"))
        print(name, extra[0], rc, heavy[:3], "error:" in err.getvalue())
"""
    out = subprocess.run([sys.executable, "-c", code, ",".join(TORCH_AT_PARSE) or "-"], capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert len(out) == 2 * (len(lowbit.commands.COMMANDS) - len(TORCH_AT_PARSE))
    for line in out:
        _name, flag, rc, rest = line.split(" ", 3)
        assert rest.startswith("[]"), line  # no torch / transformers module imported
        assert rc == ("0" if flag == "--help" else "2"), line
        assert flag == "--help" or rest.endswith("True"), line  # argparse said what was wrong


def test_readme_states_the_prerequisites():
    from pathlib import Path

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text(encoding="utf-8")
    pre = readme.split("Prerequisites:", 1)[1].split("\n## ", 1)[0]  # the list, up to the next section
    assert "Python 3.11" in pre and "make" in pre and "3 GB" in pre
    assert readme.index("Prerequisites:") < readme.index("make demo")  # before the first command


@pytest.mark.parametrize("flag", [["--vq", "2x16"], ["--zero", "none"], ["--residual", "sign"], ["--group", "64"]])
def test_serve_scheme_flag_without_kv_is_one_line(flag, capsys):
    """serve and export take the one KV flag set (lowbit.commands._kv_flags): a scheme flag without --kv or
    --recipe is refused in one line, before any model is loaded, instead of being ignored."""
    assert cli.main(["serve", "--model", "no-such-model", "--port", "0", "--device", "cpu", *flag]) == 2
    assert capsys.readouterr().err == f"error: {flag[0]} needs --kv SCHEME (or a --recipe file)\n"
