"""The loss metrics of a training step: the clip fraction by side and the loss split into its
policy-gradient, KL and entropy parts (``train/clip_fraction_low``/``_high``, ``train/loss_pg``,
``train/loss_kl``, ``train/loss_entropy``); and the loss-variant experiment files end to end."""

import math
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from grpo_fast import dist
from grpo_fast import train as train_mod
from grpo_fast.config import load_config
from grpo_fast.obs.report import read_metrics


def test_row_math_splits_clip_sides_and_loss_terms_hand_values():
    """The row math every loss op runs (``core.weighted_grpo_loss``) computes each part of the
    loss itself, and the step's statistics report them as computed."""
    from grpo_fast.algo.core import GRPOLossOutput, weighted_grpo_loss
    from grpo_fast.algo.loss_options import LossOptions
    from grpo_fast.loop.stats import StepStats

    lp = torch.tensor([0.5, -0.5, 0.1], dtype=torch.float64)  # log r against old = 0
    old = torch.zeros(3, dtype=torch.float64)
    # k2 = d²/2 with d = log π_ref − log π: d = √.4, √.8, 0 → KL .2, .4, 0
    ref = lp + torch.tensor([0.4, 0.8, 0.0], dtype=torch.float64).sqrt()
    entropy = torch.tensor([1.0, 2.0, 3.0], dtype=torch.float64)
    adv = torch.tensor([1.0, -1.0, 1.0], dtype=torch.float64)
    w = torch.tensor([0.5, 0.25, 0.25], dtype=torch.float64)
    options = LossOptions(beta=0.1, entropy_coef=0.01, kl_estimator="k2")
    loss, rows = weighted_grpo_loss(lp, entropy, adv, w, options, old_logprobs=old, ref_logprobs=ref)
    # r = e^.5 ≈ 1.6487, A = 1 > 0: clipped at 1.2 → pg −1.2 (high side)
    # r = e^−.5 ≈ .6065, A = −1: −min(−.6065, −.8) = .8, clipped (low side)
    # r = e^.1 ≈ 1.1052 inside the range: pg = −1.1052
    # Σ w·pg = .5·(−1.2) + .25·.8 + .25·(−1.1052) = −.6763; KL part .1·(.5·.2 + .25·.4) = .02;
    # entropy part −.01·(.5·1 + .25·2 + .25·3) = −.0175
    pg = 0.5 * -1.2 + 0.25 * 0.8 + 0.25 * -math.exp(0.1)
    assert rows.parts.pg.item() == pytest.approx(pg, rel=1e-12)
    assert rows.parts.kl.item() == pytest.approx(0.02, rel=1e-12)
    assert rows.parts.entropy.item() == pytest.approx(-0.0175, rel=1e-12)
    assert loss.item() == pytest.approx(pg + 0.02 - 0.0175, rel=1e-12)
    out = GRPOLossOutput(loss, lp, entropy, rows.kl, rows.clipped, rows.log_ratio, rows.parts)
    assert out.clipped_high.tolist() == [True, False, False]
    assert out.clipped_low.tolist() == [False, True, False]
    stats = StepStats()
    mb = SimpleNamespace(labels=torch.zeros(3, dtype=torch.long), old_logprobs=old, sampler_logprobs=None)
    stats.add(out, mb)
    rollout = SimpleNamespace(
        finish_reason=["stop"], sampler_logprobs=None, trajectories=[SimpleNamespace(correct=1.0)]
    )
    meta = {"zero_variance_groups": 0.0, "num_groups": 1.0}
    t = stats.global_totals(dist.DistInfo(), torch.device("cpu"), torch.tensor([1.0]), rollout, meta)
    assert t["clip_fraction_low"] == t["clip_fraction_high"] == pytest.approx(1 / 3)
    assert t["clip_fraction"] == pytest.approx(2 / 3)
    assert (t["loss_pg"], t["loss_kl"], t["loss_entropy"]) == pytest.approx((pg, 0.02, -0.0175), rel=1e-6)


def test_tiny_run_logs_the_split_metrics(tmp_path):
    """β > 0 and an entropy bonus, DAPO's token-mean weights (each token 1/N, nothing skipped: the
    zero-advantage skip is off with β ≠ 0): the KL part is β times the logged per-token KL and the
    entropy part −c times the logged mean entropy, each from its own sum (``train/kl``,
    ``train/entropy_mean``), and the policy-gradient part, computed term by term in the op, is
    what the loss holds besides them. The step's metrics are its first epoch's, on-policy:
    nothing clipped on either side (the sides' arithmetic is above)."""
    quick = ["steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16",
             "logging.progress=false", "logging.sample_every=0", f"output_dir={tmp_path}",
             "loss.beta=0.05", "loss.entropy_coef=0.01", "loss.length_norm=token_mean"]  # fmt: skip
    train_mod.run(load_config("tiny", overrides=quick))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        assert r["train/skipped_fraction"] == 0.0
        assert r["train/loss_kl"] == pytest.approx(0.05 * r["train/kl"], rel=1e-5, abs=1e-9)
        assert r["train/loss_entropy"] == pytest.approx(-0.01 * r["train/entropy_mean"], rel=1e-5)
        total = r["train/loss_pg"] + r["train/loss_kl"] + r["train/loss_entropy"]
        assert total == pytest.approx(r["train/loss"], rel=1e-5, abs=1e-7)
        assert r["train/loss_entropy"] < 0 and math.isfinite(r["train/loss_pg"])
        assert (
            r["train/clip_fraction_low"] == r["train/clip_fraction_high"] == r["train/clip_fraction"] == 0.0
        )
    assert rows[0]["train/loss_kl"] == pytest.approx(0.0, abs=1e-9)  # step 1: π = π_ref
    assert rows[1]["train/loss_kl"] > 1e-6  # step 2: π has moved away from π_ref


# what each loss-variant file sets that the loop must use: (loss options, epochs, length norm,
# |A| of a group of 8 with 4 right answers: 0.5 unscaled, 0.5 / 0.5345 = 0.9354 scaled by the
# group's unbiased std √(8/7)/2)
VARIANT_FILES = {
    "gspo.yaml": (dict(importance_sampling_level="sequence", clip_low=3e-4, clip_high=4e-4), 2, "sequence_mean", 0.9354),
    "cispo.yaml": (dict(type="cispo", clip_low=0.999, clip_high=0.28), 2, "token_mean", 0.9354),
    "dr_grpo.yaml": (dict(type="grpo_clip"), 1, "constant", 0.5),
    "dapo.yaml": (dict(clip_low=0.2, clip_high=0.28), 1, "token_mean", 0.9354),
}  # fmt: skip


@pytest.mark.parametrize("name", list(VARIANT_FILES))
def test_variant_config_files_train_on_tiny(name, tmp_path, monkeypatch):
    """Each loss-variant file layered on the tiny preset trains two steps as the file says, seen
    in what the loss module receives: its options, one or two epochs (two: with π_old's log-probs
    from a no-grad pass, for the second's off-policy ratio), the length normalization in the loss weights (token mean ``1/N``,
    sequence mean ``1/(|o|·B)``, Dr. GRPO's ``1/(L·B)``) and the reward scaling in the advantages
    (Dr. GRPO's unscaled ``r − mean``). A policy answering half of each group right
    (tests/answer_oracle.py) gives every group rewards to learn from."""
    import answer_oracle

    from grpo_fast.policy import loss as loss_mod
    from grpo_fast.task import tiny

    tok = tiny.build_tokenizer()
    answer_oracle.install(monkeypatch, tok)
    calls = []
    real = loss_mod.PolicyLoss.forward

    def recording(self, mb, options, temperature):
        if torch.is_grad_enabled():
            calls.append((options, mb.old_logprobs is not None, mb.loss_weights.clone(), torch.bincount(mb.sequence_ids),
                          mb.advantages.clone()))  # fmt: skip
        return real(self, mb, options, temperature)

    monkeypatch.setattr(loss_mod.PolicyLoss, "forward", recording)
    path = Path(__file__).parent.parent / "configs" / name
    quick = ["steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16",
             "logging.progress=false", "logging.sample_every=0", f"output_dir={tmp_path}"]  # fmt: skip
    cfg = load_config("tiny", [str(path)], quick)
    train_mod.run(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in rows)
    options, epochs, length_norm, abs_advantage = VARIANT_FILES[name]
    # one microbatch per epoch; with two epochs π_old's log-probs come from a no-grad pass first
    assert [has_old for _, has_old, *_ in calls] == [epochs > 1] * (2 * epochs)
    for used, _, weights, lengths, advantages in calls:
        assert {k: getattr(used, k) for k in options} == options
        per_token = torch.repeat_interleave(lengths, lengths).float()
        expected = {
            "token_mean": torch.full_like(weights, 1 / int(lengths.sum())),
            "sequence_mean": 1 / (per_token * len(lengths)),
            "constant": torch.full_like(weights, 1 / (cfg.rollout.max_tokens * len(lengths))),
        }[length_norm]
        torch.testing.assert_close(weights, expected)
        torch.testing.assert_close(
            advantages.abs(), torch.full_like(advantages, abs_advantage), atol=1e-4, rtol=0
        )
