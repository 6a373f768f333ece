"""The optimization phase of the loop (grpo_fast.loop.optimization): what it leaves behind for the
rollout, and its statistics."""

import copy
import math
from types import SimpleNamespace

import pytest
import torch

import grpo_fast.train as train_mod
from grpo_fast import dist
from grpo_fast.algo.core import GRPOLossOutput, LossParts
from grpo_fast.config import load_config
from grpo_fast.loop import optimization
from grpo_fast.loop import setup as setup_mod
from grpo_fast.loop.optimization import sequences_with_gradient
from grpo_fast.loop.stats import StepStats


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
    real = setup_mod.make_backend

    def checking_backend(ctx):
        backend = real(ctx)
        generate = backend.generate

        def checked_generate(*a, **k):
            seen.append([p.grad is None for p in ctx.model.parameters()])
            return generate(*a, **k)

        backend.generate = checked_generate
        return backend

    monkeypatch.setattr(setup_mod, "make_backend", checking_backend)
    train_mod.run(_tiny(tmp_path, "train.epochs_per_rollout_batch=2", "sft.steps=5"))
    assert len(seen) == 3  # one rollout per step; the warm start left no gradients either
    assert all(all(step) for step in seen), [sum(not g for g in step) for step in seen]


def test_kl_to_old_is_k3_of_kl_old_to_new():
    """The early-stop estimate of KL(π_old ‖ π) from samples of π_old."""
    stats = StepStats()
    old = torch.tensor([math.log(2), 0.0, -1.0])
    new = torch.tensor([0.0, 0.0, -1.5])
    zero = torch.tensor(0.0)
    out = GRPOLossOutput(
        loss=zero,
        logprobs=new,
        entropy=torch.zeros(3),
        kl=None,
        clipped=torch.zeros(3, dtype=torch.bool),
        log_ratio=new - old,
        parts=LossParts(zero, zero, zero),
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


def test_skipping_zero_advantage_responses_gives_the_same_update(tmp_path):
    """``train.skip_zero_advantage``: the responses of all-equal-reward groups are not run, the
    loss normalizers stay those of the whole batch, so the parameters after the steps equal the
    unskipped run's to fp32 summation order (other shapes, other padding). The reward is the
    response's length in characters (from the random weights, two tokens at most, groups of 4):
    about 30% of the responses are in groups of one length each step (a warm start of 150
    steps and the task's reward did the same in 15 s instead of 3)."""
    import json

    from safetensors.torch import load_file

    finals, skipped = [], []
    for skip in ("true", "false"):
        out = tmp_path / skip
        train_mod.run(
            _tiny(
                out,
                "data.reward=test_pipeline:length_reward",
                "rollout.batch_size=64",
                "rollout.group_size=4",
                "rollout.max_tokens=2",
                "steps=2",
                f"train.skip_zero_advantage={skip}",
            )
        )
        finals.append(load_file(out / "final" / "model.safetensors"))
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        skipped.append([r["train/skipped_fraction"] for r in rows if r["step"] > 0])
    assert all(0 < f < 1 for f in skipped[0]), skipped  # some groups informative, some not
    assert skipped[1] == [0.0, 0.0]
    for name, a in finals[0].items():
        torch.testing.assert_close(a, finals[1][name], rtol=1e-5, atol=1e-6, msg=name)


def test_nothing_informative_still_steps_every_parameter():
    """All advantages 0: one (zero-gradient) response is kept, so each parameter gets a zero
    gradient and the optimizer steps as without the skip."""
    from grpo_fast.policy.batch import Sequence

    cfg = load_config("tiny", check_device=False)
    options = cfg.loss.loss_options()
    seqs = [Sequence([1, 2, 3, 4], 2, 0.0, 0.5), Sequence([1, 2, 3], 2, 0.0, 0.5)]
    assert sequences_with_gradient(cfg, seqs, options) == [seqs[1]]
    mixed = [Sequence([1, 2, 3], 2, 0.7, 0.5), *seqs]
    assert sequences_with_gradient(cfg, mixed, options) == mixed[:1]
    # a KL term or an entropy bonus gives zero-advantage tokens a gradient, the entropy quantile
    # counts them: nothing is skipped (nor when the skip is off)
    assert sequences_with_gradient(cfg, mixed, options.with_beta(0.1)) == mixed
    for key in ("loss.entropy_coef=0.01", "loss.top_entropy_quantile=0.2", "train.skip_zero_advantage=false"):
        other = load_config("tiny", overrides=[key], check_device=False)
        assert sequences_with_gradient(other, mixed, other.loss.loss_options()) == mixed, key


def test_mask_truncated_leaves_truncated_responses_out_of_the_loss(tmp_path, monkeypatch):
    """loss.mask_truncated: every sequence handed to the optimization phase finished by itself
    (when all were cut, one zero-weight response keeps the step's shape), and the run's update
    differs from the unmasked one."""
    import json

    from safetensors.torch import load_file

    seen = []
    real = optimization.make_microbatches
    monkeypatch.setattr(
        optimization, "make_microbatches", lambda seqs, *a, **k: seen.append(len(seqs)) or real(seqs, *a, **k)
    )
    finals = []
    for masked in ("true", "false"):
        seen.clear()
        out = tmp_path / masked
        train_mod.run(
            _tiny(
                out,
                "rollout.max_tokens=2",
                "train.skip_zero_advantage=false",
                "data.reward=test_train_optimization:length_reward",  # a signal in every group
                f"loss.mask_truncated={masked}",
            )
        )
        rows = [
            json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if '"step": 0' not in x
        ]
        truncated = [round(r["train/truncated_fraction"] * 16) for r in rows]  # 16 responses a step
        assert sum(truncated) > 0  # random weights at 2 tokens: some responses are cut
        expected = [max(16 - t, 1) for t in truncated] if masked == "true" else [16] * len(rows)
        assert seen == expected, (masked, seen, truncated)
        finals.append(load_file(out / "final" / "model.safetensors"))
    assert any(not torch.equal(a, finals[1][k]) for k, a in finals[0].items())


def length_reward(response: str, ground_truth: str) -> dict[str, float]:
    return {"reward": float(len(response))}


def _fields(t) -> dict:
    """A trajectory's fields, each copied (tensors cloned), to compare later."""
    return {k: v.clone() if isinstance(v, torch.Tensor) else copy.deepcopy(v) for k, v in vars(t).items()}


def _same(a, b) -> bool:
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    return a == b


def test_the_step_leaves_its_finalized_batch_as_it_was(tmp_path, monkeypatch):
    """After the source's finalize (``Source.batch``), nothing in the step (the sp group's batch,
    the optimization phase's loss weights, publishing, metrics, end of step) changes a trajectory:
    every field of every trajectory reads the same at the end of the step as when it was
    finalized (the trainer sets its loss weights on copies). And the trainer reads the run's one
    live config, not a copy of it."""
    from grpo_fast.loop import step as step_mod

    finalized, checked = {}, []
    share, end = step_mod.sp_group.share_batch, step_mod.end_of_step

    def sharing(run, batch):
        assert run.trainer.cfg is run.cfg
        finalized["batch"] = batch
        finalized["fields"] = [_fields(t) for t in batch.rollout.trajectories]
        return share(run, batch)

    def ending(run, k, batch, *a, **kw):
        out = end(run, k, batch, *a, **kw)
        now = [vars(t) for t in finalized["batch"].rollout.trajectories]
        changed = {k for was, is_ in zip(finalized["fields"], now) for k in was if not _same(was[k], is_[k])}
        checked.append(changed)
        return out

    monkeypatch.setattr(step_mod.sp_group, "share_batch", sharing)
    monkeypatch.setattr(step_mod, "end_of_step", ending)
    train_mod.run(_tiny(tmp_path, "steps=2", "loss.mask_truncated=true", "rollout.max_tokens=3"))
    assert checked == [set(), set()]
