"""The program every sandboxed call runs (``python -c`` with this file's text; never imported).

argv: ``uid gid memory_bytes cpu_s processes file_bytes open_files`` (uid -1: keep the uid).
stdin: ``{"cells": [earlier code, ...], "code": "the code to run"}`` as JSON.

It drops to ``uid`` (a root caller's sandbox keeps CAP_SETUID for this one step), sets its own
resource limits (inherited by every process the code starts), then replays the earlier cells with
their output sent to /dev/null and their exceptions ignored, then runs ``code`` as the
``__main__`` module, printing the value of a last bare expression as a REPL does. stdout and
stderr are one pipe, unbuffered (``-u``): the text is in the order it was written.

Exit code: the code's own (``sys.exit(n)``), 0 when it ran to its end, 1 after an uncaught
exception (its traceback, the runner's frames left out, on stderr), ``EXIT_MEMORY`` after a
``MemoryError``, ``EXIT_PROCESSES`` after a failed fork at the process limit, ``EXIT_SETUP``
when the runner itself could not start. Standard library only.
"""

import ast
import contextlib
import json
import linecache
import os
import random
import resource
import sys
import traceback

EXIT_MEMORY = 113
EXIT_PROCESSES = 114
EXIT_SETUP = 115


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
        (resource.RLIMIT_NPROC, processes, processes),
        (resource.RLIMIT_FSIZE, file_bytes, file_bytes),
        (resource.RLIMIT_NOFILE, open_files, open_files),
        (resource.RLIMIT_CORE, 0, 0),
    )
    for what, soft, hard in limits:
        resource.setrlimit(what, (soft, hard))
    return processes


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


def print_exception(exc: BaseException, name: str) -> None:
    """The traceback from the cell's first frame on (none of the runner's frames)."""
    tb = exc.__traceback__
    while tb is not None and tb.tb_frame.f_code.co_filename != name:
        tb = tb.tb_next
    sys.stderr.write("".join(traceback.format_exception(type(exc), exc, tb)))
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


def main() -> int:
    try:
        processes = setup(sys.argv[1:8])
        request = json.loads(sys.stdin.buffer.read())
        cells, code = list(request["cells"]), str(request["code"])
        stdin = os.open(os.devnull, os.O_RDONLY)
        os.dup2(stdin, 0)
        os.close(stdin)
    except Exception as exc:  # nothing of the model's has run yet
        print(f"sandbox setup failed: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_SETUP
    count_failed_forks()
    namespace = {"__name__": "__main__", "__builtins__": __builtins__}
    sys.argv = [""]
    random.seed(0)  # a replayed cell draws the numbers it drew the first time
    replay(cells, namespace)
    failed_forks.clear()  # the earlier cells' are not this call's
    name = f"<cell {len(cells) + 1}>"
    try:
        run_cell(code, name, namespace, show_last=True)
    except SystemExit as exc:
        if exc.code is None or isinstance(exc.code, int):
            return exc.code or 0
        print(exc.code, file=sys.stderr)
        return 1
    except MemoryError as exc:
        print_exception(exc, name)
        return EXIT_MEMORY
    except BaseException as exc:
        print_exception(exc, name)
        return EXIT_PROCESSES if at_process_limit(exc, processes) else 1
    return 0


if __name__ == "__main__":
    code = main()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)
