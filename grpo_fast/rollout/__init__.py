"""Rollout backends behind one interface (``RolloutBackend``): ``hf`` and ``vllm``."""

from __future__ import annotations

import torch

from grpo_fast.config import AUTO, Config
from grpo_fast.errors import ConfigError
from grpo_fast.rollout.base import Rollout, RolloutBackend, SamplingParams, generate_groups

__all__ = [
    "Rollout",
    "RolloutBackend",
    "SamplingParams",
    "generate_groups",
    "make_backend",
    "vllm_dtype",
    "weight_sync_tolerance",
]


def vllm_dtype(model: torch.nn.Module, amp: torch.dtype | None) -> torch.dtype:
    """The dtype vLLM serves in: the autocast dtype when there is one, else the weights' own."""
    return amp if amp is not None else next(model.parameters()).dtype


def weight_sync_tolerance(cfg: Config, model: torch.nn.Module, amp: torch.dtype | None) -> float:
    """``rollout.weight_sync_tolerance``, with ``auto`` resolved by the dtype vLLM serves in."""
    from grpo_fast.rollout.vllm import WEIGHT_SYNC_TOLERANCE

    tol = cfg.rollout.weight_sync_tolerance
    return WEIGHT_SYNC_TOLERANCE[vllm_dtype(model, amp)] if tol == AUTO else float(tol)


def make_backend(
    cfg: Config,
    model: torch.nn.Module,
    tokenizer,
    device: torch.device,
    amp,
    engine=None,
    *,
    model_path: str | None = None,
    probe=None,
) -> RolloutBackend:
    """The configured backend, with the current policy already pushed (vllm).

    Args:
        engine: a ready vLLM-like engine (tests pass a fake one); None = start ``VLLMEngine``.
        model_path: the Hugging Face folder vLLM starts from (default ``model.name_or_path``;
            the loop passes a folder it wrote after a warm start or for the built-in model).
        probe: a ``WeightSyncProbe`` run after every push (vllm).
    """
    r = cfg.rollout
    if r.backend == "hf":
        from grpo_fast.rollout.hf import HFBackend

        return HFBackend(model, tokenizer, r.generation_batch_size, autocast_dtype=amp)
    from grpo_fast.rollout.vllm import VLLMBackend, VLLMEngine

    if engine is None:
        path = model_path or cfg.model.name_or_path
        if path.startswith("builtin:"):
            raise ConfigError("rollout.backend=vllm needs a Hugging Face folder for the built-in model")
        import torch.distributed as torch_dist

        multi = torch_dist.is_initialized() and torch_dist.get_world_size() > 1
        rank = torch_dist.get_rank() if multi else 0
        engine = VLLMEngine(
            path,
            gpu_memory_utilization=float(r.gpu_memory_utilization),
            max_model_len=r.max_prompt_tokens + r.max_tokens,
            seed=cfg.seed + rank,  # each rank samples its own prompts with its own stream
            dtype=str(vllm_dtype(model, amp)).removeprefix("torch."),
            sleep_level=r.sleep_level,
            data_parallel=multi,
            extra_args=dict(r.vllm_kwargs),
        )
    backend = VLLMBackend(engine, tokenizer, sleep_level=r.sleep_level, probe=probe)
    backend.update_weights(model, step=0)  # the (possibly warm-started or resumed) policy
    return backend
