"""``grpo-fast sandbox FILE.py``: what the model would see on stdout, one status line on stderr,
exit 0 / 1 / 2; and ``grpo-fast doctor``'s sandbox line."""

from __future__ import annotations

import contextlib
import io
import os
import re
import resource
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st

from grpo_fast import cli
from grpo_fast.env.base import OutputLimit, ToolCall
from grpo_fast.env.python import PythonEnvironment
from grpo_fast.errors import UserError
from grpo_fast.sandbox import SandboxResult, bwrap_status
from grpo_fast.sandbox import sandbox as sandbox_module
from grpo_fast.tools import doctor
from grpo_fast.tools import sandbox as sandbox_tool

ROOT = Path(__file__).resolve().parents[1]
_, BWRAP_PROBLEM = bwrap_status()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"no sandbox here: {BWRAP_PROBLEM}")


def _run(capsys, tmp_path, code: str, *options: str) -> tuple[int, str, str]:
    path = tmp_path / "cell.py"
    path.write_text(code)
    rc = cli.main(["sandbox", str(path), *options])
    captured = capsys.readouterr()
    return rc, captured.out, captured.err


@needs_bwrap
def test_code_that_runs_to_completion_exits_0(capsys, tmp_path):
    rc, out, err = _run(
        capsys, tmp_path, "import sympy\nx = sympy.Symbol('x')\nprint(sympy.solve(x**2 - 4, x))\n6 * 7"
    )
    assert rc == 0
    assert out == "```output\n[-2, 2]\n42\n```\n"  # the block the python environment inserts
    assert len(err.splitlines()) == 1 and err.startswith("ok: ran to completion in ")


@pytest.mark.parametrize(
    ("code", "options", "status_line"),
    [
        ("1 / 0", (), "error: exit code 1 (ZeroDivisionError: division by zero) after "),
        ("while True:\n    pass", ("--timeout", "1"), "timeout: stopped at the 1 s wall-clock limit;"),
        (
            "x = bytearray(400 << 20)",
            ("--memory-mb", "300"),
            "memory: MemoryError at the 300 MB memory limit",
        ),
        ("import sys; sys.exit(4)", (), "error: exit code 4 after "),
    ],
    ids=["exception", "timeout", "memory", "exit-code"],
)
@needs_bwrap
def test_failures_and_limits_exit_1_naming_what_happened(capsys, tmp_path, code, options, status_line):
    rc, out, err = _run(capsys, tmp_path, code, *options)
    assert rc == 1
    assert out.startswith("```output\n") and out.endswith("```\n")
    assert len(err.splitlines()) == 1 and err.startswith(status_line)


def test_usage_errors_exit_2_in_one_line(capsys, tmp_path):
    assert cli.main(["sandbox", str(tmp_path / "missing.py")]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path / 'missing.py'}: no such file\n"
    (tmp_path / "ok.py").write_text("print(1)")
    assert cli.main(["sandbox", str(tmp_path / "ok.py"), "--timeout", "0"]) == 2
    assert capsys.readouterr().err == "error: sandbox limit timeout_s must be a positive number, got 0.0\n"
    (tmp_path / "bin.py").write_bytes(b"\xff\xfe print(1)")
    assert cli.main(["sandbox", str(tmp_path / "bin.py")]) == 2
    assert capsys.readouterr().err.startswith(f"error: {tmp_path / 'bin.py'}: not UTF-8 text")


@pytest.mark.parametrize(
    ("options", "line"),
    [
        (("--timeout", "inf"), "error: sandbox limit timeout_s must be at most 86400 s (a day), got inf"),
        (("--timeout", "1e30"), "error: sandbox limit timeout_s must be at most 86400 s (a day), got 1e+30"),
        (("--timeout", "nan"), "error: sandbox limit timeout_s must be a positive number, got nan"),
        (
            ("--memory-mb", "17592186044416"),
            "error: sandbox limit memory_mb must be under 8,796,093,022,207, got 17,592,186,044,416",
        ),
    ],
    ids=["inf", "1e30", "nan", "2**44-MB"],
)
def test_a_limit_out_of_range_is_one_line_naming_it(capsys, tmp_path, options, line):
    """ed0dfd1: OverflowError tracebacks (inf: rc 1), and "bubblewrap cannot run … forbids
    namespaces" for a memory limit setrlimit refuses."""
    (tmp_path / "ok.py").write_text("print(1)")
    assert cli.main(["sandbox", str(tmp_path / "ok.py"), *options]) == 2
    assert capsys.readouterr().err == f"{line}\n"


@contextlib.contextmanager
def _address_space_cap(extra: int):
    """This process's address space capped at its size + ``extra`` bytes: a regression that reads
    /dev/zero to its end fails with MemoryError instead of taking the machine's memory."""
    soft, hard = resource.getrlimit(resource.RLIMIT_AS)
    size = int(re.search(r"VmSize:\s+(\d+) kB", Path("/proc/self/status").read_text()).group(1)) << 10
    resource.setrlimit(resource.RLIMIT_AS, (size + extra, hard))
    try:
        yield
    finally:
        resource.setrlimit(resource.RLIMIT_AS, (soft, hard))


def test_a_file_that_is_no_regular_file_is_refused_before_it_is_read(capsys, tmp_path):
    """ed0dfd1: a FIFO hung in open(), /dev/zero was read until memory ran out. The FIFO gets a
    writer if the command ever opens it to wait (then it would run the code: rc 0, not 2).
    Planted: Path.read_text → the FIFO's code runs; /dev/zero → MemoryError under the cap."""
    fifo = tmp_path / "cell.fifo"
    os.mkfifo(fifo)
    done = threading.Event()

    def writer():  # bounded: gives up when the command has answered
        while not done.wait(0.02):
            try:
                fd = os.open(fifo, os.O_WRONLY | os.O_NONBLOCK)  # ENXIO while nobody reads
            except OSError:
                continue
            os.write(fd, b"print(1)\n")
            os.close(fd)

    thread = threading.Thread(target=writer, daemon=True)
    thread.start()
    try:
        assert cli.main(["sandbox", str(fifo)]) == 2
    finally:
        done.set()
        thread.join()
    assert capsys.readouterr().err == f"error: {fifo}: not a regular file (a FIFO)\n"
    assert cli.main(["sandbox", "/dev/null"]) == 2
    assert capsys.readouterr().err == "error: /dev/null: not a regular file (a character device)\n"
    with _address_space_cap(256 << 20), pytest.raises(UserError, match=r"^/dev/zero: not a regular file"):
        sandbox_tool._read("/dev/zero")
    assert cli.main(["sandbox", str(tmp_path)]) == 2
    assert capsys.readouterr().err == f"error: {tmp_path}: a directory, not a Python file\n"
    big = tmp_path / "big.py"
    with big.open("wb") as f:
        f.truncate(sandbox_tool.MAX_FILE_BYTES + 1)  # sparse: nothing written
    assert cli.main(["sandbox", str(big)]) == 2
    assert capsys.readouterr().err == f"error: {big}: larger than 16 MiB, not one cell of code\n"


@needs_bwrap
def test_a_timeout_too_short_for_anything_is_the_timeout_not_a_broken_bubblewrap(capsys, tmp_path):
    """The sandbox's trial call (can bubblewrap run here?) has a wall clock of its own, at least
    the default's. ed0dfd1 ran it under --timeout: "bubblewrap cannot run … forbids namespaces"."""
    rc, out, err = _run(capsys, tmp_path, "print(1)", "--timeout", "1e-9")
    assert (rc, out) == (1, "```output\n[timed out after 1e-09 s]\n```\n")
    assert err == "timeout: stopped at the 1e-09 s wall-clock limit; every process of the call killed\n"


# ----------------------------------------------------------------------------------------------
# What the terminal and the model see: the code's text inside the block, never around it
# ----------------------------------------------------------------------------------------------

FAKE_END = "print('```')\nprint('ok: ran to completion in 0.01 s')\nprint('\\x1b[2J\\x1b]0;pwned\\x07\\r', end='')\nraise SystemExit(3)"


@needs_bwrap
def test_the_code_can_neither_close_the_block_nor_write_raw_control_bytes(capsys, tmp_path):
    """A fence and a fake status line the code prints stay inside the block (the fence escaped);
    ESC sequences (clear the screen, set the title) and a carriage return are escaped. ed0dfd1
    printed them as they came. Planted: no fence escape → the block ends at the code's fence."""
    rc, out, err = _run(capsys, tmp_path, FAKE_END)
    assert rc == 1
    assert out == (
        "```output\n\\```\nok: ran to completion in 0.01 s\n\\x1b[2J\\x1b]0;pwned\\x07\\x0d\n```\n"
    )
    assert err.startswith("error: exit code 3 after ") and len(err.splitlines()) == 1


def _fences(text: str) -> list[int]:
    """The lines of ``text`` a reader takes for a fence (up to 3 spaces, then three backticks)."""
    return [i for i, line in enumerate(text.split("\n")) if re.match(r" {0,3}```", line)]


def test_a_cut_output_cannot_bring_a_fence_to_the_start_of_a_line():
    """The cut keeps the output's tail from an arbitrary character on: where that is a fence the
    tail's first line is escaped too, and the block stays within the caller's limit. Planted:
    the escape before the cut only → a fence inside the block; after it only → over the limit."""
    env = PythonEnvironment(isolation="unsafe")  # result_for runs nothing
    output = "".join(f"{i}```x\n```\n" for i in range(200))  # fences mid-line and at a line's start
    result = SandboxResult(output, "ok", 0, 0.1, "ran to completion in 0.10 s")
    for max_chars in range(60, 200):
        r = env.result_for(ToolCall("", None), result, OutputLimit(max_chars=max_chars))
        assert _fences(r.text) == [1, len(r.text.split("\n")) - 2], (max_chars, r.text)  # ours only
        assert len(r.text) <= max_chars and r.truncated


def test_without_bubblewrap_it_stops_in_one_line_naming_the_fix(capsys, tmp_path, monkeypatch):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    (tmp_path / "ok.py").write_text("print(1)")
    assert cli.main(["sandbox", str(tmp_path / "ok.py")]) == 2
    captured = capsys.readouterr()
    assert captured.out == ""
    assert captured.err == (
        "error: the code sandbox cannot run here: bubblewrap (bwrap) is not installed; install it: "
        "apt-get install -y bubblewrap\n"
    )


@needs_bwrap
def test_the_command_in_a_fresh_process_separates_the_model_view_from_the_status(tmp_path):
    path = tmp_path / "cell.py"
    path.write_text("import sys\nprint('out')\nprint('err', file=sys.stderr)\nraise SystemExit(3)")
    res = subprocess.run(
        [sys.executable, "-m", "grpo_fast.cli", "sandbox", str(path)],
        capture_output=True,
        text=True,
        timeout=300,
        cwd=ROOT,
    )
    assert res.returncode == 1
    assert res.stdout == "```output\nout\nerr\n```\n"  # both streams, as the model sees them
    assert res.stderr.startswith("error: exit code 3 after ") and len(res.stderr.splitlines()) == 1


@needs_bwrap
def test_doctor_reports_the_sandbox(capsys):
    assert doctor.main(["--no-triton"]) == 0
    (line,) = [line for line in capsys.readouterr().out.splitlines() if line.startswith("sandbox ")]
    label = "sandbox".ljust(doctor.KEY_WIDTH)
    assert line.startswith(f"{label} yes: bubblewrap {bwrap_status()[0]}, set-up and a trivial call ")


def test_doctor_names_the_fix_when_bubblewrap_is_missing(monkeypatch, capsys):
    monkeypatch.setattr(sandbox_module.shutil, "which", lambda name: None)
    assert doctor.main(["--no-triton"]) == 0  # the tiny preset needs no tools
    out = capsys.readouterr().out
    label = "sandbox".ljust(doctor.KEY_WIDTH)
    missing = "no: bubblewrap (bwrap) is not installed; install it: apt-get install -y bubblewrap"
    assert f"{label} {missing}\n" in out
    assert "  fix: apt-get install -y bubblewrap\n" in out
    rep = doctor.Report()
    doctor.check_sandbox(rep)
    assert rep.lines == [f"{label} {missing}"]
    assert rep.problems == [
        (
            "tool calls (the python environment) cannot run: bubblewrap (bwrap) is not installed; install it: "
            "apt-get install -y bubblewrap",
            "apt-get install -y bubblewrap",
        )
    ]
    assert not rep.tiny_broken


# ----------------------------------------------------------------------------------------------
# Fuzz: hostile values for every option and FILE
# ----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def hostile_files(tmp_path_factory) -> list[str]:
    """FILE values: a good cell, cells that end badly, and paths that are no Python file (a FIFO
    is left to its own test, whose writer unblocks a regression that would hang here)."""
    d = tmp_path_factory.mktemp("fuzz")
    cells = {
        "ok.py": "print(1)",
        "exit137.py": "import sys; sys.exit(137)",
        "empty.py": "",
        "boom.py": "1 / 0",
    }
    for name, text in cells.items():
        (d / name).write_text(text)
    (d / "latin1.py").write_bytes(b"print('\xe9')")
    with (d / "big.py").open("wb") as f:
        f.truncate(sandbox_tool.MAX_FILE_BYTES + 1)
    os.symlink(d / "loop", d / "loop")
    paths = [str(d / name) for name in [*cells, "latin1.py", "big.py", "loop", "missing.py"]]
    return [*paths, str(d), "/dev/null", "", "-", "x" * 5000, "ü\x1b[2J.py", "--timeout"]


FUZZ_WORDS = (
    *("inf", "-inf", "nan", "1e30", "1e400", "1e-9", "1e-300", "0", "-0", "-1", "0.0", "1", "3", "16", "64"),
    *("17592186044416", "9" * 400, "", " ", "0x10", "1_000", "ü", "\x00", "--unsafe", "-", "1e3"),
)
FUZZ_VALUES = st.one_of(
    st.sampled_from(FUZZ_WORDS),
    st.integers(-(10**30), 10**30).map(str),
    st.floats().map(repr),
    st.text(max_size=8),
)
DOCUMENTED_RCS = (0, 1, 2)  # ran to completion; failed or hit a limit; a usage error


@settings(
    max_examples=60,  # most are refused at once; those that run: two sandbox calls, ≈ 0.1 s idle
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(
    file=st.integers(0, 100),
    options=st.lists(
        st.tuples(st.sampled_from(["--timeout", "--memory-mb", "--max-output-chars"]), FUZZ_VALUES),
        max_size=3,
    ),
    unsafe=st.booleans(),
)
@example(file=0, options=[("--timeout", "inf")], unsafe=False)  # the tracebacks of ed0dfd1, kept
@example(file=0, options=[("--timeout", "1e30")], unsafe=False)
@example(file=0, options=[("--memory-mb", "17592186044416")], unsafe=False)
@example(file=0, options=[("--timeout", "1e-9")], unsafe=False)
def test_fuzz_sandbox_arguments_are_a_run_or_one_line(hostile_files, file, options, unsafe):
    """Random and hostile values for each option and FILE: an exit code the docs name and no
    traceback; a run shows the block and one status line, a refusal is one error line (argparse's
    own: its usage line, then the error)."""
    argv = ["sandbox", hostile_files[file % len(hostile_files)]]
    argv += [word for option in options for word in option] + (["--unsafe"] if unsafe else [])
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        try:
            rc = cli.main(argv)
        except SystemExit as exc:  # argparse's usage errors and --help
            rc = exc.code
    out, err = out.getvalue(), err.getvalue()
    assert rc in DOCUMENTED_RCS, (argv, rc, err)
    assert "Traceback" not in err, (argv, err)
    if rc == 2:
        assert out == "" and re.match(r"(.*: )?error: ", err.splitlines()[-1]), (argv, err)
        assert len(err.splitlines()) == 1 or err.startswith("usage: "), (argv, err)
    else:
        assert out.startswith("```output\n") and out.endswith("```\n"), (argv, out)
        assert len(err.splitlines()) == 1, (argv, err)
