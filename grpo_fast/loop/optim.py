"""Optimizer and learning-rate schedule: small pieces the loop needs."""

from __future__ import annotations

import math

import torch

from grpo_fast.config import Config
from grpo_fast.domains import AUTO


def build_optimizer(cfg: Config, params, value_params=()) -> torch.optim.Optimizer:
    """AdamW, or bitsandbytes' 8-bit AdamW (``train.optimizer=adamw8bit``; runs on CPU with bnb ≥ 0.50),
    over the parameters that train (under LoRA, the adapter's, at ``train.lr × model.lora.lr_scale``).

    8-bit AdamW keeps both moments in blockwise-quantized uint8: 2 B/parameter instead of 8 B
    (Qwen2.5-1.5B: 3.1 GB instead of 12.4 GB). Over FSDP2's sharded parameters (DTensors) it is
    ``ShardedAdamW8bit``: the same bitsandbytes update on each rank's local shards, 2/N B/parameter
    a rank (grpo_fast/policy/sharded_optim.py).

    ``value_params`` (``loss.advantage=gae``: the value head's) form a second parameter group at
    ``critic.lr`` (null: ``train.lr``), without weight decay; the LR schedule scales both groups.
    """
    t = cfg.train
    params = [p for p in params if p.requires_grad]
    lr = t.lr * lora_lr_scale(cfg)
    value_params = list(value_params)
    flat = params + value_params
    if value_params:
        critic_lr = cfg.critic.lr if cfg.critic.lr is not None else t.lr
        params = [{"params": params}, {"params": value_params, "lr": critic_lr, "weight_decay": 0.0}]
    if t.optimizer == "adamw8bit":
        import bitsandbytes as bnb
        from torch.distributed.tensor import DTensor

        if any(isinstance(p, DTensor) for p in flat):
            from grpo_fast.policy.sharded_optim import ShardedAdamW8bit

            return ShardedAdamW8bit(params, lr=lr, betas=t.betas, weight_decay=t.weight_decay)
        return bnb.optim.AdamW8bit(params, lr=lr, betas=t.betas, weight_decay=t.weight_decay)
    return adamw(params, fused_optimizer(cfg, flat), lr=lr, betas=t.betas, weight_decay=t.weight_decay)


def fused_optimizer(cfg: Config, params) -> bool:
    """``train.fused_optimizer``: true or false as given; auto: on when the parameters are on CUDA."""
    asked = cfg.train.fused_optimizer
    if asked != AUTO:
        return bool(asked)
    return any(p.device.type == "cuda" for p in params)


def adamw(params, fused: bool, **hyper) -> torch.optim.AdamW:
    """``torch.optim.AdamW(params, **hyper)``; ``fused``: with torch's fused kernel (one kernel
    over all the tensors) where every parameter is a floating tensor on a device it supports (CUDA,
    CPU, …; FSDP2's DTensors too), else torch's default. The update is AdamW's: 100 steps of the fused
    and per-tensor forms stay within 7.5e-9 of each other, equally far from float64. A step on a
    2-core CPU (``python -m pytest bench/test_bench_step_options.py -k optimizer``, load 0.8-1.0):
    the tiny model's 0.45 M parameters 1.92 ms per tensor, 1.72 ms foreach, 0.44 ms fused;
    bench/peers' wide model's 34.9 M 145, 131 and 21.8 ms. A checkpoint keeps the form it was
    written with (its parameter groups' ``fused`` flag): a resumed run steps as it did. Why a CPU
    run's default is the per-tensor form: docs/training.md, the optimizer step."""
    from torch.utils._foreach_utils import _get_fused_kernels_supported_devices

    groups = list(params)
    tensors = [q for g in groups for q in (g["params"] if isinstance(g, dict) else [g])]
    devices = set(_get_fused_kernels_supported_devices())
    fused = (
        fused and bool(tensors) and all(q.is_floating_point() and q.device.type in devices for q in tensors)
    )
    return torch.optim.AdamW(groups, fused=True if fused else None, **hyper)


def lora_lr_scale(cfg: Config) -> float:
    """``model.lora.lr_scale`` under LoRA (the adapter's learning rate is the preset's × it), else 1."""
    return cfg.model.lora.lr_scale if cfg.model.lora.r else 1.0


def lr_factor(step: int, cfg: Config) -> float:
    """LR multiplier for GRPO step ``step`` (0-based): linear warmup, then the schedule.

    Example: warmup 10, cosine over 100 steps, min ratio 0.1 → step 4: 0.5; step 10: 1.0;
    step 55: 0.1 + 0.9·(1 + cos(π/2))/2 = 0.55; step 99: ≈ 0.1.
    """
    t = cfg.train
    if step < t.warmup_steps:
        return (step + 1) / t.warmup_steps
    if t.schedule == "constant":
        return 1.0
    span = max(cfg.steps - t.warmup_steps, 1)
    progress = min((step - t.warmup_steps) / span, 1.0)
    shape = 1.0 - progress if t.schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return t.min_lr_ratio + (1.0 - t.min_lr_ratio) * shape


def build_scheduler(cfg: Config, optimizer: torch.optim.Optimizer) -> torch.optim.lr_scheduler.LambdaLR:
    """Stepped once per GRPO step (all inner epochs of a rollout batch share its LR)."""
    return torch.optim.lr_scheduler.LambdaLR(optimizer, lambda s: lr_factor(s, cfg))
