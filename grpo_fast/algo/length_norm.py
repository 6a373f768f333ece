"""Length normalization as per-token loss weights: GRPO's per-sequence mean, Dr. GRPO's constant,
DAPO's token mean — one fused ``Σ w·ℓ`` serves them all."""

from __future__ import annotations

import torch

__all__ = ["LENGTH_NORMS", "length_norm_weights"]

LENGTH_NORMS = ("sequence_mean", "constant", "token_mean")  # loss.length_norm


def length_norm_weights(
    response_mask: torch.Tensor,
    length_norm: str,
    *,
    max_length: int | None = None,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> torch.Tensor:
    """Per-token loss weights ``w [B, T]`` such that the batch loss is ``Σ_{b,t} w·ℓ``.

    Computed once for the whole rollout batch and then sliced into microbatches, the weights
    make the sum over microbatches equal the full-batch loss whatever the split, so one fused
    kernel (``loss = Σ w·ℓ``) serves every normalization:

    - ``sequence_mean`` (GRPO): ``w = m / (|o_b| · B)`` — per-sequence mean, then batch mean.
    - ``constant`` (Dr. GRPO): ``w = m / (max_length · B)`` — token sum over a fixed length.
    - ``token_mean`` (DAPO): ``w = m / Σ m`` — every response token of the rollout batch counts
      equally, so long responses are not down-weighted.

    Args:
        response_mask: ``[B, T]`` bool/0-1 mask of response tokens.
        max_length: the constant for ``constant`` (e.g. ``rollout.max_tokens``).
        num_sequences: ``B`` of the whole rollout batch (default: ``response_mask.shape[0]``);
            pass the global count when the mask is one shard of a larger batch.
        num_tokens: ``Σ m`` of the whole rollout batch (default: ``response_mask.sum()``); across
            data-parallel ranks, pass the all-reduced count.

    Example:
        Lengths 1 and 3: ``sequence_mean`` gives 1/2 to the single token and 1/6 to each of the
        three; ``token_mean`` gives 1/4 to all four.
    """
    m = response_mask.to(torch.float32)
    n_seq = float(m.shape[0] if num_sequences is None else num_sequences)
    if length_norm == "sequence_mean":
        lengths = m.sum(dim=-1, keepdim=True).clamp_min(1.0)
        return m / (lengths * n_seq)
    if length_norm == "constant":
        if max_length is None or max_length <= 0:
            raise ValueError("length_norm='constant' needs max_length > 0")
        return m / (float(max_length) * n_seq)
    if length_norm == "token_mean":
        total = float(m.sum().item()) if num_tokens is None else float(num_tokens)
        return m / max(total, 1.0)
    raise ValueError(f"unknown length_norm {length_norm!r}; expected one of {', '.join(LENGTH_NORMS)}")
