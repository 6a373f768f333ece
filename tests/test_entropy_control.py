"""``loss.entropy_target``: the adaptive entropy coefficient (Skywork-OR1; TRL's
``use_adaptive_entropy``). The controller by hand, the gate the loss applies, the config's
checks, the same coefficient on every rank (2 CPU ranks, gloo), and an exact resume."""

from __future__ import annotations

import json
import math
import socket
from types import SimpleNamespace

import pytest
import torch
from support.ranks import join_cpu_ranks, start_ranks

from grpo_fast import dist
from grpo_fast import train as train_mod
from grpo_fast.algo.core import adaptive_entropy_coef, applied_entropy_coef
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop.state import Trainer, TrainState
from grpo_fast.loop.stats import FIELDS, StepStats


def test_controller_by_hand():
    # Δ = 0.005, target 0.5, c_max 0.012, from c = 0.003:
    #   H = 0.40 ≤ 0.5 → 0.008;  H = 0.45 → 0.012 (0.013 capped);  H = 0.50 (= target) → 0.012
    #   H = 0.60 > 0.5 → 0.007;  H = 0.70 → 0.002;  H = 0.80 → 0 (−0.003 floored);  NaN → 0 kept
    c, seen = 0.003, []
    for h in (0.40, 0.45, 0.50, 0.60, 0.70, 0.80, math.nan):
        c = adaptive_entropy_coef(c, h, 0.5, 0.005, 0.012)
        seen.append(c)
    assert seen == pytest.approx([0.008, 0.012, 0.012, 0.007, 0.002, 0.0, 0.0], abs=1e-15)
    # the loss applies c only while the last entropy was at or below the target (none before any)
    assert applied_entropy_coef(0.02, math.inf, 0.5) == 0.0
    assert applied_entropy_coef(0.02, 0.5, 0.5) == 0.02
    assert applied_entropy_coef(0.02, 0.51, 0.5) == 0.0


def _cfg(*overrides):
    return load_config("tiny", overrides=list(overrides))


def test_train_state_steps_the_controller_and_the_run_applies_it():
    cfg = _cfg("loss.entropy_target=0.5", "loss.entropy_coef=0.01", "loss.entropy_coef_step=0.004")
    state = TrainState(entropy_coef=0.01)
    run = SimpleNamespace(cfg=cfg, state=state)
    options = lambda: Trainer.loss_options(run)
    assert options().entropy_coef == 0.0  # before any step: no entropy measured yet
    state.update_entropy_coef(0.3, cfg.loss)  # below the target: 0.01 + 0.004, applied next step
    assert state.entropy_coef == pytest.approx(0.014) and options().entropy_coef == pytest.approx(0.014)
    state.update_entropy_coef(0.9, cfg.loss)  # above: 0.010, and the gate closes
    assert state.entropy_coef == pytest.approx(0.010) and options().entropy_coef == 0.0
    again = TrainState.from_state_dict(state.state_dict())  # what a checkpoint keeps
    assert (again.entropy_coef, again.entropy_last) == (state.entropy_coef, 0.9)
    fresh = TrainState.from_state_dict(TrainState(entropy_coef=0.01).state_dict())
    assert fresh.entropy_last == math.inf
    # without the key the options are loss.* as configured, and no state is kept for it
    off = SimpleNamespace(cfg=_cfg("loss.entropy_coef=0.01"), state=TrainState())
    assert Trainer.loss_options(off).entropy_coef == 0.01 and "entropy_coef" not in TrainState().state_dict()


def test_config_checks():
    assert _cfg().loss.entropy_target is None
    with pytest.raises(ConfigError, match=r"^loss\.entropy_target must be > 0 \(or null\), got 0"):
        _cfg("loss.entropy_target=0")
    with pytest.raises(ConfigError, match=r"^loss\.entropy_coef_step must be > 0"):
        _cfg("loss.entropy_target=0.5", "loss.entropy_coef_step=0")
    with pytest.raises(
        ConfigError, match=r"loss\.entropy_coef=-0\.01, which must be in \[0, loss\.entropy_coef_max=1\]"
    ):
        _cfg("loss.entropy_target=0.5", "loss.entropy_coef=-0.01")
    with pytest.raises(
        ConfigError, match=r"loss\.entropy_coef=0\.2, which must be in \[0, loss\.entropy_coef_max=0\.1\]"
    ):
        _cfg("loss.entropy_target=0.5", "loss.entropy_coef=0.2", "loss.entropy_coef_max=0.1")


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_worker(rank, world_size, port, out_path):
    """Rank 0's tokens have mean entropy 0.2, rank 1's 1.2 (10 tokens each): the global mean 0.7
    is above the target 0.5, so both ranks lower the coefficient, although rank 0 alone would
    raise it. The controller's input is the step's all-reduced totals."""
    world = join_cpu_ranks(rank, world_size, port)
    cfg = _cfg("loss.entropy_target=0.5", "loss.entropy_coef=0.02")
    stats = StepStats()
    stats.sums = {k: torch.zeros(()) for k in FIELDS}
    stats.sums["entropy"], stats.sums["tokens"] = torch.tensor([2.0, 12.0][rank]), torch.tensor(10.0)
    rollout = SimpleNamespace(finish_reason=["stop"] * 2, sampler_logprobs=None, trajectories=[])
    meta = {"zero_variance_groups": 0.0, "num_groups": 1.0}
    totals = stats.global_totals(world, torch.device("cpu"), torch.tensor([1.0, 0.0]), rollout, meta)
    state = TrainState(entropy_coef=0.02)
    state.update_entropy_coef(totals["entropy"], cfg.loss)
    gathered = dist.all_gather_objects((totals["entropy"], state.entropy_coef))
    if rank == 0:
        torch.save(gathered, out_path)
    dist.shutdown()


def test_every_rank_steps_the_same_coefficient(tmp_path):
    out = tmp_path / "ranks.pt"
    start_ranks(_rank_worker, args=(2, _free_port(), str(out)), nprocs=2, join=True)
    (h0, c0), (h1, c1) = torch.load(out)
    assert h0 == h1 == pytest.approx(0.7)
    assert c0 == c1 == pytest.approx(0.015)  # 0.02 − 0.005: above the target on both ranks


QUICK = ["sft.steps=0", "eval_every=0", "rollout.batch_size=16", "logging.progress=false",
         "logging.sample_every=0", "checkpoint_every=2", "train.lr=2e-3"]  # fmt: skip
ON = ["loss.entropy_target=5.0", "loss.entropy_coef=0.0", "loss.entropy_coef_step=0.01"]


def _rows(out):
    skip = ("time/", "throughput/", "memory/", "gpu/")
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [{k: v for k, v in json.loads(x).items() if not k.startswith(skip)} for x in lines if x.strip()]


@pytest.mark.slow
def test_the_coefficient_enters_the_loss_and_resumes_exactly(tmp_path):
    """Target 5 nats (above any tiny-task entropy): the coefficient rises by 0.01 a step from 0,
    is applied from step 2 on (``train/loss_entropy`` = −c·Σ w·H ≠ 0), and a run stopped after
    step 2 and resumed logs the straight run's metrics exactly (the coefficient and the last
    entropy come back from the checkpoint)."""
    straight, split = tmp_path / "straight", tmp_path / "split"
    train_mod.run(_cfg(*QUICK, *ON, "steps=4", f"output_dir={straight}"))
    train_mod.run(_cfg(*QUICK, *ON, "steps=2", f"output_dir={split}"))
    train_mod.run(_cfg(*QUICK, *ON, "steps=4", "resume=true", f"output_dir={split}"))
    a, b = _rows(straight), _rows(split)
    assert [r["step"] for r in a] == [r["step"] for r in b] == [1, 2, 3, 4]
    assert a == b
    assert [r["train/entropy_coef"] for r in a] == pytest.approx([0.01, 0.02, 0.03, 0.04])
    assert a[0]["train/loss_entropy"] == 0.0  # step 1: no entropy measured before it
    for r, c in zip(a[1:], (0.01, 0.02, 0.03)):  # applied: the coefficient after the previous step
        # −c·Σ w·H, Σ w·H the per-sequence mean entropy: near the per-token mean (≈ 3.5 tokens each)
        assert -r["train/loss_entropy"] / c == pytest.approx(r["train/entropy_mean"], rel=0.3)
    plain = _rows_of_plain_run(tmp_path)
    assert "train/entropy_coef" not in plain[0] and plain[1]["train/loss_entropy"] == 0.0


def _rows_of_plain_run(tmp_path):
    out = tmp_path / "plain"
    train_mod.run(_cfg(*QUICK, "steps=2", f"output_dir={out}"))
    return _rows(out)
