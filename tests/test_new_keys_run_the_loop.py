"""Issue 25's keys run the tiny preset to the end through the real loop (``grpo_fast.train.main``),
each with its effect visible in what the run wrote: SAPO's gate in ``train/loss_pg``, top-k's
truncated log-probs in the entropies and the sampler gap, normalize_each on two rewards, the paced
curriculum in the prompts drawn, the adaptive entropy coefficient in ``train/entropy_coef``."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from grpo_fast.loop import rollout_phase
from grpo_fast.task.tiny import CHARS, SPECIAL_TOKENS, carries
from grpo_fast.train import main

STEPS = 3
BATCH = 32  # 4 prompts × 8 responses
QUICK = [
    "--preset",
    "tiny",
    f"steps={STEPS}",
    "eval_every=0",
    "checkpoint_every=0",
    f"rollout.batch_size={BATCH}",
    f"train.micro_batch_size={BATCH}",
    "data.eval_subset_size=8",
    "logging.progress=false",
    "logging.sample_every=0",
    "sft.steps=0",
]
# SAPO's check needs groups whose rewards differ, which the untrained model never earns: DAPO's
# overlong punishment over the last 3 of the 4 tokens scores lengths 1-4 as 0, −1/3, −2/3, −1
# (instead of an SFT warm start: 30 steps of it cost minutes on 2 busy cores)
SHAPED = ["data.overlong_buffer=3", "data.overlong_penalty=1.0"]
VOCAB = len(SPECIAL_TOKENS) + len(CHARS)  # 15: the highest entropy is ln 15 ≈ 2.71 nats


def _check_sapo(rows, out, calls):
    # On-policy (r = 1) with sequence_mean weights (each response's tokens sum to 1/B):
    # loss_pg = −(1/B)·Σ_i (4/τ_i)·σ(0)·A_i = −(1/B)·Σ_i (2/τ_i)·A_i. The group-centred advantages
    # sum to 0, so GRPO's is 0; SAPO's τ = 1 for A > 0 and 1.05 for A ≤ 0 leaves
    # −(2/B)·(1 − 1/1.05)·Σ_{A>0} A < 0 in every step with a group whose rewards differ.
    informative = [r for r in rows if r["train/zero_variance_fraction"] < 1]
    assert informative, "no step had a group with different rewards: the check saw nothing"
    for r in informative:
        assert r["train/loss_pg"] < -1e-4, r
    for r in rows:
        if r["train/zero_variance_fraction"] == 1:
            assert r["train/loss_pg"] == 0.0
        assert r["train/clip_fraction"] == 0.0  # SAPO never clips


def _check_top_k(rows, out, calls):
    for r in rows:
        # the trainer's entropy is the top-4 distribution's: at most ln 4 ≈ 1.386 nats (the full
        # vocabulary's is ~1.9-2.7 on the tiny model before training)
        assert r["train/entropy_mean"] <= math.log(4) + 1e-6, r
        # the trainer's log-probs of the sampled tokens are the sampler's (hf backend), not
        # log π(a) over the full vocabulary, which is off by log Σ_top-4 π (tenths of a nat here)
        assert r["rollout/logprob_abs_diff"] < 1e-5, r


def _check_normalize_each(rows, out, calls):
    assert len(calls) == STEPS  # one advantage per step, made from the two rewards separately
    for parts, weights in calls:
        assert [len(p) for p in parts] == [BATCH, BATCH] and weights == [1.0, 0.5]
    for r in rows:
        assert {"train/reward/tiny", "train/reward/gsm8k"} <= set(r)
        assert r["train/reward_mean"] == pytest.approx(r["train/reward/tiny"] + 0.5 * r["train/reward/gsm8k"])


def _check_paced(rows, out, calls):
    # By carries, the easiest 25% of the prompts (26.5% at step 3: 0.25 + 0.75·2/100) are all
    # carry-free (30% of the sums a + b of 0-99 have no carry): every prompt drawn is one. Without
    # pacing the chance of 12 carry-free prompts out of 12 is 0.3^12 ≈ 5e-7.
    for step in range(1, STEPS + 1):
        lines = (out / "samples" / f"step_{step}.jsonl").read_text().splitlines()
        prompts = {json.loads(line)["prompt"] for line in lines}
        assert len(prompts) == BATCH // 8
        for prompt in prompts:
            a, b = map(int, prompt.rstrip("=").split("+"))
            assert carries(a, b) == 0, (step, prompt)


def _check_entropy_target(rows, out, calls):
    # Target 3 > ln 15: every step's entropy is at or below it, so c = 0 rises by 0.005 a step
    # (0.005, 0.010, 0.015), and from step 2 the loss carries −c·H (none on the first step).
    assert math.log(VOCAB) < 3.0
    assert [r["train/entropy_coef"] for r in rows] == pytest.approx([0.005, 0.010, 0.015])
    assert rows[0]["train/loss_entropy"] == 0.0
    assert all(r["train/loss_entropy"] < 0 for r in rows[1:])


CASES = {
    "sapo": (["loss.type=sapo", *SHAPED], _check_sapo),
    "top_k=4": (["rollout.top_k=4"], _check_top_k),  # loss.truncated_logprobs=auto: on
    "normalize_each": (
        [
            "data.reward=[tiny,gsm8k]",
            "data.reward_weights=[1.0,0.5]",
            "data.reward_aggregation=normalize_each",
        ],
        _check_normalize_each,
    ),
    "paced": (
        [
            "rollout.curriculum=paced",
            "data.difficulty_field=carries",
            "rollout.curriculum_steps=100",
            "logging.sample_every=1",
            f"logging.samples_per_dump={BATCH}",
        ],
        _check_paced,
    ),
    "entropy_target": (["loss.entropy_target=3.0"], _check_entropy_target),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_the_key_runs_the_tiny_preset_to_the_end(case, tmp_path: Path, monkeypatch):
    overrides, check = CASES[case]
    calls = []
    real = rollout_phase.normalize_each_reward

    def spy(parts, weights, *args, **kwargs):
        calls.append(([p.tolist() for p in parts], list(weights)))
        return real(parts, weights, *args, **kwargs)

    monkeypatch.setattr(rollout_phase, "normalize_each_reward", spy)
    out = tmp_path / "run"
    assert main([*QUICK, *overrides, f"output_dir={out}"]) == 0
    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    rows = [r for r in rows if "train/loss" in r]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))
    assert (out / "final").is_dir()
    if case != "normalize_each":
        assert calls == []
    check(rows, out, calls)
