"""Post-run report: PNG plots and a markdown summary from a run directory.

Usage::

    python -m grpo_fast.report RUN_DIR [--out DIR]

Reads ``RUN_DIR/metrics.jsonl`` (one JSON object per line with ``step`` and namespaced keys,
sparse: eval keys only on eval steps), ``RUN_DIR/config.yaml`` and ``RUN_DIR/health.jsonl``
when present, and writes into ``DIR`` (default ``RUN_DIR/report``) one PNG per entry of
``PLOTS`` whose keys appear in the metrics (the others are skipped with a note) and
``summary.md``: config highlights (a value the run resolved from ``auto`` shown with what was
asked), first/last/best eval accuracy, for a run with a tool one multi-turn sample turn by turn,
health events, the final value of every metric, and the plots.

The memory plot is titled by what ``memory/peak_gb`` measured: peak GPU memory allocated on
CUDA, the process's peak RSS on a CPU (the run's device, from ``config.yaml``). The reward band
(mean ± std) is clipped to the rewards the run's samples (``samples/*.jsonl``) show. Series
with few points (evaluations) are drawn with markers.

A run killed mid-write leaves a partial last line in ``metrics.jsonl``: it is dropped. Any
other malformed line is an error naming the line.
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import Counter
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from matplotlib.figure import Figure

from grpo_fast.errors import DataError, UserError, cli_errors
from grpo_fast.obs.health import SEVERITIES, HealthThresholds
from grpo_fast.obs.run_folder import RESOLVED_PREFIX

__all__ = [
    "PLOTS",
    "Panel",
    "PlotSpec",
    "RunData",
    "load_run",
    "main",
    "read_metrics",
    "series",
    "write_report",
]

METRICS_FILE = "metrics.jsonl"
CONFIG_FILE = "config.yaml"
HEALTH_FILE = "health.jsonl"
SUMMARY_FILE = "summary.md"
MAX_EVENTS_LISTED = 50


@dataclass(frozen=True)
class Panel:
    """One subplot: the metric keys drawn on a shared y axis."""

    ylabel: str
    keys: tuple[str, ...]
    logy: bool = False


@dataclass(frozen=True)
class PlotSpec:
    """One PNG (``<name>.png``): a column of panels sharing the step axis."""

    name: str
    title: str
    panels: tuple[Panel, ...]
    optional: bool = False  # drawn for the runs that log its keys, not noted as skipped elsewhere


PLOTS: tuple[PlotSpec, ...] = (
    PlotSpec(
        "reward",
        "Reward and accuracy",
        (
            Panel("reward", ("train/reward_mean",)),
            Panel("rate", ("train/accuracy", "eval/accuracy", "eval/format_rate")),
        ),
    ),
    PlotSpec("entropy", "Mean token entropy", (Panel("nats / token", ("train/entropy_mean",)),)),
    PlotSpec(
        "length",
        "Response length",
        (Panel("tokens", ("train/response_length_mean", "eval/response_length_mean")),),
    ),
    PlotSpec(
        "grad_norm", "Gradient norm (before clipping)", (Panel("grad norm", ("train/grad_norm",), logy=True),)
    ),
    PlotSpec("clip_fraction", "Clipped-token fraction", (Panel("fraction", ("train/clip_fraction",)),)),
    PlotSpec("kl", "KL to the reference policy", (Panel("KL", ("train/kl",)),)),
    PlotSpec("loss", "Loss and learning rate", (Panel("loss", ("train/loss",)), Panel("lr", ("train/lr",)))),
    PlotSpec(
        "timings",
        "Step time and throughput",
        (
            Panel("seconds", ("time/rollout_s", "time/train_s")),
            Panel("tokens / s", ("throughput/tokens_per_s",)),
        ),
    ),
    PlotSpec("memory", "Peak memory", (Panel("GB", ("memory/peak_gb",)),)),  # titled by device
    PlotSpec(
        "tools",
        "Tool use (rollout.environment)",
        (
            Panel("share of responses", ("rollout/tool_call_rate", "eval/tool_call_rate")),
            Panel("per response", ("rollout/tool_calls_mean", "rollout/turns_mean")),
            Panel("share", ("rollout/tool_error_fraction", "rollout/inserted_token_fraction")),
        ),
        optional=True,
    ),
)
MEMORY_TITLES = {
    "cuda": "Peak GPU memory (allocated by torch)",
    "cpu": "Peak RSS (the process's resident memory, CPU)",
}

# Config keys shown under "Config highlights": any under a top-level ``model`` section, and any
# whose last part is one of these (the full config follows, folded).
HIGHLIGHT_LEAVES = (
    "preset",
    "task",
    "prompt_template",
    "reward",
    "group_size",
    "batch_size",
    "temperature",
    "max_tokens",
    "lr",
    "grad_clip",
    "type",
    "length_norm",
    "clip_low",
    "clip_high",
    "beta",
    "entropy_coef",
    "steps",
    "seed",
    "world_size",
)


@dataclass
class RunData:
    """What a run directory holds: metric rows, flattened config, health events, read notes."""

    run_dir: Path
    rows: list[dict[str, Any]]
    config: dict[str, Any] | None = None
    events: list[dict[str, Any]] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    resolved: dict[str, str] = field(default_factory=dict)  # key → what an ``auto`` resolved to
    reward_range: tuple[float, float] | None = None  # the lowest and highest sampled reward
    turns_sample: dict[str, Any] | None = None  # a multi-turn sample record of the latest dump

    @property
    def device(self) -> str | None:
        """``cuda`` or ``cpu``: where the run trained (its resolved ``device``), or None."""
        device = self.resolved.get("device") or (self.config or {}).get("device")
        return str(device).split(":")[0] if device and device != "auto" else None


def read_metrics(path: Path) -> list[dict[str, Any]]:
    """Rows of a ``metrics.jsonl`` file (a partial last line is dropped).

    Raises:
        UserError: the file is missing or holds no rows.
        DataError: a line other than the last is not a JSON object (names the line).
    """
    if not path.is_file():
        raise UserError(f"{path}: no metrics file (is {path.parent} a run directory?)")
    lines = path.read_text(encoding="utf-8", errors="replace").splitlines()
    rows = []
    for lineno, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            if lineno == len(lines):  # killed mid-write
                break
            raise DataError(f"{path}:{lineno}: not valid JSON ({exc.msg} at column {exc.colno})") from None
        if not isinstance(row, dict):
            raise DataError(f"{path}:{lineno}: expected a JSON object, got {type(row).__name__}")
        rows.append(row)
    if not rows:
        raise UserError(f"{path}: empty, nothing to report")
    return rows


def series(rows: Sequence[Mapping[str, Any]], key: str) -> tuple[list[float], list[float]]:
    """``(steps, values)`` of the rows holding ``key`` with a finite number (and a ``step``)."""
    steps, values = [], []
    for row in rows:
        step, value = row.get("step"), row.get(key)
        if _is_number(step) and _is_number(value) and math.isfinite(value):
            steps.append(step)
            values.append(float(value))
    return steps, values


def load_run(run_dir: Path) -> RunData:
    """Read ``metrics.jsonl`` (required), ``config.yaml`` and ``health.jsonl`` (optional)."""
    if not run_dir.is_dir():
        raise UserError(f"{run_dir}: not a directory")
    run = RunData(run_dir=run_dir, rows=read_metrics(run_dir / METRICS_FILE))
    config_path = run_dir / CONFIG_FILE
    if config_path.is_file():
        from omegaconf import OmegaConf

        try:
            run.config = _flatten(OmegaConf.to_container(OmegaConf.load(config_path), resolve=False))
            run.resolved = _resolved(config_path.read_text(encoding="utf-8", errors="replace"))
        except Exception as exc:  # a report is still useful without the config
            run.notes.append(f"{CONFIG_FILE} could not be read ({type(exc).__name__}: {exc})")
    run.events = _collect_events(run)
    run.reward_range = _sampled_reward_range(run_dir / "samples")
    run.turns_sample = _turns_sample(run_dir / "samples")
    return run


def _resolved(config_text: str) -> dict[str, str]:
    """The ``# resolved from auto: key=value, ...`` line the run wrote into ``config.yaml``."""
    for line in config_text.splitlines():
        if line.startswith(RESOLVED_PREFIX):
            pairs = (p.partition("=") for p in line.removeprefix(RESOLVED_PREFIX).split(", "))
            return {k.strip(): v.strip() for k, eq, v in pairs if eq}
    return {}


def _turns_sample(folder: Path) -> dict[str, Any] | None:
    """The first record with more than one turn (a tool was called) in the latest training
    sample dump (``samples/step_N.jsonl``, the highest N that has one), or None."""
    dumps = folder.glob("step_*.jsonl") if folder.is_dir() else []
    numbered = [(int(p.stem[5:]), p) for p in dumps if p.stem[5:].isdigit()]
    for _, path in sorted(numbered, reverse=True):
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if isinstance(rec, dict) and isinstance(rec.get("turns"), list) and len(rec["turns"]) > 1:
                return {**rec, "file": path.name}
    return None


def _turns_lines(rec: Mapping[str, Any] | None) -> list[str]:
    """The ``## A multi-turn sample`` section: each turn, what the model wrote and what the tool
    put back."""
    if rec is None:
        return []
    rows = [
        (str(k + 1), f"`{t.get('sampled', '')!s}`", f"`{t.get('inserted', '')!s}`")
        for k, t in enumerate(rec["turns"])
        if isinstance(t, dict)
    ]
    head = [
        "",
        "## A multi-turn sample",
        "",
        f"From `samples/{rec['file']}`: `{rec.get('prompt', '')}` → reward {_fmt(rec.get('reward'))}, "
        f"{rec.get('finish_reason', '?')}.",
        "",
    ]
    return head + _table(("turn", "the model wrote", "the tool put back"), rows)


def _sampled_reward_range(folder: Path) -> tuple[float, float] | None:
    """The lowest and highest ``reward`` in the run's sample files, or None without any."""
    rewards = []
    for path in sorted(folder.glob("*.jsonl")) if folder.is_dir() else []:
        for line in path.read_text(encoding="utf-8", errors="replace").splitlines():
            try:
                value = json.loads(line).get("reward")
            except (ValueError, AttributeError):
                continue
            if _is_number(value) and math.isfinite(value):
                rewards.append(float(value))
    return (min(rewards), max(rewards)) if rewards else None


def write_report(run_dir: str | Path, out_dir: str | Path | None = None) -> Path:
    """Write the PNGs and ``summary.md`` for ``run_dir``; returns the summary's path."""
    run = load_run(Path(run_dir))
    out = Path(out_dir) if out_dir is not None else run.run_dir / "report"
    out.mkdir(parents=True, exist_ok=True)
    written, skipped = [], []
    for spec in (*PLOTS, *eval_set_plots(run.rows)):
        if spec.name == "memory" and run.device in MEMORY_TITLES:
            spec = PlotSpec(spec.name, MEMORY_TITLES[run.device], spec.panels)
        if _render(spec, run.rows, out / f"{spec.name}.png", run.reward_range):
            written.append(spec)
        elif not spec.optional:
            keys = ", ".join(k for p in spec.panels for k in p.keys)
            skipped.append(f"{spec.name}.png: none of {keys} in the metrics")
    summary = out / SUMMARY_FILE
    summary.write_text(_summary_markdown(run, written, skipped), encoding="utf-8")
    return summary


@cli_errors
def main(argv: Sequence[str] | None = None, prog: str = "python -m grpo_fast.report") -> int:
    parser = argparse.ArgumentParser(prog=prog, description="Plots and a markdown summary of a training run.")
    parser.add_argument("run_dir", metavar="RUN_DIR", help="run directory holding metrics.jsonl")
    parser.add_argument("--out", metavar="DIR", help="output directory (default: RUN_DIR/report)")
    args = parser.parse_args(argv)
    print(write_report(args.run_dir, args.out))
    return 0


# ----------------------------------------------------------------------------------------------
# Plots
# ----------------------------------------------------------------------------------------------


_SET_KEY = re.compile(r"(eval|eval_full)/([^/]+)/((?:avg|pass)@(\d+))")


def _set_keys(rows: list[dict[str, Any]]) -> dict[tuple[str, str], list[str]]:
    """(prefix, set) → its ``avg@k`` / ``pass@j`` keys in the rows, avg first, then j rising."""
    found: dict[tuple[str, str], set[str]] = {}
    for row in rows:
        for key in row:
            if m := _SET_KEY.fullmatch(key):
                found.setdefault((m[1], m[2]), set()).add(key)
    order = lambda k: (k.rsplit("/", 1)[1].startswith("pass"), int(k.rsplit("@", 1)[1]))
    return {ps: sorted(keys, key=order) for ps, keys in sorted(found.items())}


def eval_set_plots(rows: list[dict[str, Any]]) -> tuple[PlotSpec, ...]:
    """``eval_sets.png`` (``eval_full_sets.png`` for the full evaluations): one panel per eval set,
    its avg@k and pass@j over the steps; none for a run that logs no per-set keys."""
    specs = []
    for prefix, title in (
        ("eval", "Evaluation by set (eval_every)"),
        ("eval_full", "Full evaluation by set"),
    ):
        panels = tuple(
            Panel(f"{name}", tuple(keys)) for (p, name), keys in _set_keys(rows).items() if p == prefix
        )
        if panels:
            specs.append(PlotSpec(f"{prefix}_sets", title, panels, optional=True))
    return tuple(specs)


def _render(spec: PlotSpec, rows: list[dict[str, Any]], path: Path, reward_range=None) -> bool:
    """Draw ``spec`` into ``path``; panels without data are left out. False if none has data.
    A series with at most 30 points, or a quarter of the steps or fewer, gets markers."""
    panels = [(p, [(k, series(rows, k)) for k in p.keys]) for p in spec.panels]
    panels = [(p, [(k, s) for k, s in data if s[0]]) for p, data in panels]
    panels = [(p, data) for p, data in panels if data]
    if not panels:
        return False
    # Figure() directly, not pyplot: no global state, no GUI backend; PNGs are drawn with Agg.
    fig = Figure(figsize=(8, 1.2 + 2.6 * len(panels)), layout="constrained")
    axes = fig.subplots(len(panels), 1, sharex=True, squeeze=False)[:, 0]
    n_steps = len({r.get("step") for r in rows})
    for ax, (panel, data) in zip(axes, panels):
        for key, (steps, values) in data:
            sparse = key.startswith("eval") or len(steps) <= 30 or 4 * len(steps) <= n_steps
            (line,) = ax.plot(steps, values, marker="o" if sparse else None, markersize=4.5, label=key)
            if key == "train/reward_mean":
                _std_band(ax, rows, steps, values, line.get_color(), reward_range)
        if spec.name == "entropy":
            t = HealthThresholds()
            ax.axhspan(t.entropy_healthy_low, t.entropy_healthy_high, color="tab:green", alpha=0.12)
            ax.axhline(t.entropy_warn_low, color="tab:red", lw=0.8, ls="--")
            ax.axhline(t.entropy_warn_high, color="tab:red", lw=0.8, ls="--")
        if panel.logy and all(v > 0 for _, (_, values) in data for v in values):
            ax.set_yscale("log")
        ax.set_ylabel(panel.ylabel)
        ax.grid(alpha=0.3)
        ax.legend(loc="best", fontsize=8)
    axes[-1].set_xlabel("step")
    fig.suptitle(spec.title)
    fig.savefig(path, dpi=110)
    return True


def _eval_set_lines(rows: list[dict[str, Any]]) -> list[str]:
    """``## Evaluation by set``: each set's last evaluation (subset and full), the figures a
    paper's table reports: avg@k, pass@j, the format rate and the mean response length."""
    keys = _set_keys(rows)
    if not keys:
        return []
    table = []
    for (prefix, name), scored in keys.items():
        steps, _ = series(rows, scored[0])
        last = next(r for r in reversed(rows) if scored[0] in r)
        figures = ", ".join(f"{k.rsplit('/', 1)[1]} {_fmt(last[k])}" for k in scored if k in last)
        base = f"{prefix}/{name}/"
        n = last.get(base + "num_examples")
        table.append(
            (
                f"`{name}`",
                prefix,
                f"{steps[-1]:g}",
                f"{n:g}" if n is not None else "",
                figures,
                _fmt(last.get(base + "format_rate")),
                _fmt(last.get(base + "response_length_mean")),
            )
        )
    head = ("set", "evaluation", "step", "problems", "score", "format rate", "mean length")
    return ["", "## Evaluation by set", "", *_table(head, table)]


def _std_band(ax, rows, steps, values, color, reward_range=None) -> None:
    """Shade ``reward_mean ± reward_std`` where both are logged on the same rows, within
    ``reward_range`` (the rewards the samples show: a band of 0/1 rewards stays in [0, 1])."""
    std = dict(zip(*series(rows, "train/reward_std")))
    pairs = [(s, v, std[s]) for s, v in zip(steps, values) if s in std]
    if not pairs:
        return
    xs, mean, sd = zip(*pairs)
    lo, hi = reward_range or (-math.inf, math.inf)
    lower = [max(lo, min(m - d, hi)) for m, d in zip(mean, sd)]
    upper = [min(hi, max(m + d, lo)) for m, d in zip(mean, sd)]
    ax.fill_between(xs, lower, upper, color=color, alpha=0.15)


# ----------------------------------------------------------------------------------------------
# Summary
# ----------------------------------------------------------------------------------------------


def _summary_markdown(run: RunData, written: list[PlotSpec], skipped: list[str]) -> str:
    steps = [r["step"] for r in run.rows if _is_number(r.get("step"))]
    span = f", steps {min(steps):g}–{max(steps):g}" if steps else ""
    lines = [
        f"# Run report: {run.run_dir.name}",
        "",
        f"From `{run.run_dir / METRICS_FILE}`: {len(run.rows)} rows{span}.",
        *(f"\n> note: {n}" for n in run.notes),
        "",
        "## Config highlights",
        "",
    ]
    if run.config is None:
        lines.append(f"No readable `{CONFIG_FILE}`.")
    else:
        top = {
            k: v
            for k, v in run.config.items()
            if k.split(".", 1)[0] == "model" or k.rsplit(".", 1)[-1] in HIGHLIGHT_LEAVES
        }
        top.update({k: run.config.get(k) for k in run.resolved if k in run.config})
        value = lambda k, v: _fmt_resolved(k, v, run)
        lines += _table(("key", "value"), [(f"`{k}`", value(k, v)) for k, v in top.items()]) or ["(none)"]
        lines += ["", "<details><summary>full config</summary>", ""]
        lines += _table(("key", "value"), [(f"`{k}`", value(k, v)) for k, v in run.config.items()])
        lines += ["", "</details>"]
    lines += ["", "## Eval accuracy", ""]
    eval_steps, eval_acc = series(run.rows, "eval/accuracy")
    if eval_steps:
        best = max(range(len(eval_acc)), key=eval_acc.__getitem__)
        lines += _table(
            ("", "step", "eval/accuracy"),
            [
                (name, f"{eval_steps[i]:g}", _fmt(eval_acc[i]))
                for name, i in (("first", 0), ("last", -1), ("best", best))
            ],
        )
    else:
        lines.append("No `eval/accuracy` in the metrics.")
    lines += _eval_set_lines(run.rows)
    lines += _turns_lines(run.turns_sample)
    lines += ["", "## Health", "", *_health_lines(run.events), "", "## Final metrics", ""]
    lines += _table(("metric", "step", "last value"), _final_values(run.rows))
    lines += ["", "## Plots", ""]
    lines += [f"![{spec.title}]({spec.name}.png)\n" for spec in written]
    lines += [f"- skipped {s}" for s in skipped]
    return "\n".join(lines) + "\n"


def _health_lines(events: list[dict[str, Any]]) -> list[str]:
    if not events:
        return ["No health events."]
    counts = Counter(str(e.get("kind")) for e in events)
    serious = [e for e in events if SEVERITIES.index(_severity(e)) >= SEVERITIES.index("warning")]
    lines = [
        f"Events: {len(events)}, of which warning or worse: {len(serious)}. By kind: "
        + ", ".join(f"{kind} ×{n}" for kind, n in counts.most_common())
        + ".",
        "",
    ]
    rows = [
        (
            _fmt(e.get("step")),
            _severity(e),
            str(e.get("kind")),
            str(e.get("message", "")),
            str(e.get("suggestion", "")),
        )
        for e in events[:MAX_EVENTS_LISTED]
    ]
    lines += _table(("step", "severity", "kind", "message", "suggestion"), rows)
    if len(events) > MAX_EVENTS_LISTED:
        lines.append(f"\n… and {len(events) - MAX_EVENTS_LISTED} more.")
    return lines


def _collect_events(run: RunData) -> list[dict[str, Any]]:
    """Health events from ``health.jsonl`` and from ``event`` / ``health/*`` keys in the metrics,
    one per (step, kind), by step."""
    events: dict[tuple[Any, str], dict[str, Any]] = {}
    health_path = run.run_dir / HEALTH_FILE
    if health_path.is_file():
        for lineno, line in enumerate(
            health_path.read_text(encoding="utf-8", errors="replace").splitlines(), 1
        ):
            try:
                event = json.loads(line) if line.strip() else None
            except json.JSONDecodeError:
                run.notes.append(f"{HEALTH_FILE}:{lineno} is not valid JSON; skipped")
                continue
            if isinstance(event, dict):
                events.setdefault((event.get("step"), str(event.get("kind"))), event)
    for row in run.rows:
        step = row.get("step")
        if "event" in row:
            kind = str(row["event"])
            message = row.get("message", {k: v for k, v in row.items() if k not in ("step", "event")})
            events.setdefault((step, kind), {"step": step, "kind": kind, "message": message})
        for key, value in row.items():
            if key.startswith("health/"):
                kind = key.removeprefix("health/")
                events.setdefault((step, kind), {"step": step, "kind": kind, "message": value})
    return sorted(events.values(), key=lambda e: e["step"] if _is_number(e.get("step")) else math.inf)


def _final_values(rows: list[dict[str, Any]]) -> list[tuple[str, str, str]]:
    last: dict[str, tuple[Any, Any]] = {}
    for row in rows:
        for key, value in row.items():
            if key != "step" and _is_number(value):
                last[key] = (row.get("step"), value)
    return [(f"`{k}`", _fmt(step), _fmt(v)) for k, (step, v) in sorted(last.items())]


def _severity(event: Mapping[str, Any]) -> str:
    severity = event.get("severity")
    return severity if severity in SEVERITIES else "warning"


def _table(header: Sequence[str], rows: Sequence[Sequence[str]]) -> list[str]:
    if not rows:
        return []
    cell = lambda s: str(s).replace("|", "\\|").replace("\n", " ")
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(cell(c) for c in row) + " |" for row in rows),
    ]


def _flatten(tree: Any, prefix: str = "") -> dict[str, Any]:
    if not isinstance(tree, dict):
        return {prefix or "value": tree}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        name = f"{prefix}.{key}" if prefix else str(key)
        flat.update(_flatten(value, name) if isinstance(value, dict) and value else {name: value})
    return flat


def _fmt_resolved(key: str, value: Any, run: RunData) -> str:
    """A config value; for one the run resolved from ``auto``, the value it ran with and what
    was asked: ``0.5 (asked: auto)``."""
    if key not in run.resolved:
        return _fmt(value)
    used = run.resolved[key] if value == "auto" else _fmt(value)
    return f"{used} (asked: auto)"


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _fmt(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


if __name__ == "__main__":
    raise SystemExit(main())
