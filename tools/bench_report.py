"""Generate BENCHMARKS.md from pytest-benchmark JSON files: the published tables, never typed by hand.

    python tools/bench_report.py bench/results/*.json [--out BENCHMARKS.md]

One section per JSON file (one ``pytest`` run), newest first, headed by the device, the versions
(torch, triton, CUDA), the date, the commit and the exact command; one table per benchmark group
(``@pytest.mark.benchmark(group=...)``, else ``file::test function``), one row per case and
implementation. What a row shows, from the benchmark's stats and ``extra_info``:

- time: median of the rounds, and the spread (interquartile range over the median: noise);
- ``× eager`` / ``× compile``: the eager (``impl`` ``eager``) and ``torch.compile`` (``compiled``)
  medians of the same case over this row's median (> 1: this row is faster);
- peak memory (``peak_memory_bytes``) and ``× logits``: peak memory over the size of the case's
  ``[N, V]`` logits (``logits_bytes``, else ``N·V·bytes`` from the ``n``, ``v`` parameters in
  ``extra_info["dtype"]``, else bf16 for a CUDA case and fp32 for a CPU one);
- ``GB/s`` over the traffic floor and its fraction of the copy bandwidth measured in the same
  session (``gb_per_s``, ``copy_fraction``), ``TFLOP/s``, tokens/s, status (``oom``).

A case is a CUDA case when its test function's name ends in ``gpu`` (the convention of ``bench/``).
Run metadata comes from the JSON's ``grpo_fast_env`` (written by ``tools/gpu_check.sh``), else
from the cases' ``extra_info`` (``device``, ``versions``, ``command``, ``load_average_1m``), else
pytest-benchmark's ``machine_info``; what no file holds is printed as "not recorded".

A case whose ``extra_info`` holds ``peer_comparison`` (``bench/peers/``: grpo_fast against TRL,
Liger-Kernel, torch, timed alternately in one test) goes to the "Compared with other tools"
section instead, one table per case, one row per tool, from ``peer_comparison["impls"]``:

- ``kind: train_step``: median step, rollout and train phase times, peak memory, the reward of the
  last five steps and greedy eval accuracy before → after; ``kind: loss_op``: median time (and
  CPU time, and both over grpo_fast's GEMM floor, where recorded), peak memory (and over the ``[N, V]``
  logits), whether the entropy is computed;
- on every other tool's row, each figure says how grpo_fast compares: "grpo_fast 1.6× faster" /
  "grpo_fast 0.45×" (of its memory), or **not ahead** when grpo_fast is not at least ``AHEAD``
  better (within noise or behind);
- "where the time goes": each tool's top ops by self time per phase (``top_ops``), from the
  ``torch.profiler`` step the benchmark ran.

A case whose ``extra_info`` holds ``pipeline_comparison`` (``bench/test_bench_pipeline.py``: whole
runs, lockstep against generation apart from training, alternating fresh processes) goes to the
"Generation apart from training" section, one table per workload, one row per variant: the median
step and its ratio to the first row's (``× lockstep``), the run's wall time, eval accuracy before →
after, the share of time each side waited for the other, the weight sync per step, the largest
policy lag, the sampler-vs-trainer log-prob gap (mean, max), each round's step time and load.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from datetime import datetime
from pathlib import Path

EAGER_IMPLS = ("eager",)
COMPILE_IMPLS = ("compiled", "torch_compile", "compile")
IMPL_KEYS = ("impl", "backend", "provider")  # parameter names that pick the implementation
DTYPE_BYTES = {"float32": 4, "fp32": 4, "bfloat16": 2, "bf16": 2, "float16": 2, "fp16": 2}
NOISY_SPREAD = 0.25  # IQR / median above which a run's note calls its timings noisy
# 1-minute load average per core above which other work shared the machine. The benchmark's own
# torch threads (one per core) already make ≈ 1.0 per core: an idle 2-core machine read 1.7 during
# `pytest bench/`, one shared with another test run 3.3.
BUSY_LOAD_PER_CORE = 1.25
# grpo_fast is "ahead" of another tool on a figure only when its ratio is at least this (5%):
# a shared 2-core machine's step-to-step noise is of that order.
AHEAD = 1.05


class ReportError(Exception):
    """An input file that is not pytest-benchmark JSON (the message names the file)."""


@dataclass
class Row:
    """One benchmark: a case (shape) run by one implementation."""

    table: str
    case: str
    impl: str
    on_cuda: bool
    stats: dict
    info: dict
    params: dict

    @property
    def median(self) -> float:
        return self.stats["median"]

    @property
    def spread(self) -> float:
        return self.stats.get("iqr", 0.0) / self.median if self.median else 0.0

    @property
    def failed(self) -> bool:
        return self.info.get("status", "ok") != "ok"

    @property
    def peer(self) -> dict | None:
        """``extra_info["peer_comparison"]``: a side-by-side with other tools (``bench/peers/``)."""
        return self.info.get("peer_comparison")

    @property
    def pipeline(self) -> dict | None:
        """``extra_info["pipeline_comparison"]``: whole runs, lockstep against the pipeline."""
        return self.info.get("pipeline_comparison")

    def logits_bytes(self) -> float | None:
        if self.info.get("logits_bytes"):
            return self.info["logits_bytes"]
        n, v = self.params.get("n"), self.params.get("v")
        if n is None or v is None:
            return None
        default = "bfloat16" if self.on_cuda else "float32"
        return n * v * DTYPE_BYTES[str(self.info.get("dtype", default)).removeprefix("torch.")]


@dataclass
class Run:
    """One JSON file: one pytest invocation."""

    path: Path
    date: datetime | None
    rows: list[Row]
    meta: dict = field(default_factory=dict)


def _table_name(bench: dict) -> str:
    if bench.get("group"):
        return bench["group"]
    fullname = bench["fullname"].split("[", 1)[0]  # bench/test_bench_x.py::test_gpu[...]
    file, _, func = fullname.partition("::")
    return f"{Path(file).stem.removeprefix('test_bench_')} · {func}"


def _split_params(bench: dict) -> tuple[str, dict]:
    """``(impl, the other parameters)``; impl from ``extra_info["impl"]`` or an ``IMPL_KEYS`` parameter."""
    params = dict(bench.get("params") or {})
    impl = bench.get("extra_info", {}).get("impl")
    for key in IMPL_KEYS:
        if key in params:
            impl = impl or str(params[key])
            del params[key]
    return impl or bench["name"].split("[", 1)[0], params


def load_run(path: Path) -> Run:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError) as exc:
        raise ReportError(f"{path}: cannot read JSON ({exc})") from None
    if not isinstance(data, dict) or not isinstance(data.get("benchmarks"), list):
        raise ReportError(
            f"{path}: not pytest-benchmark JSON (no 'benchmarks' list; make it with --benchmark-json)"
        )
    rows = []
    for bench in data["benchmarks"]:
        impl, params = _split_params(bench)
        func = bench["fullname"].split("::")[-1].split("[", 1)[0]
        case = ", ".join(f"{k}={v}" for k, v in params.items()) or "—"
        rows.append(
            Row(
                table=_table_name(bench),
                case=case,
                impl=impl,
                on_cuda=func.endswith("gpu"),
                stats=bench["stats"],
                info=bench.get("extra_info") or {},
                params=params,
            )
        )
    date = datetime.fromisoformat(data["datetime"]) if data.get("datetime") else None
    return Run(Path(path), date, rows, _run_meta(data, rows))


def _first(rows: list[Row], key: str):
    """The first non-empty ``extra_info[key]`` of the run's cases (an empty string says nothing)."""
    return next((r.info[key] for r in rows if r.info.get(key) not in (None, "", {})), None)


def _run_meta(data: dict, rows: list[Row]) -> dict:
    env = data.get("grpo_fast_env") or {}
    machine = data.get("machine_info") or {}
    cpu = (machine.get("cpu") or {}).get("brand_raw")
    commit = data.get("commit_info") or {}
    loads = [r.info["load_average_1m"] for r in rows if r.info.get("load_average_1m") is not None]
    return {
        "device": env.get("device") or _first(rows, "device") or (f"{cpu} (CPU)" if cpu else None),
        "versions": env.get("versions") or _first(rows, "versions") or {},
        "python": machine.get("python_version"),
        "commit": (commit.get("id", "")[:12] + (" (uncommitted changes)" if commit.get("dirty") else ""))
        if commit.get("id")
        else None,
        "commands": env.get("commands") or sorted({r.info["command"] for r in rows if r.info.get("command")}),
        "copy_gb_per_s": env.get("copy_gb_per_s") or _first(rows, "copy_gb_per_s"),
        "cpu_count": env.get("cpu_count") or _first(rows, "cpu_count"),
        "max_load": max(loads) if loads else None,
        "notes": env.get("notes") or [],
    }


# ----------------------------------------------------------------------------------------------
# Formatting
# ----------------------------------------------------------------------------------------------


def fmt_time(seconds: float) -> str:
    for unit, scale in (("s", 1.0), ("ms", 1e-3), ("µs", 1e-6)):
        if seconds >= scale:
            return f"{seconds / scale:.3g} {unit}"
    return f"{seconds / 1e-9:.3g} ns"


def fmt_bytes(b: float) -> str:
    for unit, scale in (("GB", 1e9), ("MB", 1e6), ("KB", 1e3)):
        if abs(b) >= scale:
            return f"{b / scale:.3g} {unit}"
    return f"{b:.0f} B"


def fmt_ratio(x: float | None) -> str:
    return "" if x is None else f"{x:.2f}×"


def _baseline(rows: list[Row], row: Row, impls: tuple[str, ...]) -> Row | None:
    return next((r for r in rows if r.case == row.case and r.impl in impls and not r.failed), None)


# (header, cell) per column; a column whose cells are all empty is left out of its table.
def _columns(rows: list[Row]):
    def speedup(impls):
        def cell(r: Row) -> str:
            base = _baseline(rows, r, impls)
            return "" if base is None or r.failed else fmt_ratio(base.median / r.median)

        return cell

    def per_logits(r: Row) -> str:
        peak, logits = r.info.get("peak_memory_bytes"), r.logits_bytes()
        return fmt_ratio(peak / logits) if peak is not None and logits else ""

    def opt(key, fmt):
        return lambda r: "" if r.info.get(key) is None else fmt(r.info[key])

    return [
        ("case", lambda r: r.case if r.case != "—" else ""),
        ("impl", lambda r: f"**{r.impl}**" if r.impl not in EAGER_IMPLS + COMPILE_IMPLS else r.impl),
        ("status", lambda r: r.info["status"].upper() if r.failed else ""),
        ("time (median)", lambda r: fmt_time(r.median) if not r.failed else "—"),
        ("spread", lambda r: f"{r.spread:.0%}" if not r.failed else ""),
        ("rounds", lambda r: str(r.stats.get("rounds", ""))),
        ("× eager", speedup(EAGER_IMPLS)),
        ("× compile", speedup(COMPILE_IMPLS)),
        ("tokens/s", opt("tokens_per_s", lambda x: f"{x:,.0f}")),
        ("peak memory", opt("peak_memory_bytes", fmt_bytes)),
        ("absolute peak", opt("absolute_peak_memory_bytes", fmt_bytes)),
        ("[N, V] logits", lambda r: fmt_bytes(r.logits_bytes()) if r.logits_bytes() else ""),
        ("peak / logits", per_logits),
        ("GB/s", opt("gb_per_s", lambda x: f"{x:,.0f}")),
        ("of copy BW", opt("copy_fraction", lambda x: f"{x:.0%}")),
        ("TFLOP/s", opt("tflops", lambda x: f"{x:.0f}")),
    ]


def render_table(rows: list[Row]) -> list[str]:
    cols = [(h, [cell(r) for r in rows]) for h, cell in _columns(rows)]
    cols = [(h, cells) for h, cells in cols if any(cells)]
    numeric = {
        "time (median)",
        "spread",
        "rounds",
        "× eager",
        "× compile",
        "tokens/s",
        "peak memory",
        "absolute peak",
        "[N, V] logits",
        "peak / logits",
        "GB/s",
        "of copy BW",
        "TFLOP/s",
    }
    lines = [
        "| " + " | ".join(h for h, _ in cols) + " |",
        "|" + "|".join("---:" if h in numeric else "---" for h, _ in cols) + "|",
    ]
    for i in range(len(rows)):
        lines.append("| " + " | ".join(cells[i] for _, cells in cols) + " |")
    return lines


def _notes(run: Run) -> list[str]:
    m = run.meta
    notes = list(m["notes"])
    cores = m["cpu_count"]
    if m["max_load"] is not None and cores and m["max_load"] > BUSY_LOAD_PER_CORE * cores:
        notes.append(
            f"The machine was shared with other work while this ran: 1-minute load average up to "
            f"{m['max_load']:.1f} on {cores} cores. Timings are noisier and slower than on an idle machine."
        )
    timed = [r for r in run.rows if not r.failed and r.stats.get("rounds", 0) > 1]
    if timed:
        worst = max(timed, key=lambda r: r.spread)
        if worst.spread > NOISY_SPREAD:
            noisy = sum(r.spread > NOISY_SPREAD for r in timed)
            where = ", ".join(x for x in (worst.table, worst.impl, worst.case) if x != "—")
            notes.append(
                f"{noisy} of {len(timed)} cases have a spread (IQR / median) over {NOISY_SPREAD:.0%}, "
                f"up to {worst.spread:.0%} ({where})."
            )
    for r in run.rows:
        if r.failed:
            notes.append(
                f"{r.table}, {r.impl}: {r.info['status'].upper()} — {r.info.get('error') or 'no message'}."
            )
    return notes


def render_run(run: Run) -> list[str]:
    m = run.meta
    v = m["versions"]
    cuda = (v["cuda"] or "none") if "cuda" in v else "not recorded"
    device = m["device"] or "not recorded"
    when = run.date.strftime("%Y-%m-%d %H:%M %Z").strip() if run.date else "not recorded"
    lines = [
        f"## {device} — {when}",
        "",
        f"- source: `{run.path.as_posix()}`",
        f"- versions: torch {v.get('torch', 'not recorded')}, triton {v.get('triton', 'not recorded')}, "
        f"CUDA {cuda}" + "".join(f", {k} {v[k]}" for k in ("transformers", "bitsandbytes") if v.get(k)),
        f"- python {m['python'] or 'not recorded'}, commit {m['commit'] or 'not recorded'}",
    ]
    if m["copy_gb_per_s"]:
        lines.append(
            f"- measured copy bandwidth: {m['copy_gb_per_s']:,.0f} GB/s (read + write, 1 GiB `copy_`)"
        )
    commands = m["commands"] or ["not recorded"]
    lines += [f"- command: `{c}`" for c in commands]
    notes = _notes(run)
    if notes:
        lines += ["", "Notes:", "", *(f"- {n}" for n in notes)]
    tables: dict[str, list[Row]] = {}
    for r in run.rows:
        if r.peer is None and r.pipeline is None:  # their own sections (render_peers, render_pipelines)
            tables.setdefault(r.table, []).append(r)
    for name, rows in tables.items():
        first_seen = {case: i for i, case in reversed(list(enumerate(r.case for r in rows)))}
        rows.sort(key=lambda r: first_seen[r.case])  # a case's implementations together, stable order
        lines += ["", f"### {name}", "", *render_table(rows)]
        for case in sorted({r.info["case"] for r in rows if r.info.get("case")}):
            lines += ["", f"Case: {case}."]
    return lines


def render(runs: list[Run], command: str) -> str:
    runs = sorted(runs, key=lambda r: r.date.timestamp() if r.date else 0.0, reverse=True)
    lines = [
        "# Benchmarks",
        "",
        f"Generated by `{command}` from pytest-benchmark JSON; do not edit by hand "
        "(see `tools/bench_report.py` for what each column means).",
        "",
        "Peak memory: on CUDA the memory one step allocates on top of its inputs (`max_memory_allocated`; "
        "*absolute peak* counts the weights and optimizer state too); on CPU the resident-set growth of one "
        "step in a fresh process (`grpo_fast.obs.memory.peak_rss_growth`). `× eager`, `× compile`: how many "
        "times faster than eager PyTorch / `torch.compile` on the same case. `GB/s`: the op's traffic floor "
        "over its time; `of copy BW`: that over a plain device copy measured in the same session.",
    ]
    lines += render_peers(runs)
    lines += render_pipelines(runs)
    for run in runs:
        if any(r.peer is None and r.pipeline is None for r in run.rows):
            lines += ["", *render_run(run)]
    return "\n".join(lines) + "\n"


# ----------------------------------------------------------------------------------------------
# Compared with other tools (bench/peers/)
# ----------------------------------------------------------------------------------------------


def versus(ours: float | None, theirs: float | None, what: str = "faster") -> str:
    """How grpo_fast compares on a figure where lower is better: ``what="faster"`` (a time):
    "grpo_fast 1.60× faster"; ``"memory"``: "grpo_fast 0.45× of it"; either prefixed with
    **not ahead** when ``theirs / ours`` is below ``AHEAD``."""
    if not ours or not theirs:
        return ""
    ratio = theirs / ours
    speed = "faster" if ratio >= 1 else "as fast"
    said = f"grpo_fast {ratio:.2f}× {speed}" if what == "faster" else f"grpo_fast {1 / ratio:.2f}× of it"
    return said if ratio >= AHEAD else f"**not ahead**: {said}"


def _with_versus(value: str, ours: float | None, theirs: float | None, is_ours: bool, what: str) -> str:
    if is_ours or not value:
        return value
    v = versus(ours, theirs, what)
    return f"{value} ({v})" if v else value


def _is_ours(impl: dict) -> bool:
    """grpo_fast itself, or another configuration of it (``grpo_fast_chunk256``): never compared
    against grpo_fast."""
    return bool(impl.get("ours")) or str(impl.get("impl", "")).startswith("grpo_fast")


def _fmt_opt(x, fmt) -> str:
    return "" if x is None else fmt(x)


def _train_step_table(p: dict) -> list[str]:
    impls = p["impls"]
    ours = next((i for i in impls if i.get("ours")), {})
    lines = [
        "| tool | version | step (median) | rollout | train | peak memory | reward, last 5 steps "
        "| eval accuracy before → after |",
        "|---|---|---:|---:|---:|---:|---:|---:|",
    ]
    for i in impls:
        is_ours = _is_ours(i)

        def cell(key, fmt, what="faster", i=i, is_ours=is_ours):
            return _with_versus(_fmt_opt(i.get(key), fmt), ours.get(key), i.get(key), is_ours, what)

        acc = ""
        if i.get("eval_accuracy_before") is not None and i.get("eval_accuracy_after") is not None:
            acc = f"{i['eval_accuracy_before']:.3f} → {i['eval_accuracy_after']:.3f}"
        reward = _fmt_opt(i.get("reward_last5"), lambda x: f"{x:.3f}")
        if reward and i.get("reward_after_steps"):
            reward += f" (after {i['reward_after_steps']} steps)"
        lines.append(
            "| "
            + " | ".join(
                [
                    f"**{i['impl']}**" if i.get("ours") else i["impl"],
                    str(i.get("version") or ""),
                    cell("step_s", fmt_time),
                    cell("rollout_s", fmt_time),
                    cell("train_s", fmt_time),
                    cell("peak_memory_bytes", fmt_bytes, "memory"),
                    reward,
                    acc,
                ]
            )
            + " |"
        )
    return lines + _step_floor(ours, [i for i in impls if not _is_ours(i)])


def _step_floor(ours: dict, others: list[dict]) -> list[str]:
    """A line on grpo_fast's step against its GEMM floor (``gemm_floor_s``: bench/peers runs from
    2026-12-04 on), and the step each other tool would need for grpo_fast to be 3× faster."""
    floor, step = ours.get("gemm_floor_s"), ours.get("step_s")
    if not floor or not step:
        return []
    line = (
        f"- GEMM floor of grpo_fast's step (the matmuls of its generation and update alone, at their "
        f"shapes, timed on this machine): {fmt_time(floor)}; grpo_fast's step is {step / floor:.2f}× it"
    )
    for i in others:
        if i.get("step_s"):
            line += (
                f"; {i['impl']}'s step is {i['step_s'] / floor:.2f}× it, so 3× {i['impl']} would need a step "
                f"of {fmt_time(i['step_s'] / 3)}" + (" (below the floor)" if i["step_s"] / 3 < floor else "")
            )
    return ["", line]


def _loss_op_table(p: dict) -> list[str]:
    """One row per implementation; the CPU-time and GEMM-floor columns only where the run has them
    (``cpu_time_s``, ``time_over_gemm_floor``, ``cpu_time_over_gemm_floor``: bench/peers'
    fresh-process runs from 2026-12-03 on). On a shared machine the CPU-time ratio is the one that
    waits for a core do not distort."""
    impls = p["impls"]
    ours = next((i for i in impls if i.get("ours")), {})
    logits = p.get("logits_bytes")
    has_cpu = any(i.get("cpu_time_s") is not None for i in impls)
    has_floor = any(i.get("time_over_gemm_floor") is not None for i in impls)
    cpu_floor = has_floor and any(i.get("cpu_time_over_gemm_floor") is not None for i in impls)
    headers = ["implementation", "version", "computes", "entropy", "time (median)"]
    headers += (
        ["CPU time (median)"] * has_cpu + ["× GEMM floor"] * has_floor + ["CPU × GEMM floor"] * cpu_floor
    )
    headers += ["peak memory", "peak / logits"]
    lines = ["| " + " | ".join(headers) + " |", "|---|---|---|---|" + "---:|" * (len(headers) - 4)]
    for i in impls:
        is_ours = _is_ours(i)
        peak = i.get("peak_memory_bytes")

        def timed(key, i=i, is_ours=is_ours):
            return _with_versus(_fmt_opt(i.get(key), fmt_time), ours.get(key), i.get(key), is_ours, "faster")

        cells = [
            f"**{i['impl']}**" if i.get("ours") else i["impl"],
            str(i.get("version") or ""),
            i.get("what", ""),
            "yes" if i.get("entropy") else "no",
            timed("time_s"),
        ]
        cells += [timed("cpu_time_s")] * has_cpu + [fmt_ratio(i.get("time_over_gemm_floor"))] * has_floor
        cells += [fmt_ratio(i.get("cpu_time_over_gemm_floor"))] * cpu_floor
        cells += [
            _with_versus(_fmt_opt(peak, fmt_bytes), ours.get("peak_memory_bytes"), peak, is_ours, "memory"),
            fmt_ratio(peak / logits) if peak is not None and logits else "",
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def _where_the_time_goes(p: dict) -> list[str]:
    lines = []
    for i in p["impls"]:
        for phase, ops in (i.get("top_ops") or {}).items():
            if ops:
                tops = ", ".join(f"`{name}` {fmt_time(sec)}" for name, sec in ops)
                lines.append(f"- {i['impl']}, {phase}: {tops}")
    if lines:
        lines = ["", "Where the time goes (one profiled step of each, self time of the top ops):", "", *lines]
    return lines


def render_peers(runs: list[Run]) -> list[str]:
    """The "Compared with other tools" section: one table per peer-comparison case, newest run first."""
    cases = [(run, r) for run in runs for r in run.rows if r.peer is not None]
    if not cases:
        return []
    lines = [
        "",
        "## Compared with other tools",
        "",
        "grpo_fast and another tool on the same work, alternating in one process (`bench/peers/`). On "
        "each other tool's row, every figure says how grpo_fast compares (lower is better for time and "
        f"memory); **not ahead** marks a figure where grpo_fast is not at least {AHEAD - 1:.0%} better.",
    ]
    for run, r in cases:
        p, m = r.peer, run.meta
        title = "Whole GRPO step" if p.get("kind") == "train_step" else "Fused lm_head + GRPO loss"
        when = run.date.strftime("%Y-%m-%d %H:%M %Z").strip() if run.date else "not recorded"
        load = r.info.get("load_average_1m")
        cores = r.info.get("cpu_count") or m["cpu_count"]
        v = r.info.get("versions") or m["versions"]
        lines += [
            "",
            f"### {title}: {p.get('case', r.case)}",
            "",
            f"- {r.info.get('device') or m['device'] or 'device not recorded'}, {when}; source "
            f"`{run.path.as_posix()}`",
            "- versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k]),
        ]
        if load is not None:
            busy = " (shared with other work)" if cores and load > BUSY_LOAD_PER_CORE * cores else ""
            lines.append(f"- 1-minute load average up to {load:.1f} on {cores or '?'} cores{busy}")
        rounds = f"{p['rounds']} rounds" if p.get("rounds") else ""
        warm = f", after {p['warmup_steps']} warm-up steps of each" if p.get("warmup_steps") else ""
        lines.append(f"- {rounds}{warm}; peak memory: {p.get('memory', 'not recorded')}")
        if r.info.get("command"):
            lines.append(f"- command: `{r.info['command']}`")
        lines += ["", *(_train_step_table(p) if p.get("kind") == "train_step" else _loss_op_table(p))]
        lines += _where_the_time_goes(p)
    return lines


# ----------------------------------------------------------------------------------------------
# Generation apart from training (bench/test_bench_pipeline.py)
# ----------------------------------------------------------------------------------------------


def _pipeline_table(p: dict) -> list[str]:
    impls = p["impls"]
    base = impls[0].get("step_s") if impls else None
    lines = [
        "| variant | step (median) | × lockstep | run wall | eval before → after | trainer waited "
        "| producer waited | weight sync / step | policy lag (max) | log-prob gap, mean (max) "
        "| step per round | load per round |",
        "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for i in impls:
        acc = ""
        if i.get("eval_before") is not None and i.get("eval_after") is not None:
            gain = i["eval_after"] - i["eval_before"]
            acc = f"{i['eval_before']:.3f} → {i['eval_after']:.3f} ({gain:+.3f})"
        gap = _fmt_opt(i.get("logprob_gap_mean"), lambda x: f"{x:.2g}")
        if gap and i.get("logprob_gap_max") is not None:
            gap += f" ({i['logprob_gap_max']:.2g})"
        cells = [
            f"**{i['impl']}**" if i.get("ours") else i["impl"],
            _fmt_opt(i.get("step_s"), fmt_time),
            fmt_ratio(base / i["step_s"]) if base and i.get("step_s") else "",
            _fmt_opt(i.get("grpo_wall_s"), fmt_time),
            acc,
            _fmt_opt(i.get("trainer_wait_share"), lambda x: f"{x:.0%}"),
            _fmt_opt(i.get("producer_wait_share"), lambda x: f"{x:.0%}"),
            _fmt_opt(i.get("weight_sync_s"), fmt_time),
            _fmt_opt(i.get("policy_lag_max"), lambda x: f"{x:.0f}"),
            gap,
            ", ".join(fmt_time(x) for x in i.get("step_s_rounds", [])),
            ", ".join(f"{x:.1f}" for x in i.get("load_1m_rounds", [])),
        ]
        lines.append("| " + " | ".join(cells) + " |")
    return lines


def render_pipelines(runs: list[Run]) -> list[str]:
    """The "Generation apart from training" section: one table per workload, newest run first."""
    cases = [(run, r) for run in runs for r in run.rows if r.pipeline is not None]
    if not cases:
        return []
    lines = [
        "",
        "## Generation apart from training",
        "",
        "Whole runs of each variant as fresh processes, alternating (`bench/test_bench_pipeline.py`): "
        "lockstep against the pipeline (`rollout.max_staleness`), the hf decoder in the training "
        "process against a worker process (`rollout.placement`). `× lockstep`: the first row's median "
        "step over this row's (> 1: faster). Waited: the trainer's share of its step time spent "
        "waiting for its batch; the producer's share of its time spent waiting for the trainer's "
        "weights.",
    ]
    for run, r in cases:
        p = r.pipeline
        when = run.date.strftime("%Y-%m-%d %H:%M %Z").strip() if run.date else "not recorded"
        cores = r.info.get("cpu_count") or run.meta["cpu_count"]
        load = r.info.get("load_average_1m")
        v = r.info.get("versions") or run.meta["versions"]
        lines += [
            "",
            f"### Whole runs: {p.get('case', r.case)}",
            "",
            f"- {r.info.get('device') or run.meta['device'] or 'device not recorded'}, {when}; source "
            f"`{run.path.as_posix()}`",
            "- versions: " + ", ".join(f"{k} {v[k]}" for k in sorted(v) if v[k]),
            f"- {p.get('rounds', '?')} round(s) of every variant, {r.info.get('torch_threads', '?')} torch "
            f"threads by default on {cores or '?'} cores",
        ]
        if load is not None:
            busy = " (shared with other work)" if cores and load > BUSY_LOAD_PER_CORE * cores else ""
            lines.append(f"- 1-minute load average up to {load:.1f}{busy}")
        if r.info.get("command"):
            lines.append(f"- command: `{r.info['command']}`")
        lines += ["", *_pipeline_table(p)]
    return lines


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    p = argparse.ArgumentParser(prog="python tools/bench_report.py", description=__doc__.split("\n", 1)[0])
    p.add_argument("files", nargs="+", type=Path, help="pytest-benchmark JSON files (--benchmark-json)")
    p.add_argument("--out", type=Path, default=Path("BENCHMARKS.md"), help="default: BENCHMARKS.md")
    args = p.parse_args(argv)
    try:
        runs = [load_run(f) for f in args.files]
    except ReportError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    args.out.write_text(render(runs, " ".join(["python tools/bench_report.py", *argv])))
    print(f"wrote {args.out} ({sum(len(r.rows) for r in runs)} benchmarks from {len(runs)} file(s))")
    return 0


if __name__ == "__main__":
    sys.exit(main())
