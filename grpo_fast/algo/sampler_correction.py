"""Truncated importance sampling against the sampler: the trainer-vs-vLLM mismatch correction.

vLLM samples with its own kernels (and, on GPU, bf16 weights), so its log-probs of the sampled
tokens differ from the trainer's π_old by ≈ 0.01-0.02 on average. The policy gradient is taken
under the trainer's π_old; each token's loss weight is multiplied by

    ρ_t = exp(log π_old(y_t) − log π_sampler(y_t))                 (rollout.is_level=token)
    ρ_i = exp(Σ_t∈i (log π_old(y_t) − log π_sampler(y_t)))        (sequence: one ρ per response)

and ρ > C (``rollout.is_cap``) is cut to C (``is_mode=truncate``, TIS) or its tokens get weight
0 (``is_mode=mask``, rejection), as in TRL's ``vllm_importance_sampling_mode`` and verl's rollout
correction.
"""

from __future__ import annotations

import torch

__all__ = ["IS_LEVELS", "IS_MODES", "sampler_importance_weights"]

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


def sampler_importance_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    level: str,
    mode: str,
    cap: float,
) -> torch.Tensor:
    """Per-token importance weights ``[n]`` fp32 (detached).

    Args:
        trainer_logprobs, sampler_logprobs: ``[n]`` log-probs of the sampled tokens.
        sequence_ids: ``[n]`` int64, which response each token belongs to (any labels; tokens of
            one response share one).
        level, mode, cap: see the module docstring.

    Example (hand-worked, token level, cap 2): Δ = [0, ln 3, −ln 2] → ρ = [1, 3, 0.5] → truncate
    [1, 2, 0.5], mask [1, 0, 0.5].
    """
    if level not in IS_LEVELS or mode not in IS_MODES:
        raise ValueError(
            f"level must be one of {IS_LEVELS} and mode one of {IS_MODES}, got {level!r}, {mode!r}"
        )
    if (
        not (trainer_logprobs.shape == sampler_logprobs.shape == sequence_ids.shape)
        or trainer_logprobs.dim() != 1
    ):
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, sampler_logprobs "
            f"{tuple(sampler_logprobs.shape)} and sequence_ids {tuple(sequence_ids.shape)} must all be [n]"
        )
    delta = (trainer_logprobs.detach() - sampler_logprobs.detach()).double()
    if level == "sequence":
        _, inverse = torch.unique(sequence_ids, return_inverse=True)
        per_seq = torch.zeros(
            int(inverse.max()) + 1 if inverse.numel() else 0, dtype=delta.dtype, device=delta.device
        )
        per_seq.index_add_(0, inverse, delta)
        delta = per_seq[inverse]
    rho = torch.exp(delta)
    rho = rho.clamp(max=cap) if mode == "truncate" else torch.where(rho > cap, torch.zeros_like(rho), rho)
    return rho.float()
