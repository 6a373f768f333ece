"""Run model-written Python in a sandbox: hostile input, contained, one status per call.

Each call is a fresh interpreter (``_runner.py``) in its own process group, with:

- **bubblewrap** (``bwrap``, isolation ``"bwrap"``, the default): its own network namespace (no
  network: only an unconnected loopback), pid namespace (the call sees only its own processes;
  when the code's main process ends, every process it started is killed with the namespace),
  IPC and UTS namespaces; a root filesystem that holds the interpreter's prefixes, its
  site-packages and ``/usr``, all read-only, and a fresh empty writable ``/tmp`` (a tmpfs of
  ``tmp_mb``); no ``/etc``, ``/home``, ``/root`` or working tree, but for the path down to an
  interpreter's prefix that lives in one (a pyenv under ``/root``, a virtual environment in the
  checkout: the prefix itself, read-only, and empty directories above it); an emptied
  environment; a new session (no terminal); killed if its parent dies. As root, the code runs
  as a uid of its own (``10**9`` + a slot per running call), which makes the process limit
  hold (root is exempt from it) and gives concurrent calls separate counts;
- **limits** (rlimits, set by the runner on itself before any of the code runs, inherited by
  every process it starts): address space ``memory_mb`` per process, CPU time per process,
  processes + threads, file size (``tmp_mb``), open files, no core dumps;
- **the caller's watch**: a wall-clock ``timeout_s`` for the whole call, past which the group
  and its namespace are killed; at most ``output_bytes`` of output kept, past which the same;
- **a report the code cannot write**: the runner's supervisor waits for the code's process and
  says how it ended (its exit code, or the signal that killed it, and its CPU time) on a pipe
  the code's process closed before any of its code ran (``_runner.py``). An exit code is the
  code's own choice, so no status is read from one: ``sys.exit(137)`` is ``error: exit code
  137``, a real SIGKILL is ``signal``; ``cpu`` needs SIGXCPU or SIGKILL *and* the CPU time of
  the limit. ``memory`` and ``processes`` come from the runner inside the code's process (a
  ``MemoryError``, a fork refused at the limit, reached it): code that raises those on purpose
  can show them, an exit code cannot. Control characters of the output are escaped (``\\x1b``).

Isolation ``"unsafe"`` (an explicit opt-in for trusted setups, where bubblewrap cannot run): the
same runner, limits, emptied environment, process group and timeout, and a fresh temporary
working directory removed after the call, but no namespaces and the caller's uid: the code can
reach the network, read and write what the caller may, a process that leaves the process group
(``setsid``) survives the call, and as root the process limit does not hold.

The memory limit is per process: a call may hold up to ``processes × memory_mb`` in all (and
``tmp_mb`` of files); a cgroup around the trainer is what bounds the sum.

Earlier cells of the same response (``history``) are replayed before the code, with their output
dropped, so variables and imports persist from call to call as in a REPL (docs/tools.md: why
replay and what it costs). Standard library only (a low floor).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import re
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from grpo_fast.errors import UserError
from grpo_fast.sandbox.pool import default_workers, ordered_map

__all__ = [
    "BWRAP_FIX",
    "ISOLATIONS",
    "STATUSES",
    "Limits",
    "Sandbox",
    "SandboxResult",
    "SandboxUnavailable",
    "bwrap_status",
]

ISOLATIONS = ("bwrap", "unsafe")
# ok: ran to its end (exit code 0); error: an exception or a non-zero exit code; the others name
# the limit the call hit.
STATUSES = ("ok", "error", "timeout", "memory", "cpu", "processes", "output", "signal")
BWRAP_FIX = "apt-get install -y bubblewrap"
MIN_BWRAP = (0, 7)  # --size for the /tmp tmpfs (bubblewrap 0.7.0)
RUNNER = (Path(__file__).parent / "_runner.py").read_text()
MAX_TIMEOUT_S = 86_400.0  # a day: past it a deadline is no bound (and select() overflows near 1e10 s)
MAX_RLIMIT = 2**63 - 1  # the largest limit setrlimit takes short of "unlimited"
UID_BASE = 10**9  # as root, each running call gets uid UID_BASE + (pid % 2**22) * 256 + slot
_UID_SLOTS = 256
# What the output may not carry as it is: C0 controls but tab and newline, DEL, C1 controls, and
# the format characters that reorder text or break lines (bidi overrides, U+2028/U+2029). On a
# terminal they move the cursor, clear the screen, set its title; in the model's block they hide
# or reorder what the code printed.
_CONTROL = re.compile("[\x00-\x08\x0b-\x1f\x7f-\x9f\u200e\u200f\u2028-\u202e\u2066-\u2069]")

# The environment inside: nothing of the caller's. One BLAS thread (a thread counts against the
# process limit); PYTHONHASHSEED fixed so that a replayed cell iterates a set as it did.
SANDBOX_ENV = {
    "PATH": "/usr/local/bin:/usr/bin:/bin",
    "LANG": "C.UTF-8",
    "PYTHONHASHSEED": "0",
    "PYTHONDONTWRITEBYTECODE": "1",
    "PYTHONIOENCODING": "utf-8",
    "OPENBLAS_NUM_THREADS": "1",
    "OMP_NUM_THREADS": "1",
    "MKL_NUM_THREADS": "1",
    "NUMEXPR_NUM_THREADS": "1",
    "MPLBACKEND": "Agg",
}


class SandboxUnavailable(UserError):
    """The sandbox cannot run on this machine (the message names the fix)."""


@dataclass(frozen=True)
class Limits:
    """What one sandboxed call may use.

    Attributes:
        timeout_s: wall clock for the whole call (start-up and replayed cells included).
        memory_mb: address space of each process (RLIMIT_AS). numpy + sympy import in 256 MB.
        cpu_s: CPU seconds of each process (RLIMIT_CPU); None: ``ceil(timeout_s) + 1``.
        processes: processes + threads the code may have at once (RLIMIT_NPROC).
        output_bytes: stdout + stderr kept; past it every process is killed.
        tmp_mb: size of the writable ``/tmp`` (and the largest file anywhere, RLIMIT_FSIZE).
        open_files: file descriptors per process (RLIMIT_NOFILE).
    """

    timeout_s: float = 10.0
    memory_mb: int = 1024
    cpu_s: int | None = None
    processes: int = 16
    output_bytes: int = 1 << 20
    tmp_mb: int = 64
    open_files: int = 256

    def __post_init__(self):
        for name in ("timeout_s", "memory_mb", "processes", "output_bytes", "tmp_mb", "open_files"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not value > 0:
                raise ValueError(f"sandbox limit {name} must be a positive number, got {value!r}")
            if name != "timeout_s" and not isinstance(value, int):
                raise ValueError(f"sandbox limit {name} must be a whole number, got {value!r}")
        if not self.timeout_s <= MAX_TIMEOUT_S:  # inf and nan too
            raise ValueError(
                f"sandbox limit timeout_s must be at most {MAX_TIMEOUT_S:g} s (a day), got {self.timeout_s!r}"
            )
        if self.cpu_s is not None and (not isinstance(self.cpu_s, int) or self.cpu_s < 1):
            raise ValueError(
                f"sandbox limit cpu_s must be a whole number of seconds >= 1, got {self.cpu_s!r}"
            )
        if self.processes < 4:  # the interpreter and bubblewrap's own processes
            raise ValueError(f"sandbox limit processes must be >= 4, got {self.processes}")
        in_bytes = {"memory_mb": 1 << 20, "tmp_mb": 1 << 20}
        for name in ("memory_mb", "tmp_mb", "cpu_s", "processes", "open_files"):
            scale = in_bytes.get(name, 1)
            value = getattr(self, name)
            if value is not None and value * scale >= MAX_RLIMIT:  # setrlimit and --size take no more
                raise ValueError(f"sandbox limit {name} must be under {MAX_RLIMIT // scale:,}, got {value:,}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1


@dataclass(frozen=True)
class SandboxResult:
    """One call's outcome.

    Attributes:
        output: stdout and stderr as written, interleaved (at most ``output_bytes`` of it,
            decoded as UTF-8 with replacement characters, control characters escaped as
            ``\\x1b``), what the model is shown.
        status: one of ``STATUSES``.
        exit_code: the code's exit code as ``waitpid`` saw it (``sys.exit(-1)`` is 255); None
            when a signal killed it, when the call was stopped by the timeout or the output
            limit, or when the runner could not say.
        seconds: wall time of the call.
        detail: what the status line says after the status.
        signal: the signal that killed the code's process (None: it exited, or was stopped).
    """

    output: str
    status: str
    exit_code: int | None
    seconds: float
    detail: str
    signal: int | None = None

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    def status_line(self) -> str:
        """One line: ``<status>: <what happened>``, e.g. ``timeout: stopped at the 10 s
        wall-clock limit after 10.0 s; every process of the call killed``."""
        return f"{self.status}: {self.detail}"


def bwrap_status() -> tuple[str | None, str | None]:
    """``(bubblewrap's version, None)`` when it can run here, else ``(version or None, why not:
    one line naming the fix)``."""
    exe = shutil.which("bwrap")
    if exe is None:
        return None, f"bubblewrap (bwrap) is not installed; install it: {BWRAP_FIX}"
    try:
        out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=10, env={})
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"{exe} --version failed ({exc}): {BWRAP_FIX}"
    m = re.search(r"(\d+)\.(\d+)(?:\.(\d+))?", out.stdout + out.stderr)
    if m is None:
        return None, f"{exe} --version printed no version ({(out.stdout + out.stderr).strip()[:80]!r})"
    version = m.group(0)
    if (int(m.group(1)), int(m.group(2))) < MIN_BWRAP:
        need = ".".join(map(str, MIN_BWRAP))
        return (
            version,
            f"bubblewrap {version} is older than {need} (no --size for /tmp); upgrade it: {BWRAP_FIX}",
        )
    return version, None


class _UidSlots:
    """As root: a uid of its own for each running call (its process count, its processes)."""

    def __init__(self):
        self._free = list(range(_UID_SLOTS))
        self._lock = threading.Lock()

    def take(self) -> int:
        with self._lock:
            slot = self._free.pop(0) if self._free else 0  # > 256 at once: shared counts
        return UID_BASE + (os.getpid() % 2**22) * _UID_SLOTS + slot

    def give(self, uid: int) -> None:
        slot = (uid - UID_BASE) % _UID_SLOTS
        with self._lock:
            if slot not in self._free:
                self._free.append(slot)


_UIDS = _UidSlots()
_INTERPRETERS: dict[str, list[str]] = {}  # python -> its prefixes


def _interpreter_prefixes(python: str) -> list[str]:
    """The directories of ``python`` the sandbox binds read-only: its prefix, base prefix and
    site-packages (those outside /usr, which is bound whole), asked once."""
    if python not in _INTERPRETERS:
        probe = "import json, site, sys; print(json.dumps([sys.prefix, sys.base_prefix, *site.getsitepackages()]))"
        try:
            out = subprocess.run([python, "-s", "-c", probe], capture_output=True, text=True, timeout=60)
            paths = json.loads(out.stdout)
        except (OSError, ValueError, subprocess.TimeoutExpired) as exc:
            raise SandboxUnavailable(f"the sandbox's interpreter {python} does not run: {exc}") from None
        real = sorted({os.path.realpath(p) for p in paths if os.path.isdir(p)} | {os.path.dirname(python)})
        _INTERPRETERS[python] = [p for p in real if not p.startswith("/usr/") and p != "/usr"]
    return _INTERPRETERS[python]


class Sandbox:
    """Runs code under ``limits``, at most ``workers`` calls at once (``run_batch`` runs a batch
    concurrently; ``run`` from several threads is bounded the same way).

    Args:
        limits: what a call may use (``Limits``).
        isolation: ``"bwrap"`` (default) or ``"unsafe"`` (no namespaces: trusted code only).
        workers: calls at once (default: this process's CPUs, at most 8).
        python: the interpreter (default ``sys.executable``: numpy and sympy as installed here).

    Raises:
        SandboxUnavailable: bubblewrap is missing, too old, or cannot create its namespaces
            here (one line naming the fix).

    Example:
        >>> box = Sandbox(Limits(timeout_s=5))  # doctest: +SKIP
        >>> r = box.run("import sympy\\nx = sympy.Symbol('x')\\nsympy.factor(x**2 - 1)")  # doctest: +SKIP
        >>> r.output, r.status  # doctest: +SKIP
        ('(x - 1)*(x + 1)\\n', 'ok')
    """

    def __init__(
        self,
        limits: Limits | None = None,
        isolation: str = "bwrap",
        workers: int | None = None,
        python: str | None = None,
    ):
        if isolation not in ISOLATIONS:
            raise ValueError(f"isolation must be one of {', '.join(ISOLATIONS)}, got {isolation!r}")
        self.limits = limits or Limits()
        self.isolation = isolation
        self.workers = workers or default_workers()
        self.python = python or sys.executable
        self._slots = threading.BoundedSemaphore(self.workers)
        self._root = os.geteuid() == 0
        self._bwrap = None
        if isolation == "bwrap":
            version, problem = bwrap_status()
            if problem is not None:
                raise SandboxUnavailable(f"the code sandbox cannot run here: {problem}")
            self._bwrap = shutil.which("bwrap")
            self._prefixes = _interpreter_prefixes(self.python)
            # bubblewrap 0.8+: no user namespace of its own for the code (kernel attack surface)
            self._disable_userns = tuple(map(int, version.split(".")[:2])) >= (0, 8)
            self._check_bwrap_runs()

    def run(self, code: str, history: Sequence[str] = ()) -> SandboxResult:
        """Run ``code`` after replaying ``history`` (earlier cells, output dropped)."""
        return self._run(code, history, self.limits)[0]

    def run_batch(self, calls: Sequence[str | tuple[str, Sequence[str]]]) -> list[SandboxResult]:
        """``run`` on each call (``code`` or ``(code, history)``), up to ``workers`` at once;
        results in the order of ``calls``."""
        pairs = [(c, ()) if isinstance(c, str) else (c[0], c[1]) for c in calls]
        return ordered_map(lambda p: self.run(*p), pairs, self.workers)

    # -- one call ---------------------------------------------------------------------------

    def _run(self, code: str, history: Sequence[str], lim: Limits) -> tuple[SandboxResult, dict | None]:
        """``(the result, the runner's report or None)`` of one call under ``lim``."""
        request = json.dumps({"cells": list(history), "code": code}).encode()
        with self._slots:
            uid = _UIDS.take() if self._root and self._bwrap is not None else -1
            try:
                return self._call(request, uid, lim)
            finally:
                if uid >= 0 and _sweep_uid(uid):  # a uid goes back only with no task left
                    _UIDS.give(uid)

    def _call(self, request: bytes, uid: int, lim: Limits) -> tuple[SandboxResult, dict | None]:
        start = time.monotonic()
        report_r, report_w = os.pipe()  # the runner's report: see _runner.py
        if self._bwrap is not None:  # the runner drops to uid inside
            workdir, argv, env = None, self._bwrap_argv(uid, report_w, lim), {}
        else:
            workdir = tempfile.mkdtemp(prefix="grpo-fast-sandbox-")
            argv = self._runner_argv(-1, report_w, lim)
            env = {**SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}
        try:
            try:
                proc = subprocess.Popen(
                    argv,
                    stdin=subprocess.PIPE,
                    stdout=subprocess.PIPE,
                    stderr=subprocess.STDOUT,
                    cwd=workdir or "/",
                    env=env,
                    start_new_session=True,
                    pass_fds=(report_w,),
                )
            finally:
                os.close(report_w)
            try:
                output, stopped = _collect(proc, request, start + lim.timeout_s, lim.output_bytes)
            finally:
                _kill(proc, bwrap=self._bwrap is not None)
            report = _read_report(report_r)
        finally:
            os.close(report_r)
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.monotonic() - start
        killed = "every process of the call killed" if self._bwrap else "its process group killed"
        text = _printable(output.decode("utf-8", errors="replace"))
        return _result(text, stopped, report, proc.returncode, seconds, lim, killed), report

    def _runner_argv(self, uid: int, report_fd: int, lim: Limits) -> list[str]:
        numbers = (
            report_fd,
            uid,
            uid,
            lim.memory_mb << 20,
            lim.cpu_seconds,
            lim.processes,
            lim.tmp_mb << 20,
            lim.open_files,
        )
        return [self.python, "-s", "-u", "-B", "-c", RUNNER, *map(str, numbers)]

    def _bwrap_argv(self, uid: int, report_fd: int, lim: Limits) -> list[str]:
        """The bubblewrap command line for one call (``uid`` >= 0: as root, see the module doc)."""
        if self._root:  # no user namespace (root's would map to root): the runner drops to uid
            argv = [self._bwrap, "--unshare-pid", "--unshare-net", "--unshare-ipc", "--unshare-uts"]
            argv += ["--unshare-cgroup-try", "--cap-add", "CAP_SETUID", "--cap-add", "CAP_SETGID"]
        else:  # unprivileged: a user namespace too; the process limit counts per namespace
            argv = [self._bwrap, "--unshare-all", "--unshare-user"]
            argv += ["--disable-userns"] if self._disable_userns else []
        argv += ["--die-with-parent", "--new-session", "--hostname", "sandbox", "--clearenv"]
        for key, value in {**SANDBOX_ENV, "HOME": "/tmp", "TMPDIR": "/tmp"}.items():
            argv += ["--setenv", key, value]
        argv += ["--perms", "1777", "--size", str(lim.tmp_mb << 20), "--tmpfs", "/tmp"]
        argv += _filesystem_binds(self._prefixes)
        argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
        return [*argv, "--", *self._runner_argv(uid, report_fd, lim)]

    def _check_bwrap_runs(self) -> None:
        """One trivial call: bubblewrap can create its namespaces here, the interpreter starts
        and sets the limits, and ``print`` runs under them. Its wall clock is at least the
        default's (a call as short as ``timeout_s`` says nothing about bubblewrap)."""
        trial = dataclasses.replace(self.limits, timeout_s=max(self.limits.timeout_s, Limits.timeout_s))
        result, report = self._run("print('ok')", (), trial)
        if result.output == "ok\n" and result.ok:
            return
        if report is not None and "setup" in report:
            why = _printable(str(report["setup"]))[:300]
            raise SandboxUnavailable(f"the code sandbox cannot set a call's user or limits here: {why}")
        if report is not None:  # bubblewrap and the runner ran; the limits leave no room for print()
            raise SandboxUnavailable(
                f"print('ok') fails under the sandbox's limits ({result.status_line()}): raise them"
            )
        why = " ".join(result.output.split())[-300:] or result.status_line()
        raise SandboxUnavailable(
            f"bubblewrap cannot run the code sandbox here ({why}); on a machine that forbids "
            "namespaces (some containers) allow them, or use isolation=unsafe for trusted code"
        )


def _filesystem_binds(prefixes: list[str]) -> list[str]:
    """bwrap arguments: /usr and the interpreter's prefixes read-only, the top-level links."""
    argv = ["--ro-bind", "/usr", "/usr"]
    for top in ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32"):
        if os.path.islink(top):  # merged /usr: /lib -> usr/lib
            argv += ["--symlink", os.readlink(top), top]
        elif os.path.isdir(top):
            argv += ["--ro-bind", top, top]
    made: set[str] = set()
    for prefix in prefixes:
        parts = Path(prefix).parts[1:]
        for i in range(1, len(parts)):  # parents bwrap would otherwise create 0700
            parent = "/" + "/".join(parts[:i])
            if parent not in made and parent != "/tmp":
                made.add(parent)
                argv += ["--perms", "0755", "--dir", parent]
        argv += ["--ro-bind", prefix, prefix]
    return argv


def _collect(proc: subprocess.Popen, request: bytes, deadline: float, cap: int) -> tuple[bytes, str | None]:
    """Send the request, read the output until the end, the deadline or the cap: ``(output,
    None | "timeout" | "output")``."""
    try:
        proc.stdin.write(request)
        proc.stdin.close()
    except OSError:  # the runner is gone already: its output says why
        pass
    out = bytearray()
    fd = proc.stdout.fileno()
    while True:
        remaining = deadline - time.monotonic()
        if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
            return bytes(out), "timeout"
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            break
        out += chunk
        if len(out) > cap:
            return bytes(out[:cap]), "output"
    try:  # every writer closed the pipe; the code's main process may still run
        proc.wait(timeout=max(deadline - time.monotonic(), 0.0))
    except subprocess.TimeoutExpired:
        return bytes(out), "timeout"
    return bytes(out), None


def _kill(proc: subprocess.Popen, bwrap: bool) -> None:
    """Kill what is left of the call and wait until it is gone.

    With bubblewrap: SIGKILL to its init process in the call's pid namespace. The kernel then
    kills every process of the namespace, and that init's exit (which bubblewrap's outer process
    waits for) completes only once they are all gone, so ``proc.wait()`` returning means none is
    left. (Killing the outer process instead would leave the namespace to die on its own, after
    this call has returned.) Without: SIGKILL to the process group.
    """
    if proc.poll() is None:
        if bwrap:
            for child in _children(proc.pid):
                with contextlib.suppress(ProcessLookupError):
                    os.kill(child, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(timeout=10.0)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    proc.stdout.close()


def _uid_tasks(uid: int) -> list[int]:
    """The pids whose owner is ``uid`` (any state, an exiting one included)."""
    found = []
    for entry in (p for p in os.listdir("/proc") if p.isdigit()):
        with contextlib.suppress(OSError):
            if os.stat(f"/proc/{entry}").st_uid == uid:
                found.append(int(entry))
    return found


def _sweep_uid(uid: int, patience_s: float = 10.0) -> bool:
    """As root: SIGKILL whatever still runs as a call's ``uid`` and wait until none is left.

    After ``_kill`` the call's pid namespace is gone, so this normally finds nothing (one /proc
    scan, about 1 ms). It is the guarantee behind "nothing left" and behind the process limit
    (RLIMIT_NPROC counts the uid's tasks): a task still exiting when its uid was handed to the
    next call would count against that call's limit. False (the uid is then retired) when tasks
    outlive ``patience_s``."""
    deadline = time.monotonic() + patience_s
    while pids := _uid_tasks(uid):
        for pid in pids:
            with contextlib.suppress(OSError):
                os.kill(pid, signal.SIGKILL)
        if time.monotonic() > deadline:
            return False
        time.sleep(0.005)
    return True


def _children(pid: int) -> list[int]:
    try:
        return [int(c) for c in Path(f"/proc/{pid}/task/{pid}/children").read_text().split()]
    except OSError:  # a kernel without CONFIG_PROC_CHILDREN: look at every process's parent
        found = []
        for entry in (p for p in os.listdir("/proc") if p.isdigit()):
            with contextlib.suppress(OSError, IndexError):
                if int(Path(f"/proc/{entry}/stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(entry))
        return found


def _read_report(fd: int) -> dict | None:
    """The runner's report (``_runner.py``), None when it wrote none: bubblewrap failed before
    the runner started, or the runner was killed (by the code: it runs as the same uid)."""
    os.set_blocking(fd, False)  # every writer is gone once the call's processes are
    data = b""
    with contextlib.suppress(BlockingIOError):
        while chunk := os.read(fd, 1 << 16):
            data += chunk
    try:
        report = json.loads(data)
    except ValueError:
        return None
    return report if isinstance(report, dict) else None


def _printable(text: str) -> str:
    """``text`` with each control character (``_CONTROL``) written as its escape: ``\\x1b``,
    ``\\u202e``. Tab and newline stay."""

    def escape(m: re.Match) -> str:
        code = ord(m.group())
        return f"\\x{code:02x}" if code < 0x100 else f"\\u{code:04x}"

    return _CONTROL.sub(escape, text)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _said(report: dict) -> tuple[str, str | None]:
    """What the runner in the code's process said (it may be the code's doing): ``(the
    exception's last line, "memory" | "processes" | None)``."""
    said = report.get("said")
    if not isinstance(said, dict):
        return "", None
    exception = said.get("exception")
    limit = said.get("limit")
    line = _printable(" ".join(exception.split()))[:120] if isinstance(exception, str) else ""
    return line, limit if limit in ("memory", "processes") else None


def _result(
    output: str,
    stopped: str | None,
    report: dict | None,
    returncode: int,
    seconds: float,
    lim: Limits,
    killed: str,
) -> SandboxResult:
    """The status of a call from what the caller saw (``stopped``) and the runner's report:
    never from an exit code alone, which the code chooses."""
    took = f"after {seconds:.2f} s"
    exit_code = sig = None
    if stopped == "timeout":
        status, detail = "timeout", f"stopped at the {lim.timeout_s:g} s wall-clock limit; {killed}"
    elif stopped == "output":
        status, detail = (
            "output",
            f"stopped after {lim.output_bytes:,} bytes of output (the output limit) {took}; {killed}",
        )
    elif report is None:
        status = "error"
        detail = f"the sandbox's runner ended without a report (exit code {returncode}: killed?) {took}"
    elif "setup" in report:
        status, detail = "error", f"the call could not be set up: {_printable(str(report['setup']))[:300]}"
    elif isinstance(report.get("signal"), int):
        sig, cpu = report["signal"], report.get("cpu_s")
        # the kernel's SIGXCPU comes with the process's runtime read 0.97-1.05 s at a 1 s limit
        # (the scheduler's count, 16 calls at load 3 on 2 cores; /proc's ticks read 0.92): 10%
        # short still counts as the limit; code that signals itself earlier is a signal
        at_cpu_limit = isinstance(cpu, (int, float)) and cpu >= 0.9 * lim.cpu_seconds
        if sig in (signal.SIGXCPU, signal.SIGKILL) and at_cpu_limit:  # soft limit, then hard
            status, detail = "cpu", f"killed at the {lim.cpu_seconds} s CPU-time limit {took}"
        else:
            status, detail = "signal", f"killed by {_signal_name(sig)} {took}"
    else:
        exit_code = report.get("exit")
        exception, limit = _said(report)
        if exit_code == 0:
            status, detail = "ok", f"ran to completion in {seconds:.2f} s"
        elif exit_code == 1 and limit == "memory":
            status, detail = "memory", f"MemoryError at the {lim.memory_mb} MB memory limit {took}"
        elif exit_code == 1 and limit == "processes":
            status, detail = "processes", f"a new process failed at the {lim.processes}-process limit {took}"
        else:
            why = f" ({exception})" if exit_code == 1 and exception else ""
            status, detail = "error", f"exit code {exit_code}{why} {took}"
    return SandboxResult(output, status, exit_code, seconds, detail, signal=sig)
