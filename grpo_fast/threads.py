"""CPU threads for a machine that is not idle: the intra-op thread count and the OpenMP wait policy.

torch's CPU ops (the CPU wheel of torch 2.13, whose bundled OpenMP is GNU libgomp:
``torch/lib/libgomp.so.1``) run each parallel region on an OpenMP team. Between regions libgomp
keeps its worker threads spinning (``GOMP_SPINCOUNT``, by default 300,000 spins — ~3 ms by
libgomp's own account, longer where a spin is slow: ≥ 7.5 ms on a 2-core AMD EPYC — when
``OMP_WAIT_POLICY`` is unset) — on a machine where another process wants the same cores, both spin
on cores the other needs. libgomp reads ``OMP_WAIT_POLICY`` / ``GOMP_SPINCOUNT`` once, when it
loads (``import torch``); ``KMP_BLOCKTIME`` is Intel OpenMP's and libgomp ignores it. Measured
(2-core Xeon, load 13, 2026-12-03, ``bench/contention.py``'s notes): 200 ``[256, 128] @ [128,
256]`` matmuls on 2 threads, each followed by a 1 ms sleep, 8.5–13.3 s wall with the default wait,
0.27–0.49 s with ``OMP_WAIT_POLICY=PASSIVE`` (and the same with ``GOMP_SPINCOUNT=0``; with
``KMP_BLOCKTIME=0`` unchanged from the default).

So:

- the commands (``python -m grpo_fast.X``, ``grpo-fast``) call ``prefer_short_wait`` before torch
  loads (``grpo_fast/__init__.py``, first thing), unless the environment already says how to wait:
  ``GOMP_SPINCOUNT=30000`` (``SHORT_SPIN``, ~2.6 ms of spinning, then sleep) when the thread count
  is automatic (it then follows the machine: beside other work it drops to what is free, and a
  team of one never waits), ``OMP_WAIT_POLICY=PASSIVE`` when the user fixed it with
  ``OMP_NUM_THREADS`` (nothing follows: never spin on cores another process needs). Measured
  alone and beside a training job: ``bench/contention.py``, its table in docs/training.md.
  ``import grpo_fast`` from a user's own script changes nothing (set the variable yourself,
  before ``import torch``);
- ``threads.wait_policy=passive|active`` asks for one whatever the environment: the training
  command then starts itself again with the variable set (``wait_policy_restart``), since a loaded
  libgomp cannot change;
- the intra-op thread count (``choose_threads``): ``threads.intra_op=N``, else the user's
  ``OMP_NUM_THREADS`` (never overwritten), else on a CPU run the cores this process may use less
  those other work keeps busy, and then, during the run, whatever the other work leaves free
  (``ThreadFollower``, at step ends); 1 for a small model (hidden size ≤ ``SMALL_HIDDEN``) when the
  wait is passive (a sleeping thread's wake-up costs more than its share of a small matmul).
"""

from __future__ import annotations

import math
import os
import sys
import time
from dataclasses import dataclass
from pathlib import Path

# What libgomp reads for its wait between parallel regions (at load; KMP_BLOCKTIME: Intel's only).
WAIT_ENV = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")
WAIT_POLICIES = ("auto", "passive", "active")
# The tiny preset's model (hidden 128) and smaller: one intra-op thread where OpenMP waits passively.
SMALL_HIDDEN = 256
# GOMP_SPINCOUNT the commands set, then sleep: ~2.6 ms of spinning on a 2-core AMD EPYC (idle, 60
# regions 10 ms apart: 0.17 CPU s; libgomp's default, 300,000, spun ≥ 7.5 ms of each gap: 0.47 s).
SHORT_SPIN = 30000
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


def prefer_short_wait(environ: dict | None = None, modules: dict | None = None) -> bool:
    """The commands' wait, in ``environ`` (``os.environ``): ``GOMP_SPINCOUNT=SHORT_SPIN``, or
    ``OMP_WAIT_POLICY=PASSIVE`` where ``OMP_NUM_THREADS`` fixes the count (nothing follows the
    machine then); nothing where the environment names a wait already (``WAIT_ENV``) or torch is in
    ``modules`` (``sys.modules``: libgomp has read the environment, too late). True when set."""
    env = os.environ if environ is None else environ
    if "torch" in (sys.modules if modules is None else modules) or any(k in env for k in WAIT_ENV):
        return False
    if env.get("OMP_NUM_THREADS", "").strip():
        env["OMP_WAIT_POLICY"] = "PASSIVE"
    else:
        env["GOMP_SPINCOUNT"] = str(SHORT_SPIN)
    return True


def wait_policy_in_effect(environ: dict | None = None) -> str:
    """libgomp's wait as the environment gave it at load: ``passive`` (``OMP_WAIT_POLICY=PASSIVE``
    or ``GOMP_SPINCOUNT=0``), ``active``, ``spin N`` (``GOMP_SPINCOUNT=N``: N spins, then sleep) or
    ``spin`` (neither: libgomp's default, 300,000 spins). Read from the environment now, which
    is the one it loaded with unless code changed it since."""
    env = os.environ if environ is None else environ
    policy = env.get("OMP_WAIT_POLICY", "").strip().lower()
    if policy in ("passive", "active"):
        return policy
    count = env.get("GOMP_SPINCOUNT", "").strip()
    if count == "0":
        return "passive"
    return f"spin {count}" if count else "spin"


def spins_long(wait: str) -> bool:
    """Whether a wait (``wait_policy_in_effect``) spins longer than ``SHORT_SPIN``: on a busy
    machine, spinning on the cores other processes need."""
    if wait.startswith("spin "):
        count = wait.split()[1]
        return not count.isdigit() or int(count) > SHORT_SPIN
    return wait in ("spin", "active")


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
    follow: bool = False  # auto on a CPU run: the count then follows the machine (ThreadFollower)


def cores_busy(load: float) -> int:
    """Whole cores a load keeps busy, halves up (0.5 → 1, 2.5 → 3): what the thread count leaves
    to other work, at the setup and when following the machine alike."""
    return math.floor(load + 0.5)


def local_ranks() -> int:
    """The ranks of this run on this machine (torchrun's ``LOCAL_WORLD_SIZE``; 1 without it)."""
    try:
        return max(1, int(os.environ.get("LOCAL_WORLD_SIZE", "1")))
    except ValueError:
        return 1


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
    load_name: str = "load",
) -> ThreadChoice | None:
    """The intra-op thread count for a run: ``asked`` (``threads.intra_op``: an int, or
    ``"auto"``), then the user's ``OMP_NUM_THREADS``, then for a CPU run the cores free,
    ``cores - cores_busy(load)`` and at least 1, followed during the run (``ThreadFollower``); 1 for a
    model of hidden size <= SMALL_HIDDEN where OpenMP waits passively. ``load``: cores busy with
    other work (a reading of ``OtherWork``, else the 1-minute load average), named ``load_name``
    in the why. None: leave torch's own (a GPU run's CPU side, with no ask and no variable).

        >>> choose_threads("auto", "cpu", 128, cores=2, load=0.1, environ={}).threads
        2
        >>> choose_threads("auto", "cpu", 128, cores=2, load=0.1, environ={"OMP_WAIT_POLICY": "passive"}).threads
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
    free = max(1, cores - (cores_busy(load) if load is not None and math.isfinite(load) else 0))
    busy = f", {load_name} {load:.1f}" if load is not None else ""
    if hidden_size is not None and hidden_size <= SMALL_HIDDEN and wait_policy_in_effect(env) == "passive":
        return ThreadChoice(
            1, f"auto: a small model (hidden {hidden_size}), wait passive, {cores} cores{busy}"
        )
    return ThreadChoice(min(cores, free), f"auto: {cores} cores{busy}, following the machine", follow=True)


# How often a run re-reads the other work on its cores (seconds, checked at step ends): one reading
# averages over many steps (the tiny preset's take ~70 ms) and follows a job that starts within
# a few seconds.
FOLLOW_INTERVAL_S = 1.0
# The shortest window a reading of OtherWork averages over: /proc/stat counts in clock ticks (10 ms
# at 100 Hz), so over 0.25 s a reading is good to about 0.1 of a core.
MIN_WINDOW_S = 0.25
# /proc/stat's busy columns (after the cpu name): user nice system [idle iowait] irq softirq steal.
_BUSY_COLUMNS = (0, 1, 2, 5, 6, 7)


def cpu_busy_seconds(cpus) -> float | None:
    """CPU-seconds spent busy since boot on the cores ``cpus`` (all processes; /proc/stat), or None
    where there is no /proc/stat (not Linux) or it names none of them."""
    try:
        lines = Path("/proc/stat").read_text().splitlines()
    except OSError:
        return None
    want = {f"cpu{i}" for i in cpus}
    ticks, found = 0, False
    for line in lines:
        fields = line.split()
        if fields and fields[0] in want:
            values = [int(x) for x in fields[1:]]
            ticks += sum(values[i] for i in _BUSY_COLUMNS if i < len(values))
            found = True
    # None where no line names these cores (a container that renumbers them): unknown, not idle
    return ticks / os.sysconf("SC_CLK_TCK") if found else None


def own_cpu_seconds() -> float:
    """CPU-seconds this process (all its threads) has used."""
    t = os.times()
    return t.user + t.system


class OtherWork:
    """How many cores work that is not this process's kept busy (a float: 1.0 = one core all the
    time), averaged over the wall time since the previous ``read``: the busy time of the cores this
    process may use, less its own. Its children count as other work (a rollout worker or sandbox
    wants cores too)."""

    def __init__(self, cpus=None, busy=cpu_busy_seconds, own=own_cpu_seconds, clock=time.monotonic):
        self.cpus = (
            sorted(os.sched_getaffinity(0)) if cpus is None and hasattr(os, "sched_getaffinity") else cpus
        )
        self.busy, self.own, self.clock = busy, own, clock
        self.last = self._sample()
        self.latest: float | None = None  # what the last ``read`` gave

    def _sample(self) -> tuple[float, float | None, float]:
        return self.clock(), self.busy(self.cpus or range(os.cpu_count() or 1)), self.own()

    def read(self) -> float | None:
        """Cores busy with other work since the previous reading; None without /proc/stat or
        over less than ``MIN_WINDOW_S`` (the window then stays open: the next reading covers it)."""
        now = self._sample()
        (t0, busy0, own0), (t1, busy1, own1) = self.last, now
        if t1 - t0 < MIN_WINDOW_S:
            self.latest = None
            return None
        self.last = now
        if busy0 is None or busy1 is None:
            self.latest = None
        else:
            self.latest = max(0.0, ((busy1 - busy0) - (own1 - own0)) / (t1 - t0))
        return self.latest


# The other work since the command started (``grpo_fast/__init__.py`` starts it, before torch
# loads): the setup's reading then spans the imports too, long enough to read; None in a library
# caller's process.
command_meter: OtherWork | None = None


class ThreadFollower:
    """``threads.intra_op=auto`` on a CPU run: torch's intra-op thread count follows the cores the
    machine's other work leaves free, ``min(most, cores - cores_busy(other))`` and at least 1, read at
    step ends every ``interval`` seconds (``step_end``). Fewer threads at once when other work
    appears; more only after two readings in a row agree (a job between steps is not a free
    core). Measured (``bench/contention.py``, docs/training.md): the tiny preset on 2 idle cores
    is fastest on 2 threads, and beside a job that uses both cores, on 1.

        >>> f = ThreadFollower(2, 2, other=lambda: 1.2, get=lambda: 2, set=print, clock=iter(range(0, 99, 3)).__next__)
        >>> f.step_end()
        1
        '2 → 1 CPU threads (other work on 1.2 of 2 cores)'
    """

    def __init__(self, most: int, cores: int, other=None, get=None, set=None, clock=time.monotonic,
                 interval: float | None = None):  # fmt: skip
        import torch

        self.most, self.cores, self.clock = most, cores, clock
        self.interval = FOLLOW_INTERVAL_S if interval is None else interval
        self.other = other if other is not None else OtherWork().read
        self.get = get or torch.get_num_threads
        self.set = set or torch.set_num_threads
        self.last, self.rising = clock(), None

    def step_end(self) -> str | None:
        """At a step's end: after ``interval`` seconds, read the other work and change torch's
        thread count if it asks for another; what changed (for the log), or None."""
        now = self.clock()
        if now - self.last < self.interval:
            return None
        self.last = now
        other = self.other()
        if other is None:
            return None
        want = max(1, min(self.most, self.cores - cores_busy(other)))
        have = self.get()
        if want > have and self.rising != want:  # the first reading that asks for more: wait for a second
            self.rising = want
            return None
        self.rising = None
        if want == have:
            return None
        self.set(want)  # only a change (re-setting the same count costs: _set_threads)
        return f"{have} → {want} CPU threads (other work on {other:.1f} of {self.cores} cores)"


# The follower of the run in progress in this process (``loop.setup`` installs it, ``train.run``
# removes it), or None: a count asked for, OMP_NUM_THREADS, a GPU run.
follower: ThreadFollower | None = None


def follow_machine() -> str | None:
    """At a step's end (GRPO's and the SFT warm start's): the run's ``ThreadFollower``, if any."""
    return follower.step_end() if follower is not None else None
