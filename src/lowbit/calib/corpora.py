"""Text corpora for calibration and evaluation, and the token windows cut from them.

    load_text(spec) -> str
        "stdlib"     English prose that ships with Python: the pydoc topic help texts
                     (pydoc_data.topics, ~465 kB), every topic in sorted order. Always present,
                     and a different domain than WikiText -- the default calibration text.
        "wikitext2"  the WikiText-2 raw test split at WIKITEXT2_PATH, a path relative to the
                     current directory (../shared/data/wikitext-2-raw/wiki.test.raw: the
                     README's layout, run from the checkout), or at `wikitext2_path` when
                     given; when missing, an error saying to pass a file path instead.
        PATH         any UTF-8 text file.
    No path is derived from where this module lives: an installed wheel has no checkout around it.
    token_windows(tokenizer, text, seq_len, n) -> LongTensor [n, seq_len]
        the first n non-overlapping windows of seq_len tokens of the text (no special tokens added).
"""

from __future__ import annotations

from pathlib import Path

import torch

from lowbit.core.errors import LowbitError

# The README's default: relative to the current directory (the checkout's root, beside ../shared),
# resolved when the text is loaded -- never from this file's location, which in a wheel is site-packages.
WIKITEXT2_PATH = Path("..") / "shared" / "data" / "wikitext-2-raw" / "wiki.test.raw"
NAMED = ("stdlib", "wikitext2")


def stdlib_text() -> str:
    """The pydoc topic texts that ship with CPython, joined in sorted topic order."""
    try:
        from pydoc_data.topics import topics
    except ImportError as e:  # some distro Pythons split pydoc_data out
        raise LowbitError(
            "this Python has no pydoc_data (needed for --calib stdlib); pass a text file path instead"
        ) from e
    return "\n\n".join(topics[k] for k in sorted(topics))


def load_text(spec: str | Path, *, wikitext2_path: str | Path | None = None) -> str:
    """The text named by `spec`: "stdlib", "wikitext2", or the path of a UTF-8 text file.

    wikitext2_path: where "wikitext2" is read from (default WIKITEXT2_PATH, relative to the
    current directory)."""
    s = str(spec)
    if s == "stdlib":
        return stdlib_text()
    if s == "wikitext2":
        wt = Path(WIKITEXT2_PATH if wikitext2_path is None else wikitext2_path)
        if not wt.is_file():
            raise LowbitError(
                f"WikiText-2 is not at {wt} (from {Path.cwd()}); download wiki.test.raw and pass --data PATH"
            )
        return wt.read_text(encoding="utf-8")
    p = Path(s)
    if not p.is_file():
        raise LowbitError(f"corpus {s!r} is neither {' nor '.join(NAMED)} nor an existing text file")
    try:
        return p.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise LowbitError(f"corpus file {p} is not UTF-8 text ({e.reason} at byte {e.start})") from None


def token_windows(tokenizer, text: str, seq_len: int, n: int) -> torch.Tensor:
    """The first n non-overlapping windows of seq_len tokens of `text` -> int64 [n, seq_len].

    Tokenized once as a whole with no special tokens, so windows are contiguous text.
    Raises LowbitError when the text has fewer than n * seq_len tokens.
    """
    if seq_len < 1 or n < 1:
        raise LowbitError(f"token_windows needs seq_len >= 1 and n >= 1, got seq_len={seq_len}, n={n}")
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    need = n * seq_len
    if len(ids) < need:
        raise LowbitError(
            f"corpus has {len(ids)} tokens, fewer than the {n} x {seq_len} = {need} asked; "
            "use fewer/shorter windows or a longer text"
        )
    return torch.tensor(ids[:need], dtype=torch.long).reshape(n, seq_len)
