"""``data.reward_aggregation``: ``sum`` (the weighted sum normalized in its group) or
``normalize_each`` (GDPO: each reward normalized in its group, then the weighted sum):
hand-worked values, the one-reward identity, and the rollout phase on a scripted backend."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from support.stand_ins import rollout_phase_run

from grpo_fast.algo.core import normalize_each_reward, normalize_group_rewards
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop import rollout_phase as phase
from grpo_fast.rollout import Rollout
from grpo_fast.task.data import Example
from grpo_fast.task.rewards import GuardedReward, WeightedReward


def test_hand_worked_group_scaling():
    # one group of 4, ε = 0: r1 = [1, 0, 0, 0] (mean 0.25, unbiased std 0.5) → [1.5, −0.5, −0.5, −0.5];
    # r2 = [0, 1, 1, 1] (mean 0.75, std 0.5) → [−1.5, 0.5, 0.5, 0.5]; weights [1, 0.5]:
    # A = [1.5 − 0.75, −0.5 + 0.25, …] = [0.75, −0.25, −0.25, −0.25]
    r1, r2 = torch.tensor([1.0, 0, 0, 0]), torch.tensor([0.0, 1, 1, 1])
    each = normalize_each_reward([r1, r2], [1.0, 0.5], 4, 0.0, scale_rewards="group")
    assert each.tolist() == [0.75, -0.25, -0.25, -0.25]
    # the sum [1, 0.5, 0.5, 0.5] (mean 0.625, std 0.25) normalizes to [1.5, −0.5, −0.5, −0.5]
    summed, _ = normalize_group_rewards(r1 + 0.5 * r2, 4, 0.0, scale_rewards="group")
    assert summed.tolist() == [1.5, -0.5, -0.5, -0.5]


def test_hand_worked_groups_of_two_sizes():
    # sizes [2, 3], ε = 0. r1 = [1, 0 | 1, 1, 1]: group 1 → [0.7071, −0.7071] (std 0.7071), group 2
    # zero variance → 0. r2 = [0, 0 | 2, 0, 1]: group 1 → 0, group 2 (mean 1, std 1) → [1, −1, 0];
    # weights [2, 1]: A = [1.4142, −1.4142, 1, −1, 0]
    r1, r2 = torch.tensor([1.0, 0, 1, 1, 1]), torch.tensor([0.0, 0, 2, 0, 1])
    each = normalize_each_reward([r1, r2], [2.0, 1.0], [2, 3], 0.0, scale_rewards="group")
    assert each.tolist() == pytest.approx([2**0.5, -(2**0.5), 1.0, -1.0, 0.0], rel=1e-6)


def test_without_scaling_it_is_the_sum_up_to_rounding():
    """Centring is linear: with ``scale_rewards=none`` both aggregations agree (to fp32 rounding);
    the std scaling (group, batch) is what makes them differ."""
    g = torch.Generator().manual_seed(0)
    r1, r2 = torch.rand(24, generator=g), torch.randint(0, 2, (24,), generator=g).float()
    each = normalize_each_reward([r1, r2], [1.0, 0.3], 8, 1e-6, scale_rewards="none")
    summed, _ = normalize_group_rewards(r1 + 0.3 * r2, 8, 1e-6, scale_rewards="none")
    torch.testing.assert_close(each, summed, rtol=0, atol=1e-6)
    each_g = normalize_each_reward([r1, r2], [1.0, 0.3], 8, 1e-6, scale_rewards="group")
    summed_g, _ = normalize_group_rewards(r1 + 0.3 * r2, 8, 1e-6, scale_rewards="group")
    assert (each_g - summed_g).abs().max() > 0.1


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_one_reward_is_sum_bit_for_bit(scale):
    g = torch.Generator().manual_seed(1)
    r = torch.rand(10, generator=g)
    each = normalize_each_reward([r], [1.0], [3, 3, 4], 1e-6, scale_rewards=scale)
    summed, _ = normalize_group_rewards(r, [3, 3, 4], 1e-6, scale_rewards=scale)
    assert torch.equal(each, summed)


def test_config_key():
    assert load_config("tiny").data.reward_aggregation == "sum"
    with pytest.raises(
        ConfigError, match=r"^data\.reward_aggregation='mean' is not one of: sum, normalize_each"
    ):
        load_config("tiny", overrides=["data.reward_aggregation=mean"])


class _Backend:
    """Prompt ``[p]``'s responses are ``texts[p]``, in order."""

    def __init__(self, texts):
        self.texts = texts

    def generate(self, prompt_ids, params, progress=None):
        out = [self.texts[p[0]][k] for p in prompt_ids for k in range(params.n)]
        return Rollout([list(p) for p in prompt_ids], [[7] * len(t) for t in out], out, ["stop"] * len(out))

    def sleep(self):
        pass


def _batch(aggregation: str, reward, *overrides):
    """The rollout phase of one step: one prompt, 4 responses ``a, b, bb, bbb`` (answer ``a``)."""
    cfg = load_config(
        "tiny",
        overrides=[
            "rollout.group_size=4",
            "rollout.batch_size=4",
            "loss.advantage_eps=0",
            f"data.reward_aggregation={aggregation}",
            *overrides,
        ],
    )
    parts = reward.names if isinstance(reward, WeightedReward) else []
    task = SimpleNamespace(
        train=[Example("q0", "a")], prompt_ids=lambda ex: [0], reward_fn=reward, stop=[], reward_parts=parts
    )
    run = rollout_phase_run(cfg, task, _Backend({0: ["a", "b", "bb", "bbb"]}))
    progress = SimpleNamespace(phase=lambda *a: None, advance_phase=lambda *a: None)
    return phase.rollout_phase(run, 1, progress)


exact = GuardedReward(lambda r, gt: {"reward": float(r == gt), "answer_reward": float(r == gt)}, "exact")
longer = GuardedReward(lambda r, gt: {"reward": float(len(r) > 1)}, "longer")


def test_rollout_phase_normalizes_each_part():
    """exact = [1, 0, 0, 0], longer = [0, 0, 1, 1], weights [1, 0.5], one group of 4, ε = 0:
    exact → [1.5, −0.5, −0.5, −0.5]; longer (mean 0.5, std 0.57735) → [−0.86603, −0.86603,
    0.86603, 0.86603]; A = [1.06699, −0.93301, −0.06699, −0.06699]. The summed rewards
    [1, 0, 0.5, 0.5] (what is logged; mean 0.5, std 0.40825) normalize to [1.22474, −1.22474, 0, 0]
    under sum."""
    both = WeightedReward([exact, longer], [1.0, 0.5])
    each = _batch("normalize_each", both)
    h = 0.5 * 3**0.5  # (1 − 0.5) / 0.57735 = 0.86603
    assert each.advantages.tolist() == pytest.approx(
        [1.5 - 0.5 * h, -0.5 - 0.5 * h, -0.5 + 0.5 * h, -0.5 + 0.5 * h]
    )
    assert each.raw_rewards.tolist() == [1.0, 0.0, 0.5, 0.5]
    summed = _batch("sum", both)
    assert summed.raw_rewards.tolist() == each.raw_rewards.tolist()
    assert summed.advantages.tolist() == pytest.approx([1.5**0.5, -(1.5**0.5), 0.0, 0.0], rel=1e-6)
    assert each.reward_meta["advantage_abs_mean"] == pytest.approx(each.advantages.abs().mean().item())


def test_rollout_phase_one_reward_is_sum_and_shaping_is_a_part():
    one_each, one_sum = _batch("normalize_each", exact), _batch("sum", exact)
    assert torch.equal(one_each.advantages, one_sum.advantages)
    # overlong buffer 2 at max_tokens 4: lengths 1, 1, 2, 3 get penalties 0, 0, 0, −0.5; as its own
    # part: [0, 0, 0, −0.5] (mean −0.125, std 0.25) → [0.5, 0.5, 0.5, −1.5], added to exact's
    shaped = _batch("normalize_each", exact, "data.overlong_buffer=2", "data.overlong_penalty=1.0")
    assert shaped.advantages.tolist() == pytest.approx([2.0, 0.0, 0.0, -2.0])
    assert shaped.raw_rewards.tolist() == [1.0, 0.0, 0.0, -0.5]
