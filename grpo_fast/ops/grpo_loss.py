"""The GRPO loss from logits, without an ``[N, V]`` fp32 tensor.

Split by cost: the vocabulary-sized work (log-softmax of the label, entropy, and their gradient)
is the ``token_logprobs`` kernel pair, one read of the logits forward and one read + one write
backward; the per-row GRPO math (ratio, clipping, KL estimator, entropy bonus, weights) is O(N)
PyTorch on ``[N]`` vectors, ``grpo_fast.algo.core.grpo_token_loss`` itself, whose autograd hands the
kernel its two per-row upstream gradients (g_lp, g_H). At N = 8,192 that row math is a few dozen
elementwise ops on 32 KB vectors, against 2.5 GB of bf16 logits (V = 151,936) for the kernels.
"""

from __future__ import annotations

import torch

from grpo_fast.algo.core import GRPOLossOutput, eager_grpo_loss_from_logits, grpo_token_loss
from grpo_fast.ops._backend import check_loss_options, check_sequence_ids
from grpo_fast.ops.token_logprobs import apply_token_logprobs, prepare_logits

__all__ = ["grpo_loss_from_logits", "grpo_loss_from_logprobs"]


def grpo_loss_from_logprobs(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None,
    ref_logprobs: torch.Tensor | None,
    clip_low: float,
    clip_high: float,
    beta: float,
    entropy_coef: float,
    kl_estimator: str,
    dual_clip: float | None,
    loss_type: str,
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sequence_ids: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor]:
    """The per-row GRPO math on ``[N]`` fp32 vectors: ``(loss scalar, kl [N] or None, clipped [N] bool)``.

    ``loss = Σ_t w_t·ℓ_t`` with ``ℓ`` from ``grpo_fast.algo.core.grpo_token_loss`` (inputs cast to fp32,
    as the eager reference does).
    """
    as32 = lambda t: None if t is None else t.float()
    per_token, meta = grpo_token_loss(
        logprobs,
        advantages.float(),
        old_log_probs=as32(old_logprobs),
        ref_log_probs=as32(ref_logprobs),
        entropy=entropy,
        clip_low=clip_low,
        clip_high=clip_high,
        dual_clip=dual_clip,
        beta=beta,
        kl_estimator=kl_estimator,
        entropy_coef=entropy_coef,
        loss_type=loss_type,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        sequence_ids=sequence_ids,
        top_entropy_quantile=top_entropy_quantile,
        token_mask=loss_weights != 0,  # the quantile is over the tokens that count
    )
    return (loss_weights.float() * per_token).sum(), meta["kl"], meta["clipped"]


def grpo_loss_from_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    clip_low: float = 0.2,
    clip_high: float = 0.2,
    beta: float = 0.0,
    entropy_coef: float = 0.0,
    kl_estimator: str = "k3",
    dual_clip: float | None = None,
    loss_type: str = "grpo_clip",
    delta: float | None = None,
    importance_sampling_level: str = "token",
    sequence_ids: torch.Tensor | None = None,
    top_entropy_quantile: float = 1.0,
    backend: str = "auto",
    inplace_grad: bool = False,
) -> GRPOLossOutput:
    """GRPO loss ``Σ_t w_t·(−min(r_t·A_t, clip(r_t, 1−clip_low, 1+clip_high)·A_t) + β·KL_t − c·H_t)``.

    ``r_t = exp(logp_t − old_t)``; ``old_logprobs=None`` is on-policy (old = logp detached: ratio 1,
    gradient ``−A·∇logp``). Same arguments and output as ``grpo_fast.algo.core.eager_grpo_loss_from_logits``.

    Args:
        logits: ``[N, V]`` fp32/bf16/fp16 (fp64 with ``backend="eager"``), the policy's logits at
            the ``N`` response tokens; ``-inf`` entries have probability 0.
        labels: ``[N]`` int64/int32 token ids in ``[0, V)`` (padding: any valid id, weight 0).
        advantages, loss_weights: ``[N]`` float; the weights carry the mask and the length
            normalization (``grpo_fast.algo.core.length_norm_weights``).
        old_logprobs, ref_logprobs: ``[N]`` float or None. ``beta != 0`` needs ``ref_logprobs``.
        temperature: ``T > 0``; logits are divided by it before the softmax.
        clip_low, clip_high: PPO clip range ``[1 − clip_low, 1 + clip_high]``; ``dual_clip``: c > 1.
        beta, kl_estimator: KL penalty weight and estimator (``"k1"``, ``"k2"``, ``"k3"``).
        entropy_coef: weight ``c`` of the entropy bonus.
        loss_type: ``"grpo_clip"`` (the formula above), ``"reinforce_with_baseline"`` /
            ``"no_baseline"``: ``−r_t·A_t`` in place of the min, never clipped, or ``"cispo"``:
            ``−sg(clip(r_t, 1−clip_low, 1+clip_high))·A_t·logp_t`` (see
            ``grpo_fast.algo.core.grpo_token_loss``).
        delta: ``δ > 1`` or None: the unclipped term's ratio capped at δ, ``min(r_t, δ)`` (no
            gradient above it; for ``grpo_clip`` with ``δ > 1 + clip_high`` the same as
            ``dual_clip = δ``); ``clipped`` marks the capped tokens.
        importance_sampling_level, sequence_ids: ``"token"`` (``r_t`` per token), or
            ``"sequence"`` (GSPO) with ``sequence_ids [N]`` int64/int32: every row's ratio is its
            sequence's ``exp(mean_{t∈i}(logp_t − old_t))``, the mean over the rows sharing the id
            (see ``grpo_fast.algo.core.grpo_token_loss``).
        top_entropy_quantile: ``ρ ∈ (0, 1]``: the policy-gradient term only on the rows whose
            entropy is in the top ρ of the rows with ``loss_weights != 0`` of this call
            (``grpo_fast.algo.core.entropy_threshold``); 1 = every row.
        backend: ``"auto"`` (``triton`` on CUDA, else ``torch_chunked``), ``"triton"``,
            ``"torch_chunked"``, ``"eager"``.
        inplace_grad: write ``∂loss/∂logits`` into the logits buffer (no ``[N, V]`` allocation in the
            backward); the logits are gone after ``backward()``, see ``token_logprobs_and_entropy``.

    Returns:
        ``GRPOLossOutput(loss scalar, logprobs [N] fp32, entropy [N] fp32, kl [N] fp32 | None,
        clipped [N] bool)``; ``loss``, ``logprobs`` and ``entropy`` are differentiable in ``logits``.

    Example:
        >>> logits = torch.zeros(1, 4, requires_grad=True)  # uniform: logp = −log 4
        >>> out = grpo_loss_from_logits(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.5]))
        >>> out.loss  # on-policy: ratio 1, loss = −w·A = −0.5
        tensor(-0.5000, grad_fn=<SumBackward0>)
    """
    check_loss_options(
        temperature, clip_low, clip_high, beta, entropy_coef, kl_estimator, dual_clip, loss_type, delta,
        top_entropy_quantile,
    )  # fmt: skip
    if beta != 0.0 and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    check_sequence_ids(importance_sampling_level, sequence_ids, labels)
    resolved = prepare_logits(
        logits,
        labels,
        backend,
        inplace_grad,
        advantages=advantages,
        loss_weights=loss_weights,
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
    )
    options = dict(
        old_logprobs=old_logprobs,
        ref_logprobs=ref_logprobs,
        clip_low=clip_low,
        clip_high=clip_high,
        beta=beta,
        entropy_coef=entropy_coef,
        kl_estimator=kl_estimator,
        dual_clip=dual_clip,
        loss_type=loss_type,
        delta=delta,
        importance_sampling_level=importance_sampling_level,
        sequence_ids=sequence_ids,
        top_entropy_quantile=top_entropy_quantile,
    )
    if resolved == "eager":
        return eager_grpo_loss_from_logits(
            logits, labels, advantages, loss_weights, temperature=temperature, **options
        )
    logprobs, entropy = apply_token_logprobs(logits, labels, temperature, resolved, inplace_grad)
    loss, kl, clipped = grpo_loss_from_logprobs(logprobs, entropy, advantages, loss_weights, **options)
    return GRPOLossOutput(loss, logprobs, entropy, kl, clipped)
