"""Run a Python file in the code sandbox exactly as a rollout's ``python`` tool call would:
``grpo-fast sandbox FILE.py [--timeout S] [--memory-mb M]`` (or ``python -m grpo_fast.tools.sandbox``).

Prints on stdout what the model would be shown (the ```` ```output ```` block the ``python``
environment inserts), then one status line on stderr (``ok: ran to completion in 0.12 s``,
``timeout: stopped at the 10 s wall-clock limit; every process of the call killed``, ...).

Exit code: 0 when the code ran to completion, 1 when it failed or hit a limit (the status line
names which), 2 for a usage error (no such file, not a regular file, a bad limit, no bubblewrap:
one line). The code's control characters are escaped and its fences too: what it prints stays
inside the block.
"""

from __future__ import annotations

import argparse
import os
import stat
import sys

from grpo_fast.env.base import OutputLimit, ToolCall
from grpo_fast.env.python import PythonEnvironment
from grpo_fast.errors import UserError, cli_errors
from grpo_fast.sandbox import Limits

MAX_FILE_BYTES = 16 << 20  # a tool call's cell is a few kB; past this it is not one

_KINDS = {
    stat.S_IFIFO: "FIFO",
    stat.S_IFCHR: "character device",
    stat.S_IFBLK: "block device",
    stat.S_IFSOCK: "socket",
}


def _read(path: str) -> str:
    """The file's text; a ``UserError`` naming it when it is no regular UTF-8 file of at most
    ``MAX_FILE_BYTES`` (a FIFO or a device is refused before it is read: it could block or never end)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)  # a FIFO without a writer: no wait
    except FileNotFoundError:
        raise UserError(f"{path}: no such file") from None
    except (OSError, ValueError) as exc:
        raise UserError(f"{path}: cannot read it ({getattr(exc, 'strerror', None) or exc})") from None
    try:
        mode = os.fstat(fd).st_mode
        if stat.S_ISDIR(mode):
            raise UserError(f"{path}: a directory, not a Python file")
        if not stat.S_ISREG(mode):
            raise UserError(f"{path}: not a regular file (a {_KINDS.get(stat.S_IFMT(mode), 'special file')})")
        data = b""
        while len(data) <= MAX_FILE_BYTES and (chunk := os.read(fd, 1 << 20)):
            data += chunk
    except OSError as exc:
        raise UserError(f"{path}: cannot read it ({exc.strerror})") from None
    finally:
        os.close(fd)
    if len(data) > MAX_FILE_BYTES:
        raise UserError(f"{path}: larger than {MAX_FILE_BYTES >> 20} MiB, not one cell of code")
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise UserError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


@cli_errors
def main(argv: list[str] | None = None, prog: str = "python -m grpo_fast.tools.sandbox") -> int:
    defaults = Limits()
    p = argparse.ArgumentParser(
        prog=prog,
        description="Run a Python file in the code sandbox as a rollout's tool call would: print "
        "what the model would see, then one status line (exit 0: ran to completion, 1: failed or "
        "hit a limit, 2: usage error).",
    )
    p.add_argument("file", help="the Python file (the code of one ```python block)")
    p.add_argument(
        "--timeout", type=float, default=defaults.timeout_s, help="wall-clock seconds (default %(default)s)"
    )
    p.add_argument(
        "--memory-mb", type=int, default=defaults.memory_mb, help="memory per process (default %(default)s)"
    )
    p.add_argument(
        "--max-output-chars", type=int, default=None, help="cut the output shown at this many characters"
    )
    p.add_argument(
        "--unsafe", action="store_true", help="no namespaces, for trusted code only (docs/tools.md)"
    )
    args = p.parse_args(argv)
    code = _read(args.file)
    try:
        limits = Limits(timeout_s=args.timeout, memory_mb=args.memory_mb)
        cap = OutputLimit(max_chars=args.max_output_chars)
    except ValueError as exc:
        raise UserError(str(exc)) from None
    env = PythonEnvironment(limits, isolation="unsafe" if args.unsafe else "bwrap", workers=1)
    sandboxed = env.sandbox.run(code)
    shown = env.result_for(ToolCall(code, None), sandboxed, cap)
    sys.stdout.write(shown.text.lstrip("\n"))
    sys.stdout.flush()
    print(sandboxed.status_line(), file=sys.stderr)
    return 0 if sandboxed.ok else 1


if __name__ == "__main__":
    sys.exit(main())
