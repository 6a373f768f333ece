"""The user's run folders are data: no test reads or changes them (tests/conftest.py). `make run`
then `make test` in a checkout is the README's order, and `runs/tiny` then holds a finished run
that a test with a default ``output_dir`` would meet ("holds a run ... resume=true continues it")."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from types import SimpleNamespace

import conftest
import pytest

from grpo_fast.config import PRESETS, load_config

REPO = Path(__file__).resolve().parents[1]


def test_a_test_and_the_processes_it_starts_run_outside_the_checkout():
    """Every default output_dir resolves outside the checkout, in this test's own folder; a process
    started without a cwd runs there too and imports the package under test."""
    here = Path.cwd().resolve()
    assert REPO not in [here, *here.parents], here
    for preset in [None, *PRESETS]:
        out = Path(load_config(preset, check_device=False).output_dir).resolve()
        assert REPO not in out.parents and here in out.parents, (preset, out)
    res = subprocess.run(
        [sys.executable, "-c", "import os, grpo_fast; print(os.getcwd()); print(grpo_fast.__file__)"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    cwd, package = res.stdout.split("\n")[:2]
    assert Path(cwd).resolve() == here, res.stderr
    assert Path(package).resolve() == REPO / "grpo_fast" / "__init__.py"


@pytest.mark.xdist_group("own_folder")  # the two in this order, on one worker (make test: -n 2)
def test_each_test_has_a_folder_of_its_own():
    """What one test leaves in its working directory, the next does not see."""
    assert not Path("runs").exists()
    Path("runs", "tiny").mkdir(parents=True)  # as a run with the tiny preset's output_dir would


@pytest.mark.xdist_group("own_folder")
def test_each_test_has_a_folder_of_its_own_too():
    assert not Path("runs").exists()


def _session() -> SimpleNamespace:
    return SimpleNamespace(config=SimpleNamespace(stash=pytest.Stash()), exitstatus=pytest.ExitCode.OK)


@pytest.mark.parametrize(
    "change",
    ["a row appended", "a file touched", "a file deleted", "a run created", "a folder renamed"],
)
def test_the_session_fails_when_the_user_runs_changed(tmp_path, monkeypatch, capsys, change):
    """The second line of defence: the session compares the checkout's runs/ before and after
    (sizes and modification times, no file read) and fails on any difference, naming the path."""
    runs = tmp_path / "runs"
    (runs / "tiny" / "final").mkdir(parents=True)
    metrics = runs / "tiny" / "metrics.jsonl"
    metrics.write_text('{"step": 1}\n')
    (runs / "tiny" / "final" / "model.safetensors").write_bytes(b"\0" * 64)
    monkeypatch.setattr(conftest, "USER_RUNS", runs)
    monkeypatch.setattr(conftest, "XDIST_WORKER", None)
    session = _session()
    conftest.pytest_sessionstart(session)
    conftest.pytest_sessionfinish(session, session.exitstatus)
    assert session.exitstatus == pytest.ExitCode.OK and capsys.readouterr().err == ""

    if change == "a row appended":
        with metrics.open("a") as f:
            f.write('{"step": 2}\n')
        named = "tiny/metrics.jsonl"
    elif change == "a file touched":  # the same bytes, rewritten
        stat = metrics.stat()
        os.utime(metrics, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
        named = "tiny/metrics.jsonl"
    elif change == "a file deleted":
        (runs / "tiny" / "final" / "model.safetensors").unlink()
        named = "tiny/final/model.safetensors"
    elif change == "a run created":
        (runs / "grpo").mkdir()
        named = "grpo"
    else:
        (runs / "tiny").rename(runs / "tiny.old")
        named = "tiny.old"
    conftest.pytest_sessionfinish(session, session.exitstatus)
    assert session.exitstatus == pytest.ExitCode.TESTS_FAILED
    err = capsys.readouterr().err
    assert f"the tests changed {runs}" in err and named in err, err


def test_a_worker_leaves_the_watch_to_the_controller(tmp_path, monkeypatch):
    """Under pytest-xdist only the controller compares (a worker ends before the others do)."""
    monkeypatch.setattr(conftest, "USER_RUNS", tmp_path / "runs")
    monkeypatch.setattr(conftest, "XDIST_WORKER", "gw0")
    session = _session()
    conftest.pytest_sessionstart(session)
    (tmp_path / "runs").mkdir()
    conftest.pytest_sessionfinish(session, session.exitstatus)
    assert session.exitstatus == pytest.ExitCode.OK
