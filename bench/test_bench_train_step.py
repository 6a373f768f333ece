"""End-to-end benchmarks of one GRPO training step: the rollout phase and the optimization phase.

    python -m pytest bench/test_bench_train_step.py --benchmark-json OUT.json   # CPU set here
    python -m pytest -m gpu bench/test_bench_train_step.py                     # GPU set (CUDA)

GPU (``gpu`` mark, skipped without CUDA): the ``rtx4090`` preset with a random-init
Qwen2.5-Math-1.5B architecture (``grpo_fast.tools.plan.KNOWN_ARCHS``: no weights, no tokenizer), on a
card capped at 24 GB (``set_per_process_memory_fraction``) to stand in for an RTX 4090:

- rollout: transformers ``generate`` through ``grpo_fast.rollout.hf.HFBackend`` on random prompts;
- optimization: a synthetic rollout batch through ``loss_trajectories`` → ``make_microbatches`` →
  ``PolicyLoss`` → backward → grad clip → 8-bit AdamW step (gradient checkpointing, bf16 autocast),
  with the fused lm_head + loss (``loss.kernel_backend=triton``) and the eager reference (``eager``:
  ``[n, V]`` logits + ``grpo_fast.algo.core.eager_grpo_loss_from_logits``) at the same shapes. Eager may
  run out of memory under the cap: that is recorded as its result (``extra_info["status"] = "oom"``).

CPU: the same optimization phase on the ``tiny`` preset's model (fused = ``torch_chunked``, eager),
and one whole ``tiny`` step (rollout + optimization), with peak memory measured as resident-set
growth in a fresh process (``grpo_fast.obs.memory.peak_rss_growth``).
CPU cases that each measure one option of the step (``train.share_prompts``,
``train.mixed_precision``, ``loss.advantage``) are in ``bench/test_bench_step_options.py``; the
workloads and helpers both files use are in ``bench/workloads_train_step.py``.

Every number goes into ``benchmark.extra_info`` (see ``_describe``); ``tools/bench_report.py`` turns
the JSON into ``BENCHMARKS.md``. ``tools/profile.py`` profiles ``OptimizationPhase``
(``bench/workloads_train_step.py``).
"""

from __future__ import annotations

import gc

import pytest
import torch

from bench.workloads_train_step import (
    CARD_BYTES,
    CPU_ROUNDS,
    GPU_ARCH,
    GPU_MIN_RESPONSE_TOKENS,
    GPU_PROMPT_TOKENS,
    GPU_ROLLOUT_MAX_TOKENS,
    GPU_ROLLOUT_PROMPTS,
    GPU_ROLLOUT_ROUNDS,
    GPU_TRAIN_ROUNDS,
    QWEN_EOS_ID,
    TINY_PROMPT_TOKENS,
    TinyTrainStep,
    _describe,
    _median,
    _per_s,
    build_optimization_step,
    build_tiny_train_step,
    memory_cap,
    optimization_workload,
    preset_config,
    random_init_policy,
    random_prompts,
)
from grpo_fast.obs.memory import peak_cuda_memory, peak_rss_growth
from grpo_fast.policy.model import autocast_dtype
from grpo_fast.rollout import SamplingParams
from grpo_fast.rollout.hf import HFBackend


@pytest.fixture(scope="module")
def cuda_device():
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    return torch.device("cuda")


@pytest.fixture(scope="module")
def gpu_model(cuda_device):
    """One random-init 1.5B model shared by the GPU benchmarks (building it takes seconds)."""
    model = random_init_policy(preset_config("rtx4090", "triton"), cuda_device)
    yield model
    del model
    gc.collect()
    torch.cuda.empty_cache()


# ----------------------------------------------------------------------------------------------
# GPU benchmarks
# ----------------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.benchmark(group="train_step-gpu-optimization")
@pytest.mark.parametrize("backend", ["triton", "eager"])
def test_optimization_phase_gpu(benchmark, request, backend, cuda_device, gpu_model):
    pytest.importorskip("bitsandbytes", reason="the rtx4090 preset's 8-bit AdamW needs bitsandbytes")
    phase, batch = optimization_workload("rtx4090", backend, cuda_device, gpu_model)
    oom: list[str] = []

    def guarded() -> None:
        try:
            phase(batch)
        except torch.cuda.OutOfMemoryError as exc:
            oom.append(str(exc).splitlines()[0])
        if oom:
            phase.release()

    with memory_cap(cuda_device, CARD_BYTES) as total:
        guarded()  # warm-up (Triton autotuning, cuBLAS workspaces, optimizer state); also the OOM probe
        # Out of memory: time the failing attempt once, so the run is in the JSON with its status.
        rounds = 1 if oom else GPU_TRAIN_ROUNDS
        peak = peak_cuda_memory(lambda: benchmark.pedantic(guarded, rounds=rounds, iterations=1), cuda_device)
        absolute_peak = torch.cuda.max_memory_allocated(cuda_device)
    cfg = phase.cfg
    _describe(
        benchmark,
        request,
        cuda_device,
        impl=backend,
        case=(
            f"{GPU_ARCH} random init, rtx4090 preset: {len(batch.response_ids)} seqs of {GPU_PROMPT_TOKENS} + "
            f"[{GPU_MIN_RESPONSE_TOKENS}, {cfg.rollout.max_tokens}] tokens, micro-batch {cfg.train.micro_batch_size}"
        ),
        phase="optimization",
        status="oom" if oom else "ok",
        error=oom[0] if oom else None,
        memory_cap_bytes=CARD_BYTES,
        card_bytes=total,
        peak_memory_bytes=peak,  # gradients + activations + loss, on top of weights and optimizer state
        absolute_peak_memory_bytes=absolute_peak,
        logits_bytes=phase.logits_bytes(batch),
        tokens=batch.tokens,
        response_tokens=batch.response_tokens,
        tokens_per_s=None if oom else _per_s(batch.tokens, _median(benchmark)),
        optimizer=cfg.train.optimizer,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        autocast=str(phase.amp),
    )


class _IdsOnlyTokenizer:
    """What ``HFBackend`` needs of a tokenizer when only token ids matter: pad/EOS ids and a
    ``batch_decode`` (empty texts: no stop strings, no rewards)."""

    def __init__(self, eos_id: int):
        self.pad_token_id = self.eos_token_id = eos_id

    def batch_decode(self, ids: list[list[int]], skip_special_tokens: bool = True) -> list[str]:
        return [""] * len(ids)


@pytest.mark.gpu
@pytest.mark.benchmark(group="train_step-gpu-rollout")
def test_rollout_phase_gpu(benchmark, request, cuda_device, gpu_model):
    cfg = preset_config("rtx4090", "triton")
    r = cfg.rollout
    n_seqs = GPU_ROLLOUT_PROMPTS * r.group_size
    amp = autocast_dtype(cfg, cuda_device)
    backend = HFBackend(gpu_model, _IdsOnlyTokenizer(QWEN_EOS_ID), n_seqs, autocast_dtype=amp)
    prompts = random_prompts(GPU_ROLLOUT_PROMPTS, GPU_PROMPT_TOKENS, gpu_model.config.vocab_size, seed=1)
    sampling = dict(n=r.group_size, temperature=r.temperature, top_p=r.top_p, min_tokens=0)
    params = SamplingParams(max_tokens=GPU_ROLLOUT_MAX_TOKENS, **sampling)
    generated: list[int] = []

    def generate() -> None:
        # ends with a host-device sync: HFBackend copies the sampled ids to Python lists
        generated.append(backend.generate(prompts, params).num_response_tokens)

    with memory_cap(cuda_device, CARD_BYTES) as total:
        backend.generate(prompts, SamplingParams(max_tokens=8, **sampling))  # warm-up
        peak = peak_cuda_memory(lambda: benchmark.pedantic(generate, rounds=GPU_ROLLOUT_ROUNDS, iterations=1))
        absolute_peak = torch.cuda.max_memory_allocated(cuda_device)
    response_tokens = generated[-1]
    tokens = response_tokens + n_seqs * GPU_PROMPT_TOKENS
    _describe(
        benchmark,
        request,
        cuda_device,
        impl="hf_generate",
        case=(
            f"{GPU_ARCH} random init, rtx4090 preset: {GPU_ROLLOUT_PROMPTS} prompts × {r.group_size} of "
            f"{GPU_PROMPT_TOKENS} + ≤ {GPU_ROLLOUT_MAX_TOKENS} tokens, one generate call, {amp} autocast"
        ),
        phase="rollout",
        status="ok",
        memory_cap_bytes=CARD_BYTES,
        card_bytes=total,
        peak_memory_bytes=peak,  # KV cache + activations, on top of the weights
        absolute_peak_memory_bytes=absolute_peak,
        tokens=tokens,
        response_tokens=response_tokens,
        tokens_per_s=_per_s(tokens, _median(benchmark)),
        response_tokens_per_s=_per_s(response_tokens, _median(benchmark)),
    )


# ----------------------------------------------------------------------------------------------
# CPU benchmarks
# ----------------------------------------------------------------------------------------------


@pytest.mark.benchmark(group="train_step-cpu-optimization")
@pytest.mark.parametrize("backend", ["torch_chunked", "eager"])
def test_optimization_phase_tiny_cpu(benchmark, request, backend):
    phase, batch = optimization_workload("tiny", backend, torch.device("cpu"))
    phase(batch)  # warm-up: optimizer state, thread pools
    benchmark.pedantic(phase, args=(batch,), rounds=CPU_ROUNDS, iterations=1)
    cfg = phase.cfg
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=backend,
        case=(
            f"tiny preset model: {len(batch.response_ids)} seqs of {TINY_PROMPT_TOKENS} + "
            f"[1, {cfg.rollout.max_tokens}] tokens, micro-batch {cfg.train.micro_batch_size}"
        ),
        phase="optimization",
        status="ok",
        peak_memory_bytes=peak_rss_growth(build_optimization_step, "tiny", backend),
        logits_bytes=phase.logits_bytes(batch),
        tokens=batch.tokens,
        response_tokens=batch.response_tokens,
        tokens_per_s=_per_s(batch.tokens, _median(benchmark)),
        optimizer=cfg.train.optimizer,
    )


@pytest.mark.benchmark(group="train_step-cpu-full")
def test_train_step_tiny_cpu(benchmark, request):
    step = TinyTrainStep()
    step()  # warm-up
    rounds: list[dict[str, float]] = []
    benchmark.pedantic(lambda: rounds.append(step()), rounds=CPU_ROUNDS, iterations=1)
    median = lambda key: sorted(x[key] for x in rounds)[len(rounds) // 2]
    cfg = step.cfg
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=cfg.loss.kernel_backend,
        case=(
            f"tiny preset: {cfg.rollout.batch_size // cfg.rollout.group_size} prompts × {cfg.rollout.group_size}, "
            f"hf generate of ≤ {cfg.rollout.max_tokens} tokens, rewards, then the optimization phase"
        ),
        phase="rollout+optimization",
        status="ok",
        peak_memory_bytes=peak_rss_growth(build_tiny_train_step),
        rollout_s=median("rollout_s"),
        train_s=median("train_s"),
        tokens=median("tokens"),
        tokens_per_s=_per_s(
            sum(x["tokens"] for x in rounds), sum(x["rollout_s"] + x["train_s"] for x in rounds)
        ),
    )
