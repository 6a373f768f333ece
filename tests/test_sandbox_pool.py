"""The worker processes and the pool under the math grader and the sandbox: results in order, at
most N at once, a worker dies with its parent; a batch of rewards scored concurrently gives what
one-by-one scoring gives (scores, numbering, error counts, errors' zeros, the first error)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import pytest

from grpo_fast.errors import RewardError
from grpo_fast.sandbox import DIE_WITH_PARENT, WorkerPool, WorkerProcess, ordered_map
from grpo_fast.task.rewards import GuardedReward, MathGrader, WeightedReward, score_batch

# A worker that answers each line with "pid start end" after sleeping the seconds the line says.
SLEEPER = DIE_WITH_PARENT + textwrap.dedent(
    """
    import os, sys, time
    print("ready", flush=True)
    for line in sys.stdin:
        start = time.monotonic()
        time.sleep(float(line))
        print(os.getpid(), start, time.monotonic(), flush=True)
    """
)


class Concurrency:
    """Counts the calls running at once (the most seen) around ``fn``."""

    def __init__(self, fn):
        self.fn, self.now, self.most = fn, 0, 0
        self._lock = threading.Lock()

    def __call__(self, *args):
        with self._lock:
            self.now += 1
            self.most = max(self.most, self.now)
        try:
            return self.fn(*args)
        finally:
            with self._lock:
                self.now -= 1


def test_ordered_map_keeps_input_order_and_bounds_concurrency():
    # item k sleeps (5 - k) × 20 ms: later items finish first
    slow = Concurrency(lambda k: (time.sleep((5 - k) * 0.02), k * k)[1])
    assert ordered_map(slow, range(6), workers=3) == [0, 1, 4, 9, 16, 25]
    assert 2 <= slow.most <= 3
    sequential = Concurrency(lambda k: k)
    assert ordered_map(sequential, range(4), workers=1) == [0, 1, 2, 3] and sequential.most == 1


def test_ordered_map_raises_the_first_error_in_input_order():
    def fn(k):
        if k in (1, 3):
            time.sleep(0.1 if k == 1 else 0.0)  # 3 fails first in time, 1 first in order
            raise ValueError(f"item {k}")
        return k

    with pytest.raises(ValueError, match="item 1"):
        ordered_map(fn, range(5), workers=4)
    with pytest.raises(ValueError, match="workers must be >= 1"):
        ordered_map(fn, [], workers=0)


def test_worker_pool_runs_n_requests_at_once_on_n_processes():
    pool = WorkerPool([sys.executable, "-c", SLEEPER], size=2, name="sleeper")
    try:
        replies = ordered_map(lambda _: pool.request(b"1.5\n", timeout_s=60.0), range(4), workers=4)
        rows = [r.split() for r in replies]
        pids = {int(r[0]) for r in rows}
        assert len(pids) == 2 and len(pool.workers) == 2  # never a third process
        spans = sorted((float(r[1]), float(r[2])) for r in rows)
        assert spans[0][1] > spans[1][0]  # the first two ran at the same time (1.5 s each)
    finally:
        pool.close()
    assert pool.workers == []


def test_a_worker_past_its_limit_is_replaced_and_the_next_request_is_answered():
    worker = WorkerProcess([sys.executable, "-c", SLEEPER], name="sleeper")
    try:
        first = worker.request(b"0\n", timeout_s=30.0)
        first_pid = int(first.split()[0])
        assert worker.request(b"30\n", timeout_s=0.2) is None
        assert worker.proc.pid != first_pid  # killed and restarted at once
        assert not os.path.exists(f"/proc/{first_pid}") or _is_zombie_or_gone(first_pid)
        assert int(worker.request(b"0\n", timeout_s=30.0).split()[0]) == worker.proc.pid
    finally:
        worker.close()


def test_a_worker_that_does_not_start_names_itself():
    worker = WorkerProcess(
        [sys.executable, "-c", "import sys; sys.exit('boom at start')"], 30.0, "test worker"
    )
    with pytest.raises(RuntimeError, match=r"the test worker did not start:\n.*boom at start"):
        worker.request(b"x\n", timeout_s=1.0)


def _is_zombie_or_gone(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(") ")[1][0] == "Z"
    except OSError:
        return True


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_with_its_parent_even_on_sigkill():
    parent_src = textwrap.dedent(
        f"""
        import sys
        from grpo_fast.sandbox.worker import WorkerProcess
        w = WorkerProcess([sys.executable, "-c", {SLEEPER!r}])
        w.request(b"0\\n", timeout_s=60.0)
        w.proc.stdin.write(b"600\\n")  # in the pipe: the worker sleeps 600 s, deaf to its stdin
        print(w.proc.pid, flush=True)
        sys.stdin.read()
        """
    )
    parent = subprocess.Popen(
        [sys.executable, "-c", parent_src], stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    worker_pid = None
    try:
        worker_pid = int(parent.stdout.readline())
        assert _alive(worker_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait()
        deadline = time.monotonic() + 30.0
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid)  # killed by the kernel, 600 s before its sleep ends
    finally:
        parent.kill()
        parent.wait()
        if worker_pid is not None and _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    return os.path.exists(f"/proc/{pid}") and not _is_zombie_or_gone(pid)


def test_math_grader_grades_on_n_workers_at_once():
    grader = MathGrader(timeout_s=30.0, soft_timeout_s=30.0, workers=2)
    pairs = [("x^2+2x+1", "(x+1)^2"), ("x+2", "x+1")] * 4
    try:
        verdicts = ordered_map(lambda p: grader.equivalent(*p), pairs, workers=4)
        assert verdicts == [True, False] * 4
        assert len(grader._pool.workers) == 2
        assert len({w.proc.pid for w in grader._pool.workers}) == 2
    finally:
        grader.close()


# ----------------------------------------------------------------------------------------------
# score_batch: the same scores as one by one
# ----------------------------------------------------------------------------------------------


def _keyed(response: str, ground_truth: str) -> dict[str, float]:
    """Sleeps longer for earlier responses (later ones finish first); fails on "boom"; the keys
    it returns depend on the response, so an error's zeros depend on what came before."""
    k = int(response.split(":")[0])
    time.sleep(max(0, 6 - k) * 0.02)
    if response.endswith("boom"):
        raise RuntimeError(f"no {k}")
    if response.endswith("extra"):
        return {"reward": 0.5, "extra": 2.0}
    return {"reward": float(response.endswith(ground_truth)), "format_reward": 1.0}


RESPONSES = ["0:4", "1:5", "2:boom", "3:extra", "4:boom", "5:4"]
TRUTHS = ["4"] * 6


@pytest.mark.parametrize("weighted", [False, True], ids=["guarded", "weighted"])
def test_score_batch_gives_the_one_by_one_scores_and_bookkeeping(weighted):
    def make():
        guard = GuardedReward(Concurrency(_keyed), "keyed", "zero")
        if weighted:
            return WeightedReward([guard, GuardedReward(lambda r, g: {"reward": 1.0}, "one")], [1.0, 0.5])
        return guard

    one_by_one = make().for_batch(step=3)
    expected = [one_by_one(r, g) for r, g in zip(RESPONSES, TRUTHS)]
    # the error at 2 scores zeros for the keys of 0 and 1, the one at 4 for the keys of 3
    assert "format_reward" in expected[2] and "extra" not in expected[2] and "extra" in expected[4]
    reward = make()
    batch = reward.for_batch(step=3)
    assert score_batch(batch, RESPONSES, TRUTHS, workers=3) == expected
    assert batch.scores == one_by_one.scores and batch.errors == one_by_one.errors == 2
    assert batch.errors_by_part == one_by_one.errors_by_part and batch.index == 6
    fn = reward.parts[0].fn if weighted else reward.fn
    assert fn.most >= 2  # the function really ran concurrently
    direct = make()
    assert score_batch(direct, RESPONSES, TRUTHS, workers=3) == [
        direct(r, g) for r, g in zip(RESPONSES, TRUTHS)
    ]


def test_score_batch_raises_the_first_error_with_its_response_number():
    batch = GuardedReward(_keyed, "keyed").for_batch(step=7)
    with pytest.raises(
        RewardError, match=r"^reward function 'keyed' raised RuntimeError: no 2 on response 2 of step 7"
    ):
        score_batch(batch, RESPONSES, TRUTHS, workers=4)


def test_score_batch_on_a_plain_function_and_bad_lengths():
    assert score_batch(lambda r, g: {"reward": float(r == g)}, ["a", "b"], ["a", "a"], workers=2) == [
        {"reward": 1.0},
        {"reward": 0.0},
    ]
    with pytest.raises(ValueError, match="2 responses but 1 ground truths"):
        score_batch(lambda r, g: {}, ["a", "b"], ["a"])
