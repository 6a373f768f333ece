"""One run per output_dir: the lock, a used folder, a resume that keeps the run's keys, overwrite,
config.yaml's record, and the summary a run prints (grpo_fast.obs.run_folder)."""

from __future__ import annotations

import collections
import dataclasses
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from run_folders import QUICK, finished_run
from run_folders import copy_folder as _copy
from run_folders import tree as _tree
from support.ranks import start_ranks

from grpo_fast import config as config_mod
from grpo_fast import dist
from grpo_fast.config import ON_RESUME, Config, load_config
from grpo_fast.obs import run_folder
from grpo_fast.train import main


def _err_lines(capsys) -> list[str]:
    return [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]


def _steps(folder: Path) -> list[int]:
    return [json.loads(ln)["step"] for ln in (folder / "metrics.jsonl").read_text().splitlines()]


@pytest.fixture(scope="module")
def finished(tmp_path_factory) -> Path:
    """A finished 2-step run, copied by the tests that change it."""
    return finished_run(tmp_path_factory)


# ---------------------------------------------------------------------------- the table


def test_every_config_key_is_in_exactly_one_resume_class():
    keys = config_mod._all_keys()
    leaves = [k for k in keys if not any(other.startswith(k + ".") for other in keys)]
    listed = collections.Counter(k for cls in ON_RESUME.values() for k in cls)
    assert set(ON_RESUME) == {"run", "safe"}
    assert sorted(k for k in leaves if k not in listed) == [], "keys in no class of config.ON_RESUME"
    assert sorted(k for k, n in listed.items() if n > 1) == [], "keys in both classes"
    assert sorted(k for k in listed if k not in leaves) == [], "entries that name no key"


# ---------------------------------------------------------------------------- a used folder


def test_a_fresh_run_into_a_used_folder_stops_with_one_line_and_leaves_it_as_it_was(
    finished, tmp_path, capsys
):
    out = _copy(finished, tmp_path / "run")
    before = _tree(out)
    capsys.readouterr()
    assert main([*QUICK, "steps=3", f"output_dir={out}"]) == 2
    assert _err_lines(capsys) == [
        f"error: output_dir {out} holds a run (checkpoints up to step_000002, a final model, "
        "metrics.jsonl up to step 2): resume=true continues it, overwrite=true deletes it and starts over"
    ]
    assert _tree(out) == before


def test_overwrite_deletes_the_old_run_files_only_and_starts_over(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    (out / "notes.txt").write_text("mine")  # not a run file: it stays
    (out / "health.jsonl").write_text('{"step": 2, "kind": "old"}\n')
    assert main([*QUICK, "steps=1", "checkpoint_every=0", f"output_dir={out}", "overwrite=true"]) == 0
    assert _steps(out) == [1]  # not [1, 2, 1]
    assert not (out / "checkpoints").exists()  # the old step_000001/2 are gone, none was written
    assert (out / "notes.txt").read_text() == "mine"
    assert all(json.loads(ln)["step"] == 1 for ln in (out / "health.jsonl").read_text().splitlines())
    assert "overwrite: true" in (out / "config.yaml").read_text()


def test_resume_and_overwrite_together_are_refused(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    before = _tree(out)
    assert main([*QUICK, f"output_dir={out}", "resume=true", "overwrite=true"]) == 2
    assert _err_lines(capsys)[-1].startswith("error: resume=true and overwrite=true: choose one")
    assert _tree(out) == before


# ---------------------------------------------------------------------------- the lock


def test_a_second_run_on_a_folder_in_use_stops_at_once_naming_the_owner(tmp_path, capsys, monkeypatch):
    from grpo_fast.loop import setup as setup_mod

    out = tmp_path / "run"
    cfg = load_config("tiny", overrides=[f"output_dir={out}"])
    loaded = []
    monkeypatch.setattr(setup_mod, "load_task", lambda *a, **k: loaded.append(1))
    out.mkdir()
    with run_folder.claim(out, cfg, dist.DistInfo()):  # an open file description of our own
        owner = json.loads((out / run_folder.LOCK_FILE).read_text())
        assert owner["pid"] == os.getpid()
        before = _tree(out)
        assert main([*QUICK, f"output_dir={out}"]) == 2
        assert _err_lines(capsys) == [
            f"error: output_dir {out} is in use by pid {os.getpid()} on host {owner['host']} "
            f"(started {owner['started']})"
        ]
        assert _tree(out) == before and loaded == []  # refused before anything loads
    monkeypatch.undo()
    assert main([*QUICK, "steps=1", f"output_dir={out}"]) == 0  # released with the block


HOLDER = textwrap.dedent(
    """
    import sys, time
    from pathlib import Path
    from grpo_fast import dist
    from grpo_fast.config import load_config
    from grpo_fast.obs import run_folder
    out = Path(sys.argv[1])
    with run_folder.claim(out, load_config("tiny", overrides=[f"output_dir={out}"]), dist.DistInfo()):
        print("held", flush=True)
        time.sleep(600)
    """
)


def test_the_lock_is_another_process_s_until_it_dies_then_the_kernel_frees_it(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    holder = subprocess.Popen(
        [sys.executable, "-c", HOLDER, str(out)], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True
    )
    try:
        assert holder.stdout.readline().strip() == "held", holder.stderr.read()
        assert run_folder.in_use(out).startswith(f"pid {holder.pid} on host ")
        cfg = load_config("tiny", overrides=[f"output_dir={out}"])
        with (
            pytest.raises(config_mod.ConfigError, match=f"is in use by pid {holder.pid} on host"),
            run_folder.claim(out, cfg, dist.DistInfo()),
        ):
            pass
    finally:
        holder.send_signal(signal.SIGKILL)  # no cleanup of its own: the kernel drops the lock
        holder.wait(timeout=30)
    assert run_folder.in_use(out) is None
    with run_folder.claim(out, load_config("tiny", overrides=[f"output_dir={out}"]), dist.DistInfo()):
        assert json.loads((out / run_folder.LOCK_FILE).read_text())["pid"] == os.getpid()


def test_only_rank_0_takes_the_lock(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config("tiny", overrides=[f"output_dir={out}"])
    # another rank of the same run (no process group here: the broadcast is rank 0's verdict,
    # None): it takes no lock, so it does not collide with rank 0's
    with run_folder.claim(out, cfg, dist.DistInfo()), run_folder.claim(out, cfg, dist.DistInfo(1, 2)):
        pass
    rank1 = tmp_path / "rank1"
    rank1.mkdir()
    with run_folder.claim(rank1, cfg, dist.DistInfo(rank=1, world_size=2)):
        assert not (rank1 / run_folder.LOCK_FILE).exists()


# ---------------------------------------------------------------------------- resume


def test_a_resume_that_changes_run_defining_keys_names_every_one_and_changes_nothing(
    finished, tmp_path, capsys
):
    out = _copy(finished, tmp_path / "run")
    before = _tree(out)
    capsys.readouterr()
    args = [*QUICK, "steps=3", f"output_dir={out}", "resume=true", "rollout.group_size=4", "seed=1"]
    assert main(args) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith(
        "error: resume: seed=1 but the run was made with 0; rollout.group_size=4 but the run was made with 8. "
    )
    assert _tree(out) == before


def test_a_resume_may_change_safe_keys_and_config_yaml_records_them(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    original = (out / "config.yaml").read_text()
    assert main([*QUICK, "steps=3", "keep_checkpoints=5", f"output_dir={out}", "resume=true"]) == 0
    text = (out / "config.yaml").read_text()
    assert text.startswith(original)  # the run's own config, as it was
    (record,) = text[len(original) :].splitlines()
    assert record.startswith("# resumed 20") and "from " + str(out / "checkpoints" / "step_000002") in record
    # the copy moved the run: output_dir is one of the keys a resume may change, and changed
    assert record.endswith(
        f": output_dir={out} (was {finished}), steps=3 (was 2), keep_checkpoints=5 (was 2)"
    )
    assert yaml.safe_load(text)["steps"] == 2  # still a config file: the record is a comment
    assert _steps(out) == [1, 2, 3]
    out_lines = capsys.readouterr().out.splitlines()
    assert (
        out_lines[0].startswith("done: 1 step in ") and "(resumed at step 2; now at step 3)" in out_lines[0]
    )
    assert out_lines[-1] == f"report: grpo-fast report {out}"


def test_a_resume_whose_config_yaml_is_unreadable_stops_with_one_line(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    (out / "config.yaml").write_bytes(b"\xff\xfe: [")
    before = _tree(out)
    assert main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]) == 2
    (line,) = _err_lines(capsys)
    assert line.startswith(f"error: resume=true: {out / 'config.yaml'} cannot be read (")
    assert _tree(out) == before


def test_a_resume_of_a_run_with_no_checkpoint_stops_with_one_line_and_changes_nothing(
    finished, tmp_path, capsys
):
    """Planted: check_resumable without its last refusal → the run starts over: its rows and
    config.yaml rewritten (main at 54b861a: "holds no checkpoint: starting from scratch", exit 0)."""
    out = _copy(finished, tmp_path / "run")
    subprocess.run(["rm", "-r", str(out / "checkpoints"), str(out / "final")], check=True)
    before = _tree(out)
    capsys.readouterr()
    assert main([*QUICK, "steps=1", "checkpoint_every=0", f"output_dir={out}", "resume=true"]) == 2
    assert _err_lines(capsys) == [
        f"error: resume=true: output_dir {out} holds a run (metrics.jsonl up to step 2) but no checkpoint "
        "to continue it from: overwrite=true deletes it and starts over"
    ]
    assert _tree(out) == before


@pytest.mark.parametrize("left", ["nothing", "the evaluation before GRPO"])
def test_resume_with_no_run_s_work_in_the_folder_starts_the_run(tmp_path, capsys, left):
    """resume=true on a new folder, or on one a signal stopped before step 1 ("nothing was
    written; resume=true starts the run over"): the run starts, and says so."""
    out = tmp_path / "run"
    if left != "nothing":
        out.mkdir()
        (out / "metrics.jsonl").write_text('{"step": 0, "eval/accuracy": 0.1}\n')
    assert main([*QUICK, "steps=1", "checkpoint_every=0", f"output_dir={out}", "resume=true"]) == 0
    assert "holds no checkpoint: starting from scratch" in capsys.readouterr().err
    assert _steps(out) == [1]


def _only_checkpoint(finished: Path, tmp_path: Path) -> Path:
    """A copy of the finished run whose one checkpoint is step_000002."""
    out = _copy(finished, tmp_path / "run")
    subprocess.run(["rm", "-r", str(out / "checkpoints" / "step_000001")], check=True)
    return out


def test_a_resume_whose_only_checkpoint_lacks_its_trainer_state_stops_with_one_line(
    finished, tmp_path, capsys
):
    """Planted: check_resumable skipping a folder without trainer_state.pt (main at 54b861a: "holds
    no checkpoint: starting from scratch", exit 0, the run's files rewritten) → exit 0."""
    out = _only_checkpoint(finished, tmp_path)
    latest = out / "checkpoints" / "step_000002"
    (latest / "trainer_state.pt").unlink()
    before = _tree(out)
    capsys.readouterr()
    assert main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]) == 2
    assert _err_lines(capsys) == [
        f"error: checkpoint {latest} has no trainer_state.pt (the optimizer, schedule and step a resume "
        "needs); there is no checkpoint before it: overwrite=true deletes the run and starts over"
    ]
    assert _tree(out) == before
    assert main([*QUICK, "steps=3", f"output_dir={out}"]) == 2  # a fresh run: the folder holds a run
    assert "an incomplete checkpoint step_000002" in _err_lines(capsys)[0]
    assert _tree(out) == before


def _truncate(file: Path) -> None:
    file.write_bytes(file.read_bytes()[: file.stat().st_size // 2])


LATEST_DAMAGES = {  # the damage, the words the line says of it
    "no trainer_state.pt": (lambda c: (c / "trainer_state.pt").unlink(), "has no trainer_state.pt ("),
    "trainer_state.pt truncated": (
        lambda c: _truncate(c / "trainer_state.pt"),
        "cannot be read (not a whole torch.save archive: ",
    ),
    "no weights": (lambda c: (c / "model.safetensors").unlink(), "has no model weights (*.safetensors)"),
}


@pytest.mark.parametrize("damage", list(LATEST_DAMAGES))
def test_a_resume_whose_latest_checkpoint_is_damaged_names_the_one_before_and_changes_nothing(
    finished, tmp_path, capsys, damage
):
    """Two checkpoints, the latest damaged: refused in one line naming the damage and the
    checkpoint before it (main at 54b861a resumed from step_000001 without a word, or, for a
    truncated trainer_state.pt, failed after writing config.yaml's resume line); deleting the
    damaged folder as the line says resumes from step_000001.
    Planted: check_resumable checking list_checkpoints' latest (complete ones only) → exit 0."""
    harm, words = LATEST_DAMAGES[damage]
    out = _copy(finished, tmp_path / "run")
    latest = out / "checkpoints" / "step_000002"
    harm(latest)
    before = _tree(out)
    capsys.readouterr()
    assert main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]) == 2
    (line,) = _err_lines(capsys)
    assert words in line and str(latest) in line
    assert line.endswith("; delete the folder to resume from the checkpoint before it, step_000001")
    assert _tree(out) == before
    if damage == "no trainer_state.pt":  # the advice works
        subprocess.run(["rm", "-r", str(latest)], check=True)
        assert main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]) == 0
        assert f"resumed from {out / 'checkpoints' / 'step_000001'} at step 1" in capsys.readouterr().err
        assert _steps(out) == [1, 2, 3]


def test_a_resume_refused_after_the_checks_leaves_config_yaml_as_it_was(
    finished, tmp_path, capsys, monkeypatch
):
    """A refusal while the checkpoint loads (another world size, ...) comes before config.yaml's
    resume line. Planted: record_config before restore (main at 54b861a) → the line is there."""
    from grpo_fast.loop import setup as setup_mod

    def refuse(run, path):
        raise config_mod.ConfigError(f"resume=true: {path} was written by 2 rank(s)")

    monkeypatch.setattr(setup_mod, "restore", refuse)
    out = _copy(finished, tmp_path / "run")
    before = (out / "config.yaml").read_text()
    assert main([*QUICK, "steps=3", f"output_dir={out}", "resume=true"]) == 2
    assert _err_lines(capsys)[-1].endswith("was written by 2 rank(s)")
    assert (out / "config.yaml").read_text() == before


@pytest.mark.parametrize("how", ["fresh", "overwrite=true", "resume=true"])
def test_a_folder_holding_only_the_user_s_config_yaml_is_refused_and_the_file_kept(tmp_path, capsys, how):
    """``--config exp1/config.yaml output_dir=exp1``: the user's file is never replaced nor
    deleted. Planted: check_folder without users_config (main at 54b861a: the run replaced it,
    exit 0) → exit 0 and the file rewritten."""
    exp = tmp_path / "exp1"
    exp.mkdir()
    mine = exp / "config.yaml"
    mine.write_text("# my experiment\nsteps: 1\nrollout:\n  group_size: 4\n")
    before = _tree(exp)
    capsys.readouterr()
    extra = [] if how == "fresh" else [how]
    assert main([*QUICK, "--config", str(mine), f"output_dir={exp}", *extra]) == 2
    assert _err_lines(capsys) == [
        f"error: output_dir {exp} holds {mine}, which no run wrote (your own config file?): a run writes "
        f"its resolved config there and would replace it; give the run another output_dir (e.g. "
        f"output_dir={exp / 'run'}), or move the file"
    ]
    assert _tree(exp) == before  # no lock file either
    assert main([*QUICK, "--config", str(mine), f"output_dir={exp / 'run'}"]) == 0  # as the line says
    assert mine.read_text().startswith("# my experiment\n") and (exp / "run" / "config.yaml").is_file()


def test_the_final_summary_goes_to_stdout_with_the_model_the_eval_and_the_report(tmp_path, capsys):
    out = tmp_path / "run"
    args = [*QUICK, "steps=2", "eval_every=2", "data.eval_subset_size=8", f"output_dir={out}"]
    assert main([*args, "health.enabled=false"]) == 0
    assert (out / "health.jsonl").read_text() == ""  # there, as the docs say, and empty: no events
    captured = capsys.readouterr()
    lines = captured.out.splitlines()
    assert lines[0].startswith("done: 2 steps in ") and lines[0].endswith(f"; model in {out / 'final'}")
    row = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines()][-1]
    assert lines[1] == f"final eval: eval/accuracy {row['eval/accuracy']:.3f} at step 2"
    assert lines[2] == f"report: grpo-fast report {out}"
    assert "done:" not in captured.err and captured.err.splitlines()[0].startswith("plan: ")


def test_check_resume_compares_against_the_defaults_for_keys_an_older_config_lacks(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    cfg = load_config("tiny", overrides=[f"output_dir={out}"])
    tree = yaml.safe_load(config_mod.to_yaml(cfg))
    del tree["loss"]["clip_high"]  # an older run's config.yaml, without a newer key
    (out / "config.yaml").write_text(yaml.safe_dump(tree))
    run_folder.check_resume(out, cfg)  # the default: no change
    changed = dataclasses.replace(cfg, loss=dataclasses.replace(cfg.loss, clip_high=0.5))
    with pytest.raises(config_mod.ConfigError, match=r"loss.clip_high=0.5 but the run was made with 0.2"):
        run_folder.check_resume(out, changed)
    assert Config().loss.clip_high == 0.2


def test_a_lock_file_left_by_a_dead_run_does_not_block(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    (out / run_folder.LOCK_FILE).write_text(json.dumps({"pid": 1, "host": "x", "started": "then"}))
    assert run_folder.in_use(out) is None
    assert main([*QUICK, "steps=1", f"output_dir={out}"]) == 0
    assert json.loads((out / run_folder.LOCK_FILE).read_text())["pid"] == os.getpid()


def _claim_worker(rank: int, port: int, out: str, notes: str) -> None:
    """One of two gloo ranks claiming ``out``: writes what it saw to ``notes/rank<r>.json``."""
    from support.ranks import join_cpu_ranks

    world = join_cpu_ranks(rank, 2, port)
    cfg = load_config("tiny", overrides=[f"output_dir={out}"])
    seen = {"pid": os.getpid()}
    try:
        with run_folder.claim(Path(out), cfg, world):
            lock = Path(out) / run_folder.LOCK_FILE
            seen["owner"] = json.loads(lock.read_text())["pid"] if lock.is_file() else None
            dist.barrier()
    except config_mod.ConfigError as exc:
        seen["error"] = str(exc)
    finally:
        dist.shutdown()
    (Path(notes) / f"rank{rank}.json").write_text(json.dumps(seen))


def test_under_two_ranks_rank_0_holds_the_lock_and_a_refusal_stops_both(finished, tmp_path):
    import socket

    def two_ranks(out: Path) -> list[dict]:
        notes = tmp_path / f"notes_{out.name}"
        notes.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        start_ranks(_claim_worker, args=(port, str(out), str(notes)), nprocs=2, join=True)
        return [json.loads((notes / f"rank{r}.json").read_text()) for r in (0, 1)]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    rank0, rank1 = two_ranks(fresh)
    assert rank0["owner"] == rank1["owner"] == rank0["pid"] != rank1["pid"]  # rank 0's lock
    used = _copy(finished, tmp_path / "used")
    rank0, rank1 = two_ranks(used)
    assert rank0["error"] == rank1["error"] and " holds a run (" in rank0["error"]  # both stop


@pytest.mark.parametrize("preset", sorted(config_mod.PRESETS))
def test_the_config_tree_is_what_config_yaml_holds(preset):
    """``run_folder._tree`` (the plain tree the resume and the ``auto`` record compare) is what
    ``config.yaml`` reads back as, values and types, on every preset and a tuple-valued key."""
    cfg = load_config(preset, overrides=["train.betas=[0.8,0.9]"], check_device=False)
    want = yaml.safe_load(config_mod.to_yaml(cfg))
    got = run_folder._tree(cfg)
    assert got == want

    def types(a, b):
        if isinstance(a, dict):
            return all(types(a[k], b[k]) for k in a)
        if isinstance(a, list):
            return all(types(x, y) for x, y in zip(a, b))
        return type(a) is type(b)

    assert types(got, want)
