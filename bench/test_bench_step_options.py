"""CPU benchmarks of the training step under one option each, on the optimization phase or the
loop's whole step (the workloads are ``bench/workloads_train_step.py``'s):

- ``train.share_prompts``: each prompt computed once for its group's responses, against a copy per
  response (the tiny preset's batch, ``prompt128``, ``long``);
- ``train.mixed_precision``: fp32 against bf16 autocast over the fp32 weights (the same workloads);
- ``loss.advantage``: the loop's whole tiny step under each advantage estimator;
- the optimizer step: torch's AdamW per tensor (a CPU's default), foreach and fused
  (``train.fused_optimizer=true``) on the tiny preset's model and bench/peers' wide one.

    python -m pytest bench/test_bench_step_options.py --benchmark-json OUT.json
    python -m pytest bench/test_bench_step_options.py -k mixed_precision    # one option

Peak memory is resident-set growth in a fresh process (``grpo_fast.obs.memory.peak_rss_growth``);
every number goes into ``benchmark.extra_info`` (``_describe``), which ``tools/bench_report.py``
turns into ``BENCHMARKS.md``. The whole step and its optimization phase with the presets' options
are in ``bench/test_bench_train_step.py``.
"""

from __future__ import annotations

import pytest
import torch

from bench.workloads_train_step import (
    CPU_ROUNDS,
    _describe,
    _median,
    _per_s,
    build_share_prompts_step,
    share_prompts_workload,
)
from grpo_fast.obs.memory import peak_rss_growth


@pytest.mark.benchmark(group="train_step-cpu-share_prompts")
@pytest.mark.parametrize("workload", ["tiny", "prompt128", "long"])
@pytest.mark.parametrize("impl", ["unshared", "shared"])
def test_optimization_phase_share_prompts_cpu(benchmark, request, workload, impl):
    """``train.share_prompts``: each prompt computed once for its group's responses, against each
    response carrying its own copy (the same gradients: tests/test_shared_prompts.py)."""
    phase, batch = share_prompts_workload(workload, impl == "shared")
    phase(batch)  # warm-up: optimizer state, thread pools
    # prompt128's and long's phases take seconds on 2 cores (12,288 / ~6,000 tokens, a 27 M model)
    rounds = CPU_ROUNDS if workload == "tiny" else 3
    benchmark.pedantic(phase, args=(batch,), rounds=rounds, iterations=1)
    cfg = phase.cfg
    prompt_tokens = len(batch.prompt_ids[0])
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=impl,
        case=(
            f"{workload}: {len(batch.prompt_ids)} prompts of {prompt_tokens} tokens × "
            f"{cfg.rollout.group_size} responses of ≤ {cfg.rollout.max_tokens}, micro-batch "
            f"{cfg.train.micro_batch_size}, torch_chunked"
        ),
        phase="optimization",
        status="ok",
        peak_memory_bytes=peak_rss_growth(build_share_prompts_step, workload, impl == "shared"),
        tokens=batch.tokens,
        response_tokens=batch.response_tokens,
        tokens_per_s=_per_s(batch.tokens, _median(benchmark)),
    )


@pytest.mark.benchmark(group="train_step-cpu-mixed_precision")
@pytest.mark.parametrize("workload", ["tiny", "prompt128", "long"])
@pytest.mark.parametrize("precision", ["no", "bf16"])
def test_optimization_phase_mixed_precision_cpu(benchmark, request, workload, precision):
    """``train.mixed_precision``: fp32 (``no``) against bf16 autocast over the fp32 weights, the
    prompts shared (the default). Whether this CPU computes bf16 natively
    (``grpo_fast.policy.model.cpu_computes_bf16``: what ``auto`` follows) is in the case's text;
    without it the bf16 rows measure torch's emulation."""
    from grpo_fast.policy.model import cpu_computes_bf16

    phase, batch = share_prompts_workload(workload, True, precision)
    phase(batch)  # warm-up: optimizer state, thread pools, the weights' bf16 casts
    rounds = CPU_ROUNDS if workload == "tiny" else 3
    benchmark.pedantic(phase, args=(batch,), rounds=rounds, iterations=1)
    cfg = phase.cfg
    native = cpu_computes_bf16() or "no native bf16"
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=precision,
        case=(
            f"{workload}: {len(batch.prompt_ids)} prompts of {len(batch.prompt_ids[0])} tokens × "
            f"{cfg.rollout.group_size} responses of ≤ {cfg.rollout.max_tokens}, micro-batch "
            f"{cfg.train.micro_batch_size}, train.mixed_precision={precision} (this CPU: {native})"
        ),
        phase="optimization",
        status="ok",
        peak_memory_bytes=peak_rss_growth(build_share_prompts_step, workload, True, precision),
        tokens=batch.tokens,
        response_tokens=batch.response_tokens,
        tokens_per_s=_per_s(batch.tokens, _median(benchmark)),
    )


ESTIMATORS = ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
ESTIMATOR_STEPS = 40  # the median step is over the last 30: the first ten warm the caches


@pytest.mark.benchmark(group="train_step-cpu-advantage")
@pytest.mark.parametrize("estimator", ESTIMATORS)
def test_loop_step_advantage_estimators_cpu(benchmark, request, tmp_path, estimator):
    """``loss.advantage``: the loop's whole step as a run takes it (rollout, the step's finalize
    with the estimator, the update; with ``gae`` the value head's no-grad pass and its loss), on the
    tiny preset from its random weights, every response trained (``train.skip_zero_advantage=false``:
    from random weights most groups score 0 and would be skipped), no evaluation or checkpoint:
    ``ESTIMATOR_STEPS`` steps of ``grpo_fast.train.main`` in this process, 2 runs. The time is a
    whole run's; the case text gives the median ``time/step_s`` of its last 30 steps (the
    estimators' step cost, which is what differs)."""
    import json

    from grpo_fast.train import main

    runs = []

    def run() -> None:
        out = tmp_path / f"run{len(runs)}"
        args = [
            "--preset", "tiny", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
            f"steps={ESTIMATOR_STEPS}", "train.skip_zero_advantage=false", "logging.progress=false",
            "logging.sample_every=0", f"loss.advantage={estimator}", f"output_dir={out}",
        ]  # fmt: skip
        assert main(args) == 0
        rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines()]
        runs.append([r["time/step_s"] for r in rows if r["step"] > 10 and "time/step_s" in r])

    benchmark.pedantic(run, rounds=2, iterations=1)
    steps = sorted(s for r in runs for s in r)
    median_ms = 1e3 * steps[len(steps) // 2]
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=estimator,
        case=(
            f"tiny preset from random weights, 32 prompts × 8 responses of ≤ 4 tokens, every response "
            f"trained, loss.advantage={estimator}: median step {median_ms:.1f} ms (steps 11-{ESTIMATOR_STEPS}, 2 runs)"
        ),
        phase="whole step",
        status="ok",
        step_median_s=median_ms / 1e3,
    )


@pytest.mark.benchmark(group="train_step-cpu-optimizer")
@pytest.mark.parametrize("model_name", ["tiny", "wide"])
@pytest.mark.parametrize("impl", ["per tensor", "foreach", "fused"])
def test_optimizer_step_cpu(benchmark, request, model_name, impl):
    """One AdamW step over every parameter (gradients set once), in each of torch's three forms;
    ``fused`` is what ``train.fused_optimizer=true`` builds. Each timed round follows
    an untimed step of the two other forms, so the three alternate in every row."""
    from grpo_fast.loop.optim import adamw
    from grpo_fast.task import tiny

    if model_name == "tiny":
        tok = tiny.build_tokenizer()
        model = tiny.build_model(tok, seed=0)
    else:
        from bench.peers.workloads import wide_model, wide_tokenizer

        model = wide_model(wide_tokenizer(), seed=0)
    params = [p for p in model.parameters() if p.requires_grad]
    for p in params:
        p.grad = torch.randn_like(p) * 1e-3
    hyper = dict(lr=1e-5, betas=(0.9, 0.99), weight_decay=0.01)
    forms = {
        "per tensor": torch.optim.AdamW(params, foreach=False, **hyper),
        "foreach": torch.optim.AdamW(params, foreach=True, **hyper),
        "fused": adamw(params, True, **hyper),
    }
    assert forms["fused"].param_groups[0]["fused"]  # train.fused_optimizer=true's form
    for opt in forms.values():
        opt.step()  # warm-up: the moments allocated
    others = [o for k, o in forms.items() if k != impl]
    rounds = CPU_ROUNDS if model_name == "tiny" else 5

    def step_the_others() -> None:  # pedantic takes a setup's return value as the arguments
        for o in others:
            o.step()

    benchmark.pedantic(forms[impl].step, setup=step_the_others, rounds=rounds, iterations=1)
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=impl,
        case=f"{model_name} model: {sum(p.numel() for p in params) / 1e6:.2f} M parameters, fp32, AdamW",
        phase="optimizer step",
        status="ok",
    )
