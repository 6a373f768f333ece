"""``train.share_prompts``: each prompt computed once for all its responses (a block mask over
``[prompt, r_1 … r_G]``, grpo_fast/policy/batch.py ``shared_prompt_microbatches``). The loss, the
per-token log-probs and every parameter's gradient equal the unshared layout's to fp32 summation
order: padded and packed, with gradient checkpointing, a group split across microbatches or kept
whole, some responses left out (the zero-advantage skip), at token and sequence (GSPO) level."""

from __future__ import annotations

import copy

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.policy.batch import build_sequences, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.task import tiny

GROUP = 4


def _rollout(seed: int = 0):
    """3 prompts of different lengths × 4 responses of 1-5 tokens (EOS-terminated), advantages."""
    tok = tiny.build_tokenizer()
    prompts = [tok(q)["input_ids"] for q in ("12+34=", "7+8=", "61+9=")]
    g = torch.Generator().manual_seed(seed)
    responses = [
        [*torch.randint(3, 15, (int(torch.randint(0, 5, (1,), generator=g)),), generator=g).tolist(), 1]
        for _ in range(len(prompts) * GROUP)
    ]
    adv = torch.randn(len(responses), generator=g)
    seqs = build_sequences(prompts, responses, adv, length_norm="sequence_mean", max_length=6)
    return tok, seqs


def _step(model, seqs, pad_id, micro_batch_size, **layout):
    """Loss, per-response log-probs (by response index) and gradients of one accumulated step."""
    model = copy.deepcopy(model)
    loss_fn = PolicyLoss(model, autocast=None, backend="torch_chunked")
    total, logprobs = 0.0, {}
    mbs = make_microbatches(seqs, micro_batch_size, pad_id, **layout)
    for mb in mbs:
        out = loss_fn(mb, LossOptions(), 0.8)
        out.loss.backward()
        total += out.loss.item()
        for i in mb.response_index.unique().tolist():
            logprobs[i] = out.logprobs[mb.response_index == i]
    grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}
    return total, logprobs, grads, mbs


def _assert_same(a, b):
    assert a[0] == pytest.approx(b[0], rel=1e-6, abs=1e-7)
    assert a[1].keys() == b[1].keys()
    for i in a[1]:
        torch.testing.assert_close(b[1][i], a[1][i], rtol=0, atol=2e-6)
    assert a[2].keys() == b[2].keys()
    for name in a[2]:
        scale = a[2][name].abs().max().item()
        torch.testing.assert_close(b[2][name], a[2][name], rtol=1e-5, atol=1e-6 * max(scale, 1.0), msg=name)


@pytest.mark.parametrize("packing", [False, True], ids=["padded", "packed"])
@pytest.mark.parametrize("micro_batch_size", [GROUP, 3, 12], ids=["whole-groups", "split-groups", "one-mb"])
def test_shared_prompts_give_the_unshared_loss_logprobs_and_gradients(packing, micro_batch_size):
    tok, seqs = _rollout()
    model = tiny.build_model(tok, seed=0)
    unshared = _step(model, seqs, tok.pad_token_id, micro_batch_size, packing=packing)
    shared = _step(model, seqs, tok.pad_token_id, micro_batch_size, packing=packing, share_prompts=True)
    _assert_same(unshared, shared)
    # each prompt once per microbatch it reaches: fewer tokens through the decoder
    n_tokens = lambda mbs: sum(int((mb.input_ids != tok.pad_token_id).sum()) for mb in mbs)
    assert n_tokens(shared[3]) < n_tokens(unshared[3])
    assert all(len(mb.labels) <= micro_batch_size * 6 for mb in shared[3])


def test_with_gradient_checkpointing_gspo_and_responses_left_out():
    """Checkpointed layers recompute under the same block mask; GSPO's sequence ratio over the
    shared layout's sequence ids; a group with some responses left out (as the zero-advantage
    skip leaves it) keeps its prompt for the rest, and a group with none left has no prompt."""
    from grpo_fast.policy.model import enable_checkpointing

    tok, seqs = _rollout(seed=1)
    kept = [s for i, s in enumerate(seqs) if i % GROUP != 0 and i // GROUP != 2]  # group 2 gone entirely
    model = tiny.build_model(tok, seed=0)
    enable_checkpointing(model)
    model.train()
    old = {}
    for s in kept:  # an off-policy π_old, so that GSPO's ratio is not 1
        old[s.response_index] = torch.randn(
            s.n_response, generator=torch.Generator().manual_seed(s.response_index)
        )
    gspo = LossOptions(importance_sampling_level="sequence", clip_low=0.02, clip_high=0.03)
    results = []
    for share in (False, True):
        m = copy.deepcopy(model)
        loss_fn = PolicyLoss(m, autocast=None, backend="torch_chunked")
        total = 0.0
        mbs = make_microbatches(kept, 3, tok.pad_token_id, packing=False, share_prompts=share)
        for mb in mbs:
            mb.old_logprobs = torch.cat([old[i][: int((mb.response_index == i).sum())] for i in _order(mb)])
            out = loss_fn(mb, gspo, 1.0)
            out.loss.backward()
            total += out.loss.item()
        results.append(
            (total, {}, {n: p.grad.clone() for n, p in m.named_parameters() if p.grad is not None}, mbs)
        )
    _assert_same(results[0], results[1])
    prompts_in = [int((mb.input_ids[:, :3] != tok.pad_token_id).any()) for mb in results[1][3]]
    assert len(prompts_in) == 2  # 6 responses, 3 a microbatch: the 2 kept groups, no row for group 2


def _order(mb) -> list[int]:
    """The response indices of ``mb`` in the order of its labels."""
    seen = []
    for i in mb.response_index.tolist():
        if not seen or seen[-1] != i:
            seen.append(i)
    return seen


def test_a_block_mask_is_refused_by_flash_attention_in_one_line():
    with pytest.raises(
        ConfigError, match=r"train\.share_prompts=true needs an attention that takes a block mask"
    ):
        load_config(
            "tiny", overrides=["train.share_prompts=true", "model.attn_implementation=flash_attention_2"]
        )


def test_the_key_reaches_the_loop_microbatches(tmp_path, monkeypatch):
    """The optimization phase builds shared-prompt microbatches exactly with the key on."""
    from grpo_fast import train as train_mod
    from grpo_fast.loop import optimization

    seen = []
    real = optimization.make_microbatches
    monkeypatch.setattr(
        optimization,
        "make_microbatches",
        lambda *a, **k: seen.append(k.get("share_prompts")) or real(*a, **k),
    )
    for share in ("false", "true"):
        quick = ["steps=1", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16",
                 "logging.progress=false", "train.skip_zero_advantage=false", f"output_dir={tmp_path / share}"]  # fmt: skip
        train_mod.run(load_config("tiny", overrides=[*quick, f"train.share_prompts={share}"]))
    assert seen == [False, True]
