"""Config keys that change behaviour: each key made real (or checked) by the issue-11 audit has a
test here that it reaches the code it names."""

import pytest

from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError


def test_dual_clip_needs_the_clipped_loss():
    load_config("tiny", overrides=["loss.dual_clip=3.0"])  # grpo_clip: fine
    with pytest.raises(
        ConfigError, match=r"loss\.dual_clip applies only to loss\.type='grpo_clip', not 'no_baseline'"
    ):
        load_config("tiny", overrides=["loss.dual_clip=3.0", "loss.type=no_baseline"])


def test_top_entropy_quantile_range():
    with pytest.raises(ConfigError, match=r"loss\.top_entropy_quantile must be in \(0, 1\], got 1\.5"):
        load_config("tiny", overrides=["loss.top_entropy_quantile=1.5"])


def test_delta_must_exceed_one():
    assert load_config("tiny", overrides=["loss.delta=3.0", "loss.type=cispo"]).loss.delta == 3.0
    with pytest.raises(ConfigError, match=r"loss\.delta must be > 1 \(or null\), got 1\.0"):
        load_config("tiny", overrides=["loss.delta=1.0"])


def test_normalize_by_std_is_replaced_by_scale_rewards(tmp_path):
    for where in ("override", "file"):
        f = tmp_path / "old.yaml"
        f.write_text("loss:\n  normalize_by_std: false\n")
        args = (
            dict(overrides=["loss.normalize_by_std=false"])
            if where == "override"
            else dict(config_files=[str(f)])
        )
        with pytest.raises(
            ConfigError, match=r"'loss\.normalize_by_std' .* replaced: use loss\.scale_rewards=group"
        ):
            load_config("tiny", **args)
    assert load_config("tiny").loss.scale_rewards == "group"
    with pytest.raises(ConfigError, match=r"loss\.scale_rewards='std' is not one of: group, batch, none"):
        load_config("tiny", overrides=["loss.scale_rewards=std"])


def test_scale_rewards_reaches_the_advantages(tmp_path, monkeypatch):
    """The training loop hands ``loss.scale_rewards`` to the advantage computation (what each value
    does to the advantages: tests/test_course.py; to a run: tests/test_sweep.py)."""
    from grpo_fast import train as train_mod
    from grpo_fast.algo import core
    from grpo_fast.loop import rollout_phase

    seen = []

    def spy(*args, **kwargs):
        seen.append(kwargs["scale_rewards"])
        return core.normalize_group_rewards(*args, **kwargs)

    monkeypatch.setattr(rollout_phase, "normalize_group_rewards", spy)
    quick = ["steps=1", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=8",
             "logging.progress=false", "logging.sample_every=0", f"output_dir={tmp_path}"]  # fmt: skip
    train_mod.run(load_config("tiny", overrides=[*quick, "loss.scale_rewards=batch"]))
    assert seen == ["batch"]


def _spy_on_the_op(monkeypatch):
    """``PolicyLoss`` on a stand-in model whose fused-op call is recorded: ``(model, mb, calls)``."""
    import torch

    from grpo_fast.policy import loss as loss_mod

    calls = []
    monkeypatch.setattr(loss_mod, "fused_linear_grpo_loss", lambda *a, **kw: calls.append(kw))
    monkeypatch.setattr(loss_mod, "response_hidden_states", lambda model, mb: torch.zeros(2, 2))
    lin = torch.nn.Linear(2, 3)
    lin.get_output_embeddings = lambda: lin
    ids = torch.tensor([0, 1])
    mb = type("MB", (), dict(input_ids=torch.zeros(1, 2, dtype=torch.long), labels=ids, advantages=None,
                             loss_weights=None, old_logprobs=None, ref_logprobs=None, sequence_ids=ids,
                             label_bounds=(0, 1)))()  # fmt: skip
    return lin, mb, calls


def test_every_loss_option_reaches_the_op(monkeypatch):
    """Each ``loss.*`` option reaches the fused op through the options the loop passes
    (``cfg.loss.loss_options()``, as ``Run.loss_options`` builds them), and ``loss.kernel_backend``
    / ``loss.chunk_size`` through ``build_policy_loss``; β comes per step (the KL controller's)."""
    from grpo_fast.algo.loss_options import LossOptions
    from grpo_fast.policy.loss import build_policy_loss

    overrides = {
        "loss.type": "reinforce_with_baseline",
        "loss.clip_low": 0.1,
        "loss.clip_high": 0.3,
        "loss.delta": 1.5,
        "loss.importance_sampling_level": "sequence",
        "loss.top_entropy_quantile": 0.2,
        "loss.beta": 0.05,
        "loss.kl_estimator": "k2",
        "loss.entropy_coef": 0.01,
    }
    cfg = load_config(
        "tiny",
        overrides=[f"{k}={v}" for k, v in overrides.items()]
        + ["loss.kernel_backend=eager", "loss.chunk_size=7"],
    )
    options = cfg.loss.loss_options()
    assert type(options) is LossOptions
    assert options == LossOptions(**{k.removeprefix("loss."): v for k, v in overrides.items()})
    lin, mb, calls = _spy_on_the_op(monkeypatch)
    build_policy_loss(cfg, lin, None)(mb, options, 1.0)
    assert calls[0]["options"] is options
    assert (calls[0]["backend"], calls[0]["chunk_size"]) == ("eager", 7)


def test_policy_loss_hands_sequence_ids_only_at_sequence_level(monkeypatch):
    """``loss.importance_sampling_level=sequence`` makes ``PolicyLoss`` pass the microbatch's
    ``sequence_ids`` to the fused op (GSPO); at token level it passes None."""
    from grpo_fast.policy.loss import build_policy_loss

    lin, mb, calls = _spy_on_the_op(monkeypatch)
    for level in ("token", "sequence"):
        cfg = load_config("tiny", overrides=[f"loss.importance_sampling_level={level}"])
        build_policy_loss(cfg, lin, None)(mb, cfg.loss.loss_options(), 1.0)
    assert calls[0]["sequence_ids"] is None and calls[1]["sequence_ids"] is mb.sequence_ids
