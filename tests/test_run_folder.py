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
from run_folders import QUICK, finished_run
from run_folders import copy_folder as _copy
from run_folders import tree as _tree

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
    assert config_mod.yaml.safe_load(text)["steps"] == 2  # still a config file: the record is a comment
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


def test_resume_with_nothing_to_resume_starts_over_without_the_old_rows(finished, tmp_path, capsys):
    out = _copy(finished, tmp_path / "run")
    subprocess.run(["rm", "-r", str(out / "checkpoints"), str(out / "final")], check=True)
    assert main([*QUICK, "steps=1", "checkpoint_every=0", f"output_dir={out}", "resume=true"]) == 0
    assert "holds no checkpoint: starting from scratch" in capsys.readouterr().err
    assert _steps(out) == [1]


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
    tree = config_mod.yaml.safe_load(config_mod.to_yaml(cfg))
    del tree["loss"]["clip_high"]  # an older run's config.yaml, without a newer key
    (out / "config.yaml").write_text(config_mod.yaml.safe_dump(tree))
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
    from grpo_fast.testing import join_cpu_ranks

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

    import torch.multiprocessing as mp

    def two_ranks(out: Path) -> list[dict]:
        notes = tmp_path / f"notes_{out.name}"
        notes.mkdir()
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        mp.spawn(_claim_worker, args=(port, str(out), str(notes)), nprocs=2, join=True)
        return [json.loads((notes / f"rank{r}.json").read_text()) for r in (0, 1)]

    fresh = tmp_path / "fresh"
    fresh.mkdir()
    rank0, rank1 = two_ranks(fresh)
    assert rank0["owner"] == rank1["owner"] == rank0["pid"] != rank1["pid"]  # rank 0's lock
    used = _copy(finished, tmp_path / "used")
    rank0, rank1 = two_ranks(used)
    assert rank0["error"] == rank1["error"] and " holds a run (" in rank0["error"]  # both stop
