"""Rollout backends behind one interface (``RolloutBackend``): ``hf`` and ``vllm``."""

from __future__ import annotations

import torch

from grpo_fast.config import Config
from grpo_fast.errors import ConfigError
from grpo_fast.rollout.base import Rollout, RolloutBackend, SamplingParams

__all__ = ["Rollout", "RolloutBackend", "SamplingParams", "make_backend"]


def make_backend(
    cfg: Config, model: torch.nn.Module, tokenizer, device: torch.device, amp, engine=None
) -> RolloutBackend:
    """The configured backend. ``engine``: a ready vLLM-like engine (tests pass a fake one)."""
    r = cfg.rollout
    if r.backend == "hf":
        from grpo_fast.rollout.hf import HFBackend

        return HFBackend(model, tokenizer, r.generation_batch_size, autocast_dtype=amp)
    from grpo_fast.rollout.vllm import VLLMBackend, VLLMEngine

    if engine is None:
        if cfg.model.name_or_path.startswith("builtin:"):
            raise ConfigError(
                "rollout.backend=vllm needs a Hugging Face model; the built-in tiny model is hf-only"
            )
        import torch.distributed as torch_dist

        multi = torch_dist.is_initialized() and torch_dist.get_world_size() > 1
        rank = torch_dist.get_rank() if multi else 0
        engine = VLLMEngine(
            cfg.model.name_or_path,
            gpu_memory_utilization=float(r.gpu_memory_utilization),
            max_model_len=r.max_prompt_tokens + r.max_tokens,
            seed=cfg.seed + rank,  # each rank samples its own prompts with its own stream
            data_parallel=multi,
        )
    backend = VLLMBackend(engine, tokenizer, sleep_level=r.sleep_level)
    backend.update_weights(model)  # the first rollout pushes the (possibly warm-started) policy
    return backend
