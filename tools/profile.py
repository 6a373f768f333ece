"""Profile one optimization step, fused lm_head + loss against the eager reference, side by side.

    python tools/profile.py [--preset tiny] [--device cpu|cuda] [--steps N] [--out DIR]
    python tools/profile.py --preset rtx4090 --device cuda --memory-cap-gb 24

The step is ``OptimizationPhase`` from ``bench/workloads_train_step.py`` (what the benchmark
times): ``loss_trajectories`` → ``make_microbatches`` → ``PolicyLoss`` → backward → grad clip →
optimizer step. ``tiny`` uses its built-in model; a GPU preset (``rtx4090``, ``h100``) a random-init
Qwen2.5-Math-1.5B. The fused path is ``loss.kernel_backend=auto`` (``triton`` on CUDA,
``torch_chunked`` on CPU); the reference is ``eager`` (``[n, V]`` logits + ``eager_grpo_loss_from_logits``).

For each path: one warm-up step, ``--steps`` timed steps (wall time; on CUDA the peak memory of
the steps, ``grpo_fast.obs.memory.peak_cuda_memory``, and the absolute ``max_memory_allocated``), then
``--steps`` steps under ``torch.profiler`` (on CPU the peak memory is read from its allocation
events). Writes to ``--out`` (default ``runs/profile``):

    trace_<path>.json   Chrome/Perfetto trace (chrome://tracing, https://ui.perfetto.dev)
    ops_<path>.txt      top ops by self CPU time (CPU) or self device time (CUDA)
    summary.md          time per step, tokens/s and peak memory of both paths, and their ratio
    summary.json        the same numbers, for scripts
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# `python tools/profile.py` puts tools/ first on sys.path, where this file would shadow the standard
# library's `profile` module (cProfile imports it); the repository root goes there instead, which
# also makes `bench` and `grpo_fast` importable without an install.
if sys.path and Path(sys.path[0]).resolve() == ROOT / "tools":
    sys.path[0] = str(ROOT)

import torch  # noqa: E402
from torch.profiler import ProfilerActivity, record_function  # noqa: E402

from bench.workloads_train_step import (  # noqa: E402
    device_name,
    memory_cap,
    optimization_workload,
    version,
)
from grpo_fast.config_checks import GPU_PRESETS  # noqa: E402
from grpo_fast.errors import ConfigError, cli_errors  # noqa: E402
from grpo_fast.obs.memory import peak_cuda_memory  # noqa: E402
from tools.bench_report import fmt_bytes  # noqa: E402

PRESETS = ("tiny", *GPU_PRESETS)
TOP_OPS_IN_SUMMARY = 5


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python tools/profile.py", description=__doc__.split("\n", 1)[0])
    p.add_argument("--preset", default="tiny", choices=PRESETS)
    p.add_argument(
        "--device", default=None, choices=("cpu", "cuda"), help="default: cuda for a GPU preset, else cpu"
    )
    p.add_argument("--steps", type=int, default=1, help="steps timed, then steps profiled (default 1)")
    p.add_argument("--out", default="runs/profile", help="output directory (default runs/profile)")
    p.add_argument("--rows", type=int, default=25, help="rows of each top-ops table (default 25)")
    p.add_argument(
        "--memory-cap-gb", type=float, default=None, help="cap CUDA memory, e.g. 24 for an RTX 4090"
    )
    args = p.parse_args(argv)
    args.device = args.device or ("cuda" if args.preset in GPU_PRESETS else "cpu")
    if args.steps < 1:
        raise ConfigError(f"--steps must be >= 1, got {args.steps}")
    if args.device == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda: no CUDA device is available; try --preset tiny --device cpu")
    if args.preset in GPU_PRESETS and args.device != "cuda":
        raise ConfigError(f"--preset {args.preset} profiles a 1.5B model and needs --device cuda")
    if args.memory_cap_gb is not None and args.device != "cuda":
        raise ConfigError("--memory-cap-gb caps CUDA memory and needs --device cuda")
    return args


def _timed_steps(phase, batch, steps: int, device: torch.device) -> list[float]:
    times = []
    for _ in range(steps):
        t0 = time.perf_counter()
        phase(batch)
        if device.type == "cuda":
            torch.cuda.synchronize(device)  # host-device sync: close the timed region
        times.append(time.perf_counter() - t0)
    return times


def _trace_peak_bytes(trace: Path, device_type: int) -> int:
    """Peak of the profiler's ``[memory]`` events (``Total Allocated``, counted from the start of the
    profile) on one device type (0 = CPU): the tensor memory the profiled steps had live at once."""
    events = json.loads(trace.read_text())["traceEvents"]
    totals = [
        e["args"]["Total Allocated"]
        for e in events
        if e.get("name") == "[memory]" and e["args"].get("Device Type") == device_type
    ]
    return max(totals, default=0)


def profile_path(args, name: str, backend: str, device: torch.device, out: Path, model=None) -> dict:
    """Time, measure and profile one path; returns its summary row (with the model, to share it)."""
    phase, batch = optimization_workload(args.preset, backend, device, model)
    resolved = backend if backend != "auto" else ("triton" if device.type == "cuda" else "torch_chunked")
    row = {"path": name, "backend": resolved, "model": phase.model, "tokens": batch.tokens}
    row["logits_bytes"] = phase.logits_bytes(batch)
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    try:
        phase(batch)  # warm-up: optimizer state, Triton autotuning, allocator pools
        if device.type == "cuda":
            times: list[float] = []
            row["peak_bytes"] = peak_cuda_memory(
                lambda: times.extend(_timed_steps(phase, batch, args.steps, device)), device
            )
            row["absolute_peak_bytes"] = torch.cuda.max_memory_allocated(device)
        else:
            times = _timed_steps(phase, batch, args.steps, device)
        with torch.profiler.profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
            for i in range(args.steps):
                with record_function(f"optimization_step_{i}"):
                    phase(batch)
                if device.type == "cuda":
                    torch.cuda.synchronize(device)  # the profile ends after the device's work
    except torch.cuda.OutOfMemoryError as exc:
        row["oom"] = str(exc).splitlines()[0]
        phase.release()
        return row
    row["step_s"] = sorted(times)[len(times) // 2]
    sort_by = "self_device_time_total" if device.type == "cuda" else "self_cpu_time_total"
    averages = prof.key_averages()
    trace, table = out / f"trace_{name}.json", out / f"ops_{name}.txt"
    prof.export_chrome_trace(str(trace))
    table.write_text(averages.table(sort_by=sort_by, row_limit=args.rows) + "\n")
    if device.type == "cpu":
        row["peak_bytes"] = _trace_peak_bytes(trace, device_type=0)
    top = sorted(
        (e for e in averages if not e.key.startswith("optimization_step_")),
        key=lambda e: getattr(e, sort_by),
        reverse=True,
    )[:TOP_OPS_IN_SUMMARY]
    row.update(
        trace=trace.name,
        table=table.name,
        sort_by=sort_by,
        top_ops=[(e.key, getattr(e, sort_by) / 1e3 / args.steps) for e in top],  # µs -> ms per step
    )
    return row


def summary_markdown(args, device: torch.device, rows: list[dict]) -> str:
    versions = ", ".join(f"{m} {version(m)}" for m in ("torch", "triton", "transformers"))
    cuda = device.type == "cuda"
    cap = f", memory capped at {args.memory_cap_gb:g} GB" if args.memory_cap_gb else ""
    peak_kind = (
        "CUDA memory allocated by the timed steps on top of their inputs "
        "(`grpo_fast.obs.memory.peak_cuda_memory`); absolute: `max_memory_allocated` (weights, "
        "gradients, optimizer state included)"
        if cuda
        else "tensor memory allocated by the profiled steps on top of their inputs "
        "(torch.profiler memory events)"
    )
    lines = [
        f"# Profile of one optimization step: preset `{args.preset}`",
        "",
        f"- device: {device_name(device)}{cap}",
        f"- versions: {versions}" + (f", CUDA {torch.version.cuda}" if cuda else ""),
        f"- date: {time.strftime('%Y-%m-%d %H:%M:%S %Z')}",
        f"- command: `{args.command}`",
        f"- time / step: median of {args.steps} step(s) outside the profiler, after one warm-up step",
        f"- peak memory: {peak_kind}",
        "",
        "| path | backend | time / step | tokens/s | peak memory | absolute peak "
        "| [n, V] logits, largest microbatch | trace | top ops |",
        "|---|---|---:|---:|---:|---:|---:|---|---|",
    ]
    for r in rows:
        logits = fmt_bytes(r["logits_bytes"])
        if "oom" in r:
            lines.append(f"| {r['path']} | {r['backend']} | OOM | | | | {logits} | | |")
            continue
        absolute = fmt_bytes(r["absolute_peak_bytes"]) if cuda else "n/a"
        lines.append(
            f"| {r['path']} | {r['backend']} | {r['step_s'] * 1e3:.1f} ms | {r['tokens'] / r['step_s']:,.0f} | "
            f"{fmt_bytes(r['peak_bytes'])} | {absolute} | {logits} | `{r['trace']}` | `{r['table']}` |"
        )
    fused, eager = rows
    if "oom" not in fused and "oom" not in eager:
        lines += [
            "",
            f"Eager / fused: time × {eager['step_s'] / fused['step_s']:.2f}, "
            f"peak memory × {eager['peak_bytes'] / max(fused['peak_bytes'], 1):.2f}.",
        ]
    for r in rows:
        if "oom" in r:
            lines += ["", f"{r['path']}: out of memory ({r['oom']})."]
            continue
        lines += ["", f"Top {TOP_OPS_IN_SUMMARY} ops of {r['path']} by {r['sort_by']} (ms per step):", ""]
        lines += [f"- `{key}`: {ms:.2f}" for key, ms in r["top_ops"]]
    return "\n".join(lines) + "\n"


@cli_errors
def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    args.command = " ".join(["python tools/profile.py", *(sys.argv[1:] if argv is None else argv)])
    device = torch.device(args.device)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    cap = args.memory_cap_gb * 1e9 if args.memory_cap_gb else None
    rows = []
    model = None
    for name, backend in (("fused", "auto"), ("eager", "eager")):
        if cap is not None:
            with memory_cap(device, cap):
                row = profile_path(args, name, backend, device, out, model)
        else:
            row = profile_path(args, name, backend, device, out, model)
        model = row.pop("model")  # the second path profiles the same weights
        rows.append(row)
    text = summary_markdown(args, device, rows)
    (out / "summary.md").write_text(text)
    (out / "summary.json").write_text(json.dumps({"command": args.command, "rows": rows}, indent=2) + "\n")
    print(text)
    print(
        f"wrote {out}/: summary.md, summary.json, "
        + ", ".join(f"{r['trace']}, {r['table']}" for r in rows if "trace" in r)
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
