"""CPU threads on a machine that is not idle (``grpo_fast.threads``): the intra-op thread count
chosen for the work and the machine, the OpenMP wait the commands set before torch loads, the
``threads.*`` keys and the user's own variables winning, what the plan line says."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch

from grpo_fast import threads
from grpo_fast.obs import eta
from grpo_fast.train import main

ROOT = Path(__file__).resolve().parent.parent
QUICK = ["--preset", "tiny", "steps=1", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
         "rollout.batch_size=16", "train.micro_batch_size=16", "logging.progress=false",
         "logging.sample_every=0"]  # fmt: skip


def test_auto_threads_follow_the_model_the_cores_the_load_and_the_wait():
    """Planted: the small-model rule applied whatever the wait (tiny gets 1 on idle cores under
    the commands' short spin) or dropped (2 under a passive wait); the load ignored (6 → 8); the
    user's OMP_NUM_THREADS ignored by auto (3 → 1); the key losing to the variable."""
    auto = threads.choose_threads
    passive = {"OMP_WAIT_POLICY": "PASSIVE"}
    short = auto("auto", "cpu", 128, cores=2, load=0.1, environ={"GOMP_SPINCOUNT": "30000"})
    assert (short.threads, short.follow) == (2, True)  # the tiny preset's model, the commands' wait
    tiny = auto("auto", "cpu", 128, cores=2, load=0.1, environ=passive)
    assert (tiny.threads, tiny.follow) == (1, False)  # a sleeping thread's wake-up costs more than it gives
    assert auto("auto", "cpu", 1536, cores=8, load=0.2, environ=passive).threads == 8
    assert auto("auto", "cpu", 1536, cores=8, load=2.2, environ={}).threads == 6  # 2 cores busy
    assert auto("auto", "cpu", 1536, cores=2, load=20.0, environ={}).threads == 1  # at least one
    assert auto("auto", "cpu", 1536, cores=4, load=None, environ={}).threads == 4  # no load average
    assert auto("auto", "cuda", 1536, cores=8, load=0.0, environ={}) is None  # a GPU run: torch's own
    named = auto("auto", "cpu", 1536, cores=2, load=0.4, environ={}, load_name="other work")
    assert named.why == "auto: 2 cores, other work 0.4, following the machine"
    env = {"OMP_NUM_THREADS": "3"}
    user = auto("auto", "cpu", 128, cores=8, load=0.0, environ=env)
    assert (user.threads, user.why, user.follow, env) == (
        3,
        "OMP_NUM_THREADS=3",
        False,
        {"OMP_NUM_THREADS": "3"},
    )  # never rewritten
    assert auto(2, "cpu", 128, cores=8, load=0.0, environ=env) == threads.ThreadChoice(
        2, "threads.intra_op=2"
    )


def test_commands_spin_briefly_unless_the_environment_or_torch_came_first():
    """Planted: prefer_short_wait overwriting a user's OMP_WAIT_POLICY → the "active" case
    fails; not checking whether torch loaded → the last case fails."""
    assert threads.started_as_command("-m") and threads.started_as_command("/venv/bin/grpo-fast")
    assert not threads.started_as_command("/venv/bin/pytest") and not threads.started_as_command("-c")
    env: dict[str, str] = {}
    assert threads.prefer_short_wait(env, modules={}) and env == {"GOMP_SPINCOUNT": "30000"}
    assert threads.wait_policy_in_effect(env) == "spin 30000" and not threads.spins_long("spin 30000")
    env = {"OMP_NUM_THREADS": "2"}  # a count the user fixed: nothing follows the machine, no spin
    assert threads.prefer_short_wait(env, modules={}) and env == {
        "OMP_NUM_THREADS": "2",
        "OMP_WAIT_POLICY": "PASSIVE",
    }
    for user in ({"OMP_WAIT_POLICY": "active"}, {"GOMP_SPINCOUNT": "10000"}, {"OMP_WAIT_POLICY": "passive"}):
        env = dict(user)
        assert not threads.prefer_short_wait(env, modules={}) and env == user
    assert threads.wait_policy_in_effect({"OMP_WAIT_POLICY": "active"}) == "active"
    assert threads.wait_policy_in_effect({"GOMP_SPINCOUNT": "0"}) == "passive"
    assert threads.wait_policy_in_effect({}) == "spin"  # libgomp's default: ~3 ms of spinning
    assert [threads.spins_long(w) for w in ("spin", "active", "spin 300000", "passive", "spin 30000")] == [
        True,
        True,
        True,
        False,
        False,
    ]
    env = {}
    assert not threads.prefer_short_wait(env, modules={"torch": torch}) and env == {}


# 2 threads: a region, then the main thread sleeps argv[2] s, 60 times; the process's CPU seconds. A
# spinning libgomp worker burns the sleep; a passive one sleeps too. Set before torch loads, as
# grpo_fast/__init__.py does (KEY=VALUE in argv[1]; "" leaves the environment as it is).
_SPIN_PROBE = """
import os, sys, time
if sys.argv[1]:
    key, value = sys.argv[1].split("=")
    os.environ[key] = value
import torch
torch.set_num_threads(2)
a, b = torch.randn(256, 128), torch.randn(128, 256)
c0 = time.process_time()
for _ in range(60):
    a @ b
    time.sleep(float(sys.argv[2]))
print(time.process_time() - c0)
"""


def test_torchs_openmp_stops_spinning_with_the_wait_set_before_torch_loads():
    """What the commands' default rests on: torch's bundled libgomp reads OMP_WAIT_POLICY and
    GOMP_SPINCOUNT set in os.environ before ``import torch``. Measured (2 cores, load 13, 200
    regions, 2 ms apart): 2.1-3.2 CPU s spinning, 0.05-0.07 s passive. Over 60 regions 10 ms
    apart (2-core AMD EPYC, idle): 0.47 CPU s with libgomp's default, 0.17 s with the commands' short
    spin (30,000: ~2.6 ms of spinning here), 0.02 s passive. Planted: the probe setting the
    variable after ``import torch`` → all spin, the assertions fail."""
    if threads.usable_cores() < 2:
        pytest.skip("a team of one thread never waits: needs 2 cores")
    env = {k: v for k, v in os.environ.items() if k not in threads.WAIT_ENV}

    def cpu_s(setting: str, gap_s: float) -> float:
        res = subprocess.run([sys.executable, "-c", _SPIN_PROBE, setting, str(gap_s)], env=env, capture_output=True,
                             text=True, timeout=300, check=True)  # fmt: skip
        return float(res.stdout)

    spin, passive = cpu_s("", 0.002), cpu_s("OMP_WAIT_POLICY=PASSIVE", 0.002)
    assert passive < 0.4 * spin, (spin, passive)  # 60 × 2 ms of spinning: ≥ 0.12 s when it spins
    spin, short = cpu_s("", 0.01), cpu_s(f"GOMP_SPINCOUNT={threads.SHORT_SPIN}", 0.01)
    assert short < 0.5 * spin, (spin, short)


def _plan(err: str) -> str:
    return next(ln for ln in err.splitlines() if ln.startswith("plan: "))


def _command_plan(tmp_path: Path, env: dict, keys: list, to_the_end: bool) -> str:
    """The plan line of the training command run in a fresh process with ``env`` (over this
    one's, less the thread variables) and ``keys``. The setup prints it before the first step:
    unless ``to_the_end`` (the run must then end with 0), the process is killed once it has been
    read (measured 2026-12-06, 2 cores, load 4: the line at 11.6 s, the run's end at 16.1 s)."""
    base = {k: v for k, v in os.environ.items() if k not in (*threads.WAIT_ENV, "OMP_NUM_THREADS")}
    cmd = [sys.executable, "-m", "grpo_fast.train", *QUICK, f"output_dir={tmp_path / 'run'}", *keys]
    proc = subprocess.Popen(cmd, env={**base, **env, "PYTHONPATH": str(ROOT)}, stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True, cwd=tmp_path)  # fmt: skip
    timer = threading.Timer(900, proc.kill)  # a hung setup fails the test, not the session
    timer.start()
    try:
        err = []
        for line in proc.stderr:
            err.append(line)
            if line.startswith("plan: ") and not to_the_end:
                break
        else:  # the stream closed: the process ended
            assert proc.wait() == 0, "".join(err)[-3000:]
        plans = [ln for ln in err if ln.startswith("plan: ")]
        assert plans, f"no plan line; exit {proc.poll()}:\n" + "".join(err)[-3000:]
        return plans[0]
    finally:
        timer.cancel()
        proc.kill()
        proc.wait()
        proc.stderr.close()


@pytest.mark.slow
@pytest.mark.parametrize(
    ("env", "keys", "expect"),
    [
        ({}, [], r"; [12] CPU threads? \(auto: \d+ cores, other work [0-9.]+, following the machine\), OpenMP wait spin 30000;"),
        ({}, ["threads.intra_op=2", "threads.wait_policy=active"], r"; 2 CPU threads \(threads.intra_op=2\), OpenMP wait active;"),
        ({"OMP_NUM_THREADS": "2", "OMP_WAIT_POLICY": "active"}, [], r"; 2 CPU threads \(OMP_NUM_THREADS=2\), OpenMP wait active;"),
        ({"OMP_NUM_THREADS": "2"}, [], r"; 2 CPU threads \(OMP_NUM_THREADS=2\), OpenMP wait passive;"),
    ],
    ids=["defaults", "keys", "user-env", "user-count"],
)  # fmt: skip
def test_the_command_runs_with_the_threads_and_wait_asked(tmp_path, env, keys, expect):
    """The training command end to end (a fresh process each: the variables act only before torch
    loads): by default the cores other work leaves free (1 or 2 here, where pytest's other worker
    runs), followed, and the short spin (set before torch loaded: the plan line reads the
    environment the process has); the keys (a wait policy the environment lacks: the command
    restarts itself with it); the user's variables (a count fixed by OMP_NUM_THREADS alone waits
    passively). The "defaults" run trains to the end (the follower at the step's end) and exits 0;
    the others stop at the plan line, which the setup prints before the first step (the restart
    and the variables act before it). Planted: no prefer_short_wait in __init__ → "defaults" says
    spin; no restart in main → "keys" stops with the one-line error; choose_threads ignoring
    OMP_NUM_THREADS → "user-env" says 1 thread."""
    plan = _command_plan(tmp_path, env, keys, to_the_end=not env and not keys)  # "defaults"
    assert re.search(expect, plan), plan


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


def test_other_work_is_the_cores_busy_less_this_processs_own():
    """``OtherWork`` from scripted readings: 3 busy core-seconds in 2 s, 1 of them this process's
    → 1.0 core of other work; never negative; None without /proc/stat. Planted: the own time not
    subtracted → 1.5; divided by the busy time instead of the wall time → fails."""
    clock, busy, own = iter([10.0, 12.0, 13.0]), iter([100.0, 103.0, 103.2]), iter([5.0, 6.0, 7.0])
    work = threads.OtherWork(
        cpus=[0, 1], busy=lambda cpus: next(busy), own=lambda: next(own), clock=clock.__next__
    )
    assert work.read() == pytest.approx(1.0)
    assert work.read() == 0.0  # 0.2 busy, 1.0 own (clock ticks lag): clamped
    none = threads.OtherWork(cpus=[0], busy=lambda cpus: None, own=lambda: 0.0)
    assert none.read() is None


def test_other_work_reads_a_real_busy_child_and_this_process_own_time():
    """/proc/stat and os.times for real: a child spinning for 1.5 s is other work, all of its CPU
    time (never more than the cores); this process spinning for 1 s shows in its own CPU time,
    which ``OtherWork`` subtracts (scripted above: the machine's other load is unknown here, so
    only the lower bound holds). Planted: the per-core lines not matched (``"cpu 0"``) → 0."""
    if threads.cpu_busy_seconds([0]) is None:
        pytest.skip("no /proc/stat")
    cores = len(os.sched_getaffinity(0))
    work, before, t0 = threads.OtherWork(), os.times(), time.monotonic()
    child = subprocess.Popen(
        [sys.executable, "-c", "import time\nt=time.time()\nwhile time.time()-t<1.5: pass"]
    )
    child.wait(timeout=60)
    reading, after = work.read(), os.times()
    used = after.children_user + after.children_system - before.children_user - before.children_system
    share = used / (time.monotonic() - t0)
    assert share >= 0.2 and share - 0.1 <= reading <= cores + 0.1, (share, reading)  # 0.1: clock ticks
    own, spin = threads.own_cpu_seconds(), time.monotonic()
    while time.monotonic() - spin < 1.0:
        pass
    assert threads.own_cpu_seconds() - own >= 0.3  # the spin's share of a core, the machine busy or not


def test_the_follower_steps_down_at_once_and_up_after_two_readings():
    """``ThreadFollower`` on 2 cores: other work on 1.2 cores → 1 thread at the next reading;
    idle again → 2 only after two idle readings; none read before the interval; a light job
    (0.3 of a core) takes no thread. Planted: stepping up on the first reading → the third
    reading already sets 2; the interval ignored → a reading at t=1."""
    other = iter([1.2, 0.0, 0.0, 0.3, 1.6])
    now, have, sets = [0.0], [2], []

    def set_threads(n):
        sets.append(n)
        have[0] = n

    f = threads.ThreadFollower(2, 2, other=other.__next__, get=lambda: have[0], set=set_threads,
                               clock=lambda: now[0], interval=2.0)  # fmt: skip
    said = []
    for t in (1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 10.0):
        now[0] = t
        said.append(f.step_end())
    assert sets == [1, 2, 1], sets
    assert said[0] is None and said[1] == "2 → 1 CPU threads (other work on 1.2 of 2 cores)"
    assert said[2:5] == [None, None, "1 → 2 CPU threads (other work on 0.0 of 2 cores)"], said
    assert said[5] is None and said[6] == "2 → 1 CPU threads (other work on 1.6 of 2 cores)"


def test_a_cpu_run_follows_the_machine_and_its_metrics_say_the_count(tmp_path, monkeypatch, capsys):
    """End to end, in-process, the tiny preset's loop with ``threads.intra_op=auto`` and no
    OMP_NUM_THREADS: the follower installed (hidden-size rule aside: a model over SMALL_HIDDEN),
    its readings scripted; each step's ``time/cpu_threads`` is the count it ran with, the change
    logged; after the run the follower is gone and the caller's count back. Planted: no
    follow_machine call in step_end → the counts stay at 2; no removal in run → a follower left."""
    import json

    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    monkeypatch.setattr(threads, "FOLLOW_INTERVAL_S", 0.0)
    readings = iter([0.0, 1.5, 1.5, 0.0, 0.0, 0.0, 0.0, 0.0])  # the setup's, then one per step end

    class Scripted:
        latest = None

        def read(self):
            self.latest = next(readings)
            return self.latest

    monkeypatch.setattr(eta, "other_work_meter", Scripted)
    monkeypatch.setattr(threads, "load_average", lambda: 0.0)
    monkeypatch.setattr(threads, "usable_cores", lambda: 2)
    before = torch.get_num_threads()
    out = tmp_path / "run"
    monkeypatch.setattr(threads, "SMALL_HIDDEN", 0)
    keys = [k for k in QUICK if not k.startswith("steps=")] + ["steps=5"]
    assert main([*keys, f"output_dir={out}"]) == 0
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
    counts = [r["time/cpu_threads"] for r in rows if "time/cpu_threads" in r]
    assert counts == [2, 1, 1, 1, 2], counts
    err = capsys.readouterr()
    assert "; 2 CPU threads (auto: 2 cores, other work 0.0, following the machine), OpenMP wait " in err.err
    assert "step 1: 2 → 1 CPU threads (other work on 1.5 of 2 cores)" in err.out + err.err
    assert threads.follower is None and torch.get_num_threads() == before


def test_a_half_core_of_other_work_takes_a_thread_at_the_setup_and_when_following():
    """One rounding, halves up, in both places: 0.5 of a core busy on 2 → 1 thread at the setup
    and from the follower; 2.5 on 4 → 1. Planted: choose_threads with round() (0.5 → 0, banker's
    rounding) → 2 threads at the setup while the follower says 1."""
    assert [threads.cores_busy(x) for x in (0.49, 0.5, 1.5, 2.5)] == [0, 1, 2, 3]
    assert threads.choose_threads("auto", "cpu", 1536, cores=2, load=0.5, environ={}).threads == 1
    assert threads.choose_threads("auto", "cpu", 1536, cores=4, load=2.5, environ={}).threads == 1
    have = [2]
    f = threads.ThreadFollower(2, 2, other=lambda: 0.5, get=lambda: have[0], set=lambda n: have.__setitem__(0, n),
                               clock=iter([0, 5]).__next__)  # fmt: skip
    assert f.step_end() == "2 → 1 CPU threads (other work on 0.5 of 2 cores)"


def test_a_reading_over_too_short_a_window_is_none_and_the_window_stays_open():
    """/proc/stat counts 10 ms ticks: a reading over 0.1 s is not one. The next reading covers the
    whole window since the last good one. Planted: no minimum → 0.1 s gives 5.0 cores."""
    clock, busy = iter([0.0, 0.1, 1.0]), iter([0.0, 0.5, 1.0])
    work = threads.OtherWork(cpus=[0, 1], busy=lambda cpus: next(busy), own=lambda: 0.0, clock=clock.__next__)
    assert work.read() is None and work.latest is None
    assert work.read() == pytest.approx(1.0) and work.latest == pytest.approx(1.0)  # 1.0 busy over 1.0 s


def test_cores_proc_stat_does_not_name_are_unknown_not_idle():
    """A container that renumbers CPUs: /proc/stat has no line for the affinity's cores → None
    (then the load average), never 0.0. Planted: returning the 0 ticks summed → 0.0."""
    if threads.cpu_busy_seconds([0]) is None:
        pytest.skip("no /proc/stat")
    assert threads.cpu_busy_seconds([10**6]) is None


def test_a_worker_process_caps_the_count_the_trainer_follows_to(monkeypatch):
    """``rollout.placement=process``: the hf worker takes its threads, the trainer's are cut to
    the rest, and a following count never climbs back above that. Planted: no cap in
    producer_backend → the follower's most stays 2 on 2 CPUs with a 1-thread worker."""
    from types import SimpleNamespace

    from grpo_fast.loop import pipeline

    monkeypatch.setattr(pipeline.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(pipeline, "HFProcessBackend", lambda *a, **k: "worker")
    monkeypatch.setattr(
        threads, "follower", threads.ThreadFollower(2, 2, other=lambda: 0.0, get=lambda: 2, set=print)
    )
    before = torch.get_num_threads()
    rollout = SimpleNamespace(backend="hf", placement="process", worker_threads=1, start_timeout=1, request_timeout=1,
                              sync_timeout=1, generation_batch_size=8, num_engines=1)  # fmt: skip
    run = SimpleNamespace(cfg=SimpleNamespace(rollout=rollout), model=None, tokenizer=None, amp=None)
    try:
        assert pipeline.producer_backend(run) == "worker"
        assert threads.follower.most == 1 and torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
