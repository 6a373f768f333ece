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


def test_stats_split_clip_sides_and_loss_terms_hand_values():
    stats = train_mod._Stats()
    out = SimpleNamespace(
        loss=torch.tensor(1.0),
        logprobs=torch.tensor([0.5, -0.5, 0.1]),
        entropy=torch.tensor([1.0, 2.0, 3.0]),
        clipped=torch.tensor([True, True, False]),
        kl=torch.tensor([0.2, 0.4, 0.0]),
    )
    mb = SimpleNamespace(
        labels=torch.zeros(3, dtype=torch.long),
        old_logprobs=torch.zeros(3),
        sampler_logprobs=None,
        loss_weights=torch.tensor([0.5, 0.25, 0.25]),
    )
    stats.add(out, mb, beta=0.1, entropy_coef=0.01)
    rollout = SimpleNamespace(finish_reason=["stop"], sampler_logprobs=None)
    meta = {"zero_variance_groups": 0.0, "num_groups": 1.0}
    t = stats.global_totals(dist.DistInfo(), torch.device("cpu"), torch.tensor([1.0]), rollout, meta)
    # r = e^.5 > 1 clipped: high; r = e^−.5 < 1 clipped: low; r = e^.1 not clipped → 1/3 each
    assert t["clip_fraction_low"] == t["clip_fraction_high"] == pytest.approx(1 / 3)
    assert t["clip_fraction"] == pytest.approx(2 / 3)
    # KL part β·Σ w·KL = .1·(.5·.2 + .25·.4 + 0) = .02; entropy part −c·Σ w·H = −.01·(.5 + .5 + .75) = −.0175
    # pg = loss − KL part − entropy part = 1 − .02 + .0175 = .9975
    assert t["loss_kl"] == pytest.approx(0.02)
    assert t["loss_entropy"] == pytest.approx(-0.0175)
    assert t["loss_pg"] == pytest.approx(0.9975)


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
