"""CPU threads on a machine that is not idle (``grpo_fast.threads``): the intra-op thread count
chosen for the work and the machine, the OpenMP wait the commands set before torch loads, the
``threads.*`` keys and the user's own variables winning, what the plan line says."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from grpo_fast import threads
from grpo_fast.train import main

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--preset", "tiny", "steps=1", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
         "rollout.batch_size=16", "train.micro_batch_size=16", "logging.progress=false",
         "logging.sample_every=0"]  # fmt: skip


def test_auto_threads_follow_the_model_the_cores_and_the_load():
    """Planted: the small-model rule dropped (tiny gets 2 on idle cores); the load ignored (6 → 8);
    the user's OMP_NUM_THREADS ignored by auto (3 → 1); the key losing to the variable."""
    auto = threads.choose_threads
    assert auto("auto", "cpu", 128, cores=2, load=0.1, environ={}).threads == 1  # the tiny preset's model
    assert auto("auto", "cpu", 1536, cores=8, load=0.2, environ={}).threads == 8
    assert auto("auto", "cpu", 1536, cores=8, load=2.2, environ={}).threads == 6  # 2 cores busy
    assert auto("auto", "cpu", 1536, cores=2, load=20.0, environ={}).threads == 1  # at least one
    assert auto("auto", "cpu", 1536, cores=4, load=None, environ={}).threads == 4  # no load average
    assert auto("auto", "cuda", 1536, cores=8, load=0.0, environ={}) is None  # a GPU run: torch's own
    env = {"OMP_NUM_THREADS": "3"}
    user = auto("auto", "cpu", 128, cores=8, load=0.0, environ=env)
    assert (user.threads, user.why, env) == (
        3,
        "OMP_NUM_THREADS=3",
        {"OMP_NUM_THREADS": "3"},
    )  # never rewritten
    assert auto(2, "cpu", 128, cores=8, load=0.0, environ=env) == threads.ThreadChoice(
        2, "threads.intra_op=2"
    )


def test_commands_wait_passively_unless_the_environment_or_torch_came_first():
    """Planted: prefer_passive_wait overwriting a user's OMP_WAIT_POLICY → the "active" case
    fails; not checking whether torch loaded → the last case fails."""
    assert threads.started_as_command("-m") and threads.started_as_command("/venv/bin/grpo-fast")
    assert not threads.started_as_command("/venv/bin/pytest") and not threads.started_as_command("-c")
    env: dict[str, str] = {}
    assert threads.prefer_passive_wait(env, modules={}) and env == {"OMP_WAIT_POLICY": "PASSIVE"}
    assert threads.wait_policy_in_effect(env) == "passive"
    for user in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "10000"}):
        env = dict(user)
        assert not threads.prefer_passive_wait(env, modules={}) and env == user
    assert threads.wait_policy_in_effect({"OMP_WAIT_POLICY": "active"}) == "active"
    assert threads.wait_policy_in_effect({"GOMP_SPINCOUNT": "0"}) == "passive"
    assert threads.wait_policy_in_effect({}) == "spin"  # libgomp's default: ~3 ms of spinning
    env = {}
    assert not threads.prefer_passive_wait(env, modules={"torch": torch}) and env == {}


# 2 threads: a region, then the main thread sleeps 2 ms, 60 times; the process's CPU seconds. A
# spinning libgomp worker burns the sleep; a passive one sleeps too. Set before torch loads, as
# grpo_fast/__init__.py does (the variable comes in argv[1]; "" leaves the environment as it is).
_SPIN_PROBE = """
import os, sys, time
if sys.argv[1]:
    os.environ["OMP_WAIT_POLICY"] = sys.argv[1]
import torch
torch.set_num_threads(2)
a, b = torch.randn(256, 128), torch.randn(128, 256)
c0 = time.process_time()
for _ in range(60):
    a @ b
    time.sleep(0.002)
print(time.process_time() - c0)
"""


def test_torchs_openmp_stops_spinning_with_the_passive_wait_set_before_torch_loads():
    """What the commands' default rests on: torch's bundled libgomp reads OMP_WAIT_POLICY set in
    os.environ before ``import torch``. Measured (2 cores, load 13, 200 regions): 2.1-3.2 CPU s
    spinning, 0.05-0.07 s passive. Planted: the probe setting the variable after ``import torch``
    → both spin, the assertion fails."""
    if threads.usable_cores() < 2:
        pytest.skip("a team of one thread never waits: needs 2 cores")
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_ENV}

    def cpu_s(policy: str) -> float:
        res = subprocess.run([sys.executable, "-c", _SPIN_PROBE, policy], env=env, capture_output=True,
                             text=True, timeout=300, check=True)  # fmt: skip
        return float(res.stdout)

    spin, passive = cpu_s(""), cpu_s("PASSIVE")
    assert passive < 0.4 * spin, (spin, passive)  # 60 × 2 ms of spinning: ≥ 0.12 s when it spins


def _plan(err: str) -> str:
    return next(ln for ln in err.splitlines() if ln.startswith("plan: "))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "keys", "expect"),
    [
        ({}, [], "; 1 CPU thread (auto: a small model (hidden 128), "),
        ({}, ["threads.intra_op=2", "threads.wait_policy=active"], "; 2 CPU threads (threads.intra_op=2), OpenMP wait active;"),
        ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"}, [], "; 2 CPU threads (OMP_NUM_THREADS=2), OpenMP wait active;"),
    ],
    ids=["defaults", "keys", "user-env"],
)  # fmt: skip
def test_the_command_runs_with_the_threads_and_wait_asked(tmp_path, env, keys, expect):
    """The training command end to end (a fresh process each): by default 1 thread for the tiny
    model and a passive wait (set before torch loaded: the plan line reads the environment the
    process has); the keys (a wait policy the environment lacks: the command restarts itself with
    it); the user's variables. Planted: no prefer_passive_wait in __init__ → "defaults" says
    spin; no restart in main → "keys" stops with the one-line error; choose_threads ignoring
    OMP_NUM_THREADS → "user-env" says 1 thread."""
    base = {k: v for k, v in os.environ.items() if k not in (*threads.WAIT_ENV, "OMP_NUM_THREADS")}
    cmd = [sys.executable, "-m", "grpo_fast.train", *QUICK, f"output_dir={tmp_path / 'run'}", *keys]
    res = subprocess.run(cmd, env={**base, **env, "PYTHONPATH": str(ROOT)}, capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)  # fmt: skip
    assert res.returncode == 0, res.stderr[-3000:]
    plan = _plan(res.stderr)
    assert expect in plan, plan
    if not keys and not env:
        assert "OpenMP wait passive;" in plan, plan


def test_a_library_run_keeps_the_callers_threads_and_refuses_a_wait_it_cannot_have(
    tmp_path, capsys, monkeypatch
):
    """In-process (a script's ``train.main``/``run``): ``threads.intra_op=2`` holds during the run
    (the plan line reads torch back) and the caller's count comes back after; a wait policy the
    loaded OpenMP lacks stops the run in one line, before the output folder is made. Planted: no
    restore in run → 2 after; no wait_policy_problem check → the run goes on."""
    before = torch.get_num_threads()
    assert main([*QUICK, f"output_dir={tmp_path / 'a'}", f"threads.intra_op={before + 1}"]) == 0
    n = before + 1
    assert f"; {n} CPU threads (threads.intra_op={n}), OpenMP wait " in _plan(capsys.readouterr().err)
    assert torch.get_num_threads() == before
    for k in threads.WAIT_ENV:
        monkeypatch.delenv(k, raising=False)  # libgomp's default here: spin
    assert main([*QUICK, f"output_dir={tmp_path / 'b'}", "threads.wait_policy=passive"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [
        "error: threads.wait_policy=passive, but OpenMP loaded with wait spin: set "
        "OMP_WAIT_POLICY=PASSIVE before importing torch (the grpo-fast command does it)"
    ], err
    assert not (tmp_path / "b").exists()


def test_the_run_sets_torchs_threads_only_when_the_count_changes(monkeypatch):
    """Re-setting torch's own count (the OMP_NUM_THREADS it started with) also re-sets MKL's and
    OpenMP's, and made the tiny preset's steps 20-40% slower on 2 cores: ``_set_threads`` calls
    ``torch.set_num_threads`` only for another count."""
    from types import SimpleNamespace

    from grpo_fast.loop.setup import _set_threads

    calls = []
    monkeypatch.setattr(torch, "set_num_threads", calls.append)
    model = SimpleNamespace(config=SimpleNamespace(hidden_size=128))
    now = torch.get_num_threads()
    line = _set_threads(SimpleNamespace(threads=SimpleNamespace(intra_op=now)), model, torch.device("cpu"))
    assert calls == [] and line.startswith(f"{now} CPU thread")
    _set_threads(SimpleNamespace(threads=SimpleNamespace(intra_op=now + 1)), model, torch.device("cpu"))
    assert calls == [now + 1]
