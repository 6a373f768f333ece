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
