"""The sampler-correction weights before they are cut: ``raw_importance_weights`` (hand-worked) and
``rollout/is_weight_raw_mean`` / ``rollout/is_weight_raw_max`` beside the cut weights' metrics."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.sampler_correction import cut_importance_weights, raw_importance_weights
from grpo_fast.config import load_config
from grpo_fast.loop.optimization import prepare_old_and_ref
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import build_policy_loss
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny


def test_raw_weights_by_hand():
    trainer = torch.tensor([-1.0, -1.0, -1.0], dtype=torch.float64)  # fp64: Δ exact to 1e-16
    sampler = trainer - torch.tensor(
        [0.0, math.log(3), -math.log(2)], dtype=torch.float64
    )  # Δ = log π_old − log π_sampler
    # token level: ρ = e^Δ = [1, 3, 0.5]; sequence level (ids 0, 0, 1): e^(0 + ln 3) = 3 on both of
    # response 0's tokens, e^(−ln 2) = 0.5 on response 1's
    token = raw_importance_weights(trainer, sampler, torch.tensor([0, 0, 1]), level="token")
    seq = raw_importance_weights(trainer, sampler, torch.tensor([0, 0, 1]), level="sequence")
    assert token.dtype == torch.float64
    assert token.tolist() == pytest.approx([1.0, 3.0, 0.5], rel=1e-12)
    assert seq.tolist() == pytest.approx([3.0, 3.0, 0.5], rel=1e-12)
    # the cut (cap 2): truncate [1, 2, 0.5], mask [1, 0, 0.5]; the raw ones keep the 3
    assert cut_importance_weights(token, mode="truncate", cap=2.0).tolist() == pytest.approx([1.0, 2.0, 0.5])
    assert cut_importance_weights(token, mode="mask", cap=2.0).tolist() == pytest.approx([1.0, 0.0, 0.5])


def test_a_weight_at_the_cap_is_kept_and_bad_arguments_are_named():
    """Only ρ > cap is cut: ρ = cap exactly (2 = e^ln 2) stays 2 under both modes. A level, a mode
    or shapes outside the domain are a ValueError naming them (found by mutation testing: no test
    checked the boundary or the messages)."""
    from grpo_fast.algo.sampler_correction import sampler_importance_weights

    rho = torch.tensor([2.0, 2.5], dtype=torch.float64)
    assert cut_importance_weights(rho, mode="mask", cap=2.0).tolist() == [2.0, 0.0]
    assert cut_importance_weights(rho, mode="truncate", cap=2.0).tolist() == [2.0, 2.0]
    lp, ids = torch.zeros(2), torch.tensor([0, 1])
    with pytest.raises(ValueError, match=r"mode must be one of \('truncate', 'mask'\), got 'clip'"):
        cut_importance_weights(rho, mode="clip", cap=2.0)
    with pytest.raises(ValueError, match=r"level must be one of \('token', 'sequence'\), got 'batch'"):
        raw_importance_weights(lp, lp, ids, level="batch")
    with pytest.raises(
        ValueError, match=r"trainer_logprobs \(2,\), sampler_logprobs \(3,\) and sequence_ids"
    ):
        raw_importance_weights(lp, torch.zeros(3), ids, level="token")
    empty = torch.zeros(0)  # a microbatch without sampled tokens: no weights, no error
    assert raw_importance_weights(empty, empty, torch.zeros(0, dtype=torch.long), level="sequence").shape == (
        0,
    )
    for level, mode in (("batch", "mask"), ("token", "clip")):  # either one wrong is refused
        with pytest.raises(ValueError, match=rf"got '{level}', '{mode}'"):
            sampler_importance_weights(lp, lp, ids, level=level, mode=mode, cap=2.0)


@pytest.mark.parametrize("mode", ["truncate", "mask"])
def test_metrics_report_the_weights_before_the_cut(mode):
    """Two responses of 2 and 1 tokens whose sampler log-probs are the trainer's minus 0.7 (the
    first token) / 0.2 (the others): sequence level, ρ = e^0.9 ≈ 2.4596 on the 2-token response
    (over the cap 2) and e^0.2 ≈ 1.2214 on the other. Raw: mean (2·2.4596 + 1.2214) / 3 = 2.0469,
    max 2.4596, whatever the cut did; the cut weights' mean is (2·2 + 1.2214) / 3 = 1.7405
    (truncate) or 1.2214 / 3 = 0.4071 (mask)."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    seqs = loss_trajectories(
        Rollout([tok("12+34=")["input_ids"]], [tok("46")["input_ids"], tok("5")["input_ids"]]),
        advantages=torch.tensor([1.0, -1.0]),
        length_norm="sequence_mean",
        max_length=4,
    )
    mb = make_microbatches(seqs, 8, tok.pad_token_id, packing=False)[0]
    cfg = load_config(
        "tiny",
        overrides=[
            "rollout.backend=vllm",
            "rollout.is_correction=true",
            "rollout.is_level=sequence",
            f"rollout.is_mode={mode}",
        ],
        check_device=False,
    )
    policy = build_policy_loss(cfg, model, None)
    with torch.no_grad():
        trainer = policy(mb, LossOptions(), 1.0).logprobs
    assert trainer.numel() == 3  # longest response first: tokens 0-1 are "46", token 2 is "5"
    mb.sampler_logprobs = trainer - torch.tensor([0.7, 0.2, 0.2])
    _, extra = prepare_old_and_ref(cfg, [mb], policy, None, 1.0, LossOptions())
    hi, lo = math.exp(0.9), math.exp(0.2)
    assert extra["rollout/is_weight_raw_mean"] == pytest.approx((2 * hi + lo) / 3, rel=1e-6)
    assert extra["rollout/is_weight_raw_max"] == pytest.approx(hi, rel=1e-6)
    cut = (2 * 2.0 + lo) / 3 if mode == "truncate" else lo / 3
    assert extra["rollout/is_weight_mean"] == pytest.approx(cut, rel=1e-5)
