"""The CS336 course API (grpo_fast.algo.course): hand-worked values (arithmetic in comments) and properties
(hypothesis)."""

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
from grpo_fast.algo import core, course


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


def test_each_course_name_has_one_home():
    """``grpo_fast`` re-exports ``grpo_fast.algo.course``; only ``compute_entropy`` (which the eager
    reference of the fused ops uses) and ``compute_gae`` (the loop's estimator) are defined in the
    algorithm core (``grpo_fast.algo.token_loss``, ``grpo_fast.algo.advantages``, re-exported by
    ``grpo_fast.algo.core``), the rest only in the course module."""
    core_homes = {"compute_entropy": "grpo_fast.algo.token_loss", "compute_gae": "grpo_fast.algo.advantages"}
    for name in course.__all__:
        assert getattr(grpo_fast, name) is getattr(course, name), name
        assert getattr(course, name).__module__ == core_homes.get(name, "grpo_fast.algo.course"), name
        assert hasattr(core, name) == (name in core_homes), name


# ---------------------------------------------------------------------------- tokenization


def test_tokenize_prompt_and_output_shift_pad_and_mask(word_tokenizer):
    out = course.tokenize_prompt_and_output(["Hello world", "is"], ["is a test", "a"], word_tokenizer)
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
        course.tokenize_prompt_and_output(["a", "b"], ["c"], word_tokenizer)


# ---------------------------------------------------------------------------- log-probs


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
    out = course.get_response_log_probs(model, input_ids, labels, return_token_entropy=True)
    assert set(out) == {"log_probs", "token_entropy"}
    logits = model(input_ids).logits.double()
    ref = torch.log_softmax(logits, -1).gather(-1, labels[..., None])[..., 0]
    torch.testing.assert_close(out["log_probs"].double(), ref, atol=1e-5, rtol=0)
    assert out["token_entropy"].shape == (2, 7)
    assert set(course.get_response_log_probs(model, input_ids, labels)) == {"log_probs"}


# ---------------------------------------------------------------------------- masked reductions


def test_masked_mean_and_normalize_hand_values():
    t = torch.tensor([[1.0, 2.0, 3.0], [4.0, 5.0, 6.0]])
    m = torch.tensor([[True, False, True], [False, False, False]])
    # all: (1 + 3) / 2 = 2
    assert course.masked_mean(t, m).item() == 2.0
    # per row: row 0 -> 2, row 1 -> 0/0 = NaN (a mean of nothing)
    rows = course.masked_mean(t, m, dim=1)
    assert rows[0].item() == 2.0 and math.isnan(rows[1].item())
    # per column: [1/1, 0/0, 3/1]
    cols = course.masked_mean(t, m, dim=0)
    assert cols[0].item() == 1.0 and math.isnan(cols[1].item()) and cols[2].item() == 3.0
    # normalize: (1 + 3) / 2.5 = 1.6 ; per row [4/2.5, 0]
    assert course.masked_normalize(t, m, normalize_constant=2.5).item() == pytest.approx(1.6)
    torch.testing.assert_close(
        course.masked_normalize(t, m, dim=-1, normalize_constant=2.5), torch.tensor([1.6, 0.0])
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
    adv, raw, meta = course.compute_group_normalized_rewards(fn, responses, ["x"] * 8, 4, 0.0, False)
    torch.testing.assert_close(adv, torch.tensor([0.75, -0.25, -0.25, -0.25, 0.5, 0.5, -0.5, -0.5]))
    torch.testing.assert_close(raw, torch.tensor([1.0, 0, 0, 0, 1, 1, 0, 0]))
    adv, _, _ = course.compute_group_normalized_rewards(fn, responses, ["x"] * 8, 4, 1e-6, True)
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
    adv, _, _ = course.compute_group_normalized_rewards(*args, scale_rewards="none")
    torch.testing.assert_close(adv, centred)
    # group: as normalize_by_std=True (stds .5 and 1/√3, see above)
    adv, _, _ = course.compute_group_normalized_rewards(*args, scale_rewards="group")
    legacy, _, _ = course.compute_group_normalized_rewards(*args, True)
    assert torch.equal(adv, legacy)
    # batch: one std over all 8 rewards [1,0,0,0,1,1,0,0]: mean 3/8, Σr² = 3,
    # var = (3 − 8·(3/8)²)/7 = (3 − 1.125)/7 = 0.267857…, std ≈ 0.517549 → 0.75 / 0.517549 ≈ 1.449138
    adv, _, _ = course.compute_group_normalized_rewards(*args, scale_rewards="batch")
    torch.testing.assert_close(adv, centred / 0.517549, atol=1e-6, rtol=1e-6)
    assert adv[0].item() == pytest.approx(1.449138, abs=1e-6)
    with pytest.raises(ValueError, match="unknown scale_rewards 'std'"):
        course.compute_group_normalized_rewards(*args, scale_rewards="std")


def test_scale_rewards_batch_std_spans_the_ranks():
    """Rank 0 holds group 1 and rank 1 group 2: with ``reduce_sums`` summing both ranks'
    ``[count, Σr, Σr²]``, each rank divides by the std of all 8 rewards, as one process would."""
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0, "g": 0.0, "h": 0.0})
    whole, _, _ = course.compute_group_normalized_rewards(
        fn, list("abcdefgh"), ["x"] * 8, 4, 1e-6, scale_rewards="batch"
    )
    rank_sums = [[4.0, 1.0, 1.0], [4.0, 2.0, 2.0]]  # [count, Σr, Σr²] of each rank's group
    both = lambda sums: [a + b for a, b in zip(*rank_sums)]
    for rank, letters in enumerate(("abcd", "efgh")):
        local, _, _ = course.compute_group_normalized_rewards(
            fn, list(letters), ["x"] * 4, 4, 1e-6, scale_rewards="batch", reduce_sums=both
        )
        torch.testing.assert_close(local, whole[4 * rank : 4 * rank + 4])
    alone, _, _ = course.compute_group_normalized_rewards(
        fn, list("abcd"), ["x"] * 4, 4, 1e-6, scale_rewards="batch"
    )
    assert not torch.allclose(alone, whole[:4])  # without the reduction: rank 0's std alone (.5)


def test_zero_variance_group_gets_zero_advantage_never_nan():
    fn = lambda r, g: {"reward": 0.7}
    for eps in (0.0, 1e-6):
        adv, _, meta = course.compute_group_normalized_rewards(fn, ["x"] * 6, ["y"] * 6, 3, eps, True)
        assert (adv == 0).all()
        assert meta["zero_variance_groups"] == 2.0 and meta["zero_variance_fraction"] == 1.0


def test_group_normalized_rewards_bad_sizes():
    with pytest.raises(ValueError, match="group_size=3 must be >= 1 and divide the 4 responses"):
        course.compute_group_normalized_rewards(
            lambda r, g: {"reward": 0}, ["a"] * 4, ["b"] * 4, 3, 1e-6, True
        )
    with pytest.raises(
        ValueError, match=r"group sizes \[2, 3\] must each be >= 1 and sum to the 4 responses"
    ):
        course.compute_group_normalized_rewards(
            lambda r, g: {"reward": 0}, ["a"] * 4, ["b"] * 4, [2, 3], 1e-6
        )
    with pytest.raises(ValueError, match="reward_shaping has 3 items for 4 responses"):
        course.compute_group_normalized_rewards(
            lambda r, g: {"reward": 0}, ["a"] * 4, ["b"] * 4, 2, 1e-6, reward_shaping=[0.0] * 3
        )


def test_variable_group_sizes_hand_values():
    # groups [1, 0] | [1, 1, 0, 0] | [1] (sizes 2, 4, 1)
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 1.0, "d": 1.0, "e": 0.0, "f": 0.0, "g": 1.0})
    args = (fn, list("abcdefg"), ["x"] * 7, [2, 4, 1], 0.0)
    # none: [0.5, −0.5 | 0.5, 0.5, −0.5, −0.5 | 0 (a group of one: zero variance)]
    adv, _, meta = course.compute_group_normalized_rewards(*args, scale_rewards="none")
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.0]))
    assert meta["num_groups"] == 3.0 and meta["zero_variance_groups"] == 1.0
    assert meta["zero_variance_fraction"] == pytest.approx(1 / 3)
    # group: stds √0.5 ≈ 0.70711 and √(1/3) ≈ 0.57735
    adv, _, _ = course.compute_group_normalized_rewards(*args, scale_rewards="group")
    a, b = 0.5 / math.sqrt(0.5), 0.5 / math.sqrt(1 / 3)
    torch.testing.assert_close(adv, torch.tensor([a, -a, b, b, -b, -b, 0.0]))
    # batch: rewards [1,0,1,1,0,0,1]: mean 4/7, var = (4 − 7·(4/7)²)/6 = (4 − 16/7)/6 = 2/7
    adv, _, _ = course.compute_group_normalized_rewards(*args, scale_rewards="batch")
    s = math.sqrt(2 / 7)
    torch.testing.assert_close(adv, torch.tensor([0.5, -0.5, 0.5, 0.5, -0.5, -0.5, 0.0]) / s)


@pytest.mark.parametrize("scale", ["group", "batch", "none"])
def test_equal_group_sizes_as_a_list_match_the_int_form_bit_for_bit(scale):
    rewards = [0.3, 1.0, 0.0, 0.7, 0.2, 0.2, 0.9, 0.1]
    fn = lambda r, g: {"reward": rewards[int(r)]}
    args = (fn, [str(i) for i in range(8)], ["x"] * 8)
    as_int = course.compute_group_normalized_rewards(*args, 4, 1e-6, scale_rewards=scale)
    as_list = course.compute_group_normalized_rewards(*args, [4, 4], 1e-6, scale_rewards=scale)
    assert torch.equal(as_int[0], as_list[0]) and torch.equal(as_int[1], as_list[1])
    assert as_int[2] == as_list[2]


def test_reward_shaping_is_added_before_the_advantage():
    fn = _reward_table({"a": 1.0, "b": 1.0, "c": 0.0, "d": 0.0})
    # shaping [0, −0.5, 0, −1]: rewards [1, 0.5, 0, −1]; group [1, 0.5] → mean 0.75: [0.25, −0.25];
    # group [0, −1] → mean −0.5: [0.5, −0.5]. Without shaping group 1 ([1, 1]) would teach nothing.
    adv, raw, meta = course.compute_group_normalized_rewards(
        fn, list("abcd"), ["x"] * 4, 2, 0.0, scale_rewards="none", reward_shaping=[0.0, -0.5, 0.0, -1.0]
    )
    torch.testing.assert_close(raw, torch.tensor([1.0, 0.5, 0.0, -1.0]))
    torch.testing.assert_close(adv, torch.tensor([0.25, -0.25, 0.5, -0.5]))
    assert meta["reward_shaping_mean"] == -0.375 and meta["reward_mean"] == 0.125
    assert meta["answer_reward_mean"] == 0.5  # the reward function's own keys are unshaped


def test_normalize_group_rewards_matches_the_scoring_form():
    fn = _reward_table({"a": 1.0, "b": 0.0, "c": 0.0, "d": 0.0, "e": 1.0, "f": 1.0})
    adv, raw, meta = course.compute_group_normalized_rewards(fn, list("abcdef"), ["x"] * 6, [4, 2], 1e-6)
    adv2, meta2 = core.normalize_group_rewards(raw, [4, 2], 1e-6)
    assert torch.equal(adv, adv2)
    assert meta2 == {k: v for k, v in meta.items() if not k.endswith("_reward_mean")}


@settings(max_examples=50, deadline=None)
@given(
    group_size=st.integers(1, 6),
    groups=st.integers(1, 4),
    by_std=st.booleans(),
    data=st.data(),
)
def test_property_group_advantages_sum_to_zero(group_size, groups, by_std, data):
    n = group_size * groups  # whole groups only: every example is checked
    rewards = data.draw(st.lists(st.floats(-5, 5, allow_nan=False), min_size=n, max_size=n))
    responses = [str(i) for i in range(n)]
    adv, _, _ = course.compute_group_normalized_rewards(
        lambda r, g: {"reward": rewards[int(r)]}, responses, ["gt"] * n, group_size, 1e-6, by_std
    )
    assert torch.isfinite(adv).all()
    sums = adv.view(-1, group_size).sum(dim=1)
    scale = 1.0 + adv.abs().max().item()
    assert sums.abs().max().item() <= 1e-5 * scale * group_size


# ---------------------------------------------------------------------------- policy-gradient losses


def test_naive_policy_gradient_loss():
    # −A·logp: −2·(−0.5) = 1 ; −2·(−1) = 2 ; −(−1)·(−0.5) = −0.5
    loss = course.compute_naive_policy_gradient_loss(
        torch.tensor([[2.0], [-1.0]]), torch.tensor([[-0.5, -1.0], [-0.5, 0.0]])
    )
    torch.testing.assert_close(loss, torch.tensor([[1.0, 2.0], [-0.5, 0.0]]))


def test_grpo_clip_loss_hand_values():
    adv = torch.tensor([[1.0], [-1.0]])
    old = torch.zeros(2, 3)
    new = torch.tensor([[0.5, 0.0, -0.5], [0.5, 0.0, -0.5]])
    loss, meta = course.compute_grpo_clip_loss(adv, new, old, 0.2)
    e = math.exp
    # A=+1: r=e^.5≈1.6487 > 1.2 → clipped, −1.2 ; r=1 → −1 ; r=e^-.5≈.6065 → min(.6065, .8) = .6065 → −.6065
    # A=−1: r=1.6487 → min(−1.6487, −1.2) = −1.6487 → 1.6487 (not clipped) ; r=1 → 1 ;
    #       r=.6065 < .8 → min(−.6065, −.8) = −.8 → clipped, .8
    expected = torch.tensor([[-1.2, -1.0, -e(-0.5)], [e(0.5), 1.0, 0.8]])
    torch.testing.assert_close(loss, expected)
    assert meta["clipped"].tolist() == [[True, False, False], [False, False, True]]


# The documented domain of cliprange: any number >= 0 (issue 35: LossOptions' training-config
# domain, clip_low in [0, 1), had narrowed it). A large one is a legal call: the course's own tests
# use one. Ratios e^0.5 ≈ 1.6487, e^-3 ≈ 0.0498, e^3 ≈ 20.086 against A = +1 and A = −1.
_NEW = torch.tensor([[0.5, -3.0, 3.0], [0.5, -3.0, 3.0]])
_ADV = torch.tensor([[1.0], [-1.0]])


@pytest.mark.parametrize("cliprange", [10, 10.0, torch.tensor(10.0)], ids=["int", "float", "tensor"])
def test_a_clip_range_of_one_or_more_leaves_no_lower_clip(cliprange):
    loss, meta = course.compute_grpo_clip_loss(_ADV, _NEW, torch.zeros(2, 3), cliprange)
    e = math.exp
    # [1 − 10, 1 + 10] = [−9, 11]: no ratio (> 0) is below −9, so nothing is clipped from below;
    # A=+1: −min(r, clip(r)) → −1.6487, −0.0498, −11 (20.086 > 11: clipped)
    # A=−1: −min(−r, −clip(r)) = max(r, clip(r)) → 1.6487, 0.0498 (0.8 with cliprange 0.2), 20.086
    expected = torch.tensor([[-e(0.5), -e(-3.0), -11.0], [e(0.5), e(-3.0), e(3.0)]])
    torch.testing.assert_close(loss, expected)
    assert meta["clipped"].tolist() == [[False, False, True], [False, False, False]]


def test_an_infinite_clip_range_clips_nothing_and_a_negative_one_is_refused():
    loss, meta = course.compute_grpo_clip_loss(_ADV, _NEW, torch.zeros(2, 3), math.inf)
    # −min(r·A, clip(r, −inf, inf)·A) = −r·A
    torch.testing.assert_close(loss, -torch.exp(_NEW) * _ADV)
    assert not meta["clipped"].any()
    for bad in (-0.1, math.nan):
        with pytest.raises(ValueError, match=r"cliprange must be a number >= 0 \(1 or more: no lower clip\)"):
            course.compute_grpo_clip_loss(_ADV, _NEW, torch.zeros(2, 3), bad)
    with pytest.raises(TypeError, match="cliprange must be a number, got 'wide'"):
        course.compute_grpo_clip_loss(_ADV, _NEW, torch.zeros(2, 3), "wide")


def test_the_dispatch_and_the_train_step_take_a_large_clip_range():
    """compute_policy_gradient_loss and grpo_microbatch_train_step pass cliprange on unchanged."""
    old = torch.zeros(2, 3)
    loss, _ = course.compute_policy_gradient_loss(
        _NEW, "grpo_clip", advantages=_ADV, old_log_probs=old, cliprange=10
    )
    torch.testing.assert_close(loss, course.compute_grpo_clip_loss(_ADV, _NEW, old, 10)[0])
    lp = _NEW.clone().requires_grad_(True)
    mask = torch.ones(2, 3, dtype=torch.bool)
    step_loss, meta = course.grpo_microbatch_train_step(
        lp, mask, 1, "grpo_clip", advantages=_ADV, old_log_probs=old, cliprange=10
    )
    # mean over tokens then rows of the loss above: (−1.6487 − 0.0498 − 11 + 1.6487 + 0.0498 + 20.086) / 6
    assert step_loss.item() == pytest.approx((-11.0 + math.exp(3.0)) / 6, rel=1e-6)
    # ∂ℓ/∂lp = −A·r where unclipped, 0 where clipped (r = 20.086, A = +1), each / 6
    r = torch.exp(_NEW)
    grad = torch.tensor([[-1.0, -1.0, 0.0], [1.0, 1.0, 1.0]]) * r / 6
    torch.testing.assert_close(lp.grad, grad)
    assert meta["clip_fraction"].item() == pytest.approx(1 / 6)


def test_policy_gradient_loss_dispatch():
    lp = torch.tensor([[-1.0, -2.0]])
    rewards, adv = torch.tensor([[3.0]]), torch.tensor([[0.5]])
    loss, _ = course.compute_policy_gradient_loss(lp, "no_baseline", raw_rewards=rewards)
    torch.testing.assert_close(loss, torch.tensor([[3.0, 6.0]]))
    loss, _ = course.compute_policy_gradient_loss(lp, "reinforce_with_baseline", advantages=adv)
    torch.testing.assert_close(loss, torch.tensor([[0.5, 1.0]]))
    loss, meta = course.compute_policy_gradient_loss(
        lp, "grpo_clip", advantages=adv, old_log_probs=lp, cliprange=0.2
    )
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -0.5]]))  # r = 1 → −A
    assert "clipped" in meta
    with pytest.raises(ValueError, match="unknown loss_type 'ppo'"):
        course.compute_policy_gradient_loss(lp, "ppo", advantages=adv)
    with pytest.raises(ValueError, match="needs old_log_probs, cliprange"):
        course.compute_policy_gradient_loss(lp, "grpo_clip", advantages=adv)


# ---------------------------------------------------------------------------- microbatch train steps


def test_sft_microbatch_train_step_hand_values():
    lp = torch.tensor([[-1.0, -2.0, -3.0], [-4.0, -5.0, -6.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [False, True, True]])
    # per sequence: 3 and 11, /c=2 → 1.5, 5.5; batch mean 3.5; / 2 accumulation steps = 1.75
    loss, _ = course.sft_microbatch_train_step(
        lp, mask, gradient_accumulation_steps=2, normalize_constant=2.0
    )
    assert loss.item() == pytest.approx(1.75)
    # ∂/∂lp = −m / (c · B · steps) = −1/8 on response tokens
    torch.testing.assert_close(lp.grad, -mask.float() / 8)


def test_grpo_microbatch_train_step_hand_values_and_accumulation():
    lp = torch.tensor([[-1.0, -1.0, -1.0], [-2.0, -2.0, -2.0]], requires_grad=True)
    mask = torch.tensor([[True, True, False], [True, False, False]])
    adv = torch.tensor([[1.0], [-2.0]])
    # reinforce_with_baseline: ℓ = −A·lp → row 0: −1·−1 = 1 (mean 1), row 1: 2·−2 = −4 (mean −4)
    # batch mean −1.5, / 3 steps = −0.5
    loss, _ = course.grpo_microbatch_train_step(lp, mask, 3, "reinforce_with_baseline", advantages=adv)
    assert loss.item() == pytest.approx(-0.5)
    # ∂/∂lp = −A·m / (len · B · steps): row 0 −1/(2·2·3) = −1/12, row 1 2/(1·2·3) = 1/3
    g = torch.tensor([[-1 / 12, -1 / 12, 0.0], [1 / 3, 0.0, 0.0]])
    torch.testing.assert_close(lp.grad, g)
    # a second call accumulates into .grad
    course.grpo_microbatch_train_step(lp, mask, 3, "reinforce_with_baseline", advantages=adv)
    torch.testing.assert_close(lp.grad, 2 * g)


@settings(max_examples=25, deadline=None)
@given(per=st.integers(1, 4), t=st.integers(1, 6), steps=st.integers(1, 4), seed=st.integers(0, 10_000))
def test_property_gradients_accumulate_across_microbatches(per, t, steps, seed):
    """k microbatch calls of a split batch give the gradient of one call on the whole batch
    (equal-size microbatches of ``per`` sequences: only then is the per-microbatch mean a batch
    mean)."""
    b = per * steps
    g = torch.Generator().manual_seed(seed)
    lp_full = torch.randn(b, t, dtype=torch.float64, generator=g)
    old = lp_full + 0.3 * torch.randn(b, t, dtype=torch.float64, generator=g)
    adv = torch.randn(b, 1, dtype=torch.float64, generator=g)
    mask = torch.rand(b, t, generator=g) > 0.3
    mask[:, 0] = True
    whole = lp_full.clone().requires_grad_(True)
    course.grpo_microbatch_train_step(
        whole, mask, 1, "grpo_clip", advantages=adv, old_log_probs=old, cliprange=0.2
    )
    parts = lp_full.clone().requires_grad_(True)
    chunks = torch.arange(b).chunk(steps)
    assert [len(idx) for idx in chunks] == [per] * steps
    for idx in chunks:
        sub = parts[idx]
        course.grpo_microbatch_train_step(
            sub,
            mask[idx],
            len(chunks),
            "grpo_clip",
            advantages=adv[idx],
            old_log_probs=old[idx],
            cliprange=0.2,
        )
    torch.testing.assert_close(parts.grad, whole.grad, atol=1e-12, rtol=1e-10)
