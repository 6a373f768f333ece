"""``loss.type=sapo`` (SAPO, arXiv 2511.20347): hand-worked values, the zero-advantage property,
the config keys, and TRL's own SAPO loss (``GRPOTrainer._compute_loss``, TRL 1.16) on the same
inputs. Both kernel backends against the float64 reference: the ``sapo-*`` cases of
``tests/test_grpo_loss.py``; the fused head: ``tests/test_fused_linear_grpo_loss.py::test_sapo_*``.

The TRL comparison runs where TRL is installed (the ``peers`` extra, its own environment):
``.venv-peers/bin/python -m pytest tests/test_sapo.py``; elsewhere it is skipped.
"""

from __future__ import annotations

import math
import types
from collections import defaultdict

import pytest
import torch

from grpo_fast.algo.core import grpo_token_loss
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.domains import DomainError
from grpo_fast.errors import ConfigError

SAPO = LossOptions(type="sapo")


def _token(logp: float, old: float, adv: float, options: LossOptions = SAPO) -> tuple[float, float]:
    """``(ℓ, ∂ℓ/∂log π)`` of one token."""
    lp = torch.tensor([logp], dtype=torch.float64, requires_grad=True)
    loss, meta = grpo_token_loss(
        lp,
        torch.tensor([adv], dtype=torch.float64),
        options,
        old_logprobs=torch.tensor([old], dtype=torch.float64),
    )
    assert not meta["clipped"].any()  # a gate, never a clip
    loss.sum().backward()
    return loss.item(), lp.grad.item()


def test_hand_worked_values():
    # A = 1, log r = 0.5 (τ_pos = 1): r = e^0.5 = 1.64872, σ(r − 1) = σ(0.64872) = 0.65672,
    # ℓ = −4·0.65672 = −2.62689; ∂ℓ/∂log π = −4σ(1 − σ)·r·A = −4·0.65672·0.34328·1.64872 = −1.48674
    loss, grad = _token(-1.0, -1.5, 1.0)
    assert loss == pytest.approx(-2.6268889844843373, rel=1e-12)
    assert grad == pytest.approx(-1.48673861055975, rel=1e-12)
    # A = −1, log r = −0.5 (τ_neg = 1.05): r = 0.60653, τ(r − 1) = −0.41314, σ = 0.39816,
    # ℓ = −(4/1.05)·0.39816·(−1) = 1.51680; ∂ℓ/∂log π = 4·0.39816·0.60184·0.60653 = 0.58137
    loss, grad = _token(-1.5, -1.0, -1.0)
    assert loss == pytest.approx(1.5167953328585435, rel=1e-12)
    assert grad == pytest.approx(0.5813678009099889, rel=1e-12)
    # on-policy: σ(0) = 1/2, so ℓ = −2A/τ and the gradient is −A, GRPO's, for either sign
    for adv, tau in ((0.7, 1.0), (-0.7, 1.05)):
        loss, grad = _token(-2.0, -2.0, adv)
        assert loss == pytest.approx(-2 * adv / tau, rel=1e-12)
        assert grad == pytest.approx(-adv, rel=1e-12)
    # other temperatures: τ_pos = 2 at r = e^0.5: ℓ = −(4/2)·σ(2·0.64872) = −2·0.78531 = −1.57062
    loss, _ = _token(-1.0, -1.5, 1.0, LossOptions(type="sapo", sapo_tau_pos=2.0))
    assert loss == pytest.approx(-2 / (1 + math.exp(-2 * 0.6487212707001282)), rel=1e-12)


def test_zero_advantage_means_zero_loss_and_gradient():
    """SAPO's term is A times a function of r, so the loop's zero-advantage skip stays on for it."""
    assert SAPO.zero_advantage_zero_gradient
    g = torch.Generator().manual_seed(0)
    lp = torch.randn(64, generator=g, dtype=torch.float64).requires_grad_()
    old = lp.detach() + torch.randn(64, generator=g, dtype=torch.float64)  # ratios e^±2 and beyond
    loss, _ = grpo_token_loss(lp, torch.zeros(64, dtype=torch.float64), SAPO, old_logprobs=old)
    loss.sum().backward()
    assert torch.equal(loss.detach(), torch.zeros(64, dtype=torch.float64))
    assert torch.equal(lp.grad, torch.zeros(64, dtype=torch.float64))


def test_options_and_config_keys():
    assert load_config("tiny", overrides=["loss.type=sapo"]).loss.sapo_tau_neg == 1.05  # TRL's default
    cfg = load_config("tiny", overrides=["loss.type=sapo", "loss.sapo_tau_pos=0.5"])
    assert cfg.loss.loss_options().sapo_tau_pos == 0.5
    with pytest.raises(ConfigError, match=r"loss\.sapo_tau_neg must be > 0, got 0"):
        load_config("tiny", overrides=["loss.sapo_tau_neg=0"])
    with pytest.raises(ConfigError, match=r"loss\.delta .*loss\.type='sapo'"):
        load_config("tiny", overrides=["loss.type=sapo", "loss.delta=2.0"])
    with pytest.raises(DomainError, match="loss_type='sapo'"):
        LossOptions.build(loss_type="sapo", delta=2.0)


def _trl_sapo_loss(logps, old, advantages, mask, tau_pos, tau_neg):
    """TRL 1.16's ``GRPOTrainer._compute_loss`` with ``loss_type="sapo"`` on given per-token
    log-probs ``[B, T]`` (its model call stubbed to return them), β = 0, no vLLM correction, no
    entropy bonus: what it computes from there is its own code."""
    from trl import GRPOTrainer

    B, T = logps.shape
    stub = types.SimpleNamespace(
        _get_per_token_logps_and_entropies=lambda *a, **k: (logps, torch.zeros_like(logps), None),
        aux_loss_enabled=False,
        top_entropy_quantile=1.0,
        off_policy_mask_threshold=None,
        importance_sampling_level="token",
        beta=0.0,
        loss_type="sapo",
        args=types.SimpleNamespace(sapo_temperature_pos=tau_pos, sapo_temperature_neg=tau_neg),
        use_vllm=False,
        model=types.SimpleNamespace(training=True),
        current_gradient_accumulation_steps=1,
        _entropy_bonus_enabled=False,
        _metrics={"train": defaultdict(list)},
        accelerator=types.SimpleNamespace(reduce=lambda x, reduction: x, gather=lambda x: x),
    )
    inputs = {
        "prompt_ids": torch.zeros(B, 1, dtype=torch.long),
        "prompt_mask": torch.ones(B, 1, dtype=torch.long),
        "completion_ids": torch.zeros(B, T, dtype=torch.long),
        "completion_mask": mask.long(),
        "advantages": advantages,
        "old_per_token_logps": old,
    }
    return GRPOTrainer._compute_loss(stub, None, inputs)


def test_matches_trl_sapo_loss():
    """The same log-probs, π_old, advantages and mask: TRL's loss (per-sequence mean, then the
    batch mean) equals ours with ``length_norm=sequence_mean`` weights, and so do the gradients
    with respect to the log-probs, to float64 rounding; τ_pos = 0.75, τ_neg = 1.25 (not the
    defaults, so that a swapped pair would show; exact in fp32, which TRL's ``torch.where`` of two
    Python floats makes the temperatures: 1.05 would be 1.0499999523, a 5e-8 relative change)."""
    pytest.importorskip("trl", reason="TRL's SAPO loss: the peers extra (.venv-peers)")
    g = torch.Generator().manual_seed(0)
    B, T = 6, 9
    mask = torch.rand(B, T, generator=g) > 0.25
    mask[:, 0] = True
    old = -3 * torch.rand(B, T, generator=g, dtype=torch.float64)
    logps = (old + 0.8 * torch.randn(B, T, generator=g, dtype=torch.float64)).requires_grad_()  # r ≈ e^±0.8
    advantages = torch.randn(B, generator=g, dtype=torch.float64)
    theirs = _trl_sapo_loss(logps, old, advantages, mask, 0.75, 1.25)
    (their_grad,) = torch.autograd.grad(theirs, logps)

    weights = mask.double() / (
        mask.sum(-1, keepdim=True).double() * B
    )  # length_norm_weights' sequence_mean, in fp64
    ours_lp = logps.detach().clone().requires_grad_()
    per_token, _ = grpo_token_loss(
        ours_lp,
        advantages[:, None],
        LossOptions(type="sapo", sapo_tau_pos=0.75, sapo_tau_neg=1.25),
        old_logprobs=old,
    )
    ours = (weights * per_token).sum()
    ours.backward()
    assert ours.item() == pytest.approx(theirs.item(), rel=1e-12, abs=1e-15)
    torch.testing.assert_close(ours_lp.grad, their_grad, rtol=1e-12, atol=1e-15)
