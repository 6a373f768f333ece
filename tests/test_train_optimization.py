"""The optimization phase of the loop (grpo_fast.train): what it leaves behind for the rollout,
and its statistics."""

import math
from types import SimpleNamespace

import pytest
import torch

import grpo_fast.train as train_mod
from grpo_fast import dist
from grpo_fast.config import load_config


def _tiny(tmp_path, *extra):
    return load_config(
        "tiny",
        overrides=[
            f"output_dir={tmp_path}",
            "steps=3",
            "sft.steps=0",
            "eval_every=0",
            "checkpoint_every=0",
            "rollout.batch_size=16",
            "logging.progress=false",
            *extra,
        ],
    )


def test_gradients_are_freed_before_every_rollout(tmp_path, monkeypatch):
    """Every parameter's ``.grad`` is None whenever the rollout backend generates (the gradients
    of the previous step would otherwise sit beside the rollout engine)."""
    seen = []
    real = train_mod.make_backend

    def checking_backend(cfg, model, *args, **kwargs):
        backend = real(cfg, model, *args, **kwargs)
        generate = backend.generate

        def checked_generate(*a, **k):
            seen.append([p.grad is None for p in model.parameters()])
            return generate(*a, **k)

        backend.generate = checked_generate
        return backend

    monkeypatch.setattr(train_mod, "make_backend", checking_backend)
    train_mod.run(_tiny(tmp_path, "train.epochs_per_rollout_batch=2"))
    assert len(seen) == 3  # one rollout per step
    assert all(all(step) for step in seen), [sum(not g for g in step) for step in seen]


def test_kl_to_old_is_k3_of_kl_old_to_new():
    """The early-stop estimate of KL(π_old ‖ π) from samples of π_old."""
    stats = train_mod._Stats()
    old = torch.tensor([math.log(2), 0.0, -1.0])
    new = torch.tensor([0.0, 0.0, -1.5])
    out = SimpleNamespace(
        loss=torch.tensor(0.0),
        logprobs=new,
        entropy=torch.zeros(3),
        clipped=torch.zeros(3, dtype=torch.bool),
        kl=None,
    )
    stats.add(
        out, SimpleNamespace(labels=torch.zeros(3, dtype=torch.long), old_logprobs=old, sampler_logprobs=None)
    )
    # d = log π_old − log π; k3 = e^(−d) − 1 + d:
    #   d = ln 2: 1/2 − 1 + .693147 = .193147;  d = 0: 0;  d = .5: e^(−.5) − 1 + .5 = .106531
    # mean over 3 tokens = (.193147 + .106531) / 3 = .099893 (e^d − d − 1, the other direction, gives .151858)
    expected = (0.5 - 1 + math.log(2) + math.exp(-0.5) - 0.5) / 3
    approx_kl = stats.kl_to_old(dist.DistInfo(), torch.device("cpu"))
    assert approx_kl == pytest.approx(expected, rel=1e-6)
    assert approx_kl == pytest.approx(0.0998927, abs=1e-6)
