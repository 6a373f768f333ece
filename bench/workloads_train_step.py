"""Workloads and measurement helpers of the training-step benchmarks (not collected by pytest).

Shared by ``bench/test_bench_train_step.py`` (the whole step and its optimization phase, GPU and
CPU), ``bench/test_bench_step_options.py`` (the CPU step under one option each) and
``tools/profile.py`` (which profiles ``OptimizationPhase``): the model configs and constants, the
synthetic rollout batches, ``OptimizationPhase`` and ``TinyTrainStep``, the builders
``grpo_fast.obs.memory.peak_rss_growth`` rebuilds in a fresh process, and ``_describe``, which
writes a case's ``benchmark.extra_info``.
"""

from __future__ import annotations

import contextlib
import gc
import importlib
import importlib.util
import os
import platform
import shlex
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast import dist
from grpo_fast.algo.course import compute_group_normalized_rewards
from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import Config, load_config, shares_prompts
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.optimization import optimize_on_rollout
from grpo_fast.loop.state import Trainer
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import build_policy_loss
from grpo_fast.policy.model import autocast_dtype, load_policy, load_tokenizer
from grpo_fast.rollout import BackendContext, Rollout, SamplingParams, make_backend
from grpo_fast.task.loader import load_task
from grpo_fast.tools import plan

GPU_ARCH = "Qwen/Qwen2.5-Math-1.5B"
CARD_BYTES = 24e9  # an RTX 4090
QWEN_EOS_ID = 151643  # <|endoftext|>: Qwen2.5's EOS and pad token

# GPU optimization phase: 4 prompts × group 8 = 32 of the preset's 256 responses per step, prompts of
# 200 tokens, responses of random lengths in [64, 1,024] (one at 1,024). Each microbatch is the
# preset's (2 sequences of ≤ 1,224 tokens), so the peak memory is the preset's and the time is ≈ 1/8
# of a full optimization phase (≈ 23 k tokens).
GPU_TRAIN_PROMPTS = 4
GPU_PROMPT_TOKENS = 200
GPU_MIN_RESPONSE_TOKENS = 64
GPU_TRAIN_ROUNDS = 3
# GPU rollout: 16 prompts × 8 = 128 sequences in one generate call, 200 prompt tokens + 256 sampled
# (a quarter of the preset's 1,024, to keep the GPU set to a few minutes; random weights almost
# never sample EOS, so every response runs to max_tokens).
GPU_ROLLOUT_PROMPTS = 16
GPU_ROLLOUT_MAX_TOKENS = 256
GPU_ROLLOUT_ROUNDS = 2

# CPU: the tiny preset's own batch (rollout.batch_size responses of 1 to rollout.max_tokens tokens);
# its prompts ("37+45=") are 6 tokens.
TINY_PROMPT_TOKENS = 6
CPU_ROUNDS = 10
# Environment variables that change what a run measures, recorded as part of its command.
COMMAND_ENV = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "CUDA_VISIBLE_DEVICES", "PYTORCH_CUDA_ALLOC_CONF")


# ----------------------------------------------------------------------------------------------
# Workloads (also driven by tools/profile.py)
# ----------------------------------------------------------------------------------------------


@dataclass
class RolloutBatch:
    """What the optimization phase consumes. P prompts, R = P·G responses (response i answers
    prompt i // G).

    Fields: ``prompt_ids`` ``[P]`` and ``response_ids`` ``[R]`` lists of token ids;
    ``advantages`` ``[R]`` fp32.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    advantages: torch.Tensor

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        assert r % len(self.prompt_ids) == 0, f"{len(self.prompt_ids)} prompts, {r} responses"
        assert self.advantages.shape == (r,), f"advantages must be [{r}], got {tuple(self.advantages.shape)}"

    @property
    def response_tokens(self) -> int:
        return sum(len(x) for x in self.response_ids)

    @property
    def tokens(self) -> int:
        """Tokens through the model: every response with its prompt (as ``throughput/tokens_per_s``)."""
        g = len(self.response_ids) // len(self.prompt_ids)
        return self.response_tokens + g * sum(len(p) for p in self.prompt_ids)


def random_prompts(n: int, length: int, vocab: int, seed: int = 0) -> list[list[int]]:
    """``n`` prompts of ``length`` token ids uniform in ``[0, vocab)``."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (length,), generator=g).tolist() for _ in range(n)]


def synthetic_rollout(
    n_prompts: int,
    group_size: int,
    prompt_tokens: int,
    max_tokens: int,
    vocab: int,
    min_tokens: int = 1,
    seed: int = 0,
) -> RolloutBatch:
    """Random token ids: prompts of ``prompt_tokens``, responses of lengths uniform in
    ``[min_tokens, max_tokens]`` with the first at ``max_tokens`` (so the longest microbatch is the
    preset's), advantages ``randn``."""
    g = torch.Generator().manual_seed(seed + 1)
    r = n_prompts * group_size
    lengths = torch.randint(min_tokens, max_tokens + 1, (r,), generator=g)
    lengths[0] = max_tokens
    responses = [torch.randint(0, vocab, (int(n),), generator=g).tolist() for n in lengths]
    prompts = random_prompts(n_prompts, prompt_tokens, vocab, seed)
    return RolloutBatch(prompts, responses, torch.randn(r, generator=g))


class OptimizationPhase:
    """The optimization phase of ``grpo_fast.train`` on a fixed rollout batch, on one process:
    on-policy (π_old is never computed, as with the presets' ``epochs_per_rollout_batch=1``), β =
    ``loss.beta`` (0 in every preset: no reference model).

    ``__call__`` runs what the loop runs: ``loss_trajectories`` → ``make_microbatches`` →
    ``.to(device)`` → ``grpo_fast.train.optimize_on_rollout`` (per microbatch ``PolicyLoss`` +
    backward, ``clip_grad_norm_``, ``optimizer.step()``, the grad-norm sync), and returns the
    gradient norm. It then drops the gradients (the loop does so at the start of the next step), so
    every call starts and ends in the same state and a repeated call measures the same peak.
    """

    def __init__(self, cfg: Config, model: torch.nn.Module, device: torch.device, pad_id: int):
        self.cfg, self.model, self.device, self.pad_id = cfg, model, device, pad_id
        self.amp = autocast_dtype(cfg, device)
        self.policy = build_policy_loss(cfg, model, self.amp)  # as grpo_fast.train builds it
        self.optimizer = build_optimizer(cfg, model.parameters())
        self.params = [p for p in model.parameters() if p.requires_grad]

    def logits_bytes(self, batch: RolloutBatch) -> int:
        """Bytes of the ``[n, V]`` logits of the largest microbatch in the autocast (else weight)
        dtype: what the eager path materializes and the fused path never does."""
        n = max(int(mb.labels.numel()) for mb in self._microbatches(batch, on_device=False))
        head = self.model.get_output_embeddings().weight
        return n * head.shape[0] * (self.amp or head.dtype).itemsize

    def _microbatches(self, batch: RolloutBatch, on_device: bool = True):
        cfg = self.cfg
        lengths = [len(x) for x in batch.response_ids]
        seqs = loss_trajectories(
            Rollout(batch.prompt_ids, batch.response_ids),
            advantages=batch.advantages,
            length_norm=cfg.loss.length_norm,
            max_length=cfg.rollout.max_tokens,
            num_sequences=len(lengths),
            num_tokens=sum(lengths),
        )
        mbs = make_microbatches(
            seqs,
            int(cfg.train.micro_batch_size),
            self.pad_id,
            cfg.train.packing,
            share_prompts=shares_prompts(cfg),
        )
        return [mb.to(self.device) for mb in mbs] if on_device else mbs

    def __call__(self, batch: RolloutBatch) -> float:
        cfg = self.cfg
        trainer = Trainer(self.policy, self.optimizer, self.params, cfg, dist.DistInfo(), self.device)
        stats = optimize_on_rollout(
            trainer,
            self._microbatches(batch),
            options=cfg.loss.loss_options(),
            temperature=cfg.rollout.temperature,
        )
        self.optimizer.zero_grad(set_to_none=True)
        return stats.grad_norm  # read with .item(): a host-device sync that ends the timed region

    def release(self) -> None:
        """Drop gradients and cached blocks after an out-of-memory error (outside any timed region)."""
        self.optimizer.zero_grad(set_to_none=True)
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()


def preset_config(preset: str, backend: str, *overrides: str) -> Config:
    """``preset`` with ``loss.kernel_backend=backend`` and the hf rollout backend (no vLLM here)."""
    return load_config(
        preset,
        overrides=[f"loss.kernel_backend={backend}", "rollout.backend=hf", *overrides],
        check_device=False,
    )


def random_init_policy(cfg: Config, device: torch.device) -> torch.nn.Module:
    """A random-init model of ``KNOWN_ARCHS[GPU_ARCH]``, set up by ``load_policy`` exactly as a
    pretrained one (fp32 master weights, attention implementation, gradient checkpointing, train
    mode), built directly on ``device``."""
    from transformers import Qwen2Config

    a = plan.KNOWN_ARCHS[GPU_ARCH]
    config = Qwen2Config(
        vocab_size=a.vocab,
        hidden_size=a.hidden,
        intermediate_size=a.intermediate,
        num_hidden_layers=a.layers,
        num_attention_heads=a.heads,
        num_key_value_heads=a.kv_heads,
        tie_word_embeddings=a.tie_embeddings,
        bos_token_id=QWEN_EOS_ID,
        eos_token_id=QWEN_EOS_ID,
        pad_token_id=QWEN_EOS_ID,
    )
    return load_policy(cfg, None, device, hf_config=config)


def optimization_workload(
    preset: str,
    backend: str,
    device: torch.device,
    model: torch.nn.Module | None = None,
    overrides: tuple[str, ...] = (),
) -> tuple[OptimizationPhase, RolloutBatch]:
    """``preset``'s optimization phase with ``loss.kernel_backend=backend``, on ``device``.

    ``tiny``: its built-in model and its whole rollout batch (``rollout.batch_size`` responses).
    A GPU preset: a random-init ``GPU_ARCH`` (or ``model``, to share one) and ``GPU_TRAIN_PROMPTS``
    prompts × its group size.
    """
    cfg = preset_config(preset, backend, *overrides)
    if cfg.model.name_or_path.startswith("builtin:"):
        tokenizer = load_tokenizer(cfg.model.name_or_path)
        model = load_policy(cfg, tokenizer, device) if model is None else model
        pad_id, n_prompts, prompt_tokens, min_tokens = tokenizer.pad_token_id, None, TINY_PROMPT_TOKENS, 1
    else:
        model = random_init_policy(cfg, device) if model is None else model
        pad_id, n_prompts, prompt_tokens, min_tokens = (
            QWEN_EOS_ID,
            GPU_TRAIN_PROMPTS,
            GPU_PROMPT_TOKENS,
            GPU_MIN_RESPONSE_TOKENS,
        )
    cfg = plan.resolve_auto(cfg, model.config, device)
    r = cfg.rollout
    batch = synthetic_rollout(
        n_prompts or r.batch_size // r.group_size,
        r.group_size,
        prompt_tokens,
        r.max_tokens,
        model.config.vocab_size,
        min_tokens=min_tokens,
    )
    return OptimizationPhase(cfg, model, device, pad_id), batch


class TinyTrainStep:
    """One whole ``tiny`` step as ``grpo_fast.train`` runs it: sample prompts → generate (hf) →
    rewards → group advantages → optimization phase, from the random-init model (no SFT warm
    start: the time of a step does not depend on what the model knows). ``__call__`` returns the
    phase times (s) and the tokens through the model."""

    def __init__(self, backend: str = "torch_chunked"):
        cfg = preset_config("tiny", backend)
        device = torch.device("cpu")
        self.tokenizer = load_tokenizer(cfg.model.name_or_path)
        self.task = load_task(cfg, self.tokenizer)
        model = load_policy(cfg, self.tokenizer, device)
        self.cfg = cfg = plan.resolve_auto(cfg, model.config, device)
        self.backend = make_backend(
            BackendContext(cfg, model, self.tokenizer, device, autocast_dtype(cfg, device))
        )
        self.sampler = PromptSampler(len(self.task.train), cfg.seed)
        self.phase = OptimizationPhase(cfg, model, device, self.tokenizer.pad_token_id)

    def __call__(self) -> dict[str, float]:
        cfg, r = self.cfg, self.cfg.rollout
        t0 = time.perf_counter()
        examples = [self.task.train[i] for i in self.sampler.next(r.batch_size // r.group_size)]
        params = SamplingParams(
            n=r.group_size,
            temperature=r.temperature,
            top_p=r.top_p,
            max_tokens=r.max_tokens,
            min_tokens=r.min_tokens,
            stop=tuple(self.task.stop),
        )
        rollout = self.backend.generate([self.task.prompt_ids(e) for e in examples], params)
        gts = [e.answer for e in examples for _ in range(r.group_size)]
        advantages, _, _ = compute_group_normalized_rewards(
            self.task.reward_fn,
            rollout.response_text,
            gts,
            r.group_size,
            cfg.loss.advantage_eps,
            scale_rewards=cfg.loss.scale_rewards,
        )
        t1 = time.perf_counter()
        batch = RolloutBatch(rollout.prompt_ids, rollout.response_ids, advantages)
        self.phase(batch)
        return {"rollout_s": t1 - t0, "train_s": time.perf_counter() - t1, "tokens": batch.tokens}


# Builders for grpo_fast.obs.memory.peak_rss_growth (top-level: they run in a spawned process).


def build_optimization_step(preset: str, backend: str) -> Callable[[], float]:
    phase, batch = optimization_workload(preset, backend, torch.device("cpu"))
    return lambda: phase(batch)


def build_tiny_train_step() -> Callable[[], dict[str, float]]:
    return TinyTrainStep()


# Prompt-heavy (as real GRPO work is: a prompt shared by its group, 2/3 of each sequence): a random
# Qwen2 of 4 layers, D = 512, V = 32,768, tied (bench/peers' prompt-heavy case), 8 prompts of 128
# tokens × 8 responses of exactly 64, microbatches of 16 responses (two whole groups).
PROMPT_HEAVY = dict(prompts=8, group=8, prompt_tokens=128, response_tokens=64, micro_batch=16)
# Long responses after the prompt, as an R1-Zero step has them (there ~150-token prompts, responses of
# hundreds of tokens): the same model, 2 prompts of 128 tokens × 8 responses of 128-384 tokens,
# microbatches of 8 (one group). Here sharing the prompt saves least and a dense [L, L] mask over
# [prompt, r_1 … r_8] would cost most (2,176² against the unshared 8 · 384² query-key pairs).
LONG_RESPONSES = dict(
    prompts=2, group=8, prompt_tokens=128, response_tokens=384, min_tokens=128, micro_batch=8
)
SHARE_PROMPTS_WORKLOADS = {"prompt128": PROMPT_HEAVY, "long": LONG_RESPONSES}


def share_prompts_workload(
    workload: str, share: bool, mixed_precision: str = "no"
) -> tuple[OptimizationPhase, RolloutBatch]:
    """The optimization phase with ``train.share_prompts=share`` on ``workload``: ``tiny`` (the
    preset's model and batch, 6-token prompts), ``prompt128`` (``PROMPT_HEAVY``) or ``long``
    (``LONG_RESPONSES``); fp32 weights, ``train.mixed_precision=mixed_precision`` (the tiny
    preset's ``no``: fp32 throughout)."""
    device = torch.device("cpu")
    flag = f"train.share_prompts={str(share).lower()}"
    precision = f"train.mixed_precision={mixed_precision}"
    if workload == "tiny":
        return optimization_workload("tiny", "torch_chunked", device, overrides=(flag, precision))
    from bench.peers.workloads import wide_config

    w = SHARE_PROMPTS_WORKLOADS[workload]
    overrides = (
        flag,
        precision,
        f"rollout.group_size={w['group']}",
        f"rollout.batch_size={w['prompts'] * w['group']}",
        f"rollout.max_tokens={w['response_tokens']}",
        f"train.micro_batch_size={w['micro_batch']}",
    )
    cfg = preset_config("tiny", "torch_chunked", *overrides)
    # the wide peer cases' model at 4 layers; positions for the longest sequence (128 + 384)
    config = wide_config(layers=4, max_positions=1024)
    torch.manual_seed(0)
    model = load_policy(cfg, None, device, hf_config=config)
    cfg = plan.resolve_auto(cfg, model.config, device)
    batch = synthetic_rollout(
        w["prompts"],
        w["group"],
        w["prompt_tokens"],
        w["response_tokens"],
        config.vocab_size,
        min_tokens=w.get("min_tokens", w["response_tokens"]),
    )
    return OptimizationPhase(cfg, model, device, pad_id=0), batch


def build_share_prompts_step(workload: str, share: bool, mixed_precision: str = "no") -> Callable[[], float]:
    phase, batch = share_prompts_workload(workload, share, mixed_precision)
    return lambda: phase(batch)


# ----------------------------------------------------------------------------------------------
# Measurement helpers
# ----------------------------------------------------------------------------------------------


def version(module: str) -> str | None:
    try:
        return importlib.import_module(module).__version__
    except ImportError:
        return None


def device_name(device: torch.device) -> str:
    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    model = platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        model = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), model)
    return f"{model} CPU, {os.cpu_count()} cores, {torch.get_num_threads()} torch threads"


def _median(benchmark) -> float | None:
    """The median round time, or None under ``--benchmark-disable`` (one untimed call)."""
    return benchmark.stats.stats.median if benchmark.stats else None


def _per_s(count: int, seconds: float | None) -> float | None:
    return None if not seconds else count / seconds


def _describe(benchmark, request, device: torch.device, **info) -> None:
    """``extra_info``: what ran where (device, versions, the exact command), plus the numbers ``info``."""
    args = shlex.join(request.config.invocation_params.args)
    env = " ".join(f"{k}={os.environ[k]}" for k in COMMAND_ENV if k in os.environ)
    benchmark.extra_info.update(
        device=device_name(device),
        # other work on the machine shows here (a 2-core CPU at load 5 is 2.5x oversubscribed)
        load_average_1m=os.getloadavg()[0],
        cpu_count=os.cpu_count(),
        versions={m: version(m) for m in ("torch", "triton", "transformers", "bitsandbytes")}
        | {"cuda": torch.version.cuda},
        command=f"{env} python -m pytest {args}".strip(),
        **info,
    )


@contextlib.contextmanager
def memory_cap(device: torch.device, cap_bytes: float):
    """Cap this process's CUDA caching allocator at ``cap_bytes`` (restored to the whole card after)."""
    total = torch.cuda.get_device_properties(device).total_memory
    torch.cuda.set_per_process_memory_fraction(min(1.0, cap_bytes / total), device)
    try:
        yield total
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0, device)
