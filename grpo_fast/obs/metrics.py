"""Metrics: ``metrics.jsonl`` (one JSON object per line, ``step`` + namespaced keys), optional
wandb, a one-line step summary with the time left and per-phase progress bars on the console.

The console is stderr (progress, step lines, events); only a command's result goes to stdout
(``train``: the final summary), so that ``> log`` captures the result and the terminal shows
the progress.
"""

from __future__ import annotations

import json
import math
import os
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch
from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    TextColumn,
    TimeElapsedColumn,
    TimeRemainingColumn,
)

from grpo_fast.config import AUTO, Config, to_dict
from grpo_fast.errors import ConfigError
from grpo_fast.obs.memory import process_peak_bytes, reset_process_peak

# The peak a phase_peak_gb reset away from the counter (bytes), kept for peak_memory_gb
_carried_peak = 0


def _peak_bytes(device: torch.device) -> int:
    """The counter's peak since its last reset: CUDA allocated bytes, or on CPU the process's peak
    resident memory (VmHWM; the lifetime ru_maxrss where /proc is missing)."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    try:
        return process_peak_bytes()
    except (OSError, RuntimeError):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024  # Linux: kB


def peak_memory_gb(device: torch.device) -> float:
    """Peak memory since the last ``reset_peak_memory`` (``_peak_bytes``'s measure), GB; the
    phases ``phase_peak_gb`` measured on their own included."""
    return max(_peak_bytes(device), _carried_peak) / 1e9


def reset_peak_memory(device: torch.device) -> None:
    global _carried_peak
    _carried_peak = 0
    _reset_counter(device)


def _reset_counter(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
    else:
        reset_process_peak()


def phase_peak_gb(device: torch.device, fn, *args):
    """``(fn(*args), the peak memory while it ran, GB)``, measured as ``peak_memory_gb`` is (on a CPU
    the whole process's resident memory: the weights included), without losing the step's peak
    so far: the counter is reset for the phase, and what it held is carried into
    ``peak_memory_gb``. Example: the teacher's pass of on-policy distillation."""
    global _carried_peak
    _carried_peak = max(_carried_peak, _peak_bytes(device))
    _reset_counter(device)
    out = fn(*args)
    peak = _peak_bytes(device)
    _carried_peak = max(_carried_peak, peak)
    return out, peak / 1e9


def gpu_stats(device: torch.device) -> dict[str, float]:
    """Utilization, memory and power from NVML (nvidia-ml-py), when on CUDA; {} otherwise."""
    if device.type != "cuda":
        return {}
    try:
        import pynvml

        pynvml.nvmlInit()
        h = pynvml.nvmlDeviceGetHandleByIndex(device.index or 0)
        util = pynvml.nvmlDeviceGetUtilizationRates(h)
        mem = pynvml.nvmlDeviceGetMemoryInfo(h)
        return {
            "gpu/utilization": float(util.gpu),
            "gpu/memory_used_gb": mem.used / 1e9,
            "gpu/power_w": pynvml.nvmlDeviceGetPowerUsage(h) / 1000.0,
        }
    except Exception:  # NVML missing or unsupported (containers, MIG): GPU stats are optional
        return {}


WANDB_ID_FILE = "wandb_run_id"


def wandb_run_id(output_dir: Path, resume: bool) -> str:
    """The wandb run id of ``output_dir``: on ``resume`` the one stored there (the same wandb run
    continues), else a new one, stored in ``output_dir/wandb_run_id`` for the next resume."""
    path = Path(output_dir) / WANDB_ID_FILE
    if resume and path.is_file() and path.read_text().strip():
        return path.read_text().strip()
    run_id = os.urandom(8).hex()  # wandb ids: up to 64 characters of [a-z0-9]
    path.write_text(run_id + "\n")
    return run_id


def _row(line: str) -> dict[str, Any] | None:
    """A ``metrics.jsonl`` line as its row, or None for a line that is not one (cut short)."""
    try:
        row = json.loads(line)
    except ValueError:
        return None
    if not isinstance(row, dict) or not isinstance(row.get("step", -1), (int, float)):
        return None
    return row


def format_eta(seconds: float) -> str:
    """A duration as a person reads it: ``"45s"``, ``"3m05s"``, ``"2h07m"``.

    Example:
        >>> format_eta(45.2), format_eta(185), format_eta(7620)
        ('45s', '3m05s', '2h07m')
    """
    s = max(0, round(seconds))
    if s < 60:
        return f"{s}s"
    if s < 3600:
        return f"{s // 60}m{s % 60:02d}s"
    return f"{s // 3600}h{s % 3600 // 60:02d}m"


class MetricsLogger:
    """Appends rows to ``metrics.jsonl`` (flushed per row) and mirrors them to wandb."""

    def __init__(self, cfg: Config, output_dir: Path, enabled: bool = True):
        self.enabled = enabled
        self.path = Path(output_dir) / "metrics.jsonl"
        # markup off: a line such as "[health] step 3 ..." is printed as it is
        self.console = Console(stderr=True, highlight=False, soft_wrap=True, markup=False)
        self.wandb = None
        self._first: tuple[float, int] | None = None  # (time, step) of this process's first step line
        if enabled:  # health.jsonl is there from the start, empty while there is no event
            (Path(output_dir) / "health.jsonl").touch()
        if enabled and cfg.logging.wandb:
            try:
                import wandb
            except ImportError:
                raise ConfigError("logging.wandb=true needs wandb: pip install -e '.[wandb]'") from None

            mode = cfg.logging.wandb_mode
            if mode == AUTO:
                mode = "online" if os.environ.get("WANDB_API_KEY") else "offline"
            self.wandb = wandb.init(
                project=cfg.logging.wandb_project,
                dir=str(output_dir),
                config=to_dict(cfg),
                mode=mode,
                name=Path(output_dir).name,
                id=wandb_run_id(Path(output_dir), cfg.resume),
                resume="allow",
            )

    def truncate_after(self, step: int) -> None:
        """On resume: drop rows logged after the checkpoint (a killed run may have written some),
        and lines that are not a row: a line cut short, what a SIGKILL or a full disk leaves
        mid-write (not JSON, or not an object with a numeric step). Says what it dropped."""
        if not (self.enabled and self.path.exists()):
            return
        kept, unreadable = [], []
        text = self.path.read_bytes().decode("utf-8", errors="replace")  # a cut may split a character
        for number, line in enumerate(text.splitlines(), 1):
            if not line.strip():
                continue
            row = _row(line)
            if row is None:
                unreadable.append(number)
            elif row.get("step", -1) <= step:
                kept.append(line)
        tmp = self.path.with_suffix(".jsonl.tmp")
        tmp.write_text("".join(ln + "\n" for ln in kept))
        os.replace(tmp, self.path)
        if unreadable:
            lines = ", ".join(str(n) for n in unreadable[:5]) + (" ..." if len(unreadable) > 5 else "")
            self.event(
                f"resume: dropped {len(unreadable)} unreadable line(s) of {self.path} (line {lines}: cut "
                "short, as a run killed mid-write leaves it)"
            )

    def has_row(self, step: int) -> bool:
        """Whether ``metrics.jsonl`` holds a row of ``step`` (after a resume: step 0's evaluation)."""
        if not self.path.is_file():
            return False
        for line in self.path.read_text().splitlines():
            try:
                if json.loads(line).get("step") == step:
                    return True
            except (ValueError, AttributeError):
                continue
        return False

    def last_eval(self) -> tuple[int, str, float] | None:
        """``(step, key, value)`` of the last evaluation in ``metrics.jsonl`` (the whole eval set's
        when that step has one, else the subset's), or None."""
        found = None
        for line in self.path.read_text().splitlines() if self.path.is_file() else []:
            try:
                row = json.loads(line)
            except ValueError:
                continue
            for key in ("eval_full/accuracy", "eval/accuracy"):
                if isinstance(row, dict) and isinstance(row.get(key), (int, float)):
                    found = (row.get("step"), key, float(row[key]))
                    break
        return found

    def log(self, step: int, row: dict[str, Any]) -> None:
        if not self.enabled:
            return
        clean = {"step": step}
        for k, v in row.items():
            if isinstance(v, torch.Tensor):
                v = v.item()
            if isinstance(v, float) and not math.isfinite(v):
                v = None if math.isnan(v) else (1e308 if v > 0 else -1e308)
            clean[k] = v
        with open(self.path, "a") as fh:
            fh.write(json.dumps(clean) + "\n")
        if self.wandb is not None:
            self.wandb.log(
                {k: v for k, v in clean.items() if k != "step" and isinstance(v, (int, float))}, step=step
            )

    def summary(self, step: int, total: int, row: dict[str, Any]) -> None:
        """The one-line step summary; from this process's second step on, the time left at the
        mean wall time per step so far (evaluations and checkpoints included)."""
        if not self.enabled:
            return
        now = time.perf_counter()
        if self._first is None:
            self._first = (now, step)
        g = lambda k, fmt: format(row[k], fmt) if isinstance(row.get(k), (int, float)) else "-"
        line = (
            f"step {step}/{total}  reward {g('train/reward_mean', '.3f')}  acc {g('train/accuracy', '.3f')}"
            f"  entropy {g('train/entropy_mean', '.3f')}  len {g('train/response_length_mean', '.1f')}"
            f"  gnorm {g('train/grad_norm', '.3f')}  {g('time/step_s', '.2f')}s"
            f"  peak {g('memory/peak_gb', '.2f')}GB"
        )
        if "eval/accuracy" in row:
            line += f"  eval {row['eval/accuracy']:.3f}"
        t_first, s_first = self._first
        if step > s_first and step < total:
            line += f"  eta {format_eta((now - t_first) / (step - s_first) * (total - step))}"
        self.console.print(line)

    def event(self, message: str) -> None:
        if self.enabled:
            self.console.print(message)

    def close(self) -> None:
        if self.wandb is not None:
            self.wandb.finish()


class PhaseProgress:
    """Rich progress bars with ETA on stderr: one for the whole run (``label``: GRPO steps, or
    the SFT warm start's), one for the current phase (rollout, train, eval). Silent when
    disabled or when stderr is not a terminal (logs stay clean)."""

    def __init__(self, enabled: bool, total_steps: int, done_steps: int = 0, label: str = "GRPO steps"):
        self.enabled = enabled and sys.stderr.isatty()
        self.total_steps, self.done_steps, self.label = total_steps, done_steps, label
        self.progress = None
        self._steps = self._phase = None

    def __enter__(self):
        if self.enabled:
            self.progress = Progress(
                TextColumn("{task.description:<14}"),
                BarColumn(),
                MofNCompleteColumn(),
                TimeElapsedColumn(),
                TimeRemainingColumn(),
                console=Console(stderr=True),
                transient=True,
            )
            self.progress.__enter__()
            self._steps = self.progress.add_task(
                self.label, total=self.total_steps, completed=self.done_steps
            )
        return self

    def phase(self, name: str, total: int) -> None:
        """Start a phase bar of ``total`` units (replacing the previous phase's)."""
        if self.progress is None:
            return
        if self._phase is not None:
            self.progress.remove_task(self._phase)
        self._phase = self.progress.add_task(f"  {name}", total=max(total, 1))

    def advance_phase(self, n: int = 1) -> None:
        if self.progress is not None and self._phase is not None:
            self.progress.advance(self._phase, n)

    def step_done(self) -> None:
        if self.progress is not None:
            self.progress.advance(self._steps)

    def __exit__(self, *exc):
        if self.progress is not None:
            self.progress.__exit__(*exc)
