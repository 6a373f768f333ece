"""The algorithm core: hand-worked values (arithmetic in comments) and properties (hypothesis)."""

import itertools
import math

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from tokenizers import Tokenizer
from tokenizers.models import WordLevel
from tokenizers.pre_tokenizers import Whitespace
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM

import grpo_fast
from grpo_fast import core


@pytest.fixture
def word_tokenizer():
    vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "Hello": 3, "world": 4, "is": 5, "a": 6, "test": 7}
    tok = Tokenizer(WordLevel(vocab=vocab, unk_token="<unk>"))
    tok.pre_tokenizer = Whitespace()
    return PreTrainedTokenizerFast(
        tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>", unk_token="<unk>"
    )


def test_public_api_is_exported():
    for name in (
        "tokenize_prompt_and_output",
        "compute_entropy",
        "get_response_log_probs",
        "compute_group_normalized_rewards",
        "compute_naive_policy_gradient_loss",
        "compute_grpo_clip_loss",
        "compute_policy_gradient_loss",
        "masked_mean",
        "masked_normalize",
        "sft_microbatch_train_step",
        "grpo_microbatch_train_step",
    ):
        assert callable(getattr(grpo_fast, name)), name


# ---------------------------------------------------------------------------- tokenization


def test_tokenize_prompt_and_output_shift_pad_and_mask(word_tokenizer):
    out = core.tokenize_prompt_and_output(["Hello world", "is"], ["is a test", "a"], word_tokenizer)
    assert set(out) == {"input_ids", "labels", "response_mask"}
    # seq 0: Hello world | is a test -> [3, 4, 5, 6, 7]  (length 5, the longest)
    # seq 1: is | a                  -> [5, 6, pad, pad, pad]
    assert out["input_ids"].tolist() == [[3, 4, 5, 6], [5, 6, 0, 0]]
    assert out["labels"].tolist() == [[4, 5, 6, 7], [6, 0, 0, 0]]
    # labels 5, 6, 7 of seq 0 are output tokens; label 6 of seq 1 is its only output token
    assert out["response_mask"].tolist() == [[False, True, True, True], [True, False, False, False]]
    assert out["response_mask"].dtype == torch.bool


def test_tokenize_rejects_mismatched_lists(word_tokenizer):
    with pytest.raises(ValueError, match="prompt_strs has 2 items but output_strs has 1"):
        core.tokenize_prompt_and_output(["a", "b"], ["c"], word_tokenizer)


# ---------------------------------------------------------------------------- entropy, log-probs


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


def test_get_response_log_probs_matches_manual_log_softmax():
    torch.manual_seed(0)
    cfg = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
    )
    model = Qwen2ForCausalLM(cfg).eval()
    input_ids = torch.randint(0, 32, (2, 7))
    labels = torch.randint(0, 32, (2, 7))
    out = core.get_response_log_probs(model, input_ids, labels, return_token_entropy=True)
    assert set(out) == {"log_probs", "token_entropy"}
    logits = model(input_ids).logits.double()
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out["log_probs"].double(), ref, atol=1e-5, rtol=0)
    assert out["token_entropy"].shape == (2, 7)
    assert set(core.get_response_log_probs(model, input_ids, labels)) == {"log_probs"}


# ---------------------------------------------------------------------------- masked reductions


def test_masked_mean_and_normalize_hand_values():
    t = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, False, True], [False, False, False]])
    # all: (1 + 3) / 2 = 2
    assert core.masked_mean(t, m).item() == 2.0
    # per row: row 0 -> 2, row 1 -> 0/0 = NaN (a mean of nothing)
    rows = core.masked_mean(t, m, dim=1)
    assert rows[0].item() == 2.0 and math.isnan(rows[1].item())
    # per column: [1/1, 0/0, 3/1]
    cols = core.masked_mean(t, m, dim=0)
    assert cols[0].item() == 1.0 and math.isnan(cols[1].item()) and cols[2].item() == 3.0
    # normalize: (1 + 3) / 2.5 = 1.6 ; per row [4/2.5, 0]
    assert core.masked_normalize(t, m, normalize_constant=2.5).item() == pytest.approx(1.6)
    torch.testing.assert_close(
        core.masked_normalize(t, m, dim=-1, normalize_constant=2.5), torch.tensor([1.6, 0.0])
    )


# ---------------------------------------------------------------------------- rewards, advantages


def _reward_table(values):
    table = dict(values)
    return lambda response, gt: {
        "reward": table[response],
        "format_reward": 1.0,
        "answer_reward": table[response],
    }


def test_group_normalized_rewards_hand_values():
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0, "g": 0.0, "h": 0.0})
    responses = list("abcdefgh")
    # group 1 [1,0,0,0]: mean .25, unbiased std = sqrt((.5625 + 3·.0625)/3) = .5
    # group 2 [1,1,0,0]: mean .5,  unbiased std = sqrt(4·.25/3) ≈ .57735
    adv, raw, meta = core.compute_group_normalized_rewards(fn, responses, ["x"] * 8, 4, 0.0, False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))
    torch.testing.assert_close(raw, torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]))
    adv, _, _ = core.compute_group_normalized_rewards(fn, responses, ["x"] * 8, 4, 1e-6, True)
    s = 1 / math.sqrt(3)
    expected = [0.75 / 0.5, -0.5, -0.5, -0.5, 0.5 / s, 0.5 / s, -0.5 / s, -0.5 / s]
    torch.testing.assert_close(adv, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    assert meta["reward_mean"] == 0.375 and meta["format_reward_mean"] == 1.0
    assert meta["zero_variance_groups"] == 0.0


def test_scale_rewards_group_batch_none_hand_values():
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0, "g": 0.0, "h": 0.0})
    args = (fn, list("abcdefgh"), ["x"] * 8, 4, 0.0)
    centred = torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5])
    # none (Dr. GRPO): the centred rewards themselves
    adv, _, _ = core.compute_group_normalized_rewards(*args, scale_rewards="none")
    torch.testing.assert_close(adv, centred)
    # group: as normalize_by_std=True (stds .5 and 1/√3, see above)
    adv, _, _ = core.compute_group_normalized_rewards(*args, scale_rewards="group")
    legacy, _, _ = core.compute_group_normalized_rewards(*args, True)
    assert torch.equal(adv, legacy)
    # batch: one std over all 8 rewards [1,0,0,0,1,1,0,0]: mean 3/8, Σr² = 3,
    # var = (3 − 8·(3/8)²)/7 = (3 − 1.125)/7 = 0.267857…, std ≈ 0.517549 → 0.75 / 0.517549 ≈ 1.449138
    adv, _, _ = core.compute_group_normalized_rewards(*args, scale_rewards="batch")
    torch.testing.assert_close(adv, centred / 0.517549, atol=1e-6, rtol=1e-6)
    assert adv[0].item() == pytest.approx(1.449138, abs=1e-6)
    with pytest.raises(ValueError, match="unknown scale_rewards 'std'"):
        core.compute_group_normalized_rewards(*args, scale_rewards="std")


def test_scale_rewards_batch_std_spans_the_ranks():
    """Rank 0 holds group 1 and rank 1 group 2: with ``reduce_sums`` summing both ranks'
    ``[count, Σr, Σr²]``, each rank divides by the std of all 8 rewards, as one process would."""
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0, "g": 0.0, "h": 0.0})
    whole, _, _ = core.compute_group_normalized_rewards(
        fn, list("abcdefgh"), ["x"] * 8, 4, 1e-6, scale_rewards="batch"
    )
    rank_sums = [[4.0, 1.0, 1.0], [4.0, 2.0, 2.0]]  # [count, Σr, Σr²] of each rank's group
    both = lambda sums: [a + b for a, b in zip(*rank_sums)]
    for rank, letters in enumerate(("abcd", "efgh")):
        local, _, _ = core.compute_group_normalized_rewards(
            fn, list(letters), ["x"] * 4, 4, 1e-6, scale_rewards="batch", reduce_sums=both
        )
        torch.testing.assert_close(local, whole[4 * rank : 4 * rank + 4])
    alone, _, _ = core.compute_group_normalized_rewards(
        fn, list("abcd"), ["x"] * 4, 4, 1e-6, scale_rewards="batch"
    )
    assert not torch.allclose(alone, whole[:4])  # without the reduction: rank 0's std alone (.5)


def test_zero_variance_group_gets_zero_advantage_never_nan():
    fn = lambda r, g: {"reward": 0.7}
    for eps in (0.0, 1e-6):
        adv, _, meta = core.compute_group_normalized_rewards(fn, ["x"] * 6, ["y"] * 6, 3, eps, True)
        assert (adv == 0).all()
        assert meta["zero_variance_groups"] == 2.0 and meta["zero_variance_fraction"] == 1.0


def test_group_normalized_rewards_bad_sizes():
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide the 4 responses"):
        core.compute_group_normalized_rewards(lambda r, g: {"reward": 0}, ["a"] * 4, ["b"] * 4, 3, 1e-6, True)
    with pytest.raises(
        ValueError, match=r"group sizes \[2, 3\] must each be >= 1 and sum to the 4 responses"
    ):
        core.compute_group_normalized_rewards(lambda r, g: {"reward": 0}, ["a"] * 4, ["b"] * 4, [2, 3], 1e-6)
    with pytest.raises(ValueError, match="reward_shaping has 3 items for 4 responses"):
        core.compute_group_normalized_rewards(
            lambda r, g: {"reward": 0}, ["a"] * 4, ["b"] * 4, 2, 1e-6, reward_shaping=[0.0] * 3
        )


def test_variable_group_sizes_hand_values():
    # groups [1, 0] | [1, 1, 0, 0] | [1] (sizes 2, 4, 1)
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 0.0, "f": 0.0, "g": 1.0})
    args = (fn, list("abcdefg"), ["x"] * 7, [2, 4, 1], 0.0)
    # none: [0.5, −0.5 | 0.5, 0.5, −0.5, −0.5 | 0 (a group of one: zero variance)]
    adv, _, meta = core.compute_group_normalized_rewards(*args, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.0]))
    assert meta["num_groups"] == 3.0 and meta["zero_variance_groups"] == 1.0
    assert meta["zero_variance_fraction"] == pytest.approx(1 / 3)
    # group: stds √0.5 ≈ 0.70711 and √(1/3) ≈ 0.57735
    adv, _, _ = core.compute_group_normalized_rewards(*args, scale_rewards="group")
    a, b = 0.5 / math.sqrt(0.5), 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, b, b, -b, -b, 0.0]))
    # batch: rewards [1,0,1,1,0,0,1]: mean 4/7, var = (4 − 7·(4/7)²)/6 = (4 − 16/7)/6 = 2/7
    adv, _, _ = core.compute_group_normalized_rewards(*args, scale_rewards="batch")
    s = math.sqrt(2 / 7)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.0]) / s)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_group_sizes_as_a_list_match_the_int_form_bit_for_bit(scale):
    rewards = [0.3, 1.0, 0.0, 0.7, 0.2, 0.2, 0.9, 0.1]
    fn = lambda r, g: {"reward": rewards[int(r)]}
    args = (fn, [str(i) for i in range(8)], ["x"] * 8)
    as_int = core.compute_group_normalized_rewards(*args, 4, 1e-6, scale_rewards=scale)
    as_list = core.compute_group_normalized_rewards(*args, [4, 4], 1e-6, scale_rewards=scale)
    assert torch.equal(as_int[0], as_list[0]) and torch.equal(as_int[1], as_list[1])
    assert as_int[2] == as_list[2]


def test_reward_shaping_is_added_before_the_advantage():
    fn = _reward_table({"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0})
    # shaping [0, −0.5, 0, −1]: rewards [1, 0.5, 0, −1]; group [1, 0.5] → mean 0.75: [0.25, −0.25];
    # group [0, −1] → mean −0.5: [0.5, −0.5]. Without shaping group 1 ([1, 1]) would teach nothing.
    adv, raw, meta = core.compute_group_normalized_rewards(
        fn, list("abcd"), ["x"] * 4, 2, 0.0, scale_rewards="none", reward_shaping=[0.0, -0.5, 0.0, -1.0]
    )
    torch.testing.assert_close(raw, torch.tensor([1.0, 0.5, 0.0, -1.0]))
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.25, 0.5, -0.5]))
    assert meta["reward_shaping_mean"] == -0.375 and meta["reward_mean"] == 0.125
    assert meta["answer_reward_mean"] == 0.5  # the reward function's own keys are unshaped


def test_normalize_group_rewards_matches_the_scoring_form():
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0})
    adv, raw, meta = core.compute_group_normalized_rewards(fn, list("abcdef"), ["x"] * 6, [4, 2], 1e-6)
    adv2, meta2 = core.normalize_group_rewards(raw, [4, 2], 1e-6)
    assert torch.equal(adv, adv2)
    assert meta2 == {k: v for k, v in meta.items() if not k.endswith("_reward_mean")}


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


@settings(max_examples=50, deadline=None)
@given(
    rewards=st.lists(st.floats(-5, 5, allow_nan=False), min_size=2, max_size=24),
    group_size=st.integers(1, 6),
    by_std=st.booleans(),
)
def test_property_group_advantages_sum_to_zero(rewards, group_size, by_std):
    n = len(rewards) - len(rewards) % group_size
    if n == 0:
        return
    responses = [str(i) for i in range(n)]
    adv, _, _ = core.compute_group_normalized_rewards(
        lambda r, g: {"reward": rewards[int(r)]}, responses, ["gt"] * n, group_size, 1e-6, by_std
    )
    assert torch.isfinite(adv).all()
    sums = adv.view(-1, group_size).sum(dim=1)
    scale = 1.0 + adv.abs().max().item()
    assert sums.abs().max().item() <= 1e-5 * scale * group_size


# ---------------------------------------------------------------------------- policy-gradient losses


def test_naive_policy_gradient_loss():
    # −A·logp: −2·(−0.5) = 1 ; −2·(−1) = 2 ; −(−1)·(−0.5) = −0.5
    loss = core.compute_naive_policy_gradient_loss(
        torch.tensor([[2.0], [-1.0]]), torch.tensor([[-0.5, -1.0], [-0.5, 0.0]])
    )
    torch.testing.assert_close(loss, torch.tensor([[1.0, 2.0], [-0.5, 0.0]]))


def test_grpo_clip_loss_hand_values():
    adv = torch.tensor([[1.0], [-1.0]])
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, 0.0, -0.5], [0.5, 0.0, -0.5]])
    loss, meta = core.compute_grpo_clip_loss(adv, new, old, 0.2)
    e = math.exp
    # A=+1: r=e^.5≈1.6487 > 1.2 → clipped, −1.2 ; r=1 → −1 ; r=e^-.5≈.6065 → min(.6065, .8) = .6065 → −.6065
    # A=−1: r=1.6487 → min(−1.6487, −1.2) = −1.6487 → 1.6487 (not clipped) ; r=1 → 1 ;
    #       r=.6065 < .8 → min(−.6065, −.8) = −.8 → clipped, .8
    expected = torch.tensor([[-1.2, -1.0, -e(-0.5)], [e(0.5), 1.0, 0.8]])
    torch.testing.assert_close(loss, expected)
    assert meta["clipped"].tolist() == [[True, False, False], [False, False, True]]


def test_asymmetric_and_dual_clip_hand_values():
    adv = torch.tensor([[1.0], [-1.0]])
    lp = torch.tensor([[0.25], [1.5]])
    # clip-higher: A=+1, r=e^.25≈1.2840 < 1+0.3 → not clipped; symmetric 0.2 would clip at 1.2
    loss, meta = core.grpo_clip_loss(adv[:1], lp[:1], torch.zeros(1, 1), 0.2, 0.3)
    assert loss.item() == pytest.approx(-math.exp(0.25)) and not meta["clipped"].item()
    # dual clip c=3: A=−1, r=e^1.5≈4.4817: ordinary loss = −min(−4.48, −1.2) = 4.48 > c·|A| = 3 → 3
    loss, meta = core.grpo_clip_loss(adv[1:], lp[1:], torch.zeros(1, 1), 0.2, 0.2, dual_clip=3.0)
    assert loss.item() == pytest.approx(3.0) and meta["clipped"].item()


@pytest.mark.parametrize("loss_type", ["reinforce_with_baseline", "no_baseline"])
def test_grpo_token_loss_unclipped_types_hand_values(loss_type):
    lp = torch.tensor([0.5, -0.5, 0.0], requires_grad=True)
    old = torch.zeros(3)
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, meta = core.grpo_token_loss(lp, adv, old_log_probs=old, loss_type=loss_type)
    # ℓ = −r·A, never clipped: r = e^.5 ≈ 1.6487, A = 1 → −1.6487 (grpo_clip: −1.2, clipped);
    # r = e^−.5 ≈ .6065, A = −1 → .6065 (grpo_clip: .8, clipped); r = 1, A = 2 → −2
    e = math.exp
    torch.testing.assert_close(loss.detach(), torch.tensor([-e(0.5), e(-0.5), -2.0]))
    assert not meta["clipped"].any()
    loss.sum().backward()  # ∂(−r·A)/∂lp = −r·A: the gradient is never cut off
    torch.testing.assert_close(lp.grad, torch.tensor([-e(0.5), e(-0.5), -2.0]))
    clip, clip_meta = core.grpo_token_loss(lp.detach(), adv, old_log_probs=old)
    torch.testing.assert_close(clip, torch.tensor([-1.2, 0.8, -2.0]))
    assert clip_meta["clipped"].tolist() == [True, True, False]
    with pytest.raises(ValueError, match="dual_clip applies only to loss_type='grpo_clip'"):
        core.grpo_token_loss(lp, adv, dual_clip=3.0, loss_type=loss_type)
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        core.grpo_token_loss(lp, adv, loss_type="ppo")


def test_cispo_hand_values():
    """CISPO: ℓ = −sg(clip(r, 0.8, 1.2))·A·log π, the weight detached: clipped tokens keep a gradient."""
    lp = torch.tensor([-1.0, -2.0, -0.5], requires_grad=True)
    old = torch.tensor([-1.5, -1.5, -0.4])
    adv = torch.tensor([1.0, -1.0, 2.0])
    loss, meta = core.grpo_token_loss(lp, adv, old_log_probs=old, loss_type="cispo")
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
    loss, _ = core.grpo_token_loss(lp, adv, loss_type="cispo")
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, -adv)
    with pytest.raises(ValueError, match="dual_clip applies only to loss_type='grpo_clip', not 'cispo'"):
        core.grpo_token_loss(lp, adv, dual_clip=3.0, loss_type="cispo")


def test_delta_caps_the_unclipped_ratio_hand_values():
    lp = torch.tensor([1.0, 0.5, 1.5], requires_grad=True)
    adv = torch.tensor([1.0, 1.0, -1.0])
    zeros = torch.zeros(3)
    # reinforce, δ = 2: r = e ≈ 2.7183 > 2 → ℓ = −2·1 = −2, no gradient; r = e^.5 ≈ 1.6487 < 2 →
    # ℓ = −1.6487, gradient −1.6487; r = e^1.5 ≈ 4.4817, A = −1 → ℓ = 2, no gradient
    loss, meta = core.grpo_token_loss(
        lp, adv, old_log_probs=zeros, loss_type="reinforce_with_baseline", delta=2.0
    )
    torch.testing.assert_close(loss.detach(), torch.tensor([-2.0, -math.exp(0.5), 2.0]))
    assert meta["clipped"].tolist() == [True, False, True]
    loss.sum().backward()
    torch.testing.assert_close(lp.grad, torch.tensor([0.0, -math.exp(0.5), 0.0]))
    # grpo_clip, δ = 3: A = −1, r = 4.4817: −min(min(r, 3)·(−1), 1.2·(−1)) = −min(−3, −1.2) = 3, the dual clip's bound
    loss, meta = core.grpo_token_loss(lp.detach(), adv, old_log_probs=zeros, delta=3.0)
    torch.testing.assert_close(loss, torch.tensor([-1.2, -1.2, 3.0]))
    assert meta["clipped"].tolist() == [True, True, True]
    # cispo, δ = 1.1 < 1 + clip_high: the weight's upper bound is 1.1: ℓ = −1.1·1·1 = −1.1, ...
    loss, _ = core.grpo_token_loss(lp.detach(), adv, old_log_probs=zeros, loss_type="cispo", delta=1.1)
    torch.testing.assert_close(loss, torch.tensor([-1.1, -0.55, 1.65]))
    with pytest.raises(ValueError, match="delta must be > 1"):
        core.grpo_token_loss(lp, adv, delta=1.0)


def test_gspo_sequence_ratio_hand_values():
    """GSPO: every token of sequence i has ratio s_i = exp(mean_t(log π − log π_old)), clipped."""
    lp = torch.tensor([0.2, 0.4, -0.1, 0.1, 0.06], requires_grad=True)
    ids = torch.tensor([0, 0, 5, 5, 5])  # any labels
    adv = torch.tensor([1.0, 1.0, -1.0, -1.0, -1.0])
    loss, meta = core.grpo_token_loss(
        lp, adv, old_log_probs=torch.zeros(5), importance_sampling_level="sequence", sequence_ids=ids
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
    token, _ = core.grpo_token_loss(lp.detach(), adv, old_log_probs=torch.zeros(5))
    assert not torch.allclose(token, loss.detach())
    with pytest.raises(ValueError, match="sequence_ids is needed with importance_sampling_level='sequence'"):
        core.grpo_token_loss(lp, adv, importance_sampling_level="sequence")
    with pytest.raises(ValueError, match="unknown importance_sampling_level 'group'"):
        core.grpo_token_loss(lp, adv, importance_sampling_level="group", sequence_ids=ids)


def test_gspo_on_policy_is_sequence_mean_grpo():
    """On-policy s_i = 1 and ∂s_i/∂log π_t = 1/|i|: with sequence-mean weights w = 1/(|i|·B) the
    token gradient −A·(Σ_{t'∈i} w_t')/|i| = −A/(|i|·B) is token-level GRPO's −A·w_t."""
    lengths = [1, 3, 2]
    ids = torch.repeat_interleave(torch.arange(3), torch.tensor(lengths))
    w = torch.cat([torch.full((n,), 1 / (n * 3)) for n in lengths]).double()
    adv = torch.tensor([0.5, -1.0, 2.0]).double()[ids]
    grads = []
    for kw in (dict(), dict(importance_sampling_level="sequence", sequence_ids=ids)):
        lp = torch.linspace(-2, -0.1, 6, dtype=torch.float64, requires_grad=True)
        loss, _ = core.grpo_token_loss(lp, adv, **kw)
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
        lp, adv, ref_log_probs=ref, beta=0.1, entropy=entropy, top_entropy_quantile=0.5, token_mask=mask
    )
    k3 = 2 - math.log(2) - 1
    # on-policy pg = −A = −1 on kept tokens, 0 on the others; + β·k3 on all
    torch.testing.assert_close(loss.detach(), torch.tensor([0.0, -1.0, 0.0, -1.0, -1.0]) + 0.1 * k3)
    assert meta["entropy_threshold"].item() == pytest.approx(0.75)
    loss.sum().backward()
    # ∂/∂log π: −A on kept tokens, and β·(1 − π_ref/π) = .1·(1 − 2) = −.1 on every token
    torch.testing.assert_close(lp.grad, torch.tensor([-0.1, -1.1, -0.1, -1.1, -1.1]))
    full, meta = core.grpo_token_loss(lp.detach(), adv, entropy=entropy)  # ρ = 1: every token
    assert meta["entropy_threshold"] is None and torch.equal(full, -adv)
    assert core.entropy_threshold(entropy, mask, 1.0).item() == pytest.approx(0.1)  # the smallest
    with pytest.raises(ValueError, match=r"top_entropy_quantile must be in \(0, 1\]"):
        core.grpo_token_loss(lp, adv, entropy=entropy, top_entropy_quantile=0.0)


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
    for kw in (dict(delta=delta), dict(dual_clip=delta)):
        lp = torch.tensor([log_ratio], dtype=torch.float64, requires_grad=True)
        loss, meta = core.grpo_token_loss(
            lp,
            torch.tensor([advantage], dtype=torch.float64),
            old_log_probs=torch.zeros(1, dtype=torch.float64),
            **kw,
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
        clip_low,
        clip_high,
    )
    loss.sum().backward()
    r = math.exp(delta)
    clipped = (advantage > 0 and r > 1 + clip_high) or (advantage < 0 and r < 1 - clip_low)
    assert bool(meta["clipped"].item()) == clipped
    if clipped:
        assert lp.grad.item() == 0.0
    else:  # d(−r·A)/dδ = −r·A
        assert lp.grad.item() == pytest.approx(-r * advantage, rel=1e-9)


def test_policy_gradient_loss_dispatch():
    lp = torch.tensor([[-1.0, -2.0]])
    rewards, adv = torch.tensor([[3.0]]), torch.tensor([[0.5]])
    loss, _ = core.compute_policy_gradient_loss(lp, "no_baseline", raw_rewards=rewards)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 6.0]]))
    loss, _ = core.compute_policy_gradient_loss(lp, "reinforce_with_baseline", advantages=adv)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 1.0]]))
    loss, meta = core.compute_policy_gradient_loss(
        lp, "grpo_clip", advantages=adv, old_log_probs=lp, cliprange=0.2
    )
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -0.5]]))  # r = 1 → −A
    assert "clipped" in meta
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        core.compute_policy_gradient_loss(lp, "ppo", advantages=adv)
    with pytest.raises(ValueError, match="needs old_log_probs, cliprange"):
        core.compute_policy_gradient_loss(lp, "grpo_clip", advantages=adv)


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
    loss, meta = core.grpo_token_loss(lp, adv, ref_log_probs=ref, entropy=ent, beta=0.1, entropy_coef=0.01)
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
    torch.testing.assert_close((w * per_token).sum(), core.masked_mean(per_token, mask, dim=-1).mean())


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


# ---------------------------------------------------------------------------- microbatch train steps


def test_sft_microbatch_train_step_hand_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    # per sequence: 3 and 11, /c=2 → 1.5, 5.5; batch mean 3.5; / 2 accumulation steps = 1.75
    loss, _ = core.sft_microbatch_train_step(lp, mask, gradient_accumulation_steps=2, normalize_constant=2.0)
    assert loss.item() == pytest.approx(1.75)
    # ∂/∂lp = −m / (c · B · steps) = −1/8 on response tokens
    torch.testing.assert_close(lp.grad, -mask.float() / 8)


def test_grpo_microbatch_train_step_hand_values_and_accumulation():
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([[1.0], [-2.0]])
    # reinforce_with_baseline: ℓ = −A·lp → row 0: −1·−1 = 1 (mean 1), row 1: 2·−2 = −4 (mean −4)
    # batch mean −1.5, / 3 steps = −0.5
    loss, _ = core.grpo_microbatch_train_step(lp, mask, 3, "reinforce_with_baseline", advantages=adv)
    assert loss.item() == pytest.approx(-0.5)
    # ∂/∂lp = −A·m / (len · B · steps): row 0 −1/(2·2·3) = −1/12, row 1 2/(1·2·3) = 1/3
    g = torch.tensor([[-1 / 12, -1 / 12, 0.0], [1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, g)
    # a second call accumulates into .grad
    core.grpo_microbatch_train_step(lp, mask, 3, "reinforce_with_baseline", advantages=adv)
    torch.testing.assert_close(lp.grad, 2 * g)


@settings(max_examples=25, deadline=None)
@given(b=st.integers(2, 8), t=st.integers(1, 6), steps=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_property_gradients_accumulate_across_microbatches(b, t, steps, seed):
    """k microbatch calls of a split batch give the gradient of one call on the whole batch."""
    g = torch.Generator().manual_seed(seed)
    lp_full = torch.randn(b, t, dtype=torch.float64, generator=g)
    old = lp_full + 0.3 * torch.randn(b, t, dtype=torch.float64, generator=g)
    adv = torch.randn(b, 1, dtype=torch.float64, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    whole = lp_full.clone().requires_grad_(True)
    core.grpo_microbatch_train_step(
        whole, mask, 1, "grpo_clip", advantages=adv, old_log_probs=old, cliprange=0.2
    )
    parts = lp_full.clone().requires_grad_(True)
    chunks = torch.arange(b).chunk(steps)
    for idx in chunks:  # equal-size chunks only make the per-microbatch mean a batch mean
        if len(idx) != len(chunks[0]):
            return
    for idx in chunks:
        sub = parts[idx]
        core.grpo_microbatch_train_step(
            sub,
            mask[idx],
            len(chunks),
            "grpo_clip",
            advantages=adv[idx],
            old_log_probs=old[idx],
            cliprange=0.2,
        )
    torch.testing.assert_close(parts.grad, whole.grad, atol=1e-12, rtol=1e-10)


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
