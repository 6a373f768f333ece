"""Preemption: SIGTERM (a scheduler's notice) and SIGINT (Ctrl-C) stop the run within seconds, in
whatever phase it is, leaving what can be resumed.

``handle_signals()`` wraps a run: the first SIGTERM/SIGINT only records the signal. Each phase
notices it at the end of its current unit of work and stops there:

- the SFT warm start after its current step (``pending``, every rank), saving its progress;
- a rollout or an evaluation after its current generate chunk (``check_unit`` raises
  ``Interrupt``; one process only: data parallel, a rank that stopped alone would leave the
  others waiting in a collective, so there they run to the step's end);
- the optimization phase and a checkpoint write run to the step's end, where ``pending``
  all-reduces the flag so that every rank stops after the same step.

A reward function is not a unit that ends by itself: a user's may hang (an endless loop, a
sleep, a call that never returns). Inside ``rewards_abandonable()`` (the rollout's scoring and
the evaluations, one process), the first signal stops the reward call it lands in at once: the
handler raises ``Interrupt`` there (through a ``BaseException`` the reward's own ``except
Exception`` cannot swallow), and the phase stops as at a unit's end. Code that never returns to
the interpreter (a C extension holding the GIL) is out of any signal handler's reach; so is code
that catches ``BaseException`` and carries on: the second signal is then the way out. A user's
tool environment runs on a worker thread the rollout waits for (``grpo_fast.env.guarded``): the
first signal ends that wait (``_tools_stopping``), and the chunk ends with its calls failed.

What each phase writes then (``grpo_fast.loop.checkpointing``) ends in ``Preempted``: one line
saying what was written, exit code 128 + the signal number. A second signal does not wait: it
prints one line and exits at once with the same code (``os._exit``: no traceback, no cleanup; a
checkpoint being written is left as a ``.tmp`` folder, which is never read). The line says what
``resume=true`` will find, checked first (``run_folder.resume_summary``): the latest checkpoint
whole, or what is wrong with it, or that there is none.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from pathlib import Path

import torch

from grpo_fast import dist
from grpo_fast.env import guarded
from grpo_fast.obs import run_folder
from grpo_fast.task.rewards import GuardedReward

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # the signals received since handle_signals() was entered, in order
_previous: dict[int, object] = {}  # the handlers handle_signals() replaced, restored on exit
# check_unit raises; the run folder, for the second signal's line; how many rewards_abandonable()
# blocks are open (a reward call inside one is stopped by the first signal)
_units: dict = {"interruptible": False, "where": None, "abandonable": 0}
_units_lock = threading.Lock()
# The frames of a reward call: a signal whose frame has one of these below it landed in a reward
# function (GuardedReward.score calls the user's function; a WeightedReward calls it per part).
_REWARD_CODE = frozenset({GuardedReward.score.__code__})


class Interrupt(Exception):
    """A signal arrived and the current unit of work (a generate chunk, a reward call) has
    ended or been abandoned: the phase stops here, and the caller writes what can be resumed."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


class _RewardAbandoned(BaseException):
    """Raised by the signal handler inside a reward function: a ``BaseException``, so that the
    reward's own ``except Exception`` (and ``GuardedReward``'s) lets it through;
    ``rewards_abandonable`` turns it into ``Interrupt``."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _on_signal(signum: int, frame) -> None:
    if _received:  # a second signal: stop now, with one line
        out = _units["where"]
        kept = run_folder.resume_summary(out) if out is not None else "nothing more was written"
        line = f"error: second {signal.Signals(signum).name}: stopped at once; {kept}\n"
        if os.isatty(2):
            line = "\x1b[?25h" + line  # a progress bar hides the cursor: show it again
        os.write(2, line.encode())
        os._exit(128 + signum)
    _received.append(signum)
    if _units["abandonable"] and _units["interruptible"] and _in_reward(frame):
        raise _RewardAbandoned(signum)  # out of the reward function, wherever it hangs


def _in_reward(frame) -> bool:
    """Whether ``frame`` (the one the signal interrupted) is inside a reward call."""
    while frame is not None:
        if frame.f_code in _REWARD_CODE:
            return True
        frame = frame.f_back
    return False


@contextlib.contextmanager
def rewards_abandonable():
    """The block's reward calls (``GuardedReward``) may be abandoned: the first signal that lands
    inside one raises ``Interrupt`` at once instead of waiting for the call to return (a user's
    reward that hangs). For a block whose caller stops on ``Interrupt`` (``stop_within``, an
    evaluation's), one process only (``handle_signals(interruptible_units=True)``); elsewhere
    the signal waits for the unit's end as before."""
    with _units_lock:  # the pipeline's producer thread opens such blocks beside the trainer's
        _units["abandonable"] += 1
    try:
        yield
    except _RewardAbandoned as stop:
        raise Interrupt(stop.signum) from None
    finally:
        with _units_lock:
            _units["abandonable"] -= 1


def _restore_previous() -> None:
    for signum, handler in _previous.items():
        signal.signal(signum, handler)
    _previous.clear()


@contextlib.contextmanager
def handle_signals(out: Path | None = None, interruptible_units: bool = True):
    """Record SIGTERM/SIGINT inside the block for the phases to stop on (main thread only; a
    no-op elsewhere, where Python cannot install signal handlers). ``out``: the run folder,
    named by the second signal's line; ``interruptible_units``: whether ``check_unit`` may stop
    a rollout or an evaluation mid-way (False data parallel)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    _units.update(interruptible=interruptible_units, where=Path(out) if out else None)
    for signum in SIGNALS:
        _previous[signum] = signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        _restore_previous()
        _received.clear()
        _units.update(interruptible=False, where=None)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


def check_unit() -> None:
    """At the end of a unit of work that may be abandoned (a generate chunk of a rollout or an
    evaluation): ``Interrupt`` when a signal has arrived and units are interruptible."""
    if _received and _units["interruptible"]:
        raise Interrupt(_received[0])


def _tools_stopping() -> str | None:
    """The signal a wait on a user's tool call ends for (units interruptible), or None."""
    return signal_name(_received[0]) if _received and _units["interruptible"] else None


guarded.stop_waiting_when(_tools_stopping)


def unit_callback(progress):
    """``progress`` (a per-chunk callback, or None) followed by ``check_unit``: what the loop
    hands to a rollout or an evaluation."""

    def advance(n: int = 1) -> None:
        if progress is not None:
            progress(n)
        check_unit()

    return advance


def pending(world: dist.DistInfo, device: torch.device) -> int | None:
    """The signal to stop for after this step, or None. Data parallel: one collective per step,
    so that a signal any rank received stops every rank at the same step (a host-device sync)."""
    local = [float(s in _received) for s in SIGNALS]
    counts = dist.all_reduce_sum(local, device) if world.enabled else local
    return next((int(s) for s, n in zip(SIGNALS, counts) if n > 0), None)
