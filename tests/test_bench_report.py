"""tools/bench_report.py on synthetic pytest-benchmark JSON: ratios, memory over logits, GB/s, run
metadata, generated notes, OOM rows, CLI errors; and BENCHMARKS.md is what it generates from
bench/results/."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("bench_report", ROOT / "tools" / "bench_report.py")
bench_report = importlib.util.module_from_spec(_spec)
sys.modules["bench_report"] = bench_report  # its dataclasses look the module up while they are built
_spec.loader.exec_module(bench_report)

DATE = "2026-11-30T09:00:00+00:00"


def bench(test: str, param_impl: str | None, median: float, *, iqr=0.0, rounds=5, group=None, **info):
    """One pytest-benchmark entry, as ``--benchmark-json`` writes it (the fields the report reads);
    ``param_impl``: the ``impl`` parameter (with ``n=512, v=1000``), or None for no parameters."""
    file, func = test.split("::")
    params = {"impl": param_impl, "n": 512, "v": 1000} if param_impl else {}
    param = "-".join(str(v) for v in params.values())
    name = f"{func}[{param}]" if params else func
    return {
        "group": group,
        "name": name,
        "fullname": f"{file}::{name}",
        "params": params or None,
        "param": param or None,
        "extra_info": info,
        "options": {},
        "stats": {"median": median, "iqr": iqr, "rounds": rounds, "mean": median, "min": median},
    }


def report_file(
    tmp_path: Path, benchmarks: list[dict], name: str = "run.json", date: str = DATE, **top
) -> Path:
    data = {
        "machine_info": {"python_version": "3.11.7", "cpu": {"brand_raw": "Test CPU"}},
        "commit_info": {"id": "0123456789abcdef0123", "dirty": True},
        "benchmarks": benchmarks,
        "datetime": date,
        "version": "5.3.1",
        **top,
    }
    path = tmp_path / name
    path.write_text(json.dumps(data))
    return path


def table_rows(text: str, heading: str) -> list[list[str]]:
    """The cells of the markdown table under ``### heading``."""
    lines = text.split(f"### {heading}\n\n", 1)[1].splitlines()
    rows = lines[: next((i for i, ln in enumerate(lines) if not ln.startswith("|")), len(lines))]
    header = [c.strip() for c in rows[0].strip("|").split("|")]
    return [header] + [[c.strip() for c in r.strip("|").split("|")] for r in rows[2:]]


def column(rows: list[list[str]], name: str) -> list[str]:
    i = rows[0].index(name)
    return [r[i] for r in rows[1:]]


def render(*paths: Path) -> str:
    return bench_report.render([bench_report.load_run(p) for p in paths], "python tools/bench_report.py X")


def test_speedups_against_eager_and_compile(tmp_path):
    # eager 4 ms, compiled 2 ms, torch_chunked 1 ms on one case:
    # × eager = 4/median → 1.00, 2.00, 4.00; × compile = 2/median → 0.50, 1.00, 2.00
    path = report_file(
        tmp_path,
        [
            bench("bench/test_bench_op.py::test_cpu", "eager", 4e-3),
            bench("bench/test_bench_op.py::test_cpu", "compiled", 2e-3),
            bench("bench/test_bench_op.py::test_cpu", "torch_chunked", 1e-3),
        ],
    )
    rows = table_rows(render(path), "op · test_cpu")
    assert column(rows, "impl") == ["eager", "compiled", "**torch_chunked**"]
    assert column(rows, "time (median)") == ["4 ms", "2 ms", "1 ms"]
    assert column(rows, "× eager") == ["1.00×", "2.00×", "4.00×"]
    assert column(rows, "× compile") == ["0.50×", "1.00×", "2.00×"]
    assert column(rows, "case") == ["n=512, v=1000"] * 3


def test_peak_memory_over_the_logits(tmp_path):
    # CPU case, fp32: 512 · 1000 · 4 B = 2.05 MB of logits; a 6.144 MB peak is 3.00× that.
    # CUDA case (test function ending in "gpu"), bf16: 512 · 1000 · 2 B = 1.02 MB; 2.048 MB -> 2.00×.
    # extra_info["dtype"] wins: float16 on the CPU, 1.02 MB; 3.072 MB -> 3.00×.
    # extra_info["logits_bytes"] wins over everything: 4 MB; 1 MB -> 0.25×.
    path = report_file(
        tmp_path,
        [
            bench("bench/test_bench_a.py::test_cpu", "eager", 1e-3, peak_memory_bytes=6_144_000),
            bench("bench/test_bench_b.py::test_gpu", "eager", 1e-3, peak_memory_bytes=2_048_000),
            bench(
                "bench/test_bench_c.py::test_cpu",
                "eager",
                1e-3,
                peak_memory_bytes=3_072_000,
                dtype="torch.float16",
            ),
            bench("bench/test_bench_d.py::test_cpu", "eager", 1e-3, peak_memory_bytes=1e6, logits_bytes=4e6),
        ],
    )
    text = render(path)
    for heading, logits, ratio in [
        ("a · test_cpu", "2.05 MB", "3.00×"),
        ("b · test_gpu", "1.02 MB", "2.00×"),
        ("c · test_cpu", "1.02 MB", "3.00×"),
        ("d · test_cpu", "4 MB", "0.25×"),
    ]:
        rows = table_rows(text, heading)
        assert column(rows, "[N, V] logits") == [logits], heading
        assert column(rows, "peak / logits") == [ratio], heading


def test_gpu_bandwidth_columns_and_header(tmp_path):
    env = {
        "device": "NVIDIA H200, 141 GB, 132 SMs",
        "versions": {"torch": "2.13.0", "triton": "3.9.0", "cuda": "12.8"},
        "copy_gb_per_s": 4123.4,
        "commands": ["python -m pytest -m gpu bench/test_bench_op.py --benchmark-json=x.json"],
    }
    path = report_file(
        tmp_path,
        [
            bench(
                "bench/test_bench_op.py::test_gpu",
                "triton",
                1e-3,
                gb_per_s=3000.0,
                copy_fraction=0.75,
                tflops=410.2,
            )
        ],
        grpo_fast_env=env,
    )
    text = render(path)
    assert "## NVIDIA H200, 141 GB, 132 SMs — 2026-11-30 09:00 UTC" in text
    assert "- versions: torch 2.13.0, triton 3.9.0, CUDA 12.8" in text
    assert "- measured copy bandwidth: 4,123 GB/s" in text
    assert "- command: `python -m pytest -m gpu bench/test_bench_op.py --benchmark-json=x.json`" in text
    rows = table_rows(text, "op · test_gpu")
    assert column(rows, "GB/s") == ["3,000"]
    assert column(rows, "of copy BW") == ["75%"]
    assert column(rows, "TFLOP/s") == ["410"]


def test_metadata_from_extra_info_and_what_is_missing(tmp_path):
    info = dict(
        device="Test CPU, 2 cores, 2 torch threads",
        versions={"torch": "2.13.0+cpu", "triton": "3.9.0", "cuda": None, "transformers": "5.24.0"},
        command="python -m pytest bench/ --benchmark-json bench/results/cpu.json",
    )
    text = render(report_file(tmp_path, [bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3, **info)]))
    assert "## Test CPU, 2 cores, 2 torch threads — 2026-11-30 09:00 UTC" in text
    assert "- versions: torch 2.13.0+cpu, triton 3.9.0, CUDA none, transformers 5.24.0" in text
    assert "- python 3.11.7, commit 0123456789ab (uncommitted changes)" in text
    assert "- command: `python -m pytest bench/ --benchmark-json bench/results/cpu.json`" in text

    bare = render(
        report_file(tmp_path, [bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3)], "bare.json")
    )
    assert "## Test CPU (CPU) — " in bare  # machine_info's CPU when no case names its device
    assert "- versions: torch not recorded, triton not recorded, CUDA not recorded" in bare
    assert "- command: `not recorded`" in bare


def test_notes_say_when_the_machine_was_shared_and_noisy(tmp_path):
    # load 5.0 on 2 cores > 0.75 per core; spreads 10 % (quiet) and 50 % (> 25 %: noisy)
    shared = dict(load_average_1m=5.0, cpu_count=2)
    path = report_file(
        tmp_path,
        [
            bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3, iqr=1e-4, **shared),
            bench("bench/test_bench_op.py::test_cpu", "torch_chunked", 1e-3, iqr=5e-4, **shared),
        ],
    )
    text = render(path)
    assert "load average up to 5.0 on 2 cores" in text
    assert (
        "1 of 2 cases have a spread (IQR / median) over 25%, up to 50% (op · test_cpu, torch_chunked" in text
    )

    quiet = [
        bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3, iqr=1e-4, load_average_1m=0.3, cpu_count=2)
    ]
    assert "Notes:" not in render(report_file(tmp_path, quiet, "quiet.json"))


def test_out_of_memory_row_is_a_result(tmp_path):
    group = "train_step-gpu-optimization"
    path = report_file(
        tmp_path,
        [
            bench(
                "bench/test_bench_train_step.py::test_optimization_phase_gpu",
                None,
                2.0,
                group=group,
                impl="triton",
                status="ok",
                peak_memory_bytes=4e9,
                absolute_peak_memory_bytes=20e9,
                logits_bytes=0.6e9,
                tokens_per_s=12000.0,
            ),
            bench(
                "bench/test_bench_train_step.py::test_optimization_phase_gpu",
                None,
                0.5,
                group=group,
                rounds=1,
                impl="eager",
                status="oom",
                error="CUDA out of memory. Tried to allocate 1.16 GiB",
                peak_memory_bytes=6e9,
                absolute_peak_memory_bytes=24e9,
                logits_bytes=0.6e9,
            ),
        ],
    )
    text = render(path)
    rows = table_rows(text, group)
    assert column(rows, "impl") == ["**triton**", "eager"]
    assert column(rows, "status") == ["", "OOM"]
    assert column(rows, "time (median)") == ["2 s", "—"]
    assert "× eager" not in rows[0]  # no eager time to compare with: the column is left out
    assert column(rows, "absolute peak") == ["20 GB", "24 GB"]
    assert column(rows, "tokens/s") == ["12,000", ""]
    assert "TFLOP/s" not in rows[0]
    assert "eager: OOM — CUDA out of memory. Tried to allocate 1.16 GiB." in text


def test_runs_newest_first_and_the_cli(tmp_path, capsys):
    old = report_file(
        tmp_path,
        [bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3)],
        "old.json",
        date="2026-11-01T00:00:00+00:00",
    )
    new = report_file(tmp_path, [bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3)], "new.json")
    out = tmp_path / "B.md"
    assert bench_report.main([str(old), str(new), "--out", str(out)]) == 0
    text = out.read_text()
    assert text.index("2026-11-30") < text.index("2026-11-01")
    assert f"Generated by `python tools/bench_report.py {old} {new} --out {out}`" in text

    broken = tmp_path / "broken.json"
    broken.write_text(json.dumps({"rows": []}))
    assert bench_report.main([str(broken)]) == 2
    assert "broken.json: not pytest-benchmark JSON" in capsys.readouterr().err


def test_benchmarks_md_is_generated_from_bench_results(monkeypatch):
    """BENCHMARKS.md must be exactly what `python tools/bench_report.py bench/results/*.json` writes."""
    monkeypatch.chdir(ROOT)
    files = sorted(Path("bench/results").glob("*.json"))
    if not files:
        pytest.skip("no committed results in bench/results/")
    command = " ".join(["python tools/bench_report.py", *(f.as_posix() for f in files)])
    expected = bench_report.render([bench_report.load_run(f) for f in files], command)
    assert Path("BENCHMARKS.md").read_text() == expected, (
        f"BENCHMARKS.md is stale: regenerate it with `{command}`"
    )


def peer_entry(kind: str, impls: list[dict], group: str, **extra) -> dict:
    """A bench/peers/ case: one benchmark whose extra_info holds both tools' figures."""
    entry = bench(
        f"bench/peers/test_bench_{group}.py::test_{group}_cpu",
        None,
        1.0,
        group=f"peers-{group}",
        load_average_1m=5.0,
        cpu_count=2,
        device="Test CPU (2 cores)",
        versions={"torch": "2.13.0", "trl": "1.16.0"},
        command="python -m pytest bench/peers",
        peer_comparison={"kind": kind, "case": f"{group} case", "rounds": 3, "impls": impls, **extra},
    )
    return entry


def peer_table(section: str, heading: str) -> list[list[str]]:
    """The cells of the first markdown table after ``### heading`` (a peer case lists its run first)."""
    after = section.split(f"### {heading}\n", 1)[1]
    return table_rows("### T\n\n" + after[after.index("\n|") + 1 :], "T")


def test_peer_comparison_section_says_where_grpo_fast_is_not_ahead(tmp_path):
    # TRL: step 2.0 s vs ours 1.0 s → grpo_fast 2.00× faster; rollout 0.51 s vs 0.5 s → 1.02× < 1.05:
    # not ahead; train 1.49 s vs 0.5 s → 2.98×; memory 4 GB vs 1 GB → grpo_fast 0.25× of it.
    step = peer_entry(
        "train_step",
        [
            {
                "impl": "grpo_fast",
                "ours": True,
                "step_s": 1.0,
                "rollout_s": 0.5,
                "train_s": 0.5,
                "peak_memory_bytes": 1e9,
                "reward_last5": 0.4,
                "reward_after_steps": 45,
                "eval_accuracy_before": 0.25,
                "eval_accuracy_after": 0.3,
                "top_ops": {"rollout": [["aten::addmm", 0.2]], "train": [["aten::mm", 0.3]]},
                "gemm_floor_s": 0.8,
            },
            {
                "impl": "trl",
                "version": "1.16.0",
                "step_s": 2.0,
                "rollout_s": 0.51,
                "train_s": 1.49,
                "peak_memory_bytes": 4e9,
                "reward_last5": 0.41,
                "reward_after_steps": 45,
                "eval_accuracy_before": 0.25,
                "eval_accuracy_after": 0.31,
                "top_ops": {"rollout": [], "train": [["aten::_log_softmax", 0.9]]},
            },
        ],
        "train_step",
        warmup_steps=2,
        memory="RSS growth of one step",
    )
    # Liger: 3.0 s vs ours 2.5 s → 1.20× faster; 230 MB vs 220 MB → ours/theirs 1.05: not ahead.
    loss = peer_entry(
        "loss_op",
        [
            {"impl": "grpo_fast", "ours": True, "entropy": True, "time_s": 2.5, "peak_memory_bytes": 2.3e8},
            {"impl": "grpo_fast_chunk256", "entropy": True, "time_s": 2.6, "peak_memory_bytes": 1.1e8},
            {
                "impl": "liger",
                "entropy": False,
                "time_s": 3.0,
                "peak_memory_bytes": 2.2e8,
                "what": "GRPO loss",
            },
        ],
        "loss",
        logits_bytes=5.5e8,
    )
    text = render(
        report_file(tmp_path, [step, loss, bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3)])
    )
    section = text.split("## Compared with other tools", 1)[1].split("\n## ", 1)[0]
    rows = peer_table(section, "Whole GRPO step: train_step case")
    assert column(rows, "tool") == ["**grpo_fast**", "trl"]
    assert column(rows, "step (median)") == ["1 s", "2 s (grpo_fast 2.00× faster)"]
    assert column(rows, "rollout")[1] == "510 ms (**not ahead**: grpo_fast 1.02× faster)"
    assert column(rows, "train")[1] == "1.49 s (grpo_fast 2.98× faster)"
    assert column(rows, "peak memory") == ["1 GB", "4 GB (grpo_fast 0.25× of it)"]
    assert column(rows, "eval accuracy before → after") == ["0.250 → 0.300", "0.250 → 0.310"]
    assert column(rows, "reward, last 5 steps")[0] == "0.400 (after 45 steps)"
    assert "- trl, train: `aten::_log_softmax` 900 ms" in section
    # the step's GEMM floor (0.8 s): ours 1.25× it; TRL 2.50× it, so 3× TRL (0.667 s) is below it
    assert (
        "timed on this machine): 800 ms; grpo_fast's step is 1.25× it; trl's step is 2.50× it, so 3× trl "
        "would need a step of 667 ms (below the floor)"
    ) in section
    assert "1-minute load average up to 5.0 on 2 cores (shared with other work)" in section
    assert "3 rounds, after 2 warm-up steps of each; peak memory: RSS growth of one step" in section

    rows = peer_table(section, "Fused lm_head + GRPO loss: loss case")
    assert column(rows, "entropy") == ["yes", "yes", "no"]
    # another configuration of grpo_fast is shown as it is, not compared with grpo_fast
    assert column(rows, "time (median)") == ["2.5 s", "2.6 s", "3 s (grpo_fast 1.20× faster)"]
    assert column(rows, "peak memory")[2] == "220 MB (**not ahead**: grpo_fast 1.05× of it)"
    assert column(rows, "peak / logits") == ["0.42×", "0.20×", "0.40×"]
    # the peer cases stay out of the run's own tables; the other case is still there
    assert "### peers-" not in text and "### op · test_cpu" in text
    # a run without CPU times or a GEMM floor shows no such columns
    assert not {"CPU time (median)", "× GEMM floor", "CPU × GEMM floor"} & set(rows[0])


def test_pipeline_comparison_section_compares_each_variant_with_lockstep(tmp_path):
    """bench/test_bench_pipeline.py's rows: their own section, the step ratio to the first row's
    (0.40 s / 0.25 s = 1.60×), the eval gain, the wait shares, the per-round steps and loads."""
    impl = lambda name, step, **kw: {
        "impl": name,
        "ours": name == "lockstep, colocated",
        "step_s": step,
        "grpo_wall_s": step * 500,
        "eval_before": 0.21,
        "eval_after": 0.6,
        "trainer_wait_share": kw.get("tw"),
        "producer_wait_share": kw.get("pw"),
        "weight_sync_s": kw.get("sync"),
        "policy_lag_max": kw.get("lag", 0.0),
        "logprob_gap_mean": kw.get("gap"),
        "logprob_gap_max": kw.get("gap_max"),
        "step_s_rounds": [step, step],
        "load_1m_rounds": [1.2, 1.4],
    }
    entry = bench(
        "bench/test_bench_pipeline.py::test_pipeline",
        None,
        100.0,
        rounds=1,
        load_average_1m=1.4,
        cpu_count=2,
        torch_threads=2,
        versions={"torch": "2.13.0"},
        command="python -m pytest bench/test_bench_pipeline.py",
        pipeline_comparison={
            "kind": "pipeline",
            "case": "tiny preset",
            "rounds": 2,
            "impls": [
                impl("lockstep, colocated", 0.4),
                impl(
                    "staleness 1, process",
                    0.25,
                    tw=0.1,
                    pw=0.45,
                    sync=0.002,
                    lag=1.0,
                    gap=0.012,
                    gap_max=0.05,
                ),
            ],
        },
    )
    text = render(report_file(tmp_path, [entry, bench("bench/test_bench_op.py::test_cpu", "eager", 1e-3)]))
    section = text.split("## Generation apart from training", 1)[1].split("\n## ", 1)[0]
    rows = peer_table(section, "Whole runs: tiny preset")
    assert column(rows, "variant") == ["**lockstep, colocated**", "staleness 1, process"]
    assert column(rows, "× lockstep") == ["1.00×", "1.60×"]
    assert column(rows, "eval before → after") == ["0.210 → 0.600 (+0.390)"] * 2
    assert column(rows, "trainer waited") == ["", "10%"] and column(rows, "producer waited") == ["", "45%"]
    assert column(rows, "weight sync / step") == ["", "2 ms"]
    assert column(rows, "policy lag (max)") == ["0", "1"]
    assert column(rows, "log-prob gap, mean (max)") == ["", "0.012 (0.05)"]
    assert column(rows, "step per round")[1] == "250 ms, 250 ms"
    assert column(rows, "load per round")[0] == "1.2, 1.4"
    assert "2 round(s) of every variant, 2 torch threads by default on 2 cores" in section
    assert "### pipeline" not in text and "### op · test_cpu" in text


def test_loss_op_table_shows_cpu_time_and_gemm_floor_where_recorded(tmp_path):
    # wall time over the floor's 2.0 s: 1.25×, 1.50×; CPU time: liger 4.0 s vs ours 2.0 s → grpo_fast
    # 2.00× faster, over the floor's 1.6 s: 1.25×, 2.50×;
    # the floor has no peak of its own (None) and no comparison with grpo_fast (it is grpo_fast's)
    loss = peer_entry(
        "loss_op",
        [
            {
                "impl": "grpo_fast",
                "ours": True,
                "time_s": 2.5,
                "cpu_time_s": 2.0,
                "time_over_gemm_floor": 1.25,
                "cpu_time_over_gemm_floor": 1.25,
                "peak_memory_bytes": 1e8,
            },
            {
                "impl": "liger",
                "time_s": 3.0,
                "cpu_time_s": 4.0,
                "time_over_gemm_floor": 1.5,
                "cpu_time_over_gemm_floor": 2.5,
                "peak_memory_bytes": 2e8,
            },
            {
                "impl": "grpo_fast_gemm_floor",
                "time_s": 2.0,
                "cpu_time_s": 1.6,
                "time_over_gemm_floor": 1.0,
                "cpu_time_over_gemm_floor": 1.0,
                "peak_memory_bytes": None,
            },
        ],
        "loss",
        logits_bytes=5e8,
    )
    section = render(report_file(tmp_path, [loss])).split("## Compared with other tools", 1)[1]
    rows = peer_table(section, "Fused lm_head + GRPO loss: loss case")
    assert column(rows, "CPU time (median)") == ["2 s", "4 s (grpo_fast 2.00× faster)", "1.6 s"]
    assert column(rows, "× GEMM floor") == ["1.25×", "1.50×", "1.00×"]
    assert column(rows, "CPU × GEMM floor") == ["1.25×", "2.50×", "1.00×"]
    assert column(rows, "peak memory") == ["100 MB", "200 MB (grpo_fast 0.50× of it)", ""]
    assert column(rows, "peak / logits") == ["0.20×", "0.40×", ""]
