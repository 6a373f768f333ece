"""The training loop end to end on the tiny preset (CPU): outputs, metrics, resume, errors, learning."""

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
from support.inprocess import run_main

from grpo_fast.config import load_config
from grpo_fast.loop import setup as setup_mod
from grpo_fast.policy import loss as loss_mod
from grpo_fast.task import tiny
from grpo_fast.train import run

REQUIRED_KEYS = {
    "train/loss",
    "train/reward_mean",
    "train/reward_std",
    "train/accuracy",
    "train/entropy_mean",
    "train/response_length_mean",
    "train/grad_norm",
    "train/clip_fraction",
    "train/kl",
    "train/lr",
    "time/rollout_s",
    "time/train_s",
    "memory/peak_gb",
    "throughput/tokens_per_s",
    "world_size",
}
# what differs between two identical runs: wall-clock and memory readings
NONDETERMINISTIC_PREFIXES = ("time/", "throughput/", "memory/", "gpu/")


def _rows(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _quick(tmp_path, *extra):
    return load_config(
        "tiny",
        overrides=[
            f"output_dir={tmp_path}",
            "steps=4",
            "sft.steps=30",
            "eval_every=2",
            "checkpoint_every=2",
            "rollout.batch_size=32",
            "data.eval_subset_size=32",
            "logging.sample_every=2",
            *extra,
        ],
    )


def test_tiny_run_writes_config_metrics_samples_checkpoints_and_final_model(tmp_path):
    out = run(_quick(tmp_path))
    assert (out / "config.yaml").is_file() and "task: tiny" in (out / "config.yaml").read_text()
    rows = _rows(out / "metrics.jsonl")
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]
    assert set(rows[0]) == {"step", "world_size", "sft/steps"} | {k for k in rows[0] if k.startswith("eval/")}
    for r in rows[1:]:
        assert set(r) >= REQUIRED_KEYS, REQUIRED_KEYS - set(r)
        assert r["world_size"] == 1 and r["train/clip_fraction"] == 0.0  # on-policy: ratio 1
    assert {"eval/accuracy", "eval/format_rate", "eval/response_length_mean"} <= set(
        rows[2]
    ) and "eval/accuracy" not in rows[1]
    assert (out / "sft_metrics.jsonl").is_file()
    assert (out / "samples" / "step_2.jsonl").is_file()
    sample = json.loads((out / "samples" / "step_2.jsonl").read_text().splitlines()[0])
    assert {"prompt", "response", "reward", "format_reward", "answer_reward", "length"} <= set(sample)
    # every checkpoint_every steps, and the final step (a finished run can be extended)
    assert sorted(p.name for p in (out / "checkpoints").iterdir()) == ["step_000002", "step_000004"]
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(out / "final").config.vocab_size == 15


def test_on_policy_skips_the_old_logprob_pass(tmp_path, monkeypatch):
    calls = []  # no-grad forwards of the loss module: the π_old passes
    real = loss_mod.PolicyLoss.forward

    def counting(self, *a, **k):
        if not torch.is_grad_enabled():
            calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(loss_mod.PolicyLoss, "forward", counting)
    run(_quick(tmp_path / "one", "steps=2", "eval_every=0", "checkpoint_every=0"))
    assert calls == []  # one epoch per rollout batch: π_old = π, no extra forward pass
    run(
        _quick(
            tmp_path / "two",
            "steps=2",
            "eval_every=0",
            "checkpoint_every=0",
            "train.epochs_per_rollout_batch=2",
            "train.micro_batch_size=16",
            "train.skip_zero_advantage=false",  # every response trained: 2 microbatches a step
        )
    )
    assert len(calls) == 2 * 2  # 2 steps × 2 microbatches of 16 sequences
    rows = [r for r in _rows(tmp_path / "two" / "metrics.jsonl") if r["step"] > 0]
    # the logged step is its first epoch: π_old's pass gave log-probs equal to the trained ones,
    # so every ratio is exactly 1 and nothing is clipped
    assert [r["train/clip_fraction"] for r in rows] == [0.0, 0.0]


def test_each_response_is_rewarded_and_trained_under_its_own_prompt(tmp_path, monkeypatch):
    """End to end with a policy that answers each row's own prompt (tests/answer_oracle.py: right
    on a group's even samples, ten times that on the odd ones): every step's reward mean is exactly
    1/2 (each response graded against its own prompt's answer), and every training sequence holds a
    response behind the prompt it answers, its advantage positive exactly where it is right
    (microbatches of 7 mix the groups)."""
    import answer_oracle

    tok = tiny.build_tokenizer()
    answer_oracle.install(monkeypatch, tok)
    seen = []
    real = loss_mod.PolicyLoss.forward

    def recording(self, mb, *a, **k):
        if torch.is_grad_enabled():
            seen.extend(answer_oracle.check_microbatch(mb, tok))
        return real(self, mb, *a, **k)

    monkeypatch.setattr(loss_mod.PolicyLoss, "forward", recording)
    overrides = ("steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0", "train.micro_batch_size=7")
    rows = [r for r in _rows(run(_quick(tmp_path, *overrides)) / "metrics.jsonl") if r["step"] > 0]
    assert [r["train/reward_mean"] for r in rows] == [0.5, 0.5]
    assert [r["train/accuracy"] for r in rows] == [0.5, 0.5]
    assert len(seen) == 2 * 32 and sorted(set(seen)) == ["right+", "tenfold-"], seen


def test_kl_penalty_and_entropy_bonus_run_and_log(tmp_path):
    out = run(
        _quick(
            tmp_path,
            "steps=2",
            "eval_every=0",
            "loss.beta=0.1",
            "loss.target_kl=0.01",
            "loss.entropy_coef=0.01",
            "loss.length_norm=token_mean",
            "train.optimizer=adamw8bit",
            "train.packing=true",
        )
    )
    rows = [r for r in _rows(out / "metrics.jsonl") if r["step"] > 0]
    assert rows[0]["train/kl"] == pytest.approx(0.0, abs=1e-6)  # π = π_ref before the first update
    assert rows[1]["train/kl"] > 0 and rows[1]["train/beta"] != 0.1  # the controller moved β
    # token-mean weights (1/N each, nothing skipped with β ≠ 0): the bonus is −c times the logged
    # mean entropy and the KL term β times the logged KL, with the β each step used (step 2: the
    # one the controller set after step 1); the loss holds both
    betas = [0.1, rows[0]["train/beta"]]
    for r, beta in zip(rows, betas):
        assert r["train/loss_entropy"] == pytest.approx(-0.01 * r["train/entropy_mean"], rel=1e-5)
        assert r["train/loss_kl"] == pytest.approx(beta * r["train/kl"], rel=1e-5, abs=1e-9)
        total = r["train/loss_pg"] + r["train/loss_kl"] + r["train/loss_entropy"]
        assert r["train/loss"] == pytest.approx(total, rel=1e-5, abs=1e-7)


def _cli(preset: str, *args: str, timeout: int = 120, **env: str) -> subprocess.CompletedProcess:
    """``python -m grpo_fast.train --preset PRESET ARGS...`` in a subprocess, output captured."""
    cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", preset, *args]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env={**os.environ, **env})


def _train_cmd(out, *extra):
    """The kill-and-resume tests' 10-step tiny run, with a value head (``loss.advantage=gae``): its
    weights and AdamW state are in each checkpoint, so a resume that lost them changes the
    advantages, hence the metrics, from the first resumed step."""
    return [
        sys.executable,
        "-m",
        "grpo_fast.train",
        "--preset",
        "tiny",
        f"output_dir={out}",
        "steps=10",
        "sft.steps=40",
        "eval_every=3",
        "checkpoint_every=3",
        "rollout.batch_size=32",
        "data.eval_subset_size=32",
        "logging.progress=false",
        "loss.advantage=gae",
        *extra,
    ]


def _comparable(rows):
    return [{k: v for k, v in r.items() if not k.startswith(NONDETERMINISTIC_PREFIXES)} for r in rows]


BACKENDS = ["hf", pytest.param("vllm", marks=pytest.mark.vllm)]


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_straight")  # the hf straight run is tests/conftest.py's tiny_straight_run
@pytest.mark.parametrize("backend", BACKENDS)
def test_sigkill_then_resume_gives_the_same_metrics(tmp_path, backend, request):
    """A run SIGKILLed after its step-6 checkpoint and resumed logs the uninterrupted run's metrics
    and ends with its weights, the value head's state restored (``_train_cmd``). With vllm too: its
    sampling is seeded per (run seed, step, rank), so a resumed run samples what the straight run
    sampled. Planted: the value head's weights not loaded at resume → the metrics differ (this
    test, the SIGTERM one of test_faults.py and the pipeline's SIGKILL one)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    cmd = lambda out, *extra: _train_cmd(out, f"rollout.backend={backend}", *extra)
    if backend == "hf":  # the default sampler: the shared run of the same command
        straight = request.getfixturevalue("tiny_straight_run")
    else:
        straight = tmp_path / "straight"
        subprocess.run(cmd(straight), check=True, env=env, capture_output=True, timeout=600)
    killed = tmp_path / "killed"
    proc = subprocess.Popen(cmd(killed), env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    target = killed / "checkpoints" / "step_000006" / "trainer_state.pt"
    deadline = time.time() + 600
    while not target.exists() and proc.poll() is None and time.time() < deadline:
        time.sleep(0.05)
    os.kill(proc.pid, signal.SIGKILL)  # mid-run, after the step-6 checkpoint, before the end
    proc.wait()
    assert target.exists() and not (killed / "final").exists()
    res = subprocess.run(cmd(killed, "resume=true"), env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr
    assert "resumed from" in res.stderr
    straight_rows, resumed = _rows(straight / "metrics.jsonl"), _rows(killed / "metrics.jsonl")
    assert [r["step"] for r in resumed] == list(range(11))
    assert _comparable(resumed) == _comparable(straight_rows)
    from safetensors.torch import load_file

    for (k, v), w in zip(
        load_file(straight / "final/model.safetensors").items(),
        load_file(killed / "final/model.safetensors").values(),
    ):
        assert torch.equal(v, w), k


def test_bad_data_file_is_one_line_exit_2(tmp_path):
    bad = tmp_path / "train.jsonl"
    bad.write_text('{"question": "1+1=", "answer": "2"}\n{"question": "2+2=", "answer": \n')
    res = run_main(["--preset", "tiny", f"data.train_path={bad}", f"output_dir={tmp_path / 'out'}"])
    assert res.returncode == 2
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and f"{bad}:2" in lines[0] and "Traceback" not in res.stderr


@pytest.mark.slow
@pytest.mark.xdist_group("tiny_preset")  # the hf run is tests/conftest.py's tiny_preset_run
@pytest.mark.parametrize("backend", BACKENDS)
def test_tiny_preset_learns(tmp_path, backend, request):
    """The README's main job: eval accuracy rises by ≥ 0.30 between the first evaluation (after
    the SFT warm start, before any GRPO step) and the last; with the real vLLM engine as well.
    (Its wall time is measured in bench/test_bench_train_step.py, not asserted here.)"""
    if backend == "hf":  # the preset's own sampler: the run test_pipeline compares staleness 1 with
        out = request.getfixturevalue("tiny_preset_run")
    else:
        out = tmp_path
        res = _cli(
            "tiny", f"output_dir={out}", "logging.progress=false", f"rollout.backend={backend}", timeout=1800
        )
        assert res.returncode == 0, res.stderr[-2000:]
    evals = [(r["step"], r["eval/accuracy"]) for r in _rows(out / "metrics.jsonl") if "eval/accuracy" in r]
    first, last = evals[0], evals[-1]
    assert first[0] == 0
    assert last[1] - first[1] >= 0.30, evals


def test_bad_data_is_reported_before_any_model_loads(tmp_path, monkeypatch):
    """A real-model preset with a bad MATH file: the data error comes first (no hub access:
    neither the tokenizer nor the model is asked for)."""
    bad = tmp_path / "math.jsonl"
    bad.write_text(
        '{"problem": "1+1?", "solution": "\\\\boxed{2}"}\n{"problem": "2+2?", "solution": "no box"}\n'
    )

    def no_model(*a, **k):
        raise AssertionError("a model or tokenizer was loaded before the data was checked")

    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setattr(setup_mod, "load_tokenizer", no_model)
    monkeypatch.setattr(setup_mod, "load_policy", no_model)
    res = run_main(["--preset", "smoke", f"data.train_path={bad}", f"output_dir={tmp_path / 'out'}"])
    assert res.returncode == 2
    assert res.stderr.strip() == f"error: {bad}:2: no \\boxed{{...}} answer found in field 'solution'"
