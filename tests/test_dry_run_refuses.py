"""The dry run refuses what the run refuses before it trains, with the run's own line: each bad
config below goes through ``--dry-run`` and through the run (its setup: ``grpo_fast.train.run``,
``grpo_fast.loop.setup``, the rollout backend's build), and both must stop with exit code 2 and
the same one line. At ed0dfd1 the dry run accepted every one of them (exit 0) and the run
stopped on most with a traceback. Under torchrun the line is printed once, by rank 0
(``grpo_fast.errors.cli_errors``); torchrun's own failure summary follows it, which no worker can
suppress (its launcher raises ``ChildFailedError`` uncaught whenever a worker exits non-zero)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys

import pytest
import torch
from run_folders import QUICK

from grpo_fast import dist, threads
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.train import main

TOOL = """
from grpo_fast.env import Environment, EnvironmentSpec, ToolCall, ToolResult

class Tool(Environment):
    name = "tool"
    stop_strings = {stops}

    def parse(self, turn_text):
        {parse}

    def execute(self, calls, limit):
        return [ToolResult("=", True, "ok", False, 0.0) for _ in calls]

{before}ENVIRONMENT = EnvironmentSpec(name="tool", summary="a test's", build={build}{extra})
"""


def _tool(
    stops="tuple('0123456789+=')", parse="return ToolCall(turn_text[-1:])", build="Tool", before="", extra=""
):
    return TOOL.format(stops=stops, parse=parse, build=build, before=before, extra=extra)


# a user's tool environment module (its text), or None: the overrides alone
MODULES = {
    "build raises": _tool(build="lambda: {}['api_key']"),
    "build returns no environment": _tool(build="lambda: 'not an environment'"),
    "an empty stop string": _tool(stops="('</t>', '')"),  # main: IndexError in rollout/multi_turn.py
    "no stop string": _tool(stops="()"),
    "stop_strings one string": _tool(stops="'</t>'"),  # its characters would be the stop strings
    "parse raises": _tool(parse="raise ValueError('unparsable')"),
    "parse returns a string": _tool(parse="return 'call it'"),
    "takes a string": _tool(extra=", takes='timeout_s'"),
    "missing raises": _tool(
        before="def missing():\n    raise OSError('no GPU')\n\n", extra=", missing=missing"
    ),
    "the module raises as it is imported": "raise RuntimeError('configure me first')\n",
    "the module declares no ENVIRONMENT": "x = 1\n",
}
OTHER_WAIT = next(p for p in ("passive", "active") if threads.wait_policy_problem(p) is not None)
CASES = {  # the overrides, and the line's start (the rest is the case's own)
    "train.sequence_parallel=3 on one process": (
        ["train.sequence_parallel=3"],
        "train.sequence_parallel=3 splits each sequence over 3 ranks: launch a multiple of 3 ranks",
    ),
    "a wait policy OpenMP did not load with": (
        [f"threads.wait_policy={OTHER_WAIT}"],
        f"threads.wait_policy={OTHER_WAIT}, but OpenMP loaded with wait ",
    ),
    "a template the tokenizer cannot write": (
        ["data.prompt_template={question}{oops}"],
        "data.prompt_template='{question}{oops}' holds 'ops{}', which the tokenizer does not know",
    ),
    "rollout.environment=../../etc/passwd": (
        ["rollout.environment=../../etc/passwd"],
        "rollout.environment: unknown tool environment '../../etc/passwd' (built in: calculator, python;",
    ),
    "rollout.environment=.x": (
        ["rollout.environment=.x"],
        "rollout.environment: unknown tool environment '.x'",
    ),
    "a distillation teacher that is not there": (
        ["distill.teacher=/no/such/teacher"],
        "distill.teacher='/no/such/teacher': no such folder",
    ),
    "a LoRA target module the model does not have": (  # main at 09d035d: the dry run exited 0
        ["model.lora.r=4", "model.lora.target_modules=[q_proj,qkv]"],
        "model.lora.target_modules: 'qkv' matches no linear layer of the decoder; it has: down_proj,",
    ),
    "a built-in distillation teacher": (
        ["distill.teacher=builtin:tiny"],
        "distill.teacher='builtin:tiny': a built-in model is random weights",
    ),
    **{case: ([], None) for case in MODULES},
}
MODULE_LINES = {  # the line's start for a module's case ({m}: the module's name)
    "build raises": "tool environment '{m}': its build() raised KeyError: \"'api_key'\" (at {m}.py:",
    "build returns no environment": "tool environment '{m}': its build returned 'not an environment', not an",
    "an empty stop string": "tool environment '{m}': stop_strings=('</t>', '') holds an empty string",
    "no stop string": "tool environment '{m}': its stop_strings are empty, so no turn would ever call it",
    "stop_strings one string": "tool environment '{m}': stop_strings='</t>' must be a tuple of strings",
    "parse raises": "tool environment '{m}': its parse raised ValueError: 'unparsable' (at {m}.py:",
    "parse returns a string": "tool environment '{m}': its parse returned 'call it', not a ToolCall or None",
    "takes a string": "rollout.environment: tool environment '{m}': ENVIRONMENT.takes='timeout_s' must be a",
    "missing raises": "tool environment '{m}': its missing() raised OSError: 'no GPU' (at {m}.py:",
    "the module raises as it is imported": (
        "rollout.environment: tool environment '{m}': importing the module raised RuntimeError: "
        "'configure me first' (at {m}.py:"
    ),
    "the module declares no ENVIRONMENT": "rollout.environment: tool environment '{m}': the module declares no",
}


def _line(capsys, rc: int) -> str:
    """The one ``error:`` line of a command that exited 2 (the run's plan line may come first)."""
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("error")]
    assert rc == 2 and len(lines) == 1 and "Traceback" not in err, (rc, err[-3000:])
    return lines[0].removeprefix("error: ")


@pytest.mark.parametrize("case", list(CASES))
def test_the_dry_run_and_the_run_refuse_each_bad_config_with_the_same_line(
    tmp_path, capsys, monkeypatch, case
):
    """Planted (one at a time): the dry run without sequence_parallel.group_size, without the wait
    policy's check, without building a user's environment; load_task without the template's
    alphabet check → the dry run exits 0 (and the run goes on, or stops with a traceback)."""
    overrides, start = CASES[case]
    if case in MODULES:
        name = f"tool_{abs(hash(case)) % 10**8}"
        (tmp_path / f"{name}.py").write_text(MODULES[case])
        monkeypatch.syspath_prepend(str(tmp_path))
        monkeypatch.delitem(sys.modules, name, raising=False)
        overrides, start = [f"rollout.environment={name}"], MODULE_LINES[case].format(m=name)
    args = [*QUICK, *overrides, f"output_dir={tmp_path / 'run'}"]
    dry = _line(capsys, main([*args, "--dry-run"]))
    if case in MODULES:
        sys.modules.pop(name, None)  # the run imports the module afresh
    real = _line(capsys, main([*args, "steps=1"]))
    assert dry == real and dry.startswith(start), (dry, real)


def test_prompts_that_do_not_split_over_the_ranks_are_refused_before_the_model_loads(
    tmp_path, capsys, monkeypatch
):
    """Under torchrun (WORLD_SIZE=3 here): the dry run, the run's config check and the setup's own
    check (reached here with a world built by hand) give the same line; main at ed0dfd1 refused
    it only in the setup, after the model loaded, and the dry run not at all."""
    from grpo_fast.loop.setup import setup

    args = [*QUICK, f"output_dir={tmp_path / 'run'}"]
    cfg = load_config(*_preset_and_overrides(args))
    with pytest.raises(ConfigError) as err:  # the setup's check, the ranks being a hand-built world
        setup(cfg, torch.device("cpu"), dist.DistInfo(rank=0, world_size=3), tmp_path / "run", None)
    capsys.readouterr()  # its plan line
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    dry = _line(capsys, main([*args, "--dry-run"]))
    real = _line(capsys, main(args))
    assert (
        dry
        == real
        == str(err.value)
        == ("rollout.batch_size / rollout.group_size = 2 prompts per step do not split evenly over 3 ranks")
    )


def _preset_and_overrides(args: list[str]) -> tuple[str, list[str] | None, list[str]]:
    assert args[0] == "--preset"
    return args[1], None, args[2:]


def _as_torchrun_worker(monkeypatch, tmp_path, rank: int):
    """The environment torchrun gives worker ``rank`` of 2 on one node; its error file's folder."""
    for var, value in (("WORLD_SIZE", 2), ("RANK", rank), ("LOCAL_RANK", rank), ("LOCAL_WORLD_SIZE", 2)):
        monkeypatch.setenv(var, str(value))
    (tmp_path / "attempt_0" / str(rank)).mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(tmp_path / "attempt_0" / str(rank) / "error.json"))
    return tmp_path / "attempt_0"


def test_under_torchrun_local_rank_0_alone_prints_the_line_and_every_rank_hands_it_over(
    tmp_path, capsys, monkeypatch
):
    """main at ed0dfd1: every rank printed the line. Planted: _report printing on every rank →
    rank 1's stderr holds it."""
    from grpo_fast import errors

    monkeypatch.setattr(errors, "DEFER_S", 0.2)  # rank 0 waits this long for rank 1, in one process
    args = [*QUICK, "train.sequence_parallel=3", f"output_dir={tmp_path / 'run'}"]
    line = "error: train.sequence_parallel=3 splits each sequence over 3 ranks"
    for rank, printed in ((0, True), (1, False)):
        attempt = _as_torchrun_worker(monkeypatch, tmp_path, rank)
        assert main(args) == 2
        assert [ln[: len(line)] for ln in capsys.readouterr().err.splitlines()] == [line] * printed
        handed = json.loads((attempt / str(rank) / "error.json").read_text())["message"]
        assert handed["message"].startswith(line) and handed["extraInfo"]["py_callstack"] == handed["message"]
    (attempt / "0" / "error.json").write_text(json.dumps({"message": {"message": "error: another"}}))
    assert main(args) == 2  # rank 0 said something else: rank 1's own line is its to print
    assert capsys.readouterr().err.startswith(line)
    monkeypatch.delenv("TORCHELASTIC_ERROR_FILE")  # nowhere to hand it over: every rank prints
    assert main(args) == 2 and capsys.readouterr().err.startswith(line)


@pytest.mark.skipif(
    shutil.which("torchrun") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not found",
)
def test_torchrun_prints_the_refusal_once_and_each_rank_exits_2(tmp_path):
    """``torchrun --nproc_per_node 2 -m grpo_fast.train train.sequence_parallel=3`` (≈ 3 s): one
    ``error:`` line; torchrun's summary (which follows, and exits 1: torch 2.13's launcher raises
    ChildFailedError uncaught whenever a worker fails) names exit code 2 and our line for both
    ranks. main at ed0dfd1: the line twice, "To enable traceback see: …" for each rank, and often
    exit code -15 for one (torchrun's SIGTERM while it tore its interpreter down)."""
    torchrun = shutil.which("torchrun") or os.path.join(os.path.dirname(sys.executable), "torchrun")
    cmd = [torchrun, "--standalone", "--nproc_per_node=2", "-m", "grpo_fast.train", *QUICK]
    res = subprocess.run(
        [*cmd, "train.sequence_parallel=3", f"output_dir={tmp_path}"],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = res.stdout + res.stderr
    ours = [ln for ln in out.splitlines() if ln.startswith("error: ")]
    assert res.returncode == 1 and len(ours) == 1, out[-3000:]
    assert out.count("exitcode  : 2 ") == 2, out[-3000:]
    assert out.count(f"traceback : {ours[0]}") == 2, out[-3000:]


def test_nproc_per_node_starts_the_ranks_and_a_refusal_is_one_line_and_exit_2(tmp_path, capsys):
    """``python -m grpo_fast.train --nproc-per-node 2`` (torch's launcher in that process): a bad
    input the ranks find (3 prompts a step over 2 ranks) is the one line and exit code 2, with no
    launcher traceback or failure table after it (torchrun's, above: ChildFailedError, exit 1). Its
    dry run checks the same world as rank 0 (in process). At 9cb0233 there was no such option."""
    args = [*QUICK, "rollout.batch_size=24", f"output_dir={tmp_path}"]
    line = "rollout.batch_size / rollout.group_size = 3 prompts per step do not split evenly over 2 ranks"
    assert _line(capsys, main(["--nproc-per-node", "2", "--dry-run", *args])) == line
    assert "WORLD_SIZE" not in os.environ  # the dry run's world was its own
    res = subprocess.run(
        [sys.executable, "-m", "grpo_fast.train", "--nproc-per-node", "2", *args],
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    out = res.stdout + res.stderr
    assert res.returncode == 2 and [ln for ln in out.splitlines() if "error" in ln.lower()] == [
        f"error: {line}"
    ]
    assert "Traceback" not in out and "ChildFailedError" not in out, out[-3000:]


def test_nproc_per_node_is_refused_inside_torchrun_and_below_one(monkeypatch, capsys):
    assert _line(capsys, main(["--nproc-per-node", "0", *QUICK])) == "--nproc-per-node=0: give 1 rank or more"
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert _line(capsys, main(["--nproc-per-node", "2", *QUICK])).startswith(
        "--nproc-per-node starts the ranks"
    )


# ---------------------------------------------------------------------------- what the lines echo

BIG = "a" * 10_000


@pytest.mark.parametrize(
    "key",
    [
        "rollout.backend",  # grpo_fast.domains' "must be one of": cut by errors.one_line
        "data.prompt_template",
        "rollout.environment",
        "data.reward",
        "output_dir",  # main at ed0dfd1: the dry run's OSError traceback (File name too long)
        "model.name_or_path",  # and the run's
        "data.train_path",
    ],
)
def test_a_10_kb_value_is_echoed_shortened_by_the_dry_run_and_the_run(tmp_path, capsys, key):
    """main at ed0dfd1: the line held the whole value (10 kB). Planted: one_line without its cut
    of long words → rollout.backend's line is 10 kB; config_checks without check_paths → the
    paths' OSError traceback."""
    args = [*QUICK, f"output_dir={tmp_path / 'run'}", f"{key}={BIG}"]
    dry = _line(capsys, main([*args, "--dry-run"]))
    real = _line(capsys, main(args))
    assert dry == real and len(dry) < 400 and key in dry, dry
    assert re.search(r"… \(10,0\d\d characters\)", dry), dry


@pytest.mark.parametrize(
    ("overrides", "said"),
    [
        (["steps=6"], "eval: an evaluation at steps 0 and 6, "),  # main at ed0dfd1: "every 25 steps"
        (["steps=60"], "eval: an evaluation every 25 steps and at step 60, "),  # 0, 25, 50 and the last
        (["steps=6", "eval_every=0"], "eval: none (eval_every=0), "),
    ],
)
def test_the_dry_run_says_when_the_run_evaluates(tmp_path, capsys, overrides, said):
    """The evaluations grpo_fast.loop.step_end runs: step 0, every eval_every steps, the last step.
    (The run's plan line, grpo_fast.loop.setup._announce_plan, still says "every 25 steps".)"""
    assert main([*QUICK, "--dry-run", "eval_every=25", *overrides, f"output_dir={tmp_path}"]) == 0
    assert f"  {said}" in capsys.readouterr().out


def test_heads_sequence_parallelism_cannot_split_are_refused_by_the_dry_run_with_the_runs_line(
    tmp_path, capsys, monkeypatch
):
    """Under torchrun with 3 ranks (WORLD_SIZE=3 here), train.sequence_parallel=3 over the tiny
    model's 4 heads: the dry run checks the model's skeleton (meta device, no weights) and gives the
    line the setup's check gives on the loaded model. At 09d035d the dry run exited 0."""
    from grpo_fast.policy import ulysses
    from grpo_fast.policy.model import load_policy
    from grpo_fast.task import tiny

    args = [*QUICK, "train.sequence_parallel=3", "rollout.batch_size=24", f"output_dir={tmp_path / 'run'}"]
    cfg = load_config(*_preset_and_overrides(args))
    with pytest.raises(ConfigError) as err:
        ulysses.check_model(load_policy(cfg, tiny.build_tokenizer(), torch.device("cpu")), 3)
    monkeypatch.setenv("WORLD_SIZE", "3")
    monkeypatch.setenv("RANK", "0")
    dry = _line(capsys, main([*args, "--dry-run"]))
    assert dry == str(err.value) and dry.startswith(
        "train.sequence_parallel=3: the model's 4 attention heads"
    )


def test_model_checks_on_a_model_not_on_this_machine_are_skipped_and_said(tmp_path, capsys, monkeypatch):
    """A hub model that is not in the local cache: the dry run does not download it, so its model
    checks are skipped and the output says why, instead of refusing what the run may accept."""
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    args = [*QUICK, "model.name_or_path=someone/not-cached", "model.lora.r=4"]
    rc = main([*args, "model.lora.target_modules=[q_proj]", f"output_dir={tmp_path / 'run'}", "--dry-run"])
    out = capsys.readouterr().out
    assert rc == 0 and "model checks skipped: model.name_or_path='someone/not-cached'" in out, out[-2000:]
