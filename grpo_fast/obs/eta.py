"""How long a run will take on this machine: the end of the plan line printed at its start.

Each run that ends (finished, or stopped by SIGTERM/SIGINT) records what it measured into a
per-machine history, ``$XDG_CACHE_HOME/grpo_fast/timings.json`` (default
``~/.cache/grpo_fast/timings.json``), under a fingerprint of its *setup* (``fingerprint``): the
machine (device type, CPU model, torch threads, CUDA device name, world size) and the config
keys that set the cost of a step (``COST_KEYS``; not ``steps``, ``sft.steps``, ``eval_every``, the
seed or the learning rate). An entry holds, read from the run folder's logs (no timing code of
its own): the seconds per warm-start step (``sft_metrics.jsonl``'s ``time/elapsed_s`` over its
steps, accuracy checks included), how many steps the warm start ran (it may stop early at
``sft.target_accuracy``) and its ``sft.steps``, the median ``time/step_s`` of the GRPO steps,
the mean ``time/eval_s`` (``time/eval_full_s``) per evaluation of the subset (the whole eval
set), the date, and with each timing the load the run competed with (``load``: the cores other
processes kept busy, ``cores``: the cores this process may use).

Timings made under contention are ignored: the others' load is the larger of the other work
during the setup (before the run computed) and the other work over the whole run, each read from
``/proc/stat`` (``threads.OtherWork``: the cores' busy time less this process's own; the run's
other ranks on this machine not counted). Without ``/proc/stat``, the 1-minute load average when
the plan line was printed and at the run's end less the run's own threads (``own_load``): it
lags, so a run started just after another sees that one's load. Above ``CONTENDED_LOAD`` per core
a run's timings are not written (the entry keeps its earlier ones), and an entry's timing
recorded so (or by an older version, whose one ``load1`` at the end counted the run's own
threads) is not quoted. The plan line says when the machine is busy now: ``other work 1.6 on 2
cores: expect it slower`` (``load 3.2 on 2 cores: …`` from the load average).

The next run of the same setup quotes it (``plan_estimate``): warm-start steps × their time +
the GRPO steps left × the step time + the evaluations left × their time. Without an entry, the
tiny preset on CPU gets the reference measurement below scaled by a speed probe of this
machine (``speed_probe``: fp32 matmuls the size of the tiny model's); any other setup says that
no estimate exists yet; the tiny preset with an entry that lacks a unit (a run with
``sft.steps=0`` timed no warm-start step) takes that unit from the probe. The history is written atomically (a temporary file, then
``os.replace``) and holds at most ``MAX_ENTRIES`` setups, the oldest dropped; an unreadable or
corrupt file is ignored (one debug-level log record) and replaced at the next write.

``python -m grpo_fast.obs.eta --probe`` prints this machine's probe value (the line to paste
below when measuring the reference).
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import datetime
import hashlib
import json
import logging
import math
import os
import platform
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from grpo_fast import dist, threads
from grpo_fast.config import Config, load_config, to_dict
from grpo_fast.obs.run_folder import SFT_PROGRESS
from grpo_fast.policy import checkpoint as ckpt

log = logging.getLogger(__name__)

# ---------------------------------------------------------------- the tiny preset's reference
# The tiny preset (`grpo-fast train --preset tiny`, seed 0) measured on the reference machine, 2 idle
# cores (Intel Xeon, 2 torch threads, load 1.5-1.7), 2026-12-02: the probe's value there
# (`python -m grpo_fast.obs.eta --probe`: 0.000375 / 0.000368 s), and that run's entry in
# ~/.cache/grpo_fast/timings.json; it took 46.3 s from the plan line to "done", 50.2 s wall.
TINY_REFERENCE_PROBE_S = 0.00037  # seconds per probe matmul (speed_probe)
TINY_REFERENCE_SFT_STEP_S = 0.0336  # seconds per warm-start step, its accuracy checks included
TINY_REFERENCE_SFT_STEPS = 290  # warm-start steps to sft.target_accuracy=0.25 (not scaled)
TINY_REFERENCE_GRPO_STEP_S = 0.065  # median time/step_s
TINY_REFERENCE_EVAL_S = 0.072  # mean time/eval_s (500 problems)

# The probe: fp32 matmuls of the tiny model's MLP up-projection (2048 tokens, hidden 128, MLP 256)
PROBE_SHAPES = ((2048, 128), (128, 256))
PROBE_BUDGET_S = 0.12  # about this long, at least PROBE_MIN and at most PROBE_MAX matmuls
PROBE_MIN, PROBE_MAX = 8, 400

HISTORY_VERSION = 1
MAX_ENTRIES = 64  # setups kept in the history; the oldest written is dropped first
# Contention: the other processes' 1-minute load average above this per core (on 2 cores: more
# than one other busy process's worth, which a 2-thread CPU run has to share a core with).
CONTENDED_LOAD = 0.5
TIMING_FIELDS = ("sft_step_s", "grpo_step_s", "eval_s", "eval_full_s")
NO_ESTIMATE = "no time estimate yet: the progress lines give the time left once the first steps are timed"

# The config keys that set the cost of a step (or, for the warm start, how many steps it takes
# to reach sft.target_accuracy): a change of any of them is another setup.
COST_KEYS: tuple[str, ...] = (
    *("model.name_or_path", "model.dtype", "model.attn_implementation", "model.gradient_checkpointing"),
    *("model.load_in_4bit", "model.lora.r", "model.lora.target_modules", "train.mixed_precision"),
    *("data.task", "data.train_path", "data.eval_path", "data.hub_name", "data.prompt_template"),
    *("data.reward", "data.eval_subset_size", "eval.sets", "eval.k", "eval.max_tokens"),
    *("rollout.backend", "rollout.group_size", "rollout.batch_size", "rollout.max_tokens"),
    *("rollout.min_tokens", "rollout.max_prompt_tokens", "rollout.generation_batch_size"),
    *("rollout.dynamic_sampling", "rollout.max_sampling_rounds", "rollout.adaptive_group_size"),
    *("rollout.gpu_memory_utilization", "rollout.sleep_level", "rollout.vllm_kwargs"),
    *("rollout.is_correction", "rollout.old_logprobs"),
    *("train.optimizer", "train.micro_batch_size", "train.epochs_per_rollout_batch", "train.packing"),
    *("train.share_prompts", "train.skip_zero_advantage", "train.parallelism", "train.fsdp_cpu_offload"),
    *("loss.kernel_backend", "loss.chunk_size", "loss.beta", "loss.target_kl", "loss.kl_in_reward"),
    *("sft.mix_coef", "sft.batch_size", "sft.lr", "sft.target_accuracy", "sft.check_every"),
    *("sft.check_size", "sft.target"),
)


@dataclasses.dataclass(frozen=True)
class Timings:
    """One setup's measurements (None: not measured). ``sft_max``: the ``sft.steps`` of the run
    that measured ``sft_steps`` (fewer: its warm start stopped early, at its target)."""

    sft_step_s: float | None = None
    sft_steps: int | None = None
    sft_max: int | None = None
    grpo_step_s: float | None = None
    eval_s: float | None = None
    eval_full_s: float | None = None
    date: str = ""


# ---------------------------------------------------------------- the setup's fingerprint


def history_path() -> Path:
    """``$XDG_CACHE_HOME/grpo_fast/timings.json``; ``~/.cache`` without XDG_CACHE_HOME."""
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "grpo_fast" / "timings.json"


def cpu_model() -> str:
    """The CPU's model name (``/proc/cpuinfo``; ``platform.processor()`` where there is none)."""
    with contextlib.suppress(OSError):
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name") and ":" in line:
                return line.split(":", 1)[1].strip()
    return platform.processor() or platform.machine()


def machine(device: torch.device, world_size: int) -> dict[str, Any]:
    """What of this machine sets a step's time."""
    found: dict[str, Any] = {
        "device": device.type,
        "cpu": cpu_model(),
        "threads": torch.get_num_threads(),
        "world_size": world_size,
    }
    if device.type == "cuda":
        found["gpu"] = torch.cuda.get_device_name(device)
    return found


def cost_values(cfg: Config) -> dict[str, Any]:
    """``COST_KEYS`` with their values in ``cfg``."""
    tree = to_dict(cfg)
    values = {}
    for key in COST_KEYS:
        node: Any = tree
        for part in key.split("."):
            node = node[part]
        values[key] = node
    return values


def fingerprint(cfg: Config, device: torch.device, world_size: int) -> str:
    """The setup's key in the history: a hash of the machine and of ``cost_values(cfg)``."""
    setup = {"machine": machine(device, world_size), "config": cost_values(cfg)}
    text = json.dumps(setup, sort_keys=True, default=str)
    return hashlib.sha256(text.encode()).hexdigest()[:20]


# ---------------------------------------------------------------- the history file


def load_history(path: Path | None = None) -> dict[str, dict]:
    """The history's entries by fingerprint, oldest first; {} when there is none or it cannot be
    read (a debug-level record says why: the next write replaces it)."""
    path = path or history_path()
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        log.debug("ignoring the timing history %s: %s", path, exc)
        return {}
    entries = (
        data.get("entries") if isinstance(data, dict) and data.get("version") == HISTORY_VERSION else None
    )
    if not isinstance(entries, dict):
        log.debug("ignoring the timing history %s: not a version %d history", path, HISTORY_VERSION)
        return {}
    return {k: v for k, v in entries.items() if isinstance(v, dict)}


def write_history(entries: dict[str, dict], path: Path | None = None) -> None:
    """Write ``entries`` (the newest last; only the last ``MAX_ENTRIES`` kept) atomically: into a
    temporary file beside ``path``, then ``os.replace``; a failure leaves ``path`` as it was."""
    path = path or history_path()
    kept = dict(list(entries.items())[-MAX_ENTRIES:])
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=".timings.", suffix=".tmp")
    try:
        with os.fdopen(fd, "w") as fh:
            json.dump({"version": HISTORY_VERSION, "entries": kept}, fh, indent=1)  # in order: oldest first
            fh.write("\n")
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise


def _number(value: Any) -> float | None:
    """``value`` when it is a finite, non-negative number (a time, a count), else None."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    return float(value) if ok and value >= 0 else None


def timings_of(entry: dict) -> Timings:
    """An entry as ``Timings`` (a field of the wrong type, or timed under contention: not
    measured)."""
    loads, cores = field_loads(entry), _int(entry.get("cores")) or cpu_cores()
    num = {
        f: None if (load := loads.get(f)) is not None and contended(load, cores) else _number(entry.get(f))
        for f in TIMING_FIELDS
    }
    ints = {f: _int(entry.get(f)) for f in ("sft_steps", "sft_max")}
    date = entry.get("date") if isinstance(entry.get("date"), str) else ""
    return Timings(**num, **ints, date=date)


def _int(value: Any) -> int | None:
    return int(v) if (v := _number(value)) is not None else None


def field_loads(entry: dict) -> dict[str, float]:
    """The others' load each of an entry's timings was made under: its ``load`` (by field), else,
    for an entry an older version wrote, its ``load1`` less the run's own threads
    (``machine``'s); a timing with neither: unknown (not in the result)."""
    loads = entry.get("load") if isinstance(entry.get("load"), dict) else {}
    found = {f: v for f in TIMING_FIELDS if (v := _number(loads.get(f))) is not None}
    old, was = _number(entry.get("load1")), entry.get("machine")
    if old is not None and isinstance(was, dict):
        threads, ranks = _int(was.get("threads")) or 1, _int(was.get("world_size")) or 1
        own = ranks * (threads if was.get("device") == "cpu" else 1)
        for f in TIMING_FIELDS:
            if f not in found and f in entry:
                found[f] = max(old - own, 0.0)
    return found


# ---------------------------------------------------------------- the machine's load


def cpu_cores() -> int:
    """The cores this process may run on (its affinity; the machine's count where there is none)."""
    with contextlib.suppress(AttributeError, OSError):
        return len(os.sched_getaffinity(0)) or 1
    return os.cpu_count() or 1


def machine_load() -> float | None:
    """This machine's 1-minute load average; None where the OS keeps none."""
    try:
        return os.getloadavg()[0]
    except (AttributeError, OSError):
        return None


def other_work_meter() -> threads.OtherWork:
    """A meter of the work other processes do on this process's cores from now on (its ``read``:
    the cores they kept busy since). The tests replace it with an idle machine's."""
    return threads.OtherWork()


def setup_meter() -> threads.OtherWork:
    """The meter a run's setup reads (the cores other work keeps busy, for the thread count and
    the plan line): the one the command started when it started (its window spans the imports),
    else one from now."""
    return threads.command_meter if threads.command_meter is not None else other_work_meter()


def less_own_ranks(other: float, device: torch.device) -> float:
    """An ``OtherWork`` reading less this run's other ranks on this machine (``own_load`` of each)."""
    return max(0.0, other - (threads.local_ranks() - 1) * own_load(device, 1))


def own_load(device: torch.device, world_size: int) -> float:
    """The load a run puts on this machine while it computes: every rank's torch threads on a
    CPU, one busy thread per rank on a GPU (one node)."""
    return float(world_size * (torch.get_num_threads() if device.type == "cpu" else 1))


def contended(load: float, cores: int) -> bool:
    """Whether the other processes' ``load`` slows a run on ``cores`` cores (``CONTENDED_LOAD``)."""
    return load > CONTENDED_LOAD * cores


def load_note(load: float | None, cores: int, name: str = "load") -> str:
    """The plan line's words on a busy machine (``"; load 3.2 on 2 cores: expect it slower"``),
    else nothing."""
    if load is None or not contended(load, cores):
        return ""
    return f"; {name} {load:.1f} on {cores} core{'s' * (cores != 1)}: expect it slower"


# The load each plan line saw, by setup fingerprint: the others' load before the run computed,
# read back by record_run at the run's end (the same process); and the meter of the other work
# over the run, started with the plan line.
_PLAN_LOADS: dict[str, float] = {}
_RUN_METERS: dict[str, threads.OtherWork] = {}
# The fingerprint and machine each plan line quoted, by the run's setup without its thread count
# (``_slot``): the count may change during the run (a thread count that follows the machine,
# ``rollout.placement=process`` cutting the trainer's), and the run's timings belong to the setup
# it started as.
_PLAN_KEYS: dict[str, tuple[str, dict[str, Any]]] = {}


def _slot(cfg: Config, device: torch.device, world_size: int) -> str:
    return json.dumps([device.type, world_size, cost_values(cfg)], sort_keys=True, default=str)


# ---------------------------------------------------------------- what a run measured


def _rows(path: Path) -> list[dict]:
    """The rows of a ``*.jsonl`` log; a partial or malformed line is skipped."""
    rows = []
    with contextlib.suppress(OSError):
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                row = json.loads(line)
                if isinstance(row, dict) and isinstance(row.get("step"), int):
                    rows.append(row)
    return rows


def sft_step_seconds(rows: list[dict]) -> float | None:
    """Seconds per warm-start step over the last process's rows of ``sft_metrics.jsonl`` (their
    ``time/elapsed_s`` counts from that process's first step, accuracy checks included): its
    time over its steps. The first process starts at step 0; a resumed one's first row has no
    start to count from, and is only where its count begins."""
    points = [(r["step"], t) for r in rows if (t := _number(r.get("time/elapsed_s"))) is not None]
    segment = [(0, 0.0)]  # the fresh process's start
    for step, t in points:
        if step <= segment[-1][0] or t < segment[-1][1]:  # a resumed process: its count starts again
            segment = []
        segment.append((step, t))
    if len(segment) < 2 or segment[-1][0] <= segment[0][0]:
        return None
    return (segment[-1][1] - segment[0][1]) / (segment[-1][0] - segment[0][0])


def measured(out: Path, first: int) -> dict[str, float]:
    """What the run in ``out`` measured: the GRPO steps after ``first`` (this process's),
    ``metrics.jsonl``; the warm start, ``sft_metrics.jsonl``, when this process may have run it
    (``first`` 0). Only the fields it measured."""
    rows = [r for r in _rows(Path(out) / "metrics.jsonl") if r["step"] > first]
    found = {}
    for field, key, mean in (
        ("grpo_step_s", "time/step_s", statistics.median),
        ("eval_s", "time/eval_s", statistics.fmean),
        ("eval_full_s", "time/eval_full_s", statistics.fmean),
    ):
        values = [v for r in rows if (v := _number(r.get(key))) is not None]
        if values:
            found[field] = mean(values)
    if first == 0 and (sft := sft_step_seconds(_rows(Path(out) / "sft_metrics.jsonl"))) is not None:
        found["sft_step_s"] = sft
    return found


def record_run(
    cfg: Config,
    device: torch.device,
    world: dist.DistInfo,
    out: Path,
    first: int = 0,
    sft_steps: int | None = None,
) -> None:
    """At a run's end (rank 0): its measurements into the history, under its setup's fingerprint
    (``cfg``: the config as asked, as the plan line saw it). ``first``: the step this process
    started after; ``sft_steps``: the warm start's steps, when it finished. What the run did not
    measure keeps the entry's earlier value. Never raises: a history that cannot be written is
    left as it was (a debug-level record says why)."""
    if not world.is_main:
        return
    try:
        key, started_as = _PLAN_KEYS.pop(_slot(cfg, device, world.world_size), (None, None))
        if key is None:  # no plan line in this process (a caller's own loop): the setup now
            key, started_as = fingerprint(cfg, device, world.world_size), machine(device, world.world_size)
        timed = measured(out, first)
        others = _others_load(key, device, world.world_size)
        cores = cpu_cores()
        if others is not None and contended(others, cores):  # not what this machine does alone
            log.debug("timings under load %.1f on %d cores not recorded: %s", others, cores, sorted(timed))
            timed = {}
        found: dict[str, Any] = dict(timed)
        if sft_steps is not None and cfg.sft.steps > 0:
            found.update(sft_steps=sft_steps, sft_max=cfg.sft.steps)
        if not found:
            return
        entries = load_history()
        old = entries.pop(key, {})  # popped: re-inserted as the newest
        loads = field_loads(old)
        entry = {k: v for k, v in {**old, **found}.items() if k != "load1"}
        if timed:
            entry["date"] = datetime.date.today().isoformat()
        for f in timed:  # each timing with the load it was made under (none kept here: unknown)
            loads.pop(f, None)
            if others is not None:
                loads[f] = round(others, 2)
        entry["load"], entry["cores"] = loads, cores
        entry["machine"] = started_as
        entries[key] = entry
        write_history(entries)
    except Exception as exc:  # best effort: no home directory, a history nested past recursion, ...
        log.debug("the timing history was not updated: %s", exc)


def _others_load(key: str, device: torch.device, world_size: int) -> float | None:
    """The other processes' load over the run: the larger of the plan line's reading (before the
    run computed) and the other work over the whole run (the meter the plan line started), else
    the load average now less the run's own (``own_load``); None where neither can be read."""
    before, meter = _PLAN_LOADS.pop(key, None), _RUN_METERS.pop(key, None)
    during = meter.read() if meter is not None else None
    if during is not None:
        return max(before or 0.0, less_own_ranks(during, device))
    now = machine_load()
    if now is None:
        return before
    return max(before or 0.0, now - own_load(device, world_size), 0.0)


# ---------------------------------------------------------------- the estimate


def _evaluations(every: int, first: int, last: int) -> int:
    """Evaluations every ``every`` steps and at the last, over steps ``first + 1 .. last``."""
    if not every or last <= first:
        return 0
    return last // every - first // every + (1 if last % every else 0)


def resume_point(cfg: Config) -> tuple[int, int | None]:
    """Where the run starts, read cheaply from ``output_dir``: (the GRPO step, the warm-start
    steps done; None once the warm start is over). A fresh run: (0, 0)."""
    if not cfg.resume:
        return 0, 0
    out = Path(cfg.output_dir)
    latest = ckpt.latest_checkpoint(out / "checkpoints")
    if latest is not None:
        return int(latest.name.rpartition("_")[2]), None
    if (out / "checkpoints" / SFT_PROGRESS / ckpt.STATE_FILE).is_file():
        rows = _rows(out / "sft_metrics.jsonl")
        return 0, max((r["step"] for r in rows), default=0)
    return 0, 0


def plan_counts(cfg: Config, t: Timings, start: int, sft_done: int | None) -> dict[str, int]:
    """How many of each unit is left: warm-start steps (the recorded count when that warm start
    stopped early, at most ``sft.steps``; else ``sft.steps``), GRPO steps, evaluations."""
    sft = 0
    if sft_done is not None and cfg.sft.steps > 0:
        early = t.sft_steps is not None and t.sft_max is not None and t.sft_steps < t.sft_max
        sft = max((min(t.sft_steps, cfg.sft.steps) if early else cfg.sft.steps) - sft_done, 0)
    subset = cfg.data.eval_subset_size > 0 and cfg.eval_every > 0
    evals = _evaluations(cfg.eval_every, start, cfg.steps) + (start == 0) if subset else 0
    return {
        "sft": sft,
        "grpo": max(cfg.steps - start, 0),
        "eval": evals,
        "eval_full": _evaluations(cfg.full_eval_every, start, cfg.steps),
    }


def total_seconds(counts: dict[str, int], t: Timings) -> float | None:
    """The counts × their times; None when a unit that is left has no time."""
    total = 0.0
    for unit, seconds in (
        ("sft", t.sft_step_s),
        ("grpo", t.grpo_step_s),
        ("eval", t.eval_s),
        ("eval_full", t.eval_full_s),
    ):
        if counts[unit]:
            if seconds is None:
                return None
            total += counts[unit] * seconds
    return total


def format_duration(seconds: float) -> str:
    """``"40 s"``, ``"1.5 min"``, ``"12 min"``, ``"2.3 h"``."""
    if seconds < 59.5:
        return f"{max(round(seconds), 1)} s"
    if seconds < 3570:
        minutes = seconds / 60
        return f"{minutes:.1f} min" if minutes < 9.95 else f"{minutes:.0f} min"
    return f"{seconds / 3600:.1f} h"


def format_seconds(x: float) -> str:
    """A step's seconds: ``"0.12"``, ``"1.2"``, ``"12"``."""
    return f"{x:.2f}" if x < 0.995 else f"{x:.1f}" if x < 9.95 else f"{x:.0f}"


def speed_probe() -> float:
    """Seconds per fp32 ``torch.mm`` of ``PROBE_SHAPES`` on this machine (the median of about
    ``PROBE_BUDGET_S`` of them, on torch's threads), from a generator of its own: the run's
    random streams are untouched."""
    gen = torch.Generator().manual_seed(0)
    a, b = (torch.randn(*shape, generator=gen) for shape in PROBE_SHAPES)
    c = torch.empty(PROBE_SHAPES[0][0], PROBE_SHAPES[1][1])
    for _ in range(3):  # warm-up: the first calls pay for allocation and thread start-up
        torch.mm(a, b, out=c)
    times: list[float] = []
    start = time.perf_counter()
    while len(times) < PROBE_MAX and (len(times) < PROBE_MIN or time.perf_counter() - start < PROBE_BUDGET_S):
        t0 = time.perf_counter()
        torch.mm(a, b, out=c)
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def is_tiny_reference(cfg: Config, device: torch.device, world_size: int) -> bool:
    """Whether ``cfg`` is the tiny preset's setup (its cost keys; any steps, seed, eval cadence)
    on one CPU process: the setup of the reference measurement."""
    if device.type != "cpu" or world_size != 1 or cfg.model.name_or_path != "builtin:tiny":
        return False
    return cost_values(cfg) == cost_values(load_config("tiny", check_device=False))


def tiny_reference(probe_s: float) -> Timings:
    """The tiny preset's reference timings scaled by this machine's probe against the reference
    machine's (the warm start's step count is not scaled)."""
    ratio = probe_s / TINY_REFERENCE_PROBE_S
    return Timings(
        sft_step_s=TINY_REFERENCE_SFT_STEP_S * ratio,
        sft_steps=TINY_REFERENCE_SFT_STEPS,
        sft_max=load_config("tiny", check_device=False).sft.steps,
        grpo_step_s=TINY_REFERENCE_GRPO_STEP_S * ratio,
        eval_s=TINY_REFERENCE_EVAL_S * ratio,
    )


def plan_estimate(cfg: Config, device: torch.device, world_size: int, others: float | None = None) -> str:
    """The plan line's end: about how long the run takes on this machine, from its last run of
    this setup, else (the tiny preset) from the speed probe, else that there is no estimate yet;
    then, on a busy machine, its load (``load_note``). ``others``: the cores other work kept busy
    during the setup (an ``other_work_meter`` reading, the run's other ranks still in it); None:
    the 1-minute load average, which lags (a run just ended still weighs on it). Starts the meter
    of the other work over the run (``record_run``). Never raises: what cannot be read gives no
    estimate (a debug-level record says why)."""
    load, name = (
        (less_own_ranks(others, device), "other work") if others is not None else (machine_load(), "load")
    )
    try:
        key = fingerprint(cfg, device, world_size)
        _PLAN_KEYS[_slot(cfg, device, world_size)] = key, machine(device, world_size)
        if load is not None:
            _PLAN_LOADS[key] = load  # the others' load: this run has not computed yet
        _RUN_METERS[key] = other_work_meter()
        return _estimate(cfg, device, world_size, key) + load_note(load, cpu_cores(), name)
    except Exception as exc:  # best effort: no home directory (Path.home), a deeply nested file, ...
        log.debug("no time estimate: %s", exc)
        return NO_ESTIMATE + load_note(load, cpu_cores(), name)


def _estimate(cfg: Config, device: torch.device, world_size: int, key: str) -> str:
    start, sft_done = resume_point(cfg)
    entry = load_history().get(key)
    t = timings_of(entry) if entry is not None else None
    if t is not None and all(getattr(t, f) is None for f in TIMING_FIELDS):
        entry = t = None  # nothing it holds is quoted (timed under contention, or not at all)
    probed = False
    if is_tiny_reference(cfg, device, world_size) and (
        t is None or total_seconds(plan_counts(cfg, t, start, sft_done), t) is None
    ):  # what the history does not hold (no run here yet; a run without a warm start): the probe
        reference = tiny_reference(speed_probe())
        t, probed = (reference if t is None else _filled(t, reference)), True
    if t is not None:
        counts = plan_counts(cfg, t, start, sft_done)
        total = total_seconds(counts, t)
        if total is not None and total > 0:
            if entry is None:
                return (
                    f"about {format_duration(total)} on this machine "
                    "(estimated from a speed probe; no run of this setup here yet)"
                )
            parts = []
            if counts["sft"]:
                parts.append(f"{counts['sft']} warm-start steps" + (" left" if sft_done else ""))
            if counts["grpo"] and t.grpo_step_s is not None:
                parts.append(f"{format_seconds(t.grpo_step_s)} s a GRPO step")
            when = f" on {t.date}" if t.date else ""
            what = f"from its last run of this setup{when}"
            if probed:
                what += " and a speed probe for what it did not time"
            if parts:
                what += ": " + ", ".join(parts)
            return f"about {format_duration(total)} on this machine ({what})"
    if cfg.steps <= start and not (sft_done is not None and cfg.sft.steps > 0):
        return "the progress lines give the time left"  # nothing left to run
    return NO_ESTIMATE


def _filled(t: Timings, reference: Timings) -> Timings:
    """``t`` with what it did not measure (None) taken from ``reference``."""
    return dataclasses.replace(
        t,
        **{
            f.name: getattr(reference, f.name)
            for f in dataclasses.fields(Timings)
            if getattr(t, f.name) is None and f.name != "date"
        },
    )


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(
        prog="python -m grpo_fast.obs.eta",
        description="The plan line's time estimate: this machine's speed probe and timing history.",
    )
    p.add_argument("--probe", action="store_true", help="print this machine's speed-probe value")
    args = p.parse_args(argv)
    if args.probe:
        value = statistics.median(speed_probe() for _ in range(5))
        print(
            f"TINY_REFERENCE_PROBE_S = {value:.6f}  # {torch.get_num_threads()} torch threads, "
            f"{cpu_model()}, load {os.getloadavg()[0]:.2f}"
        )
        return 0
    path = history_path()
    print(f"{path}: {len(load_history(path))} setups (--probe: this machine's speed probe)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
