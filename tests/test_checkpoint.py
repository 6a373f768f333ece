"""Checkpoints as untrusted input and as writes that can fail: safe loading, a full disk."""

import errno
import os
import random
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import numpy as np
import pytest
import torch

from grpo_fast.errors import CheckpointError
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.task import tiny
from grpo_fast.train import main

QUICK = [
    "steps=2",
    "sft.steps=0",
    "eval_every=0",
    "checkpoint_every=1",
    "rollout.batch_size=16",
    "logging.progress=false",
    "logging.sample_every=0",
]


class _Planted:
    """A pickle payload: unpickling it calls ``os.system`` (what a tampered checkpoint does)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return (os.system, (f"touch {self.marker}",))


def _plant(folder: Path, marker: Path) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    torch.save({"train_state": {"step": 1}, "rng": [_Planted(marker)]}, folder / ckpt.STATE_FILE)


# ---------------------------------------------------------------------------- safe loading


def test_a_planted_pickle_is_refused_and_nothing_runs(tmp_path):
    marker = tmp_path / "pwned"
    _plant(tmp_path / "step_000001", marker)
    with pytest.raises(CheckpointError) as info:
        ckpt.load_state(tmp_path / "step_000001")
    msg = str(info.value)
    assert str(tmp_path / "step_000001" / ckpt.STATE_FILE) in msg and "refused" in msg
    assert "posix.system" in msg  # the reason: the global it would have called
    assert not marker.exists()


def test_resume_from_a_planted_checkpoint_is_one_line_exit_2_nothing_runs(tmp_path):
    """End to end: a real run's checkpoint with its trainer_state.pt swapped for a payload."""
    out = tmp_path / "run"
    assert main(["--preset", "tiny", f"output_dir={out}", *QUICK, "steps=1"]) == 0
    marker = tmp_path / "pwned"
    _plant(out / "checkpoints" / "step_000001", marker)
    cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", f"output_dir={out}", *QUICK]
    res = subprocess.run(
        [*cmd, "resume=true"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert res.returncode == 2, res.stderr[-2000:]
    lines = res.stderr.strip().splitlines()
    assert lines[-1].startswith("error: checkpoint file ") and "refused" in lines[-1]
    assert str(out / "checkpoints" / "step_000001" / ckpt.STATE_FILE) in lines[-1]
    assert "Traceback" not in res.stderr and not marker.exists()


@pytest.mark.parametrize("optimizer", ["adamw", "adamw8bit"])
def test_a_real_runs_trainer_state_loads_with_weights_only(tmp_path, optimizer):
    """Everything _save_checkpoint writes (optimizer, scheduler, sampler, health, KL controller,
    the reference model, every RNG) passes torch.load(weights_only=True)."""
    overrides = [f"train.optimizer={optimizer}", "loss.beta=0.05", "loss.target_kl=0.1", "steps=1"]
    assert main(["--preset", "tiny", f"output_dir={tmp_path}", *QUICK, *overrides]) == 0
    file = tmp_path / "checkpoints" / "step_000001" / ckpt.STATE_FILE
    state = torch.load(file, weights_only=True)
    assert {"optimizer", "scheduler", "sampler", "health", "rng", "kl_controller", "ref_model"} <= set(state)


def test_rng_state_round_trips_python_numpy_and_torch_through_weights_only(tmp_path):
    random.seed(1)
    np.random.seed(2)
    np.random.randn()  # a cached Gaussian in numpy's state
    torch.manual_seed(3)
    torch.save({"rng": ckpt.rng_state()}, tmp_path / "s.pt")
    before = (random.random(), np.random.randn(), np.random.rand(), torch.rand(2))
    ckpt.set_rng_state(torch.load(tmp_path / "s.pt", weights_only=True)["rng"])
    after = (random.random(), np.random.randn(), np.random.rand(), torch.rand(2))
    assert before[:3] == after[:3] and torch.equal(before[3], after[3])


# ---------------------------------------------------------------------------- a failed write


def _save(root: Path, step: int, keep: int = 2) -> Path:
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=step)
    return ckpt.save_checkpoint(root, step, model, tok, {"train_state": {"step": step}}, keep=keep)


def _assert_previous_intact(root: Path, step: int, saved_seed: int | None = None) -> None:
    assert [p.name for p in ckpt.list_checkpoints(root)] == [ckpt.step_dir_name(step)]
    assert not [p for p in root.iterdir() if p.name.endswith(".tmp")]  # the partial write is gone
    assert ckpt.load_state(root / ckpt.step_dir_name(step))["train_state"]["step"] == step
    tok = tiny.build_tokenizer()
    other = tiny.build_model(tok, seed=99)
    ckpt.load_model_weights(other, root / ckpt.step_dir_name(step))
    if saved_seed is not None:  # the weights _save wrote
        torch.testing.assert_close(
            other.lm_head.weight, tiny.build_model(tok, seed=saved_seed).lm_head.weight
        )


@pytest.mark.parametrize(
    ("target", "error"),
    [
        ("torch.save", RuntimeError("[enforce fail at inline_container.cc:664] . unexpected pos 0 vs 1")),
        ("torch.save", OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))),
        ("tokenizer", OSError(errno.EACCES, os.strerror(errno.EACCES))),
    ],
    ids=["zip-writer", "enospc", "eacces"],
)
def test_a_failed_write_keeps_the_previous_checkpoint_and_says_so(tmp_path, monkeypatch, target, error):
    _save(tmp_path, 1)

    def fail(*a, **k):
        raise error

    if target == "torch.save":
        monkeypatch.setattr(ckpt.torch, "save", fail)
    else:
        monkeypatch.setattr(type(tiny.build_tokenizer()), "save_pretrained", fail)
    with pytest.raises(CheckpointError) as info:
        _save(tmp_path, 2, keep=1)  # keep=1: the pruning must not run after a failed write
    msg = str(info.value)
    assert msg.startswith(f"step 2: cannot write {tmp_path / 'step_000002'}: ")
    assert f"{tmp_path / 'step_000001'} is intact" in msg and "\n" not in msg
    monkeypatch.undo()
    _assert_previous_intact(tmp_path, 1, saved_seed=1)


@pytest.fixture
def small_tmpfs(tmp_path):
    """A 4 MiB tmpfs (root only; skipped elsewhere — the injected errors above cover the same path)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    if os.geteuid() != 0 or shutil.which("mount") is None:
        pytest.skip("mounting a tmpfs needs root")
    res = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mnt)], capture_output=True)
    if res.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {res.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", str(mnt)], check=False)


def test_a_full_disk_keeps_the_previous_checkpoint_and_says_so(small_tmpfs):
    root = small_tmpfs / "checkpoints"
    _save(root, 1)  # ≈ 1.6 MB of weights
    free = shutil.disk_usage(small_tmpfs).free
    with open(small_tmpfs / f"filler-{uuid.uuid4().hex}", "wb") as fh:  # leave ~0.5 MB
        fh.write(b"\0" * max(free - 512 * 1024, 0))
    with pytest.raises(CheckpointError) as info:
        _save(root, 2, keep=1)
    msg = str(info.value)
    assert "No space left on device" in msg and "MiB free there" in msg
    assert f"{root / 'step_000001'} is intact" in msg
    _assert_previous_intact(root, 1, saved_seed=1)


def test_a_run_whose_checkpoint_write_fails_stops_with_one_line(tmp_path, monkeypatch, capsys):
    real = ckpt.torch.save

    def full_on_step_2(obj, f, *a, **k):
        if "step_000002" in str(f):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(obj, f, *a, **k)

    monkeypatch.setattr(ckpt.torch, "save", full_on_step_2)
    assert main(["--preset", "tiny", f"output_dir={tmp_path}", *QUICK]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err[-1].startswith("error: step 2: cannot write ") and "No space left on device" in err[-1]
    assert not (tmp_path / "final").exists()
    monkeypatch.undo()
    _assert_previous_intact(tmp_path / "checkpoints", 1)
