"""Config keys that change behaviour: each key made real (or checked) by the issue-11 audit has a
test here that it reaches the code it names."""

import pytest

from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError


def test_dual_clip_needs_the_clipped_loss():
    load_config("tiny", overrides=["loss.dual_clip=3.0"])  # grpo_clip: fine
    with pytest.raises(
        ConfigError, match=r"loss\.dual_clip applies only to loss\.type=grpo_clip, not no_baseline"
    ):
        load_config("tiny", overrides=["loss.dual_clip=3.0", "loss.type=no_baseline"])


def test_build_policy_loss_passes_every_loss_option():
    """Each ``loss.*`` key the fused op consumes reaches ``PolicyLoss`` (β and the temperature
    come per call: ``loss.beta`` through the KL controller's state, the temperature from the
    rollout)."""
    import torch

    from grpo_fast.model import build_policy_loss

    cfg = load_config(
        "tiny",
        overrides=[
            "loss.type=reinforce_with_baseline",
            "loss.clip_low=0.1",
            "loss.clip_high=0.3",
            "loss.kl_estimator=k2",
            "loss.entropy_coef=0.01",
            "loss.kernel_backend=eager",
            "loss.chunk_size=7",
        ],
    )
    policy = build_policy_loss(cfg, torch.nn.Linear(2, 2), None)
    assert policy.loss_options == dict(
        clip_low=0.1,
        clip_high=0.3,
        dual_clip=None,
        kl_estimator="k2",
        entropy_coef=0.01,
        loss_type="reinforce_with_baseline",
        backend="eager",
        chunk_size=7,
    )
