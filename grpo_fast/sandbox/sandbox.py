"""Run model-written Python in a sandbox: hostile input, contained, one status per call.

Each call is a fresh interpreter (``_runner.py``) in its own process group, with:

- **bubblewrap** (``bwrap``, isolation ``"bwrap"``, the default): its own network namespace (no
  network: only an unconnected loopback), pid namespace (the call sees only its own processes;
  when the code's main process ends, every process it started is killed with the namespace),
  IPC and UTS namespaces; a root filesystem that holds the interpreter's prefixes, its
  site-packages and ``/usr``, all read-only, and a fresh empty writable ``/tmp`` (a tmpfs of
  ``tmp_mb``); no ``/etc``, ``/home``, ``/root`` or working tree; an emptied environment; a
  new session (no terminal); killed if its parent dies. As root, the code runs as a uid of its
  own (``10**9`` + a slot per running call), which makes the process limit hold (root is exempt
  from it) and gives concurrent calls separate counts;
- **limits** (rlimits, set by the runner on itself before any of the code runs, inherited by
  every process it starts): address space ``memory_mb`` per process, CPU time per process,
  processes + threads, file size (``tmp_mb``), open files, no core dumps;
- **the caller's watch**: a wall-clock ``timeout_s`` for the whole call, past which the group
  and its namespace are killed; at most ``output_bytes`` of output kept, past which the same.

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
EXIT_MEMORY, EXIT_PROCESSES, EXIT_SETUP = 113, 114, 115  # the runner's own exit codes
UID_BASE = 10**9  # as root, each running call gets uid UID_BASE + (pid % 2**22) * 256 + slot
_UID_SLOTS = 256
_EXCEPTION_LINE = re.compile(r"[A-Za-z_][\w.]*(Error|Exception|Interrupt|Exit)\b")  # a traceback's last line

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
        if self.cpu_s is not None and (not isinstance(self.cpu_s, int) or self.cpu_s < 1):
            raise ValueError(
                f"sandbox limit cpu_s must be a whole number of seconds >= 1, got {self.cpu_s!r}"
            )
        if self.processes < 4:  # the interpreter and bubblewrap's own processes
            raise ValueError(f"sandbox limit processes must be >= 4, got {self.processes}")

    @property
    def cpu_seconds(self) -> int:
        return self.cpu_s if self.cpu_s is not None else math.ceil(self.timeout_s) + 1


@dataclass(frozen=True)
class SandboxResult:
    """One call's outcome.

    Attributes:
        output: stdout and stderr as written, interleaved (at most ``output_bytes`` of it,
            decoded as UTF-8 with replacement characters), what the model is shown.
        status: one of ``STATUSES``.
        exit_code: the interpreter's exit code (128 + N when signal N killed it; None when the
            call was stopped by the timeout or the output limit).
        seconds: wall time of the call.
        detail: what the status line says after the status.
    """

    output: str
    status: str
    exit_code: int | None
    seconds: float
    detail: str

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
        request = json.dumps({"cells": list(history), "code": code}).encode()
        with self._slots:
            uid = _UIDS.take() if self._root and self._bwrap is not None else -1
            try:
                return self._call(request, uid)
            finally:
                if uid >= 0 and _sweep_uid(uid):  # a uid goes back only with no task left
                    _UIDS.give(uid)

    def run_batch(self, calls: Sequence[str | tuple[str, Sequence[str]]]) -> list[SandboxResult]:
        """``run`` on each call (``code`` or ``(code, history)``), up to ``workers`` at once;
        results in the order of ``calls``."""
        pairs = [(c, ()) if isinstance(c, str) else (c[0], c[1]) for c in calls]
        return ordered_map(lambda p: self.run(*p), pairs, self.workers)

    # -- one call ---------------------------------------------------------------------------

    def _call(self, request: bytes, uid: int) -> SandboxResult:
        lim = self.limits
        start = time.monotonic()
        if self._bwrap is not None:  # the runner drops to uid inside
            workdir, argv, env = None, self._bwrap_argv(uid), {}
        else:
            workdir = tempfile.mkdtemp(prefix="grpo-fast-sandbox-")
            argv, env = self._runner_argv(-1), {**SANDBOX_ENV, "HOME": workdir, "TMPDIR": workdir}
        try:
            proc = subprocess.Popen(
                argv,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                cwd=workdir or "/",
                env=env,
                start_new_session=True,
            )
            try:
                output, stopped = _collect(proc, request, start + lim.timeout_s, lim.output_bytes)
            finally:
                _kill(proc, bwrap=self._bwrap is not None)
        finally:
            if workdir is not None:
                shutil.rmtree(workdir, ignore_errors=True)
        seconds = time.monotonic() - start
        rc = None if stopped else _exit_code(proc.returncode)
        killed = "every process of the call killed" if self._bwrap else "its process group killed"
        return _result(output.decode("utf-8", errors="replace"), stopped, rc, seconds, lim, killed)

    def _runner_argv(self, uid: int) -> list[str]:
        lim = self.limits
        numbers = (
            uid,
            uid,
            lim.memory_mb << 20,
            lim.cpu_seconds,
            lim.processes,
            lim.tmp_mb << 20,
            lim.open_files,
        )
        return [self.python, "-s", "-u", "-B", "-c", RUNNER, *map(str, numbers)]

    def _bwrap_argv(self, uid: int) -> list[str]:
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
        argv += ["--perms", "1777", "--size", str(self.limits.tmp_mb << 20), "--tmpfs", "/tmp"]
        argv += _filesystem_binds(self._prefixes)
        argv += ["--proc", "/proc", "--dev", "/dev", "--remount-ro", "/", "--chdir", "/tmp"]
        return [*argv, "--", *self._runner_argv(uid)]

    def _check_bwrap_runs(self) -> None:
        """One trivial call: bubblewrap can create its namespaces here, the interpreter starts."""
        result = self.run("print('ok')")
        if result.output != "ok\n" or not result.ok:
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


def _exit_code(returncode: int) -> int:
    """The shell's convention: 128 + N for a process killed by signal N."""
    return 128 - returncode if returncode < 0 else returncode


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


def _result(
    output: str, stopped: str | None, rc: int | None, seconds: float, lim: Limits, killed: str
) -> SandboxResult:
    took = f"after {seconds:.2f} s"
    if stopped == "timeout":
        status, detail = "timeout", f"stopped at the {lim.timeout_s:g} s wall-clock limit; {killed}"
    elif stopped == "output":
        status, detail = (
            "output",
            f"stopped after {lim.output_bytes:,} bytes of output (the output limit) {took}; {killed}",
        )
    elif rc == 0:
        status, detail = "ok", f"ran to completion in {seconds:.2f} s"
    elif rc == EXIT_MEMORY:
        status, detail = "memory", f"MemoryError at the {lim.memory_mb} MB memory limit {took}"
    elif rc == EXIT_PROCESSES:
        status, detail = "processes", f"a new process failed at the {lim.processes}-process limit {took}"
    elif rc == 128 + signal.SIGXCPU:
        status, detail = "cpu", f"killed at the {lim.cpu_seconds} s CPU-time limit {took}"
    elif rc is not None and rc > 128:
        status, detail = "signal", f"killed by {_signal_name(rc - 128)} {took}"
    else:
        last = next((line.strip() for line in reversed(output.splitlines()) if line.strip()), "")
        why = f" ({last[:120]})" if rc == 1 and _EXCEPTION_LINE.match(last) else ""
        status, detail = "error", f"exit code {rc}{why} {took}"
    return SandboxResult(output=output, status=status, exit_code=rc, seconds=seconds, detail=detail)
