"""Sweep planning (the exact commands), the CLI's dry run and errors, sequential running with
stand-in commands, and the combined plots on synthetic metrics; one test trains the baseline
sweep's runs (in-process, two steps on the tiny preset) to check that they differ."""

import json
import shlex
import sys

import pytest
import torch

from grpo_fast.algo.core import LENGTH_NORMS
from grpo_fast.errors import ConfigError
from grpo_fast.obs.sweep import LRGrid, SweepRun, main, plan_sweep, run_sweep, summarize_sweep
from grpo_fast.task.rewards import register_reward

PY = sys.executable


def test_lr_grid_is_log_spaced():
    # 1e-6 · (1e-4 / 1e-6)^(i/2) = 1e-6, 1e-5, 1e-4
    assert LRGrid(1e-6, 1e-4, 3).values() == pytest.approx([1e-6, 1e-5, 1e-4])
    assert [f"{v:.3g}" for v in LRGrid().values()] == ["1e-06", "3.16e-06", "1e-05", "3.16e-05", "0.0001"]
    assert LRGrid(2e-5, 2e-5, 1).values() == [2e-5]
    with pytest.raises(ConfigError, match="lr grid"):
        LRGrid(1e-4, 1e-6).values()


def test_plan_lr_sweep_commands(tmp_path):
    runs = plan_sweep(
        "qwen_math", "lr", configs=["a.yaml", "b.yaml"], overrides=["steps=50"], out=tmp_path, python="python"
    )
    assert [r.name for r in runs] == ["lr_1e-06", "lr_3.16e-06", "lr_1e-05", "lr_3.16e-05", "lr_0.0001"]
    assert runs[1].command == (
        "python", "-m", "grpo_fast.train", "--preset", "qwen_math", "--config", "a.yaml", "--config", "b.yaml",
        "steps=50", "train.lr=3.16e-06", f"output_dir={tmp_path / 'lr_3.16e-06'}",
    )  # fmt: skip
    assert runs[1].out_dir == tmp_path / "lr_3.16e-06"


def test_plan_defaults_and_given_values():
    assert [r.value for r in plan_sweep("p", "baseline")] == ["no_baseline", "reinforce_with_baseline"]
    assert [r.value for r in plan_sweep("p", "length_norm")] == list(LENGTH_NORMS)
    runs = plan_sweep("p", "baseline", ["grpo_clip"])
    assert runs[0].command[-2:] == (
        "loss.type=grpo_clip",
        "output_dir=runs/sweep_baseline/baseline_grpo_clip",
    )
    assert [r.value for r in plan_sweep("p", "lr", ["3e-5", "0.0001"])] == ["3e-05", "0.0001"]


def test_plan_the_rollout_side_sweeps():
    """The issue-13 ablations: each option off, then on (a 0 that means off is a valid value)."""
    planned = {
        sweep: [r.command[-2] for r in plan_sweep("tiny", sweep)]
        for sweep in ("dynamic_sampling", "curriculum", "adaptive_group_size", "overlong_buffer", "sft_mix")
    }
    assert planned == {
        "dynamic_sampling": ["rollout.dynamic_sampling=false", "rollout.dynamic_sampling=true"],
        "curriculum": [
            "rollout.curriculum=none",
            "rollout.curriculum=easy_first",
            "rollout.curriculum=paced",
        ],
        "adaptive_group_size": ["rollout.adaptive_group_size=false", "rollout.adaptive_group_size=true"],
        "overlong_buffer": ["data.overlong_buffer=0", "data.overlong_buffer=2"],
        "sft_mix": ["sft.mix_coef=0", "sft.mix_coef=0.1"],
    }
    with pytest.raises(ConfigError, match=r"'-1' is not a number >= 0 for sft\.mix_coef \(sft_mix sweep\)"):
        plan_sweep("tiny", "sft_mix", ["-1"])
    with pytest.raises(ConfigError, match=r"'yes' is not a rollout\.dynamic_sampling"):
        plan_sweep("tiny", "dynamic_sampling", ["yes"])


def test_difficulty_filter_sweep_takes_bands():
    """``[lo,hi]`` values (written back with %g numbers) or null; a bad band is one line."""
    runs = plan_sweep("tiny", "difficulty_filter")
    assert [r.command[-2] for r in runs] == [
        "rollout.difficulty_filter=null",
        "rollout.difficulty_filter=[0,0.9]",
    ]
    assert [r.command[-2] for r in plan_sweep("tiny", "difficulty_filter", ["[0.10, 0.80]"])] == [
        "rollout.difficulty_filter=[0.1,0.8]"
    ]
    from grpo_fast.config import load_config

    assert runs[1].name == "difficulty_filter_0-0.9"  # a plain folder name
    cfg = load_config("tiny", overrides=list(runs[1].command[-2:]))  # the planned command is a valid config
    assert list(cfg.rollout.difficulty_filter) == [0.0, 0.9]
    for bad in ("0.9", "[0.9,0.1]", "[0,2]", "[a,b]"):
        with pytest.raises(
            ConfigError, match=r"is not \[lo,hi\] with 0 <= lo <= hi <= 1 for rollout\.difficulty_filter"
        ):
            plan_sweep("tiny", "difficulty_filter", [bad])


@pytest.mark.parametrize(
    ("sweep", "values", "overrides", "match"),
    [
        ("kl", None, (), "unknown sweep 'kl': choose one of lr, baseline, length_norm"),
        ("lr", ["fast"], (), "'fast' is not a positive learning rate"),
        ("lr", ["-1e-5"], (), "'-1e-5' is not a positive learning rate"),
        ("lr", ["1e-5", "0.00001"], (), "repeats 1e-05"),
        (
            "length_norm",
            ["mean"],
            (),
            "'mean' is not a loss.length_norm .*sequence_mean, constant, token_mean",
        ),
        ("baseline", None, ["loss.type=grpo_clip"], "sets loss.type, the key this sweep varies"),
        ("baseline", None, ["output_dir=x"], "use --out"),
        ("baseline", None, ["steps"], "'steps' is not key=value"),
    ],
)
def test_plan_errors(sweep, values, overrides, match):
    with pytest.raises(ConfigError, match=match):
        plan_sweep("p", sweep, values, overrides=overrides)


def test_cli_dry_run_prints_the_commands(capsys, tmp_path):
    # overrides may come anywhere, even after --values
    argv = [
        "--preset",
        "tiny",
        "steps=3",
        "--sweep",
        "baseline",
        "--values",
        "grpo_clip",
        "rollout.temperature=0.7",
    ]
    assert main([*argv, "--out", str(tmp_path), "--dry-run"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [shlex.split(line)[1:] for line in lines] == [
        ["-m", "grpo_fast.train", "--preset", "tiny", "steps=3", "rollout.temperature=0.7", "loss.type=grpo_clip",
         f"output_dir={tmp_path / 'baseline_grpo_clip'}"],
    ]  # fmt: skip
    assert not list(tmp_path.iterdir())  # nothing ran, nothing written


def test_cli_lr_grid_options(capsys):
    assert (
        main(["--preset", "p", "--sweep", "lr", "--lr-range", "1e-5", "1e-3", "--num", "3", "--dry-run"]) == 0
    )
    assert [line.split()[-2] for line in capsys.readouterr().out.splitlines()] == [
        "train.lr=1e-05",
        "train.lr=0.0001",
        "train.lr=0.001",
    ]


@pytest.mark.parametrize(
    "argv",
    [
        ["--sweep", "baseline", "--num", "3"],
        ["--sweep", "lr", "--values", "1e-5", "--lr-range", "1e-6", "1e-4"],
        ["--sweep", "length_norm", "--values", "sum"],
    ],
    ids=["grid-on-baseline", "grid-and-values", "bad-value"],
)
def test_cli_errors_exit_2_with_one_line(capsys, argv):
    assert main(["--preset", "p", *argv, "--dry-run"]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ")


# ----------------------------------------------------------------------------------------------
# Running (stand-in commands) and plotting
# ----------------------------------------------------------------------------------------------


def write_metrics(run_dir, reward_slope, accuracies):
    run_dir.mkdir(parents=True, exist_ok=True)
    rows = []
    for step in range(20):
        row = {
            "step": step,
            "train/reward_mean": reward_slope * step,
            "train/entropy_mean": 2.0 - 0.05 * step,
        }
        if step % 5 == 0:
            row["eval/accuracy"] = accuracies[step // 5]
        rows.append(row)
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


def test_run_sweep_runs_in_order_and_keeps_going_after_a_failure(tmp_path, capsys):
    log = tmp_path / "order.txt"
    append = "import sys; open(sys.argv[1], 'a').write(sys.argv[2])"
    runs = [
        SweepRun("a", "1", tmp_path / "a", (PY, "-c", append, str(log), "a")),
        SweepRun("b", "2", tmp_path / "b", (PY, "-c", "raise SystemExit(3)")),
        SweepRun("c", "3", tmp_path / "c", (PY, "-c", append, str(log), "c")),
    ]
    assert run_sweep(runs) == {"a": 0, "b": 3, "c": 0}
    assert log.read_text() == "ac"
    assert "[sweep 2/3] b failed with exit code 3" in capsys.readouterr().out


def test_summarize_plots_runs_together(tmp_path):
    runs = plan_sweep("p", "lr", ["1e-6", "1e-5", "1e-4"], out=tmp_path)
    write_metrics(runs[0].out_dir, 0.01, [0.1, 0.2, 0.25, 0.3])
    write_metrics(runs[1].out_dir, 0.03, [0.1, 0.4, 0.35, 0.5])  # runs[2] never produced metrics
    md = summarize_sweep("lr", runs, tmp_path, codes={"lr_1e-06": 0, "lr_1e-05": 0, "lr_0.0001": 1})
    for name in ("sweep_reward", "sweep_eval_accuracy", "sweep_entropy", "sweep_lr"):
        png = (tmp_path / f"{name}.png").read_bytes()
        assert png.startswith(b"\x89PNG") and len(png) > 5_000, name
    text = md.read_text(encoding="utf-8")
    # final reward 0.03 · 19 = 0.57; best eval 0.5 at step 15
    assert "| lr_1e-05 | 1e-05 | exit 0 | 0.57 | 0.5 | 0.5 (step 15) |" in text
    assert "| lr_0.0001 | 0.0001 | exit 1 | – | – | – |" in text
    assert "lr_0.0001: " in text and "no metrics file" in text
    assert "![Train reward](sweep_reward.png)" in text


def test_cli_plot_only(tmp_path, capsys):
    runs = plan_sweep("p", "length_norm", out=tmp_path)
    for i, run in enumerate(runs):
        write_metrics(run.out_dir, 0.01 * (i + 1), [0.1, 0.2, 0.3, 0.4])
    assert main(["--preset", "p", "--sweep", "length_norm", "--out", str(tmp_path), "--plot-only"]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "sweep.md")
    assert (tmp_path / "sweep_entropy.png").stat().st_size > 0
    assert not (tmp_path / "sweep_lr.png").exists()  # only for lr sweeps


@register_reward("test_sweep_odd_first_digit")
def _odd_first_digit(response: str, ground_truth: str) -> dict[str, float]:
    """A reward an untrained tiny model earns about half the time: varied rewards at step 1."""
    return {"reward": float(response[:1] in ("1", "3", "5", "7", "9"))}


def test_baseline_sweep_runs_differ(tmp_path):
    """The baseline sweep's commands, run in-process for two steps: the same first rollout, then
    different losses and different weights. Sequence-mean weights sum to 1/B per sequence and the
    ratio is 1 (on-policy), so the step-1 loss is −mean(A): −mean(reward) for ``no_baseline``
    (A = the raw reward), and 0 for ``reinforce_with_baseline`` (A sums to 0 within each group)."""
    from safetensors.torch import load_file

    from grpo_fast.config import load_config
    from grpo_fast.obs.report import read_metrics
    from grpo_fast.train import parse_args, run

    quick = ["steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=32",
             "data.reward=test_sweep_odd_first_digit", "logging.progress=false", "logging.sample_every=0"]  # fmt: skip
    runs = plan_sweep("tiny", "baseline", overrides=quick, out=tmp_path)
    assert [r.value for r in runs] == ["no_baseline", "reinforce_with_baseline"]
    first, weights = {}, {}
    for r in runs:
        args = parse_args(list(r.command[3:]))  # what `python -m grpo_fast.train` would parse
        run(load_config(args.preset, args.config, args.overrides))
        first[r.value] = read_metrics(r.out_dir / "metrics.jsonl")[0]
        weights[r.value] = load_file(r.out_dir / "final" / "model.safetensors")
    none, base = first["no_baseline"], first["reinforce_with_baseline"]
    assert none["step"] == base["step"] == 1
    assert none["train/reward_mean"] == base["train/reward_mean"] > 0  # the same first rollout
    assert none["train/loss"] == pytest.approx(-none["train/reward_mean"], rel=1e-5)
    assert base["train/loss"] == pytest.approx(0.0, abs=1e-6)
    same = [
        k for k, w in weights["no_baseline"].items() if torch.equal(w, weights["reinforce_with_baseline"][k])
    ]
    assert not same, f"tensors equal after two steps: {same}"


def _run_sweep_in_process(sweep, tmp_path, values=None, extra=()):
    """Each run of ``sweep`` for two steps on the tiny preset, in-process: ``{value: (first metrics
    row, final weights)}``."""
    from safetensors.torch import load_file

    from grpo_fast.config import load_config
    from grpo_fast.obs.report import read_metrics
    from grpo_fast.train import parse_args, run

    quick = ["steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "rollout.batch_size=32",
             "data.reward=test_sweep_odd_first_digit", "logging.progress=false", "logging.sample_every=0",
             *extra]  # fmt: skip
    out = {}
    for r in plan_sweep("tiny", sweep, values, overrides=quick, out=tmp_path):
        args = parse_args(list(r.command[3:]))
        run(load_config(args.preset, args.config, args.overrides))
        out[r.value] = (
            read_metrics(r.out_dir / "metrics.jsonl")[0],
            load_file(r.out_dir / "final" / "model.safetensors"),
        )
    return out


def test_scale_rewards_sweep_runs_differ(tmp_path):
    """``batch`` divides every advantage by one number, the batch's reward std (+1e-6), so its
    step-1 gradient is ``none``'s divided by it: grad_norm(none) = grad_norm(batch)·(std + 1e-6),
    with ``train/reward_std`` the same unbiased std of the same first rollout. ``group`` divides
    each group by its own std: a different direction, different weights."""
    runs = _run_sweep_in_process("scale_rewards", tmp_path)
    assert list(runs) == ["group", "batch", "none"]
    (group, w_group), (batch, w_batch), (none, w_none) = runs.values()
    assert group["train/reward_mean"] == batch["train/reward_mean"] == none["train/reward_mean"] > 0
    std = batch["train/reward_std"]
    assert 0 < std < 1
    assert none["train/grad_norm"] == pytest.approx(batch["train/grad_norm"] * (std + 1e-6), rel=1e-4)
    assert group["train/grad_norm"] != pytest.approx(none["train/grad_norm"], rel=1e-3)
    for a, b in ((w_group, w_none), (w_group, w_batch)):
        assert any(not torch.equal(a[k], b[k]) for k in a)


def test_loss_type_sweep_cispo_on_and_off_policy(tmp_path):
    """On-policy CISPO's gradient is grpo_clip's (ŵ = r = 1: −A·∇log π) but its loss is
    −Σ w·A·log π, not −Σ w·A = 0; with a second epoch and a tiny clip range (ε = 0.001) the
    second epoch clips nearly every token: grpo_clip cuts their gradient, CISPO keeps it."""
    on = _run_sweep_in_process("loss_type", tmp_path / "on")
    assert list(on) == ["grpo_clip", "cispo"]
    (clip, w_clip), (cispo, w_cispo) = on.values()
    assert clip["train/loss"] == pytest.approx(0.0, abs=1e-6) and abs(cispo["train/loss"]) > 1e-3
    assert clip["train/grad_norm"] == pytest.approx(cispo["train/grad_norm"], rel=1e-6)
    off = _run_sweep_in_process(
        "loss_type", tmp_path / "off",
        extra=["train.epochs_per_rollout_batch=2", "loss.clip_low=0.001", "loss.clip_high=0.001"],
    )  # fmt: skip
    (_, w_clip), (_, w_cispo) = off.values()
    assert any(not torch.equal(w_clip[k], w_cispo[k]) for k in w_clip)


def _record_loss_calls(monkeypatch) -> list:
    """Patch the loss module to keep ``(options, output, microbatch)`` of every training call."""
    from grpo_fast.policy import loss as loss_mod

    calls = []
    real = loss_mod.PolicyLoss.forward

    def recording(self, mb, options, temperature):
        out = real(self, mb, options, temperature)
        if torch.is_grad_enabled():
            calls.append((options, out, mb))
        return out

    monkeypatch.setattr(loss_mod.PolicyLoss, "forward", recording)
    return calls


def _plain_row_loss(out, mb, **options):
    """tests/loss_reference.py's plain loss of a training call's own per-token inputs (its
    log-probs, entropies, advantages, weights, π_old), with ``options``."""
    from loss_reference import PlainOptions, plain_row_loss

    old = None if mb.old_logprobs is None else mb.old_logprobs.tolist()
    return plain_row_loss(
        out.logprobs.detach().tolist(), out.entropy.detach().tolist(), mb.advantages.tolist(),
        mb.loss_weights.tolist(), PlainOptions(**options), old_logprobs=old,
    )  # fmt: skip


def _loss_size(plain, mb) -> float:
    return sum(abs(w * x) for w, x in zip(mb.loss_weights.tolist(), plain.per_token))


def test_delta_sweep_caps_the_second_epoch(tmp_path, monkeypatch):
    """With two epochs the second sees ratios ≠ 1; δ = 1.01 caps every r > 1.01 (no gradient
    there): each training call of the capped run has the loss and clipped tokens of the plain
    reference (tests/loss_reference.py) with δ = 1.01 on its own inputs, not those without, so
    its weights differ from the uncapped run's; and the sweep's values parse."""
    calls = _record_loss_calls(monkeypatch)
    runs = _run_sweep_in_process(
        "delta", tmp_path, values=["null", "1.01"], extra=["train.epochs_per_rollout_batch=2"]
    )
    (_, w_none), (_, w_capped) = runs.values()
    assert any(not torch.equal(w_none[k], w_capped[k]) for k in w_none)
    capped = [(out, mb) for options, out, mb in calls if options.delta == 1.01]
    assert len(capped) == len(calls) // 2 == 4  # 2 steps × 2 epochs, one microbatch each
    bites = 0
    for out, mb in capped:
        plain = _plain_row_loss(out, mb, delta=1.01)
        assert out.loss.item() == pytest.approx(plain.loss, abs=1e-6 * _loss_size(plain, mb))
        assert out.clipped.tolist() == plain.clipped
        uncapped = _plain_row_loss(out, mb)
        bites += abs(uncapped.loss - plain.loss) > 1e-4 * _loss_size(plain, mb)
    assert bites >= 1  # the cap changed the loss of at least one second epoch
    assert [r.value for r in plan_sweep("tiny", "delta", out=tmp_path)] == ["null", "1.5", "3"]
    with pytest.raises(ConfigError, match=r"'big' is not a positive number for loss\.delta"):
        plan_sweep("tiny", "delta", ["big"], out=tmp_path)


def test_importance_sampling_level_sweep_gspo(tmp_path):
    """GSPO end to end: on-policy (one epoch) its step-1 gradient is sequence-mean GRPO's (the
    tiny preset's length norm), so grad norms agree; with configs/gspo.yaml's second epoch and
    tiny sequence clip range the runs' weights differ."""
    on = _run_sweep_in_process("importance_sampling_level", tmp_path / "on")
    assert list(on) == ["token", "sequence"]
    (tok, _), (seq, _) = on.values()
    assert seq["train/grad_norm"] == pytest.approx(tok["train/grad_norm"], rel=1e-4)
    off = _run_sweep_in_process(
        "importance_sampling_level", tmp_path / "off",
        extra=["train.epochs_per_rollout_batch=2", "loss.clip_low=3e-4", "loss.clip_high=4e-4"],
    )  # fmt: skip
    (_, w_tok), (_, w_seq) = off.values()
    assert any(not torch.equal(w_tok[k], w_seq[k]) for k in w_tok)


def test_top_entropy_quantile_sweep(tmp_path, monkeypatch):
    """ρ = 0.2 trains on the top-20%-entropy tokens only: each training call's threshold is the
    0.8-quantile of its weighted tokens' entropies and its loss the plain reference's with ρ = 0.2
    on its own inputs (tests/loss_reference.py), the logged threshold is the call's (0 when off),
    and the weights differ from ρ = 1's."""
    calls = _record_loss_calls(monkeypatch)
    runs = _run_sweep_in_process("top_entropy_quantile", tmp_path)
    assert list(runs) == ["1", "0.2"]
    (full, w_full), (top, w_top) = runs.values()
    assert full["train/entropy_threshold"] == 0.0
    assert any(not torch.equal(w_full[k], w_top[k]) for k in w_full)
    top_calls = [(out, mb) for options, out, mb in calls if options.top_entropy_quantile == 0.2]
    assert len(top_calls) == len(calls) // 2 == 2  # 2 steps, one microbatch each
    for out, mb in top_calls:
        plain = _plain_row_loss(out, mb, top_entropy_quantile=0.2)
        assert out.entropy_threshold.item() == pytest.approx(plain.threshold, rel=1e-6)
        assert out.loss.item() == pytest.approx(plain.loss, abs=1e-6 * _loss_size(plain, mb))
        everything = _plain_row_loss(out, mb)
        assert abs(everything.loss - plain.loss) > 1e-4 * _loss_size(plain, mb)  # the quantile bites
    assert top["train/entropy_threshold"] == pytest.approx(top_calls[0][0].entropy_threshold.item(), rel=1e-6)


def _expected_token_advantages(estimator, batch, gamma=1.0, kl=None, beta=0.0) -> list[torch.Tensor]:
    """Each response's ``[S]`` advantages by ``estimator`` on ``batch`` (its rewards and groups),
    from the public functions of grpo_fast.algo.advantages."""
    from grpo_fast.algo import advantages as est

    trajectories, sizes = batch.rollout.trajectories, batch.rollout.sizes
    rewards = batch.raw_rewards
    n = torch.tensor([t.num_sampled for t in trajectories])
    if estimator in ("group", "rloo"):
        f = est.normalize_group_rewards if estimator == "group" else est.compute_rloo_advantages
        a, _ = f(rewards, sizes, advantage_eps=1e-6, scale_rewards="group")
        return [torch.full((int(k),), float(x)) for x, k in zip(a, n)]
    mask = torch.arange(int(n.max()))[None] < n[:, None]
    token_rewards = None
    if kl is not None:  # the outcome before the KL, the KL per token
        rewards = rewards + beta * torch.tensor([float(k.double().sum()) for k in kl])
        token_rewards = torch.zeros(mask.shape)
        for i, k in enumerate(kl):
            token_rewards[i, : len(k)] = -beta * k
    groups = sizes if estimator == "reinforce_pp_baseline" else None
    a, _ = est.compute_reinforce_pp_advantages(rewards, mask, token_rewards, gamma, group_sizes=groups)
    return [a[i, :k] for i, k in enumerate(n.tolist())]


def test_advantage_sweep_trains_each_estimator_on_its_advantages(tmp_path, monkeypatch):
    """``loss.advantage``: in each run every trajectory of a step carries the estimator's per-token
    advantages of that step's batch, those are the advantages the training calls receive (the
    same multiset of nonzero values), and every two runs end with different weights. With
    ``loss.gamma=0.5`` REINFORCE++'s advantages fall along a response (γ = 1: one value per
    response); with ``loss.kl_in_reward`` they carry each token's own −β·k1."""
    from grpo_fast.loop import optimization, rollout_phase

    calls, batches, kls = _record_loss_calls(monkeypatch), [], []
    real_finalize, real_scores = rollout_phase.finalize, optimization.score_responses

    def finalize(*args, **kwargs):
        batches.append((len(calls), real_finalize(*args, **kwargs)))
        return batches[-1][1]

    def score_responses(*args, **kwargs):
        out = real_scores(*args, **kwargs)
        kls.append(out.kl_tokens)
        return out

    monkeypatch.setattr(rollout_phase, "finalize", finalize)
    monkeypatch.setattr(rollout_phase, "score_responses", score_responses)

    def check(estimator, **expected):
        for step, (start, batch) in enumerate(batches):
            want = _expected_token_advantages(estimator, batch, kl=kls[step] if kls else None, **expected)
            for t, a in zip(batch.rollout.trajectories, want):
                torch.testing.assert_close(t.sampled_advantages, a, rtol=1e-5, atol=1e-6)
            end = batches[step + 1][0] if step + 1 < len(batches) else len(calls)
            seen = sorted(x for _, _, mb in calls[start:end] for x in mb.advantages.tolist() if x != 0)
            assert seen == pytest.approx(
                sorted(float(x) for a in want for x in a.tolist() if x != 0), rel=1e-6
            )
        calls.clear(), batches.clear(), kls.clear()

    weights = {}
    for value in ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline"):
        (_, weights[value]), = _run_sweep_in_process("advantage", tmp_path / value, values=[value]).values()  # fmt: skip
        check(value)
    names = list(weights)
    for i, a in enumerate(names):
        for b in names[i + 1 :]:
            assert any(not torch.equal(weights[a][k], weights[b][k]) for k in weights[a]), (a, b)

    def spread_within_responses():
        return max(
            float(t.sampled_advantages.std())
            for _, b in batches
            for t in b.rollout.trajectories
            if t.num_sampled > 1
        )

    _run_sweep_in_process("advantage", tmp_path / "gamma", values=["reinforce_pp"], extra=["loss.gamma=0.5"])
    assert spread_within_responses() > 0.1
    check("reinforce_pp", gamma=0.5)
    _run_sweep_in_process(
        "advantage",
        tmp_path / "kl",
        values=["reinforce_pp"],
        extra=["loss.beta=0.5", "loss.kl_in_reward=true"],
    )
    assert spread_within_responses() > 0  # step 2's policy has left π_ref: k1 ≠ 0, per token
    check("reinforce_pp", beta=0.5)
    # one response per prompt: every group is of one (zero variance), and REINFORCE++ still learns
    ((row, _),) = _run_sweep_in_process(
        "advantage", tmp_path / "one", values=["reinforce_pp"], extra=["rollout.group_size=1"]
    ).values()
    assert row["train/zero_variance_fraction"] == 1.0 and row["train/grad_norm"] > 0
    check("reinforce_pp")
    health = (tmp_path / "one" / "advantage_reinforce_pp" / "health.jsonl").read_text()
    assert "zero_variance" not in health  # no group baseline: no "no learning signal" warning
