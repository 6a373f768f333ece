"""Faults and bad input: each one a clean line on stderr and exit code 2 (or a skipped step),
never a traceback, never a half-written checkpoint."""

import errno
import os
import shutil
import subprocess
import sys

import pytest

from grpo_fast import train as train_mod
from grpo_fast.train import main


def _cli(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout)


def _one_error_line(res: subprocess.CompletedProcess) -> str:
    assert res.returncode == 2, res.stderr[-2000:]
    assert "Traceback" not in res.stderr
    lines = [ln for ln in res.stderr.splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error: "), res.stderr
    return lines[0]


# ---------------------------------------------------------------------------- bad input


def test_output_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = _one_error_line(_cli(f"output_dir={blocker / 'run'}"))
    assert f"output_dir='{blocker / 'run'}' cannot be created: Not a directory" in line


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no one can write in: a read-only tmpfs as root (root ignores file modes), else
    mode 0o500. Skipped where neither works; the injected error below covers the same path."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
        )
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        try:
            yield ro
        finally:
            subprocess.run(["umount", str(ro)], check=False)
    else:
        ro.chmod(0o500)
        try:
            yield ro
        finally:
            ro.chmod(0o700)


def test_output_dir_that_is_not_writable_is_one_line_exit_2(read_only_dir):
    line = _one_error_line(_cli(f"output_dir={read_only_dir}"))
    assert f"output_dir='{read_only_dir}' is not writable: " in line
    line = _one_error_line(_cli(f"output_dir={read_only_dir / 'sub'}"))
    assert "cannot be created" in line


def test_output_dir_write_error_injected_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(train_mod.tempfile, "NamedTemporaryFile", refuse)
    loaded = []
    monkeypatch.setattr(train_mod, "load_policy", lambda *a, **k: loaded.append(1))
    assert main(["--preset", "tiny", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: output_dir='{tmp_path}' is not writable: Permission denied"]
    assert loaded == []  # refused before any model loads


def test_group_size_one_is_one_line_exit_2():
    line = _one_error_line(_cli("rollout.group_size=1", "rollout.batch_size=8"))
    assert "rollout.group_size must be >= 2, got 1" in line


@pytest.mark.parametrize("override", ["train.lr=nan", "train.weight_decay=-0.1"])
def test_numeric_domain_errors_are_one_line_exit_2(override):
    """Through the CLI; every key's domain is walked in tests/test_config.py (DOMAINS)."""
    key = override.split("=")[0]
    assert key in _one_error_line(_cli(override))
