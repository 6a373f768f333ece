"""Errors a user can fix: bad config, bad data, wrong machine.

Command-line entry points catch ``UserError`` and print its message as one line on stderr,
exit with code 2 and show no traceback. The message names the key, file (and line) or shape
at fault. Anything else is a bug and keeps its traceback.
"""

from __future__ import annotations

import atexit
import os
import sys
from collections.abc import Callable
from functools import wraps


class UserError(Exception):
    """A problem in what the user gave us; the message is the whole story."""

    exit_code = 2


class ConfigError(UserError):
    """A bad config key or value (the message names the key)."""


class DataError(UserError):
    """A bad data file (the message names the file, and the line when there is one)."""


class CheckpointError(UserError):
    """A checkpoint that cannot be read, is refused as unsafe, or cannot be written (names the file)."""


class TrainingStopped(UserError):
    """The run cannot go on as it is (e.g. non-finite steps in a row, a reward function that
    fails); the message says why and which checkpoint is intact."""


class RewardError(UserError):
    """A reward function raised or returned a non-number (names the function and the response)."""


class EngineError(UserError):
    """A rollout engine apart from the trainer (a worker process, a server) cannot go on: it died,
    or a wait for it (its start, a rollout, a weight sync) ran past its timeout. The message is
    one line naming what failed and what was waited for; the loop writes a resumable checkpoint
    of the last finished step before it stops (``grpo_fast.loop.pipeline``)."""


class EngineDied(EngineError):
    """The engine's process is gone (exited, killed)."""


class EngineTimeout(EngineError):
    """A wait had no answer within its timeout (``rollout.start_timeout``, ``request_timeout``,
    ``sync_timeout``): the message names what was waited for and for how long."""


class Preempted(UserError):
    """SIGTERM/SIGINT: a checkpoint of the last finished step was written (the message says
    where); exit code 128 + the signal number, as a shell reports a process killed by it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


def cli_errors(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a CLI ``main``: a ``UserError`` becomes ``error: <message>`` on stderr and its
    ``exit_code`` (2; ``Preempted``: 128 + the signal number); a Ctrl-C that reaches it, one
    line and 130 (no traceback)."""

    @wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UserError as exc:
            msg = " ".join(str(exc).split())  # one line, whatever the message held
            print(f"error: {msg}", file=sys.stderr)
            return exc.exit_code
        except KeyboardInterrupt:  # Ctrl-C where no phase handles it (loading, a tool's work)
            print("error: interrupted (SIGINT): nothing more was done", file=sys.stderr)
            return 128 + 2

    return wrapper


def cwd_on_path() -> None:
    """Put the working directory first on ``sys.path``, as ``python -m`` does, for a console
    script (``grpo-fast``), whose ``sys.path[0]`` is the script's own folder: a user's module in
    the working directory (``data.reward=my_rewards:exact``) then imports under either command.
    Not under ``python -P`` / ``PYTHONSAFEPATH``, which ask for no such entry."""
    if sys.flags.safe_path:
        return
    try:
        cwd = os.getcwd()
    except OSError:  # the working directory was deleted: nothing there to import
        return
    if cwd not in sys.path:
        sys.path.insert(0, cwd)


def exit_process(code: int | None):
    """End the process with ``code``: what a command's ``__main__`` and console script call.

    A run stopped by a signal (``code > 128``) runs the atexit handlers (vLLM's engine shutdown,
    ``weakref.finalize`` clean-ups such as the adapter folder in /dev/shm, wandb's finish) and then
    skips the interpreter's own teardown (``os._exit`` after flushing): freeing torch's, Triton's
    and transformers' modules took 2.5 s of CPU, 16 s wall on 2 cores at load 9, time a
    scheduler's grace period does not have. Everything the run keeps is on disk by then
    (checkpoints are written atomically, ``metrics.jsonl`` and ``sft_metrics.jsonl`` a closed
    line at a time).
    """
    code = int(code or 0)
    if code <= 128:
        sys.exit(code)
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
