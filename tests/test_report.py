"""Run report on synthetic run directories: plots, summary contents, sparse and missing keys,
and one-line errors for missing or broken metrics."""

import json

import pytest

from grpo_fast.errors import DataError, UserError
from grpo_fast.obs.report import PLOTS, main, read_metrics, series, write_report

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def full_row(step: int) -> dict:
    row = {
        "step": step,
        "train/loss": 1.0 / (step + 1),
        "train/reward_mean": 0.1 + 0.01 * step,
        "train/reward_std": 0.3,
        "train/accuracy": 0.05 + 0.01 * step,
        "train/entropy_mean": 2.5 - 0.02 * step,
        "train/response_length_mean": 300.0 + step,
        "train/grad_norm": 1.0 + 0.1 * (step % 3),
        "train/clip_fraction": 0.02,
        "train/kl": 0.001 * step,
        "train/lr": 1e-6,
        "time/rollout_s": 10.0,
        "time/train_s": 5.0,
        "memory/peak_gb": 17.5,
        "throughput/tokens_per_s": 3000.0,
        "world_size": 1,
    }
    if step % 10 == 0:  # eval rows are sparse
        row.update({"eval/accuracy": [0.2, 0.4, 0.3][step // 10], "eval/format_rate": 0.9})
    return row


@pytest.fixture
def run_dir(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    rows = [full_row(s) for s in range(30)]
    rows.append({"step": 12, "event": "length_explosion", "message": "length +60%"})
    text = "".join(json.dumps(r) + "\n" for r in rows) + '{"step": 30, "train/lo'  # killed mid-write
    (run / "metrics.jsonl").write_text(text, encoding="utf-8")
    (run / "config.yaml").write_text(
        "model:\n  name_or_path: Qwen/Qwen2.5-Math-1.5B\ntrain:\n  lr: 1.0e-06\n"
        "loss:\n  type: grpo_clip\n  length_norm: constant\nrollout:\n  group_size: 8\n",
        encoding="utf-8",
    )
    health = {
        "step": 7,
        "kind": "grad_norm_spike",
        "severity": "warning",
        "message": "grad norm 31 is 20× the running median 1.5",
        "suggestion": "lower train.lr or train.grad_clip",
        "value": 31.0,
    }
    (run / "health.jsonl").write_text(json.dumps(health) + "\n", encoding="utf-8")
    return run


def test_full_report(run_dir):
    summary_path = write_report(run_dir)
    out = run_dir / "report"
    assert summary_path == out / "summary.md"
    for spec in PLOTS:
        if spec.optional:  # a run without a tool logs no tool metrics: no plot, no note
            assert not (out / f"{spec.name}.png").exists(), spec.name
            continue
        png = (out / f"{spec.name}.png").read_bytes()
        assert png.startswith(PNG_MAGIC) and len(png) > 10_000, spec.name
    summary = summary_path.read_text(encoding="utf-8")
    assert "| `model.name_or_path` | Qwen/Qwen2.5-Math-1.5B |" in summary
    assert "| `loss.length_norm` | constant |" in summary
    # eval accuracy 0.2 @0, 0.4 @10, 0.3 @20: first, last, best
    assert "| first | 0 | 0.2 |" in summary
    assert "| last | 20 | 0.3 |" in summary
    assert "| best | 10 | 0.4 |" in summary
    assert "grad_norm_spike" in summary and "lower train.lr" in summary
    assert "length_explosion" in summary  # an event row inside metrics.jsonl
    assert "| `train/kl` | 29 | 0.029 |" in summary  # final value of each metric
    assert "![Reward and accuracy](reward.png)" in summary
    assert "skipped" not in summary


def test_a_run_with_a_tool_gets_the_tools_plot_and_a_multi_turn_sample(run_dir):
    tools = {"rollout/tool_call_rate": 0.5, "rollout/tool_calls_mean": 0.7, "rollout/turns_mean": 1.7}
    rows = [{**full_row(s), **tools} for s in range(30)]
    (run_dir / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    samples = run_dir / "samples"
    samples.mkdir()
    one_turn = {"prompt": "1*2=", "reward": 0.0, "turns": [{"sampled": "3", "inserted": ""}]}
    two = {
        "prompt": "12*34=",
        "reward": 1.0,
        "finish_reason": "stop",
        "turns": [
            {"sampled": "<calc>12*34</calc>", "inserted": "<result>408</result>"},
            {"sampled": "408", "inserted": ""},
        ],
    }
    (samples / "step_2.jsonl").write_text(
        json.dumps(one_turn) + "\n" + json.dumps(two) + "\n", encoding="utf-8"
    )
    (samples / "step_1.jsonl").write_text(json.dumps({**two, "prompt": "older"}) + "\n", encoding="utf-8")
    summary = write_report(run_dir).read_text(encoding="utf-8")
    assert (run_dir / "report" / "tools.png").read_bytes().startswith(PNG_MAGIC)
    assert "## A multi-turn sample" in summary
    assert "From `samples/step_2.jsonl`: `12*34=` → reward 1, stop." in summary
    assert "| 1 | `<calc>12*34</calc>` | `<result>408</result>` |" in summary
    assert "older" not in summary


def test_missing_keys_skip_plots_with_a_note(tmp_path):
    run = tmp_path / "sparse"
    run.mkdir()
    rows = [{"step": s, "train/loss": 1.0 - 0.1 * s} for s in range(5)]
    (run / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")
    summary = write_report(run, tmp_path / "out").read_text(encoding="utf-8")
    assert sorted(p.name for p in (tmp_path / "out").glob("*.png")) == ["loss.png"]
    assert "- skipped kl.png: none of train/kl in the metrics" in summary
    assert "No `eval/accuracy` in the metrics." in summary
    assert "No readable `config.yaml`." in summary
    assert "No health events." in summary


def test_series_skips_missing_nan_and_non_numbers():
    rows = [
        {"step": 0, "a": 1.0},
        {"step": 1},
        {"step": 2, "a": float("nan")},
        {"step": 3, "a": True},
        {"a": 5.0},
        {"step": 4, "a": 2},
    ]
    assert series(rows, "a") == ([0, 4], [1.0, 2.0])


def test_read_metrics_errors(tmp_path):
    with pytest.raises(UserError, match=r"metrics\.jsonl: no metrics file"):
        read_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text("\n\n", encoding="utf-8")
    with pytest.raises(UserError, match="empty, nothing to report"):
        read_metrics(tmp_path / "metrics.jsonl")
    (tmp_path / "metrics.jsonl").write_text('{"step": 0}\n{"step": \n{"step": 2}\n', encoding="utf-8")
    with pytest.raises(DataError, match=r"metrics\.jsonl:2: not valid JSON"):
        read_metrics(tmp_path / "metrics.jsonl")


@pytest.mark.parametrize(
    ("setup", "message"),
    [
        (lambda d: None, "not a directory"),
        (lambda d: d.mkdir(), "no metrics file"),
        (lambda d: (d.mkdir(), (d / "metrics.jsonl").touch()), "empty, nothing to report"),
    ],
    ids=["no-dir", "no-metrics", "empty-metrics"],
)
def test_cli_errors_are_one_line_exit_2(tmp_path, capsys, setup, message):
    run = tmp_path / "run"
    setup(run)
    assert main([str(run)]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and err.startswith("error: ") and message in err


def test_cli_success(run_dir, tmp_path, capsys):
    assert main([str(run_dir), "--out", str(tmp_path / "elsewhere")]) == 0
    assert capsys.readouterr().out.strip() == str(tmp_path / "elsewhere" / "summary.md")
    assert (tmp_path / "elsewhere" / "reward.png").stat().st_size > 0
