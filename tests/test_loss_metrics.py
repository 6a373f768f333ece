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
    rollout = SimpleNamespace(finish_reason=["stop"], sampler_logprobs=None)
    meta = {"zero_variance_groups": 0.0, "num_groups": 1.0}
    t = stats.global_totals(dist.DistInfo(), torch.device("cpu"), torch.tensor([1.0]), rollout, meta)
    assert t["clip_fraction_low"] == t["clip_fraction_high"] == pytest.approx(1 / 3)
    assert t["clip_fraction"] == pytest.approx(2 / 3)
    assert (t["loss_pg"], t["loss_kl"], t["loss_entropy"]) == pytest.approx((pg, 0.02, -0.0175), rel=1e-6)


def test_tiny_run_logs_the_split_metrics(tmp_path):
    """β > 0 and an entropy bonus: the logged parts add up to ``train/loss``, each with its sign
    (k3 ≥ 0, so the KL part is > 0; the bonus −c·Σ w·H < 0). The step's metrics are its first
    epoch's, on-policy: nothing clipped on either side (the sides' arithmetic is above)."""
    quick = ["steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16",
             "logging.progress=false", "logging.sample_every=0", f"output_dir={tmp_path}",
             "loss.beta=0.05", "loss.entropy_coef=0.01"]  # fmt: skip
    train_mod.run(load_config("tiny", overrides=quick))
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    for r in rows:
        total = r["train/loss_pg"] + r["train/loss_kl"] + r["train/loss_entropy"]
        assert total == pytest.approx(r["train/loss"], rel=1e-5, abs=1e-7)
        assert r["train/loss_entropy"] < 0 and math.isfinite(r["train/loss_pg"])
        assert (
            r["train/clip_fraction_low"] == r["train/clip_fraction_high"] == r["train/clip_fraction"] == 0.0
        )
    assert rows[1]["train/loss_kl"] > 0  # step 2: π has moved away from π_ref


@pytest.mark.parametrize("name", ["gspo.yaml", "cispo.yaml", "dr_grpo.yaml"])
def test_variant_config_files_train_on_tiny(name, tmp_path):
    """Each loss-variant file layered on the tiny preset trains two steps with finite metrics
    (GSPO and CISPO with their second, off-policy epoch)."""
    path = Path(__file__).parent.parent / "configs" / name
    quick = ["steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16",
             "logging.progress=false", "logging.sample_every=0", f"output_dir={tmp_path}"]  # fmt: skip
    cfg = load_config("tiny", [str(path)], quick)
    train_mod.run(cfg)
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert len(rows) == 2
    assert all(math.isfinite(r["train/loss"]) and math.isfinite(r["train/grad_norm"]) for r in rows)
