"""Task data: JSONL/Parquet loading, answer extraction, hub defaults, and every bad-data error
naming its file, line and field."""

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from grpo_fast.errors import ConfigError, DataError, cli_errors
from grpo_fast.task.data import TASKS, Example, load_examples, write_jsonl

# ----------------------------------------------------------------------------------------------
# Good data
# ----------------------------------------------------------------------------------------------


def test_gsm8k_jsonl_takes_the_text_after_hashes_without_commas(tmp_path):
    path = write_jsonl(
        tmp_path / "gsm.jsonl",
        [
            {"question": "Eggs?", "answer": "16 - 3 - 4 = 9\n9 * 2 = 18\n#### 18"},
            {"question": "Big?", "answer": "so\n#### 1,000"},
            {"question": "Bare?", "answer": 42},  # an already-extracted number
        ],
    )
    # the worked solution: the text before ####; a bare number has none
    assert load_examples("gsm8k", str(path)) == [
        Example("Eggs?", "18", solution="16 - 3 - 4 = 9\n9 * 2 = 18"),
        Example("Big?", "1000", solution="so"),
        Example("Bare?", "42"),
    ]


def test_math_jsonl_takes_the_last_box_with_balanced_braces(tmp_path):
    path = write_jsonl(
        tmp_path / "math.jsonl",
        [
            {"problem": "P1", "solution": "First $\\boxed{1}$, then $\\boxed{\\frac{a^{2}}{b}}$."},
            {"problem": "P2", "solution": "Thus \\boxed 5$."},
            {"problem": "P3", "solution": "Hence \\fbox{\\{1,2\\}}."},
        ],
    )
    assert [e.answer for e in load_examples("math", str(path))] == ["\\frac{a^{2}}{b}", "5", "\\{1,2\\}"]


def test_math_prefers_a_bare_answer_field_and_accepts_an_explicit_one(tmp_path):
    # MATH-500 style: both a solution and a bare answer; the default picks "answer".
    path = write_jsonl(
        tmp_path / "m500.jsonl", [{"problem": "P", "solution": "\\boxed{2}", "answer": "\\frac14"}]
    )
    assert load_examples("math", str(path)) == [Example("P", "\\frac14", solution="\\boxed{2}")]
    path = write_jsonl(tmp_path / "custom.jsonl", [{"q": "Q", "final": "x+1"}])
    assert load_examples("math", str(path), question_field="q", answer_field="final") == [Example("Q", "x+1")]


def test_blank_lines_are_skipped(tmp_path):
    path = tmp_path / "gaps.jsonl"
    path.write_text('\n{"question": "Q", "answer": "#### 3"}\n\n', encoding="utf-8")
    assert load_examples("gsm8k", str(path)) == [Example("Q", "3")]


def test_parquet(tmp_path):
    path = tmp_path / "train.parquet"
    pq.write_table(pa.table({"problem": ["P1", "P2"], "solution": ["\\boxed{1}", "\\boxed{x^2}"]}), path)
    assert load_examples("math", str(path)) == [
        Example("P1", "1", solution="\\boxed{1}"),
        Example("P2", "x^2", solution="\\boxed{x^2}"),
    ]


@pytest.mark.parametrize(
    ("task", "hub_name", "hub_config", "expected"),
    [
        ("math", None, None, ("DigitalLearningGmbH/MATH-lighteval", None)),
        ("gsm8k", None, None, ("openai/gsm8k", "main")),
        ("math", "HuggingFaceH4/MATH-500", None, ("HuggingFaceH4/MATH-500", None)),
        ("gsm8k", None, "socratic", ("openai/gsm8k", "socratic")),
    ],
    ids=["math-default", "gsm8k-default", "hub-name", "hub-config"],
)
def test_hub_defaults_and_overrides(monkeypatch, task, hub_name, hub_config, expected):
    # No network in tests: stand in for datasets.load_dataset and check what it was asked for.
    import datasets

    calls = []

    def fake_load_dataset(name, config=None, split=None):
        calls.append((name, config, split))
        return [
            {"problem": "Q", "solution": "\\boxed{7}"}
            if task == "math"
            else {"question": "Q", "answer": "#### 7"}
        ]

    monkeypatch.setattr(datasets, "load_dataset", fake_load_dataset)
    examples = load_examples(task, split="test", hub_name=hub_name, hub_config=hub_config)
    assert calls == [(*expected, "test")]
    assert examples == [Example("Q", "7", solution="\\boxed{7}" if task == "math" else None)]


def test_write_jsonl_creates_folders(tmp_path):
    path = write_jsonl(tmp_path / "a" / "b.jsonl", [{"x": "é"}])
    assert path.read_text(encoding="utf-8") == '{"x": "é"}\n'


def test_task_specs_name_their_fields_and_a_registered_reward():
    from grpo_fast.task.rewards import REWARD_FNS

    assert TASKS["math"].question_fields[0] == "problem"
    assert TASKS["gsm8k"].question_fields[0] == "question"
    assert all(spec.reward in REWARD_FNS for spec in TASKS.values())


# ----------------------------------------------------------------------------------------------
# Bad data: one clear line naming the file (and line, and field)
# ----------------------------------------------------------------------------------------------


def write_lines(path, *lines):
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return str(path)


GOOD = '{"question": "Q", "answer": "#### 1"}'


def test_missing_file(tmp_path):
    with pytest.raises(DataError, match=r"nope\.jsonl: file not found"):
        load_examples("gsm8k", str(tmp_path / "nope.jsonl"))


def test_unsupported_extension(tmp_path):
    path = write_lines(tmp_path / "train.csv", "question,answer")
    with pytest.raises(
        DataError, match=r"train\.csv: unsupported file type '\.csv'; use one of \.jsonl, \.parquet"
    ):
        load_examples("gsm8k", path)


def test_empty_file(tmp_path):
    (tmp_path / "empty.jsonl").touch()
    with pytest.raises(DataError, match=r"empty\.jsonl: empty"):
        load_examples("gsm8k", str(tmp_path / "empty.jsonl"))
    path = write_lines(tmp_path / "blank.jsonl", "", "   ")
    with pytest.raises(DataError, match=r"blank\.jsonl: empty"):
        load_examples("gsm8k", path)


def test_malformed_json_names_the_line(tmp_path):
    path = write_lines(tmp_path / "bad.jsonl", GOOD, GOOD, '{"question": "Q", "answer": ')
    with pytest.raises(DataError, match=r"bad\.jsonl:3: not valid JSON"):
        load_examples("gsm8k", path)


def test_non_object_line(tmp_path):
    path = write_lines(tmp_path / "list.jsonl", GOOD, '["Q", "#### 1"]')
    with pytest.raises(DataError, match=r"list\.jsonl:2: expected a JSON object, got list"):
        load_examples("gsm8k", path)


def test_missing_field_names_it_and_the_fields_present(tmp_path):
    path = write_lines(tmp_path / "fields.jsonl", GOOD, '{"prompt": "Q", "answer": "#### 1"}')
    with pytest.raises(
        DataError,
        match=r"fields\.jsonl:2: missing question field \(tried 'question', 'problem'\); fields present: 'prompt', 'answer'",
    ):
        load_examples("gsm8k", path)
    with pytest.raises(
        DataError, match=r"fields\.jsonl:1: missing field 'final'; fields present: 'question', 'answer'"
    ):
        load_examples("gsm8k", path, answer_field="final")


def test_math_solution_without_a_box(tmp_path):
    path = write_lines(
        tmp_path / "nobox.jsonl",
        '{"problem": "P", "solution": "\\\\boxed{1}"}',
        '{"problem": "P", "solution": "it is 1"}',
    )
    with pytest.raises(
        DataError, match=r"nobox\.jsonl:2: no \\boxed\{\.\.\.\} answer found in field 'solution'"
    ):
        load_examples("math", path)


def test_gsm8k_answer_without_hashes(tmp_path):
    path = write_lines(tmp_path / "nohash.jsonl", GOOD, '{"question": "Q", "answer": "the answer is 5"}')
    with pytest.raises(DataError, match=r"nohash\.jsonl:2: no '####' answer found in field 'answer'"):
        load_examples("gsm8k", path)


def test_empty_answer_and_bad_question(tmp_path):
    path = write_lines(tmp_path / "emptybox.jsonl", '{"problem": "P", "solution": "\\\\boxed{ }"}')
    with pytest.raises(DataError, match=r"emptybox\.jsonl:1: empty answer in field 'solution'"):
        load_examples("math", path)
    path = write_lines(tmp_path / "q.jsonl", '{"question": 3, "answer": "#### 1"}')
    with pytest.raises(DataError, match=r"q\.jsonl:1: field 'question' must be a non-empty string"):
        load_examples("gsm8k", path)


def test_unreadable_parquet(tmp_path):
    path = tmp_path / "broken.parquet"
    path.write_bytes(b"not parquet at all")
    with pytest.raises(DataError, match=r"broken\.parquet: not a readable Parquet file"):
        load_examples("math", str(path))


def test_parquet_row_numbers(tmp_path):
    path = tmp_path / "rows.parquet"
    pq.write_table(pa.table({"problem": ["P1", "P2"], "solution": ["\\boxed{1}", "none"]}), path)
    with pytest.raises(DataError, match=r"rows\.parquet row 2: no \\boxed"):
        load_examples("math", str(path))


def test_not_utf8(tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"question": "caf\xe9", "answer": "#### 1"}\n')
    with pytest.raises(DataError, match=r"latin1\.jsonl: not UTF-8"):
        load_examples("gsm8k", str(path))


def test_unknown_task():
    with pytest.raises(ConfigError, match=r"unknown task 'aime': choose one of gsm8k, math"):
        load_examples("aime", "x.jsonl")


def test_hub_failure_is_one_data_error(monkeypatch):
    import datasets

    def offline(*args, **kwargs):
        raise ConnectionError(
            "Couldn't reach 'openai/gsm8k' on the Hub (LocalEntryNotFoundError)\nmore detail"
        )

    monkeypatch.setattr(datasets, "load_dataset", offline)
    with pytest.raises(
        DataError,
        match=r"could not load 'openai/gsm8k' \(config 'main', split 'train'\).*Couldn't reach.*local \.jsonl",
    ):
        load_examples("gsm8k")


def test_cli_prints_one_line_and_exits_2(tmp_path, capsys):
    path = write_lines(tmp_path / "cli.jsonl", GOOD, "{oops")
    main = cli_errors(lambda: load_examples("gsm8k", path) and 0)
    assert main() == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1
    assert err.startswith("error: ") and "cli.jsonl:2:" in err


def test_extraction_uses_the_reward_modules_box_parser():
    # One box parser for data and rewards: the math task's module must not grow its own.
    from grpo_fast.task import competition_math, rewards

    assert competition_math.extract_boxed is rewards.extract_boxed


def test_math_solution_and_level(tmp_path):
    path = write_jsonl(
        tmp_path / "math.jsonl",
        [
            {"problem": "P1", "solution": "So $\\boxed{2}$.", "level": "Level 3"},
            {"problem": "P2", "solution": "Hence \\boxed{5}", "level": "Level ?"},  # MATH has a few
            {"problem": "P3", "solution": "\\boxed{1}", "level": 2},
        ],
    )
    examples = load_examples("math", str(path), difficulty_field="level")
    assert [(e.answer, e.solution, e.difficulty) for e in examples] == [
        ("2", "So $\\boxed{2}$.", 3.0),
        ("5", "Hence \\boxed{5}", None),
        ("1", "\\boxed{1}", 2.0),
    ]
    assert load_examples("math", str(path))[0].difficulty is None  # no difficulty field by default
    with pytest.raises(DataError, match=r"math.jsonl:1: missing field 'rating'"):
        load_examples("math", str(path), difficulty_field="rating")
    with pytest.raises(DataError, match=r"math.jsonl:1: missing field 'worked'"):
        load_examples("math", str(path), solution_field="worked")


def test_gsm8k_solution_drops_the_calculator_annotations(tmp_path):
    path = write_jsonl(tmp_path / "g.jsonl", [{"question": "Q", "answer": "48/2 = <<48/2=24>>24\n#### 24"}])
    assert load_examples("gsm8k", str(path)) == [Example("Q", "24", solution="48/2 = 24")]


def test_task_solution_text_in_the_reward_format():
    from grpo_fast.config import load_config
    from grpo_fast.task.loader import load_task
    from grpo_fast.task.rewards import r1_zero_reward_fn

    tiny_task = load_task(load_config("tiny"))
    ex = tiny_task.train[0]
    assert ex.solution == ex.answer  # the tiny task's response is the bare sum
    assert tiny_task.reward_fn(tiny_task.solution_text(ex), ex.answer)["reward"] == 1.0
    math_ex = Example("1+1?", "2", solution="One plus one is 2.")
    tiny_task.template = "r1_zero"
    text = tiny_task.solution_text(math_ex)
    assert text == " One plus one is 2. </think> <answer> 2 </answer>"
    assert r1_zero_reward_fn(text, "2")["reward"] == 1.0
    assert tiny_task.solution_text(Example("Q", "3")) is None


def test_sft_mix_needs_solutions(tmp_path):
    from grpo_fast.config import load_config
    from grpo_fast.task.loader import load_task

    path = write_jsonl(tmp_path / "bare.jsonl", [{"question": "1+2=", "answer": "3"}])
    overrides = ["sft.mix_coef=0.1", f"data.train_path={path}", f"data.eval_path={path}"]
    assert load_task(load_config("tiny", overrides=overrides)).train[0].solution == "3"  # tiny: the answer
    cfg = load_config(overrides=[*overrides, "data.task=gsm8k"])
    with pytest.raises(ConfigError, match=r"^sft\.mix_coef=0\.1 needs ground-truth solutions"):
        load_task(cfg)


def test_tasks_are_found_by_their_modules_and_make_the_config_domain():
    """Each task module of grpo_fast.task declares a TaskSpec; data.task's choices are those."""
    from grpo_fast.config import DataConfig
    from grpo_fast.domains import domain_of
    from grpo_fast.task.registry import tasks

    assert list(tasks()) == ["math", "gsm8k", "tiny", "tiny_tools"]
    assert domain_of(DataConfig, "task").choices == tuple(tasks())
    assert TASKS is tasks() or dict(TASKS) == tasks()
