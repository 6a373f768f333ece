"""Configuration: frozen dataclasses hold every default and its domain once; presets, YAML files
and ``key=value`` overrides are layered on top, in that order.

    defaults (the dataclasses below)
      ← preset (``PRESETS[name]``: only what differs from the defaults)
      ← ``--config a.yaml --config b.yaml`` (later files win)
      ← ``key=value`` dot-list overrides (OmegaConf syntax: ``train.lr=3e-6``)

Each field is declared as ``option(default, domain)`` (``grpo_fast.domains``): ``validate``
(``grpo_fast.config_checks``) walks the table and names the first key out of its domain, then
checks the relations between keys.
``loss.*`` is ``LossConfig``, which extends ``LossOptions`` (``grpo_fast.algo.loss_options``):
the loss options' defaults and domains are written there, once. ``rollout.backend`` is one of
the backends the registry finds (``grpo_fast.rollout.registry``), each with its own checks.

``load_config`` validates the result and raises ``ConfigError`` with one line naming the key
at fault (an unknown key comes with the nearest valid name). ``"auto"`` values are resolved
at run time by the memory planner (``grpo_fast.tools.plan``) or by the device.
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml
from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from grpo_fast.algo.core import LENGTH_NORMS, SCALE_REWARDS
from grpo_fast.algo.difficulty import CURRICULA
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.sampler_correction import IS_LEVELS, IS_MODES
from grpo_fast.config_checks import validate
from grpo_fast.domains import AUTO, AutoOrBool, OneOf, Range, option
from grpo_fast.errors import ConfigError
from grpo_fast.ops._backend import BACKENDS as KERNEL_BACKENDS
from grpo_fast.rollout.registry import backends as rollout_backends

__all__ = ["AUTO", "PRESETS", "Config", "config_sources", "load_config", "presets_and_keys_help", "validate"]

_DTYPES = ("auto", "float32", "bfloat16", "float16")
_ANY = Range()  # any finite number
_NONNEG = Range(0)
_POSITIVE = Range(0, lo_open=True)


@dataclass(frozen=True)
class LoRAConfig:
    """``model.lora``: a LoRA adapter (peft) on a frozen base; the embeddings and the lm_head stay
    frozen. Off while ``r`` is 0."""

    r: int = option(0, Range(0, integer=True))  # the adapter's rank; 0 = off (full fine-tuning)
    alpha: float = option(16.0, Range(0, lo_open=True))  # the update is scaled by alpha / r
    dropout: float = option(0.0, Range(0, 1, hi_open=True))
    # "all-linear" (every linear layer of the decoder: attention and MLP projections) or a list
    # of module names (e.g. [q_proj, v_proj]); each must match a linear layer of the model
    target_modules: Any = "all-linear"
    # The adapter's learning rate is train.lr × lr_scale (the warm start's: sft.lr × lr_scale):
    # LoRA's best learning rate is about 10× full fine-tuning's, nearly whatever the rank
    # (Schulman et al. 2025, "LoRA Without Regret"), so a preset's lr carries over.
    lr_scale: float = option(10.0, _POSITIVE)


@dataclass(frozen=True)
class ModelConfig:
    name_or_path: str = "Qwen/Qwen2.5-Math-1.5B"
    # The dtype the trained weights are kept in; auto = float32 (master weights, with bf16
    # autocast on CUDA when train.mixed_precision=bf16).
    dtype: str = option(AUTO, OneOf(_DTYPES))
    # flash_attention_2 | sdpa | eager | auto (flash-attn 2 when installed on CUDA, else sdpa)
    attn_implementation: str = option(AUTO, OneOf(("auto", "flash_attention_2", "sdpa", "eager")))
    gradient_checkpointing: bool = False
    trust_remote_code: bool = False
    lora: LoRAConfig = field(default_factory=LoRAConfig)
    # QLoRA: the frozen base in 4-bit NF4 (bitsandbytes; on CUDA, and on CPU with bnb ≥ 0.50),
    # computing in the run's precision (bf16 under autocast, else fp32); needs model.lora.r > 0
    load_in_4bit: bool = False


@dataclass(frozen=True)
class DataConfig:
    task: str = option("math", OneOf(("math", "gsm8k", "tiny")))
    train_path: str | None = None  # local JSONL/Parquet; None = the task's hub dataset
    eval_path: str | None = None
    hub_name: str | None = None  # override the task's default hub dataset name
    question_field: str | None = None  # None = the task's default field names
    answer_field: str | None = None
    prompt_template: str = "r1_zero"  # r1_zero | question_only | a string holding {question}
    # A name in grpo_fast.task.rewards.REWARD_FNS, package.module:function, or auto (the task's own);
    # or a list of them: the reward is then Σ_k w_k·reward_k (grpo_fast.task.rewards.WeightedReward),
    # each part logged as train/reward/NAME.
    reward: str | list[str] = AUTO
    # One weight per data.reward entry (a list); None = every weight 1.
    reward_weights: list[float] | None = None
    # How a list of rewards makes the advantage: sum (normalize Σ_k w_k·reward_k within its group)
    # | normalize_each (GDPO: normalize each reward within its group, loss.scale_rewards as for the
    # sum, then Σ_k w_k·normalized_k; the shaping terms, overlong and KL, as one more reward of
    # weight 1). The same as sum with one reward and no shaping (grpo_fast.algo.core.normalize_each_reward).
    reward_aggregation: str = option("sum", OneOf(("sum", "normalize_each")))
    eval_subset_size: int = option(1024, _NONNEG)  # subset evaluated every eval_every steps (fixed seed)
    # A reward function that raises or returns a non-number: raise (stop the run, one line naming
    # the function, the exception and the response) | zero (score it 0, count train/reward_errors)
    reward_errors: str = option("raise", OneOf(("raise", "zero")))
    # DAPO's soft overlong punishment (grpo_fast.algo.core.overlong_penalty): over the last
    # overlong_buffer tokens before rollout.max_tokens the reward falls linearly from 0 to
    # −overlong_penalty (reached at max_tokens); added to the reward before the advantage. 0 = off.
    overlong_buffer: int = option(0, _NONNEG)
    overlong_penalty: float = option(1.0, _NONNEG)
    # The field holding a worked ground-truth solution (sft.mix_coef's target); None = the task's
    # default (math: solution; gsm8k: answer, the text before ####; tiny: the answer itself).
    solution_field: str | None = None
    # A field holding each problem's difficulty (MATH: level, "Level 3" → 3; lower = easier), which
    # rollout.curriculum=easy_first then uses instead of the pass rates; None = no such field.
    difficulty_field: str | None = None


@dataclass(frozen=True)
class RolloutConfig:
    # A backend of grpo_fast.rollout: hf (transformers generate) | vllm (colocated in-process engine)
    backend: str = option("hf", OneOf(tuple(rollout_backends())))
    group_size: int = option(
        8,
        Range(
            2,
            why=": GRPO's advantage is a response's reward against the others of its group, so a "
            "group of one never learns",
        ),
    )  # responses per prompt
    batch_size: int = option(256, _POSITIVE)  # responses per step (a multiple of group_size)
    temperature: float = option(1.0, _POSITIVE)
    top_p: float = option(1.0, Range(0, 1, lo_open=True))
    # top-k sampling: only the top_k most likely tokens (after the temperature, before top_p, as
    # vLLM and transformers apply them); 0 = off. The trainer's log-probs follow (loss.truncated_logprobs).
    top_k: int = option(0, Range(0, integer=True))
    max_tokens: int = option(1024, _POSITIVE)  # response tokens
    min_tokens: int = option(4, _NONNEG)
    max_prompt_tokens: int = option(512, _POSITIVE)  # longer prompts are left-truncated, with a warning
    # hf backend: prompts·group_size sequences per generate call
    generation_batch_size: int = option(64, _POSITIVE)
    eval_temperature: float = option(0.0, _NONNEG)  # 0 = greedy
    # vllm: fraction of the card, or auto (memory planner)
    gpu_memory_utilization: Any = option(AUTO, Range(0.05, 0.99, auto_ok=True))
    # vllm sleep mode during the training phase: 0 = stay awake, 1 = offload the weights to CPU
    # RAM, 2 = discard them (the next push refills them). Where the platform has no sleep mode
    # (CPU), the engine stays awake whatever the level, and says so once in the log.
    sleep_level: int = option(1, OneOf((0, 1, 2)))
    # After each weight push, vLLM's log-probs of a fixed probe sequence are compared with the
    # trainer's; a mean |Δ log p| above this stops the run. auto: 1e-3 when vLLM serves fp32,
    # 0.05 in bf16/fp16 (grpo_fast.rollout.vllm.WEIGHT_SYNC_TOLERANCE).
    weight_sync_tolerance: Any = option(AUTO, Range(0, auto_ok=True))
    # Truncated importance sampling against the sampler's log-probs (vllm): each token's loss is
    # weighted by ρ = exp(logp_trainer_old − logp_sampler), per token (is_level=token) or the
    # product over the response (sequence); ρ > is_cap is cut to is_cap (is_mode=truncate) or
    # its tokens get weight 0 (mask).
    is_correction: bool = False
    is_level: str = option("token", OneOf(IS_LEVELS))
    is_mode: str = option("truncate", OneOf(IS_MODES))
    is_cap: float = option(2.0, Range(1, lo_open=True))
    # π_old when train.epochs_per_rollout_batch > 1: trainer (a no-grad pass of the fused op over
    # the rollout batch) | sampler (the engine's log-probs: one forward pass saved per batch).
    old_logprobs: str = option("trainer", OneOf(("trainer", "sampler")))
    # DAPO dynamic sampling: groups whose rewards are all equal are dropped and more prompts are
    # generated until the step has batch_size responses from informative groups, for at most
    # max_sampling_rounds generation rounds (then it trains on what it has, and says so).
    dynamic_sampling: bool = False
    max_sampling_rounds: int = option(3, _POSITIVE)
    # [lo, hi]: after a prompt's first visit, skip it while its pass rate (grpo_fast.algo.difficulty)
    # is outside [lo, hi], e.g. [0.0, 0.9] drops the prompts already solved; None = off.
    difficulty_filter: list[float] | None = None
    # none | easy_first: each pass over the data goes from the easiest prompt to the hardest
    # (data.difficulty_field when set, else the pass rates; grpo_fast.algo.prompt_sampler) | paced:
    curriculum: str = option("none", OneOf(CURRICULA))
    # paced: each step draws at random from the easiest curriculum_start of the prompts (same
    # easiness), a share growing linearly to all of them over curriculum_steps steps (null: half
    # the run's steps), never a sort (grpo_fast.algo.difficulty.paced_quantile)
    curriculum_start: float = option(0.25, Range(0, 1, lo_open=True))
    curriculum_steps: int | None = option(None, Range(1, integer=True, none_ok=True))
    # Group size per prompt by its pass rate, between min_group_size (solved) and max_group_size
    # (never solved); unseen prompts get group_size; each step still has batch_size responses.
    adaptive_group_size: bool = False
    min_group_size: int = option(2, Range(2))
    max_group_size: int = 16  # at least min_group_size
    # With model.lora, what a backend with its own weights (vllm) gets after each step: adapter (the
    # adapter alone, served as a LoRA request) | merged (the adapter merged into a copy of the
    # base's affected weights, pushed as full weights: faster decoding, not with a 4-bit base)
    lora_sync: str = option("adapter", OneOf(("adapter", "merged")))
    # More keyword arguments for vllm.LLM, e.g. {enforce_eager: true, max_num_seqs: 128}; those
    # grpo_fast sets itself (grpo_fast.rollout.vllm.VLLM_MANAGED_ARGS) are refused.
    vllm_kwargs: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class TrainConfig:
    lr: float = option(1e-6, _NONNEG)
    # adamw | adamw8bit (bitsandbytes; also on CPU with bnb ≥ 0.50)
    optimizer: str = option("adamw", OneOf(("adamw", "adamw8bit")))
    betas: tuple[float, float] = (0.9, 0.999)  # two numbers in [0, 1)
    weight_decay: float = option(0.0, _NONNEG)
    warmup_steps: int = option(0, _NONNEG)
    # constant | linear | cosine (after warmup, to min_lr_ratio·lr)
    schedule: str = option("constant", OneOf(("constant", "linear", "cosine")))
    min_lr_ratio: float = option(0.0, Range(0, 1))
    grad_clip: float = option(1.0, _NONNEG)
    # sequences per microbatch, or auto (memory planner)
    micro_batch_size: Any = option(AUTO, Range(1, integer=True, auto_ok=True))
    epochs_per_rollout_batch: int = option(1, _POSITIVE)  # > 1 computes old log-probs and clips off-policy
    packing: bool = False  # padding-free packing of microbatches (flash-attn varlen / sdpa mask)
    # Each prompt computed once for all its responses in the training forward and backward (and the
    # π_old / π_ref passes): [prompt, r_1 … r_G] rows, the same gradients to fp32 summation order
    # (grpo_fast.policy.batch.shared_prompt_microbatches, policy/shared_attention.py); needs sdpa or
    # eager attention. auto: on, unless model.attn_implementation=flash_attention_2 (shares_prompts)
    share_prompts: bool | str = option(AUTO, AutoOrBool())
    # Skip the forward/backward of responses whose advantage is exactly 0 (groups whose rewards are
    # all equal) where the loss says their gradient is exactly 0 (LossOptions.zero_advantage_zero_gradient).
    skip_zero_advantage: bool = True
    mixed_precision: str = option(
        AUTO, OneOf(("auto", "bf16", "fp16", "no"))
    )  # auto: bf16 on CUDA, no on CPU
    # dtype of the final model in output_dir/final: auto (the trained weights' dtype) | float32
    # | bfloat16 | float16 (e.g. bfloat16 for serving: half the size of fp32 master weights)
    save_dtype: str = option(AUTO, OneOf(_DTYPES))
    # With model.lora: also write output_dir/final_merged, the adapter merged into the base
    # (Hugging Face format, train.save_dtype), for serving without peft
    save_merged: bool = False
    # A step whose loss or gradient norm is NaN/inf is not applied (optimizer step skipped, logged);
    # this many in a row stop the run (the checkpoint before them is intact).
    max_nonfinite_steps: int = option(3, _POSITIVE)
    # Under torchrun: ddp (every rank holds the whole model, gradients and AdamW state) | fsdp
    # (FSDP2, ZeRO-3-style: each holds 1/N of them; sharded checkpoints; grpo_fast.policy.fsdp)
    parallelism: str = option("ddp", OneOf(("ddp", "fsdp")))
    # With fsdp: the weight shards, their gradients and the optimizer step in CPU RAM (ZeRO-3 offload)
    fsdp_cpu_offload: bool = False


@dataclass(frozen=True)
class LossConfig(LossOptions):
    """``loss.*``: the loss options (``LossOptions``: type, clip_low, clip_high, dual_clip, delta,
    importance_sampling_level, top_entropy_quantile, beta, kl_estimator, entropy_coef; their
    defaults and domains live there), and the loop's loss settings below."""

    length_norm: str = option(
        "sequence_mean", OneOf(LENGTH_NORMS)
    )  # | constant (Dr. GRPO) | token_mean (DAPO)
    # true: responses that hit rollout.max_tokens get no loss at all and are not counted in the
    # length normalizers (DAPO's overlong filtering); their rewards still enter the group's advantage.
    mask_truncated: bool = False
    # true: β·KL enters the reward, not the loss (verl's use_kl_in_reward): each response's reward
    # loses β·Σ_t k1_t, k1 = log π − log π_ref on its sampled tokens, before the advantages (two
    # no-grad passes in the rollout phase, π and π_ref); the loss then has no KL term.
    kl_in_reward: bool = False
    # adaptive β (proportional controller) when set; per-token KL
    target_kl: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    # stop the inner epochs once KL(π_old‖π) exceeds this
    kl_early_stop: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    # Adaptive entropy coefficient when set (Skywork-OR1; TRL's use_adaptive_entropy): after each
    # step, loss.entropy_coef (the start value) rises by entropy_coef_step, up to entropy_coef_max,
    # while the step's mean token entropy is at or below entropy_target, and falls by it (down to
    # 0) above; the loss applies it only while the last step's entropy was at or below the target.
    entropy_target: float | None = option(None, Range(0, lo_open=True, none_ok=True))
    entropy_coef_max: float = option(1.0, _NONNEG)
    entropy_coef_step: float = option(0.005, _POSITIVE)
    scale_rewards: str = option("group", OneOf(SCALE_REWARDS))  # the advantage's std: group | batch | none
    advantage_eps: float = option(1e-6, _NONNEG)
    # The trainer's log-probs, entropies and gradients under truncated sampling (rollout.top_k > 0
    # or rollout.top_p < 1): those of the distribution the sampler drew from, log π(a) − log Σ_kept π
    # (true), or of the full vocabulary (false: what TRL and verl compute, off by the kept mass).
    # auto = true whenever the sampler truncates (grpo_fast.policy.loss.trainer_truncation).
    truncated_logprobs: bool | str = option(AUTO, AutoOrBool())
    kernel_backend: str = option(AUTO, OneOf(KERNEL_BACKENDS))  # auto | triton | torch_chunked | eager
    # rows of logits per lm_head chunk, or auto (memory budget)
    chunk_size: Any = option(AUTO, Range(1, integer=True, auto_ok=True))

    def __post_init__(self) -> None:
        """Checked by ``validate`` with the ``loss.`` prefix, with the rest of the config."""


# Keys that no longer exist -> what to write instead (a ConfigError says so).
_REPLACED_KEYS = {
    "loss.normalize_by_std": "use loss.scale_rewards=group (was true) or none (was false); batch is new",
}


@dataclass(frozen=True)
class SFTConfig:
    """An optional supervised warm start before GRPO, logged separately (``sft_metrics.jsonl``)."""

    steps: int = option(0, _NONNEG)  # the most SFT steps (0 = no warm start)
    lr: float = option(1e-3, _NONNEG)
    batch_size: int = option(64, _POSITIVE)
    # Stop early once greedy accuracy on check_size *training* problems reaches this (checked
    # every check_every steps); None = always run all steps.
    target_accuracy: float | None = option(None, Range(0, 1, lo_open=True, none_ok=True))
    check_every: int = option(10, _POSITIVE)
    check_size: int = option(200, _POSITIVE)
    # > 0: during GRPO, add mix_coef × the per-token-mean NLL of the step's prompts' ground-truth
    # solutions (data.solution_field) to the GRPO loss, logged separately; 0 = pure RL.
    mix_coef: float = option(0.0, _NONNEG)
    # Under model.lora, what the warm start trains: adapter (the adapter GRPO then goes on
    # training) | base (the whole model, frozen afterwards as the adapter's base and written to
    # output_dir/base; π_ref is then the warm-started policy) | auto: base for the built-in model,
    # whose warm start stands in for pretraining (random weights), adapter for any other.
    target: str = option(AUTO, OneOf(("auto", "adapter", "base")))

    def resolved_target(self, model_name: str) -> str:
        """``target`` with ``auto`` resolved for ``model.name_or_path``."""
        if self.target != AUTO:
            return self.target
        return "base" if model_name.startswith("builtin:") else "adapter"


@dataclass(frozen=True)
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "grpo_fast"
    # online | offline | auto (offline without WANDB_API_KEY) | disabled
    wandb_mode: str = option(AUTO, OneOf(("auto", "online", "offline", "disabled")))
    progress: bool = True  # rich progress bars per phase
    sample_every: int = option(10, _NONNEG)  # write samples/step_N.jsonl every N steps (0 = never)
    samples_per_dump: int = option(16, _NONNEG)


@dataclass(frozen=True)
class HealthConfig:
    enabled: bool = True
    auto_temperature: bool = False  # temporarily raise the temperature on repetition loops
    # Overrides of grpo_fast.obs.health.HealthThresholds fields (their defaults live there), e.g.
    # {entropy_warn_low: 0.1} for a task whose answers are short and nearly deterministic.
    thresholds: dict[str, float] = field(default_factory=dict)


@dataclass(frozen=True)
class Config:
    output_dir: str = "runs/grpo"
    seed: int = option(0, Range(0, 2**32 - 1, integer=True))  # numpy's seeds: 0 .. 2^32 - 1
    steps: int = option(200, _POSITIVE)
    eval_every: int = option(10, _NONNEG)  # subset evaluation (data.eval_subset_size problems); 0 = never
    full_eval_every: int = option(50, _NONNEG)  # the whole eval set; 0 = never
    checkpoint_every: int = option(50, _NONNEG)  # 0 = only the final model
    keep_checkpoints: int = option(2, _POSITIVE)
    # continue the run in output_dir from its latest checkpoint (the run-defining keys of
    # ON_RESUME must match its config.yaml)
    resume: bool = False
    # a fresh run into an output_dir that holds a run deletes that run's files first
    # (grpo_fast.obs.run_folder.RUN_FILES); without it such a run stops, naming what is there
    overwrite: bool = False
    device: str = AUTO  # auto | cpu | cuda | cuda:N
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    sft: SFTConfig = field(default_factory=SFTConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    health: HealthConfig = field(default_factory=HealthConfig)


# Presets hold only what differs from the defaults above.
PRESETS: dict[str, dict[str, Any]] = {
    # CPU, built-in model, tokenizer and task (grpo_fast.task.tiny): what a newcomer runs first.
    # Two-digit addition. An SFT warm start stops once the model solves 25% of training
    # problems (a "base model"); then 500 GRPO steps. Measured on 2 idle cores (seed 0, 2026-12-02):
    # greedy eval 0.21 → 0.62 in 51 s wall.
    "tiny": {
        "output_dir": "runs/tiny",
        "steps": 500,
        "eval_every": 25,
        "full_eval_every": 0,
        "checkpoint_every": 100,
        "device": "cpu",
        "model": {"name_or_path": "builtin:tiny", "dtype": "float32"},
        "data": {"task": "tiny", "prompt_template": "question_only", "eval_subset_size": 500},
        "rollout": {
            "group_size": 8,
            "batch_size": 256,
            "max_tokens": 4,
            "min_tokens": 0,
            "max_prompt_tokens": 16,
            "generation_batch_size": 256,
            # with rollout.backend=vllm: no torch.compile of the 0.4 M-parameter model (engine
            # start-up 9 s instead of 45 s on 2 busy cores; nothing to gain from compiling it)
            "vllm_kwargs": {"enforce_eager": True},
        },
        "train": {
            "lr": 2e-4,
            "warmup_steps": 10,
            "schedule": "cosine",
            "min_lr_ratio": 0.1,
            "micro_batch_size": 256,
            "mixed_precision": "no",
        },
        "sft": {"steps": 1000, "lr": 1e-3, "batch_size": 64, "target_accuracy": 0.25},
        "logging": {"sample_every": 50},
        # A 1-4 digit answer is nearly deterministic: its healthy entropy is far below an essay's.
        "health": {"thresholds": {"entropy_warn_low": 0.05, "entropy_healthy_low": 0.1}},
    },
    # A real model at ~1% of the cost: catches config mistakes before a long run.
    "smoke": {
        "output_dir": "runs/smoke",
        "steps": 3,
        "eval_every": 0,
        "full_eval_every": 0,
        "checkpoint_every": 0,
        "data": {"eval_subset_size": 16},
        "rollout": {"group_size": 2, "batch_size": 8, "max_tokens": 256},
        "train": {"micro_batch_size": 2},
    },
    # Qwen2.5-Math-1.5B on MATH within 24 GB: fp32 master weights + bf16 autocast, gradient
    # checkpointing, 8-bit AdamW, vLLM in sleep mode (its share from the planner). Microbatch 2
    # until a GPU measurement validates the planner's pick (9 at 1,536 tokens per sequence).
    "rtx4090": {
        "output_dir": "runs/rtx4090",
        "steps": 200,
        "device": "cuda",
        "model": {"gradient_checkpointing": True},
        "data": {"task": "math"},
        "rollout": {"backend": "vllm", "group_size": 8, "batch_size": 256, "max_tokens": 1024},
        "train": {"lr": 1e-6, "optimizer": "adamw8bit", "betas": [0.9, 0.95], "micro_batch_size": 2},
        "loss": {"length_norm": "sequence_mean"},
    },
    # An 80 GB card: larger microbatches, bf16, plain AdamW.
    "h100": {
        "output_dir": "runs/h100",
        "steps": 200,
        "device": "cuda",
        "model": {"gradient_checkpointing": True},
        "data": {"task": "math"},
        "rollout": {"backend": "vllm", "group_size": 8, "batch_size": 512, "max_tokens": 1024},
        "train": {"lr": 1e-6, "optimizer": "adamw", "betas": [0.9, 0.95], "micro_batch_size": AUTO},
    },
}

# Every key, by what ``resume=true`` may do with it (grpo_fast.obs.run_folder.check_resume):
# "run": it defines what the run's metrics mean (model, data, task, reward, sizes, seed, loss,
# rollout and warm-start options): a resume must keep the run's value, or it stops naming it;
# "safe": how long, how often, where, how fast, what is logged: a resume may change it, and
# config.yaml records the change. A new key goes in one of the two (tests/test_run_folder.py).
ON_RESUME: dict[str, tuple[str, ...]] = {
    "run": (
        "seed",
        *("model.name_or_path", "model.dtype", "model.load_in_4bit", "model.lora.r", "model.lora.alpha"),
        *("model.lora.dropout", "model.lora.target_modules", "model.lora.lr_scale"),
        *("data.task", "data.train_path", "data.eval_path", "data.hub_name", "data.question_field"),
        *("data.answer_field", "data.prompt_template", "data.reward", "data.reward_weights"),
        *("data.eval_subset_size", "data.reward_errors", "data.overlong_buffer", "data.overlong_penalty"),
        *("data.solution_field", "data.difficulty_field", "data.reward_aggregation"),
        *("rollout.backend", "rollout.group_size", "rollout.batch_size", "rollout.temperature"),
        *("rollout.top_p", "rollout.max_tokens", "rollout.min_tokens", "rollout.max_prompt_tokens"),
        *("rollout.eval_temperature", "rollout.is_correction", "rollout.is_level", "rollout.is_mode"),
        *("rollout.is_cap", "rollout.old_logprobs", "rollout.dynamic_sampling"),
        *("rollout.max_sampling_rounds", "rollout.difficulty_filter", "rollout.curriculum"),
        *("rollout.adaptive_group_size", "rollout.min_group_size", "rollout.max_group_size"),
        *("train.lr", "train.optimizer", "train.betas", "train.weight_decay", "train.warmup_steps"),
        *("train.schedule", "train.min_lr_ratio", "train.grad_clip", "train.epochs_per_rollout_batch"),
        *("train.skip_zero_advantage", "train.mixed_precision", "train.parallelism"),
        *(f"loss.{f.name}" for f in dataclasses.fields(LossOptions)),  # every loss option
        *("loss.length_norm", "loss.mask_truncated", "loss.kl_in_reward", "loss.target_kl"),
        *("loss.kl_early_stop", "loss.scale_rewards", "loss.advantage_eps", "loss.truncated_logprobs"),
        *("loss.entropy_target", "loss.entropy_coef_max", "loss.entropy_coef_step", "rollout.top_k"),
        *("rollout.curriculum_start", "rollout.curriculum_steps"),
        *("sft.steps", "sft.lr", "sft.batch_size", "sft.target_accuracy", "sft.check_every"),
        *("sft.check_size", "sft.mix_coef", "sft.target", "health.auto_temperature"),
    ),
    "safe": (
        *("output_dir", "steps", "eval_every", "full_eval_every", "checkpoint_every"),
        *("keep_checkpoints", "resume", "overwrite", "device"),
        *("model.attn_implementation", "model.gradient_checkpointing", "model.trust_remote_code"),
        *("rollout.generation_batch_size", "rollout.gpu_memory_utilization", "rollout.sleep_level"),
        *("rollout.weight_sync_tolerance", "rollout.lora_sync", "rollout.vllm_kwargs"),
        *("train.micro_batch_size", "train.packing", "train.share_prompts", "train.save_dtype"),
        "train.save_merged",
        *("train.max_nonfinite_steps", "train.fsdp_cpu_offload", "loss.kernel_backend", "loss.chunk_size"),
        *("logging.wandb", "logging.wandb_project", "logging.wandb_mode", "logging.progress"),
        *("logging.sample_every", "logging.samples_per_dump", "health.enabled", "health.thresholds"),
    ),
}

PRESET_SUMMARIES = {
    "tiny": "any CPU, first run: built-in model, tokenizer and task, SFT warm start, 500 steps",
    "smoke": "a real model before a long run: group 2, 8 responses, 3 steps",
    "rtx4090": "Qwen2.5-Math-1.5B on MATH in 24 GB: bf16 autocast, checkpointing, 8-bit AdamW, vLLM",
    "h100": "80 GB: bf16 autocast, plain AdamW, planner microbatch, 512 responses/step",
}


def presets_and_keys_help() -> str:
    """The presets and every config key by section (from the dataclasses: one source of truth)."""
    lines = ["presets (--preset):"]
    lines += [f"  {name:<9} {PRESET_SUMMARIES.get(name, '')}".rstrip() for name in PRESETS]
    lines += ["", "config keys (key=value, e.g. train.lr=3e-6; see grpo_fast/config.py):"]
    top = [f.name for f in dataclasses.fields(Config) if not dataclasses.is_dataclass(f.default_factory)]
    lines.append(f"  {'(top)':<9} {' '.join(top)}")
    for f in dataclasses.fields(Config):
        if dataclasses.is_dataclass(f.default_factory):
            names = [g.name for g in dataclasses.fields(f.default_factory)]
            lines.append(f"  {f.name:<9} {' '.join(names)}")
    return "\n".join(lines)


def _all_keys(cls: type = Config, prefix: str = "") -> list[str]:
    keys = []
    for f in dataclasses.fields(cls):
        name = f"{prefix}{f.name}"
        keys.append(name)
        if _is_section(f):
            keys.extend(_all_keys(type(f.default_factory()), name + "."))
    return keys


def _is_section(f: dataclasses.Field) -> bool:
    """A nested config section (a dataclass), as opposed to a plain field with a factory (a dict)."""
    return f.default_factory is not dataclasses.MISSING and dataclasses.is_dataclass(f.default_factory)


def _nearest(key: str) -> str:
    keys = _all_keys()
    leaf = key.rsplit(".", 1)[-1]
    leaves = [k.rsplit(".", 1)[-1] for k in keys]
    by_key = difflib.get_close_matches(key, keys, n=1, cutoff=0.6)
    match = by_key or difflib.get_close_matches(leaf, leaves, n=1, cutoff=0.6)
    if not match:
        return ""
    best = match[0]
    if best not in keys:  # matched a leaf name: report its full key
        best = next(k for k in keys if k.rsplit(".", 1)[-1] == best)
    return f" (did you mean {best!r}?)"


def _check_keys(tree: Any, cls: type, where: str, prefix: str = "") -> None:
    """Reject unknown keys with the nearest valid name, before OmegaConf sees them."""
    if not isinstance(tree, dict):
        return
    fields = {f.name: f for f in dataclasses.fields(cls)}
    for key, value in tree.items():
        full = f"{prefix}{key}"
        if full in _REPLACED_KEYS:
            raise ConfigError(f"config key {full!r} in {where} was replaced: {_REPLACED_KEYS[full]}")
        if key not in fields:
            raise ConfigError(f"unknown config key {full!r} in {where}{_nearest(full)}")
        f = fields[key]
        if _is_section(f) and isinstance(value, dict):
            _check_keys(value, type(f.default_factory()), where, full + ".")


def _load_yaml(path: str) -> dict:
    p = Path(path)
    if p.is_dir():
        raise ConfigError(f"config file {path} is a folder, not a YAML file")
    if not p.is_file():
        raise ConfigError(f"config file {path} not found")
    try:
        data = yaml.safe_load(p.read_bytes().decode("utf-8"))
    except UnicodeDecodeError as exc:
        raise ConfigError(f"config file {path} is not UTF-8 ({exc.reason} at byte {exc.start})") from None
    except (OSError, RecursionError) as exc:
        raise ConfigError(f"config file {path} cannot be read: {exc}") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        line = f" line {mark.line + 1}" if mark is not None else ""
        raise ConfigError(
            f"config file {path}{line} is not valid YAML: {getattr(exc, 'problem', exc)}"
        ) from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of keys, not {type(data).__name__}")
    return data


def _dotlist_to_tree(overrides: list[str]) -> list[tuple[str, dict]]:
    out = []
    for item in overrides:
        if "=" not in item:
            raise ConfigError(f"override {item!r} is not of the form key=value (e.g. train.lr=3e-6)")
        key = item.split("=", 1)[0].strip()
        try:
            tree = OmegaConf.to_container(OmegaConf.from_dotlist([item]))
        except OmegaConfBaseException as exc:
            raise ConfigError(
                f"override {item!r} cannot be parsed: {exc.msg if hasattr(exc, 'msg') else exc}"
            ) from None
        out.append((key, tree))
    return out


def _omegaconf_error(exc: OmegaConfBaseException, where: str, key_hint: str = "?") -> ConfigError:
    key = getattr(exc, "full_key", None) or key_hint
    msg = str(exc).splitlines()[0]
    return ConfigError(f"config key {key!r} from {where}: {msg}")


def shares_prompts(cfg: Config) -> bool:
    """``train.share_prompts`` as the run applies it: ``auto`` is on, except where the model was
    asked for flash-attention 2 (``model.attn_implementation=flash_attention_2``), which the shared
    forward does not wrap (grpo_fast/policy/shared_attention.py)."""
    share = cfg.train.share_prompts
    return share if isinstance(share, bool) else cfg.model.attn_implementation != "flash_attention_2"


def load_config(
    preset: str | None = None,
    config_files: list[str] | None = None,
    overrides: list[str] | None = None,
    *,
    check_device: bool = True,
) -> Config:
    """Layer defaults ← preset ← YAML files ← dot-list overrides, then validate.

    Example:
        >>> cfg = load_config("tiny", overrides=["train.lr=1e-4", "steps=10"])
        >>> cfg.train.lr, cfg.steps
        (0.0001, 10)
    """
    base = OmegaConf.structured(Config)
    layers: list[tuple[str, dict, str]] = []
    if preset is not None:
        if preset not in PRESETS:
            near = difflib.get_close_matches(preset, list(PRESETS), n=1)
            hint = f" (did you mean {near[0]!r}?)" if near else ""
            raise ConfigError(f"unknown preset {preset!r}{hint}; presets: {', '.join(PRESETS)}")
        layers.append((f"preset {preset!r}", PRESETS[preset], "?"))
    for path in config_files or []:
        layers.append((f"config file {path}", _load_yaml(path), "?"))
    for key, tree in _dotlist_to_tree(overrides or []):
        layers.append((f"override {key}=...", tree, key))

    merged = base
    for where, tree, key in layers:
        _check_keys(tree, Config, where)
        try:
            merged = OmegaConf.merge(merged, tree)
        except OmegaConfBaseException as exc:
            raise _omegaconf_error(exc, where, key) from None
    try:
        cfg = OmegaConf.to_object(merged)
    except OmegaConfBaseException as exc:
        raise _omegaconf_error(exc, "the merged config") from None
    cfg = _freeze(cfg)
    validate(cfg, preset, check_device=check_device)
    return cfg


def config_sources(
    preset: str | None = None,
    config_files: list[str] | None = None,
    overrides: list[str] | None = None,
    *,
    check_device: bool = True,
) -> dict[str, tuple[Any, str]]:
    """Every leaf key of the resolved config → ``(value, where it came from)``: ``"default"``,
    ``"preset NAME"``, ``"file PATH"`` or ``"override"`` (the last layer that set it wins, as in
    ``load_config``, which this calls first: a bad layer raises the same ``ConfigError``).

    Example:
        >>> src = config_sources("tiny", overrides=["steps=10"])
        >>> src["steps"], src["seed"], src["train.lr"]
        ((10, 'override'), (0, 'default'), (0.0002, 'preset tiny'))
    """
    cfg = load_config(preset, config_files, overrides, check_device=check_device)
    sources: dict[str, str] = {}
    if preset is not None:
        sources.update(dict.fromkeys(_flatten(PRESETS[preset]), f"preset {preset}"))
    for path in config_files or []:
        sources.update(dict.fromkeys(_flatten(_load_yaml(path)), f"file {path}"))
    for _, tree in _dotlist_to_tree(overrides or []):
        sources.update(dict.fromkeys(_flatten(tree), "override"))
    return {k: (v, sources.get(k, "default")) for k, v in _flatten(dataclasses.asdict(cfg)).items()}


def _flatten(tree: dict, cls: type = Config, prefix: str = "") -> dict[str, Any]:
    """A (partial) config tree → ``{dotted leaf key: value}``; a dict-valued field such as
    ``health.thresholds`` contributes one key per entry."""
    fields = {f.name: f for f in dataclasses.fields(cls)}
    flat: dict[str, Any] = {}
    for key, value in tree.items():
        f = fields.get(key)
        if f is not None and _is_section(f) and isinstance(value, dict):
            flat.update(_flatten(value, type(f.default_factory()), f"{prefix}{key}."))
        elif isinstance(value, dict):
            flat.update({f"{prefix}{key}.{k}": v for k, v in value.items()})
        else:
            flat[f"{prefix}{key}"] = value
    return flat


def _freeze(cfg: Config) -> Config:
    """OmegaConf turns tuples into lists; restore the dataclass field types that matter. YAML 1.1
    reads a bare ``no`` as false, so ``train.mixed_precision=no`` arrives as ``"False"``."""
    mp = "no" if cfg.train.mixed_precision == "False" else cfg.train.mixed_precision
    train = dataclasses.replace(cfg.train, betas=tuple(float(b) for b in cfg.train.betas), mixed_precision=mp)
    return dataclasses.replace(cfg, train=train)


def to_yaml(cfg: Config) -> str:
    """The resolved config as YAML (what ``output_dir/config.yaml`` holds)."""
    return OmegaConf.to_yaml(OmegaConf.structured(cfg))


def to_dict(cfg: Config) -> dict:
    return dataclasses.asdict(cfg)
