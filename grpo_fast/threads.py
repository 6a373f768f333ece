"""CPU threads for a machine that is not idle: the intra-op thread count and the OpenMP wait policy.

torch's CPU ops (the CPU wheel of torch 2.13, whose bundled OpenMP is GNU libgomp:
``torch/lib/libgomp.so.1``) run each parallel region on an OpenMP team. Between regions libgomp
keeps its worker threads spinning (``GOMP_SPINCOUNT``, by default 300,000 spins, ~3 ms, when
``OMP_WAIT_POLICY`` is unset) — on a machine where another process wants the same cores, both spin
on cores the other needs. libgomp reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when it
loads (``import torch``); ``KMP_BLOCKTIME`` is Intel OpenMP's and libgomp ignores it. Measured
(2-core Xeon, load 13, 2026-12-03, ``bench/contention.py``'s notes): 200 ``[256, 128] @ [128,
256]`` matmuls on 2 threads, each followed by a 1 ms sleep, 8.5–13.3 s wall with the default wait,
0.27–0.49 s with ``OMP_WAIT_POLICY=PASSIVE`` (and the same with ``GOMP_SPINCOUNT=0``; with
``KMP_BLOCKTIME=0`` unchanged from the default).

So:

- the commands (``python -m grpo_fast.X``, ``grpo-fast``) call ``prefer_passive_wait`` before
  torch loads (``grpo_fast/__init__.py``, first thing): ``OMP_WAIT_POLICY=PASSIVE`` unless the
  environment already says how to wait. ``import grpo_fast`` from a user's own script changes
  nothing (set the variable yourself, before ``import torch``);
- ``threads.wait_policy=passive|active`` asks for one whatever the environment: the training
  command then starts itself again with the variable set (``wait_policy_restart``), since a loaded
  libgomp cannot change;
- the intra-op thread count (``choose_threads``): ``threads.intra_op=N``, else the user's
  ``OMP_NUM_THREADS`` (never overwritten), else on a CPU run the cores this process may use, less
  the busy ones (the 1-minute load average), and 1 for a small model (hidden size ≤
  ``SMALL_HIDDEN``: its matmuls are too small for a second thread to pay its wake-up).
"""

from __future__ import annotations

import math
import os
import sys
from dataclasses import dataclass
from pathlib import Path

# What libgomp reads for its wait between parallel regions (at load; KMP_BLOCKTIME: Intel's only).
WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
WAIT_POLICIES = ("auto", "passive", "active")
# The tiny preset's model (hidden 128) and smaller: one intra-op thread.
SMALL_HIDDEN = 256
# Set on the restart of ``wait_policy_restart``: the restarted process never restarts again.
_RESTARTED = "GRPO_FAST_WAIT_RESTARTED"
COMMANDS = ("grpo-fast",)  # console scripts (pyproject.toml); ``python -m``: argv[0] is "-m"
# Whether this process started as a command (``grpo_fast/__init__.py`` sets it, before torch).
started_by_command = False


def started_as_command(argv0: str | None = None) -> bool:
    """Whether this process is a grpo_fast command still importing its package: ``python -m
    grpo_fast.X`` (``sys.argv[0]`` is ``"-m"`` while the module is located: the Python docs' ``-m``)
    or the ``grpo-fast`` console script."""
    argv0 = sys.argv[0] if argv0 is None else argv0
    return argv0 == "-m" or Path(argv0).name in COMMANDS


def prefer_passive_wait(environ: dict | None = None, modules: dict | None = None) -> bool:
    """``OMP_WAIT_POLICY=PASSIVE`` in ``environ`` (``os.environ``) unless it names a wait already
    (``WAIT_ENV``) or torch is in ``modules`` (``sys.modules``: libgomp has read the environment,
    too late). True when set."""
    env = os.environ if environ is None else environ
    if "torch" in (sys.modules if modules is None else modules) or any(k in env for k in WAIT_ENV):
        return False
    env["OMP_WAIT_POLICY"] = "PASSIVE"
    return True


def wait_policy_in_effect(environ: dict | None = None) -> str:
    """libgomp's wait as the environment gave it at load: ``passive`` (``OMP_WAIT_POLICY=PASSIVE``
    or ``GOMP_SPINCOUNT=0``), ``active``, or ``spin`` (neither: libgomp's default, ~3 ms of
    spinning). Read from the environment now, which is the one it loaded with unless code changed
    it since."""
    env = os.environ if environ is None else environ
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy in ("passive", "active"):
        return policy
    if env.get("GOMP_SPINCOUNT", "").strip() == "0":
        return "passive"
    return "spin"


def wait_policy_problem(asked: str, environ: dict | None = None) -> str | None:
    """Why ``threads.wait_policy=asked`` cannot hold in this process (torch loaded with another
    wait: a library call, not the command, which restarts itself), or None."""
    have = wait_policy_in_effect(environ)
    if asked == "auto" or have == asked:
        return None
    return (
        f"threads.wait_policy={asked}, but OpenMP loaded with wait {have}: set "
        f"OMP_WAIT_POLICY={asked.upper()} before importing torch (the grpo-fast command does it)"
    )


def wait_policy_restart(asked: str, argv: list[str] | None = None, environ: dict | None = None):
    """The command line and environment to start this process again with when ``asked``
    (``threads.wait_policy``) is not the wait in effect; None when it is (or ``auto``), or when
    this process is already that restart. ``argv``: ``sys.orig_argv``."""
    env = dict(os.environ if environ is None else environ)
    if asked == "auto" or wait_policy_in_effect(env) == asked or env.get(_RESTARTED):
        return None
    env.pop("GOMP_SPINCOUNT", None)  # OMP_WAIT_POLICY alone decides
    env["OMP_WAIT_POLICY"], env[_RESTARTED] = asked.upper(), "1"
    argv = list(sys.orig_argv if argv is None else argv)
    return [sys.executable, *argv[1:]], env


@dataclass(frozen=True)
class ThreadChoice:
    """The intra-op thread count a run uses and why (the plan line says both)."""

    threads: int
    why: str


def usable_cores() -> int:
    """The cores this process may run on (its affinity mask; a container's cpuset)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # macOS, Windows
        return os.cpu_count() or 1


def load_average() -> float | None:
    """The 1-minute load average, or None where the OS has none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def choose_threads(
    asked,
    device_type: str,
    hidden_size: int | None,
    cores: int,
    load: float | None,
    environ: dict | None = None,
) -> ThreadChoice | None:
    """The intra-op thread count for a run: ``asked`` (``threads.intra_op``: an int, or
    ``"auto"``), then the user's ``OMP_NUM_THREADS``, then for a CPU run ``min(cores free,
    1 if hidden_size <= SMALL_HIDDEN)``, cores free = ``cores - round(load)``, at least 1.
    None: leave torch's own (a GPU run's CPU side, with no ask and no variable).

        >>> choose_threads("auto", "cpu", 128, cores=2, load=0.1, environ={}).threads
        1
        >>> choose_threads("auto", "cpu", 1536, cores=8, load=2.2, environ={}).threads
        6
    """
    env = os.environ if environ is None else environ
    if asked != "auto":
        return ThreadChoice(int(asked), f"threads.intra_op={asked}")
    user = env.get("OMP_NUM_THREADS", "").strip()
    if user.isdigit() and int(user) > 0:
        return ThreadChoice(int(user), f"OMP_NUM_THREADS={user}")
    if device_type != "cpu":
        return None
    free = max(1, cores - (round(load) if load is not None and math.isfinite(load) else 0))
    busy = f", load {load:.1f}" if load is not None else ""
    if hidden_size is not None and hidden_size <= SMALL_HIDDEN:
        return ThreadChoice(1, f"auto: a small model (hidden {hidden_size}), {cores} cores{busy}")
    return ThreadChoice(min(cores, free), f"auto: {cores} cores{busy}")
