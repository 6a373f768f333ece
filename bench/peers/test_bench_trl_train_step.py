"""One whole GRPO step, grpo_fast against TRL's ``GRPOTrainer``, alternating in one process.

    pip install -e ".[dev,peers]"          # in its own environment (see README: Compared with other tools)
    python -m pytest bench/peers/test_bench_trl_train_step.py --benchmark-json OUT.json
    python -m pytest -m gpu bench/peers/test_bench_trl_train_step.py     # CUDA (skipped without one)

What runs on each side, and what is made equal, is in ``bench/peers/workloads.py``. Per case:
``warmup_steps`` untimed steps of each, then ``rounds`` rounds of one step of each (the order flips
every round, so a load spike on the shared machine hits both alike), then one step of each for
peak memory (CPU: resident-set growth of the step after ``gc`` + ``malloc_trim``; CUDA:
``max_memory_allocated`` over the step), then one profiled step of each (``torch.profiler``: self
CPU time by op, split into the rollout and train phases). grpo_fast's row also carries its step's
GEMM floor (``workloads.gemm_rates``: the matmuls of the step's generation and update alone, at
their shapes, timed on this machine; the median over the timed steps). The benchmark's own rounds time the
pair; each tool's medians are in ``extra_info["peer_comparison"]``, which ``tools/bench_report.py``
turns into the "Compared with other tools" section of ``BENCHMARKS.md``.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import gc
import os
import shlex

import pytest
import torch
from torch._C._profiler import _ExperimentalConfig
from torch.profiler import ProfilerActivity, profile, record_function

from bench.peers.duel import ComputeThread, OnThread, TRLStepper
from bench.peers.workloads import (
    LONG_RESPONSES,
    PROMPT_HEAVY,
    TINY,
    VERSIONS,
    WIDE,
    GrpoFastStepper,
    Problem,
    dist_version,
    gemm_floor_s,
    gemm_rates,
    greedy_accuracy,
    make_problem,
    median,
    summarize,
)
from bench.workloads_train_step import COMMAND_ENV, device_name
from grpo_fast.obs.memory import peak_cuda_memory, process_peak_bytes, reset_process_peak

PEERS_MISSING = (
    "needs the peers extra: pip install -e '.[dev,peers]' in its own environment "
    "(trl and liger-kernel; TRL may pin another transformers)"
)
ROLLOUT_SCOPE = "peer/rollout"
TOP_OPS = 6


def _rss_bytes() -> int:
    with open("/proc/self/status") as f:
        return next(int(ln.split()[1]) * 1024 for ln in f if ln.startswith("VmRSS:"))


def _release_free_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # freed heap pages of every thread's arena back to the OS


def peak_step_memory(stepper, device: torch.device) -> int:
    """Memory one step of ``stepper`` touches on top of what is alive before it."""
    if device.type == "cuda":
        return peak_cuda_memory(stepper.step, device)
    _release_free_memory()
    reset_process_peak()
    before = _rss_bytes()
    stepper.step()
    return process_peak_bytes() - before


def profiled_step(stepper, device: torch.device) -> dict[str, list[list]]:
    """Self time (s) of the top ops of one step, per phase: ``rollout`` (under ``ROLLOUT_SCOPE``)
    and ``train`` (the rest). On CUDA, self device time."""
    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if device.type == "cuda" else [])
    # the steps run on the duel's compute thread (ComputeThread): without profile_all_threads
    # (torch ≥ 2.6, experimental) only this thread's ops would be recorded
    everywhere = _ExperimentalConfig(profile_all_threads=True)
    with profile(activities=activities, experimental_config=everywhere) as prof:
        stepper.step()
    totals: dict[str, dict[str, float]] = {"rollout": {}, "train": {}}
    for evt in prof.events():
        if evt.name == ROLLOUT_SCOPE or evt.name.startswith("ProfilerStep"):
            continue
        parent, phase = evt.cpu_parent, "train"
        while parent is not None:
            if parent.name == ROLLOUT_SCOPE:
                phase = "rollout"
                break
            parent = parent.cpu_parent
        self_us = evt.self_device_time_total if device.type == "cuda" else evt.self_cpu_time_total
        totals[phase][evt.name] = totals[phase].get(evt.name, 0.0) + self_us / 1e6
    return {
        phase: [[name, round(s, 4)] for name, s in sorted(ops.items(), key=lambda kv: -kv[1])[:TOP_OPS]]
        for phase, ops in totals.items()
    }


def _mark_rollout(stepper) -> None:
    """Put each side's rollout phase under ``ROLLOUT_SCOPE`` for the profiler."""
    if isinstance(stepper, OnThread):
        generate = stepper.backend.generate

        def scoped(*args, **kwargs):
            with record_function(ROLLOUT_SCOPE):
                return generate(*args, **kwargs)

        stepper.backend.generate = scoped
    else:
        rollout = stepper.trainer._generate_and_score_completions

        def scoped_trl(inputs):
            with record_function(ROLLOUT_SCOPE):
                return rollout(inputs)

        stepper.trainer._generate_and_score_completions = scoped_trl


def run_duel(benchmark, request, case_name: str, device: torch.device) -> None:
    """The duel on one ``ComputeThread`` (bench/peers/duel.py: both tools' compute, the warm
    start and the evaluations on one OS thread, as each tool's would be alone); this thread only
    orders the steps and times them."""
    compute = ComputeThread()
    try:
        _duel(benchmark, request, compute.run(make_problem, case_name), device, compute)
    finally:
        compute.close()


def _duel(benchmark, request, problem: Problem, device: torch.device, compute: ComputeThread) -> None:
    ours = OnThread(compute.run(GrpoFastStepper, problem, device), compute)
    trl = compute.run(TRLStepper, problem, device, compute)
    try:
        _timed_duel(benchmark, request, problem, device, compute, ours, trl)
    finally:
        trl.close()  # lets TRL's held loop run to its end (before the compute thread closes)


def _timed_duel(benchmark, request, problem: Problem, device, compute: ComputeThread, ours, trl) -> None:
    case = problem.case
    sides = [ours, trl]
    for s in sides:
        _mark_rollout(s)
    acc_before = compute.run(greedy_accuracy, ours.model, problem)
    loads = [os.getloadavg()[0]]
    order = lambda i: sides if i % 2 == 0 else sides[::-1]
    for i in range(case.warmup_steps):
        for s in order(i):
            s.step()
    counter = iter(range(case.warmup_steps, case.warmup_steps + case.rounds))

    def one_round() -> None:
        for s in order(next(counter)):
            s.step()

    benchmark.pedantic(one_round, rounds=case.rounds, iterations=1)
    loads.append(os.getloadavg()[0])
    timed = case.warmup_steps + case.rounds
    works = [r.work for r in ours.records[case.warmup_steps : timed]]
    rates = compute.run(gemm_rates, ours.model, works[-1].gen_batch, device)
    floor = {
        "gemm_floor_s": median([gemm_floor_s(w, rates) for w in works]),
        "gemm_rates_s_per_token": rates,
        "work_last": dataclasses.asdict(works[-1]),
    }
    peak = {s.name: peak_step_memory(s, device) for s in sides}
    top_ops = {s.name: profiled_step(s, device) for s in sides}
    trl.close()
    loads.append(os.getloadavg()[0])
    impls = []
    for s, pkg in ((ours, "grpo_fast"), (trl, "trl")):
        summary = summarize(s.records[:timed], case.warmup_steps)
        impls.append(
            {
                "impl": s.name,
                "ours": s is ours,
                "version": dist_version(pkg) if pkg != "grpo_fast" else _grpo_fast_version(),
                **summary,
                # reward after all the steps each side took (timed, memory and profiled ones)
                "reward_after_steps": len(s.records),
                "reward_last": s.records[-1].reward,
                "reward_last5": sum(r.reward for r in s.records[-5:]) / len(s.records[-5:]),
                "peak_memory_bytes": peak[s.name],
                "eval_accuracy_before": acc_before,
                "eval_accuracy_after": compute.run(greedy_accuracy, s.model, problem),
                "top_ops": top_ops[s.name],
                **(floor if s is ours else {}),
            }
        )
    args = shlex.join(request.config.invocation_params.args)
    env = " ".join(f"{k}={os.environ[k]}" for k in COMMAND_ENV if k in os.environ)
    benchmark.extra_info.update(
        impl="grpo_fast+trl",
        device=device_name(device),
        load_average_1m=max(loads),
        load_average_1m_all=loads,
        cpu_count=os.cpu_count(),
        versions={m: dist_version(m) for m in VERSIONS} | {"cuda": torch.version.cuda},
        command=f"{env} python -m pytest {args}".strip(),
        torch_threads=torch.get_num_threads(),
        case=case.describe,
        peer_comparison={
            "kind": "train_step",
            "case": case.describe,
            "memory": "max_memory_allocated over one step"
            if device.type == "cuda"
            else "RSS growth of one step",
            "warm_start_steps": problem.warm_start_steps,
            "warmup_steps": case.warmup_steps,
            "rounds": case.rounds,
            "impls": impls,
        },
    )


def _grpo_fast_version() -> str:
    import subprocess

    with contextlib.suppress(OSError, subprocess.CalledProcessError):
        sha = subprocess.check_output(["git", "rev-parse", "--short=12", "HEAD"], text=True).strip()
        return f"0.1.0 ({sha})"
    return "0.1.0"


@pytest.mark.benchmark(group="peers-train_step-cpu")
@pytest.mark.parametrize("case_name", [TINY.name, WIDE.name, PROMPT_HEAVY.name, LONG_RESPONSES.name])
def test_train_step_vs_trl_cpu(benchmark, request, case_name):
    pytest.importorskip("trl", reason=PEERS_MISSING)
    run_duel(benchmark, request, case_name, torch.device("cpu"))


@pytest.mark.gpu
@pytest.mark.benchmark(group="peers-train_step-gpu")
def test_train_step_vs_trl_gpu(benchmark, request):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("trl", reason=PEERS_MISSING)
    run_duel(benchmark, request, WIDE.name, torch.device("cuda"))
