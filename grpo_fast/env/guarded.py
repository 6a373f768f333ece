"""A user's tool environment as a rollout calls it: bounded in time, what it returns checked.

A built-in environment (``python``, ``calculator``) is ours: its calls end by themselves (the
sandbox's wall clock, the calculator's bounds) and return what ``base`` says. A user's module is
not, so the rollout wraps it in ``GuardedEnvironment`` (``grpo_fast.rollout.multi_turn.from_config``):

- **Bounded.** Each call into it (``new_state``, ``parse``, ``execute``, ``close``) runs on a
  worker thread and the rollout waits at most ``timeout_s`` (``rollout.tool_timeout_s``) for it.
  An ``execute`` past it is a failed call for every request of its batch (``ok=False``, status
  ``timeout``, the text ``[timed out after 10 s]``): a tool error, counted
  (``rollout/tool_error_fraction``) and penalized (``data.tool_error_penalty``) as one. A
  ``parse`` or ``new_state`` past it stops the run (``ToolError``): those are the module's own
  code on text, not a tool's work. Python cannot stop a thread: the call is abandoned, its daemon
  thread left running until the call returns (its result dropped) or the process ends, and the
  next call gets a fresh worker. While more than ``MAX_ABANDONED`` abandoned calls still run, the
  run stops (``ToolError``): a thread that spins holds the trainer's interpreter lock, and an
  abandoned call may still change what the environment shares (a response's ``state``).
- **Stoppable.** The wait looks every ``POLL_S`` at the checks ``stop_waiting_when`` registered
  (``grpo_fast.loop.preempt``: a SIGTERM/SIGINT has arrived and the phase may stop mid-way). A
  call it is waiting for is then abandoned at once and later calls are not made: ``execute``
  gives a failed call per request (status ``interrupted``), ``parse`` gives None (the turn asks
  nothing). The generate chunk then ends at the speed of generation, and the phase stops at its
  end as after any chunk, writing its checkpoint. Where the phase may not stop mid-way (under
  torchrun every rank runs to the step's end) no check answers, and each call waits at most
  ``timeout_s``.
- **What it costs.** A call handed to the worker and waited for took ≈ 75 µs here (2 cores, load
  1, 2026-12-06; 0.4 µs called directly): ≈ 60 ms a step of 256 responses of two turns (a
  ``new_state`` per response, a ``parse`` per turn, an ``execute`` per batch).
- **Checked.** ``execute`` must return one ``ToolResult`` per call with fields of the types
  ``base`` gives them, ``parse`` a ``ToolCall`` or None; anything else, or an exception, is a
  ``ToolError``: one line naming the module, the method and what it returned or raised (and
  where, for an exception), no traceback. ``check_built`` checks what a module's ``build``
  returned: an ``Environment`` whose stop strings are non-empty strings.

Example (a module whose ``execute`` hangs):
    >>> env = GuardedEnvironment(hanging_env, "my_tools", timeout_s=0.5)  # doctest: +SKIP
    >>> env.execute([(None, ToolCall("x"))], OutputLimit())[0][:3]  # doctest: +SKIP
    ('[timed out after 0.5 s]', False, 'timeout')
"""

from __future__ import annotations

import logging
import math
import os
import queue
import sysconfig
import threading
import time
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path

from grpo_fast.env.base import Environment, OutputLimit, ToolCall, ToolResult
from grpo_fast.errors import ConfigError, ToolError, shown

__all__ = ["MAX_ABANDONED", "POLL_S", "GuardedEnvironment", "check_built", "stop_waiting_when", "what_raised"]

POLL_S = 0.1  # how often a wait on a user's call looks at the stop checks
MAX_ABANDONED = 8  # abandoned calls still running past which the run stops

log = logging.getLogger("grpo_fast")
_stop_checks: list[Callable[[], str | None]] = []


def stop_waiting_when(check: Callable[[], str | None]) -> None:
    """Have every wait on a user's call end once ``check()`` gives a reason (e.g. ``"SIGTERM"``)
    instead of None; registered once (``grpo_fast.loop.preempt`` does, at import)."""
    if check not in _stop_checks:
        _stop_checks.append(check)


def _stopping() -> str | None:
    for check in _stop_checks:
        why = check()
        if why is not None:
            return why
    return None


# where a traceback's frames are not the user's: the standard library, installed packages, grpo_fast
_LIBRARIES = tuple(
    os.path.join(path, "")
    for path in {
        *(sysconfig.get_paths()[k] for k in ("stdlib", "platstdlib", "purelib", "platlib")),
        str(Path(__file__).parents[1]),
    }
)


def what_raised(exc: BaseException) -> str:
    """``ValueError: 'boom' (at my_tools.py:12)``: what a user's call raised and where (the
    innermost frame of the user's own code, else the innermost one)."""
    where = ""
    frames = traceback.extract_tb(exc.__traceback__)
    frames = [f for f in frames if not f.filename.startswith(_LIBRARIES)] or frames
    if frames:
        where = f" (at {Path(frames[-1].filename).name}:{frames[-1].lineno})"
    try:
        text = str(exc)
    except Exception:  # an exception whose __str__ raises
        text = ""
    return f"{type(exc).__name__}{': ' + shown(text) if text else ''}{where}"


class _Call:
    """One call into the user's module, run by a worker; ``done`` set when it returned or raised."""

    def __init__(self, fn: Callable, args: tuple):
        self.fn, self.args = fn, args
        self.done = threading.Event()
        self.value: object = None
        self.error: BaseException | None = None

    def run(self) -> None:
        try:
            self.value = self.fn(*self.args)
        except BaseException as exc:  # the user's code: whatever it raises goes to the waiter
            self.error = exc
        finally:
            self.done.set()


class _Worker:
    """A daemon thread that runs calls one at a time until it is handed None (after the call it
    is running, when it was abandoned)."""

    def __init__(self, name: str):
        self.calls: queue.SimpleQueue[_Call | None] = queue.SimpleQueue()
        self.thread = threading.Thread(target=self._loop, name=name, daemon=True)
        self.thread.start()

    def _loop(self) -> None:
        while (call := self.calls.get()) is not None:
            call.run()


def check_built(env: object, module: str) -> Environment:
    """``env``, what the module ``module``'s ``build`` returned, if it is an ``Environment`` whose
    ``stop_strings`` are a non-empty tuple (or list) of non-empty strings.

    Raises:
        ConfigError: anything else (one line naming the module and what it returned).
    """
    what = f"tool environment {module!r}"
    if not isinstance(env, Environment):
        raise ConfigError(
            f"{what}: its build returned {shown(env)}, not an Environment (a subclass of grpo_fast.env.Environment)"
        )
    try:
        stops = env.stop_strings
    except Exception as exc:  # a property of the user's
        raise ConfigError(f"{what}: reading its stop_strings raised {what_raised(exc)}") from None
    if (
        isinstance(stops, str)
        or not isinstance(stops, (tuple, list))
        or not all(isinstance(s, str) for s in stops)
    ):
        raise ConfigError(
            f"{what}: stop_strings={shown(stops)} must be a tuple of strings (what ends a turn)"
        )
    if not stops:
        raise ConfigError(f"{what}: its stop_strings are empty, so no turn would ever call it")
    if "" in stops:
        raise ConfigError(
            f"{what}: stop_strings={shown(stops)} holds an empty string, which would end every turn"
        )
    return env


class GuardedEnvironment(Environment):
    """A user's environment ``env`` (the module ``module``, ``check_built`` passed) with each call
    bounded by ``timeout_s`` and stoppable, and what it returns checked (module docstring).

    Attributes:
        abandoned: calls abandoned so far (past ``timeout_s``, or at a stop).
    """

    def __init__(self, env: Environment, module: str, timeout_s: float):
        self.env, self.name, self.timeout_s = env, module, float(timeout_s)
        self.stop_strings = tuple(env.stop_strings)
        self.abandoned = 0
        self._warned = False  # the first timeout's warning was printed
        self._worker: _Worker | None = None
        self._running: list[_Worker] = []  # the workers of abandoned calls (alive while those run)

    def _run(self, method: str, *args) -> tuple[str, object]:
        """``("ok", value)``, ``("timeout", None)`` or ``("stopped", reason)`` of ``env.method(*args)``
        on the worker; ``ToolError`` when it raised."""
        why = _stopping()
        if why is not None:
            return "stopped", why
        self._running = [w for w in self._running if w.thread.is_alive()]
        if len(self._running) >= MAX_ABANDONED:
            raise ToolError(
                f"tool environment {self.name!r}: {len(self._running)} of its calls ran past "
                f"rollout.tool_timeout_s={self.timeout_s:g} s and are still running (a thread each, which "
                "Python cannot stop): fix the environment, or raise rollout.tool_timeout_s"
            )
        if self._worker is None:
            self._worker = _Worker(f"grpo_fast tool {self.name}")
        call = _Call(getattr(self.env, method), args)
        self._worker.calls.put(call)
        deadline = time.monotonic() + self.timeout_s
        while not call.done.wait(max(min(POLL_S, deadline - time.monotonic()), 0.0)):
            why = _stopping()
            if why is not None or time.monotonic() >= deadline:
                self._abandon()
                return ("stopped", why) if why is not None else ("timeout", None)
        if call.error is not None:
            raise ToolError(f"tool environment {self.name!r}: its {method} raised {what_raised(call.error)}")
        return "ok", call.value

    def _abandon(self) -> None:
        """Leave the worker to its call: it ends after it (handed None); the next call gets a new one."""
        self._worker.calls.put(None)
        self._running.append(self._worker)
        self._worker = None
        self.abandoned += 1

    def _late(self, method: str, turn_text: str | None = None) -> ToolError:
        on = f" (on a turn of {len(turn_text):,} characters)" if turn_text is not None else ""
        return ToolError(
            f"tool environment {self.name!r}: its {method} did not return within "
            f"rollout.tool_timeout_s={self.timeout_s:g} s{on}"
        )

    def new_state(self) -> object:
        outcome, value = self._run("new_state")
        if outcome == "timeout":
            raise self._late("new_state")
        return value if outcome == "ok" else None

    def parse(self, turn_text: str) -> ToolCall | None:
        outcome, value = self._run("parse", turn_text)
        if outcome == "timeout":
            raise self._late("parse", turn_text)
        if outcome == "stopped" or value is None:
            return None
        what = f"tool environment {self.name!r}: its parse returned"
        if not isinstance(value, ToolCall):
            raise ToolError(f"{what} {shown(value)}, not a ToolCall or None")
        if not isinstance(value.request, str):
            raise ToolError(f"{what} a ToolCall whose request is {shown(value.request)}, not a str")
        if value.stop is not None and not isinstance(value.stop, str):
            raise ToolError(f"{what} a ToolCall whose stop is {shown(value.stop)}, not a str or None")
        return value

    def execute(self, calls: Sequence[tuple[object, ToolCall]], limit: OutputLimit) -> list[ToolResult]:
        t0 = time.perf_counter()
        outcome, value = self._run("execute", calls, limit)
        if outcome == "ok":
            return self._checked(value, len(calls))
        seconds = time.perf_counter() - t0
        if outcome == "timeout":
            if not self._warned:  # once: the metrics count the rest
                self._warned = True
                log.warning(
                    "tool environment %r: a batch of %d calls ran past rollout.tool_timeout_s=%g s; each is a "
                    "failed call (status timeout), its thread left running",
                    self.name,
                    len(calls),
                    self.timeout_s,
                )
            text, status = f"[timed out after {self.timeout_s:g} s]", "timeout"
        else:
            text, status = f"[not run: the run is stopping ({value})]", "interrupted"
        return [ToolResult(text, False, status, False, seconds) for _ in calls]

    def _checked(self, results: object, n: int) -> list[ToolResult]:
        what = f"tool environment {self.name!r}: its execute"
        if not isinstance(results, (list, tuple)):
            raise ToolError(f"{what} returned {shown(results)}, not a list of ToolResult (one per call)")
        if len(results) != n:
            raise ToolError(
                f"{what} returned {len(results)} results for {n} call{'s' * (n != 1)} (one ToolResult per "
                "call, in order)"
            )
        for i, result in enumerate(results):
            problem = _result_problem(result)
            if problem is not None:
                raise ToolError(f"{what}'s result {i} of {n} is {problem}")
        return list(results)

    def close(self) -> None:
        outcome, _ = self._run("close")  # past the timeout: left running, as any abandoned call
        if outcome == "ok" and self._worker is not None:
            self._worker.calls.put(None)
            self._worker = None


# ToolResult's fields but seconds, with the type each must have (base.ToolResult)
_FIELDS = (
    ("text", str, "a str (the text that goes back)"),
    ("ok", bool, "a bool"),
    ("status", str, "a str"),
    ("truncated", bool, "a bool"),
)


def _result_problem(result: object) -> str | None:
    """What is wrong with one result of ``execute`` (in words), or None."""
    if not isinstance(result, ToolResult):
        return f"{shown(result)}, not a ToolResult"
    for name, kind, what in _FIELDS:
        value = getattr(result, name)
        if not isinstance(value, kind):
            return f"a ToolResult whose {name} is {shown(value)}, not {what}"
    s = result.seconds
    if isinstance(s, bool) or not isinstance(s, (int, float)) or not math.isfinite(s) or s < 0:
        return f"a ToolResult whose seconds is {shown(s)}, not a number of seconds >= 0"
    return None
