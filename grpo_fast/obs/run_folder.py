"""One run per ``output_dir``: its owner, what it holds, and the record of its config.

``claim(out, cfg, world)`` is held for a run's life (rank 0 holds it under torchrun):

- an OS lock on ``output_dir/.grpo_fast.lock`` (``fcntl.flock``; the kernel releases it when
  the process ends, however it ends), with the owner's pid, host and start time in the file
  for the next run's message: a second run on the folder stops at once, naming them;
- a fresh run (no ``resume=true``) into a folder that holds a run stops, saying what is there
  and the two ways on: ``resume=true`` continues it, ``overwrite=true`` deletes the files a
  run writes (``RUN_FILES``, nothing else) and starts over;
- ``resume=true`` refuses a change of a run-defining key (``config.ON_RESUME``), naming every
  changed key (``check_resume``); and a folder it cannot continue (``check_resumable``): its
  latest checkpoint incomplete or damaged (it names the checkpoint before it, or says there is
  none), or a run's work with no checkpoint at all. On a folder that holds no run's work,
  ``resume=true`` starts the run (a job script may always pass it);
- a ``config.yaml`` in a folder no run has claimed (no lock file) is the user's own file, never
  overwritten or deleted: the run stops, saying so.

Every refusal comes before anything in the folder changes. ``record_config`` writes
``config.yaml`` once, at the run's start, and appends one dated comment line per resume with
the keys it changed (a comment: the file still loads as the run's config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import datetime
import errno
import fcntl
import json
import os
import shutil
import socket
from pathlib import Path
from typing import Any

import yaml

from grpo_fast import dist
from grpo_fast.config import AUTO, ON_RESUME, Config, to_yaml
from grpo_fast.errors import ConfigError, UserError
from grpo_fast.policy import checkpoint as ckpt

LOCK_FILE = ".grpo_fast.lock"
CONFIG_FILE = "config.yaml"
SFT_PROGRESS = "sft_warm_start"
RESOLVED_PREFIX = "# resolved from auto: "  # config.yaml's line of what each auto became  # checkpoints/sft_warm_start: a stopped warm start's progress
# What a run writes into its folder: what overwrite=true deletes (nothing else is touched).
RUN_FILES = (
    CONFIG_FILE,
    "metrics.jsonl",
    "sft_metrics.jsonl",
    "health.jsonl",
    "wandb_run_id",
    "checkpoints",
    "final",
    "final_merged",
    "samples",
    "rollout_init",
    "base",
    "report",
    "wandb",
)


def output_dir_problem(out: Path, name: str = "output_dir") -> str | None:
    """Why a run could not create or write the folder ``out`` (the line ``train``'s own check
    gives when it tries), found without creating anything: the dry run's check, and the sweep's
    of ``--out`` (``name``: the key or flag the line names); None when it can."""
    existing = out
    while not existing.exists() and existing != existing.parent:
        existing = existing.parent
    verb = "is not writable" if existing == out else "cannot be created"
    if not existing.is_dir():
        code = errno.EEXIST if existing == out else errno.ENOTDIR
        return f"{name}={str(out)!r} cannot be created: {os.strerror(code)}"
    if os.statvfs(existing).f_flag & os.ST_RDONLY:
        return f"{name}={str(out)!r} {verb}: {os.strerror(errno.EROFS)}"
    if not os.access(existing, os.W_OK | os.X_OK):
        return f"{name}={str(out)!r} {verb}: {os.strerror(errno.EACCES)}"
    return None


def held_run(out: Path) -> str | None:
    """What of a run ``out`` holds (its checkpoints, final model, logs), or None when nothing.

    Example: ``"checkpoints up to step 20, a final model, metrics.jsonl up to step 20"``.
    """
    return ", ".join(words for words, _ in _held(out)) or None


def _held(out: Path) -> list[tuple[str, bool]]:
    """What of a run ``out`` holds, in words, each with whether a fresh start would lose work
    by deleting it (a ``metrics.jsonl`` whose only row is the evaluation before GRPO, step 0,
    loses none: a fresh start redoes it)."""
    found = []
    steps = ckpt.list_checkpoints(out / "checkpoints")
    if steps:
        found.append((f"checkpoints up to {steps[-1].name}", True))
    incomplete = [p for p in ckpt.step_folders(out / "checkpoints") if p not in steps]
    if incomplete:
        found.append((f"an incomplete checkpoint {incomplete[-1].name}", True))
    if (out / "checkpoints" / SFT_PROGRESS).is_dir():
        found.append(("a stopped SFT warm start", True))
    if (out / "final").is_dir():
        found.append(("a final model", True))
    last = _last_step(out / "metrics.jsonl")
    if last is not None:
        found.append((f"metrics.jsonl up to step {last}", last > 0))
    elif _nonempty(out / "sft_metrics.jsonl"):
        found.append(("sft_metrics.jsonl", True))
    return found


def resumable(out: Path) -> Path | None:
    """What ``resume=true`` continues: the latest complete checkpoint, else a stopped warm start."""
    latest = ckpt.latest_checkpoint(out / "checkpoints")
    sft = out / "checkpoints" / SFT_PROGRESS
    return latest or (sft if (sft / ckpt.STATE_FILE).is_file() else None)


def check_folder(out: Path, cfg: Config) -> None:
    """The refusals that read the folder only: the user's own ``config.yaml``, a fresh run into
    a used folder, a resume that cannot continue the folder or changes a run-defining key,
    ``resume`` with ``overwrite``. ``ConfigError`` (``CheckpointError``) in one line."""
    if cfg.resume and cfg.overwrite:
        raise ConfigError(
            "resume=true and overwrite=true: choose one (resume continues the run, overwrite deletes it)"
        )
    if out.is_dir() and users_config(out):
        raise ConfigError(
            f"output_dir {out} holds {out / CONFIG_FILE}, which no run wrote (your own config file?): "
            "a run writes its resolved config there and would replace it; give the run another "
            f"output_dir (e.g. output_dir={out / 'run'}), or move the file"
        )
    held = held_run(out) if out.is_dir() else None
    if held and not (cfg.resume or cfg.overwrite):
        raise ConfigError(
            f"output_dir {out} holds a run ({held}): resume=true continues it, "
            "overwrite=true deletes it and starts over"
        )
    if cfg.resume and out.is_dir():
        check_resumable(out)
        if resumable(out) is not None:
            check_resume(out, cfg)


def users_config(out: Path) -> bool:
    """Whether ``out/config.yaml`` is the user's own file, not a run's record: a run claims its
    folder (``LOCK_FILE``) before it writes one, and a folder a run has used holds more than
    that file (an older run's folder may have no lock file)."""
    return (out / CONFIG_FILE).is_file() and not (out / LOCK_FILE).exists() and not _held(out)


def check_resumable(out: Path) -> None:
    """``resume=true`` on ``out``: ``CheckpointError`` when its latest checkpoint (or a stopped
    warm start's progress) is incomplete or damaged (``ckpt.check_checkpoint``), saying which
    checkpoint comes before it or that none does; ``ConfigError`` when it holds a run's work but
    no checkpoint to continue from. A folder without a run's work passes: the run starts."""
    steps = ckpt.step_folders(out / "checkpoints")
    if steps:
        complete = [p for p in steps[:-1] if (p / ckpt.STATE_FILE).is_file()]
        fix = (
            f"delete the folder to resume from the checkpoint before it, {complete[-1].name}"
            if complete
            else "there is no checkpoint before it: overwrite=true deletes the run and starts over"
        )
        ckpt.check_checkpoint(steps[-1], fix)  # the refusal, before anything loads
        return
    sft = out / "checkpoints" / SFT_PROGRESS
    if sft.is_dir():
        ckpt.check_checkpoint(sft, "overwrite=true deletes the run and starts the warm start over")
        return
    lost = [words for words, work in _held(out) if work]
    if lost:
        raise ConfigError(
            f"resume=true: output_dir {out} holds a run ({', '.join(lost)}) but no checkpoint to "
            "continue it from: overwrite=true deletes it and starts over"
        )


def resume_summary(out: Path) -> str:
    """What ``resume=true`` finds in ``out`` now, checked (``ckpt.check_checkpoint``), in words:
    the line a second signal prints. Never raises.

    Example: ``"checkpoint runs/x/checkpoints/step_000004 is whole (checked): resume=true
    continues from it"``.
    """
    root = out / "checkpoints"
    try:
        steps = ckpt.step_folders(root)
        sft = root / SFT_PROGRESS
        writing = sorted(p.name for p in root.glob("*.tmp")) if root.is_dir() else []
        unfinished = f"; {writing[-1]}, being written, is left unfinished and never read" if writing else ""
        target = steps[-1] if steps else sft if sft.is_dir() else None
        if target is None:
            return f"no checkpoint in {root}: there is nothing to resume from{unfinished}"
        problem = ckpt.checkpoint_problem(target)
        if problem is not None:
            return f"{problem}: resume=true refuses it{unfinished}"
        if target == sft:
            return (
                f"the warm start's progress in {sft} is whole (checked): resume=true continues it{unfinished}"
            )
        return f"checkpoint {target} is whole (checked): resume=true continues from it{unfinished}"
    except Exception as exc:  # a second signal must exit whatever the folder holds
        return f"{root} could not be checked ({type(exc).__name__})"


def check_resume(out: Path, cfg: Config) -> None:
    """``ConfigError`` naming every run-defining key (``ON_RESUME["run"]``) whose value differs
    from the run's own (``config.yaml``)."""
    original = _original_config(out)
    if original is None:
        return
    now, default = _tree(cfg), _tree(Config())
    changed = []
    for key in ON_RESUME["run"]:
        was = _get(original, key, _get(default, key))
        if _get(now, key) != was:
            changed.append(f"{key}={_fmt(_get(now, key))} but the run was made with {_fmt(was)}")
    if changed:
        raise ConfigError(
            f"resume: {'; '.join(changed)}. These keys define the run: set them back, or start "
            "a new one (another output_dir, or overwrite=true)"
        )


@contextlib.contextmanager
def claim(out: Path, cfg: Config, world: dist.DistInfo):
    """Own ``out`` for the block (module docstring): rank 0 takes the lock and makes the checks;
    every rank gets its verdict, so that a refusal stops them all with the same line."""
    fd, error = None, None
    if world.is_main:
        try:
            fd = _claim(out, cfg)
        except UserError as exc:
            error = exc
    verdict = dist.broadcast_object(None if error is None else str(error))
    if verdict is not None:
        # every rank holds the verdict before any tears the group down on the way out: rank 0
        # leaving straight after its broadcast was seen to die of gloo's std::terminate (SIGABRT,
        # "terminate called without an active exception") once in CI under load, 2026-12-06
        dist.barrier()
    if error is not None:
        raise error
    if verdict is not None:
        raise ConfigError(verdict)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def _claim(out: Path, cfg: Config) -> int:
    """The lock's file descriptor; the folder's old run files deleted when asked to."""
    lock = out / LOCK_FILE
    fd = _lock(lock, create=False) if lock.exists() else None
    try:
        check_folder(out, cfg)
        if fd is None:
            fd = _lock(lock, create=True)
        if cfg.overwrite or (cfg.resume and resumable(out) is None):
            clear_run_files(out)  # overwrite; or resume=true with nothing to resume: from scratch
        owner = {"pid": os.getpid(), "host": socket.gethostname(), "started": _now()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(owner) + "\n").encode(), 0)
    except BaseException:
        if fd is not None:
            os.close(fd)
        raise
    return fd


def _lock(path: Path, create: bool) -> int:
    flags = os.O_RDWR | os.O_CLOEXEC | (os.O_CREAT if create else 0)
    fd = os.open(path, flags, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        os.close(fd)
        raise ConfigError(f"output_dir {path.parent} is in use by {_owner(path)}") from None
    return fd


def in_use(out: Path) -> str | None:
    """Who holds ``out``'s lock now (``"pid N on host H (started T)"``), or None: the dry run's
    check, which takes no lock of its own for longer than the test."""
    lock = out / LOCK_FILE
    if not lock.is_file():
        return None
    try:
        os.close(_lock(lock, create=False))
    except ConfigError:
        return _owner(lock)
    return None


def _owner(lock: Path) -> str:
    try:
        owner = json.loads(lock.read_text())
        return f"pid {owner['pid']} on host {owner['host']} (started {owner['started']})"
    except (OSError, ValueError, KeyError, TypeError):
        return "another process (it has not written its pid yet)"


def clear_run_files(out: Path) -> None:
    """Delete what a run writes into ``out`` (``RUN_FILES``); anything else there stays."""
    for name in RUN_FILES:
        path = out / name
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        elif path.exists() or path.is_symlink():
            path.unlink()


def resolved_from_auto(asked: Config, cfg: Config, seen: dict[str, str]) -> dict[str, str]:
    """Each key ``asked`` leaves at ``auto``, with what the run uses: the planner's value in
    ``cfg``, or what setup ``seen`` (the device, the weights' dtype, the autocast)."""
    was, now = _tree(asked), _tree(cfg)
    found = {}
    for key in (*ON_RESUME["run"], *ON_RESUME["safe"]):
        if _get(was, key) == AUTO:
            value = _get(now, key)
            if value != AUTO:
                found[key] = _fmt(value)
            elif key in seen:
                found[key] = seen[key]
    return found


def record_config(
    out: Path, cfg: Config, resumed_from: Path | None, resolved: dict[str, str] | None = None
) -> None:
    """A fresh run writes ``config.yaml`` and a comment line with what each ``auto`` resolved to
    (``resolved``, for the report); a resume appends one line: when, from which checkpoint, and
    each key it changed (``key=new (was old)``), the original kept above."""
    path = out / CONFIG_FILE
    original = _original_config(out) if resumed_from is not None else None
    if original is None:
        note = (
            ""
            if resumed_from is None
            else f"# written at a resume from {resumed_from}: no config.yaml was found\n"
        )
        autos = ", ".join(f"{k}={v}" for k, v in (resolved or {}).items())
        path.write_text(to_yaml(cfg) + (f"{RESOLVED_PREFIX}{autos}\n" if autos else "") + note)
        return
    now, default = _tree(cfg), _tree(Config())
    changes = [
        f"{key}={_fmt(_get(now, key))} (was {_fmt(_get(original, key, _get(default, key)))})"
        for key in ON_RESUME["safe"]
        if key != "resume" and _get(now, key) != _get(original, key, _get(default, key))
    ]
    with open(path, "a") as fh:
        fh.write(f"# resumed {_now()} from {resumed_from}: {', '.join(changes) or 'no key changed'}\n")


def _original_config(out: Path) -> dict | None:
    path = out / CONFIG_FILE
    if not path.is_file():
        return None
    try:
        tree = yaml.safe_load(path.read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError) as exc:
        tree = exc
    if not isinstance(tree, dict):
        why = f"{type(tree).__name__}: {tree}" if isinstance(tree, Exception) else "not a mapping"
        raise ConfigError(
            f"resume=true: {path} cannot be read ({' '.join(why.split())[:120]}); it is the run's config, "
            "which a resume must match: restore it, or overwrite=true to start over"
        )
    return tree


def _tree(cfg: Config) -> dict:
    """``cfg`` as the plain tree ``config.yaml`` holds (what ``yaml.safe_load(to_yaml(cfg))`` gives:
    the same values and types, tuples as lists, for every preset), without the YAML round trip
    through OmegaConf (0.04 s a call, two a run; measured on the tiny preset)."""
    return _plain(dataclasses.asdict(cfg))


def _plain(x: Any) -> Any:
    if isinstance(x, dict):
        return {k: _plain(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


_MISSING = object()


def _get(tree: Any, key: str, default: Any = _MISSING) -> Any:
    for part in key.split("."):
        if not isinstance(tree, dict) or part not in tree:
            return None if default is _MISSING else default
        tree = tree[part]
    return tree


def _fmt(value: Any) -> str:
    """A value as one would type it after ``key=``."""
    if isinstance(value, str):
        return value
    return yaml.safe_dump(value, default_flow_style=True, width=10**6).strip().removesuffix("...").strip()


def _nonempty(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 0


def _last_step(path: Path) -> int | None:
    """The ``step`` of the last complete row of a ``metrics.jsonl`` (its tail only is read)."""
    if not _nonempty(path):
        return None
    with open(path, "rb") as fh:
        fh.seek(max(0, path.stat().st_size - 65536))
        lines = fh.read().decode("utf-8", "replace").splitlines()
    for line in reversed(lines):
        try:
            row = json.loads(line)
        except ValueError:
            continue
        if isinstance(row, dict) and isinstance(row.get("step"), int):
            return row["step"]
    return None


def _now() -> str:
    return datetime.datetime.now().isoformat(sep=" ", timespec="seconds")
