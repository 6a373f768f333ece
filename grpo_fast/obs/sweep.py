"""Ablation sweeps: sequential training runs over one setting, then plots side by side.

Usage::

    python -m grpo_fast.sweep --preset NAME [--config FILE]... --sweep {lr,baseline,length_norm,scale_rewards,advantage,loss_type,delta,
        importance_sampling_level,top_entropy_quantile,dynamic_sampling,curriculum,adaptive_group_size,
        overlong_buffer,sft_mix,difficulty_filter}
        [--values V ...] [--lr-range LOW HIGH] [--num N] [--out DIR] [--dry-run] [--plot-only]
        [key=value ...]

Each value becomes one run, executed one after another (each needs the whole GPU) as::

    python -m grpo_fast.train --preset NAME [--config FILE ...] key=value ... SWEPT_KEY=VALUE output_dir=OUT/<name>

``SWEEPS`` maps a sweep to its config key and default values: ``lr`` → ``train.lr`` over a
log grid (``LRGrid``: 5 values from 1e-6 to 1e-4); ``baseline`` → ``loss.type``
(``no_baseline`` vs ``reinforce_with_baseline``; ``grpo_clip`` may be added with ``--values``);
``length_norm`` → ``loss.length_norm`` (all of ``sequence_mean``, ``constant``,
``token_mean``); ``scale_rewards`` → ``loss.scale_rewards`` (``group``, ``batch``, ``none``); ``advantage``
→ ``loss.advantage`` (``group``, ``rloo``, ``reinforce_pp``, ``reinforce_pp_baseline``, ``gae``); ``loss_type`` →
``loss.type`` (``grpo_clip`` vs ``cispo``; any loss type with ``--values``); ``delta`` →
``loss.delta`` (``null``, 1.5, 3: off-policy only, with ``train.epochs_per_rollout_batch`` > 1);
``importance_sampling_level`` → ``loss.importance_sampling_level`` (``token`` vs ``sequence``,
GSPO); ``top_entropy_quantile`` → ``loss.top_entropy_quantile`` (1 vs 0.2, the 80/20 rule);
``dynamic_sampling`` → ``rollout.dynamic_sampling`` (false vs true, DAPO); ``curriculum`` →
``rollout.curriculum`` (``none``, ``easy_first``, ``paced``); ``adaptive_group_size`` →
``rollout.adaptive_group_size`` (false vs true); ``overlong_buffer`` → ``data.overlong_buffer``
(0 vs 2: the tiny preset's 4-token responses); ``sft_mix`` → ``sft.mix_coef`` (0 vs 0.1);
``difficulty_filter`` → ``rollout.difficulty_filter`` (``null`` vs ``[0,0.9]``; values ``[lo,hi]``). Extra
``key=value`` words are OmegaConf dot-list overrides passed to every run; they may appear
anywhere on the command line (even after ``--values``).

Afterwards (or alone, with ``--plot-only``) it writes into ``OUT`` (checked before the first run): ``sweep_reward.png``,
``sweep_eval_accuracy.png``, ``sweep_entropy.png`` (one line per run against the step), for
an lr sweep ``sweep_lr.png`` (final reward and best eval accuracy against the lr), and
``sweep.md`` with a table of each run's final numbers. A failed run is reported and the sweep
goes on; the exit code is then 1.
"""

from __future__ import annotations

import argparse
import math
import shlex
import subprocess
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grpo_fast.algo.advantages import ADVANTAGE_ESTIMATORS, SCALE_REWARDS
from grpo_fast.algo.difficulty import CURRICULA
from grpo_fast.algo.length_norm import LENGTH_NORMS
from grpo_fast.algo.loss_options import IMPORTANCE_SAMPLING_LEVELS, LOSS_TYPES
from grpo_fast.errors import ConfigError, UserError, cli_errors
from grpo_fast.obs.report import METRICS_FILE, read_metrics, series
from grpo_fast.obs.run_folder import output_dir_problem

__all__ = ["SWEEPS", "LRGrid", "SweepRun", "SweepSpec", "main", "plan_sweep", "run_sweep", "summarize_sweep"]

DEFAULT_OUT = "runs/sweep_{sweep}"
TRAIN_MODULE = "grpo_fast.train"


@dataclass(frozen=True)
class LRGrid:
    """Log-spaced learning rates: ``low · (high / low)^(i / (num − 1))``, ``i = 0 … num − 1``.

    Example:
        >>> [f"{v:.3g}" for v in LRGrid(1e-6, 1e-4, 3).values()]
        ['1e-06', '1e-05', '0.0001']
    """

    low: float = 1e-6
    high: float = 1e-4
    num: int = 5

    def values(self) -> list[float]:
        if not (0 < self.low <= self.high) or self.num < 1:
            raise ConfigError(
                f"lr grid: need 0 < low <= high and num >= 1, got {self.low}, {self.high}, {self.num}"
            )
        if self.num == 1:
            return [self.low]
        ratio = math.log(self.high / self.low)
        return [self.low * math.exp(ratio * i / (self.num - 1)) for i in range(self.num)]


@dataclass(frozen=True)
class SweepSpec:
    """A sweepable setting: its train-config key and the values it may take.

    ``choices`` empty means a positive float (a learning rate; ``defaults`` empty: ``LRGrid``),
    or ``null`` too where ``nullable`` (an option that is off by default), or 0 too where
    ``allow_zero`` (an option whose 0 is off); ``band``: ``[lo,hi]`` with 0 ≤ lo ≤ hi ≤ 1, or
    ``null`` (``rollout.difficulty_filter``).
    """

    key: str
    defaults: tuple[str, ...]
    choices: tuple[str, ...] = ()
    nullable: bool = False
    allow_zero: bool = False
    band: bool = False


_OFF_ON = ("false", "true")


SWEEPS: dict[str, SweepSpec] = {
    "lr": SweepSpec(key="train.lr", defaults=()),  # its defaults come from LRGrid
    "baseline": SweepSpec(
        key="loss.type", defaults=("no_baseline", "reinforce_with_baseline"), choices=LOSS_TYPES
    ),
    "length_norm": SweepSpec(key="loss.length_norm", defaults=LENGTH_NORMS, choices=LENGTH_NORMS),
    "scale_rewards": SweepSpec(key="loss.scale_rewards", defaults=SCALE_REWARDS, choices=SCALE_REWARDS),
    # every estimator (gae with its value head, critic.* as set)
    "advantage": SweepSpec(key="loss.advantage", defaults=ADVANTAGE_ESTIMATORS, choices=ADVANTAGE_ESTIMATORS),
    "loss_type": SweepSpec(key="loss.type", defaults=("grpo_clip", "cispo"), choices=LOSS_TYPES),
    "delta": SweepSpec(key="loss.delta", defaults=("null", "1.5", "3"), nullable=True),
    "top_entropy_quantile": SweepSpec(key="loss.top_entropy_quantile", defaults=("1", "0.2")),
    "importance_sampling_level": SweepSpec(
        key="loss.importance_sampling_level",
        defaults=IMPORTANCE_SAMPLING_LEVELS,
        choices=IMPORTANCE_SAMPLING_LEVELS,
    ),
    "dynamic_sampling": SweepSpec(key="rollout.dynamic_sampling", defaults=_OFF_ON, choices=_OFF_ON),
    "curriculum": SweepSpec(key="rollout.curriculum", defaults=CURRICULA, choices=CURRICULA),
    "adaptive_group_size": SweepSpec(key="rollout.adaptive_group_size", defaults=_OFF_ON, choices=_OFF_ON),
    # the tiny preset's responses are at most 4 tokens: a buffer of 2 shapes its last two
    "overlong_buffer": SweepSpec(key="data.overlong_buffer", defaults=("0", "2"), allow_zero=True),
    "sft_mix": SweepSpec(key="sft.mix_coef", defaults=("0", "0.1"), allow_zero=True),
    # off, then the prompts already solved 90% of the time or more left out of later passes
    "difficulty_filter": SweepSpec(
        key="rollout.difficulty_filter", defaults=("null", "[0,0.9]"), nullable=True, band=True
    ),
    # full fine-tuning (0) against LoRA adapters of rank 8 and 32 (model.lora.*'s other keys as set)
    "lora_rank": SweepSpec(key="model.lora.r", defaults=("0", "8", "32"), allow_zero=True),
}


@dataclass(frozen=True)
class SweepRun:
    """One run of a sweep: ``name`` (also its folder under the sweep's output), the swept
    ``value`` as passed on the command line, and the full ``command``."""

    name: str
    value: str
    out_dir: Path
    command: tuple[str, ...]


def plan_sweep(
    preset: str,
    sweep: str,
    values: Sequence[str] | None = None,
    *,
    configs: Sequence[str] = (),
    overrides: Sequence[str] = (),
    out: str | Path | None = None,
    lr_grid: LRGrid | None = None,
    python: str = sys.executable,
) -> list[SweepRun]:
    """The runs of a sweep, without running anything.

    Args:
        preset: ``--preset`` of every run.
        sweep: a key of ``SWEEPS``.
        values: the values to sweep (strings as on the command line); None for the defaults
            (for ``lr``: ``lr_grid``).
        configs: ``--config`` files, in order.
        overrides: ``key=value`` overrides for every run; may not set the swept key or
            ``output_dir``.
        out: sweep output folder (default ``runs/sweep_<sweep>``); run ``name`` writes to
            ``out/name``.
        lr_grid: the default lr values (``LRGrid()`` when None).

    Raises:
        ConfigError: unknown sweep, bad value, duplicate value, malformed or conflicting override.
    """
    if sweep not in SWEEPS:
        raise ConfigError(f"unknown sweep {sweep!r}: choose one of {', '.join(SWEEPS)}")
    spec = SWEEPS[sweep]
    for item in overrides:
        key, eq, _ = item.partition("=")
        if not eq or not key:
            raise ConfigError(f"override {item!r} is not key=value")
        if key == spec.key:
            raise ConfigError(f"override {item!r} sets {spec.key}, the key this sweep varies")
        if key == "output_dir":
            raise ConfigError(f"override {item!r}: the sweep sets output_dir per run; use --out")
    if values is None and (spec.choices or spec.defaults):
        values = spec.defaults
    elif values is None:  # the grid, and the preset's own lr (the tiny preset's 2e-4 is off the grid)
        grid = [f"{v:.3g}" for v in (lr_grid or LRGrid()).values()]
        own = _preset_lr(preset)
        values = sorted({*grid, own} if own and float(own) not in map(float, grid) else grid, key=float)
    values = [_check_value(sweep, spec, v) for v in values]
    duplicates = sorted({v for v in values if values.count(v) > 1})
    if duplicates:
        raise ConfigError(f"--values repeats {', '.join(duplicates)}")
    out_dir = Path(out if out is not None else DEFAULT_OUT.format(sweep=sweep))
    base = [python, "-m", TRAIN_MODULE, "--preset", preset]
    for config in configs:
        base += ["--config", config]
    runs = []
    for value in values:
        name = f"{sweep}_{value}".translate(str.maketrans({"[": "", "]": "", ",": "-"}))  # [0,0.9] -> 0-0.9
        run_dir = out_dir / name
        command = (*base, *overrides, f"{spec.key}={value}", f"output_dir={run_dir}")
        runs.append(SweepRun(name=name, value=value, out_dir=run_dir, command=command))
    return runs


def check_out(out: str | Path) -> None:
    """``ConfigError`` in one line when the sweep's folder ``out`` (``--out``: the runs' folders
    and the plots go there) cannot be created or written: found before the first run, not after
    the last. Nothing is created."""
    problem = output_dir_problem(Path(out), "--out")
    if problem is not None:
        raise ConfigError(problem)


def run_sweep(runs: Sequence[SweepRun]) -> dict[str, int]:
    """Run the commands one after another (output streams through); returns exit codes by name."""
    codes = {}
    for i, run in enumerate(runs, start=1):
        print(f"[sweep {i}/{len(runs)}] {run.name}: {shlex.join(run.command)}", flush=True)
        codes[run.name] = subprocess.run(run.command, check=False).returncode
        if codes[run.name]:
            print(f"[sweep {i}/{len(runs)}] {run.name} failed with exit code {codes[run.name]}", flush=True)
    return codes


SWEEP_PLOTS = (
    ("sweep_reward", "train/reward_mean", "Train reward"),
    ("sweep_eval_accuracy", "eval/accuracy", "Eval accuracy"),
    ("sweep_entropy", "train/entropy_mean", "Mean token entropy"),
)


def summarize_sweep(
    sweep: str, runs: Sequence[SweepRun], out: str | Path, codes: dict[str, int] | None = None
) -> Path:
    """Plot the runs' metrics together and write ``sweep.md`` into ``out``; returns its path.

    Runs without a readable ``metrics.jsonl`` are listed as missing and left out of the plots.
    """
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    metrics: dict[str, list[dict[str, Any]]] = {}
    notes = []
    for run in runs:
        try:
            metrics[run.name] = read_metrics(run.out_dir / METRICS_FILE)
        except UserError as exc:
            notes.append(f"{run.name}: {exc}")
    pictures = []
    for stem, key, title in SWEEP_PLOTS:
        if _plot_against_step(metrics, key, f"{title} ({sweep} sweep)", out / f"{stem}.png"):
            pictures.append((title, f"{stem}.png"))
        else:
            notes.append(f"{stem}.png skipped: no run logged {key}")
    if sweep == "lr" and _plot_lr(runs, metrics, out / "sweep_lr.png"):
        pictures.append(("Final reward and best eval accuracy against the lr", "sweep_lr.png"))

    header = (
        "run",
        SWEEPS[sweep].key,
        "status",
        "final train/reward_mean",
        "final eval/accuracy",
        "best eval/accuracy",
    )
    rows = []
    for run in runs:
        status = f"exit {codes[run.name]}" if codes and run.name in codes else "–"
        rows_ = metrics.get(run.name, [])
        reward, acc = _last(rows_, "train/reward_mean"), _last(rows_, "eval/accuracy")
        best = _best(rows_, "eval/accuracy")
        best_text = f"{best[1]:.4g} (step {best[0]:g})" if best else "–"
        rows.append((run.name, run.value, status, _fmt(reward), _fmt(acc), best_text))
    lines = [f"# Sweep: {sweep} ({SWEEPS[sweep].key})", ""]
    lines += ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(map(str, row)) + " |" for row in rows]
    lines += [""] + [f"![{title}]({name})\n" for title, name in pictures]
    lines += [f"- {note}" for note in notes]
    path = out / "sweep.md"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    return path


def _preset_lr(preset: str) -> str | None:
    """A known preset's ``train.lr`` (its own, else the default), as a sweep value; None otherwise."""
    from grpo_fast.config import PRESETS, TrainConfig

    if preset not in PRESETS:
        return None
    return f"{PRESETS[preset].get('train', {}).get('lr', TrainConfig().lr):.3g}"


def _values_help() -> str:
    """``--values``' help: each sweep's default values, from ``SWEEPS`` and ``LRGrid``."""
    g = LRGrid()
    lr = f"lr: {g.num} points from {g.low:g} to {g.high:g} (--lr-range, --num) and the preset's own lr"
    rest = [f"{name}: {' '.join(spec.defaults)}" for name, spec in SWEEPS.items() if spec.defaults]
    return "values to sweep; the defaults: " + "; ".join([lr, *rest])


@cli_errors
def main(argv: Sequence[str] | None = None, prog: str = "python -m grpo_fast.sweep") -> int:
    parser = argparse.ArgumentParser(
        prog=prog,
        description="Sequential ablation runs of grpo_fast.train, plotted together.",
    )
    parser.add_argument("--preset", required=True, help="train preset of every run")
    parser.add_argument(
        "--config", action="append", default=[], metavar="FILE", help="train config file (repeatable)"
    )
    parser.add_argument("--sweep", required=True, choices=list(SWEEPS), help="the setting to vary")
    parser.add_argument("--values", nargs="+", metavar="V", help=_values_help())
    parser.add_argument("--lr-range", nargs=2, type=float, metavar=("LOW", "HIGH"), help="lr grid bounds")
    parser.add_argument("--num", type=int, help="number of lr grid points")
    parser.add_argument("--out", metavar="DIR", help="sweep output folder (default: runs/sweep_<sweep>)")
    parser.add_argument("--dry-run", action="store_true", help="print the commands, run nothing")
    parser.add_argument("--plot-only", action="store_true", help="only plot runs already in --out")
    parser.add_argument("overrides", nargs="*", metavar="key=value", help="overrides for every run")
    args = parser.parse_intermixed_args(argv)

    values = [v for v in args.values or [] if "=" not in v] or None
    overrides = [*args.overrides, *(v for v in args.values or [] if "=" in v)]
    if (args.lr_range or args.num is not None) and (args.sweep != "lr" or values):
        raise ConfigError(
            "--lr-range/--num set the default lr grid: only with --sweep lr and without --values"
        )
    grid_defaults = LRGrid()
    lr_low, lr_high = args.lr_range or (grid_defaults.low, grid_defaults.high)
    grid = LRGrid(lr_low, lr_high, args.num if args.num is not None else grid_defaults.num)
    out = args.out or DEFAULT_OUT.format(sweep=args.sweep)
    runs = plan_sweep(
        args.preset, args.sweep, values, configs=args.config, overrides=overrides, out=out, lr_grid=grid
    )
    check_out(out)  # before any run: the plots and sweep.md go there after the last one
    if args.dry_run:
        for run in runs:
            print(shlex.join(run.command))
        return 0
    codes = None if args.plot_only else run_sweep(runs)
    print(summarize_sweep(args.sweep, runs, out, codes))
    return 1 if codes and any(codes.values()) else 0


# ----------------------------------------------------------------------------------------------


def _check_value(sweep: str, spec: SweepSpec, value: str) -> str:
    if spec.choices:
        if value not in spec.choices:
            raise ConfigError(
                f"--values: {value!r} is not a {spec.key} (choose from {', '.join(spec.choices)})"
            )
        return value
    if spec.nullable and value == "null":
        return value
    if spec.band:
        return _check_band(sweep, spec, value)
    try:
        lr = float(value)
    except ValueError:
        lr = math.nan
    if not ((lr > 0 or (spec.allow_zero and lr == 0)) and math.isfinite(lr)):
        if spec.key == "train.lr":
            what = "a positive learning rate"
        elif spec.allow_zero:
            what = f"a number >= 0 for {spec.key}"
        else:
            what = f"a positive number for {spec.key} (or null)"
        raise ConfigError(f"--values: {value!r} is not {what} ({sweep} sweep)")
    return f"{lr:.3g}"


def _check_band(sweep: str, spec: SweepSpec, value: str) -> str:
    """``[lo,hi]`` (0 ≤ lo ≤ hi ≤ 1), written back as ``[lo,hi]`` with ``%g`` numbers."""
    inner = value.strip()
    parts = inner[1:-1].split(",") if inner.startswith("[") and inner.endswith("]") else []
    try:
        lo, hi = (float(x) for x in parts)
    except ValueError:
        lo = hi = math.nan
    if not 0 <= lo <= hi <= 1:
        raise ConfigError(
            f"--values: {value!r} is not [lo,hi] with 0 <= lo <= hi <= 1 for {spec.key} ({sweep} sweep)"
        )
    return f"[{lo:g},{hi:g}]"


def _plot_against_step(metrics: dict[str, list[dict[str, Any]]], key: str, title: str, path: Path) -> bool:
    curves = {name: series(rows, key) for name, rows in metrics.items()}
    curves = {name: c for name, c in curves.items() if c[0]}
    if not curves:
        return False
    fig = Figure(figsize=(8, 4.5), layout="constrained")
    ax = fig.subplots()
    for name, (steps, values) in curves.items():
        ax.plot(steps, values, marker="o" if key.startswith("eval/") else None, markersize=3.5, label=name)
    ax.set_xlabel("step")
    ax.set_ylabel(key)
    ax.set_title(title)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return True


def _plot_lr(runs: Sequence[SweepRun], metrics: dict[str, list[dict[str, Any]]], path: Path) -> bool:
    points = [(float(r.value), metrics[r.name]) for r in runs if r.name in metrics]
    if not points:
        return False
    fig = Figure(figsize=(6, 4), layout="constrained")
    ax = fig.subplots()
    drawn = False
    for label, pick in (
        ("final train/reward_mean", lambda rows: _last(rows, "train/reward_mean")),
        ("best eval/accuracy", lambda rows: (_best(rows, "eval/accuracy") or (None, None))[1]),
    ):
        xy = [(lr, pick(rows)) for lr, rows in points]
        xy = [(x, y) for x, y in xy if y is not None]
        if xy:
            ax.plot(*zip(*xy), marker="o", label=label)
            drawn = True
    if not drawn:
        return False
    ax.set_xscale("log")
    ax.set_xlabel("train.lr")
    ax.set_title("lr sweep")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.savefig(path, dpi=110)
    return True


def _last(rows: list[dict[str, Any]], key: str) -> float | None:
    values = series(rows, key)[1]
    return values[-1] if values else None


def _best(rows: list[dict[str, Any]], key: str) -> tuple[float, float] | None:
    steps, values = series(rows, key)
    if not values:
        return None
    i = max(range(len(values)), key=values.__getitem__)
    return steps[i], values[i]


def _fmt(value: float | None) -> str:
    return "–" if value is None else f"{value:.4g}"


if __name__ == "__main__":
    raise SystemExit(main())
