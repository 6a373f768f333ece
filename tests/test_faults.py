"""Faults and bad input: each one a clean line on stderr and exit code 2 (or a skipped step),
never a traceback, never a half-written checkpoint."""

import errno
import os
import shutil
import subprocess

import pytest
import torch
from support.inprocess import Result, one_error_line, run_main

from grpo_fast import train as train_mod
from grpo_fast.loop import optimization
from grpo_fast.loop import setup as setup_mod
from grpo_fast.train import main


def _cli(*args: str) -> Result:
    """``python -m grpo_fast.train --preset tiny ARGS...``, run in this process (tests/support/inprocess.py)."""
    return run_main(["--preset", "tiny", *args])


# ---------------------------------------------------------------------------- bad input


def test_output_dir_that_cannot_be_created_is_one_line_exit_2(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    line = one_error_line(_cli(f"output_dir={blocker / 'run'}"))
    assert f"output_dir='{blocker / 'run'}' cannot be created: Not a directory" in line


@pytest.fixture
def read_only_dir(tmp_path):
    """A folder no one can write in: a read-only tmpfs as root (root ignores file modes), else
    mode 0o500. Skipped where neither works; the injected error below covers the same path."""
    ro = tmp_path / "ro"
    ro.mkdir()
    if os.geteuid() == 0:
        if shutil.which("mount") is None:
            pytest.skip("no mount command")
        res = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(ro)], capture_output=True
        )
        if res.returncode:
            pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
        try:
            yield ro
        finally:
            subprocess.run(["umount", str(ro)], check=False)
    else:
        ro.chmod(0o500)
        try:
            yield ro
        finally:
            ro.chmod(0o700)


def test_output_dir_that_is_not_writable_is_one_line_exit_2(read_only_dir):
    line = one_error_line(_cli(f"output_dir={read_only_dir}"))
    assert f"output_dir='{read_only_dir}' is not writable: " in line
    line = one_error_line(_cli(f"output_dir={read_only_dir / 'sub'}"))
    assert "cannot be created" in line


def test_output_dir_write_error_injected_is_one_line_exit_2(tmp_path, monkeypatch, capsys):
    def refuse(*a, **k):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES))

    monkeypatch.setattr(train_mod.tempfile, "NamedTemporaryFile", refuse)
    loaded = []
    monkeypatch.setattr(setup_mod, "load_policy", lambda *a, **k: loaded.append(1))
    assert main(["--preset", "tiny", f"output_dir={tmp_path}"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"error: output_dir='{tmp_path}' is not writable: Permission denied"]
    assert loaded == []  # refused before any model loads


def test_group_size_one_is_one_line_exit_2():
    line = one_error_line(_cli("rollout.group_size=1", "rollout.batch_size=8"))
    assert "rollout.group_size=1 with loss.advantage=group" in line


@pytest.mark.parametrize("override", ["train.lr=nan", "train.weight_decay=-0.1"])
def test_numeric_domain_errors_are_one_line_exit_2(override):
    """Through the CLI; every key's domain is walked in tests/test_config.py (DOMAINS)."""
    key = override.split("=")[0]
    assert key in one_error_line(_cli(override))


# ---------------------------------------------------------------------------- non-finite steps

QUICK = [
    "sft.steps=0",
    "eval_every=0",
    "checkpoint_every=1",
    "keep_checkpoints=10",
    "rollout.batch_size=16",
    "logging.progress=false",
    "logging.sample_every=0",
    "data.reward=test_faults:length_reward",  # random weights: a signal in every group
]


def length_reward(response: str, ground_truth: str) -> dict[str, float]:
    return {"reward": float(len(response))}


def _adam_steps(folder) -> int:
    state = torch.load(folder / "trainer_state.pt", weights_only=True)["optimizer"]["state"]
    return int(next(iter(state.values()))["step"])


def _poison(monkeypatch, steps: set[int], how: str) -> None:
    """Make every microbatch of ``steps`` non-finite: its loss NaN (``loss``), or its loss finite
    and its gradient inf (``grad_norm``: the backward pass multiplies by inf)."""
    from grpo_fast.policy import loss as loss_mod

    current = {}
    real_opt, real_fwd = optimization.optimize_on_rollout, loss_mod.PolicyLoss.forward

    def opt(*a, **k):
        current["step"] = k.get("step", 0)
        return real_opt(*a, **k)

    def fwd(self, *a, **k):
        out = real_fwd(self, *a, **k)
        if torch.is_grad_enabled() and current.get("step") in steps:
            if how == "loss":
                return out._replace(loss=out.loss * float("nan"))
            out.loss.register_hook(lambda g: g * float("inf"))
        return out

    monkeypatch.setattr(optimization, "optimize_on_rollout", opt)
    monkeypatch.setattr(loss_mod.PolicyLoss, "forward", fwd)


def _weights(folder):
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def _same(a, b) -> bool:
    return all(torch.equal(a[k], b[k]) for k in a)


@pytest.mark.parametrize(
    ("how", "what"),
    [("loss", "loss and grad_norm"), ("grad_norm", "grad_norm")],  # a NaN loss has NaN gradients
)
def test_a_non_finite_step_is_skipped_and_logged_then_training_goes_on(
    tmp_path, monkeypatch, capsys, how, what
):
    _poison(monkeypatch, {2}, how)
    assert main(["--preset", "tiny", f"output_dir={tmp_path}", "steps=3", *QUICK]) == 0
    err = capsys.readouterr().err
    assert f"step 2: non-finite {what} (" in err and "optimizer step skipped" in err
    assert "step 1: non-finite" not in err and "step 3: non-finite" not in err
    c = tmp_path / "checkpoints"
    w1, w2, w3 = (_weights(c / f"step_00000{i}") for i in (1, 2, 3))
    assert _same(w1, w2) and not _same(w2, w3)  # step 2 was not applied, step 3 was
    assert [_adam_steps(c / f"step_00000{i}") for i in (1, 2, 3)] == [1, 1, 2]  # nor AdamW's moments
    assert all(torch.isfinite(t).all() for t in w3.values())


def test_max_nonfinite_steps_in_a_row_stop_the_run_with_one_line(tmp_path, monkeypatch, capsys):
    _poison(monkeypatch, {2, 3, 4}, "loss")
    args = ["--preset", "tiny", f"output_dir={tmp_path}", "steps=6", "train.max_nonfinite_steps=2", *QUICK]
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: steps 2-3: 2 steps in a row with a non-finite loss and grad_norm")
    assert "the weights are step 1's" in err[-1] and "step_000002 is intact" in err[-1]
    c = tmp_path / "checkpoints"
    assert [p.name for p in sorted(c.iterdir())] == ["step_000001", "step_000002"]
    assert _same(_weights(c / "step_000001"), _weights(c / "step_000002"))
    assert not (tmp_path / "final").exists()


# ---------------------------------------------------------------------------- preemption

NONDETERMINISTIC_PREFIXES = ("time/", "throughput/", "memory/", "gpu/")


def _comparable(path):
    import json

    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in rows]


def test_second_signal_is_not_deferred(monkeypatch):
    import signal

    from grpo_fast import dist
    from grpo_fast.loop import preempt

    exits = []
    monkeypatch.setattr(preempt.os, "_exit", exits.append)  # tests/test_stops.py: a real process
    world = dist.DistInfo(rank=0, world_size=1, local_rank=0)
    before = signal.getsignal(signal.SIGINT)  # default_int_handler; SIG_IGN in a pytest-xdist worker
    with preempt.handle_signals():
        assert preempt.pending(world, torch.device("cpu")) is None
        os.kill(os.getpid(), signal.SIGINT)
        assert preempt.pending(world, torch.device("cpu")) == signal.SIGINT  # deferred
        os.kill(os.getpid(), signal.SIGINT)  # the impatient second Ctrl-C: exits at once
        assert exits == [128 + signal.SIGINT]
    assert signal.getsignal(signal.SIGINT) is before  # restored


@pytest.mark.parametrize("signame", ["SIGTERM", "SIGINT"])
def test_a_signal_checkpoints_the_step_exits_non_zero_and_resume_is_exact(
    tmp_path, monkeypatch, capsys, signame
):
    """The signal arrives during step 2 (at its optimization phase); checkpoint_every=0, so the
    only checkpoint is the one the signal writes. Resumed, the run ends as an uninterrupted one
    (compared for SIGTERM; SIGINT takes the same path with another exit code). No evaluation at
    step 2: a pending signal skips it (tests/test_stops.py)."""
    import signal

    signum = getattr(signal, signame)
    common = ["--preset", "tiny", "steps=3", *QUICK, "checkpoint_every=0", "eval_every=3"]
    real = optimization.optimize_on_rollout

    def signalled(*a, **k):
        if k["step"] == 2:
            os.kill(os.getpid(), signum)
        return real(*a, **k)

    monkeypatch.setattr(optimization, "optimize_on_rollout", signalled)
    out = tmp_path / "preempted"
    assert main([*common, f"output_dir={out}"]) == 128 + signum
    err = capsys.readouterr().err.strip().splitlines()
    where = out / "checkpoints" / "step_000002"
    assert (
        err[-1]
        == f"error: {signame} during step 2: checkpoint {where} written after it; resume=true continues from there"
    )
    assert [p.name for p in (out / "checkpoints").iterdir()] == ["step_000002"] and not (
        out / "final"
    ).exists()
    monkeypatch.undo()
    if signame == "SIGINT":
        return
    assert main([*common, f"output_dir={out}", "resume=true"]) == 0
    assert main([*common, f"output_dir={tmp_path / 'straight'}"]) == 0
    assert _comparable(out / "metrics.jsonl") == _comparable(tmp_path / "straight" / "metrics.jsonl")
    assert _same(_weights(out / "final"), _weights(tmp_path / "straight" / "final"))


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_straight")  # the straight run is tests/conftest.py's tiny_straight_run
def test_sigterm_then_resume_gives_the_same_metrics(tmp_path, tiny_straight_run):
    """As tests/test_train.py's SIGKILL test, with SIGTERM: the process checkpoints the step it
    is in, exits with 143 and one line naming the checkpoint; resumed, the metrics and the final
    weights are those of an uninterrupted run (the same command's, ``tiny_straight_run``)."""
    import signal
    import time

    from test_train import _train_cmd

    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = tmp_path / "termed"
    cmd = _train_cmd(out)
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    first = out / "checkpoints" / "step_000003" / "trainer_state.pt"
    deadline = time.time() + 600
    while not first.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGTERM)  # mid-run, after the step-3 checkpoint
    stderr = proc.communicate(timeout=600)[1]
    assert proc.returncode == 128 + signal.SIGTERM, stderr[-2000:]
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: SIGTERM during step ") and "resume=true continues from there" in last
    step = int(last.split("/step_")[1][:6])  # the checkpoint it names: the step, or the one before it
    assert 3 <= step < 10 and (out / "checkpoints" / f"step_{step:06d}" / "trainer_state.pt").is_file()
    assert not (out / "final").exists() and not list((out / "checkpoints").glob("*.tmp"))
    res = subprocess.run([*cmd, "resume=true"], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert f"resumed from {out / 'checkpoints' / f'step_{step:06d}'}" in res.stderr
    assert _comparable(out / "metrics.jsonl") == _comparable(tiny_straight_run / "metrics.jsonl")
    assert _same(_weights(out / "final"), _weights(tiny_straight_run / "final"))


# ---------------------------------------------------------------------------- failing reward functions


CALLS = []  # responses scored by the two rewards below; every third one fails


def raising_reward(response: str, ground_truth: str) -> dict[str, float]:
    CALLS.append(response)
    if len(CALLS) % 3 == 0:
        raise ValueError("cannot grade this one")
    return {"reward": float(len(response)), "format_reward": 1.0}


def none_reward(response: str, ground_truth: str):
    CALLS.append(response)
    return {"reward": None if len(CALLS) % 3 == 0 else 1.0}


@pytest.mark.parametrize(
    ("fn", "problem"),
    [
        ("raising_reward", "raised ValueError: cannot grade this one"),
        ("none_reward", "returned reward None (NoneType), not a number"),
    ],
)
def test_a_failing_reward_function_stops_the_run_with_one_line(tmp_path, capsys, fn, problem):
    args = ["--preset", "tiny", f"output_dir={tmp_path}", "steps=2", *QUICK, f"data.reward=test_faults:{fn}"]
    CALLS.clear()
    assert main(args) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith(f"error: reward function 'test_faults:{fn}' {problem}")
    assert f" on response 2 of step 1's rollout batch (response {CALLS[2]!r}, ground truth '" in err[-1]
    assert "data.reward_errors=zero" in err[-1]


def test_reward_errors_zero_scores_them_0_and_counts_them(tmp_path):
    import json

    args = ["--preset", "tiny", f"output_dir={tmp_path}", "steps=2", *QUICK]
    CALLS.clear()
    assert main([*args, "data.reward=test_faults:raising_reward", "data.reward_errors=zero"]) == 0
    rows = [json.loads(line) for line in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["train/reward_errors"] for r in rows] == [5, 5]  # 16 responses a step: calls 3, 6, …, 15


def test_guarded_reward_names_the_response_and_keeps_the_keys_on_zero():
    from grpo_fast.errors import RewardError
    from grpo_fast.task.rewards import GuardedReward

    CALLS.clear()
    score = GuardedReward(raising_reward, "mine", "zero").for_batch(step=7)
    assert score("22", "4") == {"reward": 2.0, "format_reward": 1.0}
    assert score("1", "4") == {"reward": 1.0, "format_reward": 1.0}
    assert score("13", "4") == {"reward": 0.0, "format_reward": 0.0}  # every key, so means stay defined
    assert score.errors == 1 and score.index == 3
    strict = GuardedReward(lambda r, g: {"reward": float("nan")}, "nan_reward").for_batch(step=3)
    with pytest.raises(
        RewardError, match=r"'nan_reward' returned reward nan, not a finite number on response 0 of step 3"
    ):
        strict("5", "5")
    with pytest.raises(RewardError, match=r"returned float 0.5, not a dict"):
        GuardedReward(lambda r, g: 0.5, "bare")("5", "5")
