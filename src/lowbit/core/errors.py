"""The one error type users see: a one-line message that says what was wrong and what to do."""


class LowbitError(Exception):
    """Bad input or an unmet precondition. The CLI prints `error: <message>` and exits 2."""
