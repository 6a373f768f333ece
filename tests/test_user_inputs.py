"""Bad and hostile inputs: each is one ``error:`` line and exit code 2, never a traceback, and
nothing in a run folder changes. Damaged model files, planner and evaluate arguments, the dry
run's stops (the real run's, with the same lines), data files and YAML (a fuzz pass), a
microbatch larger than the batch, a data line of megabytes."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from run_folders import QUICK, finished_run
from run_folders import copy_folder as _copy
from run_folders import tree as _tree

from grpo_fast.config import load_config
from grpo_fast.obs import run_folder
from grpo_fast.tools import evaluate as evaluate_mod
from grpo_fast.tools import plan as plan_mod
from grpo_fast.train import main


def _one_line(capsys, code: int, rc: int) -> str:
    assert rc == code
    err = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    assert len(err) == 1 and err[0].startswith("error: "), err
    return err[0]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run, copied by the tests that change it."""
    return finished_run(tmp_path_factory)


# ---------------------------------------------------------------------------- damaged model files


def _truncate(file: Path, keep: float = 0.5) -> None:
    data = file.read_bytes()
    file.write_bytes(data[: int(len(data) * keep)])


DAMAGES = {
    "model.safetensors truncated": ("model.safetensors", lambda f: _truncate(f)),
    "model.safetensors header garbage": ("model.safetensors", lambda f: f.write_bytes(b"\x10\x00" * 64)),
    "model.safetensors empty": ("model.safetensors", lambda f: f.write_bytes(b"")),
    "config.json truncated": ("config.json", lambda f: _truncate(f)),
    "tokenizer.json truncated": ("tokenizer.json", lambda f: _truncate(f)),
    "tokenizer_config.json not UTF-8": ("tokenizer_config.json", lambda f: f.write_bytes(b"\xff\xfe{")),
}


@pytest.mark.parametrize("damage", list(DAMAGES))
def test_evaluate_on_a_damaged_model_folder_is_one_line_naming_the_file(finished, tmp_path, capsys, damage):
    name, harm = DAMAGES[damage]
    model = _copy(finished / "final", tmp_path / "final")
    harm(model / name)
    line = _one_line(capsys, 2, evaluate_mod.main(["--model", str(model), "--limit", "2"]))
    assert line.startswith(f"error: model file {model / name} is damaged (")
    assert line.endswith("re-save or re-download the model")


@pytest.mark.parametrize("damage", ["model.safetensors truncated", "config.json truncated"])
def test_a_resume_from_a_damaged_checkpoint_is_one_line_and_changes_nothing(
    finished, tmp_path, capsys, damage
):
    name, harm = DAMAGES[damage]
    out = _copy(finished, tmp_path / "run")
    harm(out / "checkpoints" / "step_000002" / name)
    before = _tree(out)
    line = _one_line(capsys, 2, main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]))
    assert line.startswith(f"error: model file {out / 'checkpoints' / 'step_000002' / name} is damaged (")
    assert line.endswith("delete the folder to resume from the checkpoint before it")
    assert _tree(out) == before


def test_an_intact_model_folder_passes_the_check(finished):
    from grpo_fast.policy.checkpoint import check_model_folder

    check_model_folder(finished / "final", "unused")
    check_model_folder(finished / "checkpoints" / "step_000002", "unused")
    check_model_folder("builtin:tiny", "unused")  # not a folder: nothing to check


# ---------------------------------------------------------------------------- evaluate, plan


@pytest.mark.parametrize("limit", ["0", "-3"])
def test_evaluate_limit_below_1_is_refused(capsys, limit):
    line = _one_line(capsys, 2, evaluate_mod.main(["--model", "builtin:tiny", "--limit", limit]))
    assert line == f"error: --limit must be at least 1 (the problems to evaluate), got {limit}"


def test_evaluate_errors_name_the_flag_the_user_typed(capsys, tmp_path):
    line = _one_line(capsys, 2, evaluate_mod.main(["--model", "./no_such_model_here"]))
    assert line == "error: --model './no_such_model_here': no such folder"


@pytest.mark.parametrize("gb", ["0", "-5", "nan", "inf"])
def test_plan_gpu_mem_gb_must_be_a_card_size(capsys, gb):
    line = _one_line(capsys, 2, plan_mod.main(["--gpu-mem-gb", gb]))
    assert line.startswith("error: --gpu-mem-gb must be a card size in GB, above 0; got ")


def test_plan_refuses_a_card_below_the_smallest_plan_and_takes_one_above_it(capsys):
    cfg = load_config("rtx4090", check_device=False)
    need = plan_mod.smallest_need(cfg, plan_mod.arch_for(cfg), 24 * plan_mod.GB) / plan_mod.GB
    line = _one_line(capsys, 2, plan_mod.main(["--gpu-mem-gb", f"{need - 0.05:.2f}"]))
    assert line.startswith(
        f"error: a {need - 0.05:.1f} GB card is too small for preset 'rtx4090': its smallest plan "
        f"(microbatch 1, one sequence of vLLM KV cache) needs {need:.1f} GB; try a lower rollout.max_tokens"
    )
    assert plan_mod.main(["--gpu-mem-gb", f"{need + 0.05:.2f}"]) == 0
    out = capsys.readouterr().out
    assert "rollout.gpu_memory_utilization" in out and "0.000" not in out.splitlines()[-1]


# ---------------------------------------------------------------------------- the dry run stops as the run


def _dry_and_real(capsys, args: list[str]) -> tuple[str, str]:
    dry = _one_line(capsys, 2, main([*QUICK, "--dry-run", *args]))
    real = _one_line(capsys, 2, main([*QUICK, "steps=1", *args]))
    return dry, real


@pytest.mark.parametrize("case", ["output_dir a file", "output_dir under a file", "no model folder"])
def test_the_dry_run_exits_2_with_the_real_run_s_line(tmp_path, capsys, case):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    args = {
        "output_dir a file": [f"output_dir={blocker}"],
        "output_dir under a file": [f"output_dir={blocker / 'run'}"],
        "no model folder": [f"output_dir={tmp_path / 'run'}", f"model.name_or_path={tmp_path / 'nope'}"],
    }[case]
    dry, real = _dry_and_real(capsys, args)
    assert dry == real


def test_the_dry_run_stops_on_a_used_folder_and_a_changed_resume_as_the_run_does(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    before = _tree(out)
    dry, real = _dry_and_real(capsys, [f"output_dir={out}"])
    assert dry == real and "holds a run" in dry
    dry, real = _dry_and_real(capsys, [f"output_dir={out}", "resume=true", "seed=3"])
    assert dry == real and dry.startswith("error: resume: seed=3 but the run was made with 0.")
    assert _tree(out) == before


def test_the_dry_run_names_the_owner_of_a_folder_in_use(tmp_path, capsys):
    from grpo_fast import dist

    out = tmp_path / "run"
    out.mkdir()
    with run_folder.claim(out, load_config("tiny", overrides=[f"output_dir={out}"]), dist.DistInfo()):
        dry, real = _dry_and_real(capsys, [f"output_dir={out}"])
    assert dry == real and " is in use by pid " in dry


# ---------------------------------------------------------------------------- data files and YAML


def _data_args(path: Path, tmp_path: Path) -> list[str]:
    return [
        "data.task=gsm8k",
        f"data.train_path={path}",
        f"data.eval_path={path}",
        f"output_dir={tmp_path}/o",
    ]


def test_duplicate_json_keys_in_a_data_file_get_their_own_line(tmp_path, capsys):
    f = tmp_path / "train.jsonl"
    f.write_text('{"question": "1+1?", "answer": "2"}\n{"question": "a", "answer": "1", "question": "b"}\n')
    line = _one_line(capsys, 2, main([*QUICK, "--dry-run", *_data_args(f, tmp_path)]))
    assert line == (
        f"error: {f}:2: key 'question' appears twice in one object (JSON keeps the last one without "
        "a word): keep one"
    )


def test_a_folder_given_as_a_data_file_or_a_yaml_file_is_named_as_one(tmp_path, capsys):
    folder = tmp_path / "data.jsonl"
    folder.mkdir()
    line = _one_line(capsys, 2, main([*QUICK, "--dry-run", *_data_args(folder, tmp_path)]))
    assert line == f"error: {folder}: a folder, not a data file (give a .jsonl or .parquet file in it)"
    line = _one_line(capsys, 2, main([*QUICK, "--dry-run", "--config", str(folder)]))
    assert line == f"error: config file {folder} is a folder, not a YAML file"


VALID = [{"question": f"What is {i}+{i}?", "answer": f"so #### {2 * i}"} for i in range(1, 6)]


def _data_cases() -> list[tuple[str, bytes]]:
    rng = random.Random(0)
    good = "".join(json.dumps(r) + "\n" for r in VALID).encode()
    cases = [
        (f"random bytes {i}", bytes(rng.randrange(256) for _ in range(rng.randrange(1, 400))))
        for i in range(6)
    ]
    for i in range(6):  # cut inside the last record: an unfinished line
        last = good.rstrip(b"\n").rfind(b"\n") + 1
        cases.append((f"truncated {i}", good[: rng.randrange(last + 1, len(good) - 2)]))
    wrong = {
        "question a number": {"question": 5, "answer": "#### 1"},
        "question a list": {"question": ["a"], "answer": "#### 1"},
        "question null": {"question": None, "answer": "#### 1"},
        "question empty": {"question": " ", "answer": "#### 1"},
        "answer a list": {"question": "q", "answer": [1]},
        "answer an object": {"question": "q", "answer": {"a": 1}},
        "answer true": {"question": "q", "answer": True},
        "answer null": {"question": "q", "answer": None},
        "no answer": {"question": "q"},
        "a list, not an object": [1, 2],
        "a string": "q",
    }
    cases += [(k, (good.decode() + json.dumps(v) + "\n").encode()) for k, v in wrong.items()]
    cases.append(("deeply nested", b'{"question": ' + b"[" * 100000 + b"]" * 100000 + b"}\n"))
    cases.append(("NaN answer", good + b'{"question": "q", "answer": NaN}\n'))
    return cases


@pytest.mark.parametrize(("name", "content"), _data_cases(), ids=[c[0] for c in _data_cases()])
def test_fuzz_data_files_are_one_line_exit_2(tmp_path, capsys, name, content):
    f = tmp_path / "train.jsonl"
    f.write_bytes(content)
    line = _one_line(capsys, 2, main([*QUICK, "--dry-run", *_data_args(f, tmp_path)]))
    assert str(f) in line


def _yaml_cases() -> list[tuple[str, bytes]]:
    import yaml

    rng = random.Random(1)
    cases = [
        (f"random bytes {i}", bytes([0xFF]) + bytes(rng.randrange(256) for _ in range(rng.randrange(1, 300))))
        for i in range(5)
    ]
    alphabet = ":{}[]-,'\"\n #&*!|>%@`ab1"
    while len(cases) < 15:  # random YAML-ish text, keeping what is not a (trivially valid) empty config
        text = "".join(rng.choice(alphabet) for _ in range(rng.randrange(1, 60)))
        try:
            if yaml.safe_load(text) in (None, {}):
                continue
        except yaml.YAMLError:
            pass
        cases.append((f"random text {len(cases)}", text.encode()))
    wrong = {
        "steps a string": "steps: abc\n",
        "steps a list": "steps: [1, 2]\n",
        "seed huge": "seed: " + "9" * 400 + "\n",
        "section a number": "rollout: 5\n",
        "section a list": "model: [a, b]\n",
        "nested wrong": "train: {lr: {a: 1}}\n",
        "unknown key": "trian: {lr: 1}\n",
        "a date": "seed: 2024-01-01\n",
        "binary": "output_dir: !!binary aGVsbG8=\n",
        "top-level list": "- steps: 3\n",
        "bad tab": "steps:\t\t3\n  x: [\n",
        "python tag": "steps: !!python/object:os.system ls\n",
        "truncated": "rollout:\n  group_size: 8\n  batch_size: [1,\n",
        "deep": "steps: " + "[" * 5000 + "]" * 5000 + "\n",
    }
    cases += [(k, v.encode()) for k, v in wrong.items()]
    return cases


@pytest.mark.parametrize(("name", "content"), _yaml_cases(), ids=[c[0] for c in _yaml_cases()])
def test_fuzz_yaml_config_files_are_one_line_exit_2(tmp_path, capsys, name, content):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    _one_line(capsys, 2, main([*QUICK, "--dry-run", "--config", str(f), f"output_dir={tmp_path}/o"]))


# ---------------------------------------------------------------------------- sizes


def test_a_microbatch_larger_than_a_rank_s_batch_is_clamped_with_one_line(tmp_path, capsys):
    args = [*QUICK, "steps=1", "checkpoint_every=0", "train.micro_batch_size=1000"]
    assert main([*args, f"output_dir={tmp_path / 'big'}"]) == 0
    line = (
        "train.micro_batch_size=1000 is more than the 16 responses a rank trains on per step: "
        "microbatches of 16"
    )
    assert line in capsys.readouterr().err.splitlines()
    assert "micro_batch_size: 16" in (tmp_path / "big" / "config.yaml").read_text()
    assert main([*QUICK, "--dry-run", "train.micro_batch_size=1000", f"output_dir={tmp_path}/d"]) == 0
    assert f"  {line}" in capsys.readouterr().out.splitlines()


def test_a_megabyte_prompt_is_cut_before_tokenizing_and_printed_shortened(tmp_path, capsys, monkeypatch):
    from grpo_fast.task import tiny

    f = tmp_path / "train.jsonl"
    question = "1+1 " * 1_000_000  # 4 MB
    f.write_text(json.dumps({"question": question, "answer": "#### 2"}) + "\n")
    seen = []
    real = tiny.build_tokenizer

    def spy_tokenizer():
        tok = real()
        call = tok.__call__
        tok.__class__ = type(
            "Spy", (type(tok),), {"__call__": lambda s, t, **k: seen.append(len(t)) or call(t, **k)}
        )
        return tok

    monkeypatch.setattr(tiny, "build_tokenizer", spy_tokenizer)
    assert main([*QUICK, "--dry-run", *_data_args(f, tmp_path), "rollout.max_prompt_tokens=16"]) == 0
    out = capsys.readouterr().out
    longest = max(map(len, real().get_vocab()))
    assert seen and max(seen) <= (16 + 16) * longest  # the tokenizer never saw the 4 MB
    assert max(map(len, out.splitlines())) < 1000 and "more characters] …" in out
    assert "as the model sees it: 16 tokens" in out
