"""``rollout.curriculum=paced``: each step draws from the easiest share of the prompts, a share
growing from ``rollout.curriculum_start`` to 1 over ``rollout.curriculum_steps``; by the data's
difficulty or the pass rates; a mixture at every step, never a sort; exact resume; the loop hands
it the step."""

from __future__ import annotations

from collections import Counter
from types import SimpleNamespace

import pytest
from support.stand_ins import rollout_phase_run

from grpo_fast.algo.difficulty import PassRateTable, paced_quantile
from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop import rollout_phase as phase
from grpo_fast.loop import setup as setup_mod
from grpo_fast.rollout import Rollout
from grpo_fast.task.data import Example
from grpo_fast.task.rewards import GuardedReward


def test_quantile_by_hand():
    # start 0.25 over 100 steps: step 1 → 0.25; step 51 → 0.25 + 0.75·50/100 = 0.625; step 101 on → 1
    assert [paced_quantile(s, 0.25, 100) for s in (1, 51, 101, 400)] == [0.25, 0.625, 1.0, 1.0]
    assert paced_quantile(11, 0.5, 20) == 0.75  # 0.5 + 0.5·10/20


DIFFICULTY = [3.0, 0.0, 2.0, 1.0, 0.0, 3.0, 1.0, 2.0]  # 8 prompts: the easiest are 1 and 4, then 3, 6


def test_the_admitted_share_grows_from_the_easy_end():
    """8 prompts, start 0.25 over 4 steps, 2 per draw: step 1 admits the 2 easiest (1, 4: both
    drawn); step 3 (q = 0.625: ⌈5⌉ prompts) admits 1, 4, 3, 6 and one of the 2-difficulty pair
    (the run's fixed tie-break); step 5 on (q = 1) all 8."""
    s = PromptSampler(8, seed=0, curriculum="paced", difficulty=DIFFICULTY, pace=(0.25, 4))
    assert sorted(s.next(2, step=1)) == [1, 4]
    seen3 = {i for _ in range(40) for i in s.next(2, step=3)}
    assert {1, 3, 4, 6} < seen3 and len(seen3) == 5 and seen3 - {1, 3, 4, 6} <= {2, 7}
    seen5 = {i for _ in range(60) for i in s.next(2, step=5)}
    assert seen5 == set(range(8))
    for step in (1, 3, 5):
        draw = s.next(2, step=step)
        assert len(set(draw)) == 2  # distinct within a draw


def test_a_mixture_at_every_step_not_a_sort():
    """The tiny task (9,500 sums; carries 0/1/2 for 30%/45%/25%), 32 prompts a step, start 0.25
    over 250 steps: step 1 draws carry-free sums only; in the middle, easy and harder ones in the
    pool's proportion (step 125, q = 0.62: the 2,872 carry-free and ~3,000 one-carry sums, about
    half each); from step 251 the data's own mix. easy_first's hard sort, by contrast, gives a
    stretch of one class only."""
    from grpo_fast.task import tiny

    d = [e.difficulty for e in tiny.examples("train")]
    s = PromptSampler(len(d), seed=0, curriculum="paced", difficulty=d, pace=(0.25, 250))

    def mix(step, draws=20):
        c = Counter(d[i] for _ in range(draws) for i in s.next(32, step=step))
        return {k: c[k] / (32 * draws) for k in (0.0, 1.0, 2.0)}

    assert mix(1)[0.0] == 1.0
    mid = mix(125)
    assert 0.35 < mid[0.0] < 0.65 and 0.35 < mid[1.0] < 0.65 and mid[2.0] == 0.0
    late = mix(300)
    assert all(abs(late[k] - Counter(d)[k] / len(d)) < 0.05 for k in late)
    sorted_pass = PromptSampler(len(d), seed=0, curriculum="easy_first", difficulty=d)
    middle = Counter(d[i] for _ in range(20) for i in sorted_pass.next(32)[:0] + sorted_pass.next(32))
    assert len(middle) == 1  # the sort's first 1,280 prompts: one class only


def test_by_pass_rate_the_ranking_follows_the_table():
    """Without a difficulty field the table ranks the prompts (easiness_key: unseen first, then the
    highest rate): with start 0.5 over 10 steps on 4 prompts, step 1 admits the 2 easiest."""
    table = PassRateTable(4)
    s = PromptSampler(4, seed=0, table=table, curriculum="paced", pace=(0.5, 10))
    table.update([0, 1, 2, 3], [[0.0], [1.0], [0.5], [0.25]])  # easiest: 1 (1.0), then 2 (0.5)
    assert {i for _ in range(20) for i in s.next(1, step=1)} == {1, 2}
    table.update([0], [[1.0] * 9])  # prompt 0 now at 0.9: the easiest two are 0 and 1
    assert {i for _ in range(20) for i in s.next(1, step=1)} == {0, 1}
    with pytest.raises(ValueError, match="pass-rate table"):
        PromptSampler(4, seed=0, curriculum="paced", pace=(0.5, 10))


def test_state_resumes_the_same_draws():
    s = PromptSampler(8, seed=2, curriculum="paced", difficulty=DIFFICULTY, pace=(0.25, 6))
    for step in (1, 2, 3):
        s.next(3, step=step)
    # a resume with another run length (curriculum_steps null: half of it) keeps the run's pace
    again = PromptSampler(8, seed=2, curriculum="paced", difficulty=DIFFICULTY, pace=(0.25, 60))
    again.load_state_dict(s.state_dict())
    assert again.pace == (0.25, 6)
    assert [again.next(3, step=t) for t in (4, 5, 6)] == [s.next(3, step=t) for t in (4, 5, 6)]


def test_config_keys():
    cfg = load_config("tiny", overrides=["rollout.curriculum=paced", "data.difficulty_field=carries"])
    assert (cfg.rollout.curriculum_start, cfg.rollout.curriculum_steps) == (0.25, None)
    with pytest.raises(ConfigError, match=r"^rollout\.curriculum_start must be in \(0, 1\], got 0"):
        load_config("tiny", overrides=["rollout.curriculum_start=0"])
    with pytest.raises(ConfigError, match=r"^rollout\.curriculum_steps must be >= 1 \(or null\), got 0"):
        load_config("tiny", overrides=["rollout.curriculum_steps=0"])
    with pytest.raises(
        ConfigError, match=r"rollout\.curriculum='hard' is not one of: none, easy_first, paced"
    ):
        load_config("tiny", overrides=["rollout.curriculum=hard"])


class _Backend:
    def generate(self, prompt_ids, params, progress=None):
        out = ["a"] * (len(prompt_ids) * params.n)
        return Rollout([list(p) for p in prompt_ids], [[7]] * len(out), out, ["stop"] * len(out))

    def sleep(self):
        pass


def test_the_rollout_phase_paces_by_its_step():
    """8 prompts of difficulties 0-7, 2 per step, start 0.25 over 4 steps (``steps=8``: half the
    run by default): step 1 draws from prompts 0-1 only, step 5 on from all of them."""
    cfg = load_config(
        "tiny",
        overrides=["rollout.group_size=2", "rollout.batch_size=4", "rollout.curriculum=paced",
                   "data.difficulty_field=level", "steps=8"],
    )  # fmt: skip
    train = [Example(f"q{p}", "a", difficulty=float(p)) for p in range(8)]
    task = SimpleNamespace(train=train, prompt_ids=lambda ex: [int(ex.question[1:])], stop=[],
                           reward_fn=GuardedReward(lambda r, g: {"reward": 1.0}, "one"), reward_parts=[])  # fmt: skip
    assert setup_mod._prompt_sampler(cfg, task)[1].pace == (0.25, 4)
    run = rollout_phase_run(cfg, task, _Backend())
    progress = SimpleNamespace(phase=lambda *a: None, advance_phase=lambda *a: None)
    drawn = lambda step: {int(e.question[1:]) for e in phase.rollout_phase(run, step, progress).examples}
    assert set().union(*(drawn(1) for _ in range(5))) == {0, 1}
    assert len(set().union(*(drawn(5) for _ in range(20)))) == 8
