"""The code sandbox (grpo_fast.sandbox.Sandbox, bubblewrap): hostile code is contained — each case
ends with one status and leaves nothing behind (no process, no file on the host) — and ordinary
code gives the model what a Python REPL would show.

Timeouts here are generous where the call should end by itself (the interpreter starts in
≈0.1 s idle, seconds on a loaded 2-core machine) and short where the timeout is the behaviour."""

from __future__ import annotations

import ast
import json
import math
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import textwrap
import time
import uuid
from pathlib import Path

import pytest

from grpo_fast.sandbox import Limits, Sandbox, SandboxUnavailable, bwrap_status
from grpo_fast.sandbox import sandbox as sandbox_module

ROOT = Path(__file__).resolve().parents[1]
SLACK_S = 60.0  # an ordinary call on a loaded machine: far above the ≈0.1-0.3 s it takes idle

_, BWRAP_PROBLEM = bwrap_status()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"no sandbox here: {BWRAP_PROBLEM}")


@pytest.fixture(scope="module")
def box():
    if BWRAP_PROBLEM is not None:
        pytest.skip(f"no sandbox here: {BWRAP_PROBLEM}")
    return Sandbox(Limits(timeout_s=SLACK_S), workers=2)


def _my_sandbox_uids() -> range:
    """As root: the uids this process's calls run as (see sandbox.UID_BASE)."""
    base = sandbox_module.UID_BASE + (os.getpid() % 2**22) * 256
    return range(base, base + 256)


def _host_processes() -> list[tuple[int, int, str]]:
    out = []
    for pid in (p for p in os.listdir("/proc") if p.isdigit()):
        try:
            uid = os.stat(f"/proc/{pid}").st_uid
            cmdline = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        out.append((int(pid), uid, cmdline))
    return out


def assert_nothing_left(marker: str | None = None, tmpdir: Path | None = None) -> None:
    """No process of a call is alive (its uid, or ``marker`` in its command line), and no
    working directory of the unsafe mode is left in ``tmpdir``."""
    uids = _my_sandbox_uids()
    left = [
        (pid, cmd[:80])
        for pid, uid, cmd in _host_processes()
        if (uid in uids and os.geteuid() == 0) or (marker is not None and marker in cmd)
    ]
    assert left == []
    if tmpdir is not None:
        assert not list(tmpdir.glob("grpo-fast-sandbox-*"))


# ----------------------------------------------------------------------------------------------
# Hostile code: contained, one status, nothing left
# ----------------------------------------------------------------------------------------------


@needs_bwrap
def test_an_infinite_loop_is_killed_at_the_wall_clock_limit():
    box = Sandbox(Limits(timeout_s=2.0, cpu_s=600), workers=1)
    r = box.run("while True:\n    pass")
    assert r.status == "timeout" and r.exit_code is None
    assert r.status_line() == "timeout: stopped at the 2 s wall-clock limit; every process of the call killed"
    assert 2.0 <= r.seconds < 2.0 + SLACK_S
    assert_nothing_left()


@needs_bwrap
def test_cpu_time_is_limited_per_process():
    box = Sandbox(Limits(timeout_s=SLACK_S + 30, cpu_s=1), workers=1)
    r = box.run("while True:\n    pass")
    assert (r.status, r.exit_code, r.signal) == ("cpu", None, signal.SIGXCPU)
    assert r.status_line().startswith("cpu: killed at the 1 s CPU-time limit after ")
    assert_nothing_left()


@needs_bwrap
def test_a_memory_bomb_stops_at_the_memory_limit(box):
    code = "chunks = []\ntry:\n    while True:\n        chunks.append(bytearray(50 << 20))\nfinally:\n    print(len(chunks))"
    r = box.run(code)
    assert r.status == "memory" and r.output.rstrip().endswith("MemoryError")
    assert 10 <= int(r.output.split()[0]) <= 1024 // 50  # 50 MB blocks: stopped within 1024 MB
    assert r.status_line().startswith("memory: MemoryError at the 1024 MB memory limit after ")
    assert_nothing_left()


REFUSED_THEN_REAPED = """import os, time
try:
    while True:
        if os.fork() == 0:
            time.sleep(0.5)
            os._exit(0)
except BlockingIOError:
    time.sleep(1.0)
    while True:
        try:
            os.wait()
        except ChildProcessError:
            break
    raise
"""


@needs_bwrap
def test_a_refused_fork_is_the_process_limit_after_the_children_are_gone(box):
    """The fork bomb's race made deterministic: by the time the refused fork's exception reaches
    the runner, every child has exited and been reaped (a fork bomb's children exit as their own
    forks fail: CI saw "error" there). Planted: only the task count read at the end → "error"."""
    r = box.run(REFUSED_THEN_REAPED)
    assert r.status == "processes", (r.status, r.output[-300:])
    assert_nothing_left()


@needs_bwrap
def test_a_fork_bomb_stops_at_the_process_limit(box):
    r = box.run("import os\nwhile True:\n    os.fork()")
    assert r.status == "processes", r.output[-500:]
    assert "BlockingIOError: [Errno 11] Resource temporarily unavailable" in r.output
    # the runner's os.fork wrapper is not the code's (ed0dfd1: 'File "<string>", line 112, in fork')
    assert '"<string>"' not in r.output and ", in fork\n" not in r.output, r.output[-500:]
    assert r.status_line().startswith("processes: a new process failed at the 16-process limit after ")
    assert_nothing_left()


@needs_bwrap
def test_no_connection_reaches_a_listener_on_the_hosts_loopback(box):
    listener = socket.socket()
    listener.bind(("127.0.0.1", 0))
    listener.listen(8)
    listener.settimeout(0.5)
    port = listener.getsockname()[1]
    try:
        r = box.run(
            f"import socket\nsocket.create_connection(('127.0.0.1', {port}), timeout=5).sendall(b'hi')"
        )
        assert r.status == "error"
        assert "ConnectionRefusedError" in r.status_line()  # its own loopback: nobody listens there
        with pytest.raises(TimeoutError):
            listener.accept()
    finally:
        listener.close()
    assert_nothing_left()


@needs_bwrap
def test_host_files_can_be_neither_read_nor_written(box, tmp_path):
    secret = tmp_path / "secret.txt"
    secret.write_text("host secret")
    tag = uuid.uuid4().hex
    code = textwrap.dedent(
        f"""
        import os, site
        for path in [{str(secret)!r}, "/etc/passwd", "/etc/hostname", "/root/.bashrc"]:
            try:
                print("read", path, open(path).read())
            except OSError as exc:
                print("refused", path, type(exc).__name__)
        # the checkout's files (its directory itself shows when the venv lives inside it)
        print("tree", any(os.path.exists(p) for p in {[str(ROOT / n) for n in ("README.md", "grpo_fast", ".git")]!r}),
              os.listdir("/"))
        for path in [{str(tmp_path / "pwned.txt")!r}, site.getsitepackages()[0] + "/pwned-{tag}.py",
                     "/pwned-{tag}", "/tmp/pwned-{tag}"]:
            try:
                open(path, "w").write("x")
                print("wrote", path)
            except OSError as exc:
                print("refused", path, type(exc).__name__)
        """
    )
    r = box.run(code)
    assert r.status == "ok", r.output
    assert "host secret" not in r.output and "read " not in r.output
    assert f"refused {secret} FileNotFoundError" in r.output
    assert "tree False" in r.output and "'etc'" not in r.output and "'home'" not in r.output
    assert "OSError" in r.output or "Read-only file system" not in r.output  # the reason is named
    assert f"refused {tmp_path / 'pwned.txt'} FileNotFoundError" in r.output
    assert f"pwned-{tag}.py PermissionError" in r.output or f"pwned-{tag}.py OSError" in r.output
    assert f"wrote /tmp/pwned-{tag}" in r.output  # its own /tmp
    assert not (tmp_path / "pwned.txt").exists() and not Path(f"/tmp/pwned-{tag}").exists()
    assert not list(Path(sys.prefix).rglob(f"pwned-{tag}*"))
    assert_nothing_left()


@needs_bwrap
def test_of_a_directory_above_the_interpreter_only_the_path_down_to_it_shows(box):
    """docs/tools.md's filesystem row: an interpreter under /root (pyenv) or in the checkout (a
    virtual environment) is bound where it is, read-only; each directory above it holds nothing
    but the path down to it (here: /root holds .pyenv alone, the checkout .venv alone)."""
    prefixes = box._prefixes
    above: dict[str, set[str]] = {}
    for prefix in prefixes:
        parts = Path(prefix).parts
        for i in range(2, len(parts)):
            parent = str(Path(*parts[:i]))
            if not any(parent == p or parent.startswith(p + "/") for p in prefixes):
                above.setdefault(parent, set()).add(parts[i])
    r = box.run(f"import os\nprint({{d: sorted(os.listdir(d)) for d in {sorted(above)!r}}})")
    assert r.status == "ok", r.output
    assert ast.literal_eval(r.output) == {d: sorted(names) for d, names in above.items()}


@needs_bwrap
def test_the_hosts_environment_is_not_visible(box, monkeypatch):
    secret = uuid.uuid4().hex
    monkeypatch.setenv("GRPO_FAST_TEST_SECRET", secret)
    code = textwrap.dedent(
        """
        import os
        print(dict(os.environ))
        for pid in os.listdir("/proc"):
            if pid.isdigit():
                try:
                    print(pid, open(f"/proc/{pid}/environ", "rb").read())
                except OSError as exc:
                    print(pid, type(exc).__name__)
        """
    )
    r = box.run(code)
    assert r.status == "ok", r.output
    assert secret not in r.output and "GRPO_FAST_TEST_SECRET" not in r.output
    assert "'HOME': '/tmp'" in r.output  # the sandbox's own environment
    assert_nothing_left()


# In a fresh, small process (the package's __init__, which imports torch, left out: the sandbox
# needs only the standard library), so that its peak RSS growth is the call's alone.
GIGABYTE_OF_OUTPUT = f"""
import json, os, resource, sys, types
package = types.ModuleType("grpo_fast")
package.__path__ = [{str(ROOT / "grpo_fast")!r}]
sys.modules["grpo_fast"] = package
from grpo_fast.sandbox import Limits, Sandbox
box = Sandbox(Limits(timeout_s={SLACK_S}), workers=1)
before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10
r = box.run("import sys\\nchunk = 'x' * (1 << 20)\\nfor _ in range(1024):\\n    sys.stdout.write(chunk)")
growth = (resource.getrusage(resource.RUSAGE_SELF).ru_maxrss << 10) - before
print(json.dumps(dict(status=r.status, exit_code=r.exit_code, size=len(r.output), xs=set(r.output) == {{"x"}},
                      line=r.status_line(), growth=growth, pid=os.getpid())))
"""


@needs_bwrap
def test_a_gigabyte_of_output_is_cut_at_the_limit_in_bounded_memory():
    res = subprocess.run(
        [sys.executable, "-c", GIGABYTE_OF_OUTPUT], capture_output=True, text=True, timeout=300
    )
    assert res.returncode == 0, res.stderr
    out = json.loads(res.stdout)
    assert (out["status"], out["exit_code"], out["size"], out["xs"]) == ("output", None, 1 << 20, True)
    assert out["line"].startswith("output: stopped after 1,048,576 bytes of output (the output limit)")
    assert out["growth"] < 16 << 20  # the 1 MiB kept (+ a 64 KiB read), not the gigabyte
    base = sandbox_module.UID_BASE + (out["pid"] % 2**22) * 256
    assert not [pid for pid, uid, _ in _host_processes() if base <= uid < base + 256]


@needs_bwrap
def test_a_child_that_outlives_its_parent_is_killed_at_the_end_of_the_call(box):
    marker = f"grpo-fast-orphan-{uuid.uuid4().hex}"
    code = textwrap.dedent(
        f"""
        import os, sys
        if os.fork() == 0:
            os.setsid()
            if os.fork() == 0:  # a daemon: new session, parent gone, stdout still open
                os.execv(sys.executable, [sys.executable, "-c", "import time; time.sleep(600)", {marker!r}])
            os._exit(0)
        os.wait()
        print("parent done")
        """
    )
    try:
        r = box.run(code)
        assert r.status == "ok" and r.output == "parent done\n"  # ended with its main process, not at 600 s
        assert_nothing_left(marker)
    finally:
        _kill_marked(marker)


@needs_bwrap
def test_the_sandbox_dies_with_its_parent(tmp_path):
    marker = f"grpo-fast-parent-{uuid.uuid4().hex}"
    parent_src = textwrap.dedent(
        f"""
        from grpo_fast.sandbox import Limits, Sandbox
        box = Sandbox(Limits(timeout_s=600), workers=1)
        print("started", flush=True)
        box.run("import os, sys; os.execv(sys.executable, [sys.executable, '-c', 'import time; time.sleep(600)', {marker[::-1]!r}[::-1]])")
        """
    )
    parent = subprocess.Popen([sys.executable, "-c", parent_src], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline() == "started\n"
        assert marker not in Path(f"/proc/{parent.pid}/cmdline").read_text()  # only the sandbox's has it
        deadline = time.monotonic() + SLACK_S
        while not any(marker in cmd for _, _, cmd in _host_processes()) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert any(marker in cmd for _, _, cmd in _host_processes())
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        while any(marker in cmd for _, _, cmd in _host_processes()) and time.monotonic() < deadline + 30:
            time.sleep(0.05)
        assert not any(marker in cmd for _, _, cmd in _host_processes())
    finally:
        parent.kill()
        parent.wait()
        _kill_marked(marker)


def _kill_marked(marker: str) -> None:
    """Clean up after a failure: what a planted bug let live would sleep 600 s."""
    for pid, _, cmd in _host_processes():
        if marker in cmd:
            os.kill(pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------------
# Ordinary code: what the model sees
# ----------------------------------------------------------------------------------------------


@needs_bwrap
def test_stdout_and_stderr_in_the_order_written_and_the_last_expression_shown(box):
    r = box.run("import sys\nprint('a')\nprint('b', file=sys.stderr)\nprint('c')\n6 * 7")
    assert (r.output, r.status, r.exit_code) == ("a\nb\nc\n42\n", "ok", 0)
    assert r.status_line().startswith("ok: ran to completion in ")
    assert box.run("x = 1\nNone").output == ""  # a None value is not shown


@needs_bwrap
def test_numpy_and_sympy_import(box):
    r = box.run("import numpy as np\nprint(int(np.arange(10).sum()), np.linalg.inv(np.eye(2)).tolist())")
    assert r.output == "45 [[1.0, 0.0], [0.0, 1.0]]\n", r.output
    r = box.run("import sympy\nx = sympy.Symbol('x')\nsympy.factor(x**2 - 1)")
    assert r.output == "(x - 1)*(x + 1)\n", r.output


@needs_bwrap
def test_an_exception_shows_its_traceback_from_the_code_on(box):
    r = box.run("def f(n):\n    return 1 / n\n\nf(0)")
    assert (r.status, r.exit_code) == ("error", 1)
    assert r.output.startswith('Traceback (most recent call last):\n  File "<cell 1>", line 4, in <module>')
    assert '  File "<cell 1>", line 2, in f\n    return 1 / n' in r.output
    assert r.output.rstrip().endswith("ZeroDivisionError: division by zero")
    assert "_runner" not in r.output and "run_cell" not in r.output  # none of the runner's frames
    assert r.status_line().startswith("error: exit code 1 (ZeroDivisionError: division by zero) after ")
    r = box.run("x = (")
    assert r.status == "error" and r.output.rstrip().endswith("SyntaxError: '(' was never closed")


@pytest.mark.parametrize(
    ("code", "status", "exit_code", "sig", "output"),
    [
        ("import sys; sys.exit(3)", "error", 3, None, ""),
        ("import sys; sys.exit(0)", "ok", 0, None, ""),
        ("import sys; sys.exit('bad input')", "error", 1, None, "bad input\n"),
        ("import os; os._exit(0)", "ok", 0, None, ""),
        ("import os, signal; os.kill(os.getpid(), signal.SIGSEGV)", "signal", None, signal.SIGSEGV, ""),
    ],
    ids=["exit-3", "exit-0", "exit-message", "os-exit", "segv"],
)
@needs_bwrap
def test_exit_codes(box, code, status, exit_code, sig, output):
    r = box.run(code)
    assert (r.status, r.exit_code, r.signal, r.output) == (status, exit_code, sig, output)


# Exit codes that look like the runner's old ones (113 memory, 114 processes, 115 set-up) or like a
# signal's 128 + N (152: SIGXCPU, the CPU-time limit; 137: SIGKILL; 139: SIGSEGV); -1 is 255.
CHOSEN_EXIT_CODES = (-1, 113, 114, 115, 137, 139, 152, 255)


@needs_bwrap
def test_an_exit_code_the_code_chose_is_named_never_a_limit_or_a_signal(box):
    """ed0dfd1 read the status from bubblewrap's exit code: sys.exit(113) was "memory", 152 "cpu",
    137 "killed by SIGKILL", -1 "killed by signal 127". Planted: a status from "exit" > 128 → signal."""
    results = box.run_batch([f"import sys; sys.exit({n})" for n in CHOSEN_EXIT_CODES])
    for n, r in zip(CHOSEN_EXIT_CODES, results):
        assert (r.status, r.exit_code, r.signal) == ("error", n & 0xFF, None), (n, r)
        assert r.status_line().startswith(f"error: exit code {n & 0xFF} after "), (n, r)


@needs_bwrap
def test_a_signal_the_code_sends_itself_is_a_signal_never_the_cpu_limit(box):
    """SIGXCPU is what the CPU-time limit sends, but this one came from the code, far under the
    limit's CPU time. Planted: "cpu" on SIGXCPU alone."""
    kill = "import os, signal\nos.kill(os.getpid(), signal.{})"
    xcpu, sigkill = box.run_batch([kill.format("SIGXCPU"), kill.format("SIGKILL")])
    assert (xcpu.status, xcpu.exit_code, xcpu.signal) == ("signal", None, signal.SIGXCPU)
    assert xcpu.status_line().startswith("signal: killed by SIGXCPU after ")
    assert (sigkill.status, sigkill.signal) == ("signal", signal.SIGKILL)


# Write a report that says "ran to completion" wherever the code can reach, then kill the runner's
# supervisor so that only a forged report could be read.
FORGE_THE_REPORT = """
import json, os, signal
fake = json.dumps({"exit": 0, "cpu_s": 0.0, "said": None}).encode()
for fd in range(3, 64):
    try:
        os.write(fd, fake)
    except OSError:
        pass
for n in range(64):
    try:
        fd = os.open(f"/proc/{os.getppid()}/fd/{n}", os.O_WRONLY | os.O_NONBLOCK)
        os.write(fd, fake)
    except OSError:
        pass
os.kill(os.getppid(), signal.SIGKILL)
"""


@needs_bwrap
def test_the_code_can_neither_forge_the_runners_report_nor_hide_that_it_killed_it(box):
    """The report's pipe is closed in the code's process before its code runs, and the supervisor
    that holds it is not dumpable (no /proc/PID/fd). Planted: the code's process keeps the pipe →
    the fake report is read and the call is "ok"."""
    r = box.run(FORGE_THE_REPORT)
    assert (r.status, r.exit_code, r.signal) == ("error", None, None), r
    assert r.status_line().startswith("error: the sandbox's runner ended without a report"), r
    assert_nothing_left()


# The sandbox as user nobody, from a copy of the package any user can read (the checkout, or the
# pytest folders, may be closed to others); the system's interpreter (root's may be, too).
AS_NOBODY = """
import sys, types
package = types.ModuleType("grpo_fast")
package.__path__ = [{package!r}]
sys.modules["grpo_fast"] = package
from grpo_fast.sandbox import Limits, Sandbox, SandboxUnavailable
try:
    box = Sandbox(Limits(timeout_s=60), workers=1, python=sys.executable)
except SandboxUnavailable as exc:
    print("unavailable:", exc)
    sys.exit(0)
print(box.run({code!r}).status_line())
"""
SYSTEM_PYTHON = "/usr/bin/python3"


@needs_bwrap
def test_as_another_user_the_runners_report_is_out_of_the_codes_reach_too():
    """As root, the runner's drop to the call's uid already leaves its supervisor not dumpable; as
    another user (a user namespace: one uid for bubblewrap, the runner and the code) only the
    runner's prctl does. Planted: no set_dumpable(False) → the code writes its report through
    /proc/PPID/fd and the call is "ok"."""
    setpriv = shutil.which("setpriv")
    if os.geteuid() != 0 or setpriv is None or not os.access(SYSTEM_PYTHON, os.X_OK):
        pytest.skip("needs root, setpriv (util-linux) and /usr/bin/python3 to run as nobody")
    folder = Path(tempfile.mkdtemp(prefix="grpo-fast-as-nobody-"))
    try:
        folder.chmod(0o755)
        package = folder / "grpo_fast"
        shutil.copytree(
            ROOT / "grpo_fast" / "sandbox", package / "sandbox", ignore=shutil.ignore_patterns("__pycache__")
        )
        shutil.copy(ROOT / "grpo_fast" / "errors.py", package)
        script = AS_NOBODY.format(package=str(package), code=FORGE_THE_REPORT)
        nobody = [setpriv, "--reuid=65534", "--regid=65534", "--clear-groups", SYSTEM_PYTHON, "-c", script]
        res = subprocess.run(nobody, capture_output=True, text=True, timeout=300, cwd="/")
    finally:
        shutil.rmtree(folder)
    if res.stdout.startswith("unavailable:"):  # no unprivileged user namespaces here
        pytest.skip(res.stdout.strip())
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith("error: the sandbox's runner ended without a report"), res.stdout


THREAD_AFTER_MAIN = """
import threading, time
def late():
    time.sleep(0.5)
    print("late")
threading.Thread(target=late).start()
print("main done")
"""


@needs_bwrap
def test_a_thread_left_running_is_waited_for_within_the_timeout(box):
    """The call ends as ``python file.py`` does: after its non-daemon threads (ed0dfd1 cut them off
    and said "ok"). One that never ends is the timeout. Planted: os._exit once the cell is done."""
    r = box.run(THREAD_AFTER_MAIN)
    assert (r.status, r.output) == ("ok", "main done\nlate\n")
    forever = (
        "import threading, time\nthreading.Thread(target=time.sleep, args=(600,)).start()\nprint('main done')"
    )
    r = Sandbox(Limits(timeout_s=2.0, cpu_s=600), workers=1).run(forever)
    assert r.status == "timeout" and "main done\n".startswith(r.output)  # (a slow start: no output)
    assert_nothing_left()


@needs_bwrap
def test_control_characters_of_the_output_are_escaped(box):
    """NUL, ESC (a terminal's title, clear, cursor sequences), a carriage return, a C1 CSI and a
    bidi override reach neither a terminal nor the model raw; tab and newline stay. The status
    line's exception is escaped too. Planted: the output decoded as it came."""
    code = "import sys\nsys.stdout.write('a\\x00b\\x1b]0;title\\x07c\\r\\n\\tx\\u202ey\\x9b2J\\n')\nraise ValueError('\\x1b[2J')"
    r = box.run(code)
    assert r.output.startswith("a\\x00b\\x1b]0;title\\x07c\\x0d\n\tx\\u202ey\\x9b2J\nTraceback"), r.output
    assert r.output.rstrip().endswith("ValueError: \\x1b[2J")
    assert r.status_line().startswith("error: exit code 1 (ValueError: \\x1b[2J) after ")


@needs_bwrap
def test_earlier_cells_are_replayed_silently_so_state_persists(box):
    history = ["import random\nx = 41\nprint('first turn')", "1 / 0", "y = random.random()\nprint(y)"]
    r = box.run("import random as r2\nprint(x + 1, y == r2.Random(0).random())", history=history)
    assert (r.output, r.status) == ("42 True\n", "ok")  # no replayed output; the error skipped
    files = box.run("print(open('/tmp/f').read())", history=["open('/tmp/f', 'w').write('kept')"])
    assert files.output == "kept\n"


@needs_bwrap
def test_a_batch_runs_concurrently_in_order_each_call_in_its_own_namespace(box):
    code = "import os, time\nstart = time.monotonic()\ntime.sleep(1.0)\nprint({k}, os.getpid(), start, time.monotonic())"
    results = box.run_batch([code.format(k=k) for k in range(4)])
    rows = [r.output.split() for r in results]
    assert [int(row[0]) for row in rows] == [0, 1, 2, 3]
    assert {row[1] for row in rows} == {"3"}  # pid 3 in its own pid namespace (bwrap 1, the runner 2)
    spans = [(float(row[2]), float(row[3])) for row in rows]
    assert most_at_once(spans) == 2  # the pool's width: two ran at once, never three
    assert_nothing_left()


def most_at_once(spans: list[tuple[float, float]]) -> int:
    """The most intervals ``(start, end)`` open at one time (an end before a start at a tie)."""
    events = sorted([(start, 1) for start, _ in spans] + [(end, -1) for _, end in spans])
    now = most = 0
    for _, step in events:
        now += step
        most = max(most, now)
    return most


# ----------------------------------------------------------------------------------------------
# Set-up: no bubblewrap, limits, the unsafe opt-in
# ----------------------------------------------------------------------------------------------


def test_without_bubblewrap_the_sandbox_refuses_in_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox()
    assert str(info.value) == (
        "the code sandbox cannot run here: bubblewrap (bwrap) is not installed; install it: "
        "apt-get install -y bubblewrap"
    )


def test_bad_limits_are_named():
    with pytest.raises(ValueError, match="sandbox limit memory_mb must be a positive number, got 0"):
        Limits(memory_mb=0)
    with pytest.raises(ValueError, match="sandbox limit processes must be >= 4, got 2"):
        Limits(processes=2)
    with pytest.raises(ValueError, match=r"cpu_s must be a whole number of seconds >= 1, got 0\.5"):
        Limits(cpu_s=0.5)
    # ed0dfd1: inf and 1e30 passed, then OverflowError (ceil, select); 2**44 MB passed, then the
    # runner's setrlimit failed and the trial call blamed bubblewrap; 1.5 MB failed at `<<`
    for value in (math.inf, 1e30, math.nan):
        with pytest.raises(ValueError, match="sandbox limit timeout_s must be"):
            Limits(timeout_s=value)
    with pytest.raises(ValueError, match="sandbox limit memory_mb must be under 8,796,093,022,207, got"):
        Limits(memory_mb=17592186044416)
    with pytest.raises(ValueError, match=r"sandbox limit memory_mb must be a whole number, got 1\.5"):
        Limits(memory_mb=1.5)
    with pytest.raises(ValueError, match="isolation must be one of bwrap, unsafe, got 'none'"):
        Sandbox(isolation="none")


@needs_bwrap
def test_limits_the_kernel_refuses_are_named_not_blamed_on_bubblewrap():
    """The runner's set-up failure comes back in its report. ed0dfd1 said "bubblewrap cannot run the
    code sandbox here … forbids namespaces". 2**31 files: above any fs.nr_open (at most 2**30)."""
    with pytest.raises(SandboxUnavailable) as info:
        Sandbox(Limits(open_files=2**31), workers=1)
    assert str(info.value).startswith(
        "the code sandbox cannot set a call's user or limits here: ValueError: "
    )


def test_unsafe_isolation_runs_code_with_the_limits_and_cleans_up(tmp_path, monkeypatch):
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # where its working directories go
    box = Sandbox(Limits(timeout_s=SLACK_S), isolation="unsafe", workers=1)
    r = box.run(
        "import os\nprint(sorted(os.environ)[:3], os.getcwd() == os.environ['HOME'])\nx = bytearray(2 << 30)"
    )
    assert r.status == "memory" and "['HOME', 'LANG', 'MKL_NUM_THREADS'] True" in r.output
    assert box.run("print(x)", history=["x = 5"]).output == "5\n"
    quick = Sandbox(Limits(timeout_s=1.0), isolation="unsafe", workers=1).run("while True:\n    pass")
    assert quick.status == "timeout"
    assert quick.status_line() == "timeout: stopped at the 1 s wall-clock limit; its process group killed"
    assert_nothing_left(tmpdir=tmp_path)
