"""Preemption: SIGTERM (a scheduler's notice) and SIGINT (Ctrl-C) end the run at a step boundary.

``handle_signals()`` wraps a run: the first SIGTERM/SIGINT only sets a flag, the loop finishes the
step it is in, writes a checkpoint (atomically, as every checkpoint) and raises ``Preempted``
(one line saying where; exit code 128 + the signal number). A second signal is not deferred: it
acts as it would have without us (SIGINT raises ``KeyboardInterrupt``, SIGTERM kills).

Data parallel, every rank gets the signal (torchrun forwards it) but not necessarily in the same
step; ``pending`` all-reduces the flag so that every rank stops after the same step.
"""

from __future__ import annotations

import contextlib
import os
import signal
import threading

import torch

from grpo_fast import dist

SIGNALS = (signal.SIGTERM, signal.SIGINT)
_received: list[int] = []  # the signals received since handle_signals() was entered, in order
_previous: dict[int, object] = {}  # the handlers handle_signals() replaced, restored on exit


def _on_signal(signum: int, frame) -> None:
    if _received:  # a second signal: stop deferring, act as the handler before ours
        _restore_previous()
        if signum == signal.SIGINT:
            raise KeyboardInterrupt
        os.kill(os.getpid(), signum)
        return
    _received.append(signum)


def _restore_previous() -> None:
    for signum, handler in _previous.items():
        signal.signal(signum, handler)
    _previous.clear()


@contextlib.contextmanager
def handle_signals():
    """Defer SIGTERM/SIGINT to the next step boundary inside the block (main thread only; a
    no-op elsewhere, where Python cannot install signal handlers)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    _received.clear()
    for signum in SIGNALS:
        _previous[signum] = signal.signal(signum, _on_signal)
    try:
        yield
    finally:
        _restore_previous()
        _received.clear()


def pending(world: dist.DistInfo, device: torch.device) -> int | None:
    """The signal to stop for after this step, or None. Data parallel: one collective per step,
    so that a signal any rank received stops every rank at the same step (a host-device sync)."""
    local = [float(s in _received) for s in SIGNALS]
    counts = dist.all_reduce_sum(local, device) if world.enabled else local
    return next((int(s) for s, n in zip(SIGNALS, counts) if n > 0), None)
