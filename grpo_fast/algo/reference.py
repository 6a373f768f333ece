"""The eager ``[N, V]`` references of the fused ops (``grpo_fast.ops``): full fp32 logits, the
log-softmax, its exp — the memory the fused kernels avoid. ``grpo_fast.ops.token_logprobs`` and
``grpo_fast.ops.grpo_loss`` run them as their ``eager`` backend; the tests and benchmarks compare
every kernel with them (in float64)."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.token_loss import GRPOLossOutput, compute_entropy, weighted_grpo_loss
from grpo_fast.algo.truncation import truncated_logits, truncates, truncation_threshold

__all__ = ["eager_grpo_loss_from_logits", "eager_token_logprobs_and_entropy"]


def eager_token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    *,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference for ``grpo_fast.ops.token_logprobs_and_entropy``: ``[N, V], [N] -> ([N], [N])``.

    Materializes ``[N, V]`` in fp32 (the upcast, the log-softmax, its exp): the memory the fused
    kernels avoid. Computes in the input's dtype if it is float64 (the test reference), else fp32.
    ``top_k`` / ``top_p``: the log-prob and entropy of the truncated distribution top-k/top-p
    sampling draws from (``truncation_threshold``), and their gradients; 0 / 1 = the full one.
    """
    compute_dtype = torch.float64 if logits.dtype == torch.float64 else torch.float32
    scaled = logits.to(compute_dtype) / temperature
    if truncates(top_k, top_p, scaled.shape[-1]):
        scaled = truncated_logits(scaled, labels, truncation_threshold(scaled.detach(), top_k, top_p))
    log_probs = F.log_softmax(scaled, dim=-1)
    logp = log_probs.gather(-1, labels.long().unsqueeze(-1)).squeeze(-1)
    return logp, compute_entropy(scaled)


def eager_grpo_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    sequence_ids: torch.Tensor | None = None,
    options: LossOptions | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    across=None,
    **loss_options,
) -> GRPOLossOutput:
    """Reference for ``grpo_fast.ops.grpo_loss_from_logits`` (same arguments, same output;
    ``across`` as ``weighted_grpo_loss``'s).

    ``loss = Σ_t w_t·ℓ_t`` with ``ℓ`` from ``grpo_token_loss`` (for ``grpo_clip``:
    ``−min(r_t·A_t, clip(r_t, 1−clip_low, 1+clip_high)·A_t) + β·KL_t − c·H_t``). The options:
    ``options`` and/or ``LossOptions``' fields as keywords (``loss_type`` for ``type``).
    Shapes: logits ``[N, V]``, labels/advantages/loss_weights/old/ref/sequence_ids ``[N]``.
    """
    options = LossOptions.build(options, **loss_options)
    logp, entropy = eager_token_logprobs_and_entropy(logits, labels, temperature, top_k=top_k, top_p=top_p)
    loss, rows = weighted_grpo_loss(
        logp,
        entropy,
        advantages,
        loss_weights,
        options,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        sequence_ids=sequence_ids,
        across=across,
    )
    return GRPOLossOutput(
        loss, logp, entropy, rows.kl, rows.clipped, rows.log_ratio, rows.parts, rows.entropy_threshold
    )
