"""`lowbit serve` without the `serve` extra: one line naming the install, no traceback, no model load."""

from __future__ import annotations

import sys

import pytest


@pytest.mark.parametrize("absent", [("fastapi",), ("uvicorn",), ("fastapi", "uvicorn")])
def test_serve_without_the_extra_is_one_line(monkeypatch, capsys, absent):
    from lowbit.cli import main
    from lowbit.serve import loader as runtime

    for name in absent:
        monkeypatch.setitem(sys.modules, name, None)  # `import name` now raises ModuleNotFoundError

    def no_load(*a, **k):
        raise AssertionError("the model must not load before the missing extra is reported")

    monkeypatch.setattr(runtime, "load_runtime", no_load)
    rc = main(["serve", "--model", "smollm2-135m", "--port", "0"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2
    assert len(err) == 1, err
    assert err[0].startswith("error: `lowbit serve` needs ")
    assert "pip install 'lowbit[serve]'" in err[0]
    for name in ("fastapi", "uvicorn"):
        assert (name in err[0]) == (name in absent)


def test_serve_extra_present_passes():
    from lowbit.commands.serve import require_serve_extra

    pytest.importorskip("fastapi")
    pytest.importorskip("uvicorn")
    require_serve_extra()  # no error when both are importable
