"""Groups of different sizes through the whole loop: each response is trained under its own prompt.

``rollout.adaptive_group_size`` gives each prompt a group size from its pass rate, so the groups of
one step differ in size. Before the trajectory type, four places found a response's prompt as
``i // (R / P)``: once the sizes differed, responses were trained under another prompt's tokens
and the step metrics stopped the run with a traceback. Here the real loop (setup, the rollout
phase, the optimization phase, the step metrics) runs on the tiny model with groups of unequal
size, and every microbatch row the loss sees is checked against what the backend generated.
"""

from __future__ import annotations

import json
from collections import Counter

from grpo_fast import train as train_mod
from grpo_fast.config import load_config
from grpo_fast.loop import optimization
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.task.rewards import register_reward

# Six problems; the reward scores a response 1 whenever its problem's answer is a multiple of 3
# (pass rate 1: a small group) and otherwise by the response's length parity (about half right: a
# large group), so the sizes of one step's groups differ as soon as its prompts have been seen.
PROBLEMS = [
    ("12+34=", "46"),
    ("20+13=", "33"),
    ("7+8=", "15"),
    ("5+6=", "11"),
    ("40+2=", "42"),
    ("9+9=", "18"),
]


@register_reward("_test_unequal_groups")
def _reward(response: str, ground_truth: str) -> dict[str, float]:
    return {"reward": 1.0 if int(ground_truth) % 3 == 0 else float(len(response) % 2)}


def _pairs_of(mb) -> list[tuple[tuple[int, ...], tuple[int, ...]]]:
    """Each row of an unpacked, unshared microbatch as (prompt tokens, response tokens): the
    response is what its selected positions predict, the prompt the real tokens before it."""
    out = []
    for r in range(mb.input_ids.shape[0]):
        tokens = mb.input_ids[r][mb.attention_mask[r].bool()].tolist()
        first = int(mb.select[r].nonzero()[0])  # the prompt's last position predicts the first label
        out.append((tuple(tokens[: first + 1]), tuple(tokens[first + 1 :])))
    return out


def test_each_response_is_trained_under_its_own_prompt(tmp_path, monkeypatch):
    data = tmp_path / "six.jsonl"
    data.write_text("".join(json.dumps({"question": q, "answer": a}) + "\n" for q, a in PROBLEMS))
    generated, trained = Counter(), Counter()

    real_generate = HFBackend.generate

    def recording_generate(self, prompt_ids, params, progress=None):
        rollout = real_generate(self, prompt_ids, params, progress)
        if params.n > 1:  # the training rollouts (evaluation samples one greedy response)
            for g in rollout.groups:
                generated.update((tuple(g.prompt_ids), tuple(t.token_ids)) for t in g.trajectories)
        return rollout

    real_make = optimization.make_microbatches

    def recording_make(trajectories, *args, **kwargs):
        mbs = real_make(trajectories, *args, **kwargs)  # the optimization phase's microbatches
        for mb in mbs:
            trained.update(_pairs_of(mb))
        return mbs

    monkeypatch.setattr(HFBackend, "generate", recording_generate)
    monkeypatch.setattr(optimization, "make_microbatches", recording_make)
    cfg = load_config(
        "tiny",
        overrides=[
            f"data.train_path={data}",
            "data.reward=_test_unequal_groups",
            "rollout.adaptive_group_size=true",
            "rollout.min_group_size=2",
            "rollout.max_group_size=14",
            "rollout.batch_size=16",
            "rollout.max_tokens=3",
            "train.share_prompts=false",  # one row per response: each row is (its prompt, itself)
            "train.skip_zero_advantage=false",  # every generated response trains
            "train.micro_batch_size=4",
            "sft.steps=0",
            "steps=6",
            "eval_every=0",
            "checkpoint_every=0",
            "logging.progress=false",
            f"output_dir={tmp_path / 'run'}",
        ],
    )
    out = train_mod.run(cfg)

    rows = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert len(steps) == 6  # every step's metrics were written: no traceback after the update
    uneven = [r for r in steps if r["rollout/group_size_min"] < r["rollout/group_size_max"]]
    assert uneven, "the groups never differed in size: the test would not see the bug"
    # every (prompt, response) the loss saw is one the backend generated, as often: none moved
    # to another prompt, none lost
    assert trained == generated
    assert sum(r["train/response_length_mean"] > 0 for r in steps) == 6
