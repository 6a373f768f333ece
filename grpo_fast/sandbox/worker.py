"""Long-lived helper processes that answer one request line at a time, under a hard time limit.

A ``WorkerProcess`` runs a Python source in a fresh interpreter that speaks a line protocol: it
writes ``ready`` once started, then one reply line per request line. A request that is not
answered within its limit kills the process and starts a fresh one at once, so the next request
waits only for what is left of the start-up. ``WorkerPool`` keeps up to N of them for callers on
several threads (started when first needed, never more than N alive).

The worker's source should begin with ``DIE_WITH_PARENT`` so that it is killed when its parent
dies, even by SIGKILL (Linux ``PR_SET_PDEATHSIG``), and move ``sys.stdout`` aside so stray prints
of the libraries it imports cannot corrupt the protocol (``MathGrader``'s worker in
``grpo_fast/task/rewards.py`` is the example). Standard library only: this is a low floor.
"""

from __future__ import annotations

import os
import select
import subprocess
import tempfile
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

__all__ = ["DIE_WITH_PARENT", "WorkerPool", "WorkerProcess"]

# Linux: die with the parent, even when it is SIGKILLed (PR_SET_PDEATHSIG = 1). Elsewhere the
# worker outlives a killed parent until its stdin closes.
DIE_WITH_PARENT = """
try:
    import ctypes, signal
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
"""


_SPAWNER: ThreadPoolExecutor | None = None
_SPAWNER_LOCK = threading.Lock()


def _spawn(argv: list[str], stderr) -> subprocess.Popen:
    """Start a worker from one thread that lives as long as the interpreter.

    Linux sends the parent-death signal when the *thread* that started a process ends, not the
    process: a worker started from a short-lived thread (a ``ThreadPoolExecutor``'s, which
    ``ordered_map`` shuts down after each batch) would be killed with it, in the middle of
    another thread's request.
    """
    global _SPAWNER
    with _SPAWNER_LOCK:
        if _SPAWNER is None:
            _SPAWNER = ThreadPoolExecutor(max_workers=1, thread_name_prefix="worker-spawner")
    pipe = subprocess.PIPE
    return _SPAWNER.submit(subprocess.Popen, argv, stdin=pipe, stdout=pipe, stderr=stderr, bufsize=0).result()


class WorkerProcess:
    """One helper process: ``argv`` started on first use, one request line in, one reply line out.

    Not thread-safe on its own: one caller at a time (``WorkerPool`` hands each worker to one
    thread). A timed-out or dead worker is replaced before ``request`` returns None.

    Args:
        argv: the command, e.g. ``[sys.executable, "-c", SOURCE]``; it prints ``ready`` once
            started, then answers each line of its stdin with one line on its stdout.
        startup_timeout_s: how long to wait for ``ready`` before raising ``RuntimeError`` with the
            tail of the worker's stderr.
        name: what the error calls it.

    Example:
        >>> w = WorkerProcess([sys.executable, "-c", "print('ready'); [print(l.upper(), end='') for l in open(0)]"])  # doctest: +SKIP
        >>> w.request(b"abc\\n", timeout_s=5.0)  # doctest: +SKIP
        b'ABC'
    """

    def __init__(self, argv: Sequence[str], startup_timeout_s: float = 60.0, name: str = "worker"):
        self.argv = list(argv)
        self.startup_timeout_s = startup_timeout_s
        self.name = name
        self.proc: subprocess.Popen | None = None
        self._stderr = None
        self._ready = False
        self._buf = b""

    def request(self, line: bytes, timeout_s: float) -> bytes | None:
        """The reply line (without its newline) to ``line`` (which ends with a newline), or None
        when none came within ``timeout_s`` or the worker died: it has then been replaced."""
        proc = self._ready_process()
        try:
            proc.stdin.write(line)
            proc.stdin.flush()
            reply = self._read_line(proc, timeout_s)
        except OSError:  # the worker died under us (broken pipe)
            reply = None
        if reply is None:
            self.restart()
        return reply

    def restart(self) -> None:
        """Kill the process (if any) and start a fresh one (``ready`` is awaited on next use)."""
        self.close()
        # A file, not a pipe: a chatty worker never blocks. It lives as long as the worker.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self.proc = _spawn(self.argv, self._stderr)

    def close(self) -> None:
        """Kill the process and wait for it (a later request starts a new one)."""
        if self.proc is not None:
            self.proc.kill()
            self.proc.wait()
            self.proc.stdin.close()
            self.proc.stdout.close()
            self._stderr.close()
        self.proc, self._stderr, self._ready, self._buf = None, None, False, b""

    def _ready_process(self) -> subprocess.Popen:
        if self.proc is None or self.proc.poll() is not None:
            self.restart()
        if not self._ready:
            if self._read_line(self.proc, self.startup_timeout_s) != b"ready":
                self._stderr.seek(0)
                tail = self._stderr.read()[-2000:].decode(errors="replace")
                self.close()
                raise RuntimeError(f"the {self.name} did not start:\n{tail}")
            self._ready = True
        return self.proc

    def _read_line(self, proc: subprocess.Popen, timeout_s: float) -> bytes | None:
        """One reply line (without the newline), or None on timeout or end of file."""
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line


class WorkerPool:
    """Up to ``size`` ``WorkerProcess``es of one command, shared by threads.

    ``request`` takes an idle worker, or starts one while fewer than ``size`` exist, or waits for
    one to come back: at most ``size`` requests run at once, and a single-threaded caller only
    ever starts one worker.

    Example:
        >>> pool = WorkerPool([sys.executable, "-c", SOURCE], size=2)  # doctest: +SKIP
        >>> ordered_map(lambda x: pool.request(x, 5.0), lines, workers=2)  # doctest: +SKIP
    """

    def __init__(
        self, argv: Sequence[str], size: int = 1, startup_timeout_s: float = 60.0, name: str = "worker"
    ):
        if size < 1:
            raise ValueError(f"a worker pool needs size >= 1, got {size}")
        self.argv, self.size = list(argv), size
        self.startup_timeout_s, self.name = startup_timeout_s, name
        self.workers: list[WorkerProcess] = []  # every worker started so far, in start order
        self._idle: list[WorkerProcess] = []
        self._cond = threading.Condition()

    def request(self, line: bytes, timeout_s: float) -> bytes | None:
        """``WorkerProcess.request`` on an idle worker (see there)."""
        worker = self._take()
        try:
            return worker.request(line, timeout_s)
        finally:
            with self._cond:
                self._idle.append(worker)
                self._cond.notify()

    def close(self) -> None:
        """Stop every worker (waits for the ones in use; a later request starts new ones)."""
        with self._cond:
            while len(self._idle) < len(self.workers):
                self._cond.wait()
            for worker in self.workers:
                worker.close()
            self.workers, self._idle = [], []

    def _take(self) -> WorkerProcess:
        with self._cond:
            while not self._idle and len(self.workers) >= self.size:
                self._cond.wait()
            if self._idle:
                return self._idle.pop()
            worker = WorkerProcess(self.argv, self.startup_timeout_s, self.name)
            self.workers.append(worker)
            return worker
