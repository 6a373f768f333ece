"""The estimators of ``loss.advantage`` beside ``group`` (grpo_fast.algo.advantages): each against a
float64 reference written from its definition, one token at a time, on random inputs with padding
and holes where an environment inserted tokens. What each does to a run: tests/test_sweep.py."""

import pytest
import torch

import grpo_fast
from grpo_fast.algo import course
from grpo_fast.algo.advantages import (
    compute_gae,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    normalize_group_rewards,
)


def _random_tokens(seed, b=6, t=9):
    """``(rewards [B, T], values [B, T], mask [B, T])``: each row a prefix of sampled and inserted
    tokens (holes) then padding; one row with no sampled token at all."""
    g = torch.Generator().manual_seed(seed)
    mask = torch.zeros(b, t, dtype=torch.bool)
    for i in range(b - 1):
        n = int(torch.randint(1, t + 1, (1,), generator=g))
        mask[i, :n] = torch.rand(n, generator=g) > 0.3
        mask[i, 0] = True  # a response starts with a sampled token
    rewards = torch.randn(b, t, generator=g)
    values = torch.randn(b, t, generator=g)
    return rewards, values, mask


def _gae_reference(rewards, values, mask, gamma, lams):
    """Row by row over the sampled positions only, float64: δ_k = r_k + γ·V_{k+1} − V_k on the
    k-th sampled token (V after the last = 0), A_k = Σ_j (γλ)^j δ_{k+j}."""
    adv = torch.zeros(rewards.shape, dtype=torch.float64)
    for i in range(rewards.shape[0]):
        pos = mask[i].nonzero().squeeze(1).tolist()
        r = [float(rewards[i, p]) for p in pos]
        v = [float(values[i, p]) for p in pos] + [0.0]
        deltas = [r[k] + gamma * v[k + 1] - v[k] for k in range(len(pos))]
        for k, p in enumerate(pos):
            adv[i, p] = sum((gamma * lams[i]) ** j * deltas[k + j] for j in range(len(pos) - k))
    return adv


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_gae_equals_its_definition_with_padding_and_holes(seed):
    rewards, values, mask = _random_tokens(seed)
    lam = torch.tensor([0.95, 0.0, 1.0, 0.5, 0.9, 0.7])  # one λ per response (length-adaptive λ)
    for gamma, lams in ((0.99, [0.95] * 6), (0.8, lam.tolist())):
        adv, ret = compute_gae(rewards, values, mask, gamma=gamma, lam=0.95 if lams[1] == 0.95 else lam)
        ref = _gae_reference(rewards.double(), values.double(), mask, gamma, lams)
        torch.testing.assert_close(adv.double(), ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(
            ret.double(), torch.where(mask, ref + values.double(), 0.0), rtol=1e-6, atol=1e-6
        )
        assert adv.dtype == torch.float32 and not adv[~mask].any() and not ret[~mask].any()


def test_gae_one_dimensional_is_the_course_form():
    """The CS336 write-up's ``compute_gae(rewards, values, gamma=0.99, lam=0.95)``: the case B = 1,
    every token sampled; the course API and ``grpo_fast`` export this one function."""
    assert course.compute_gae is grpo_fast.compute_gae is compute_gae
    rewards, values = torch.tensor([0.0, 0.0, 1.0]), torch.tensor([0.2, 0.5, 0.4])
    adv, ret = compute_gae(rewards, values, gamma=0.99, lam=0.95)
    ref = _gae_reference(
        rewards[None].double(), values[None].double(), torch.ones(1, 3, dtype=torch.bool), 0.99, [0.95]
    )
    torch.testing.assert_close(adv.double(), ref[0], rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(ret, adv + values)
    with pytest.raises(TypeError, match="pass gamma= and lam= by keyword"):
        compute_gae(rewards, values, 0.99, 0.95)  # the write-up's positional gamma would be the mask


@pytest.mark.parametrize("scale", ["none", "group", "batch"])
def test_rloo_is_each_reward_against_the_mean_of_the_others(scale):
    g = torch.Generator().manual_seed(3)
    sizes = [4, 1, 3, 5, 2]
    rewards = torch.randn(sum(sizes), generator=g)
    rewards[5:8] = 0.25  # a group of equal rewards: exactly 0
    adv, meta = compute_rloo_advantages(rewards, sizes, scale_rewards=scale, advantage_eps=1e-6)
    ref, start = [], 0
    for n in sizes:
        grp = rewards[start : start + n].double()
        loo = [float(grp[i] - (grp.sum() - grp[i]) / (n - 1)) if n > 1 else 0.0 for i in range(n)]
        ref += [x / (float(grp.std()) + 1e-6) if scale == "group" and n > 1 else x for x in loo]
        start += n
    ref = torch.tensor(ref, dtype=torch.float64)
    if scale == "batch":
        ref = ref / (float(rewards.double().std()) + 1e-6)
    torch.testing.assert_close(adv.double(), ref, rtol=1e-6, atol=1e-6)
    assert adv[4] == 0 and not adv[5:8].any()  # a group of one, a group of equal rewards
    assert meta["advantage_abs_mean"] == pytest.approx(adv.abs().mean().item())
    assert meta["zero_variance_groups"] == 2


def _reinforce_pp_reference(outcome, token_rewards, mask, gamma, eps):
    """Float64: the outcome reward on the last sampled token, the token rewards on each,
    G at the k-th sampled token = Σ_j γ^j r_{k+j}; whitened over every sampled token."""
    returns = torch.zeros(mask.shape, dtype=torch.float64)
    for i in range(mask.shape[0]):
        pos = mask[i].nonzero().squeeze(1).tolist()
        r = [float(token_rewards[i, p]) for p in pos]
        if pos:
            r[-1] += float(outcome[i])
        for k, p in enumerate(pos):
            returns[i, p] = sum(gamma**j * r[k + j] for j in range(len(pos) - k))
    g = returns[mask]
    return torch.where(mask, (returns - g.mean()) / (g.std() + eps), 0.0), returns


@pytest.mark.parametrize("gamma", [1.0, 0.9])
def test_reinforce_pp_whitens_per_token_returns(gamma):
    kl, _, mask = _random_tokens(4)
    outcome = torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.5])
    sizes = [2, 4]
    for baseline in (False, True):
        adv, ret = compute_reinforce_pp_advantages(
            outcome, mask, 0.1 * kl, gamma, group_sizes=sizes if baseline else None, advantage_eps=1e-6
        )
        centred = outcome - torch.tensor([0.5] * 2 + [0.625] * 4) if baseline else outcome
        ref_adv, ref_ret = _reinforce_pp_reference(centred.double(), 0.1 * kl.double(), mask, gamma, 1e-6)
        torch.testing.assert_close(adv.double(), ref_adv, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(ret.double(), ref_ret, rtol=1e-6, atol=1e-6)
    assert not adv[~mask].any()


def test_reinforce_pp_whitens_over_every_rank():
    """Two ranks' halves with ``reduce_sums`` summing both give the whole batch's advantages."""
    kl, _, mask = _random_tokens(5, b=6)
    outcome = torch.tensor([1.0, 0.0, 0.0, 1.0, 1.0, 0.0])
    whole, _ = compute_reinforce_pp_advantages(outcome, mask, kl)
    halves = [(outcome[:3], mask[:3], kl[:3]), (outcome[3:], mask[3:], kl[3:])]
    totals = []
    for o, m, k in halves:
        _, ret = compute_reinforce_pp_advantages(o, m, k)
        g = ret[m].double()
        totals.append([float(g.numel()), g.sum().item(), (g * g).sum().item()])
    summed = [a + b for a, b in zip(*totals)]
    parts = [compute_reinforce_pp_advantages(o, m, k, reduce_sums=lambda s: summed)[0] for o, m, k in halves]
    torch.testing.assert_close(torch.cat(parts), whole, rtol=1e-6, atol=1e-6)


def test_bad_shapes_and_values_name_the_input():
    mask = torch.ones(2, 3, dtype=torch.bool)
    with pytest.raises(ValueError, match=r"values has shape \(2, 2\), expected \(2, 3\)"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 2), mask)
    with pytest.raises(ValueError, match=r"lam has shape \(3,\), expected a float or \(2,\)"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, lam=torch.ones(3))
    with pytest.raises(ValueError, match=r"gamma=1.5 and lam must be in \[0, 1\]"):
        compute_gae(torch.zeros(2, 3), torch.zeros(2, 3), mask, gamma=1.5)
    with pytest.raises(ValueError, match=r"rewards has shape \(3,\), expected \(2,\)"):
        compute_reinforce_pp_advantages(torch.zeros(3), mask)
    with pytest.raises(ValueError, match=r"gamma=-0.1 must be in \[0, 1\]"):
        compute_reinforce_pp_advantages(torch.zeros(2), mask, gamma=-0.1)
    with pytest.raises(ValueError, match=r"group sizes \[3\] must each be >= 1 and sum to the 2"):
        compute_rloo_advantages(torch.zeros(2), [3])


def test_rloo_is_grpo_centring_times_g_over_g_minus_one():
    """The identity the docs state: RLOO's advantage = G/(G − 1) × GRPO's centred one."""
    r = torch.tensor([1.0, 0.0, 0.0, 0.0, 1.0, 1.0])
    centred, _ = normalize_group_rewards(r, 3, 0.0, scale_rewards="none")
    loo, _ = compute_rloo_advantages(r, 3)
    torch.testing.assert_close(loo, centred * 1.5)
