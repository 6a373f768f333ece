"""The plan line's time estimate (grpo_fast.obs.eta): a run's end records its setup's timings in
this machine's history, the next plan line of the same setup quotes them (another setup does
not), the fingerprint follows the per-step-cost keys only, the arithmetic of what is left, a
corrupt history breaks nothing, the history is written atomically and stays bounded, and the
tiny preset without history gets the speed probe's estimate."""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import signal
import statistics
import types
from pathlib import Path

import pytest
import torch
from support.stand_ins import plan_threads_note

from grpo_fast import dist
from grpo_fast.config import ON_RESUME, load_config
from grpo_fast.loop import setup as setup_mod
from grpo_fast.obs import eta
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.train import main

CPU = torch.device("cpu")
TODAY = datetime.date.today().isoformat()


class _Today(datetime.date):
    """``datetime.date`` whose today is ``TODAY``, the day this module was loaded."""

    @classmethod
    def today(cls):
        return cls.fromisoformat(TODAY)


@pytest.fixture(autouse=True)
def _one_day(monkeypatch):
    """The history records the day of each run (``eta.record_run``): here always ``TODAY``, so
    that a suite that crosses midnight between loading this module and a run's end compares the
    same day (CI at 00:06 UTC: "2026-12-05" recorded against "2026-12-04")."""
    monkeypatch.setattr(eta, "datetime", types.SimpleNamespace(date=_Today))


# a tiny run of a few seconds: a 20-step warm start, evaluations, no checkpoints
QUICK = [
    "--preset",
    "tiny",
    "sft.steps=20",
    "sft.check_size=8",
    "eval_every=2",
    "checkpoint_every=0",
    "rollout.batch_size=16",
    "train.micro_batch_size=16",
    "data.eval_subset_size=16",
    "logging.progress=false",
    "logging.sample_every=0",
]


def _cfg(*overrides: str):
    return load_config("tiny", overrides=list(overrides))


def _rows(path: Path) -> list[dict]:
    return [json.loads(ln) for ln in path.read_text().splitlines() if ln.strip()]


def _plan_line(err: str) -> str:
    return next(ln for ln in err.splitlines() if ln.startswith("plan: "))


def _write_run(out: Path, step_s=(0.2, 0.1, 0.3), eval_s=(0.5, 0.7), sft=((10, 1.0), (20, 2.0))) -> Path:
    """A run folder's logs as a run writes them: a step-0 row, GRPO rows, sft_metrics.jsonl."""
    out.mkdir(parents=True, exist_ok=True)
    rows = [{"step": 0, "eval/accuracy": 0.1, "sft/steps": 20}]
    for i, s in enumerate(step_s, 1):
        rows.append({"step": i, "time/step_s": s, **({"time/eval_s": eval_s[i - 2]} if i >= 2 else {})})
    (out / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + '{"step": 4, "ti')
    (out / "sft_metrics.jsonl").write_text(
        "".join(json.dumps({"step": s, "time/elapsed_s": t}) + "\n" for s, t in sft)
    )
    return out


# ---------------------------------------------------------------- the round trip, real runs


def test_a_run_s_end_records_its_setup_and_the_next_plan_line_quotes_it(tmp_path, capsys):
    """Planted: no ``eta.record_run`` after ``finish`` (train.py) → no entry."""
    assert not eta.history_path().exists()
    assert main([*QUICK, "steps=3", f"output_dir={tmp_path / 'a'}"]) == 0
    assert _plan_line(capsys.readouterr().err).endswith("; " + eta.NO_ESTIMATE)
    entries = eta.load_history()
    assert list(entries) == [eta.fingerprint(_cfg(*QUICK[2:], "steps=3"), CPU, 1)]
    entry = entries[next(iter(entries))]
    rows = _rows(tmp_path / "a" / "metrics.jsonl")
    assert entry["grpo_step_s"] == statistics.median(r["time/step_s"] for r in rows[1:])
    evals = [r["time/eval_s"] for r in rows if "time/eval_s" in r]
    assert len(evals) == 2 and entry["eval_s"] == pytest.approx(statistics.fmean(evals))  # steps 2, 3
    assert entry["sft_steps"] == rows[0]["sft/steps"] == 20 and entry["sft_max"] == 20
    last_sft = _rows(tmp_path / "a" / "sft_metrics.jsonl")[-1]
    assert last_sft["step"] == 20 and entry["sft_step_s"] == pytest.approx(last_sft["time/elapsed_s"] / 20)
    assert entry["date"] == TODAY and entry["cores"] == eta.cpu_cores()
    assert entry["load"] == {"grpo_step_s": 0.0, "eval_s": 0.0, "sft_step_s": 0.0}  # idle (conftest)
    assert entry["machine"] == {
        "device": "cpu",
        "cpu": eta.cpu_model(),
        "threads": torch.get_num_threads(),
        "world_size": 1,
    }

    # the same setup, fewer steps (steps is not part of it): its plan line quotes the entry
    assert main([*QUICK, "steps=2", f"output_dir={tmp_path / 'b'}"]) == 0
    total = 20 * entry["sft_step_s"] + 2 * entry["grpo_step_s"] + 2 * entry["eval_s"]  # evals: 0, 2
    assert _plan_line(capsys.readouterr().err).endswith(
        f", an evaluation at steps 0 and 2; {plan_threads_note()}; about {eta.format_duration(total)} on this machine (from its "
        f"last run of this setup on {TODAY}: 20 warm-start steps, "
        f"{eta.format_seconds(entry['grpo_step_s'])} s a GRPO step)"
    )
    assert len(eta.load_history()) == 1  # the same entry, updated
    # another setup (a per-step-cost key changed), or another world size: nothing to quote
    assert eta.plan_estimate(_cfg(*QUICK[2:], "rollout.batch_size=32"), CPU, 1) == eta.NO_ESTIMATE
    assert eta.plan_estimate(_cfg(*QUICK[2:]), CPU, 2) == eta.NO_ESTIMATE


def test_a_run_stopped_by_a_signal_records_what_it_timed(tmp_path, monkeypatch, capsys):
    """Planted: no ``eta.record_run`` in train.py's ``except Preempted`` → no entry."""
    from grpo_fast.loop import stats

    real = stats.step_metrics  # close_step's metrics row, at each step's end

    def signalled(run, step, *a, **k):
        if step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # met at step 2's end: checkpoint, then stop
        return real(run, step, *a, **k)

    monkeypatch.setattr(stats, "step_metrics", signalled)
    args = [*QUICK, "sft.steps=0", "eval_every=0", "steps=5", f"output_dir={tmp_path}"]
    assert main(args) == 128 + signal.SIGTERM
    assert "error: SIGTERM during step 2" in capsys.readouterr().err
    (entry,) = eta.load_history().values()
    rows = _rows(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2]
    assert entry["grpo_step_s"] == statistics.median(r["time/step_s"] for r in rows)
    assert "sft_steps" not in entry and "eval_s" not in entry  # no warm start, no evaluation


# ---------------------------------------------------------------- the fingerprint


def test_the_fingerprint_follows_the_per_step_cost_keys_and_not_the_run_s_length():
    """Planted: ``rollout.batch_size`` left out of ``COST_KEYS`` (or ``steps`` put in) → fails."""
    base = eta.fingerprint(_cfg(), CPU, 1)
    for other in ("rollout.batch_size=128", "train.micro_batch_size=64", "model.gradient_checkpointing=true"):
        assert eta.fingerprint(_cfg(other), CPU, 1) != base, other
    for same in ("steps=20", "sft.steps=5", "eval_every=5", "seed=3", "output_dir=elsewhere", "resume=true"):
        assert eta.fingerprint(_cfg(same), CPU, 1) == base, same
    assert eta.fingerprint(_cfg(), CPU, 2) != base  # the machine: the world size
    assert eta.fingerprint(_cfg(), torch.device("meta"), 1) != base  # and the device type


def test_every_cost_key_is_a_config_key():
    keys = set(ON_RESUME["run"]) | set(ON_RESUME["safe"])  # every config key is in one of the two
    assert [k for k in eta.COST_KEYS if k not in keys] == []
    assert len(set(eta.COST_KEYS)) == len(eta.COST_KEYS)
    assert "steps" not in eta.COST_KEYS and "sft.steps" not in eta.COST_KEYS and "seed" not in eta.COST_KEYS


# ---------------------------------------------------------------- the arithmetic


def test_the_total_counts_what_is_left_and_caps_the_warm_start_at_sft_steps():
    """Planted: the warm start's count not capped by ``sft.steps`` (or a resume's steps not
    taken off) → fails."""
    t = eta.Timings(sft_step_s=0.1, sft_steps=230, sft_max=1000, grpo_step_s=0.12, eval_s=0.5)
    fresh = eta.plan_counts(_cfg(), t, 0, 0)  # tiny: sft.steps=1000, steps=500, eval_every=25
    assert fresh == {"sft": 230, "grpo": 500, "eval": 21, "eval_full": 0}  # 20 + the one before GRPO
    assert eta.total_seconds(fresh, t) == pytest.approx(230 * 0.1 + 500 * 0.12 + 21 * 0.5)
    assert eta.plan_counts(_cfg("sft.steps=100"), t, 0, 0)["sft"] == 100  # capped by sft.steps
    ran_to_cap = eta.Timings(**{**t.__dict__, "sft_steps": 230, "sft_max": 230})
    assert eta.plan_counts(_cfg("sft.steps=400"), ran_to_cap, 0, 0)["sft"] == 400  # it never stopped early
    assert eta.plan_counts(_cfg("sft.steps=0"), t, 0, 0)["sft"] == 0
    resumed = eta.plan_counts(_cfg(), t, 200, None)  # from step 200's checkpoint: the warm start is over
    assert resumed == {"sft": 0, "grpo": 300, "eval": 12, "eval_full": 0}  # 225, 250, ..., 500
    assert eta.plan_counts(_cfg("steps=510"), t, 200, None)["eval"] == 13  # and the last step's
    assert eta.plan_counts(_cfg(), t, 0, 30)["sft"] == 200  # a stopped warm start: 30 steps done
    full = eta.plan_counts(_cfg("full_eval_every=100"), t, 0, 0)
    assert full["eval_full"] == 5 and eta.total_seconds(full, t) is None  # no time for it: no total
    cfg = _cfg()  # data.eval_subset_size=0 with eval_every > 0 is refused; plan_counts still says 0
    no_subset = dataclasses.replace(cfg, data=dataclasses.replace(cfg.data, eval_subset_size=0))
    assert eta.plan_counts(no_subset, t, 0, 0)["eval"] == 0


def test_a_resumed_plan_line_counts_from_the_checkpoint(tmp_path):
    """The resume point is read from the folder: a checkpoint's step, else a stopped warm start's."""
    cfg = _cfg(f"output_dir={tmp_path}", "resume=true")
    entry = {"sft_step_s": 0.1, "sft_steps": 230, "sft_max": 1000, "grpo_step_s": 0.12, "eval_s": 0.5}
    eta.write_history({eta.fingerprint(cfg, CPU, 1): {**entry, "date": "2026-12-02"}})
    fresh = eta.plan_estimate(_cfg(f"output_dir={tmp_path}"), CPU, 1)  # 23 + 60 + 10.5 s
    assert fresh == (
        "about 1.6 min on this machine (from its last run of this setup on 2026-12-02: "
        "230 warm-start steps, 0.12 s a GRPO step)"
    )
    assert eta.resume_point(cfg) == (0, 0)  # resume=true in an empty folder: from scratch
    sft = tmp_path / "checkpoints" / "sft_warm_start"
    sft.mkdir(parents=True)
    (sft / ckpt.STATE_FILE).write_bytes(b"")
    (tmp_path / "sft_metrics.jsonl").write_text('{"step": 10}\n{"step": 30}\n')
    assert eta.resume_point(cfg) == (0, 30)
    assert "200 warm-start steps left" in eta.plan_estimate(cfg, CPU, 1)
    step = tmp_path / "checkpoints" / ckpt.step_dir_name(200)
    step.mkdir()
    (step / ckpt.STATE_FILE).write_bytes(b"")
    assert eta.resume_point(cfg) == (200, None)
    assert eta.plan_estimate(cfg, CPU, 1) == (  # 300 × 0.12 + 12 × 0.5 s
        "about 42 s on this machine (from its last run of this setup on 2026-12-02: 0.12 s a GRPO step)"
    )
    done = _cfg(f"output_dir={tmp_path}", "resume=true", "steps=200")
    assert eta.plan_estimate(done, CPU, 1) == "the progress lines give the time left"  # nothing left


def test_durations_read_as_a_person_reads_them():
    assert [eta.format_duration(s) for s in (0.2, 42.4, 59.4, 90, 599, 1500, 3569, 5400, 86400)] == [
        "1 s",
        "42 s",
        "59 s",
        "1.5 min",
        "10 min",
        "25 min",
        "59 min",
        "1.5 h",
        "24.0 h",
    ]
    assert [eta.format_seconds(s) for s in (0.123, 0.5, 1.234, 12.3)] == ["0.12", "0.50", "1.2", "12"]


# ---------------------------------------------------------------- what a run measured


def test_the_measurements_come_from_the_run_s_logs(tmp_path):
    """A partial last line is skipped; only this process's GRPO rows (after ``first``) count."""
    out = _write_run(tmp_path / "run")
    found = eta.measured(out, first=0)
    assert found == {"grpo_step_s": 0.2, "eval_s": pytest.approx(0.6), "sft_step_s": 0.1}
    assert eta.measured(out, first=1) == {"grpo_step_s": pytest.approx(0.2), "eval_s": pytest.approx(0.6)}


def test_a_resumed_warm_start_is_timed_from_its_own_rows():
    """Planted: no new segment where ``time/elapsed_s`` starts again → the resumed process's first
    interval is counted from the stopped one's clock (a negative time)."""
    rows = [{"step": 10, "time/elapsed_s": 5.0}, {"step": 20, "time/elapsed_s": 10.0}]  # stopped at 23
    rows += [{"step": 30, "time/elapsed_s": 2.1}, {"step": 40, "time/elapsed_s": 5.1}]  # resumed at 23
    assert eta.sft_step_seconds(rows) == pytest.approx(0.3)
    assert eta.sft_step_seconds(rows[:2]) == pytest.approx(0.5)
    assert eta.sft_step_seconds(rows[:3]) is None and eta.sft_step_seconds([]) is None


def test_what_a_run_did_not_measure_keeps_the_entry_s_earlier_value(tmp_path):
    cfg = _cfg(f"output_dir={tmp_path}")
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "a"), first=0, sft_steps=20)
    no_sft = _write_run(tmp_path / "b", step_s=(0.4,), eval_s=(), sft=())
    eta.record_run(cfg, CPU, dist.DistInfo(), no_sft, first=0, sft_steps=None)
    (entry,) = eta.load_history().values()
    assert entry["grpo_step_s"] == 0.4 and entry["eval_s"] == pytest.approx(0.6)
    assert entry["sft_step_s"] == 0.1 and entry["sft_steps"] == 20 and entry["sft_max"] == 1000
    eta.record_run(cfg, CPU, dist.DistInfo(rank=1, world_size=2), no_sft)  # another rank: no write
    assert len(eta.load_history()) == 1


# ---------------------------------------------------------------- the history file


@pytest.mark.parametrize(
    "text",
    [b"{not json", b"[]", b'{"version": 1, "entries": []}', b'{"version": 99, "entries": {}}', b"\x00\xff"],
)
def test_a_corrupt_history_is_ignored_then_replaced(tmp_path, text):
    """Planted: ``load_history`` without its ``ValueError`` catch (or its shape check) → raises."""
    path = eta.history_path()
    path.parent.mkdir(parents=True)
    path.write_bytes(text)
    cfg = _cfg("rollout.batch_size=32")  # not the tiny preset's setup: no probe estimate either
    assert eta.load_history() == {}
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)
    assert len(eta.load_history()) == 1  # the next write replaced it
    assert eta.plan_estimate(cfg, CPU, 1).startswith("about ")


def test_an_entry_with_fields_of_the_wrong_type_gives_no_estimate():
    """Planted: ``_number`` without its ``math.isfinite`` (``json`` reads Infinity) → "about inf h"."""
    cfg = _cfg("rollout.batch_size=32", "sft.steps=0", "eval_every=0", "steps=200")
    for bad in ("fast", float("nan"), float("inf"), -1.0, True, None, [0.5]):
        eta.write_history({eta.fingerprint(cfg, CPU, 1): {"grpo_step_s": bad, "date": 3}})
        assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE, bad
    eta.write_history({eta.fingerprint(cfg, CPU, 1): {"grpo_step_s": 0.5}})  # no date: none said
    assert eta.plan_estimate(cfg, CPU, 1) == (
        "about 1.7 min on this machine (from its last run of this setup: 0.50 s a GRPO step)"
    )


def test_an_unreadable_history_breaks_no_run(tmp_path):
    eta.history_path().mkdir(parents=True)  # a folder where the file should be
    cfg = _cfg("rollout.batch_size=32")
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)  # no raise


def test_no_home_directory_breaks_no_run(tmp_path, monkeypatch):
    """An arbitrary-UID container: no XDG_CACHE_HOME, no HOME, no passwd entry, so ``Path.home()``
    raises RuntimeError; the plan line has no estimate and the run's end records nothing."""
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)

    def no_home():
        raise RuntimeError("Could not determine home directory.")

    monkeypatch.setattr(eta.Path, "home", staticmethod(no_home))
    cfg = _cfg("rollout.batch_size=32")
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)  # no raise


def test_the_history_is_written_atomically(tmp_path, monkeypatch):
    """Planted: ``write_history`` writing ``path`` itself (no temporary file) → the old history
    is left half-written."""
    cfg = _cfg("rollout.batch_size=32")
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "a"), sft_steps=20)
    path = eta.history_path()
    before = path.read_bytes()

    def dump(obj, fh, **kwargs):
        fh.write('{"version": 1, "entr')  # a partial write, then the disk is full
        raise OSError(28, "No space left on device")

    monkeypatch.setattr(eta.json, "dump", dump)
    eta.record_run(_cfg("rollout.batch_size=64"), CPU, dist.DistInfo(), tmp_path / "a", sft_steps=20)
    assert path.read_bytes() == before
    assert sorted(p.name for p in path.parent.iterdir()) == ["timings.json"]  # no temporary file left
    with pytest.raises(OSError):
        eta.write_history({}, path)
    assert path.read_bytes() == before


def test_the_history_keeps_the_newest_setups(tmp_path):
    """Planted: no cut at ``MAX_ENTRIES`` → the file grows without bound."""
    entries = {f"k{i}": {"grpo_step_s": 0.1, "date": TODAY} for i in range(eta.MAX_ENTRIES + 6)}
    eta.write_history(entries)
    kept = eta.load_history()
    assert list(kept) == [f"k{i}" for i in range(6, eta.MAX_ENTRIES + 6)]
    cfg = _cfg("rollout.batch_size=32")
    key = eta.fingerprint(cfg, CPU, 1)
    eta.write_history({key: {"grpo_step_s": 0.1}, **dict(list(kept.items())[1:])})  # the oldest
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)
    after = list(eta.load_history())
    assert len(after) == eta.MAX_ENTRIES and after[0] == "k7" and after[-1] == key  # now the newest


# ---------------------------------------------------------------- the tiny preset's probe estimate


class _Events:
    enabled = True

    def __init__(self):
        self.lines: list[str] = []

    def event(self, line: str) -> None:
        self.lines.append(line)


def test_the_tiny_preset_without_history_gets_the_speed_probe_s_estimate(monkeypatch):
    """Planted: the reference scaled by reference / probe instead of probe / reference (or no
    tiny branch) → fails."""
    monkeypatch.setattr(eta, "speed_probe", lambda: 2 * eta.TINY_REFERENCE_PROBE_S)  # half as fast
    cfg = _cfg()  # sft.steps=1000 (target 0.25), steps=500, an evaluation every 25 steps
    sft = min(eta.TINY_REFERENCE_SFT_STEPS, cfg.sft.steps)
    total = 2 * (
        sft * eta.TINY_REFERENCE_SFT_STEP_S
        + 500 * eta.TINY_REFERENCE_GRPO_STEP_S
        + 21 * eta.TINY_REFERENCE_EVAL_S
    )
    logger = _Events()
    setup_mod._announce_plan(cfg, dist.DistInfo(), logger, CPU)
    assert logger.lines == [
        "plan: an SFT warm start of up to 1000 steps (it stops once greedy accuracy on 200 training "
        "problems reaches 0.25, checked every 10 steps), then GRPO to step 500, 32 prompts × 8 responses "
        f"each, an evaluation every 25 steps; about {eta.format_duration(total)} on this machine "
        "(estimated from a speed probe; no run of this setup here yet)"
    ]
    assert "speed probe" in eta.plan_estimate(_cfg("steps=50", "seed=1"), CPU, 1)  # its length, its seed
    for other in (_cfg("rollout.batch_size=32"), _cfg("train.micro_batch_size=64")):  # another setup
        assert eta.plan_estimate(other, CPU, 1) == eta.NO_ESTIMATE
    assert eta.plan_estimate(cfg, CPU, 2) == eta.NO_ESTIMATE  # not one process
    eta.write_history({eta.fingerprint(cfg, CPU, 1): {"grpo_step_s": 0.1, "eval_s": 0.1, "sft_step_s": 0.1}})
    assert "from its last run" in eta.plan_estimate(cfg, CPU, 1)  # a measurement beats the probe


def test_the_speed_probe_is_short_and_leaves_the_run_s_random_streams_alone():
    """Planted: the probe's matrices from the global generator → the run's RNG moves."""
    state = torch.get_rng_state()
    value = eta.speed_probe()
    assert torch.equal(torch.get_rng_state(), state)
    assert 0 < value < 1.0  # a generous bound: 4-8 ms per matmul on 2 shared Xeon cores


def test_the_probe_command_prints_the_line_to_paste(capsys):
    assert eta.main(["--probe"]) == 0
    line = capsys.readouterr().out.strip()
    assert line.startswith("TINY_REFERENCE_PROBE_S = ") and float(line.split()[2]) > 0


# ---------------------------------------------------------------- the machine's load


def _busy(monkeypatch, load: float, cores: int = 2) -> None:
    """This machine's 1-minute load average and cores, as eta reads them."""
    monkeypatch.setattr(eta, "machine_load", lambda: load)
    monkeypatch.setattr(eta, "cpu_cores", lambda: cores)


def test_timings_made_under_contention_are_not_recorded_and_the_earlier_ones_stay(tmp_path, monkeypatch):
    """A run's end at load 5 on 2 cores (3 a core once its own 2 threads are taken out): its
    timings stay out of the history, the entry keeps the idle run's. Planted: record_run
    without its contention check → the loaded run's 0.4 s a step replaces 0.2."""
    monkeypatch.setattr(eta.torch, "get_num_threads", lambda: 2)
    cfg = _cfg("rollout.batch_size=32", f"output_dir={tmp_path}")
    _busy(monkeypatch, 0.4)
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "idle"), sft_steps=20)
    (idle,) = eta.load_history().values()
    assert idle["grpo_step_s"] == 0.2 and idle["cores"] == 2
    assert idle["load"] == dict.fromkeys(("grpo_step_s", "eval_s", "sft_step_s"), 0.0)  # 0.4 - 2 threads
    _busy(monkeypatch, 5.0)
    loaded = _write_run(tmp_path / "loaded", step_s=(0.4, 0.4), eval_s=(1.4,), sft=((10, 9.0),))
    eta.record_run(cfg, CPU, dist.DistInfo(), loaded, sft_steps=10)
    (entry,) = eta.load_history().values()
    assert {k: entry[k] for k in ("grpo_step_s", "eval_s", "sft_step_s")} == {
        k: idle[k] for k in ("grpo_step_s", "eval_s", "sft_step_s")
    }
    assert entry["sft_steps"] == 10  # a count, not a timing: the load does not change it
    # the plan line's reading, before the run computed, counts too: 1.2 on 2 cores is contended
    _busy(monkeypatch, 1.2)
    assert eta.plan_estimate(cfg, CPU, 1).endswith("; load 1.2 on 2 cores: expect it slower")
    _busy(monkeypatch, 0.0)  # idle at the run's end, but the plan line saw 1.2: not recorded
    eta.record_run(cfg, CPU, dist.DistInfo(), loaded, sft_steps=10)
    assert eta.load_history()[eta.fingerprint(cfg, CPU, 1)]["grpo_step_s"] == 0.2
    eta.record_run(cfg, CPU, dist.DistInfo(), loaded, sft_steps=10)  # idle throughout: recorded
    assert eta.load_history()[eta.fingerprint(cfg, CPU, 1)]["grpo_step_s"] == pytest.approx(0.4)


def test_an_entry_timed_under_load_is_not_quoted(monkeypatch):
    """An entry whose timings were made at a load of 3 on 2 cores (the issue's "about 20 min" for
    a run that took 29 s): a loaded ``load``, or an older version's ``load1`` with the run's own
    threads in it. Planted: timings_of without its contention filter → "about 8.3 h"."""
    _busy(monkeypatch, 0.0)
    cfg = _cfg("rollout.batch_size=32", "sft.steps=0", "eval_every=0", "steps=500")
    key = eta.fingerprint(cfg, CPU, 1)
    idle = {"grpo_step_s": 60.0, "load": {"grpo_step_s": 0.2}, "cores": 2}
    eta.write_history({key: idle})
    assert eta.plan_estimate(cfg, CPU, 1).startswith("about 8.3 h on this machine")
    machine = {"device": "cpu", "threads": 2, "world_size": 1}
    for loaded in (
        {**idle, "load": {"grpo_step_s": 3.0}},
        {"grpo_step_s": 60.0, "load1": 5.0, "machine": machine},
    ):
        eta.write_history({key: loaded})
        assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE, loaded
    eta.write_history({key: {"grpo_step_s": 60.0, "load1": 2.5, "machine": machine}})  # 0.5: its own
    assert eta.plan_estimate(cfg, CPU, 1).startswith("about 8.3 h on this machine")


def test_the_plan_line_says_when_the_machine_is_busy(monkeypatch):
    """Planted: load_note's threshold on the load itself, not per core → 1.8 on 4 cores warns."""
    cfg = _cfg("rollout.batch_size=32")
    _busy(monkeypatch, 3.2, cores=2)
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE + "; load 3.2 on 2 cores: expect it slower"
    _busy(monkeypatch, 1.8, cores=4)  # 0.45 a core
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE
    _busy(monkeypatch, 2.1, cores=4)
    assert eta.plan_estimate(cfg, CPU, 1).endswith("; load 2.1 on 4 cores: expect it slower")
    monkeypatch.setattr(eta, "machine_load", lambda: None)  # no load average on this OS: no note
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE


def test_a_run_without_a_warm_start_leaves_the_tiny_preset_its_probe_for_the_warm_start(
    tmp_path, monkeypatch
):
    """A ``sft.steps=0`` run of the tiny preset's setup records GRPO and eval times only; the next
    run with the warm start takes the warm start from the speed probe (main at 54b861a: "no time
    estimate yet"). Planted: no ``_filled`` in _estimate → NO_ESTIMATE."""
    monkeypatch.setattr(eta, "speed_probe", lambda: eta.TINY_REFERENCE_PROBE_S)
    no_warm = _cfg("sft.steps=0", f"output_dir={tmp_path}")
    eta.record_run(no_warm, CPU, dist.DistInfo(), _write_run(tmp_path / "run", sft=()), sft_steps=0)
    (entry,) = eta.load_history().values()
    assert "sft_step_s" not in entry and "sft_steps" not in entry
    cfg = _cfg()  # the warm start (to 0.25, at most 1000 steps), GRPO to step 500, 21 evaluations
    sft = eta.TINY_REFERENCE_SFT_STEPS
    total = sft * eta.TINY_REFERENCE_SFT_STEP_S + 500 * 0.2 + 21 * 0.6
    assert eta.plan_estimate(cfg, CPU, 1) == (
        f"about {eta.format_duration(total)} on this machine (from its last run of this setup on {TODAY} "
        f"and a speed probe for what it did not time: {sft} warm-start steps, 0.20 s a GRPO step)"
    )


class _Meter:
    """``eta.other_work_meter`` reading ``value`` cores of other work (None: no /proc/stat)."""

    value: float | None = 0.0

    def __init__(self):
        self.latest = None

    def read(self):
        self.latest = type(self).value
        return self.latest


def test_a_run_just_after_another_is_not_contended_by_its_lingering_load_average(tmp_path, monkeypatch):
    """On 2 cores a run that ends leaves a 1-minute load average near 2 for a minute: the next
    run's plan line (others read over the setup: 0.0) says nothing of it, and that run's timings,
    with no other work over it, are recorded. Planted: plan_estimate reading the load average
    whatever ``others`` says → "load 1.9 … expect it slower" and nothing recorded."""
    monkeypatch.setattr(eta.torch, "get_num_threads", lambda: 2)
    _busy(monkeypatch, 1.9)  # the last run's threads, still in the 1-minute average
    monkeypatch.setattr(eta, "other_work_meter", _Meter)
    cfg = _cfg("rollout.batch_size=32", f"output_dir={tmp_path}")
    assert eta.plan_estimate(cfg, CPU, 1, others=0.0) == eta.NO_ESTIMATE
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)
    (entry,) = eta.load_history().values()
    assert entry["grpo_step_s"] == 0.2 and entry["load"]["grpo_step_s"] == 0.0


def test_other_work_during_the_run_keeps_its_timings_out_and_the_plan_line_names_it(tmp_path, monkeypatch):
    """Idle before, 1.5 cores of other work over the run (the meter the plan line started), idle
    load average at the end: not recorded. Busy before (1.6 cores): the plan line says "other
    work 1.6". Planted: _others_load without the run's meter → the loaded run recorded."""
    monkeypatch.setattr(eta.torch, "get_num_threads", lambda: 2)
    _busy(monkeypatch, 0.0)
    monkeypatch.setattr(eta, "other_work_meter", _Meter)
    cfg = _cfg("rollout.batch_size=32", f"output_dir={tmp_path}")
    monkeypatch.setattr(_Meter, "value", 1.5)
    assert eta.plan_estimate(cfg, CPU, 1, others=0.0) == eta.NO_ESTIMATE
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)
    assert "grpo_step_s" not in next(iter(eta.load_history().values()), {})
    assert eta.plan_estimate(cfg, CPU, 1, others=1.6) == (
        eta.NO_ESTIMATE + "; other work 1.6 on 2 cores: expect it slower"
    )
    monkeypatch.setattr(_Meter, "value", None)  # no /proc/stat: the load average at the end decides
    eta.plan_estimate(cfg, CPU, 1, others=0.0)
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)
    assert eta.load_history()[eta.fingerprint(cfg, CPU, 1)]["grpo_step_s"] == 0.2


def test_the_run_s_other_ranks_on_this_machine_are_not_other_work(tmp_path, monkeypatch):
    """Under torchrun with 2 local ranks of 1 thread each, the other rank's core is the run's own:
    1.2 cores read → 0.2 of other work, not contended. Planted: less_own_ranks returning the
    reading → "other work 1.2 … expect it slower"."""
    monkeypatch.setattr(eta.torch, "get_num_threads", lambda: 1)
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    _busy(monkeypatch, 0.0)
    cfg = _cfg("rollout.batch_size=32", f"output_dir={tmp_path}")
    assert eta.less_own_ranks(1.2, CPU) == pytest.approx(0.2)
    assert eta.plan_estimate(cfg, CPU, 2, others=1.2) == eta.NO_ESTIMATE
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "1")
    assert eta.plan_estimate(cfg, CPU, 1, others=1.2).endswith(
        "; other work 1.2 on 2 cores: expect it slower"
    )


def test_a_run_whose_thread_count_changed_records_under_the_setup_it_started_as(tmp_path, monkeypatch):
    """The plan line at 2 threads, the run ends on 1 (the count followed the machine, or a worker
    process took a core): its timings go under the 2-thread setup, which the next 2-thread plan
    line quotes. Planted: record_run fingerprinting the thread count at the end → "no time
    estimate yet"."""
    count = [2]
    monkeypatch.setattr(eta.torch, "get_num_threads", lambda: count[0])
    _busy(monkeypatch, 0.0)
    cfg = _cfg("rollout.batch_size=32", f"output_dir={tmp_path}")
    assert eta.plan_estimate(cfg, CPU, 1) == eta.NO_ESTIMATE
    count[0] = 1
    eta.record_run(cfg, CPU, dist.DistInfo(), _write_run(tmp_path / "run"), sft_steps=20)
    count[0] = 2
    (entry,) = eta.load_history().values()
    assert entry["machine"]["threads"] == 2
    assert eta.plan_estimate(cfg, CPU, 1).startswith("about ")
