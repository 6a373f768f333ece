"""The peer duel's one compute thread (bench/peers/duel.py ``ComputeThread``): jobs run on it
and hand back results and errors, a held loop (TRL's ``train()`` at its step gate) serves the
other jobs meanwhile, and closing the thread while the loop is held ends that loop at once
instead of leaving it to run one more step and wait for ever."""

from __future__ import annotations

import threading

import pytest

from bench.peers.duel import ComputeThread, DuelClosed


def test_jobs_run_on_the_one_thread_and_errors_come_back():
    compute = ComputeThread()
    try:
        names = {compute.run(lambda: threading.current_thread().name) for _ in range(3)}
        assert names == {"duel-compute"}
        with pytest.raises(ZeroDivisionError):
            compute.run(lambda: 1 / 0)
    finally:
        compute.close()
    assert not compute._thread.is_alive()


def test_a_held_loop_serves_other_jobs_and_ends_when_the_thread_closes():
    compute = ComputeThread()
    go, steps, outcome, held = object(), [], [], threading.Semaphore(0)

    def loop():  # as TRL's train(): a step, then its gate serves the queue until `go`
        try:
            for i in range(100):
                steps.append(i)
                held.release()
                compute.serve(until=go)
        except DuelClosed:
            outcome.append("closed")

    compute.submit(loop)
    held.acquire()  # step 0 done, the loop held
    assert compute.run(lambda: threading.current_thread().name) == "duel-compute"  # served meanwhile
    compute.resume(go)
    held.acquire()  # step 1 done
    compute.close()
    assert steps == [0, 1] and outcome == ["closed"]  # no third step after close
    assert not compute._thread.is_alive()
