"""One rule for "correct" (``grpo_fast.task.rewards.correct``), set where rewards are scored and
read by the pass rates, the step's accuracy and evaluation."""

from __future__ import annotations

import json

import answer_oracle
import pytest

from grpo_fast.task import tiny
from grpo_fast.task.rewards import correct
from grpo_fast.train import main


def partial_credit(response: str, ground_truth: str) -> dict:
    """1 for the sum, 0.5 for any other answer; no ``answer_reward``."""
    return {"reward": 1.0 if response.strip() == ground_truth.strip() else 0.5}


@pytest.mark.parametrize(
    "scores, want",
    [({"reward": 0.0, "answer_reward": 1.0}, 1.0), ({"reward": 1.0}, 1.0), ({"reward": 0.5}, 0.0),
     ({"reward": 2.0}, 1.0), ({"reward": 1.0, "answer_reward": 0.0}, 0.0)],
)  # fmt: skip
def test_the_answer_reward_decides_else_a_full_reward(scores, want):
    assert correct(scores) == want


def test_shaping_and_partial_credit_leave_accuracy_and_pass_rates_alone(tmp_path, monkeypatch):
    """The answer oracle (tests/answer_oracle.py: half of each group right, the other half its
    tenfold), a reward giving 0.5 for a wrong answer and no ``answer_reward``, and DAPO's overlong
    shaping on every response (``data.overlong_buffer=3`` of ``rollout.max_tokens=4``): the step's
    accuracy and the pass-rate table both read 0.5, while the shaped reward is below it. Planted
    (ed0dfd1): accuracy from the shaped reward == 1 → 0.0; pass rates from reward > 0 → 1.0."""
    answer_oracle.install(monkeypatch, tiny.build_tokenizer())
    args = ["--preset", "tiny", f"output_dir={tmp_path}", "steps=1", "sft.steps=0", "eval_every=0",
            "checkpoint_every=0", "logging.progress=false", "logging.sample_every=0",
            "rollout.batch_size=32", "data.reward=test_correct_rule:partial_credit",
            "data.overlong_buffer=3", "rollout.difficulty_filter=[0.0,1.0]"]  # fmt: skip
    assert main(args) == 0
    (row,) = [
        r for r in map(json.loads, (tmp_path / "metrics.jsonl").read_text().splitlines()) if r["step"] == 1
    ]
    assert row["rollout/overlong_penalty_mean"] < 0
    assert row["train/reward_mean"] == pytest.approx(0.75 + row["rollout/overlong_penalty_mean"], abs=1e-6)
    assert row["train/accuracy"] == 0.5
    assert row["rollout/pass_rate_mean"] == 0.5
