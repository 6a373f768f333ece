"""Errors a user can fix: bad config, bad data, wrong machine.

Command-line entry points catch ``UserError`` and print its message as one line on stderr,
exit with code 2 and show no traceback. The message names the key, file (and line) or shape
at fault. Anything else is a bug and keeps its traceback.

A value the user gave is echoed shortened (``shown``; ``one_line`` cuts whatever a message still
holds of it), so a 10 kB value does not become a 10 kB line. Under torchrun local rank 0 alone
prints the line; every rank hands it to torchrun's failure summary (``cli_errors``).
"""

from __future__ import annotations

import atexit
import json
import os
import signal
import sys
import time
from collections.abc import Callable
from functools import wraps
from pathlib import Path


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


class ToolError(UserError):
    """A user's tool environment broke its contract during the run: its ``new_state``, ``parse``
    or ``execute`` raised or returned something else, or too many of its calls are still running
    past ``rollout.tool_timeout_s`` (names the module, the method and what it raised or returned)."""


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


class WeightSyncError(UserError):
    """An engine serves other weights than the ones it was given: its probe after a weight load
    disagrees (vLLM: the probe's log-probs against the trainer's; an hf worker: the digest of its
    parameters against the staged tensors'). Not an ``EngineError``: the engine answers, so the
    run stops where the sync was asked (a fleet takes the engine out of service instead)."""


class Preempted(UserError):
    """SIGTERM/SIGINT: a checkpoint of the last finished step was written (the message says
    where); exit code 128 + the signal number, as a shell reports a process killed by it."""

    def __init__(self, message: str, signum: int):
        super().__init__(message)
        self.exit_code = 128 + signum


SHOWN_WIDTH = 80  # characters of a value echoed in a message (``shown``)
LONG_WORD = 200  # a run of non-blank characters longer than this in a message is cut (``one_line``)
LONG_LINE = 2000  # and a message longer than this loses its middle


def shown(value: object, width: int = SHOWN_WIDTH) -> str:
    """``repr(value)`` for a message, cut past ``width`` characters with an ellipsis and the
    length (a value the user gave can be megabytes).

    Example:
        >>> shown("a" * 10_000)
        "'aaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaaa'… (10,000 characters)"
        >>> shown([1, 2])
        '[1, 2]'
    """
    if isinstance(value, str):
        return repr(value) if len(value) <= width else f"{value[: width - 10]!r}… ({len(value):,} characters)"
    try:
        text = repr(value)
    except Exception:  # a user's object whose __repr__ raises
        text = f"<a {type(value).__name__}>"
    return text if len(text) <= width else f"{text[:width]}… ({len(text):,} characters)"


def one_line(message: str) -> str:
    """``message`` as one line of bounded length: blanks collapsed, each run of non-blank
    characters past ``LONG_WORD`` cut to ``SHOWN_WIDTH`` with its length (a value echoed whole by
    a check that did not shorten it), the middle of a line past ``LONG_LINE`` left out."""
    words = [
        w if len(w) <= LONG_WORD else f"{w[:SHOWN_WIDTH]}… ({len(w):,} characters)"
        for w in str(message).split()
    ]
    line = " ".join(words)
    if len(line) > LONG_LINE:
        head, tail = LONG_LINE * 3 // 4, LONG_LINE // 5
        line = f"{line[:head]} … ({len(line) - head - tail:,} characters left out) … {line[-tail:]}"
    return line


def _rank() -> int | None:
    """This process's rank under a launcher that started several (torchrun: ``RANK`` and
    ``WORLD_SIZE`` in the environment), or None in a world of one."""
    try:
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            return int(os.environ["RANK"])
    except (KeyError, ValueError):
        pass
    return None


DEFER_S = 5.0  # how long a failed worker under torchrun waits for the others on its node to fail too


def _torchrun_error_files() -> tuple[int, Path, list[Path]] | None:
    """``(local rank, this worker's error file, those of the other workers on this node)`` under
    torchrun, or None. The one reach-in into torchrun's layout (torch 2.13,
    ``torch/distributed/elastic/multiprocessing/api.py``): each worker's ``TORCHELASTIC_ERROR_FILE``
    is ``<log dir>/attempt_<n>/<local rank>/error.json``, ``LOCAL_WORLD_SIZE`` workers a node."""
    path = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if not path or _rank() is None:
        return None
    try:
        local, workers = int(os.environ["LOCAL_RANK"]), int(os.environ["LOCAL_WORLD_SIZE"])
    except (KeyError, ValueError):
        return None
    own = Path(path)
    return local, own, [own.parent.parent / str(i) / own.name for i in range(workers) if i != local]


def _hand_to_torchrun(path: Path, line: str) -> bool:
    """Write ``line`` to this worker's error file in the format of torch's
    ``ErrorHandler.record_exception``: torchrun's failure summary then shows it for this rank
    instead of a link to its docs. Whether it was written."""
    data = {
        "message": {"message": line, "extraInfo": {"py_callstack": line, "timestamp": str(int(time.time()))}}
    }
    try:
        path.write_text(json.dumps(data))
    except OSError:
        return False
    return True


def _handed(path: Path) -> str | None:
    """The line another worker handed to torchrun (``_hand_to_torchrun``), or None (none yet)."""
    try:
        return json.loads(path.read_text())["message"]["message"]
    except (OSError, ValueError, KeyError, TypeError):
        return None


def _report(line: str) -> None:
    """``line`` on stderr, once per run (once per node under torchrun).

    Under torchrun every worker hands its line to torchrun's failure summary, and local rank 0
    prints it. A failure the config or the launch makes happens on every rank alike, at about
    the same time; torchrun stops the other workers (SIGTERM) as soon as one exits non-zero, so
    each worker waits, up to ``DEFER_S`` and with SIGTERM ignored, until the others on its node
    have handed theirs over: no worker is then stopped before its line is out, and each exits with
    its own code. A worker other than local rank 0 prints its line when rank 0's differs or did not
    come (a failure of its own must not go unsaid)."""
    files = _torchrun_error_files()
    if files is None:
        print(line, file=sys.stderr)
        return
    local, own, others = files
    handed = _hand_to_torchrun(own, line)
    if local == 0 or not handed:
        print(line, file=sys.stderr, flush=True)
        if not handed:
            return
    previous = _ignore_sigterm()
    deadline = time.monotonic() + DEFER_S
    try:
        while any(_handed(p) is None for p in others) and time.monotonic() < deadline:
            time.sleep(0.01)
    except KeyboardInterrupt:  # Ctrl-C: wait no longer
        pass
    if previous is not None:
        signal.signal(signal.SIGTERM, previous)
    if local != 0 and _handed(own.parent.parent / "0" / own.name) != line:
        print(line, file=sys.stderr)


def _ignore_sigterm():
    """Ignore SIGTERM (torchrun's stop) from now on; the handler it had, or None (not the main thread)."""
    try:
        return signal.signal(signal.SIGTERM, signal.SIG_IGN)
    except ValueError:
        return None


def cli_errors(main: Callable[..., int | None]) -> Callable[..., int]:
    """Decorate a CLI ``main``: a ``UserError`` becomes ``error: <message>`` on stderr (one line,
    ``one_line``) and its ``exit_code`` (2; ``Preempted``: 128 + the signal number); a Ctrl-C that
    reaches it, one line and 130 (no traceback). Under torchrun the line is printed by local rank 0
    alone (``_report``); every rank exits with its code."""

    @wraps(main)
    def wrapper(*args, **kwargs) -> int:
        try:
            return main(*args, **kwargs) or 0
        except UserError as exc:
            _report(f"error: {one_line(str(exc))}")
            return exc.exit_code
        except KeyboardInterrupt:  # Ctrl-C where no phase handles it (loading, a tool's work)
            _report("error: interrupted (SIGINT): nothing more was done")
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

    A failed worker under torchrun (``_rank``) ends the same way: torchrun stops the other workers
    (SIGTERM) at its next look at them after one exited non-zero (every 0.1 s), and a worker still
    tearing down its interpreter then is reported killed by SIGTERM instead of by its own exit code.
    """
    code = int(code or 0)
    if code <= 128 and not (code and _rank() is not None):
        sys.exit(code)
    if code <= 128:  # a failed worker: torchrun's stop would now only hide its exit code
        _ignore_sigterm()
    atexit._run_exitfuncs()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
