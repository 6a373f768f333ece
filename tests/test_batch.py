"""Rollout → microbatches: response positions, weights, packing, and the fused loss on them."""

import pytest
import torch

from grpo_fast.algo import course
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss, response_hidden_states
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny


def _rollout():
    prompts = [[5, 6, 7], [8, 9]]
    responses = [[3, 1], [4, 4, 4, 1], [10], [11, 12, 1]]  # group size 2
    adv = torch.tensor([1.0, -1.0, 0.5, -0.5])
    return prompts, responses, adv


def test_sequences_and_sequence_mean_weights():
    prompts, responses, adv = _rollout()
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=4
    )
    assert [s.prompt_ids + s.token_ids for s in seqs] == [
        [5, 6, 7, 3, 1],
        [5, 6, 7, 4, 4, 4, 1],
        [8, 9, 10],
        [8, 9, 11, 12, 1],
    ]
    assert [len(s.prompt_ids) for s in seqs] == [3, 3, 2, 2]
    assert [s.advantage for s in seqs] == [1.0, -1.0, 0.5, -0.5]
    # sequence_mean: 1 / (length · B) with B = 4 → 1/8, 1/16, 1/4, 1/12, on every token
    expected = [torch.full((n,), w) for w, n in zip([1 / 8, 1 / 16, 1 / 4, 1 / 12], [2, 4, 1, 3])]
    for s, want in zip(seqs, expected):
        torch.testing.assert_close(s.loss_weights, want, rtol=0, atol=0)
    tm = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="token_mean", max_length=4
    )
    assert [s.loss_weights[0].item() for s in tm] == pytest.approx([1 / 10] * 4)  # 10 response tokens


def test_empty_responses_are_dropped():
    seqs = loss_trajectories(
        Rollout([[1, 2]], [[3], []]),
        advantages=torch.tensor([1.0, -1.0]),
        length_norm="token_mean",
        max_length=4,
    )
    assert len(seqs) == 1 and seqs[0].loss_weights.tolist() == [1.0]


@pytest.mark.parametrize("share", [False, True], ids=["unshared", "shared"])
def test_an_empty_response_in_a_microbatch_selects_nothing(share):
    """A response of no tokens (a ``Trajectory`` allows one; the loop drops them first) adds no
    label and no selected position, with or without shared prompts. Planted: the shared layout
    selecting the prompt's last position for it anyway -> ``Microbatch`` refuses 3 positions for
    2 labels."""
    from grpo_fast.rollout.trajectory import Trajectory

    rows = [(0, Trajectory([1, 2], [3, 4], advantage=1.0)), (1, Trajectory([1, 2], [], advantage=1.0))]
    for _, t in rows:
        t.loss_weights = torch.ones(t.num_sampled)
    (mb,) = make_microbatches([t for _, t in rows], 2, 0, packing=False, share_prompts=share)
    assert mb.labels.tolist() == [3, 4] and int(mb.select.sum()) == 2


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
def test_microbatch_selects_exactly_the_response_labels(packing):
    prompts, responses, adv = _rollout()
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=4
    )
    mbs = make_microbatches(seqs, micro_batch_size=2, pad_id=0, packing=packing)
    labels, weights = [], []
    for mb in mbs:
        # the label of each selected position is the token that follows it
        nxt = torch.cat([mb.input_ids[:, 1:], torch.zeros_like(mb.input_ids[:, :1])], dim=1)
        assert torch.equal(nxt[mb.select], mb.labels)
        labels += mb.labels.tolist()
        weights += mb.loss_weights.tolist()
    # every response token appears once, and the weights still sum to 1 (one per-sequence mean each)
    assert sorted(labels) == sorted(t for r in responses for t in r)
    assert sum(weights) == pytest.approx(1.0)
    if packing:
        assert all(mb.attention_mask is None and mb.position_ids is not None for mb in mbs)


def test_packed_forward_equals_padded_forward():
    """Packing changes the layout, never the numbers: the same hidden states at response positions."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0).eval()
    prompts, responses, adv = _rollout()
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=4
    )
    ref = {}
    for mb in make_microbatches(seqs, 8, 0, packing=False):
        h = response_hidden_states(model, mb)
        ref = dict(zip(range(len(h)), h))
    packed = make_microbatches(seqs, 8, 0, packing=True)
    assert len(packed) == 1 and packed[0].input_ids.shape[0] == 1  # all four sequences share one row
    h_packed = response_hidden_states(model, packed[0])
    # same multiset of (label, hidden) pairs: match by label order within the sorted layouts
    pad = make_microbatches(seqs, 8, 0, packing=False)[0]
    key = lambda labels, h: sorted(zip(labels.tolist(), h.sum(-1).tolist()))
    got, want = key(packed[0].labels, h_packed), key(pad.labels, torch.stack(list(ref.values())))
    for (la, a), (lb, b) in zip(got, want):
        assert la == lb and a == pytest.approx(b, rel=1e-4, abs=1e-4)


def test_policy_loss_equals_the_eager_course_loss():
    """PolicyLoss (fused lm_head + loss on response positions) = the CS336 per-sequence GRPO loss."""
    torch.manual_seed(0)
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    prompts, responses, adv = _rollout()
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=4
    )
    mbs = make_microbatches(seqs, 2, 0, packing=False)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    total = sum(policy(mb, LossOptions(), temperature=1.0).loss for mb in mbs)
    total.backward()
    fused_grad = model.model.embed_tokens.weight.grad.clone()
    model.zero_grad()

    # eager: full logits, CS336 helpers, per-sequence masked mean, batch mean
    seq_tokens = [s.prompt_ids + s.token_ids for s in seqs]
    width = max(map(len, seq_tokens))
    ids = torch.zeros(len(seqs), width, dtype=torch.long)
    mask = torch.zeros(len(seqs), width, dtype=torch.bool)
    for i, (s, tokens) in enumerate(zip(seqs, seq_tokens)):
        ids[i, : len(tokens)] = torch.tensor(tokens)
        mask[i, len(s.prompt_ids) : len(tokens)] = True
    lp = course.get_response_log_probs(model, ids[:, :-1], ids[:, 1:])["log_probs"]
    a = torch.tensor([s.advantage for s in seqs])[:, None]
    per_token, _ = course.compute_policy_gradient_loss(
        lp, "grpo_clip", advantages=a, old_log_probs=lp.detach(), cliprange=0.2
    )
    eager = course.masked_mean(per_token, mask[:, 1:], dim=-1).mean()
    eager.backward()
    # fp32 both ways: the same sums in a different order
    torch.testing.assert_close(total, eager, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(fused_grad, model.model.embed_tokens.weight.grad, rtol=1e-4, atol=1e-6)


def test_left_out_responses_get_no_sequence_and_are_not_normalized_over():
    """``keep`` (loss.mask_truncated): 2 prompts × 2 responses, the second one left out. Under
    sequence_mean the three kept responses each weigh 1/(3·|o|): lengths 2, 1, 3 → 1/6, 1/3, 1/9."""
    seqs = loss_trajectories(
        Rollout([[5, 6], [7]], [[1, 2], [3, 4, 4, 4], [8], [9, 9, 9]]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        length_norm="sequence_mean",
        max_length=4,
        keep=[True, False, True, True],
    )
    assert [s.prompt_ids + s.token_ids for s in seqs] == [[5, 6, 1, 2], [7, 8], [7, 9, 9, 9]]
    assert [s.loss_weights[0].item() for s in seqs] == pytest.approx([1 / 6, 1 / 3, 1 / 9])
    # token_mean: 6 kept tokens (not 10) share the unit weight
    seqs = loss_trajectories(
        Rollout([[5, 6], [7]], [[1, 2], [3, 4, 4, 4], [8], [9, 9, 9]]),
        advantages=torch.tensor([1.0, -1.0, 0.5, -0.5]),
        length_norm="token_mean",
        max_length=4,
        keep=[True, False, True, True],
    )
    assert [s.loss_weights[0].item() for s in seqs] == pytest.approx([1 / 6] * 3)


def test_packed_microbatches_carry_their_boundaries_and_label_bounds():
    """Built on the CPU: lengths 7, 5, 5, 3 (longest first) in rows of at most 2 × 7 = 14 tokens,
    first-fit: row 0 = 7 + 5 (12; the second 5 does not fit in the 2 left), row 1 = 5 + 3 (8).
    cu_seqlens are the sequence starts, then the row's length; max_seqlen the longest."""
    prompts, responses, adv = _rollout()
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=4
    )
    packed = make_microbatches(seqs, micro_batch_size=2, pad_id=0, packing=True)
    assert [mb.cu_seqlens.tolist() for mb in packed] == [[0, 7, 12], [0, 5, 8]]
    assert [mb.max_seqlen for mb in packed] == [7, 5]
    assert all(mb.cu_seqlens.dtype == torch.int32 for mb in packed)  # what flash-attention takes
    # labels: row 0 = [4, 4, 4, 1] + [3, 1], row 1 = [11, 12, 1] + [10]
    assert [mb.label_bounds for mb in packed] == [(1, 4), (1, 12)]
    padded = make_microbatches(seqs, micro_batch_size=2, pad_id=0, packing=False)
    assert all(mb.cu_seqlens is None and mb.max_seqlen is None for mb in padded)
    moved = packed[0].to(torch.device("cpu"))
    assert moved.label_bounds == (1, 4) and moved.max_seqlen == 7  # carried over, not re-read


class _RecordingDecoder(torch.nn.Module):
    """Records the keyword arguments of its forward; returns zeros as hidden states."""

    def __init__(self, d: int):
        super().__init__()
        self.d, self.kwargs = d, None

    def forward(self, input_ids, **kwargs):
        self.kwargs = kwargs
        from types import SimpleNamespace

        return SimpleNamespace(last_hidden_state=torch.zeros(*input_ids.shape, self.d))


@pytest.mark.parametrize("attn", ["sdpa", "flash_attention_2"])
def test_flash_attention_gets_the_precomputed_varlen_arguments(attn):
    """Under flash-attention a packed microbatch's cu_seqlens / max_seqlen go to transformers'
    varlen path (so it derives nothing from position_ids per layer); other kernels get none."""
    from types import SimpleNamespace

    prompts, responses, adv = _rollout()
    seqs = loss_trajectories(
        Rollout(prompts, responses), advantages=adv, length_norm="sequence_mean", max_length=4
    )
    mb = make_microbatches(seqs, micro_batch_size=2, pad_id=0, packing=True)[0]
    decoder = _RecordingDecoder(4)
    model = SimpleNamespace(config=SimpleNamespace(_attn_implementation=attn), get_decoder=lambda: decoder)
    hidden = response_hidden_states(model, mb)
    assert hidden.shape == (mb.labels.numel(), 4)
    varlen = {k: v for k, v in decoder.kwargs.items() if k.startswith(("cu_seq_lens", "max_length"))}
    if attn == "sdpa":
        assert varlen == {}
    else:
        assert set(varlen) == {"cu_seq_lens_q", "cu_seq_lens_k", "max_length_q", "max_length_k"}
        assert varlen["cu_seq_lens_q"].tolist() == [0, 7, 12] and varlen["max_length_q"] == 7
