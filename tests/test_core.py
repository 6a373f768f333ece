"""The algorithm core (grpo_fast.algo.core): hand-worked values (arithmetic in comments) and properties
(hypothesis). The course API built on it is tested in tests/test_course.py, which also holds the
hand-worked advantages of ``normalize_group_rewards`` (through ``compute_group_normalized_rewards``)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from grpo_fast.algo import core, course
from grpo_fast.algo.loss_options import LossOptions

# ---------------------------------------------------------------------------- entropy


def test_compute_entropy_hand_values():
    # uniform over 4 -> ln 4 ≈ 1.386294; one-hot-ish [1000, 0] -> ≈ 0
    h = core.compute_entropy(torch.tensor([[0.0, 0.0, 0.0, 0.0], [1000.0, 0.0, 0.0, 0.0]]))
    torch.testing.assert_close(h, torch.tensor([math.log(4), 0.0]), atol=1e-6, rtol=0)


def test_compute_entropy_ignores_neg_inf_in_value_and_gradient():
    # [0, 0, -inf, -inf] is uniform over 2 -> ln 2; the -inf entries have zero gradient
    logits = torch.tensor([0.0, 0.0, -math.inf, -math.inf], requires_grad=True)
    h = core.compute_entropy(logits)
    h.backward()
    assert h.item() == pytest.approx(math.log(2), abs=1e-7)
    assert torch.isfinite(logits.grad).all() and (logits.grad[2:] == 0).all()


# ---------------------------------------------------------------------------- rewards, advantages


def test_informative_groups():
    r = torch.tensor([1.0, 1.0, 1.0, 0.0, 1.0, 0.0, 0.5, 0.5, 0.5])
    assert core.informative_groups(r, 3) == [False, True, False]  # [1,1,1] | [0,1,0] | [.5,.5,.5]
    assert core.informative_groups(r, [2, 2, 2, 3]) == [False, True, True, False]  # [1,1] [1,0] [1,0] […]
    assert core.informative_groups(torch.tensor([0.7]), [1]) == [False]  # a group of one teaches nothing


@pytest.mark.parametrize(
    ("lengths", "max_tokens", "buffer", "penalty", "expected"),
    [
        # L − c = 16: 16 → 0; 17 → −1/4; 18 → −2/4; 19 → −3/4; 20 (= L) → −1
        ([10, 16, 17, 18, 19, 20], 20, 4, 1.0, [0.0, 0.0, -0.25, -0.5, -0.75, -1.0]),
        ([6, 7, 8], 8, 2, 0.5, [0.0, -0.25, -0.5]),  # L − c = 6: 7 → −0.5·1/2; 8 → −0.5
        ([4, 8, 9], 8, 0, 1.0, [0.0, 0.0, 0.0]),  # buffer 0: off
    ],
    ids=["dapo", "penalty-half", "off"],
)
def test_overlong_penalty_hand_values(lengths, max_tokens, buffer, penalty, expected):
    out = core.overlong_penalty(lengths, max_tokens, buffer, penalty)
    assert out.dtype == torch.float32 and out.tolist() == expected
    assert not torch.signbit(out[0])  # 0, not −0


def test_overlong_penalty_bad_buffer():
    with pytest.raises(ValueError, match=r"buffer=8 must be in \[0, max_tokens=8\)"):
        core.overlong_penalty([1], 8, 8)


# ---------------------------------------------------------------------------- policy-gradient losses


def test_asymmetric_and_dual_clip_hand_values():
    adv = torch.tensor([[1.0], [-1.0]])
    lp = torch.tensor([[0.25], [1.5]])
    # clip-higher: A=+1, r=e^.25≈1.2840 < 1+0.3 → not clipped; symmetric 0.2 would clip at 1.2
    loss, meta = core.grpo_clip_loss(
        adv[:1], lp[:1], torch.zeros(1, 1), LossOptions(clip_low=0.2, clip_high=0.3)
    )
    assert loss.item() == pytest.approx(-math.exp(0.25)) and not meta["clipped"].item()
    # dual clip c=3: A=−1, r=e^1.5≈4.4817: ordinary loss = −min(−4.48, −1.2) = 4.48 > c·|A| = 3 → 3
    loss, meta = core.grpo_clip_loss(
        adv[1:], lp[1:], torch.zeros(1, 1), LossOptions(dual_clip=3.0, clip_low=0.2, clip_high=0.2)
    )
    assert loss.item() == pytest.approx(3.0) and meta["clipped"].item()


@pytest.mark.parametrize("loss_type", ["reinforce_with_baseline", "no_baseline"])
def test_grpo_token_loss_unclipped_types_hand_values(loss_type):
    lp = torch.tensor([0.5, -0.5, 0.0], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, meta = core.grpo_token_loss(lp, adv, LossOptions(type=loss_type), old_logprobs=old)
    # ℓ = −r·A, never clipped: r = e^.5 ≈ 1.6487, A = 1 → −1.6487 (grpo_clip: −1.2, clipped);
    # r = e^−.5 ≈ .6065, A = −1 → .6065 (grpo_clip: .8, clipped); r = 1, A = 2 → −2
    e = math.exp
    torch.testing.assert_close(loss.detach(), torch.tensor([-e(0.5), e(-0.5), -2.0]))
    assert not meta["clipped"].any()
    loss.sum().backward()  # ∂(−r·A)/∂lp = −r·A: the gradient is never cut off
    torch.testing.assert_close(lp.grad, torch.tensor([-e(0.5), e(-0.5), -2.0]))
    clip, clip_meta = core.grpo_token_loss(lp.detach(), adv, LossOptions(), old_logprobs=old)
    torch.testing.assert_close(clip, torch.tensor([-1.2, 0.8, -2.0]))
    assert clip_meta["clipped"].tolist() == [True, True, False]
    with pytest.raises(ValueError, match="dual_clip applies only to loss_type='grpo_clip'"):
        core.grpo_token_loss(lp, adv, LossOptions(dual_clip=3.0, type=loss_type))
    with pytest.raises(ValueError, match="loss_type='ppo' is not one of"):
        core.grpo_token_loss(lp, adv, LossOptions(type="ppo"))


def test_cispo_hand_values():
    """CISPO: ℓ = −sg(clip(r, 0.8, 1.2))·A·log π, the weight detached: clipped tokens keep a gradient."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = torch.tensor([-1.5, -1.5, -0.4])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, meta = core.grpo_token_loss(lp, adv, LossOptions(type="cispo"), old_logprobs=old)
    # r = e^.5 ≈ 1.6487 > 1.2 → ŵ = 1.2: ℓ = −1.2·1·(−1) = 1.2, ∂ℓ/∂log π = −1.2 (grpo_clip: 0)
    # r = e^−.5 ≈ .6065 < .8 → ŵ = .8:   ℓ = −.8·(−1)·(−2) = −1.6, ∂ℓ/∂log π = .8
    # r = e^−.1 ≈ .9048 inside → ŵ = r:  ℓ = −.9048·2·(−.5) = .9048, ∂ℓ/∂log π = −1.8097 (no ∂r term)
    w3 = math.exp(-0.1)
    torch.testing.assert_close(loss.detach(), torch.tensor([1.2, -1.6, w3]))
    assert meta["clipped"].tolist() == [True, True, False]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([-1.2, 0.8, -2 * w3]))
    # on-policy: ŵ = 1, the gradient −A·∇log π of every other loss type
    lp.grad = None
    loss, _ = core.grpo_token_loss(lp, adv, LossOptions(type="cispo"))
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -adv)
    with pytest.raises(ValueError, match="dual_clip applies only to loss_type='grpo_clip', not 'cispo'"):
        core.grpo_token_loss(lp, adv, LossOptions(dual_clip=3.0, type="cispo"))


def test_delta_below_the_clip_range_marks_only_capped_or_clipped_tokens():
    """grpo_clip with δ = 1.1 < 1 + clip_high = 1.2, ratios inside the clip range:
    A = −1, r = e^0.14 ≈ 1.1503 > δ: −min(min(r, δ)·A, clip(r)·A) = −min(−1.1, −1.1503) = 1.1503, the
    clip branch with the clamp inactive: the gradient −A·r = 1.1503 flows, not clipped;
    A = +1, r = 1.1503 > δ: −min(1.1, 1.1503) = −1.1, the cap decides: no gradient, clipped."""
    lp = torch.tensor([0.14, 0.14], requires_grad=True)
    loss, meta = core.grpo_token_loss(
        lp, torch.tensor([-1.0, 1.0]), LossOptions(delta=1.1), old_logprobs=torch.zeros(2)
    )
    r = math.exp(0.14)
    torch.testing.assert_close(loss.detach(), torch.tensor([r, -1.1]))
    assert meta["clipped"].tolist() == [False, True]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([r, 0.0]))


def test_delta_caps_the_unclipped_ratio_hand_values():
    lp = torch.tensor([1.0, 0.5, 1.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    zeros = torch.zeros(3)
    # reinforce, δ = 2: r = e ≈ 2.7183 > 2 → ℓ = −2·1 = −2, no gradient; r = e^.5 ≈ 1.6487 < 2 →
    # ℓ = −1.6487, gradient −1.6487; r = e^1.5 ≈ 4.4817, A = −1 → ℓ = 2, no gradient
    loss, meta = core.grpo_token_loss(
        lp, adv, LossOptions(type="reinforce_with_baseline", delta=2.0), old_logprobs=zeros
    )
    torch.testing.assert_close(loss.detach(), torch.tensor([-2.0, -math.exp(0.5), 2.0]))
    assert meta["clipped"].tolist() == [True, False, True]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -math.exp(0.5), 0.0]))
    # grpo_clip, δ = 3: A = −1, r = 4.4817: −min(min(r, 3)·(−1), 1.2·(−1)) = −min(−3, −1.2) = 3, the dual clip's bound
    loss, meta = core.grpo_token_loss(lp.detach(), adv, LossOptions(delta=3.0), old_logprobs=zeros)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.2, 3.0]))
    assert meta["clipped"].tolist() == [True, True, True]
    # cispo, δ = 1.1 < 1 + clip_high: the weight's upper bound is 1.1: ℓ = −1.1·1·1 = −1.1, ...
    loss, _ = core.grpo_token_loss(lp.detach(), adv, LossOptions(type="cispo", delta=1.1), old_logprobs=zeros)
    torch.testing.assert_close(loss, torch.tensor([-1.1, -0.55, 1.65]))
    with pytest.raises(ValueError, match="delta must be > 1"):
        core.grpo_token_loss(lp, adv, LossOptions(delta=1.0))


def test_gspo_sequence_ratio_hand_values():
    """GSPO: every token of sequence i has ratio s_i = exp(mean_t(log π − log π_old)), clipped."""
    lp = torch.tensor([0.2, 0.4, -0.1, 0.1, 0.06], requires_grad=True)
    ids = torch.tensor([0, 0, 5, 5, 5])  # any labels
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    loss, meta = core.grpo_token_loss(
        lp,
        adv,
        LossOptions(importance_sampling_level="sequence"),
        old_logprobs=torch.zeros(5),
        sequence_ids=ids,
    )
    # seq 0: mean(.2, .4) = .3, s = e^.3 ≈ 1.3499 > 1.2, A = 1 → ℓ = −1.2 on both tokens, clipped, no gradient
    # seq 5: mean(−.1, .1, .06) = .02, s = e^.02 ≈ 1.0202 inside, A = −1 → ℓ = 1.0202 on each token;
    #        ∂(Σ_t ℓ_t)/∂log π_t = 3 tokens · (−A)·s/3 = 1.0202 (each token's loss depends on all three)
    s5 = math.exp(0.02)
    torch.testing.assert_close(loss.detach(), torch.tensor([-1.2, -1.2, s5, s5, s5]))
    assert meta["clipped"].tolist() == [True, True, False, False, False]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, 0.0, s5, s5, s5]))
    # the token level on the same inputs: ratios e^.2 … per token, a different loss
    token, _ = core.grpo_token_loss(lp.detach(), adv, LossOptions(), old_logprobs=torch.zeros(5))
    assert not torch.allclose(token, loss.detach())
    with pytest.raises(ValueError, match="sequence_ids is needed with importance_sampling_level='sequence'"):
        core.grpo_token_loss(lp, adv, LossOptions(importance_sampling_level="sequence"))
    with pytest.raises(ValueError, match="importance_sampling_level='group' is not one of"):
        core.grpo_token_loss(lp, adv, LossOptions(importance_sampling_level="group"), sequence_ids=ids)


def test_gspo_on_policy_is_sequence_mean_grpo():
    """On-policy s_i = 1 and ∂s_i/∂log π_t = 1/|i|: with sequence-mean weights w = 1/(|i|·B) the
    token gradient −A·(Σ_{t'∈i} w_t')/|i| = −A/(|i|·B) is token-level GRPO's −A·w_t."""
    lengths = [1, 3, 2]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    w = torch.cat([torch.full((n,), 1 / (n * 3)) for n in lengths]).double()
    adv = torch.tensor([0.5, -1.0, 2.0]).double()[ids]
    grads = []
    for options, seq in ((LossOptions(), None), (LossOptions(importance_sampling_level="sequence"), ids)):
        lp = torch.linspace(-2, -0.1, 6, dtype=torch.float64, requires_grad=True)
        loss, _ = core.grpo_token_loss(lp, adv, options, sequence_ids=seq)
        (w * loss).sum().backward()
        grads.append(lp.grad)
    torch.testing.assert_close(grads[0], grads[1], rtol=1e-12, atol=1e-15)
    torch.testing.assert_close(grads[0], -adv * w)


def test_top_entropy_quantile_hand_values():
    """80/20: the policy-gradient term only on the top-ρ-entropy tokens; KL and bonus on all."""
    lp = torch.zeros(5, requires_grad=True)
    entropy = torch.tensor([0.1, 2.0, 0.5, 1.0, 9.0])
    mask = torch.tensor([True, True, True, True, False])  # the last token does not count (weight 0)
    adv = torch.ones(5)
    # ρ = .5 over the 4 masked entropies, sorted [.1, .5, 1, 2]: the .5-quantile interpolates
    # halfway between .5 and 1 → .75; kept: H = 2 and H = 1 (and H = 9: above it, though unmasked)
    assert core.entropy_threshold(entropy, mask, 0.5).item() == pytest.approx(0.75)
    ref = torch.full((5,), math.log(2))  # k3 with d = ln 2: 2 − ln 2 − 1 ≈ .3069 on every token
    loss, meta = core.grpo_token_loss(
        lp,
        adv,
        LossOptions(beta=0.1, top_entropy_quantile=0.5),
        ref_logprobs=ref,
        entropy=entropy,
        token_mask=mask,
    )
    k3 = 2 - math.log(2) - 1
    # on-policy pg = −A = −1 on kept tokens, 0 on the others; + β·k3 on all
    torch.testing.assert_close(loss.detach(), torch.tensor([0.0, -1.0, 0.0, -1.0, -1.0]) + 0.1 * k3)
    assert meta["entropy_threshold"].item() == pytest.approx(0.75)
    loss.sum().backward()
    # ∂/∂log π: −A on kept tokens, and β·(1 − π_ref/π) = .1·(1 − 2) = −.1 on every token
    torch.testing.assert_close(lp.grad, torch.tensor([-0.1, -1.1, -0.1, -1.1, -1.1]))
    full, meta = core.grpo_token_loss(lp.detach(), adv, LossOptions(), entropy=entropy)  # ρ = 1: every token
    assert meta["entropy_threshold"] is None and torch.equal(full, -adv)
    assert core.entropy_threshold(entropy, mask, 1.0).item() == pytest.approx(0.1)  # the smallest
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \(0, 1\]"):
        core.grpo_token_loss(lp, adv, LossOptions(top_entropy_quantile=0.0), entropy=entropy)


def test_sequence_mean():
    x = torch.tensor([1.0, 3.0, 5.0, 7.0])
    torch.testing.assert_close(
        core.sequence_mean(x, torch.tensor([4, 4, 1, 4])), torch.tensor([11 / 3, 11 / 3, 5.0, 11 / 3])
    )


@settings(max_examples=60, deadline=None)
@given(
    log_ratio=st.floats(-2, 2, allow_nan=False),
    advantage=st.floats(-3, 3, allow_nan=False).filter(lambda a: abs(a) > 1e-3),
    delta=st.floats(1.3, 4.0),
)
def test_property_delta_equals_dual_clip_beyond_the_clip_range(log_ratio, advantage, delta):
    """For grpo_clip and δ > 1 + clip_high, ``delta = δ`` and ``dual_clip = δ`` are one loss,
    one gradient and one clipped mask."""
    outs = []
    for options in (LossOptions(delta=delta), LossOptions(dual_clip=delta)):
        lp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
        loss, meta = core.grpo_token_loss(
            lp,
            torch.tensor([advantage], dtype=torch.float64),
            options,
            old_logprobs=torch.zeros(1, dtype=torch.float64),
        )
        loss.sum().backward()
        outs.append((loss.item(), lp.grad.item(), meta["clipped"].item()))
    assert outs[0] == pytest.approx(outs[1], rel=1e-12, abs=1e-12)


@settings(max_examples=60, deadline=None)
@given(
    delta=st.floats(-2, 2, allow_nan=False),
    advantage=st.floats(-3, 3, allow_nan=False).filter(lambda a: abs(a) > 1e-3),
    clip_low=st.floats(0.05, 0.5),
    clip_high=st.floats(0.05, 0.5),
)
def test_property_no_gradient_through_clipped_branch(delta, advantage, clip_low, clip_high):
    lp = torch.tensor([[delta]], dtype=torch.float64, requires_grad=True)
    loss, meta = core.grpo_clip_loss(
        torch.tensor([[advantage]], dtype=torch.float64),
        lp,
        torch.zeros(1, 1, dtype=torch.float64),
        LossOptions(clip_low=clip_low, clip_high=clip_high),
    )
    loss.sum().backward()
    r = math.exp(delta)
    clipped = (advantage > 0 and r > 1 + clip_high) or (advantage < 0 and r < 1 - clip_low)
    assert bool(meta["clipped"].item()) == clipped
    if clipped:
        assert lp.grad.item() == 0.0
    else:  # d(−r·A)/dδ = −r·A
        assert lp.grad.item() == pytest.approx(-r * advantage, rel=1e-9)


def test_kl_estimators_hand_values():
    lp, ref = torch.tensor([0.0]), torch.tensor([math.log(2)])
    # d = ln 2 ≈ .693147: k1 = −d, k2 = d²/2 ≈ .240227, k3 = 2 − d − 1 ≈ .306853
    assert core.kl_penalty(lp, ref, "k1").item() == pytest.approx(-math.log(2))
    assert core.kl_penalty(lp, ref, "k2").item() == pytest.approx(math.log(2) ** 2 / 2)
    assert core.kl_penalty(lp, ref, "k3").item() == pytest.approx(1 - math.log(2))
    assert core.kl_penalty(ref, ref, "k3").item() == 0.0
    with pytest.raises(ValueError, match="unknown KL estimator 'k4'"):
        core.kl_penalty(lp, ref, "k4")


def test_kl_estimator_gradients_in_expectation():
    """As loss terms, by exact enumeration over a 5-token vocabulary: E_{y~π}[∇k(y)] is 0 for
    k1, ∇KL(π ‖ π_ref) for k2, ∇KL(π_ref ‖ π) for k3 (the samples' weights π(y) held fixed)."""
    theta = torch.tensor([0.3, -1.2, 2.0, 0.0, -0.4], dtype=torch.float64, requires_grad=True)
    ref = torch.log_softmax(torch.tensor([1.0, 0.5, -0.3, 0.2, -2.0], dtype=torch.float64), -1)

    def expected_grad(estimator: str) -> torch.Tensor:
        logp = torch.log_softmax(theta, -1)
        k = core.kl_penalty(logp, ref, estimator)  # the loss term at each possible sample y
        return torch.autograd.grad((logp.exp().detach() * k).sum(), theta)[0]

    def kl_grad(forward: bool) -> torch.Tensor:
        logp = torch.log_softmax(theta, -1)
        kl = (logp.exp() * (logp - ref)).sum() if forward else (ref.exp() * (ref - logp)).sum()
        return torch.autograd.grad(kl, theta)[0]

    torch.testing.assert_close(expected_grad("k1"), torch.zeros(5, dtype=torch.float64))
    torch.testing.assert_close(expected_grad("k2"), kl_grad(forward=True))
    torch.testing.assert_close(expected_grad("k3"), kl_grad(forward=False))
    assert (kl_grad(forward=True) - kl_grad(forward=False)).abs().max() > 0.1  # the two differ


def test_grpo_token_loss_on_policy_gradient_and_bonus_terms():
    lp = torch.tensor([-1.0, -2.0], requires_grad=True)
    adv = torch.tensor([2.0, -1.0])
    ref = torch.tensor([-1.0, -1.0])
    ent = torch.tensor([1.5, 0.5], requires_grad=True)
    loss, meta = core.grpo_token_loss(
        lp, adv, LossOptions(beta=0.1, entropy_coef=0.01), ref_logprobs=ref, entropy=ent
    )
    # on-policy r = 1: pg = −A ; k3 at token 2: d = −1 − (−2) = 1 → e − 2 ≈ .718282
    k3 = math.e - 2
    expected = torch.tensor([-2.0 - 0.01 * 1.5, 1.0 + 0.1 * k3 - 0.01 * 0.5])
    torch.testing.assert_close(loss.detach(), expected)
    loss.sum().backward()
    # ∂/∂lp: −A·r + β·(1 − e^d) → token 1: −2 + 0 ; token 2: 1 + 0.1·(1 − e)
    torch.testing.assert_close(lp.grad, torch.tensor([-2.0, 1.0 + 0.1 * (1 - math.e)]))
    torch.testing.assert_close(ent.grad, torch.tensor([-0.01, -0.01]))
    assert meta["kl"] is not None and not meta["clipped"].any()


# ---------------------------------------------------------------------------- length normalization


def test_length_norm_weights_hand_values():
    m = torch.tensor([[1, 0, 0, 0], [1, 1, 1, 0]], dtype=torch.bool)
    # sequence_mean: 1/(1·2) = .5 for the single token, 1/(3·2) for each of the three
    w = core.length_norm_weights(m, "sequence_mean")
    torch.testing.assert_close(w, torch.tensor([[0.5, 0, 0, 0], [1 / 6, 1 / 6, 1 / 6, 0]]))
    # token_mean: 4 tokens → 1/4 each
    w = core.length_norm_weights(m, "token_mean")
    torch.testing.assert_close(w, torch.tensor([[0.25, 0, 0, 0], [0.25, 0.25, 0.25, 0]]))
    # constant, max_length 8: 1/(8·2) = 1/16 each
    w = core.length_norm_weights(m, "constant", max_length=8)
    torch.testing.assert_close(w, m.float() / 16)
    with pytest.raises(ValueError, match="needs max_length"):
        core.length_norm_weights(m, "constant")


def test_sequence_mean_weights_equal_the_course_aggregation():
    torch.manual_seed(0)
    per_token = torch.randn(5, 7, dtype=torch.float64)
    mask = torch.rand(5, 7) > 0.3
    mask[:, 0] = True
    w = core.length_norm_weights(mask, "sequence_mean").double()
    torch.testing.assert_close((w * per_token).sum(), course.masked_mean(per_token, mask, dim=-1).mean())


@settings(max_examples=40, deadline=None)
@given(
    lengths=st.lists(st.integers(0, 9), min_size=2, max_size=12),
    cut_points=st.sets(st.integers(1, 11), max_size=4),
    norm=st.sampled_from(["sequence_mean", "constant", "token_mean"]),
)
def test_property_weights_invariant_to_microbatch_split(lengths, cut_points, norm):
    b = len(lengths)
    mask = torch.arange(9)[None, :] < torch.tensor(lengths)[:, None]
    per_token = torch.randn(b, 9, dtype=torch.float64, generator=torch.Generator().manual_seed(b))
    w_full = core.length_norm_weights(mask, norm, max_length=9).double()
    full = (w_full * per_token).sum()
    # the same weights sliced into microbatches, or computed per microbatch with the global counts
    bounds = [0, *sorted(c for c in cut_points if c < b), b]
    total_tokens = mask.sum().item()
    split_sum = sum(
        (
            core.length_norm_weights(
                mask[s:e], norm, max_length=9, num_sequences=b, num_tokens=total_tokens
            ).double()
            * per_token[s:e]
        ).sum()
        for s, e in itertools.pairwise(bounds)
        if e > s
    )
    torch.testing.assert_close(split_sum, full, atol=1e-12, rtol=1e-12)


# ---------------------------------------------------------------------------- KL control


def test_adaptive_kl_controller_hand_values():
    ctl = core.AdaptiveKLController(beta=0.1, target_kl=0.05, horizon=10_000)
    # KL 0.1 → error clip(1, ±.2) = .2 → β·(1 + .2·64/10⁴) = .100128
    assert ctl.update(0.1, 64) == pytest.approx(0.100128)
    # KL 0.04 → error −.2 → β·(1 − .2·64/10⁴)
    assert ctl.update(0.04, 64) == pytest.approx(0.100128 * (1 - 0.00128))
    before = ctl.beta
    assert ctl.update(float("nan"), 64) == before
    clone = core.AdaptiveKLController(beta=1.0, target_kl=1.0)
    clone.load_state_dict(ctl.state_dict())
    assert clone.beta == ctl.beta and clone.target_kl == 0.05


def test_kl_early_stop():
    assert core.kl_early_stop(0.31, 0.3)
    assert not core.kl_early_stop(0.29, 0.3)
    assert not core.kl_early_stop(5.0, None)
    assert core.kl_early_stop(float("nan"), 0.3)


# ---------------------------------------------------------------------------- eager [N, V] reference


def test_eager_grpo_loss_from_logits_matches_composition():
    torch.manual_seed(0)
    logits = torch.randn(6, 11, dtype=torch.float64)
    labels = torch.randint(0, 11, (6,))
    adv, w = torch.randn(6, dtype=torch.float64), torch.rand(6, dtype=torch.float64)
    old = torch.randn(6, dtype=torch.float64) - 2
    out = core.eager_grpo_loss_from_logits(
        logits, labels, adv, w, old_logprobs=old, temperature=0.7, clip_low=0.1, clip_high=0.3
    )
    lp = torch.log_softmax(logits / 0.7, -1)[torch.arange(6), labels]
    ratio = torch.exp(lp - old)
    pg = -torch.minimum(ratio * adv, ratio.clamp(0.9, 1.3) * adv)
    torch.testing.assert_close(out.loss, (w * pg).sum())
    torch.testing.assert_close(out.logprobs, lp)
    assert out.kl is None and out.clipped.dtype == torch.bool
