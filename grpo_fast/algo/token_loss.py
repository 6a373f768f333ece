"""The per-token loss row math of the GRPO family, in plain PyTorch: what every loss op runs on
its ``[N]`` vectors (``weighted_grpo_loss``), the eager reference, the fused ops and the course API
alike.

The clipped surrogate with asymmetric ("clip-higher") and dual clipping or a ratio cap, CISPO,
SAPO, REINFORCE with/without baseline, GSPO's sequence-level ratio, KL to a reference (k1/k2/k3),
the entropy bonus and the top-entropy token mask; the loss split by term (``loss_parts``); what
the ops return (``GRPOLossOutput``).

Shapes: ``B`` sequences, ``T`` tokens per sequence, ``N`` flattened tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpo_fast.algo.loss_options import KL_ESTIMATORS, LossOptions

__all__ = [
    "GRPOLossOutput",
    "LossParts",
    "RowOutputs",
    "check_sequence_ids_given",
    "compute_entropy",
    "entropy_threshold",
    "grpo_clip_loss",
    "grpo_token_loss",
    "kl_penalty",
    "loss_parts",
    "sequence_mean",
    "weighted_grpo_loss",
]


def compute_entropy(logits: torch.Tensor) -> torch.Tensor:
    """Entropy of ``softmax(logits)`` over the last dimension, ``[..., V] -> [...]``.

    Computed from ``log_softmax`` (max-subtracted, so huge logits are safe); ``-inf`` logits
    (a padded vocabulary) contribute exactly 0, in the value and in the gradient.

    Example:
        >>> compute_entropy(torch.zeros(2, 4))  # uniform over 4: log 4 ≈ 1.3863
        tensor([1.3863, 1.3863])
    """
    log_probs = F.log_softmax(logits, dim=-1)
    probs = log_probs.exp()
    # 0·(−inf) would be NaN: zero the log-prob where the probability is exactly 0.
    safe_log_probs = torch.where(probs > 0, log_probs, torch.zeros_like(log_probs))
    return -(probs * safe_log_probs).sum(dim=-1)


def check_sequence_ids_given(options: LossOptions, sequence_ids) -> None:
    """``ValueError`` unless ``sequence_ids`` is given exactly for
    ``importance_sampling_level="sequence"`` (GSPO: each row's ratio is its sequence's)."""
    if (options.importance_sampling_level == "sequence") != (sequence_ids is not None):
        raise ValueError("sequence_ids is needed with importance_sampling_level='sequence', and only then")


def grpo_clip_loss(
    advantages: torch.Tensor,
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    options: LossOptions,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Clipped surrogate with asymmetric ("clip-higher", DAPO) and optional dual clipping.

    ``r = exp(log π − log π_old)``,
    ``ℓ = −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)``; with ``dual_clip = c > 1``
    (Ye et al. 2020), tokens with ``A < 0`` are further bounded: ``ℓ = min(ℓ, −c·A)``. With
    ``delta = δ > 1`` (INTELLECT-2's two-sided clipping, TRL's ``delta``) the unclipped term's
    ratio is capped first: ``ℓ = −min(min(r, δ)·A, clip(r, …)·A)``; for ``δ > 1 + clip_high``
    that bounds the ``A < 0`` tokens at ``−δ·A`` exactly as ``dual_clip = δ`` does. The options
    used: ``clip_low``, ``clip_high``, ``dual_clip``, ``delta``.

    No gradient flows through a clipped branch: for ``A ≥ 0`` once ``r > 1 + clip_high`` and
    for ``A < 0`` once ``r < 1 − clip_low`` (and, with dual clip or delta, once ``r > c``/``δ``).

    Args:
        advantages: ``[B, 1]`` (or broadcastable to ``[B, T]``).
        logprobs, old_logprobs: ``[B, T]``.

    Returns:
        ``(loss [B, T], {"clipped": bool [B, T], "ratio": [B, T] detached})``; ``clipped`` marks
        the tokens whose loss came from a clipped branch.
    """
    o = options
    ratio = torch.exp(logprobs - old_logprobs)
    capped = ratio if o.delta is None else torch.clamp(ratio, max=o.delta)
    unclipped = capped * advantages
    clipped = torch.clamp(ratio, 1 - o.clip_low, 1 + o.clip_high) * advantages
    loss = -torch.minimum(unclipped, clipped)
    is_clipped = (clipped < unclipped) & ((ratio < 1 - o.clip_low) | (ratio > 1 + o.clip_high))
    if o.delta is not None:
        is_clipped = is_clipped | ((unclipped <= clipped) & (ratio > o.delta))
    if o.dual_clip is not None:
        bound = -o.dual_clip * advantages
        dual = (advantages < 0) & (loss > bound)
        loss = torch.where(dual, bound.expand_as(loss), loss)
        is_clipped = is_clipped | dual
    return loss, {"clipped": is_clipped, "ratio": ratio.detach()}


def kl_penalty(logprobs: torch.Tensor, ref_logprobs: torch.Tensor, estimator: str = "k3") -> torch.Tensor:
    """Per-token estimate of ``KL(π ‖ π_ref)`` from samples of π (Schulman, "Approximating KL").

    With ``d = log π_ref − log π``: ``k1 = −d`` (unbiased, can be negative),
    ``k2 = d² / 2`` (low variance, biased), ``k3 = e^d − d − 1`` (unbiased, ≥ 0; GRPO's choice).
    Any pair of policies works: ``kl_penalty(log π_old, log π)`` estimates ``KL(π_old ‖ π)`` from
    samples of π_old (the KL early stop).

    As a loss term ``β·k`` (the gradient flows through ``log π`` of the sampled tokens, the samples
    held fixed), the three give different gradients in expectation over ``y ~ π``:

    - k1: ``∇k1 = ∇log π``, and ``E_π[∇log π] = 0``: zero in expectation, only noise. (k1 belongs
      in the reward, as in PPO-RLHF, where the policy gradient carries it.)
    - k2: ``∇k2 = (log π − log π_ref)·∇log π``, whose expectation is ``∇KL(π ‖ π_ref)``: the
      gradient of the KL it estimates.
    - k3: ``∇k3 = (1 − π_ref/π)·∇log π``, whose expectation is ``−Σ_y π_ref·∇log π =
      ∇KL(π_ref ‖ π)``: the gradient of the *other* direction, although its value estimates
      ``KL(π ‖ π_ref)``. This is what DeepSeekMath's GRPO and TRL's ``GRPOTrainer`` use.

    Example:
        ``log π = 0, log π_ref = ln 2`` → ``d ≈ 0.6931``: k1 ≈ −0.6931, k2 ≈ 0.2402, k3 = 2 − 0.6931 − 1 ≈ 0.3069.
    """
    d = ref_logprobs - logprobs
    if estimator == "k1":
        return -d
    if estimator == "k2":
        return 0.5 * d * d
    if estimator == "k3":
        return torch.exp(d) - d - 1
    raise ValueError(f"unknown KL estimator {estimator!r}; expected one of {', '.join(KL_ESTIMATORS)}")


def sequence_mean(values: torch.Tensor, sequence_ids: torch.Tensor, across=None) -> torch.Tensor:
    """Each entry replaced by the mean over the entries of its sequence: ``[N], [N] -> [N]``.

    ``sequence_ids``: any integer labels (the rows of one sequence share one). Differentiable in
    ``values``; ``torch.unique`` makes it one host-device sync on CUDA.

    ``across`` (sequence parallelism: these rows are one rank's share of sequences split over a
    group of ranks, ``grpo_fast.policy.sequence_parallel.SequenceShard``): the ids are
    ``0 … across.num_sequences − 1`` on every rank, and each sequence's sum and count are summed
    over the group (``across.sum``, differentiable) before the mean.

    Example:
        >>> sequence_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 7]))
        tensor([2., 2., 5.])
    """
    if across is not None:  # [2, S] sums and counts over the group's ranks: one collective
        n_seq = across.num_sequences
        local = torch.stack(
            [
                values.new_zeros(n_seq).index_add(0, sequence_ids, values),
                torch.bincount(sequence_ids, minlength=n_seq).to(values.dtype),
            ]
        )
        sums, counts = across.sum(local).unbind(0)
        return (sums / counts.clamp(min=1))[sequence_ids]
    _, inverse = torch.unique(sequence_ids, return_inverse=True)
    n_seq = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = values.new_zeros(n_seq).index_add(0, inverse, values)
    counts = torch.bincount(inverse, minlength=n_seq).to(values.dtype)
    return (sums / counts)[inverse]


def entropy_threshold(
    entropy: torch.Tensor, token_mask: torch.Tensor, quantile: float, across=None
) -> torch.Tensor:
    """The entropy above which a token is in the top ``quantile`` of the masked tokens (a 0-dim tensor).

    "Beyond the 80/20 rule" (Wang et al. 2025) trains on the high-entropy "forking" tokens only:
    the ``(1 − quantile)``-quantile of ``entropy[token_mask]`` (linear interpolation, as
    ``torch.quantile``); tokens with ``H ≥`` it are kept. ``quantile = 1`` keeps every token
    (the threshold is the smallest entropy); no masked token gives ``+inf``. ``across`` (sequence
    parallelism, as ``sequence_mean``): the quantile of every rank's masked entropies
    (``across.gather``), the same threshold on each.

    Example:
        >>> entropy_threshold(torch.tensor([0.1, 2.0, 0.5, 1.0, 9.0]), torch.tensor([1, 1, 1, 1, 0]).bool(), 0.5)
        tensor(0.7500)
    """
    h = entropy.detach()[token_mask]
    if across is not None:
        h = across.gather(h)
    if h.numel() == 0:
        return entropy.new_tensor(math.inf)
    return torch.quantile(h, 1.0 - quantile)


def _policy_gradient(
    logprobs: torch.Tensor, log_ratio: torch.Tensor, advantages: torch.Tensor, o: LossOptions
) -> tuple[torch.Tensor, torch.Tensor]:
    """The policy-gradient term ``pg`` of ``o.type`` for the ratio ``exp(log_ratio)`` and the
    tokens it clipped or capped (``grpo_token_loss`` has the formulas)."""
    if o.type == "grpo_clip":
        loss, meta = grpo_clip_loss(advantages, log_ratio, torch.zeros_like(log_ratio), o)
        return loss, meta["clipped"]
    ratio = torch.exp(log_ratio)
    if o.type == "sapo":
        # τ by the advantage's sign (A = 0 takes τ_neg, as TRL: its term is 0 either way)
        tau = torch.where(advantages > 0, ratio.new_tensor(o.sapo_tau_pos), ratio.new_tensor(o.sapo_tau_neg))
        loss = -(4.0 / tau) * torch.sigmoid(tau * (ratio - 1.0)) * advantages
        return loss, torch.zeros_like(loss, dtype=torch.bool)  # a gate, never a clip
    if o.type == "cispo":
        low = 1 - o.clip_low
        high = 1 + o.clip_high if o.delta is None else min(1 + o.clip_high, o.delta)
        weight = ratio.detach().clamp(low, high)
        loss = -weight * advantages * logprobs
        is_clipped = (ratio < low) | (ratio > high)
    else:
        loss = -(ratio if o.delta is None else torch.clamp(ratio, max=o.delta)) * advantages
        is_clipped = ratio > (math.inf if o.delta is None else o.delta)
    return loss, is_clipped.detach().expand(loss.shape)


def _top_entropy_only(loss, entropy, token_mask, quantile: float, across=None):
    """``(loss·[H ≥ threshold], threshold)`` for ``top_entropy_quantile = quantile < 1`` (the mask
    detached; ``grpo_token_loss``), ``(loss, None)`` for 1."""
    if quantile == 1.0:
        return loss, None
    if entropy is None:
        raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
    mask = torch.ones_like(entropy, dtype=torch.bool) if token_mask is None else token_mask.bool()
    threshold = entropy_threshold(entropy, mask, quantile, across)
    return loss * (entropy.detach() >= threshold).to(loss.dtype), threshold


def grpo_token_loss(
    logprobs: torch.Tensor,
    advantages: torch.Tensor,
    options: LossOptions,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    entropy: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    token_mask: torch.Tensor | None = None,
    across=None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor | None]]:
    """The full per-token GRPO loss, before length normalization.

    ``ℓ_t = pg_t + β·KL_t − c·H_t`` with ``r_t = exp(log π_t − log π_old,t)`` and, by ``options.type``:

    - ``grpo_clip``: ``pg = −min(r·A, clip(r, 1 − clip_low, 1 + clip_high)·A)`` (and the dual clip);
    - ``reinforce_with_baseline``, ``no_baseline``: ``pg = −r·A``, never clipped (``clip_*``
      unused). The two differ in what the caller passes as ``A``: reward minus the group
      baseline, or the raw reward.
    - ``cispo`` (MiniMax-M1): ``pg = −sg(clip(r, 1 − clip_low, 1 + clip_high))·A·log π``: the
      importance weight is clipped and detached (``sg``), so every token keeps a gradient,
      ``−ŵ·A·∇log π``, bounded by the clip range instead of cut off.
    - ``sapo`` (SAPO, arXiv 2511.20347; TRL's): ``pg = −(4/τ)·σ(τ·(r − 1))·A``, ``τ = sapo_tau_pos``
      where ``A > 0`` else ``sapo_tau_neg``: a smooth gate, nothing ``clipped``; its gradient
      ``−4σ(1 − σ)·r·A·∇log π`` is GRPO's on-policy and fades smoothly as ``r`` leaves 1.

    ``delta = δ > 1`` caps the ratio of the unclipped term at δ for every type (``min(r, δ)``;
    for ``cispo`` the weight's upper bound is ``min(1 + clip_high, δ)``): a token with ``r > δ``
    gets no gradient (``cispo``: weight δ).

    ``clipped`` marks the tokens whose ratio was clipped or capped: no gradient through ``r``
    (``grpo_clip``, ``delta``), or a clipped weight (``cispo``; the gradient still flows).

    ``importance_sampling_level="sequence"`` (GSPO, Zheng et al. 2025) replaces every token's
    ratio by its sequence's, ``s_i = exp(mean_{t∈i}(log π_t − log π_old,t))`` (``sequence_ids``
    says which rows form sequence ``i``; the mean is over all of them), clipped with the same
    ``clip_low``/``clip_high`` (GSPO's are small, e.g. 3e-4 / 4e-4). The gradient of ``s_i``
    reaches every token of ``i``: ``∂s_i/∂log π_t = s_i/|i|``. On-policy ``s_i = 1`` and the
    token gradient is ``−A·(Σ_{t'∈i} w_t')/|i|``: with sequence-mean weights ``1/(|i|·B)`` that is
    ``−A·w_t``, token-level GRPO.

    ``top_entropy_quantile = ρ < 1`` keeps the policy-gradient term only on the tokens whose
    entropy is in the top ρ of the ``token_mask`` tokens (``entropy_threshold``; default mask: all
    of them): ``pg_t ← pg_t·[H_t ≥ threshold]``, the mask detached; the KL and entropy terms stay
    on every token (as TRL's ``top_entropy_quantile``).

    ``old_logprobs=None`` means on-policy: π_old is π detached, so ``r = 1`` and the gradient is
    ``−A·∇log π`` (no extra forward pass needed) for every type.

    Example:
        ``A = 1``, ``log π − log π_old = 0.5``: ``r = e^0.5 ≈ 1.6487``; ``grpo_clip`` gives
        ``ℓ = −1.2`` (clipped, no gradient), ``reinforce_with_baseline`` ``ℓ ≈ −1.6487``,
        with ``log π = −1`` ``cispo`` gives ``ℓ = −1.2·1·(−1) = 1.2`` with gradient ``−1.2``, and
        ``sapo`` (τ = 1) ``ℓ = −4·σ(0.6487) ≈ −2.6269`` with gradient ``−4σ(1 − σ)·r ≈ −1.4867``.

    Args:
        logprobs: ``[...]`` per-token log π (differentiable).
        advantages: broadcastable to ``logprobs`` (``[B, 1]`` for ``[B, T]``, ``[N]`` for ``[N]``).
        options: the loss options (``LossOptions``, validated when built).
        old_logprobs, ref_logprobs, entropy: same shape as ``logprobs`` or None.
        sequence_ids: ``[N]`` int, given exactly with ``importance_sampling_level="sequence"``.
        across: sequence parallelism's group: the sequence mean, the quantile over it (``sequence_mean``).

    Returns:
        ``(loss [...], meta)``; meta: ``pg`` (the policy-gradient term, differentiable),
        ``clipped`` (bool), ``log_ratio`` (detached: the token's ``log r``, with GSPO its
        sequence's), ``kl`` (the estimate, not times β; None without ``ref_logprobs``),
        ``entropy_threshold`` (0-dim, None for ρ = 1).
    """
    o = options
    old = logprobs.detach() if old_logprobs is None else old_logprobs
    check_sequence_ids_given(o, sequence_ids)
    log_ratio = logprobs - old
    if sequence_ids is not None:
        log_ratio = sequence_mean(log_ratio, sequence_ids, across)
    loss, clipped = _policy_gradient(logprobs, log_ratio, advantages, o)
    loss, threshold = _top_entropy_only(loss, entropy, token_mask, o.top_entropy_quantile, across)
    pg = loss
    kl = None
    if ref_logprobs is not None:
        kl = kl_penalty(logprobs, ref_logprobs, o.kl_estimator)
        if o.beta != 0.0:
            loss = loss + o.beta * kl
    if o.entropy_coef != 0.0:
        if entropy is None:
            raise ValueError("entropy_coef != 0 needs the per-token entropy")
        loss = loss - o.entropy_coef * entropy
    meta = {
        "pg": pg,
        "clipped": clipped,
        "log_ratio": log_ratio.detach().expand(loss.shape),
        "kl": kl,
        "entropy_threshold": threshold,
    }
    return loss, meta


class LossParts(NamedTuple):
    """The batch loss split by term, each ``Σ_t w_t·term_t`` (0-dim fp32, detached):
    ``loss = pg + kl + entropy`` up to fp32 summation order."""

    pg: torch.Tensor  # Σ w·pg
    kl: torch.Tensor  # Σ w·β·KL (0 when β = 0 or no reference)
    entropy: torch.Tensor  # −Σ w·c·H (0 when c = 0)


@torch.no_grad()
def loss_parts(
    loss_weights: torch.Tensor,
    pg: torch.Tensor,
    kl: torch.Tensor | None,
    entropy: torch.Tensor,
    options: LossOptions,
) -> LossParts:
    """``LossParts`` of per-token ``pg``, ``kl`` (the estimate) and ``entropy``, all ``[N]``, in
    their dtype (fp32 in the ops, fp64 in the float64 reference)."""
    w, pg = loss_weights, pg.detach()
    zero = pg.new_zeros(())
    kl_sum = options.beta * (w * kl).sum() if options.beta != 0 and kl is not None else zero
    ent_sum = -options.entropy_coef * (w * entropy).sum() if options.entropy_coef != 0 else zero
    return LossParts((w * pg).sum(), kl_sum, ent_sum)


class RowOutputs(NamedTuple):
    """What the row math gives besides the loss, for ``N`` rows (all detached).

    Fields:
        kl: ``[N]`` the KL estimate to the reference (not times β), or None without ``ref_logprobs``.
        clipped: ``[N]`` bool, the token's loss came from a clipped branch.
        log_ratio: ``[N]`` ``log r`` as the loss used it: the token's, with GSPO its sequence's
            (0 on-policy).
        parts: ``LossParts``, the loss split by term.
        entropy_threshold: 0-dim, the top-entropy threshold (None for ``top_entropy_quantile = 1``).
    """

    kl: torch.Tensor | None
    clipped: torch.Tensor
    log_ratio: torch.Tensor
    parts: LossParts
    entropy_threshold: torch.Tensor | None


def weighted_grpo_loss(
    logprobs: torch.Tensor,
    entropy: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    options: LossOptions,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    sequence_ids: torch.Tensor | None = None,
    across=None,
) -> tuple[torch.Tensor, RowOutputs]:
    """The row math of every GRPO loss op: ``loss = Σ_t w_t·ℓ_t`` on ``[N]`` vectors.

    ``ℓ`` from ``grpo_token_loss``, with the per-row inputs cast to ``logprobs``' dtype (fp32 in
    the ops, fp64 in the float64 reference); the top-entropy quantile is over the rows with
    ``loss_weights != 0``. Differentiable in ``logprobs`` and ``entropy``. ``across``: the rows are
    one sequence-parallel rank's share (``grpo_token_loss``); ``loss`` is then that rank's part.
    """
    cast = lambda t: None if t is None else t.to(logprobs.dtype)
    per_token, meta = grpo_token_loss(
        logprobs,
        cast(advantages),
        options,
        old_logprobs=cast(old_logprobs),
        ref_logprobs=cast(ref_logprobs),
        entropy=entropy,
        sequence_ids=sequence_ids,
        token_mask=loss_weights != 0,  # the quantile is over the tokens that count
        across=across,
    )
    w = cast(loss_weights)
    loss = (w * per_token).sum()
    kl = None if meta["kl"] is None else meta["kl"].detach()
    parts = loss_parts(w, meta["pg"], kl, entropy.detach(), options)
    return loss, RowOutputs(kl, meta["clipped"], meta["log_ratio"], parts, meta["entropy_threshold"])


class GRPOLossOutput(NamedTuple):
    """What the GRPO loss ops return. N = number of (response) tokens.

    Fields:
        loss: scalar, ``Σ_t w_t·ℓ_t`` (differentiable).
        logprobs: ``[N]`` fp32, log π of the labels (after temperature).
        entropy: ``[N]`` fp32, entropy of the tempered distribution.
        kl: ``[N]`` fp32 per-token KL estimate to the reference, or None without ``ref_logprobs``.
        clipped: ``[N]`` bool, the token's loss came from a clipped branch.
        log_ratio: ``[N]`` fp32 ``log r`` as the loss used it (the token's; GSPO: its sequence's).
        parts: ``LossParts`` (0-dim fp32 each): ``loss = parts.pg + parts.kl + parts.entropy``.
        entropy_threshold: 0-dim, the top-entropy threshold, or None (``top_entropy_quantile = 1``).
        values, value_loss, value_clipped: with a value head (``PolicyLoss.value_head``,
            ``loss.advantage=gae``): ``[N]`` fp32 the head's values (detached), the weighted
            clipped value loss (0-dim, differentiable; not in ``loss``), ``[N]`` bool the tokens
            whose clipped branch was the larger; None otherwise (the fused ops never set them).

    ``clipped_low`` / ``clipped_high``: the clipped tokens whose ratio was below / above 1.
    """

    loss: torch.Tensor
    logprobs: torch.Tensor
    entropy: torch.Tensor
    kl: torch.Tensor | None
    clipped: torch.Tensor
    log_ratio: torch.Tensor
    parts: LossParts
    entropy_threshold: torch.Tensor | None = None
    values: torch.Tensor | None = None
    value_loss: torch.Tensor | None = None
    value_clipped: torch.Tensor | None = None

    @property
    def backward_loss(self) -> torch.Tensor:
        """What the backward takes: ``loss``, plus ``value_loss`` with a value head."""
        return self.loss if self.value_loss is None else self.loss + self.value_loss

    @property
    def clipped_low(self) -> torch.Tensor:
        return self.clipped & (self.log_ratio < 0)

    @property
    def clipped_high(self) -> torch.Tensor:
        return self.clipped & (self.log_ratio > 0)
