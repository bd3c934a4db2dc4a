"""One progress bar for long jobs (GPTQ / SignRound layers, calibration sequences, rotation fits).

A tqdm bar on stderr with elapsed time and ETA, as `lowbit eval` shows. enabled=False (or a stderr
that is not a terminal: logs, CI) gives a no-op bar, and callers then keep their one line per step.
"""

from __future__ import annotations

import sys


class NoBar:
    enabled = False

    def update(self, n: int = 1) -> None:
        pass

    def set_postfix_str(self, s: str) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def bar(total: int, desc: str, unit: str, enabled: bool | None = None):
    """A tqdm bar of `total` steps; enabled None: only when stderr is a terminal."""
    if enabled is None:
        enabled = sys.stderr.isatty()
    if not enabled or total <= 0:
        return NoBar()
    from tqdm.auto import tqdm

    b = tqdm(total=total, desc=desc, unit=unit, leave=True, file=sys.stderr, dynamic_ncols=True)  # the last state stays
    b.enabled = True
    return b
