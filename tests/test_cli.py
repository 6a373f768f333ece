"""The ``grpo-fast`` entry point: every subcommand's help and one real invocation, the dry run,
options after overrides, extending a finished run, the bf16 final model, and the Makefile."""

import json
import os
import shutil
import subprocess
import sys
import time
import types
from pathlib import Path

import pytest
import torch
from support.inprocess import one_error_line, run_main

from grpo_fast import cli
from grpo_fast.config import PRESETS
from grpo_fast.policy import model as model_mod
from grpo_fast.train import parse_args

ROOT = Path(__file__).resolve().parents[1]
QUICK = [
    "steps=4",
    "sft.steps=30",
    "eval_every=2",
    "checkpoint_every=3",  # 4 is not a multiple: the final step's checkpoint comes from the end of the run
    "rollout.batch_size=32",
    "data.eval_subset_size=32",
    "logging.progress=false",
]


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _grpo_fast(*args: str, timeout: int = 120) -> subprocess.CompletedProcess:
    """The installed console script (next to this interpreter), output captured."""
    script = Path(sys.executable).with_name("grpo-fast")
    cmd = [str(script)] if script.exists() else [sys.executable, "-m", "grpo_fast.cli"]
    return subprocess.run([*cmd, *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    """A finished 4-step tiny run through ``grpo-fast train`` (in-process), with its metrics."""
    out = tmp_path_factory.mktemp("run")
    assert cli.main(["train", "--preset", "tiny", f"output_dir={out}", *QUICK]) == 0
    return out, _rows(out / "metrics.jsonl")


# ----------------------------------------------------------------------------------------------
# help and dispatch
# ----------------------------------------------------------------------------------------------


def test_top_level_help_lists_commands_presets_and_keys():
    res = _grpo_fast("--help")
    assert res.returncode == 0, res.stderr
    for name in (*cli.COMMANDS, *PRESETS):
        assert name in res.stdout
    assert any(line.split()[:2] == ["train", "lr"] for line in res.stdout.splitlines())
    assert "save_dtype" in res.stdout


@pytest.mark.parametrize("command", list(cli.COMMANDS))
def test_each_subcommand_has_help(command, capsys):
    with pytest.raises(SystemExit) as exc:
        cli.main([command, "--help"])
    assert exc.value.code == 0
    text = capsys.readouterr().out
    assert text.startswith("usage:")
    if command == "train":
        assert "grpo-fast train" in text and "--dry-run" in text
    if command in ("train", *cli.WITH_PRESETS):
        assert all(f"  {name} " in text for name in PRESETS) and "micro_batch_size" in text


def test_unknown_command_is_one_line_exit_2():
    res = _grpo_fast("trian")
    assert res.returncode == 2
    assert res.stderr.strip().splitlines() == [
        "error: unknown command 'trian'; commands: train, evaluate, plan, report, sweep, doctor, sandbox"
    ]


def test_subcommand_equals_its_module_form():
    args = ["plan", "--preset", "rtx4090", "--gpu-mem-gb", "24", "train.micro_batch_size=auto"]
    via_cli = _grpo_fast(*args)
    via_module = subprocess.run(
        [sys.executable, "-m", "grpo_fast.tools.plan", *args[1:]],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert via_cli.returncode == via_module.returncode == 0, via_cli.stderr
    assert via_cli.stdout == via_module.stdout
    assert "train.micro_batch_size" in via_cli.stdout
    # its error path in this process (tests/support/inprocess.py); the console script's exit path
    # with a one-line error is test_unknown_command_is_one_line_exit_2's
    bad = run_main(["plan", "--preset", "tiny", "train.lrr=1"], cli.main)
    assert "did you mean 'train.lr'" in one_error_line(bad)


@pytest.mark.xdist_group("finished_run")  # one run for the three (make test: -n 2)
def test_evaluate_sweep_and_report_run(finished_run, tmp_path, capsys):
    out, _ = finished_run
    records = tmp_path / "records.jsonl"
    model = ["--model", str(out / "final")]
    assert cli.main(["evaluate", *model, "--preset", "tiny", "--limit", "16", "--out", str(records)]) == 0
    metrics = json.loads(capsys.readouterr().out)
    rewards = [json.loads(x)["reward"] for x in records.read_text().splitlines()]
    assert metrics["eval/num_examples"] == len(rewards) == 16
    assert metrics["eval/accuracy"] == pytest.approx(sum(rewards) / 16)  # the mean of what was graded

    assert cli.main(["sweep", "--preset", "tiny", "--sweep", "baseline", "--dry-run", "steps=2"]) == 0
    commands = capsys.readouterr().out.splitlines()
    assert commands and all(
        "-m grpo_fast.train" in c and "loss.type=" in c and "steps=2" in c for c in commands
    )

    assert cli.main(["report", str(out), "--out", str(tmp_path / "report")]) == 0
    assert (tmp_path / "report" / "summary.md").is_file()


@pytest.mark.parametrize("mode", [[], ["--dry-run"], ["--plot-only"]])
def test_a_sweep_whose_out_is_a_file_stops_with_one_line_before_any_run(tmp_path, capsys, monkeypatch, mode):
    """``--out`` checked first (main at 54b861a: every arm ran, then a FileExistsError traceback).
    Planted: no ``check_out`` → the arms run and summarize_sweep raises."""
    from grpo_fast.obs import sweep

    ran = []
    monkeypatch.setattr(sweep, "run_sweep", lambda runs: ran.append(runs) or {r.name: 0 for r in runs})
    out = tmp_path / "results.txt"
    out.write_text("mine\n")
    args = ["sweep", "--preset", "tiny", "--sweep", "baseline", *mode, "steps=1"]
    assert cli.main([*args, "--out", str(out)]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out={str(out)!r} cannot be created: File exists"
    ]
    assert cli.main([*args, "--out", str(out / "sweep")]) == 2  # under a file
    assert capsys.readouterr().err.splitlines() == [
        f"error: --out={str(out / 'sweep')!r} cannot be created: Not a directory"
    ]
    assert ran == [] and out.read_text() == "mine\n" and sorted(tmp_path.iterdir()) == [out]


MY_REWARDS = """
def exact(response, ground_truth):
    with open("calls.txt", "a") as fh:  # what the test reads: the function scored the responses
        fh.write(ground_truth + "\\n")
    ok = float(response.strip() == ground_truth.strip())
    return {"reward": ok, "answer_reward": ok}
"""


@pytest.mark.parametrize("script", ["grpo-fast", "grpo-fast-train"])
def test_the_documented_custom_reward_imports_from_the_working_directory_under_the_console_script(
    tmp_path, script
):
    """``grpo-fast train data.reward=my_rewards:exact`` with my_rewards.py in the working directory
    (docs/tasks.md), through the installed console script, as ``python -m`` runs it (main at
    54b861a: "No module named 'my_rewards'"). Planted: no ``cwd_on_path`` in ``entry`` → exit 2."""
    path = Path(sys.executable).with_name(script)
    if not path.exists():
        pytest.skip(f"no {script} console script beside {sys.executable} (pip install -e .)")
    (tmp_path / "my_rewards.py").write_text(MY_REWARDS)
    command = [str(path), "train"] if script == "grpo-fast" else [str(path)]
    quick = ["--preset", "tiny", "sft.steps=0", "eval_every=0", "steps=1", "rollout.batch_size=16"]
    quick += ["train.micro_batch_size=16", "logging.progress=false", "data.reward=my_rewards:exact"]
    env = {**os.environ, "PYTHONPATH": str(ROOT), "OMP_NUM_THREADS": "1"}  # this tree's grpo_fast
    out = tmp_path / "run"
    res = subprocess.run(
        [*command, *quick, f"output_dir={out}"],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert res.returncode == 0, res.stderr[-2000:]
    assert len((tmp_path / "calls.txt").read_text().splitlines()) == 16  # it scored step 1's responses


# ----------------------------------------------------------------------------------------------
# options and overrides in any order
# ----------------------------------------------------------------------------------------------


def test_config_file_after_overrides_is_accepted():
    args = parse_args(["steps=3", "--config", "configs/dapo.yaml", "train.lr=1e-5", "--preset", "tiny"])
    assert args.config == ["configs/dapo.yaml"]
    assert args.overrides == ["steps=3", "train.lr=1e-5"]
    assert args.preset == "tiny"


# ----------------------------------------------------------------------------------------------
# dry run
# ----------------------------------------------------------------------------------------------


def test_dry_run_prints_sources_plan_and_data_and_loads_no_model(monkeypatch, capsys, tmp_path):
    def no_model(*a, **k):
        raise AssertionError("the dry run loaded a model")

    monkeypatch.setattr(model_mod, "load_policy", no_model)
    monkeypatch.setattr(model_mod, "load_tokenizer", no_model)
    code = cli.main(
        [
            "train",
            "steps=3",
            "model.name_or_path=/nonexistent/model",
            f"output_dir={tmp_path / 'run'}",
            "--config",
            str(ROOT / "configs" / "dapo.yaml"),
            "--dry-run",
        ]
    )
    captured = capsys.readouterr()
    assert code == 2  # the real run would stop on the missing folder: the same line
    assert captured.err == "error: model.name_or_path='/nonexistent/model': no such folder\n"
    out = captured.out
    lines = {line.split("=")[0].strip(): line for line in out.splitlines() if " = " in line}
    assert lines["steps"].endswith("# override") and "= 3 " in lines["steps"]
    assert lines["seed"].endswith("# default")
    assert lines["train.lr"].endswith("# preset tiny")
    assert (
        lines["loss.length_norm"].endswith(f"# file {ROOT / 'configs' / 'dapo.yaml'}")
        and "'token_mean'" in lines["loss.length_norm"]
    )
    assert lines["model.name_or_path"].endswith("# override")
    assert "train.micro_batch_size=256" in out  # the CPU branch of the planner's resolution
    assert "task tiny: 9500 train / 500 eval examples" in out
    assert "per step: 32 prompts × 8 responses" in out
    # the tokenizer of a missing folder cannot load: said, and the text prompt printed
    assert "tokenizer not loaded" in out and "no such folder" in out
    assert "'75+60='" in out
    assert "no model was loaded" in out


def test_dry_run_shows_the_prompt_as_tokens_with_the_builtin_tokenizer(capsys, tmp_path):
    assert cli.main(["train", "--dry-run", "--preset", "tiny", f"output_dir={tmp_path / 'run'}"]) == 0
    out = capsys.readouterr().out
    assert "as the model sees it: 6 tokens" in out  # "75+60=" is one token per character
    assert "'7' '5' '+' '6' '0' '='" in out


def test_dry_run_of_a_gpu_preset_on_a_cpu_plans_24_gb_and_says_it_cannot_run(capsys, tmp_path):
    if torch.cuda.is_available():
        pytest.skip("checks the CPU-machine message")
    train = tmp_path / "train.jsonl"
    train.write_text('{"problem": "What is 1+1?", "solution": "\\\\boxed{2}"}\n')
    code = cli.main(
        ["train", "--preset", "rtx4090", "--dry-run", f"data.train_path={train}", f"data.eval_path={train}"]
    )
    captured = capsys.readouterr()
    assert code == 2
    assert "no GPU here: planned for a 24 GB card" in captured.out
    assert "rollout.gpu_memory_utilization" in captured.out and "training peak" in captured.out
    assert "error: preset 'rtx4090' needs a CUDA GPU" in captured.err


def test_dry_run_in_a_fresh_process_loads_no_model(tmp_path):
    """What keeps the dry run to seconds: in a fresh process it resolves the tiny preset without
    building its model, and a model that does not exist is only named, never read: exit 2 (the
    real run would stop on it) with its one-line error, no traceback. Its wall time is not
    asserted here."""
    run = lambda *extra: subprocess.run(
        [sys.executable, "-m", "grpo_fast.train", "--dry-run", f"output_dir={tmp_path / 'run'}", *extra],
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    res = run()
    assert res.returncode == 0, res.stderr
    assert "no model was loaded" in res.stdout
    missing = run("model.name_or_path=/no/such/model")
    assert "no model was loaded" in missing.stdout and "/no/such/model" in missing.stdout
    # the dry run's checks of what the real run would stop on (dry_run._run_problems) find the
    # missing folder: exit 2 and that one error line
    assert missing.returncode == 2, missing.stderr
    assert missing.stderr.strip().splitlines() == [
        "error: model.name_or_path='/no/such/model': no such folder"
    ], missing.stderr


def test_bad_override_in_dry_run_is_one_line_exit_2(capsys):
    assert cli.main(["train", "--dry-run", "train.save_dtype=int8"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "train.save_dtype='int8' is not one of" in err[0]


# ----------------------------------------------------------------------------------------------
# extending a finished run; the final model's dtype
# ----------------------------------------------------------------------------------------------


@pytest.mark.xdist_group("finished_run")  # one run for the three (make test: -n 2)
def test_finished_run_leaves_a_checkpoint_of_its_final_step(finished_run):
    out, rows = finished_run
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    names = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert names == ["step_000003", "step_000004"]  # 3 from the loop, 4 = the final step
    from safetensors.torch import load_file

    final = load_file(out / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.float32}  # train.save_dtype=auto: as trained


@pytest.mark.xdist_group("finished_run")  # one run for the three (make test: -n 2)
def test_resume_extends_a_finished_run_from_its_final_step_and_saves_bf16(finished_run, tmp_path, capsys):
    out, rows = finished_run
    run = tmp_path / "extended"
    shutil.copytree(out, run)
    code = cli.main(
        ["train", f"output_dir={run}", *QUICK, "resume=true", "steps=6", "train.save_dtype=bfloat16"]
    )
    assert code == 0
    assert f"resumed from {run / 'checkpoints' / 'step_000004'} at step 4" in capsys.readouterr().err
    extended = _rows(run / "metrics.jsonl")
    assert [r["step"] for r in extended] == [0, 1, 2, 3, 4, 5, 6]
    assert extended[:5] == rows  # steps 1-4 are kept as logged, not trained again
    from safetensors.torch import load_file

    final = load_file(run / "final" / "model.safetensors")
    assert {t.dtype for t in final.values()} == {torch.bfloat16}
    assert json.loads((run / "final" / "config.json").read_text())["dtype"] == "bfloat16"
    # the checkpoint keeps the fp32 master weights: an exact resume point
    ckpt = load_file(run / "checkpoints" / "step_000006" / "model.safetensors")
    assert {t.dtype for t in ckpt.values()} == {torch.float32}
    from transformers import AutoModelForCausalLM

    served = AutoModelForCausalLM.from_pretrained(run / "final", dtype="auto")
    assert served.dtype == torch.bfloat16
    master = {k: v for k, v in ckpt.items()}
    for name, t in final.items():
        torch.testing.assert_close(t, master[name].to(torch.bfloat16), rtol=0, atol=0)


class _FakeWandb:
    """Stands in for the wandb module (not installed here): records ``init`` and ``log`` calls."""

    def __init__(self):
        self.inits: list[dict] = []
        self.logged: list[list[int]] = []

    def init(self, **kwargs):
        self.inits.append(kwargs)
        steps: list[int] = []
        self.logged.append(steps)
        return types.SimpleNamespace(log=lambda row, step: steps.append(step), finish=lambda: None)


def test_wandb_resume_continues_the_same_run(tmp_path, monkeypatch):
    fake = _FakeWandb()
    monkeypatch.setitem(sys.modules, "wandb", fake)
    out = tmp_path / "run"
    common = [f"output_dir={out}", *QUICK, "logging.wandb=true", "eval_every=0", "checkpoint_every=2"]
    assert cli.main(["train", *common, "steps=2"]) == 0
    assert cli.main(["train", *common, "steps=4", "resume=true"]) == 0
    first, second = fake.inits
    assert first["id"] == second["id"] == (out / "wandb_run_id").read_text().strip()
    assert second["resume"] == "allow" and first["mode"] == "offline"  # no WANDB_API_KEY here
    assert fake.logged == [[1, 2], [3, 4]]  # the resumed run logs on from step 3 into the same run
    assert cli.main(["train", *common, "steps=2", "overwrite=true"]) == 0  # a new run there: a new id
    assert fake.inits[2]["id"] != first["id"]


# ----------------------------------------------------------------------------------------------
# the Makefile in a clean directory
# ----------------------------------------------------------------------------------------------


@pytest.mark.fresh_env
@pytest.mark.skipif(shutil.which("make") is None or shutil.which("git") is None, reason="needs make and git")
def test_make_run_and_make_test_in_a_clean_directory(tmp_path):
    """The README's two commands in a clean copy of the committed tree (as a fresh clone has
    it): ``make run`` builds a fresh ``.venv`` (pip's cache may serve the wheels) and trains;
    ``make test`` reuses it and runs ruff and pytest (here on one test module: the whole suite
    is what ``.ci/run`` runs through ``make test``, and would include this test)."""
    clean = tmp_path / "grpo_fast"
    clean.mkdir()
    archive = subprocess.run(["git", "archive", "HEAD"], cwd=ROOT, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(clean)], input=archive, check=True)
    env = {k: v for k, v in os.environ.items() if k not in ("VIRTUAL_ENV", "PYTHONPATH")}
    env["PATH"] = os.pathsep.join(p for p in env["PATH"].split(os.pathsep) if not p.startswith(str(ROOT)))
    short = "ARGS=steps=2 sft.steps=20 eval_every=0 checkpoint_every=0 rollout.batch_size=16 logging.progress=false"
    t0 = time.perf_counter()
    res = subprocess.run(
        ["make", "run", short], cwd=clean, env=env, capture_output=True, text=True, timeout=1500
    )
    t_run = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    assert (clean / ".venv" / "bin" / "grpo-fast").is_file()
    assert (clean / "runs" / "tiny" / "final" / "model.safetensors").is_file()
    t0 = time.perf_counter()
    res = subprocess.run(
        ["make", "test", "PYTEST_ARGS=-q tests/test_config.py"],
        cwd=clean,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    t_test = time.perf_counter() - t0
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-2000:]
    assert "All checks passed" in res.stdout + res.stderr and " passed" in res.stdout
    print(f"make run: {t_run:.0f} s (fresh .venv); make test (one module): {t_test:.0f} s")
