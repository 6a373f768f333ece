"""The value model of ``loss.advantage=gae`` (grpo_fast/policy/value.py): the clipped value loss
against float64, the head's gradient into the shared layers, the head in the loss module; then in
a run: the advantages and targets each step computes, the critic keys, the warm-up, an exact
resume. Two ranks against one: tests/test_distributed.py."""

import json

import pytest
import torch

from grpo_fast.algo.advantages import compute_gae, whiten_over_batch
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.policy.batch import Sequence, make_microbatches
from grpo_fast.policy.loss import PolicyLoss, response_hidden_states
from grpo_fast.policy.value import ValueHead, clipped_value_loss
from grpo_fast.task import tiny
from grpo_fast.task.rewards import register_reward


def test_clipped_value_loss_equals_its_definition():
    g = torch.Generator().manual_seed(0)
    v, r, old, w = (torch.randn(50, generator=g) for _ in range(4))
    w = w.abs()
    for clip in (None, 0.2, 1.0):
        loss, clipped = clipped_value_loss(v, r, old, w, clip)
        v64, r64, o64, w64 = v.double(), r.double(), old.double(), w.double()
        plain = (v64 - r64) ** 2
        moved = plain if clip is None else (o64 + (v64 - o64).clamp(-clip, clip) - r64) ** 2
        want = 0.5 * (w64 * torch.maximum(plain, moved)).sum()
        assert loss.item() == pytest.approx(want.item(), rel=1e-6)
        held = (v64 - o64).abs() > (clip if clip is not None else float("inf"))
        assert clipped.tolist() == (held & (moved > plain)).tolist()
    assert 0 < int(clipped_value_loss(v, r, old, w, 0.2)[1].sum()) < 50  # both branches occur here
    # the docstring's case: V = 1, V_old = 0, R = 2, c = 0.2 -> ½·1.8² = 1.62, gradient 0
    v1 = torch.tensor([1.0], requires_grad=True)
    loss, clipped = clipped_value_loss(v1, torch.tensor([2.0]), torch.tensor([0.0]), torch.tensor([1.0]), 0.2)
    loss.backward()
    assert loss.item() == pytest.approx(1.62) and clipped.item() and v1.grad.item() == 0


@pytest.mark.parametrize("coef", [0.0, 0.3, 1.0])
def test_trunk_coef_scales_the_gradient_into_the_hidden_states(coef):
    head = ValueHead(4)
    torch.nn.init.normal_(head.proj.weight, generator=torch.Generator().manual_seed(1))
    hidden = torch.randn(6, 4, requires_grad=True)
    values = head(hidden, coef)
    torch.testing.assert_close(values, hidden.detach() @ head.proj.weight[0] + head.proj.bias)
    values.sum().backward()
    if coef == 0:
        assert hidden.grad is None  # detached: the shared layers get nothing
    else:
        torch.testing.assert_close(hidden.grad, coef * head.proj.weight.detach().expand(6, 4))
    assert head.proj.weight.grad is not None  # the head learns whatever coef


def test_the_loss_module_gives_the_head_the_response_positions():
    """``PolicyLoss`` with a head: values of the positions before each sampled token (the hidden
    states the fused op reads); the value loss only for a microbatch with targets, apart from the
    policy's loss (``train/loss`` stays the policy's)."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    head = ValueHead(model.config.hidden_size)
    torch.nn.init.normal_(head.proj.weight, generator=torch.Generator().manual_seed(2))
    loss_mod = PolicyLoss(model, autocast=None, backend="torch_chunked")
    plain = loss_mod(_mb(tok), LossOptions(), 1.0)
    loss_mod.attach_value_head(head, trunk_coef=0.0, value_clip=0.2)
    mb = _mb(tok)
    out = loss_mod(mb, LossOptions(), 1.0)
    assert out.value_loss is None and out.loss.item() == plain.loss.item()
    with torch.no_grad():
        want = head(response_hidden_states(model, mb), 0.0)
    torch.testing.assert_close(out.values, want)
    mb.returns, mb.old_values = torch.ones_like(mb.advantages), torch.zeros_like(mb.advantages)
    out = loss_mod(mb, LossOptions(), 1.0)
    want_loss, _ = clipped_value_loss(want, mb.returns, mb.old_values, mb.loss_weights, 0.2)
    assert out.value_loss.item() == pytest.approx(want_loss.item(), rel=1e-6)
    assert out.loss.item() == plain.loss.item()


def _mb(tok):
    seqs = [Sequence([5, 6, 7, 8, 9], 2, 1.0, 0.25), Sequence([6, 7, 10, 11], 1, -0.5, 0.25)]
    return make_microbatches(seqs, micro_batch_size=2, pad_id=tok.pad_token_id, packing=False)[0]


# ------------------------------------------------------------------------------------ in a run


@register_reward("test_value_odd_first_digit")
def _odd_first_digit(response: str, ground_truth: str) -> dict[str, float]:
    """A reward an untrained tiny model earns about half the time: varied rewards from step 1."""
    return {"reward": float(response[:1] in ("1", "3", "5", "7", "9"))}


QUICK = ["steps=3", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=16", "logging.progress=false",
         "logging.sample_every=0", "sft.steps=0", "data.reward=test_value_odd_first_digit", "loss.advantage=gae"]  # fmt: skip


def _run(tmp_path, *extra):
    """A short in-process run with the value model: (its metrics rows, its final weights)."""
    from safetensors.torch import load_file

    from grpo_fast import train as train_mod

    cfg = load_config("tiny", overrides=[*QUICK, f"output_dir={tmp_path}", *extra])
    train_mod.run(cfg)
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    return rows, load_file(tmp_path / "final" / "model.safetensors")


@pytest.fixture
def finalized(monkeypatch):
    """Every step's finalized batch and the value head's state when it was finalized."""
    from grpo_fast.loop import pipeline, rollout_phase

    batches, real = [], rollout_phase.finalize

    def finalize(run, *args, **kwargs):
        batch = real(run, *args, **kwargs)
        head = {k: v.clone() for k, v in run.trainer.value_head.state_dict().items()}
        batches.append((batch, run.cfg, head))
        return batch

    monkeypatch.setattr(rollout_phase, "finalize", finalize)
    monkeypatch.setattr(pipeline, "finalize", finalize)  # the pipeline's outline calls it too
    return batches


def _expected(batch, cfg):
    """Each response's ``[S]`` advantages and targets from the batch's rewards and the values the
    trajectories carry, by the public functions (module docstring of rollout_phase)."""
    trajectories = batch.rollout.trajectories
    n = torch.tensor([t.num_sampled for t in trajectories])
    mask = torch.arange(int(n.max()))[None] < n[:, None]
    rewards, values = torch.zeros(mask.shape), torch.zeros(mask.shape)
    for i, t in enumerate(trajectories):
        rewards[i, t.num_sampled - 1] = batch.raw_rewards[i]
        values[i, : t.num_sampled] = t.token_values
    c = cfg.critic
    lam = c.policy_lam if c.lam_alpha is None else (1 - 1 / (c.lam_alpha * n.float())).clamp(min=0)
    adv = compute_gae(rewards, values, mask, cfg.loss.gamma, lam)[0]
    adv = whiten_over_batch(adv, mask) if c.whiten_advantages else adv
    _, ret = compute_gae(rewards, values, mask, cfg.loss.gamma, c.lam)
    return [adv[i, :k] for i, k in enumerate(n.tolist())], [ret[i, :k] for i, k in enumerate(n.tolist())]


@pytest.mark.parametrize("outline", ["lockstep", "staleness_1"])
def test_each_step_trains_on_gae_of_the_value_heads_values(tmp_path, finalized, outline):
    """Every step, in lockstep and in the pipeline (``rollout.max_staleness=1``: responses of the
    weights one step older, the values of the head when the batch is finalized): the trajectories
    carry the value head's values (zero at the first: a zero-initialized head), the whitened GAE
    advantages (λ = critic.policy_lam) and the targets (λ = critic.lam) computed from them; the
    head learns (its values move); the metrics report it."""
    pipelined = (
        ["rollout.max_staleness=1", "rollout.old_logprobs=sampler"] if outline == "staleness_1" else []
    )
    rows, _ = _run(tmp_path, "critic.lr=0.05", *pipelined)
    assert len(finalized) == 3
    for step, (batch, cfg, _) in enumerate(finalized):
        values = torch.cat([t.token_values for t in batch.rollout.trajectories])
        assert (values == 0).all() if step == 0 else values.abs().max() > 0
        adv, ret = _expected(batch, cfg)
        for t, a, r in zip(batch.rollout.trajectories, adv, ret):
            torch.testing.assert_close(t.token_advantages, a, rtol=1e-5, atol=1e-6)
            torch.testing.assert_close(t.token_returns, r, rtol=1e-5, atol=1e-6)
    assert all(r["train/value_loss"] > 0 for r in rows)
    assert {"rollout/value_mean", "rollout/return_mean", "train/value_clip_fraction"} <= set(rows[-1])


@pytest.mark.parametrize(
    ("key", "context"),
    [("critic.lr=0.5", ()), ("critic.trunk_coef=1.0", ()), ("critic.lam=0.5", ()),
     ("critic.policy_lam=0.5", ()), ("critic.lam_alpha=0.3", ()), ("loss.gamma=0.5", ()),
     ("critic.whiten_advantages=false", ()),
     # the clip acts from the second epoch on (the first starts at the values it is centred on)
     ("critic.value_clip=0.001", ("train.epochs_per_rollout_batch=2",))],
)  # fmt: skip
def test_each_critic_key_changes_the_run(tmp_path, key, context, finalized):
    """Against the defaults (with ``critic.lr=0.05`` so that the head moves within 3 steps): the
    final weights differ, so do the last step's targets or value loss, and the advantages and
    targets are still the formula's for that key's value."""
    base_rows, base_w = _run(tmp_path / "base", "critic.lr=0.05", *context)
    base = finalized[-1][0]
    finalized.clear()
    rows, w = _run(tmp_path / "new", "critic.lr=0.05", *context, key)
    batch, cfg, _ = finalized[-1]
    adv, ret = _expected(batch, cfg)
    for t, a, r in zip(batch.rollout.trajectories, adv, ret):
        torch.testing.assert_close(t.token_advantages, a, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(t.token_returns, r, rtol=1e-5, atol=1e-6)
    changed_weights = any(not torch.equal(w[k], base_w[k]) for k in w)
    targets = lambda b: torch.cat([t.token_returns for t in b.rollout.trajectories])
    changed_targets = not torch.equal(targets(batch), targets(base))
    changed_values = rows[-1]["train/value_loss"] != base_rows[-1]["train/value_loss"]
    assert changed_weights and (changed_targets or changed_values), key


def test_warmup_steps_train_the_value_head_alone(tmp_path, finalized):
    """``critic.warmup_steps=2``: after step 2 the policy's weights are the initial ones, bitwise
    (no AdamW step either: no weight decay), while the head moved at each step; step 3 moves the
    policy."""
    from safetensors.torch import load_file

    _, final = _run(tmp_path, "critic.lr=0.05", "critic.warmup_steps=2", "checkpoint_every=1")
    start = tiny.build_model(tiny.build_tokenizer(), seed=0).state_dict()
    w = load_file(tmp_path / "checkpoints" / "step_000002" / "model.safetensors")
    assert all(torch.equal(w[k], start[k]) for k in w)
    assert any(not torch.equal(final[k], start[k]) for k in final)
    heads = [h["proj.weight"] for _, _, h in finalized]  # the head at steps 1, 2, 3's finalize
    assert not torch.equal(heads[0], heads[1]) and not torch.equal(heads[1], heads[2])


def test_resume_with_the_value_model_logs_the_straight_runs_metrics(tmp_path):
    """Stopped after step 2 (its checkpoint: the weights, the value head, AdamW's state for both),
    resumed for step 3: the same metrics as the straight run, bitwise (time and memory aside)."""
    import shutil

    straight, _ = _run(tmp_path / "straight", "critic.lr=0.05", "checkpoint_every=2")
    part = tmp_path / "part"
    _run(part, "critic.lr=0.05", "checkpoint_every=2", "steps=2")
    shutil.rmtree(part / "final")
    resumed, _ = _run(part, "critic.lr=0.05", "checkpoint_every=2", "resume=true")
    keep = lambda r: {k: v for k, v in r.items() if not k.startswith(("time/", "memory/", "throughput/"))}
    assert [keep(r) for r in resumed] == [keep(r) for r in straight]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["critic.lr=0.1"], r"critic\.lr configures the value model of loss\.advantage=gae; loss\.advantage=group has none"),
        (["loss.advantage=gae", "critic.value_clip=0"], r"critic\.value_clip must be > 0"),
        (["loss.advantage=gae", "critic.lam=1.5"], r"critic\.lam must be in \[0, 1\]"),
        (["loss.advantage=gae", "loss.scale_rewards=none"], r"loss\.advantage=gae whitens its per-token returns"),
    ],
)  # fmt: skip
def test_bad_critic_settings_are_one_line(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides=overrides)
