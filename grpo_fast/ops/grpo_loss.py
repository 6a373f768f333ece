"""The GRPO loss from logits, without an ``[N, V]`` fp32 tensor.

Split by cost: the vocabulary-sized work (log-softmax of the label, entropy, and their gradient)
is the ``token_logprobs`` kernel pair, one read of the logits forward and one read + one write
backward; the per-row GRPO math (ratio, clipping, KL estimator, entropy bonus, weights) is O(N)
PyTorch on ``[N]`` vectors, ``grpo_fast.algo.core.weighted_grpo_loss`` itself (the eager
reference's row math), whose autograd hands the kernel its two per-row upstream gradients
(g_lp, g_H). At N = 8,192 that row math is a few dozen
elementwise ops on 32 KB vectors, against 2.5 GB of bf16 logits (V = 151,936) for the kernels.
"""

from __future__ import annotations

import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.reference import eager_grpo_loss_from_logits
from grpo_fast.algo.token_loss import GRPOLossOutput, weighted_grpo_loss
from grpo_fast.ops._backend import check_sequence_ids, check_temperature, check_truncation
from grpo_fast.ops.token_logprobs import apply_token_logprobs, prepare_logits

__all__ = ["grpo_loss_from_logits"]


def grpo_loss_from_logits(
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
    backend: str = "auto",
    inplace_grad: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
    **loss_options,
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
        sequence_ids: ``[N]`` int64/int32 with ``importance_sampling_level="sequence"`` (GSPO):
            every row's ratio is its sequence's ``exp(mean_{t∈i}(logp_t − old_t))``, the mean
            over the rows sharing the id (see ``grpo_fast.algo.core.grpo_token_loss``).
        options, **loss_options: the loss options, a ``LossOptions`` and/or its fields as
            keywords (``loss_type`` for ``type``; keywords replace ``options``' values):
            ``loss_type`` (``"grpo_clip"``: the formula above; ``"reinforce_with_baseline"`` /
            ``"no_baseline"``: ``−r_t·A_t`` in place of the min, never clipped; ``"cispo"``:
            ``−sg(clip(r_t, 1−clip_low, 1+clip_high))·A_t·logp_t``), ``clip_low``, ``clip_high``
            (the range ``[1 − clip_low, 1 + clip_high]``), ``dual_clip`` (c > 1), ``delta``
            (``δ > 1``: the unclipped term's ratio capped at δ), ``importance_sampling_level``,
            ``top_entropy_quantile`` (``ρ ∈ (0, 1]``: the policy-gradient term only on the rows
            whose entropy is in the top ρ of the rows with ``loss_weights != 0``), ``beta`` and
            ``kl_estimator`` (the KL term; ``beta != 0`` needs ``ref_logprobs``),
            ``entropy_coef`` (the entropy bonus ``c``). Defaults and domains: ``LossOptions``.
        backend: ``"auto"`` (``triton`` on CUDA, else ``torch_chunked``), ``"triton"``,
            ``"torch_chunked"``, ``"eager"``.
        inplace_grad: write ``∂loss/∂logits`` into the logits buffer (no ``[N, V]`` allocation in the
            backward); the logits are gone after ``backward()``, see ``token_logprobs_and_entropy``.
        top_k, top_p: the sampler's truncation (0 / 1: none): the log-probs, entropies and
            gradients of the truncated distribution it drew from (``token_logprobs_and_entropy``).

    Returns:
        ``GRPOLossOutput``: ``loss`` scalar, ``logprobs`` / ``entropy`` ``[N]`` fp32 (these three
        differentiable in ``logits``), ``kl`` ``[N]`` fp32 | None, ``clipped`` ``[N]`` bool,
        ``log_ratio`` ``[N]``, ``parts`` (the loss by term), ``entropy_threshold``.

    Example:
        >>> logits = torch.zeros(1, 4, requires_grad=True)  # uniform: logp = −log 4
        >>> out = grpo_loss_from_logits(logits, torch.tensor([0]), torch.tensor([1.0]), torch.tensor([0.5]))
        >>> out.loss  # on-policy: ratio 1, loss = −w·A = −0.5
        tensor(-0.5000, grad_fn=<SumBackward0>)
    """
    options = LossOptions.build(options, **loss_options)
    check_temperature(temperature)
    check_truncation(top_k, top_p)
    if options.needs_ref_logprobs and ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    check_sequence_ids(options, sequence_ids, labels)
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
    rows = dict(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, sequence_ids=sequence_ids)
    if resolved == "eager":
        return eager_grpo_loss_from_logits(
            logits, labels, advantages, loss_weights, temperature=temperature, options=options,
            top_k=top_k, top_p=top_p, **rows,
        )  # fmt: skip
    logprobs, entropy = apply_token_logprobs(
        logits, labels, temperature, resolved, inplace_grad, top_k, top_p
    )
    loss, out = weighted_grpo_loss(logprobs, entropy, advantages, loss_weights, options, **rows)
    return GRPOLossOutput(
        loss, logprobs, entropy, out.kl, out.clipped, out.log_ratio, out.parts, out.entropy_threshold
    )
