"""Rewards for ``bench/test_bench_pipeline.py``: the tiny task's exact match behind a wait, as a
grader or a sandbox call makes one (``data.reward=bench.slow_rewards:tiny_10ms``)."""

from __future__ import annotations

import time

from grpo_fast.task.tiny import tiny_reward_fn

WAIT_S = 0.010


def tiny_10ms(response: str, ground_truth: str) -> dict[str, float]:
    """``tiny_reward_fn`` after a 10 ms wait (a sleep: it holds no core, as a call to another
    process does)."""
    time.sleep(WAIT_S)
    return tiny_reward_fn(response, ground_truth)
