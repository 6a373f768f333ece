"""The trajectory type with inserted tokens (a tool's output between two sampled turns): only
sampled tokens are labels, in every microbatch layout, and the loss is the float64 loss of the
sampled tokens alone (an inserted token given a label changes it)."""

from __future__ import annotations

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.policy.batch import assign_loss_weights, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout import Group, Role, Rollout, Trajectory
from grpo_fast.task import tiny

S, INS = Role.SAMPLED, Role.INSERTED


def test_a_trajectory_checks_its_shapes():
    with pytest.raises(ValueError, match="roles has 2 entries for 3 tokens"):
        Trajectory([1], [2, 3, 4], roles=[S, S])
    with pytest.raises(ValueError, match="starts with a sampled token"):
        Trajectory([1], [2, 3], roles=[INS, S])
    with pytest.raises(ValueError, match="sampler_logprobs has 3 entries for 2 sampled tokens"):
        Trajectory([1], [2, 3, 4], roles=[S, INS, S], sampler_logprobs=[-1.0, -2.0, -3.0])
    with pytest.raises(ValueError, match="turn_starts"):
        Trajectory([1], [2, 3, 4], roles=[S, INS, S], turn_starts=[0, 0])
    t = Trajectory(
        [1], [2, 3, 4, 5], roles=[S, INS, INS, S], sampler_logprobs=[-1.0, -2.0], turn_starts=[0, 3]
    )
    assert (t.num_sampled, t.num_inserted, t.num_turns, t.sampled_ids) == (2, 2, 2, [2, 5])
    assert Trajectory([1], [2, 3], roles=[S, S]).roles is None  # all sampled: the single-turn form


def _multi_turn():
    """Two groups; the first response of each has an inserted segment between two turns."""
    g = torch.Generator().manual_seed(0)
    tok = lambda n: torch.randint(3, 15, (n,), generator=g).tolist()
    groups = []
    for prompt in ([5, 6, 7], [8, 9]):
        responses = [
            Trajectory(prompt, tok(7), roles=[S, S, INS, INS, INS, S, S], turn_starts=[0, 5]),
            Trajectory(prompt, tok(3)),
            Trajectory(prompt, tok(5), roles=[S, INS, S, S, S], turn_starts=[0, 2]),
        ]
        for t in responses:
            t.sampler_logprobs = (-torch.rand(t.num_sampled, generator=g)).tolist()
        groups.append(Group(prompt, responses))
    rollout = Rollout(groups=groups)
    for t, a in zip(rollout.trajectories, torch.randn(6, generator=g).tolist()):
        t.advantage = a
    assign_loss_weights(rollout.trajectories, length_norm="sequence_mean", max_length=8)
    return rollout.trajectories


@pytest.mark.parametrize(
    "layout", [dict(packing=False), dict(packing=True), dict(packing=False, share_prompts=True)],
    ids=["padded", "packed", "shared"],
)  # fmt: skip
def test_only_sampled_tokens_are_labels_in_every_layout(layout):
    trajectories = _multi_turn()
    labels, slp = {}, {}
    for mb in make_microbatches(trajectories, 2, pad_id=0, **layout):
        flat = mb.input_ids.flatten()
        assert torch.equal(flat[mb.select_index + 1], mb.labels) or layout.get("share_prompts")
        for i in mb.response_index.unique().tolist():
            labels[i] = mb.labels[mb.response_index == i].tolist()
            slp[i] = mb.sampler_logprobs[mb.response_index == i].tolist()
    assert labels == {i: t.sampled_ids for i, t in enumerate(trajectories)}
    for i, t in enumerate(trajectories):  # fp32 in the microbatch
        assert slp[i] == pytest.approx(t.sampler_logprobs, rel=1e-6)


def _reference(model, trajectories, options, temperature, label_inserted=False):
    """Σ_t w_t·ℓ_t over each response's sampled tokens from full float64 logits, on-policy:
    ℓ = −A·r with r = exp(log π − log π_old) = 1 (value −A, gradient −A·∇log π); ``label_inserted``
    (the planted bug) gives the inserted tokens a loss too, at their neighbours' weight."""
    total = 0.0
    for t in trajectories:
        ids = torch.tensor([t.prompt_ids + t.token_ids])
        logp = (model(ids).logits[0].double() / temperature).log_softmax(-1)
        p = len(t.prompt_ids)
        positions = range(t.num_tokens) if label_inserted else t.label_positions
        w = t.loss_weights[0].double()
        for j in positions:
            lp = logp[p + j - 1, t.token_ids[j]]
            total = total - w * t.advantage * torch.exp(lp - lp.detach())
    return total


def test_the_loss_is_the_sampled_tokens_loss_in_every_layout():
    import copy

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    model64 = copy.deepcopy(model).double()
    trajectories = _multi_turn()
    want = _reference(model64, trajectories, LossOptions(), 0.8)
    planted = _reference(model64, trajectories, LossOptions(), 0.8, label_inserted=True)
    assert abs(planted.item() - want.item()) > 1e-3  # the check below can tell them apart
    planted.backward()
    planted_grad = {n: p.grad.float() for n, p in model64.named_parameters()}
    model64.zero_grad(set_to_none=True)
    want.backward()
    want_grad = {n: p.grad.float() for n, p in model64.named_parameters()}
    assert not torch.allclose(planted_grad["model.norm.weight"], want_grad["model.norm.weight"], rtol=1e-3)
    for layout in (dict(packing=False), dict(packing=True), dict(packing=False, share_prompts=True)):
        model.zero_grad(set_to_none=True)
        loss_fn = PolicyLoss(model, autocast=None, backend="torch_chunked")
        total = sum(
            loss_fn(mb, LossOptions(), 0.8).loss for mb in make_microbatches(trajectories, 2, 0, **layout)
        )
        total.backward()
        torch.testing.assert_close(total.double(), want.detach(), rtol=1e-5, atol=1e-7)
        for n, p in model.named_parameters():
            torch.testing.assert_close(
                p.grad, want_grad[n], rtol=1e-4, atol=1e-7, msg=lambda m, n=n: f"{n}: {m}"
            )
