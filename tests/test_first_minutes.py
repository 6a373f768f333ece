"""A newcomer's first ten minutes: the plan line, the warm start's progress and time left, step
lines with an ETA, logs on stderr and the result on stdout, usage lines as typed, the sweep's
defaults, and a report that says what it measured."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from support.stand_ins import plan_threads_note

from grpo_fast import cli
from grpo_fast.obs import report as report_mod
from grpo_fast.obs import sweep as sweep_mod
from grpo_fast.obs.metrics import format_eta
from grpo_fast.train import main

QUICK = [
    "--preset",
    "tiny",
    "eval_every=0",
    "checkpoint_every=0",
    "rollout.batch_size=16",
    "train.micro_batch_size=16",
    "logging.progress=false",
    "logging.sample_every=0",
]


def test_a_run_says_its_plan_first_shows_time_left_and_prints_its_result_on_stdout(
    tmp_path, capsys, monkeypatch
):
    from grpo_fast.loop import sft

    bars = []

    class Bar:  # the warm start's progress bar (drawn by rich on a terminal only)
        def __init__(self, enabled, total, done, label):
            bars.append({"args": (enabled, total, done, label), "steps": 0})

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            return None

        def step_done(self):
            bars[-1]["steps"] += 1

    monkeypatch.setattr(sft, "PhaseProgress", Bar)
    warm = ["sft.steps=12", "sft.target_accuracy=0.99", "sft.check_every=5", "sft.check_size=8"]
    out = tmp_path / "run"
    assert main([*QUICK, *warm, "steps=4", f"output_dir={out}", "logging.progress=true"]) == 0
    captured = capsys.readouterr()
    err = captured.err.splitlines()
    assert err[0] == (
        "plan: an SFT warm start of up to 12 steps (it stops once greedy accuracy on 8 training "
        "problems reaches 0.99, checked every 5 steps), then GRPO to step 4, 2 prompts × 8 responses "
        f"each; {plan_threads_note()}; no time estimate yet: the progress lines give the time left once the first steps are timed"
    )
    assert bars == [{"args": (True, 12, 0, "SFT warm start"), "steps": 12}]
    first = next(ln for ln in err if ln.startswith("sft warm start 5/12"))
    assert first.endswith(" left)") and "(at most " in first  # the first check: the most it can take
    steps = [ln for ln in err if ln.startswith("step ")]
    assert [ln.split()[1] for ln in steps] == ["1/4", "2/4", "3/4", "4/4"]
    assert "eta" not in steps[0] and "eta" not in steps[-1]  # no rate yet; nothing left
    assert all(ln.rsplit("  ", 1)[-1].startswith("eta ") for ln in steps[1:-1])
    assert captured.out.splitlines()[0].startswith("done: 4 steps in ")
    assert captured.out.splitlines()[-1] == f"report: grpo-fast report {out}"
    assert (out / "sft_metrics.jsonl").read_text() and (out / "health.jsonl").exists()


def test_health_lines_follow_their_step_line(tmp_path, capsys):
    assert main([*QUICK, "sft.steps=0", "steps=1", f"output_dir={tmp_path / 'r'}"]) == 0
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.startswith(("step 1/", "[health]"))]
    assert err[0].startswith("step 1/1") and err[1].startswith("[health] step 1 warning: ")


def test_format_eta():
    assert [format_eta(s) for s in (0.4, 59.4, 60, 3599, 3600, 86399)] == [
        "0s",
        "59s",
        "1m00s",
        "59m59s",
        "1h00m",
        "23h59m",
    ]


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_usage_lines_name_the_command_as_typed(capsys, command):
    with pytest.raises(SystemExit) as stop:
        cli.main([command, "--no-such-flag"])
    assert stop.value.code == 2
    assert capsys.readouterr().err.startswith(f"usage: grpo-fast {command} ")


def test_the_default_lr_sweep_holds_the_preset_s_own_lr_and_the_help_lists_the_defaults(capsys):
    values = [r.value for r in sweep_mod.plan_sweep("tiny", "lr")]
    assert values == ["1e-06", "3.16e-06", "1e-05", "3.16e-05", "0.0001", "0.0002"]  # tiny: 2e-4
    smoke = [r.value for r in sweep_mod.plan_sweep("smoke", "lr")]  # its lr, 1e-6, is on the grid
    assert smoke == values[:-1]
    with pytest.raises(SystemExit):
        sweep_mod.main(["--help"])
    text = " ".join(capsys.readouterr().out.split())
    assert "see SWEEPS" not in text
    assert "lr: 5 points from 1e-06 to 0.0001 (--lr-range, --num) and the preset's own lr" in text
    assert "baseline: no_baseline reinforce_with_baseline" in text and "delta: null 1.5 3" in text


# ---------------------------------------------------------------------------- the report


@pytest.fixture
def drawn(monkeypatch):
    """The figures the report saves, by file name: their titles, lines and shaded bands."""
    figures = {}

    def savefig(fig, path, **kwargs):
        ax_lines = [(line.get_label(), line.get_marker()) for ax in fig.axes for line in ax.get_lines()]
        bands = [c.get_paths()[0].vertices[:, 1] for ax in fig.axes for c in ax.collections]
        figures[Path(path).name] = {"title": fig._suptitle.get_text(), "lines": ax_lines, "bands": bands}
        Path(path).write_bytes(b"png")

    monkeypatch.setattr(report_mod.Figure, "savefig", savefig)
    return figures


def _run_dir(tmp_path: Path, device: str, samples: bool = True) -> Path:
    run = tmp_path / "run"
    (run / "samples").mkdir(parents=True)
    rows = []
    for step in range(1, 401):
        row = {"step": step, "train/reward_mean": 0.1, "train/reward_std": 0.4, "memory/peak_gb": 0.6}
        if step % 100 == 0:
            row["eval/accuracy"] = 0.3
        if step % 10 == 0:
            row["train/kl"] = 0.01  # 40 points among 400 steps: sparse
        rows.append(row)
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    config = f"device: {device}\nrollout:\n  gpu_memory_utilization: 0.5\n"
    resolved = "device=cpu, rollout.gpu_memory_utilization=0.5" if device == "auto" else ""
    (run / "config.yaml").write_text(config + (f"# resolved from auto: {resolved}\n" if resolved else ""))
    if samples:
        recs = [{"response": "1", "reward": r} for r in (0.0, 1.0, 0.0)]
        (run / "samples" / "step_50.jsonl").write_text("".join(json.dumps(r) + "\n" for r in recs))
    return run


def test_the_memory_plot_is_titled_by_the_run_s_device(tmp_path, drawn):
    report_mod.write_report(_run_dir(tmp_path, "cpu"))
    assert drawn["memory.png"]["title"] == "Peak RSS (the process's resident memory, CPU)"
    report_mod.write_report(_run_dir(tmp_path / "g", "cuda:0"))
    assert drawn["memory.png"]["title"] == "Peak GPU memory (allocated by torch)"
    report_mod.write_report(_run_dir(tmp_path / "a", "auto"))  # resolved: the run's config.yaml line
    assert drawn["memory.png"]["title"] == "Peak RSS (the process's resident memory, CPU)"


def test_the_reward_band_stays_within_the_sampled_rewards(tmp_path, drawn):
    report_mod.write_report(_run_dir(tmp_path, "cpu"))  # mean 0.1 ± 0.4 for rewards in [0, 1]
    (band,) = drawn["reward.png"]["bands"]
    assert band.min() == 0.0 and band.max() == pytest.approx(0.5)
    report_mod.write_report(_run_dir(tmp_path / "n", "cpu", samples=False))  # nothing to clip to
    assert drawn["reward.png"]["bands"][0].min() == pytest.approx(-0.3)


def test_sparse_series_have_markers(tmp_path, drawn):
    report_mod.write_report(_run_dir(tmp_path, "cpu"))
    markers = dict(drawn["reward.png"]["lines"])
    assert markers["eval/accuracy"] == "o" and markers["train/reward_mean"] in ("None", None, "")
    assert dict(drawn["kl.png"]["lines"])["train/kl"] == "o"  # 40 points among 400 steps


def test_the_summary_shows_what_an_auto_resolved_to_beside_what_was_asked(tmp_path, drawn):
    summary = report_mod.write_report(_run_dir(tmp_path, "auto")).read_text()
    assert "| `device` | cpu (asked: auto) |" in summary
    assert "| `rollout.gpu_memory_utilization` | 0.5 (asked: auto) |" in summary


@pytest.mark.parametrize(("native", "precision"), [(None, "no"), ("AVX512-BF16", "bf16")])
def test_a_run_records_what_its_autos_resolved_to(tmp_path, capsys, monkeypatch, native, precision):
    """``train.mixed_precision=auto`` on a CPU: bf16 autocast where the CPU computes bf16 natively
    (its probe stood in for both answers), fp32 elsewhere; the plan line says which and why, and
    config.yaml records what the run used. Planted: auto kept at fp32 on every CPU -> the bf16
    case records ``no``."""
    from grpo_fast.policy import model as model_mod

    monkeypatch.setattr(model_mod, "cpu_computes_bf16", lambda: native)
    out = tmp_path / "run"
    args = [
        *QUICK,
        "sft.steps=0",
        "steps=1",
        f"output_dir={out}",
        "device=auto",
        "train.mixed_precision=auto",
    ]
    assert main(args) == 0
    line = (out / "config.yaml").read_text().splitlines()[-1]
    assert line.startswith("# resolved from auto: ")
    assert {"device=cpu", f"train.mixed_precision={precision}", "rollout.gpu_memory_utilization=0.5"} <= set(
        line.removeprefix("# resolved from auto: ").split(", ")
    )
    plan = next(ln for ln in capsys.readouterr().err.splitlines() if ln.startswith("plan: "))
    said = (
        "; bf16 autocast (train.mixed_precision=auto: this CPU has AVX512-BF16)"
        if native
        else "; fp32 (train.mixed_precision=auto: this CPU has no native bf16 dot products)"
    )
    assert said in plan
