"""Errors a user can fix: bad config, bad data, wrong machine.

Command-line entry points catch ``UserError`` and print its message as one line on stderr,
exit with code 2 and show no traceback. The message names the key, file (and line) or shape
at fault. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from functools import wraps


class UserError(Exception):
    """A problem in what the user gave us; the message is the whole story."""


class ConfigError(UserError):
    """A bad config key or value (the message names the key)."""


class DataError(UserError):
    """A bad data file (the message names the file, and the line when there is one)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read, is refused as unsafe, or cannot be written (names the file)."""


def cli_errors(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a CLI ``main``: a ``UserError`` becomes ``error: <message>`` on stderr and exit 2."""

    @wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UserError as exc:
            msg = " ".join(str(exc).split())  # one line, whatever the message held
            print(f"error: {msg}", file=sys.stderr)
            return 2

    return wrapper
