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

__all__ = [
    "IS_LEVELS",
    "IS_MODES",
    "cut_importance_weights",
    "raw_importance_weights",
    "sampler_importance_weights",
]

IS_LEVELS = ("token", "sequence")
IS_MODES = ("truncate", "mask")


def raw_importance_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    level: str,
    across=None,
) -> torch.Tensor:
    """Per-token importance weights ``ρ`` ``[n]`` fp64 (detached), before any cut: what the
    module docstring's formulas give (``rollout/is_weight_raw_mean`` and ``_max`` are over these).

    Args:
        trainer_logprobs, sampler_logprobs: ``[n]`` log-probs of the sampled tokens.
        sequence_ids: ``[n]`` int64, which response each token belongs to (any labels; tokens of
            one response share one).
        level: ``token`` or ``sequence`` (one ρ per response, on each of its tokens).
        across: sequence parallelism (``grpo_fast.algo.core.sequence_mean``'s): the tokens are one
            rank's share of their responses; each response's Σ Δ is summed over the group.

    Example: Δ = [0, ln 3, −ln 2] at the token level → ρ = [1, 3, 0.5]; at the sequence level
    with ids [0, 0, 1] → [3, 3, 0.5].
    """
    if level not in IS_LEVELS:
        raise ValueError(f"level must be one of {IS_LEVELS}, got {level!r}")
    if (
        not (trainer_logprobs.shape == sampler_logprobs.shape == sequence_ids.shape)
        or trainer_logprobs.dim() != 1
    ):
        raise ValueError(
            f"trainer_logprobs {tuple(trainer_logprobs.shape)}, sampler_logprobs "
            f"{tuple(sampler_logprobs.shape)} and sequence_ids {tuple(sequence_ids.shape)} must all be [n]"
        )
    delta = (trainer_logprobs.detach() - sampler_logprobs.detach()).double()
    if level == "sequence" and across is not None:  # ids 0 … S−1 on every rank; one collective
        per_seq = delta.new_zeros(across.num_sequences).index_add_(0, sequence_ids, delta)
        delta = across.sum(per_seq)[sequence_ids]
    elif level == "sequence":
        _, inverse = torch.unique(sequence_ids, return_inverse=True)
        per_seq = torch.zeros(
            int(inverse.max()) + 1 if inverse.numel() else 0, dtype=delta.dtype, device=delta.device
        )
        per_seq.index_add_(0, inverse, delta)
        delta = per_seq[inverse]
    return torch.exp(delta)


def cut_importance_weights(rho: torch.Tensor, *, mode: str, cap: float) -> torch.Tensor:
    """``ρ`` (``raw_importance_weights``) with every ``ρ > cap`` cut to ``cap`` (``truncate``) or
    to 0 (``mask``): ``[n]`` fp32. Example, cap 2: ``[1, 3, 0.5]`` → truncate ``[1, 2, 0.5]``,
    mask ``[1, 0, 0.5]``."""
    if mode not in IS_MODES:
        raise ValueError(f"mode must be one of {IS_MODES}, got {mode!r}")
    rho = rho.clamp(max=cap) if mode == "truncate" else torch.where(rho > cap, torch.zeros_like(rho), rho)
    return rho.float()


def sampler_importance_weights(
    trainer_logprobs: torch.Tensor,
    sampler_logprobs: torch.Tensor,
    sequence_ids: torch.Tensor,
    *,
    level: str,
    mode: str,
    cap: float,
) -> torch.Tensor:
    """Per-token importance weights ``[n]`` fp32 (detached), cut: ``cut_importance_weights`` of
    ``raw_importance_weights`` (their arguments; see the module docstring).

    Example (hand-worked, token level, cap 2): Δ = [0, ln 3, −ln 2] → ρ = [1, 3, 0.5] → truncate
    [1, 2, 0.5], mask [1, 0, 0.5].
    """
    if level not in IS_LEVELS or mode not in IS_MODES:
        raise ValueError(
            f"level must be one of {IS_LEVELS} and mode one of {IS_MODES}, got {level!r}, {mode!r}"
        )
    raw = raw_importance_weights(trainer_logprobs, sampler_logprobs, sequence_ids, level=level)
    return cut_importance_weights(raw, mode=mode, cap=cap)
