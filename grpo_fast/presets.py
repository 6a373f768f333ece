"""The presets (``--preset NAME``): each once, with its one-line summary and the values it sets
over the defaults of ``grpo_fast.config`` (the dataclasses there hold every default and its
domain; a preset holds only what differs). ``grpo_fast.config`` re-exports ``PRESETS``; the
values are validated there, as every layer is (``load_config``)."""

from __future__ import annotations

from typing import Any

from grpo_fast.domains import AUTO

__all__ = ["PRESETS", "PRESET_SUMMARIES", "Preset"]


class Preset(dict):
    """A preset: the values it sets (only what differs from the defaults in ``grpo_fast.config``), and its one-line
    summary, ``"who it is for: what it sets"`` — what ``--help``, the README's and
    docs/training.md's preset tables say (tests/test_docs.py holds them to it)."""

    def __init__(self, summary: str, values: dict[str, Any]):
        super().__init__(values)
        self.summary = summary


# What the two built-in CPU presets (tiny, tiny_tools) share: the optimizer's schedule for a
# 0.4 M-parameter model, and its health thresholds (a 1-6 digit answer is nearly deterministic:
# its healthy entropy is far below an essay's).
_TINY_TRAIN = {
    "lr": 2e-4,
    "warmup_steps": 10,
    "schedule": "cosine",
    "min_lr_ratio": 0.1,
    "micro_batch_size": 256,
    "mixed_precision": "no",  # fp32 even where the CPU has bf16: 1.3x slower at D = 128 (docs/training.md)
}
_TINY_THRESHOLDS = {"entropy_warn_low": 0.05, "entropy_healthy_low": 0.1}
# ... and the run's shape: an evaluation every 25 steps (of the 500-problem subset), a checkpoint
# every 100, everything on the CPU; groups of 8 of 32 prompts of at most 16 tokens, generated in
# one chunk; with rollout.backend=vllm no torch.compile of the 0.4 M-parameter model (engine
# start-up 9 s instead of 45 s on 2 busy cores; nothing to gain from compiling it)
_TINY_RUN = {"eval_every": 25, "full_eval_every": 0, "checkpoint_every": 100, "device": "cpu"}
_TINY_ROLLOUT = {
    "group_size": 8,
    "batch_size": 256,
    "min_tokens": 0,
    "max_prompt_tokens": 16,
    "generation_batch_size": 256,
    "vllm_kwargs": {"enforce_eager": True},
}

# The presets, each once: its summary and its values.
PRESETS: dict[str, Preset] = {
    # CPU, built-in model, tokenizer and task (grpo_fast.task.tiny): what a newcomer runs first.
    # Two-digit addition. An SFT warm start stops once the model solves 25% of training
    # problems (a "base model"); then 500 GRPO steps. Measured on 2 idle cores (seed 0, 2026-12-02):
    # greedy eval 0.21 → 0.62 in 51 s wall.
    "tiny": Preset(
        "any CPU, first run: built-in model/tokenizer/task, SFT warm start, 500 steps",
        {
            "output_dir": "runs/tiny",
            "steps": 500,
            **_TINY_RUN,
            "model": {"name_or_path": "builtin:tiny", "dtype": "float32"},
            "data": {"task": "tiny", "prompt_template": "question_only", "eval_subset_size": 500},
            "rollout": {**_TINY_ROLLOUT, "max_tokens": 4},
            "train": {**_TINY_TRAIN},
            "sft": {"steps": 1000, "lr": 1e-3, "batch_size": 64, "target_accuracy": 0.25},
            "logging": {"sample_every": 50},
            "health": {"thresholds": {**_TINY_THRESHOLDS}},
        },
    ),
    # CPU, the built-in model with the calculator's tags (grpo_fast.task.tiny_tools): what a
    # newcomer runs first of tool use. Products of 2-3-digit numbers, which the model cannot
    # compute: it learns to call the calculator and copy the result. A warm start on demonstrations
    # (half of them call the tool) stops once greedy accuracy on training problems reaches 0.2,
    # then GRPO, which makes the tool-call rate rise and the accuracy with it.
    "tiny_tools": Preset(
        "any CPU, first run with a tool: built-in model, products with a calculator, SFT on demonstrations, 300 steps",
        {
            "output_dir": "runs/tiny_tools",
            "steps": 300,
            **_TINY_RUN,
            "model": {"name_or_path": "builtin:tiny_tools", "dtype": "float32"},
            "data": {"task": "tiny_tools", "prompt_template": "question_only", "eval_subset_size": 500},
            "rollout": {
                **_TINY_ROLLOUT,
                # sampled: <calc>999*999</calc> (9 tokens), the 6-digit product, EOS
                "max_tokens": 20,
                "environment": "calculator",
                "max_tool_calls": 2,
                # <result>998001</result>: 8 tokens; response ≤ 20 + 2 × 12 = 44, context ≤ 60 of 64
                "max_tool_output_tokens": 12,
            },
            "train": {**_TINY_TRAIN},
            "sft": {"steps": 2000, "lr": 1e-3, "batch_size": 64, "target_accuracy": 0.4},
            "logging": {"sample_every": 50},
            "health": {"thresholds": {**_TINY_THRESHOLDS}},
        },
    ),
    # A real model at ~1% of the cost: catches config mistakes before a long run.
    "smoke": Preset(
        "a real model, before a long run: group 2, 8 responses, 3 steps (~1% of the cost)",
        {
            "output_dir": "runs/smoke",
            "steps": 3,
            "eval_every": 0,
            "full_eval_every": 0,
            "checkpoint_every": 0,
            "data": {"eval_subset_size": 16},
            "rollout": {"group_size": 2, "batch_size": 8, "max_tokens": 256},
            "train": {"micro_batch_size": 2},
        },
    ),
    # Qwen2.5-Math-1.5B on MATH within 24 GB: fp32 master weights + bf16 autocast, gradient
    # checkpointing, 8-bit AdamW, vLLM in sleep mode (its share from the planner). Microbatch 2
    # until a GPU measurement validates the planner's pick (9 at 1,536 tokens per sequence).
    "rtx4090": Preset(
        "Qwen2.5-Math-1.5B on MATH, 24 GB: fp32 master weights + bf16 autocast, gradient checkpointing, 8-bit AdamW, microbatch 2, vLLM sleep mode",
        {
            "output_dir": "runs/rtx4090",
            "steps": 200,
            "device": "cuda",
            "model": {"gradient_checkpointing": True},
            "data": {"task": "math"},
            "rollout": {"backend": "vllm", "group_size": 8, "batch_size": 256, "max_tokens": 1024},
            "train": {"lr": 1e-6, "optimizer": "adamw8bit", "betas": [0.9, 0.95], "micro_batch_size": 2},
            "loss": {"length_norm": "sequence_mean"},
        },
    ),
    # An 80 GB card: larger microbatches, bf16, plain AdamW.
    "h100": Preset(
        "80 GB: bf16 autocast, plain AdamW, microbatch from the planner, 512 responses/step",
        {
            "output_dir": "runs/h100",
            "steps": 200,
            "device": "cuda",
            "model": {"gradient_checkpointing": True},
            "data": {"task": "math"},
            "rollout": {"backend": "vllm", "group_size": 8, "batch_size": 512, "max_tokens": 1024},
            "train": {"lr": 1e-6, "optimizer": "adamw", "betas": [0.9, 0.95], "micro_batch_size": AUTO},
        },
    ),
}


PRESET_SUMMARIES = {name: preset.summary for name, preset in PRESETS.items()}
