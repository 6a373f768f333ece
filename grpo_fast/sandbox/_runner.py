"""The program every sandboxed call runs (``python -c`` with this file's text; never imported).

argv: ``report_fd uid gid memory_bytes cpu_s processes file_bytes open_files`` (uid -1: keep
the uid). stdin: ``{"cells": [earlier code, ...], "code": "the code to run"}`` as JSON.

Two processes. The **supervisor** reads the request, drops to ``uid`` (a root caller's sandbox
keeps CAP_SETUID for this one step), sets the resource limits (inherited by every process the
code starts) and forks the **code's process**, which replays the earlier cells with their output
sent to /dev/null and their exceptions ignored, then runs ``code`` as the ``__main__`` module,
printing the value of a last bare expression as a REPL does, and ends as ``python file.py``
would: waiting for the threads it left running, with the code's own exit code. stdout and stderr
are one pipe, unbuffered (``-u``): the text is in the order it was written.

The supervisor waits for that process and writes one JSON object on ``report_fd``, which the
code's process closes before any of the code runs and cannot reopen (the supervisor is not
dumpable: no ``/proc/PID/fd``, no ptrace): ``{"exit": n}`` or ``{"signal": n}`` as ``waitpid``
saw it, ``"cpu_s"``: the CPU time the process used, and ``"said"``: what the runner in the
code's process said after an uncaught exception (``{"exception": its last line, "limit":
"memory" | "processes" | null}``), or ``{"setup": why}`` when the call could not be set up. The
code chooses its exit code, and can kill itself with any signal, but cannot write that report:
only ``said`` comes from the code's own process (code that goes out of its way can fake it).
A traceback leaves out the runner's frames. Standard library only.
"""

import ast
import builtins
import contextlib
import ctypes
import json
import linecache
import os
import random
import resource
import sys
import traceback

PR_SET_DUMPABLE = 4
EXCEPTION_GROUPS = getattr(builtins, "BaseExceptionGroup", ())  # Python 3.11+


def setup(argv: list) -> int:
    """Drop to the sandbox's uid and set the limits; returns the process limit."""
    uid, gid, memory, cpu, processes, file_bytes, open_files = (int(a) for a in argv)
    if uid >= 0:
        os.setgroups([])
        os.setgid(gid)
        os.setuid(uid)  # from root: every capability is gone from here on
    limits = (
        (resource.RLIMIT_AS, memory, memory),
        (resource.RLIMIT_CPU, cpu, cpu + 1),  # SIGXCPU at cpu s, SIGKILL a second later
        (resource.RLIMIT_NPROC, processes + 1, processes + 1),  # + the supervisor
        (resource.RLIMIT_FSIZE, file_bytes, file_bytes),
        (resource.RLIMIT_NOFILE, open_files, open_files),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for what, soft, hard in limits:
        resource.setrlimit(what, (soft, hard))
    return processes


def set_dumpable(on: bool) -> None:
    """prctl(PR_SET_DUMPABLE): off, no process of the same uid may ptrace this one or open its
    ``/proc/PID/fd``; on, its ``/proc/PID`` belongs to its uid again (the caller counts the
    uid's tasks there)."""
    if ctypes.CDLL(None, use_errno=True).prctl(PR_SET_DUMPABLE, int(on), 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_DUMPABLE) failed")


def compile_cell(source: str, name: str):
    """(body code, last expression code or None) of one cell; its lines registered for tracebacks."""
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    tree = ast.parse(source, name)
    last = None
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = compile(ast.Expression(tree.body.pop().value), name, "eval")
    return compile(tree, name, "exec"), last


def run_cell(source: str, name: str, namespace: dict, show_last: bool) -> None:
    body, last = compile_cell(source, name)
    exec(body, namespace)
    if last is not None:
        value = eval(last, namespace)
        if show_last and value is not None:
            print(repr(value))


def replay(cells: list, namespace: dict) -> None:
    """Run the earlier cells for their state only: no output, exceptions ignored."""
    saved = os.dup(1), os.dup(2)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.dup2(devnull, 2)
    try:
        for i, cell in enumerate(cells):
            with contextlib.suppress(BaseException):
                run_cell(cell, f"<cell {i + 1}>", namespace, show_last=False)
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
        os.dup2(saved[0], 1)
        os.dup2(saved[1], 2)
        for fd in (*saved, devnull):
            os.close(fd)


def without_runner_frames(exc: BaseException, namespace: dict) -> None:
    """Cut the traceback of ``exc``, and of every exception chained to it or grouped in it, to
    the code's: from the first frame of a cell (whose globals are ``namespace``) on, less the
    runner's own frames below it (the ``os.fork`` wrapper: this module's globals)."""
    todo, seen = [exc], set()
    while todo:
        exc = todo.pop()
        if exc is None or id(exc) in seen:
            continue
        seen.add(id(exc))
        kept, tb = [], exc.__traceback__
        while tb is not None and tb.tb_frame.f_globals is not namespace:
            tb = tb.tb_next
        while tb is not None:
            if tb.tb_frame.f_globals is not globals():
                kept.append(tb)
            tb = tb.tb_next
        for tb, after in zip(kept, [*kept[1:], None]):
            tb.tb_next = after
        exc.__traceback__ = kept[0] if kept else None
        todo += [exc.__cause__, exc.__context__]
        if isinstance(exc, EXCEPTION_GROUPS):
            todo += exc.exceptions


def print_exception(exc: BaseException, namespace: dict) -> None:
    """The traceback as Python prints it, from the code's first frame on, none of the runner's
    frames in it."""
    without_runner_frames(exc, namespace)
    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, exc.__traceback__)))
    sys.stderr.flush()


# Set when an ``os.fork`` of the code's failed with EAGAIN (``count_failed_forks``): the task count
# read after the fact can be under the limit again, a fork bomb's children exiting meanwhile.
failed_forks = []


def count_failed_forks() -> None:
    """Wrap ``os.fork`` so that a fork refused with EAGAIN is noted (``failed_forks``)."""
    real_fork = os.fork

    def fork():
        try:
            return real_fork()
        except BlockingIOError:
            failed_forks.append(1)
            raise

    os.fork = fork


def at_process_limit(exc: BaseException, processes: int) -> bool:
    """A fork that failed because the sandbox holds its limit of tasks (processes and threads):
    an ``os.fork`` refused with EAGAIN (RLIMIT_NPROC is the limit that says so here), or another
    EAGAIN (``subprocess``) with this uid's tasks at the limit when it is looked at."""
    if not isinstance(exc, BlockingIOError):
        return False
    if failed_forks:
        return True
    uid, tasks = os.getuid(), 0
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            if os.stat(f"/proc/{pid}").st_uid == uid:  # the limit counts this uid's tasks
                tasks += len(os.listdir(f"/proc/{pid}/task"))
        except OSError:  # gone meanwhile
            continue
    return tasks >= processes - 1


def run_code(cells: list, code: str, processes: int, said: int) -> int:
    """In the code's process: the cells, then ``code``; its exit code (a ``SystemExit`` of the
    code's goes up to the interpreter, which ends as it would end ``python file.py``). Only this
    process says what ended it on ``said``, not a child the code forked that gets here too."""
    me = os.getpid()
    count_failed_forks()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    sys.argv = [""]
    random.seed(0)  # a replayed cell draws the numbers it drew the first time
    replay(cells, namespace)
    failed_forks.clear()  # the earlier cells' are not this call's
    try:
        run_cell(code, f"<cell {len(cells) + 1}>", namespace, show_last=True)
    except SystemExit:
        raise
    except BaseException as exc:
        limit = "memory" if isinstance(exc, MemoryError) else None
        limit = "processes" if at_process_limit(exc, processes) else limit
        last = traceback.format_exception_only(type(exc), exc)[-1].strip()
        if os.getpid() == me:
            with contextlib.suppress(OSError):
                os.write(said, json.dumps({"exception": last[:200], "limit": limit}).encode() + b"\n")
        print_exception(exc, namespace)
        return 1
    return 0


def supervise(pid: int, said: int) -> dict:
    """Wait for the code's process: how it ended, its CPU time, what it said."""
    os.waitid(os.P_PID, pid, os.WEXITED | os.WNOWAIT)  # a zombie still: its CPU time is readable
    report = {"cpu_s": None, "said": None}
    # the scheduler's own runtime (ns); /proc/PID/stat's utime + stime are sampled at clock
    # ticks and read up to 8% low (0.92 s at the 1 s limit's SIGXCPU, at load 3 on 2 cores):
    # the fallback without schedstat
    with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/schedstat") as f:
        report["cpu_s"] = int(f.read().split()[0]) / 1e9
    if report["cpu_s"] is None:
        with contextlib.suppress(OSError, IndexError, ValueError), open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
            report["cpu_s"] = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    status = os.waitpid(pid, 0)[1]
    if os.WIFSIGNALED(status):
        report["signal"] = os.WTERMSIG(status)
    else:
        report["exit"] = os.WEXITSTATUS(status)
    os.set_blocking(said, False)  # a process the code left may still hold the pipe open
    with contextlib.suppress(Exception):  # whatever the code may have written there instead
        said = json.loads(os.read(said, 1 << 12).split(b"\n")[0])
        report["said"] = {"exception": str(said["exception"])[:200], "limit": str(said["limit"])}
    return report


def main() -> int:
    report = int(sys.argv[1])
    try:
        request = json.loads(sys.stdin.buffer.read())
        cells, code = list(request["cells"]), str(request["code"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
        processes = setup(sys.argv[2:9])
        said_r, said_w = os.pipe()
        set_dumpable(False)
        pid = os.fork()
    except Exception as exc:  # nothing of the model's has run yet
        os.write(report, json.dumps({"setup": f"{type(exc).__name__}: {exc}"}).encode())
        os._exit(0)
    if pid == 0:  # the code's process
        os.close(report)
        os.close(said_r)
        set_dumpable(True)
        return run_code(cells, code, processes, said_w)
    os.close(said_w)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)  # the output pipe ends with the code's processes, not with this one
    os.dup2(devnull, 2)
    os.write(report, json.dumps(supervise(pid, said_r)).encode())
    os._exit(0)


if __name__ == "__main__":
    sys.exit(main())
