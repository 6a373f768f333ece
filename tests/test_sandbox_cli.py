"""``grpo-fast sandbox FILE.py``: what the model would see on stdout, one status line on stderr,
exit 0 / 1 / 2; and ``grpo-fast doctor``'s sandbox line."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from grpo_fast import cli
from grpo_fast.sandbox import bwrap_status
from grpo_fast.sandbox import sandbox as sandbox_module
from grpo_fast.tools import doctor

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
