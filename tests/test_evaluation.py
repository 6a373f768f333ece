"""Evaluation as papers report it (docs/evaluation.md): ``eval.k`` samples a problem at the
``eval`` section's own sampling, the unbiased pass@k and avg@k per named set, in the loop and in
``grpo-fast evaluate`` alike."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from grpo_fast.config import load_config
from grpo_fast.errors import DataError
from grpo_fast.task.loader import load_eval_sets, load_task
from grpo_fast.tools import evaluate as evaluate_cli
from grpo_fast.tools.evaluate import pass_at_k
from grpo_fast.train import main as train_main

# Two sets, 8 samples each at temperature 1: the generalization set tiny_3digit beside the task's own.
EVAL_ARGS = ["eval.sets=[tiny,tiny_3digit]", "eval.k=8", "eval.temperature=1.0", "data.eval_subset_size=24"]
CLI_EVAL = ["--sets", "tiny,tiny_3digit", "--k", "8", "--temperature", "1.0", "data.eval_subset_size=24"]


@pytest.mark.parametrize(
    ("n", "c", "k", "want"),
    [
        (4, 1, 2, 0.5),  # 1 − C(3,2)/C(4,2) = 1 − 3/6
        (5, 2, 2, 0.7),  # 1 − C(3,2)/C(5,2) = 1 − 3/10
        (8, 3, 1, 3 / 8),  # pass@1 is the share correct
        (10, 0, 5, 0.0),  # nothing correct: never
        (6, 1, 6, 1.0),  # all six drawn: the one correct always among them
        (6, 2, 5, 1.0),  # n − c = 4 < k = 5: every draw of 5 holds a correct one
        (3, 1, 2, 2 / 3),  # 1 − C(2,2)/C(3,2) = 1 − 1/3
    ],
)
def test_pass_at_k_is_its_closed_form_on_hand_worked_cases(n, c, k, want):
    assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-15)


def test_pass_at_k_equals_the_binomial_ratio_everywhere_and_refuses_k_above_n():
    """Against ``1 − C(n−c, k)/C(n, k)`` in exact integers, every (n ≤ 24, c, k): the product form
    is exact to float64's rounding. Planted: ``range(n − c, n + 1)`` (one factor too many) fails."""
    for n in range(1, 25):
        for c in range(n + 1):
            for k in range(1, n + 1):
                want = 1 - math.comb(n - c, k) / math.comb(n, k)
                assert pass_at_k(n, c, k) == pytest.approx(want, rel=1e-12, abs=1e-14), (n, c, k)
    with pytest.raises(ValueError, match="1 <= k <= n"):
        pass_at_k(4, 1, 5)


@pytest.fixture(scope="module")
def two_set_run(tmp_path_factory) -> Path:
    """The tiny preset, 40 warm-start steps (answers right now and then, so that the figures are
    not all zero), 2 GRPO steps, evaluated at steps 0 and 2 on two sets with k = 8."""
    out = tmp_path_factory.mktemp("two_sets") / "run"
    args = ["--preset", "tiny", f"output_dir={out}", "steps=2", "sft.steps=40", "eval_every=2",
            "checkpoint_every=0", "rollout.batch_size=32", "logging.progress=false", *EVAL_ARGS]  # fmt: skip
    assert train_main(args) == 0
    return out


def _rows(run: Path) -> dict[int, dict]:
    return {r["step"]: r for r in map(json.loads, (run / "metrics.jsonl").read_text().splitlines())}


def _cli_metrics(capsys, *argv) -> dict:
    capsys.readouterr()
    assert evaluate_cli.main(list(argv)) == 0
    out = capsys.readouterr().out
    return json.loads(out[out.index("{") :])


def test_both_sets_logged_every_evaluation_and_the_cli_gives_the_same_figures(two_set_run, capsys):
    """Each evaluation (steps 0 and 2) logs avg@8, pass@2/4/8 and the rest for both sets, the first
    set's also as the headline ``eval/accuracy``; ``grpo-fast evaluate`` on the final model, the
    same sets and sampling, the loop's subset, gives every figure of step 2 bitwise (the draws
    are seeded by (seed, set, rank), not by the step). Planted: the seed drawn from the step → the
    CLI's figures differ; accuracy → avg@k left out of the per-set keys → KeyError."""
    rows = _rows(two_set_run)
    for step in (0, 2):
        row = rows[step]
        for name in ("tiny", "tiny_3digit"):
            for key in ("avg@8", "pass@2", "pass@4", "pass@8", "format_rate", "response_length_mean"):
                assert f"eval/{name}/{key}" in row, (step, name, key)
            assert row[f"eval/{name}/num_examples"] == 24
            ks = [row[f"eval/{name}/{k}"] for k in ("avg@8", "pass@2", "pass@4", "pass@8")]
            assert ks == sorted(ks), ks  # more samples can only pass more
        assert row["eval/accuracy"] == row["eval/tiny/avg@8"]
    assert rows[2]["eval/tiny/pass@8"] > rows[2]["eval/tiny/avg@8"] > 0  # figures, not zeros
    dumped = [
        json.loads(line) for line in (two_set_run / "samples" / "eval_step_2.jsonl").read_text().splitlines()
    ]
    assert {r["set"] for r in dumped} == {"tiny", "tiny_3digit"}
    assert [r["sample"] for r in dumped if r["set"] == "tiny"][:8] == list(range(8))  # problem by problem
    cli = _cli_metrics(capsys, "--model", str(two_set_run / "final"), *CLI_EVAL, "--subset")
    loop = {k: v for k, v in rows[2].items() if k.startswith("eval/")}
    assert cli == loop


def test_eval_sampling_keys_reach_the_sampler(two_set_run, capsys):
    """``eval.top_p=0.05`` at temperature 1 keeps only the likeliest token (of 15, p ≥ 1/15 > 0.05):
    greedy's answers exactly; ``eval.temperature`` 1 vs 0 differ; ``eval.max_tokens=1`` cuts every
    answer to one token. Planted: top_p read from rollout.top_p, or max_tokens from
    rollout.max_tokens → fails."""
    model = ["--model", str(two_set_run / "final"), "--sets", "tiny", "--limit", "40"]
    greedy = _cli_metrics(capsys, *model)
    nucleus = _cli_metrics(capsys, *model, "--temperature", "1.0", "--top-p", "0.05")
    hot = _cli_metrics(capsys, *model, "--temperature", "1.0")
    short = _cli_metrics(capsys, *model, "--max-tokens", "1")
    assert nucleus == greedy
    assert hot != greedy
    assert short["eval/tiny/response_length_mean"] == 1.0 and short["eval/tiny/truncated_fraction"] > 0
    assert greedy["eval/tiny/response_length_mean"] > 1.0


def test_eval_temperature_auto_is_greedy_alone_and_the_policys_temperature_at_k_above_1(two_set_run, capsys):
    """``eval.temperature=auto`` (the default): ``--k 2`` alone samples at ``rollout.temperature``
    (the issue's ``grpo-fast evaluate --k 16`` with no temperature runs), the same draws as that
    temperature given; k = 1 stays greedy. Planted: auto read as 1.0 → the 0.7 run differs."""
    model = ["--model", str(two_set_run / "final"), "--sets", "tiny", "--limit", "40"]
    auto = _cli_metrics(capsys, *model, "--k", "2", "rollout.temperature=0.7")
    assert auto == _cli_metrics(capsys, *model, "--k", "2", "--temperature", "0.7")
    assert auto != _cli_metrics(capsys, *model, "--k", "2", "--temperature", "1.0")
    greedy = _cli_metrics(capsys, *model)
    assert greedy == _cli_metrics(capsys, *model, "--temperature", "0")


def test_a_set_that_cannot_be_read_is_one_line_before_the_run_starts(tmp_path, capsys):
    """A missing file, and a Hub set offline (the tests' Hub is off: tests/conftest.py): one line
    naming the set, exit 2, and the run folder holds no run."""
    out = tmp_path / "run"
    rc = train_main(["--preset", "tiny", f"output_dir={out}", "eval.sets=[tiny,mine=/nope/x.jsonl]"])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and err == ["error: eval.sets: 'mine': /nope/x.jsonl: file not found"]
    assert not (out / "metrics.jsonl").exists()
    rc = evaluate_cli.main(["--model", "builtin:tiny", "--sets", "math500"])
    err = capsys.readouterr().err.strip().splitlines()
    assert (
        rc == 2
        and len(err) == 1
        and err[0].startswith("error: eval.sets: 'math500': could not load 'HuggingFaceH4/MATH-500'")
    )


def test_a_file_set_is_read_as_the_runs_task_and_its_characters_checked(tmp_path):
    """NAME=PATH: the run's task's fields, template and reward; a character the built-in tokenizer
    does not know is refused naming the set and the line."""
    good = tmp_path / "sums.jsonl"
    good.write_text('{"question": "1+2=", "answer": "3"}\n{"question": "10+20=", "answer": "30"}\n')
    cfg = load_config("tiny", overrides=[f"eval.sets=[tiny_3digit,mine={good}]"])
    task = load_task(cfg)
    three, mine = load_eval_sets(cfg, task)
    assert (three.name, len(three.task.eval), three.task.template) == ("tiny_3digit", 500, "question_only")
    assert [e.answer for e in mine.task.eval] == ["3", "30"] and mine.task.reward_fn is task.reward_fn
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"question": "1 + 2 =", "answer": "3"}\n')
    cfg = load_config("tiny", overrides=[f"eval.sets=[{bad}]"])
    with pytest.raises(
        DataError, match=r"eval\.sets: 'bad': .*bad\.jsonl:1: the question '1 \+ 2 =' holds ' '"
    ):
        load_eval_sets(cfg, load_task(cfg))


def test_the_report_plots_each_set_and_tables_its_last_evaluation(two_set_run):
    """``eval_sets.png`` with a panel per set, and ``summary.md``'s "Evaluation by set": each set's
    last evaluation (step 2, 24 problems) with its avg@8 and pass@j as the metrics say. Planted:
    the table's row read from the first evaluation → the step and figures differ."""
    from grpo_fast.obs.report import eval_set_plots, write_report

    rows = list(_rows(two_set_run).values())
    (spec,) = eval_set_plots(rows)
    assert spec.name == "eval_sets" and [p.ylabel for p in spec.panels] == ["tiny", "tiny_3digit"]
    out = write_report(two_set_run).parent
    assert (out / "eval_sets.png").stat().st_size > 0
    summary = (out / "summary.md").read_text()
    table = summary[summary.index("## Evaluation by set") :].split("\n\n")[1].splitlines()
    last = _rows(two_set_run)[2]
    for name in ("tiny", "tiny_3digit"):
        (line,) = [row for row in table if row.startswith(f"| `{name}` ")]
        cells = [c.strip() for c in line.strip("|").split("|")]
        assert cells[1:4] == ["eval", "2", "24"], cells
        assert f"avg@8 {last[f'eval/{name}/avg@8']:.4g}" in cells[4], cells
        assert f"pass@8 {last[f'eval/{name}/pass@8']:.4g}" in cells[4], cells
        assert cells[5:] == [
            f"{last[f'eval/{name}/{k}']:.4g}" for k in ("format_rate", "response_length_mean")
        ]


def test_a_hub_set_is_read_with_its_split_and_config_and_refused_offline_by_name(tmp_path):
    """``NAME=hub:ORG/DATASET[:CONFIG][@SPLIT]``: a dataset ``datasets.load_dataset`` reads (here
    a local dataset folder: the tests' Hub is off), its split chosen, read and graded as the run's
    own task; a bare ``hub:ORG/DATASET`` is named by DATASET; one that cannot be reached is one line
    naming the set. Planted: the split ignored (always "test") → the validation rows are not read."""
    from grpo_fast.task.eval_sets import parse_entry

    folder = tmp_path / "sums"
    folder.mkdir()
    (folder / "test.jsonl").write_text('{"question": "1+2=", "answer": "3"}\n')
    (folder / "validation.jsonl").write_text(
        '{"question": "4+4=", "answer": "8"}\n{"question": "5+5=", "answer": "10"}\n'
    )
    assert parse_entry("hub:org/gsm_hard:main@train", "tiny") == parse_entry(
        "gsm_hard=hub:org/gsm_hard:main@train", "tiny"
    )
    cfg = load_config("tiny", overrides=[f"eval.sets=[tiny,test=hub:{folder},val=hub:{folder}@validation]"])
    task = load_task(cfg)
    _, test, val = load_eval_sets(cfg, task)
    assert [e.answer for e in test.task.eval] == ["3"] and [e.answer for e in val.task.eval] == ["8", "10"]
    assert val.task.reward_fn is task.reward_fn and val.task.template == task.template
    cfg = load_config("tiny", overrides=["eval.sets=[tiny,far=hub:nobody/nothing]"])
    with pytest.raises(
        DataError, match=r"^eval\.sets: 'far': could not load 'nobody/nothing' .*OfflineModeIsEnabled"
    ):
        load_eval_sets(cfg, task)
    with pytest.raises(Exception, match=r"give a Hub dataset as hub:ORG/DATASET\[:CONFIG\]\[@SPLIT\]"):
        load_config("tiny", overrides=["eval.sets=[x=hub:org/ds@]"])
