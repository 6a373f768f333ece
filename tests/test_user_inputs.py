"""Bad and hostile inputs: each is one ``error:`` line and exit code 2, never a traceback, and
nothing in a run folder changes. Damaged model files, planner and evaluate arguments, the dry
run's stops (the real run's, with the same lines), data files and YAML (a fuzz pass), command-line
overrides (prompt templates, devices, the Triton kernels, absurd integers; a fuzz pass), a resume
after a cut metrics line, a microbatch larger than the batch, a data line of megabytes."""

from __future__ import annotations

import dataclasses
import json
import random
from pathlib import Path

import pytest
import torch
from hypothesis import HealthCheck, Phase, example, given, settings
from hypothesis import strategies as st
from run_folders import QUICK, finished_run
from run_folders import copy_folder as _copy
from run_folders import tree as _tree
from support.inprocess import run_main

from grpo_fast.config import Config, _is_section, load_config
from grpo_fast.config_checks import devices_here
from grpo_fast.errors import ConfigError
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
    assert line.endswith("delete the folder to resume from the checkpoint before it, step_000001")
    assert _tree(out) == before


def test_a_resume_after_metrics_jsonl_was_cut_inside_a_line_works_and_says_so(finished, tmp_path, capsys):
    """What a SIGKILL or a full disk during a write leaves: the last row cut short. The resume drops
    that line (its step is redone from the checkpoint), says so, and goes on."""
    out = _copy(finished, tmp_path / "run")
    metrics = out / "metrics.jsonl"
    lines = metrics.read_text().splitlines()
    assert [json.loads(ln)["step"] for ln in lines] == [1, 2]
    metrics.write_text(lines[0] + "\n" + lines[1][: len(lines[1]) // 2])  # cut inside row 2
    assert main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]) == 0
    err = capsys.readouterr().err
    assert (
        f"resume: dropped 1 unreadable line(s) of {metrics} (line 2: cut short, as a run killed "
        "mid-write leaves it)"
    ) in err.splitlines()
    rows = [json.loads(ln) for ln in metrics.read_text().splitlines()]
    assert [r["step"] for r in rows] == [1, 3] and rows[0] == json.loads(lines[0])


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
        "a float key 10^400": "sft: {mix_coef: " + "9" * 400 + "}\n",  # beyond a float: OverflowError
        "a mapping into a list": "train: {betas: {a: 1}}\n",  # TypeError in the merge
    }
    cases += [(k, v.encode()) for k, v in wrong.items()]
    return cases


@pytest.mark.parametrize(("name", "content"), _yaml_cases(), ids=[c[0] for c in _yaml_cases()])
def test_fuzz_yaml_config_files_are_one_line_exit_2(tmp_path, capsys, name, content):
    f = tmp_path / "c.yaml"
    f.write_bytes(content)
    _one_line(capsys, 2, main([*QUICK, "--dry-run", "--config", str(f), f"output_dir={tmp_path}/o"]))


# ---------------------------------------------------------------------------- command-line overrides


@pytest.mark.parametrize(
    ("typed", "template"),
    [
        ("{question} Answer:", "{question} Answer:"),  # YAML read it as a mapping: a traceback
        ("{question}{oops}", "{question}{oops}"),  # braces besides {question} are text
        ("Q: {question}", "Q: {question}"),  # a colon and a space
        ('"Q: {question}\\nA:"', "Q: {question}\nA:"),  # in quotes: YAML's escapes
        ("{question} # 1", "{question} # 1"),  # not a YAML comment
    ],
)
def test_a_custom_prompt_template_on_the_command_line_is_the_text_as_typed(tmp_path, capsys, typed, template):
    """README and docs/tasks.md: "any string holding {question}", given as
    data.prompt_template=...: the run uses exactly that text (the dry run shows its prompt). A
    model whose tokenizer writes any text (the tiny one refuses these characters:
    tests/test_dry_run_refuses.py)."""
    assert load_config("tiny", overrides=[f"data.prompt_template={typed}"]).data.prompt_template == template
    anything = "model.name_or_path=Qwen/Qwen2.5-Math-1.5B"
    code = main(
        [*QUICK, "--dry-run", anything, f"data.prompt_template={typed}", f"output_dir={tmp_path / 'run'}"]
    )
    out = capsys.readouterr().out
    assert code == 0 and f"template {template!r}" in out
    prompt = out.split("sample prompt (")[1].splitlines()[1].strip()
    assert prompt == repr(template.replace("{question}", "75+60="))  # the tiny task's train[0]


def test_an_invalid_prompt_template_is_one_line_naming_the_key(tmp_path, capsys):
    line = _one_line(capsys, 2, main([*QUICK, "data.prompt_template=Answer:", f"output_dir={tmp_path}"]))
    assert line == (
        "error: data.prompt_template: unknown prompt template 'Answer:': use one of math_tir, "
        "question_only, r1_zero, or a custom template string containing {question}"
    )


@pytest.mark.parametrize("device", ["banana", "meta", "mps", "cuda:x", "cpu:0", "cuda:-1", "CPU"])
def test_a_device_this_machine_does_not_run_is_one_line(tmp_path, capsys, device):
    """torch.device raised (banana), or .item() did later (meta, mps): now the config's line, naming
    the key and what this machine takes."""
    line = _one_line(capsys, 2, main([*QUICK, f"device={device}", f"output_dir={tmp_path}"]))
    assert line == f"error: device={device!r} is not one of: auto, cpu, cuda, cuda:N ({devices_here()})"
    assert not any(tmp_path.iterdir())


def test_a_cuda_device_past_the_last_gpu_is_one_line(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    assert load_config("tiny", overrides=["device=cuda:0"]).device == "cuda:0"
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=["device=cuda:1"])
    assert str(err.value) == "device='cuda:1' is not on this machine (this machine: auto, cpu, cuda, cuda:0)"


def test_resolve_device_names_a_device_this_machine_does_not_run():
    """A config built without the checks (dataclasses.replace) meets the same line at the device."""
    from grpo_fast.policy.model import resolve_device

    cfg = load_config("tiny")
    assert resolve_device(cfg) == torch.device("cpu")
    for device in ("mps", "banana", *(["cuda"] if not torch.cuda.is_available() else [])):
        with pytest.raises(ConfigError, match=f"device='{device}' is not one this machine runs"):
            resolve_device(dataclasses.replace(cfg, device=device))


def test_the_triton_kernels_on_a_cpu_without_the_interpreter_is_one_line(tmp_path, capsys, monkeypatch):
    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the Triton kernels run")
    assert load_config("tiny", overrides=["loss.kernel_backend=triton"]).loss.kernel_backend == "triton"
    monkeypatch.delenv("TRITON_INTERPRET")
    line = _one_line(capsys, 2, main([*QUICK, "loss.kernel_backend=triton", f"output_dir={tmp_path}"]))
    assert line == (
        "error: loss.kernel_backend=triton needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is "
        "imported to run under the interpreter; device=cpu"
    )
    assert not any(tmp_path.iterdir())


@pytest.mark.parametrize(
    ("override", "line"),
    [
        (
            "steps=99999999999999999999999",  # planned "about 63837894527776161792.0 h"
            "error: steps must be <= 100000000, got 99999999999999999999999: 10^8 steps is 58 days at "
            "the tiny preset's fastest, 0.05 s a step (published GRPO runs take thousands)",
        ),
        (
            "rollout.batch_size=99999999999999999992",  # printed its plan, then hung
            "error: rollout.batch_size must be <= 1048576, got 99999999999999999992: 2^20 = 1,048,576 "
            "sequences, 128 times the largest published GRPO batch (8,192 responses a step)",
        ),
        (
            "rollout.max_tokens=10000000000",
            "error: rollout.max_tokens must be <= 1048576, got 10000000000: 2^20 = 1,048,576 tokens, "
            "8 times the longest context of the models trained here (131,072)",
        ),
    ],
)
def test_an_absurd_integer_is_one_line_naming_the_key_and_the_bound(tmp_path, capsys, override, line):
    """The dry run (which printed the plan for these) and the real run stop on the same line."""
    assert _one_line(capsys, 2, main([*QUICK, "--dry-run", override, f"output_dir={tmp_path}"])) == line
    assert _one_line(capsys, 2, main([*QUICK, override, f"output_dir={tmp_path}"])) == line


def _leaf_keys(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        if _is_section(f):
            keys += _leaf_keys(type(f.default_factory()), f"{prefix}{f.name}.")
        else:
            keys.append(f"{prefix}{f.name}")
    return keys


# Every key, and an entry of each dict-valued key; the values a shell lets through: YAML's flow
# and block syntax, tags, anchors, interpolations, quotes, numbers past every range, unicode.
FUZZ_KEYS = [*_leaf_keys(), "health.thresholds.entropy_warn_low", "rollout.vllm_kwargs.enforce_eager"]
FUZZ_WORDS = [
    *("", " ", "{", "}", "[", "]", "{}", "[]", "{question}", "{question}{oops}", "'", '"', '"x', "${oops}"),
    *("9" * 400, "-" + "9" * 30, "1e400", "-1e400", "nan", ".inf", "null", "~", "true", "no", "[1,2"),
    *("{a: 1}", "!!python/object:os.system ls", "!!binary aGVsbG8=", "&a [*a]", "*a", "2024-01-01"),
    *("0x1F", "a: b", "- x", "[" * 2000, "{" * 2000, "? a", "---", "|", "@", "`", "a #b", "\t", "1_000"),
    *("ü", "🙂", "\x00", "\n", "cuda:99999", "meta", "mps", "auto", "triton", "vllm", "[a, [b, {c: 1}]]"),
]
FUZZ_VALUES = st.one_of(
    st.sampled_from(FUZZ_WORDS),
    st.text(st.sampled_from([*":{}[]'\",=#&*!|>%@`~$\\ -_.\t\n0123456789aeu", "ü", "\x00"]), max_size=30),
    st.text(max_size=20),
    st.integers(-(10**30), 10**30).map(str),
    st.integers(-(10**400), 10**400).map(str),  # past a float's range too
    st.floats().map(repr),
)


@settings(
    max_examples=250,  # ≈ 20 s at load 10 on 2 cores (≈ 80 ms a load_config)
    derandomize=True,
    database=None,
    deadline=None,
    phases=[Phase.explicit, Phase.generate],
    suppress_health_check=[HealthCheck.too_slow],
)
@given(key=st.sampled_from(FUZZ_KEYS), value=FUZZ_VALUES)
@example(key="data.prompt_template", value="{question} Answer:")  # the tracebacks it found, kept
@example(key="sft.mix_coef", value="9" * 400)
@example(key="health.thresholds.entropy_warn_low", value="-" + "9" * 400)
@example(key="train.grad_clip", value="1" + "0" * 309)
def test_fuzz_command_line_overrides_are_a_config_or_one_line(key, value):
    """A random value for a random key, through the CLI's config loading: a Config, or a
    ConfigError of one line naming the key (its leaf for a relation between keys). Tracebacks
    it found: a YAML ParserError for text keys, OverflowError for a float key past 1.8e308,
    TypeError for a mapping merged into a list, IndexError for a key of brackets."""
    try:
        cfg = load_config("tiny", overrides=[f"{key}={value}"])
    except ConfigError as exc:
        msg = str(exc)
        assert msg and "\n" not in msg, msg
        assert key.rsplit(".", 1)[-1] in msg, msg
    else:
        assert isinstance(cfg, Config)


@pytest.mark.parametrize(
    "key",
    ["", ".", "a..b", "steps[0]", "train.betas[0]", "train.betas.0", "[x}y", "${x}", "ü", "a b", "-steps"],
)
def test_an_override_key_that_is_not_a_dotted_name_is_one_line(key):
    with pytest.raises(ConfigError) as err:
        load_config("tiny", overrides=[f"{key}=1"])
    assert "\n" not in str(err.value) and repr(key) in str(err.value)


def test_hostile_overrides_through_the_command_line(tmp_path):
    """Two of the fuzz's values through `python -m grpo_fast.train --dry-run`'s ``main(argv)``, in
    this process (tests/support/inprocess.py; as two processes: 48 s at load 12 on 2 cores): the
    template works; the absurd batch is one line and exit 2 (no traceback, no plan)."""
    run = lambda *a: run_main([*QUICK, "--dry-run", f"output_dir={tmp_path}", *a])
    works = run("data.prompt_template={question}{oops}", "model.name_or_path=Qwen/Qwen2.5-Math-1.5B")
    assert works.returncode == 0 and "'75+60={oops}'" in works.stdout, works.stderr[-2000:]
    refused = run("rollout.batch_size=99999999999999999992")
    assert refused.returncode == 2 and refused.stdout == ""
    assert refused.stderr.splitlines() == [
        "error: rollout.batch_size must be <= 1048576, got 99999999999999999992: 2^20 = 1,048,576 "
        "sequences, 128 times the largest published GRPO batch (8,192 responses a step)"
    ]


# ---------------------------------------------------------------------------- the tiny task's files


def test_a_tiny_task_file_s_errors_speak_of_the_tiny_task_and_name_the_line(tmp_path, capsys):
    """A tiny-task data file: an answer that is not one (main at 54b861a: GSM8K's "no '####'
    answer found"), characters the built-in tokenizer does not know (main: silently <unk>).
    Planted: load_examples without its alphabet check → the spaces pass."""
    f = tmp_path / "train.jsonl"
    args = [*QUICK, "--dry-run", f"data.train_path={f}", f"output_dir={tmp_path}/o"]
    cases = {
        '{"question": "1+2=", "answer": "3"}\n{"question": "2+2=", "answer": "four"}\n': (
            f"error: {f}:2: the answer 'four' holds 'foru', which the tokenizer does not know (it knows "
            "only '0123456789+='): it would become <unk>"
        ),
        '{"question": "37 + 45 =", "answer": "82"}\n': (
            f"error: {f}:1: the question '37 + 45 =' holds ' ', which the tokenizer does not know (it "
            "knows only '0123456789+='): it would become <unk>"
        ),
        '{"question": "1+2=", "answer": " "}\n': f"error: {f}:1: empty answer in field 'answer'",
    }
    for text, want in cases.items():
        f.write_text(text)
        assert _one_line(capsys, 2, main(args)) == want


def test_a_tiny_task_file_takes_any_character_another_tokenizer_knows(finished, tmp_path):
    """The check is the built-in tokenizer's: a tiny run's own folder has it too; another
    model's tokenizer (whatever it is) is not checked."""
    from grpo_fast.task import tiny
    from grpo_fast.task.loader import load_task

    f = tmp_path / "train.jsonl"
    f.write_text('{"question": "2 + 2 =", "answer": "four"}\n')
    assert tiny.has_builtin_tokenizer(str(finished / "final"))
    assert not tiny.has_builtin_tokenizer("Qwen/Qwen2.5-Math-1.5B")
    cfg = load_config("tiny", overrides=[f"data.train_path={f}", "model.name_or_path=Qwen/Qwen2.5-Math-1.5B"])
    assert [(e.question, e.answer, e.solution) for e in load_task(cfg).train] == [("2 + 2 =", "four", "four")]


def test_the_plan_line_says_the_evaluation_stays_on_the_built_in_problems(tmp_path):
    """data.train_path without data.eval_path: the evaluations are the built-in problems' (the
    tiny task) or the Hub's test split; the plan line says so. Planted: no _eval_source → silent."""
    from grpo_fast import dist
    from grpo_fast.loop import setup as setup_mod

    class Events:
        def __init__(self):
            self.lines = []

        def event(self, line):
            self.lines.append(line)

    f = tmp_path / "train.jsonl"
    f.write_text('{"question": "1+2=", "answer": "3"}\n')
    cpu = __import__("torch").device("cpu")
    for extra, words in (
        ([], ", an evaluation every 25 steps on the built-in eval problems (data.eval_path is not set);"),
        ([f"data.eval_path={f}"], ", an evaluation every 25 steps;"),
        (
            ["data.task=gsm8k"],
            ", an evaluation every 25 steps on openai/gsm8k [test] (data.eval_path is not set);",
        ),
    ):
        events = Events()
        setup_mod._announce_plan(
            load_config("tiny", overrides=[f"data.train_path={f}", *extra]), dist.DistInfo(), events, cpu
        )
        assert words in events.lines[0], events.lines


# ---------------------------------------------------------------------------- runs that would do the wrong thing

WRONG = {  # main at 54b861a ran each, exit 0: NaN steps, no evaluation, no final_merged
    "fp16 weights": (
        ["model.dtype=float16"],
        "error: model.dtype=float16 keeps the weights that train in fp16 (the whole model trains): AdamW "
        "then computes its step in fp16, where its eps=1e-8 rounds to 0",
    ),
    "fp16 base made by the warm start": (
        ["model.dtype=float16", "model.lora.r=8", "sft.steps=20"],
        "error: model.dtype=float16 keeps the weights that train in fp16 (the warm start trains the whole "
        "model (sft.target=base)): ",
    ),
    "an evaluation of no problem": (
        ["eval_every=2", "data.eval_subset_size=0"],
        "error: data.eval_subset_size=0 with eval_every=2: the evaluation every 2 steps would evaluate no "
        "problem; set eval_every=0 to turn it off",
    ),
    "save_merged without LoRA": (
        ["train.save_merged=true"],
        "error: train.save_merged=true merges a LoRA adapter into its base (output_dir/final_merged) and "
        "needs model.lora.r > 0; without LoRA, output_dir/final is the whole model already",
    ),
}


@pytest.mark.parametrize("case", list(WRONG))
def test_a_run_that_would_do_the_wrong_thing_is_refused_in_one_line(tmp_path, capsys, case):
    """Planted: each check taken out of config_checks → the run trains (exit 0)."""
    extra, start = WRONG[case]
    out = tmp_path / "run"
    line = _one_line(capsys, 2, main([*QUICK, "steps=2", *extra, f"output_dir={out}"]))
    assert line.startswith(start) and not out.exists()


def test_what_those_checks_leave_alone_loads():
    """fp16 under LoRA (the frozen base in fp16, the adapter fp32), no evaluation, a merged LoRA."""
    for ok in (
        ["model.dtype=float16", "model.lora.r=8", "sft.steps=0"],
        ["model.dtype=float16", "model.lora.r=8", "sft.target=adapter"],
        ["eval_every=0", "data.eval_subset_size=0"],
        ["train.save_merged=true", "model.lora.r=8"],
    ):
        load_config("tiny", overrides=ok)


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

    def spy_tokenizer(*name):  # tiny.build_tokenizer(name=BUILTIN_NAME)
        tok = real(*name)
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
