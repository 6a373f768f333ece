"""A command line run in this process: ``grpo_fast.train.main(argv)`` (or another CLI ``main``)
with its stdout and stderr captured, as a ``CompletedProcess``-like result.

Each ``python -m grpo_fast.train`` a test starts imports torch and transformers again (~2.5 s);
a command-line error is ``main``'s work (``errors.cli_errors``: one ``error:`` line, exit code
2), so the tests check it here and keep one real process per console entry point for the exit
path itself (tests/test_cli.py: ``test_unknown_command_is_one_line_exit_2`` for ``grpo-fast``,
``test_dry_run_in_a_fresh_process_loads_no_model`` for ``python -m grpo_fast.train``).

What ``main`` may change in the process is put back after it, whatever it returned or raised:
the environment, the working directory, ``sys.path``, the SIGINT/SIGTERM handlers, torch's
intra-op threads, default dtype, grad mode and deterministic flag, the loggers' levels and
handlers, and transformers' progress bars (``policy.model.quiet_transformers``).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import signal
import sys
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

import torch

from grpo_fast import threads


@dataclass
class Result:
    returncode: int
    stdout: str
    stderr: str


def _loggers() -> dict[str, logging.Logger]:
    named = {n: lg for n, lg in logging.Logger.manager.loggerDict.items() if isinstance(lg, logging.Logger)}
    return {"": logging.getLogger(), **named}


@contextlib.contextmanager
def process_state_kept() -> Iterator[None]:
    """Put back what a run of ``main`` may change in this process (module docstring)."""
    env, cwd, path = dict(os.environ), os.getcwd(), list(sys.path)
    handlers = {s: signal.getsignal(s) for s in (signal.SIGINT, signal.SIGTERM)}
    n_threads, dtype = torch.get_num_threads(), torch.get_default_dtype()
    grad, deterministic = torch.is_grad_enabled(), torch.are_deterministic_algorithms_enabled()
    follower = threads.follower
    loggers = {n: (lg.level, list(lg.handlers), lg.propagate, lg.disabled) for n, lg in _loggers().items()}
    hf_logging = sys.modules.get("transformers.utils.logging")
    bars = hf_logging.is_progress_bar_enabled() if hf_logging is not None else None
    try:
        yield
    finally:
        os.chdir(cwd)
        sys.path[:] = path
        for s, h in handlers.items():
            if h is not None:
                signal.signal(s, h)
        torch.set_num_threads(n_threads)
        torch.set_default_dtype(dtype)
        torch.set_grad_enabled(grad)
        torch.use_deterministic_algorithms(deterministic)
        threads.follower = follower
        for n, lg in _loggers().items():  # a logger first made during the run: an import's, kept
            if n in loggers:
                level, lg.handlers[:], lg.propagate, lg.disabled = loggers[n]
                lg.setLevel(level)  # (clears the loggers' cached levels)
        if bars is not None:
            (hf_logging.enable_progress_bar if bars else hf_logging.disable_progress_bar)()
        for k in set(os.environ) - set(env):  # last: torch's own lazy set-up may write one above
            del os.environ[k]
        os.environ.update(env)


def run_main(argv: Sequence[str], main: Callable[[list[str]], int] | None = None) -> Result:
    """``main(argv)`` (default ``grpo_fast.train.main``), stdout and stderr captured; an argparse
    exit (``SystemExit``) is its code, as the process's would be."""
    if main is None:
        from grpo_fast.train import main
    out, err = io.StringIO(), io.StringIO()
    with process_state_kept(), contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            code = main(list(argv))
        except SystemExit as exc:
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
    return Result(int(code or 0), out.getvalue(), err.getvalue())


def one_error_line(res: Result) -> str:
    """The result's one ``error: ...`` line: exit code 2, nothing else on stderr, no traceback."""
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]
