"""The GRPO algorithm core in plain PyTorch: the eager reference for every fused kernel.

The GRPO family the engine uses: group-normalized advantages (``normalize_group_rewards``) and
DAPO's dynamic-sampling filter and overlong penalty, asymmetric ("clip-higher") and dual
clipping, CISPO and GSPO, KL to a reference policy (k1/k2/k3), an adaptive KL coefficient, KL
early stop, an entropy bonus, three length normalizations expressed as per-token loss weights,
and the eager ``[N, V]``-logits reference of the fused ops (``eager_token_logprobs_and_entropy``,
``eager_grpo_loss_from_logits``) that ``grpo_fast.ops`` is tested against.

The Stanford CS336 assignment-5 helper API lives in ``grpo_fast.algo.course``, built on this module;
of its names only ``compute_entropy`` is defined here, because the eager reference uses it.

Shapes: ``B`` sequences, ``T`` tokens per sequence, ``N`` flattened tokens, ``V`` vocabulary.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F

from grpo_fast.algo.loss_options import KL_ESTIMATORS, LossOptions

__all__ = [
    "LENGTH_NORMS",
    "SCALE_REWARDS",
    "AdaptiveKLController",
    "GRPOLossOutput",
    "LossParts",
    "RowOutputs",
    "adaptive_entropy_coef",
    "applied_entropy_coef",
    "check_sequence_ids_given",
    "compute_entropy",
    "eager_grpo_loss_from_logits",
    "eager_token_logprobs_and_entropy",
    "entropy_threshold",
    "grpo_clip_loss",
    "grpo_token_loss",
    "informative_groups",
    "kl_early_stop",
    "kl_penalty",
    "length_norm_weights",
    "loss_parts",
    "normalize_each_reward",
    "normalize_group_rewards",
    "overlong_penalty",
    "sequence_mean",
    "truncated_logits",
    "truncates",
    "truncation_threshold",
    "weighted_grpo_loss",
]

LENGTH_NORMS = ("sequence_mean", "constant", "token_mean")  # loss.length_norm
SCALE_REWARDS = ("group", "batch", "none")  # loss.scale_rewards


# ----------------------------------------------------------------------------------------------
# Entropy
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# Rewards and advantages
# ----------------------------------------------------------------------------------------------


def normalize_group_rewards(
    raw_rewards: torch.Tensor,
    group_size: int | Sequence[int],
    advantage_eps: float,
    normalize_by_std: bool = True,
    *,
    scale_rewards: str | None = None,
    reduce_sums: Callable[[list[float]], list[float]] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """Group-normalized advantages of rewards already scored (the course's
    ``grpo_fast.algo.course.compute_group_normalized_rewards`` scores them first, then calls this; the
    training loop calls it directly on a batch assembled from several rounds of dynamic sampling).

    ``A_i = r_i − mean(group)``, then divided by a std by ``scale_rewards`` (``loss.scale_rewards``;
    every std unbiased, as ``torch.std``):

    - ``group``: ``std(group) + advantage_eps`` (GRPO);
    - ``batch``: ``std(all B rewards) + advantage_eps`` (one scale for the whole batch, as TRL's
      ``scale_rewards="batch"``), across ranks with ``reduce_sums``;
    - ``none``: no scaling (Dr. GRPO).

    ``scale_rewards=None`` keeps the CS336 flag: ``group`` if ``normalize_by_std`` else ``none``.
    A zero-variance group (all rewards equal: nothing to learn from it) gets advantage exactly 0,
    never NaN, and is counted in ``metadata["zero_variance_groups"]``.

    Args:
        raw_rewards: ``[B]`` fp32, groups contiguous.
        group_size: one size for every group, or a list of sizes summing to ``B``.
        advantage_eps: added to the std before dividing.
        reduce_sums: for ``batch``, a function summing ``[count, Σr, Σr²]`` over the
            data-parallel ranks (``lambda x: dist.all_reduce_sum(x, device)``); None = these
            rewards are the whole batch.

    Returns:
        ``(advantages [B] fp32, metadata)``; metadata: ``reward_mean reward_std reward_min
        reward_max num_groups zero_variance_groups zero_variance_fraction advantage_abs_mean``.

    Example:
        Rewards ``[1, 0, 0, 0]`` in one group: mean 0.25, unbiased std 0.5, so without std
        the advantages are ``[0.75, -0.25, -0.25, -0.25]`` and with std ``[1.5, -0.5, -0.5, -0.5]``.
        Sizes ``[2, 3]``, rewards ``[1, 0, 1, 1, 1]``, ``scale_rewards="none"``: group 1's mean 0.5
        gives ``[0.5, -0.5]``; group 2 has zero variance: ``[0, 0, 0]``.
    """
    scale = scale_rewards if scale_rewards is not None else ("group" if normalize_by_std else "none")
    if scale not in SCALE_REWARDS:
        raise ValueError(f"unknown scale_rewards {scale!r}; expected one of {', '.join(SCALE_REWARDS)}")
    sizes = _check_group_sizes(group_size, raw_rewards.numel())
    if sizes is not None and len(set(sizes)) == 1:
        group_size, sizes = sizes[0], None  # equal sizes: the [n_groups, G] path below, bit for bit
    if sizes is None:
        grouped = raw_rewards.view(-1, group_size)
        advantages = grouped - grouped.mean(dim=1, keepdim=True)
        if scale == "group" and group_size > 1:  # a group of one has no std (and zero advantage below)
            advantages = advantages / (grouped.std(dim=1, keepdim=True) + advantage_eps)
        zero_var = grouped.max(dim=1).values == grouped.min(dim=1).values  # [n_groups]
    else:
        groups = raw_rewards.split(sizes)
        centred = [g - g.mean() for g in groups]
        if scale == "group":  # a group of one has no std (and zero advantage below)
            centred = [c / (g.std() + advantage_eps) if len(g) > 1 else c for c, g in zip(centred, groups)]
        advantages = torch.cat(centred)
        zero_var = torch.tensor([bool(g.max() == g.min()) for g in groups])  # [n_groups]
    if scale == "batch":
        r64 = raw_rewards.double()
        sums = [float(r64.numel()), r64.sum().item(), (r64 * r64).sum().item()]
        count, total, squares = reduce_sums(sums) if reduce_sums is not None else sums
        mean = total / count
        var = max(squares - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
        advantages = advantages / (math.sqrt(var) + advantage_eps)
    if sizes is None:
        advantages = torch.where(zero_var[:, None], torch.zeros_like(advantages), advantages).reshape(-1)
    else:
        per_response = zero_var.repeat_interleave(torch.tensor(sizes))  # [B]
        advantages = torch.where(per_response, torch.zeros_like(advantages), advantages)

    n = raw_rewards.numel()
    metadata: dict[str, float] = {
        "reward_mean": raw_rewards.mean().item(),
        "reward_std": raw_rewards.std().item() if n > 1 else 0.0,
        "reward_min": raw_rewards.min().item(),
        "reward_max": raw_rewards.max().item(),
        "num_groups": float(zero_var.numel()),
        "zero_variance_groups": float(zero_var.sum().item()),
        "zero_variance_fraction": zero_var.float().mean().item(),
        "advantage_abs_mean": advantages.abs().mean().item(),
    }
    return advantages, metadata


def normalize_each_reward(
    part_rewards: Sequence[torch.Tensor],
    weights: Sequence[float],
    group_size: int | Sequence[int],
    advantage_eps: float,
    *,
    scale_rewards: str,
    reduce_sums: Callable[[list[float]], list[float]] | None = None,
) -> torch.Tensor:
    """``data.reward_aggregation=normalize_each`` (GDPO): each reward normalized within its group
    (``normalize_group_rewards`` with ``scale_rewards``: centred, then scaled by the group's, the
    batch's or no std), then weighted and summed: ``A = Σ_k w_k·normalize(r_k)``, ``[B]`` fp32.
    With one reward of weight 1 this is ``normalize_group_rewards(r_1)`` bit for bit (``sum``).
    Unlike TRL's ``multi_objective_aggregation="normalize_then_sum"``, the sum is not normalized
    again over the batch.

    Why: normalizing the weighted sum lets one reward's spread drown another's, and distinct
    reward combinations collapse to the same advantage; each reward's own group-normalized
    signal keeps them apart.

    Example (one group of 4, ``scale_rewards="group"``, ε = 0): ``r_1 = [1, 0, 0, 0]`` (mean 0.25,
    std 0.5) gives ``[1.5, −0.5, −0.5, −0.5]``; ``r_2 = [0, 1, 1, 1]`` gives ``[−1.5, 0.5, 0.5,
    0.5]``; weights ``[1, 0.5]``: ``A = [0.75, −0.25, −0.25, −0.25]``. Normalizing the sum
    ``[1, 0.5, 0.5, 0.5]`` (mean 0.625, std 0.25) would give ``[1.5, −0.5, −0.5, −0.5]``.
    """
    if not part_rewards or len(part_rewards) != len(weights):
        raise ValueError(f"{len(part_rewards)} rewards need as many weights, got {len(weights)}")
    total = None
    for rewards, w in zip(part_rewards, weights):
        adv, _ = normalize_group_rewards(
            rewards, group_size, advantage_eps, scale_rewards=scale_rewards, reduce_sums=reduce_sums
        )
        term = float(w) * adv
        total = term if total is None else total + term
    return total


def informative_groups(raw_rewards: torch.Tensor, group_size: int | Sequence[int]) -> list[bool]:
    """Per group, whether its rewards differ (``max > min``): the groups DAPO's dynamic sampling
    keeps. A group whose rewards are all equal has advantage 0 for every response: nothing to
    learn from it. ``raw_rewards [B]``, groups contiguous (sizes as ``normalize_group_rewards``).

    Example:
        >>> informative_groups(torch.tensor([1.0, 0.0, 1.0, 1.0, 0.0, 0.0, 0.5]), [2, 2, 3])
        [True, False, True]
    """
    sizes = _check_group_sizes(group_size, raw_rewards.numel())
    sizes = sizes if sizes is not None else [group_size] * (raw_rewards.numel() // group_size)
    return [bool(g.max() > g.min()) for g in raw_rewards.split(sizes)]


def overlong_penalty(
    lengths: Sequence[int] | torch.Tensor, max_tokens: int, buffer: int, penalty: float = 1.0
) -> torch.Tensor:
    """DAPO's soft overlong punishment, a reward added per response: ``[B] -> [B]`` fp32.

    With ``L = max_tokens`` and the buffer ``c``: 0 for ``length ≤ L − c``;
    ``−penalty · (length − (L − c)) / c`` for ``L − c < length < L`` (falling linearly);
    ``−penalty`` for ``length ≥ L``. ``buffer = 0`` turns it off (all zeros). ``data.overlong_buffer``
    and ``data.overlong_penalty``; the lengths count response tokens.

    Example:
        >>> overlong_penalty([10, 16, 17, 18, 20, 21], max_tokens=20, buffer=4, penalty=1.0)
        tensor([ 0.0000,  0.0000, -0.2500, -0.5000, -1.0000, -1.0000])
    """
    lengths = torch.as_tensor(lengths, dtype=torch.float32)
    if buffer < 0 or buffer >= max_tokens:
        raise ValueError(f"buffer={buffer} must be in [0, max_tokens={max_tokens})")
    if buffer == 0:
        return torch.zeros_like(lengths)
    over = (lengths - (max_tokens - buffer)).clamp(0.0, float(buffer))  # tokens into the buffer
    return 0.0 - over * (penalty / buffer)  # 0.0 − 0 is +0.0, not −0.0


def _check_group_sizes(group_size: int | Sequence[int], n: int) -> list[int] | None:
    """None for one int size that divides ``n``; the list of sizes when they are positive and sum to ``n``."""
    if isinstance(group_size, int):
        if group_size < 1 or n % group_size:
            raise ValueError(f"group_size={group_size} must be >= 1 and divide the {n} responses")
        return None
    sizes = [int(g) for g in group_size]
    if not sizes or min(sizes) < 1 or sum(sizes) != n:
        raise ValueError(f"group sizes {sizes} must each be >= 1 and sum to the {n} responses")
    return sizes


# ----------------------------------------------------------------------------------------------
# Per-token policy-gradient losses (the GRPO family)
# ----------------------------------------------------------------------------------------------


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


def sequence_mean(values: torch.Tensor, sequence_ids: torch.Tensor) -> torch.Tensor:
    """Each entry replaced by the mean over the entries of its sequence: ``[N], [N] -> [N]``.

    ``sequence_ids``: any integer labels (the rows of one sequence share one). Differentiable in
    ``values``; ``torch.unique`` makes it one host-device sync on CUDA.

    Example:
        >>> sequence_mean(torch.tensor([1.0, 3.0, 5.0]), torch.tensor([0, 0, 7]))
        tensor([2., 2., 5.])
    """
    _, inverse = torch.unique(sequence_ids, return_inverse=True)
    n_seq = int(inverse.max()) + 1 if inverse.numel() else 0
    sums = values.new_zeros(n_seq).index_add(0, inverse, values)
    counts = torch.bincount(inverse, minlength=n_seq).to(values.dtype)
    return (sums / counts)[inverse]


def entropy_threshold(entropy: torch.Tensor, token_mask: torch.Tensor, quantile: float) -> torch.Tensor:
    """The entropy above which a token is in the top ``quantile`` of the masked tokens (a 0-dim tensor).

    "Beyond the 80/20 rule" (Wang et al. 2025) trains on the high-entropy "forking" tokens only:
    the ``(1 − quantile)``-quantile of ``entropy[token_mask]`` (linear interpolation, as
    ``torch.quantile``); tokens with ``H ≥`` it are kept. ``quantile = 1`` keeps every token
    (the threshold is the smallest entropy); no masked token gives ``+inf``.

    Example:
        >>> entropy_threshold(torch.tensor([0.1, 2.0, 0.5, 1.0, 9.0]), torch.tensor([1, 1, 1, 1, 0]).bool(), 0.5)
        tensor(0.7500)
    """
    h = entropy.detach()[token_mask]
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
        log_ratio = sequence_mean(log_ratio, sequence_ids)
    loss, clipped = _policy_gradient(logprobs, log_ratio, advantages, o)
    threshold = None
    if o.top_entropy_quantile != 1.0:
        if entropy is None:
            raise ValueError("top_entropy_quantile < 1 needs the per-token entropy")
        mask = torch.ones_like(entropy, dtype=torch.bool) if token_mask is None else token_mask.bool()
        threshold = entropy_threshold(entropy, mask, o.top_entropy_quantile)
        loss = loss * (entropy.detach() >= threshold).to(loss.dtype)
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


# ----------------------------------------------------------------------------------------------
# Length normalization as per-token loss weights
# ----------------------------------------------------------------------------------------------


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


# ----------------------------------------------------------------------------------------------
# KL control
# ----------------------------------------------------------------------------------------------


@dataclass
class AdaptiveKLController:
    """Proportional controller for the KL coefficient β (Ziegler et al. 2019, §2.2).

    After each step: ``e = clip(KL / target − 1, −0.2, 0.2)``, ``β ← β·(1 + e·n / horizon)``
    where ``n`` is the number of sequences the KL was measured on. β rises while the measured
    KL is above target and falls while below.

    The training loop passes the per-token KL (the mean over response tokens of the
    ``loss.kl_estimator`` estimate, ``train/kl``), so ``loss.target_kl`` is a per-token target.
    Ziegler et al. target the per-sequence KL (the sum over a response, e.g. 6 nats); the
    per-token equivalent is that divided by the mean response length.

    Example:
        β = 0.1, target 0.05, measured 0.1, n = 64, horizon 10,000: e = 0.2 (clipped from 1),
        β ← 0.1·(1 + 0.2·64/10,000) = 0.100128.
    """

    beta: float
    target_kl: float
    horizon: int = 10_000

    def update(self, current_kl: float, n_steps: int) -> float:
        if not math.isfinite(current_kl):
            return self.beta
        error = min(max(current_kl / self.target_kl - 1.0, -0.2), 0.2)
        self.beta *= 1.0 + error * n_steps / self.horizon
        return self.beta

    def state_dict(self) -> dict[str, float]:
        return {"beta": self.beta, "target_kl": self.target_kl, "horizon": self.horizon}

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.beta = float(state["beta"])
        self.target_kl = float(state["target_kl"])
        self.horizon = int(state["horizon"])


def adaptive_entropy_coef(
    coef: float, entropy: float, target: float, step_size: float, coef_max: float
) -> float:
    """One step of the adaptive entropy coefficient (Skywork-OR1's adaptive entropy control; TRL's
    ``use_adaptive_entropy``): ``c ← min(c + Δ, c_max)`` when the step's mean token entropy is at
    or below ``target``, else ``max(c − Δ, 0)``. The coefficient enters the loss (``−c·H``) only
    while the last measured entropy is at or below the target (``applied_entropy_coef``). A NaN
    entropy leaves ``c`` as it is.

    Example: ``c = 0.01``, Δ = 0.005, target 0.5, c_max 0.012: ``H = 0.4`` → ``min(0.015, 0.012) =
    0.012``; ``H = 0.6`` → ``0.005``; from ``c = 0.003``, ``H = 0.6`` → ``max(−0.002, 0) = 0``.
    """
    if math.isnan(entropy):
        return coef
    if entropy <= target:
        return min(coef + step_size, coef_max)
    return max(coef - step_size, 0.0)


def applied_entropy_coef(coef: float, last_entropy: float, target: float) -> float:
    """The entropy coefficient a step's loss uses: ``coef`` if the last step's mean token entropy
    was at or below ``target``, else 0 (TRL's gate; ``last_entropy = inf`` before the first step,
    so the first step applies none). Example: ``(0.02, 0.4, 0.5) → 0.02``, ``(0.02, 0.6, 0.5) → 0.0``."""
    return coef if last_entropy <= target else 0.0


def kl_early_stop(approx_kl: float, threshold: float | None) -> bool:
    """Whether to stop the inner epochs on this rollout batch: its KL to π_old exceeds ``threshold``.

    ``threshold=None`` (or ≤ 0) never stops. NaN KL stops (something is badly wrong).
    Example: ``kl_early_stop(0.31, 0.3)`` is True, ``kl_early_stop(0.29, 0.3)`` is False.
    """
    if threshold is None or threshold <= 0:
        return False
    return not (approx_kl <= threshold)


# ----------------------------------------------------------------------------------------------
# The eager [N, V] reference of the fused ops (grpo_fast.ops)
# ----------------------------------------------------------------------------------------------


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
) -> tuple[torch.Tensor, RowOutputs]:
    """The row math of every GRPO loss op: ``loss = Σ_t w_t·ℓ_t`` on ``[N]`` vectors.

    ``ℓ`` from ``grpo_token_loss``, with the per-row inputs cast to ``logprobs``' dtype (fp32 in
    the ops, fp64 in the float64 reference); the top-entropy quantile is over the rows with
    ``loss_weights != 0``. Differentiable in ``logprobs`` and ``entropy``.
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

    @property
    def clipped_low(self) -> torch.Tensor:
        return self.clipped & (self.log_ratio < 0)

    @property
    def clipped_high(self) -> torch.Tensor:
        return self.clipped & (self.log_ratio > 0)


def truncates(top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether top-k (``0 < top_k < V``) and/or top-p (``top_p < 1``) sampling leaves tokens out."""
    return 0 < top_k < vocab_size or top_p < 1.0


@torch.no_grad()
def truncation_threshold(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Per row, the threshold ``τ`` of top-k and/or top-p sampling: ``[R, V] -> [R]`` (``scaled``'s
    dtype): the sampler keeps exactly the tokens with ``s_j ≥ τ`` (``s`` = the logits after the
    temperature), draws from ``softmax`` over them, and ``log π_trunc(a) = s_a − logsumexp_kept s``.

    The order of operations is vLLM's (0.32, ``apply_top_k_top_p_pytorch``) and transformers'
    (temperature, then ``TopKLogitsWarper``, then ``TopPLogitsWarper``):

    1. top-k (``0 < top_k < V``): the ``top_k`` largest ``s``; a tie with the k-th value is kept
       (both mask ``s < s_(k)``).
    2. top-p (``top_p < 1``), on the softmax of what top-k kept: from the largest down, the
       smallest prefix whose mass reaches ``top_p`` (a token is kept iff the mass strictly above
       it is ``< top_p``: vLLM's "ascending cumulative sum ≤ 1 − p" removed); the prefix sums in
       float64. A tie with the last kept value is kept (vLLM breaks such ties by its sort order).

    ``τ`` is the midpoint between the last kept value and the largest left-out one (``−inf``
    when nothing is left out), so that a kernel recomputing ``s`` to the last ulp keeps the same
    set: the kept values and the left-out ones are ``τ`` apart on either side. No truncation
    (``truncates`` false): ``−inf``. The sampled token is kept by the kernels whatever ``τ``
    (``truncated_logits``): recomputed under other weights (π_ref, a later epoch) it may fall
    outside, where its log-prob would be ``−inf``.

    Example:
        >>> s = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax: 0.644 0.237 0.087 0.032
        >>> truncation_threshold(s, top_k=2), truncation_threshold(s, top_p=0.9)  # keeps 2 / 3 tokens
        (tensor([0.5000]), tensor([-0.5000]))
    """
    r, v = scaled.shape
    k = top_k if 0 < top_k < v else 0
    inf = torch.full((r,), -math.inf, dtype=scaled.dtype, device=scaled.device)
    if not truncates(k, top_p, v):
        return inf
    if top_p >= 1.0:  # top-k alone: no sort
        kth = scaled.topk(k, dim=-1).values[:, -1:]  # [R, V] -> [R, 1]: s_(k)
        below = scaled.masked_fill(scaled >= kth, -math.inf).amax(-1)  # the largest left out
        return (kth[:, 0] + below) / 2  # −inf when only −inf entries are left out
    values = scaled.sort(dim=-1, descending=True).values  # [R, V]: s_(1) ≥ s_(2) ≥ …
    kept = torch.full((r,), v, dtype=torch.long, device=scaled.device)  # how many, a prefix of values
    if k:
        kept = (values >= values[:, k - 1 : k]).sum(-1)  # [R, V] -> [R]: k, and the ties of s_(k)
    in_k = torch.arange(v, device=scaled.device) < kept[:, None]
    probs = torch.softmax(values.double().masked_fill(~in_k, -math.inf), dim=-1)  # [R, V] fp64
    above = torch.cumsum(probs, dim=-1).roll(1, dims=-1)  # the mass strictly above each position:
    above[:, 0] = 0.0  # the sums shifted one place (nondecreasing, unlike cumsum − p)
    reach = (above < top_p) & in_k  # a prefix: the smallest one reaching top_p
    last = values.gather(1, (reach.sum(-1).clamp_min(1) - 1)[:, None])  # the last kept value
    kept = (values >= last).sum(-1)  # and its ties
    cut = kept < v
    below = values.gather(1, kept.clamp(max=v - 1)[:, None]).squeeze(1)  # the largest left out
    last = values.gather(1, (kept - 1).clamp_min(0)[:, None]).squeeze(1)
    return torch.where(cut, (last + below) / 2, inf)


def truncated_logits(scaled: torch.Tensor, labels: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``scaled`` ``[N, V]`` with the entries below the row's ``threshold`` ``[N]`` set to ``−inf``,
    the label's kept whatever its value (see ``truncation_threshold``)."""
    cols = torch.arange(scaled.shape[1], device=scaled.device)
    keep = (scaled >= threshold[:, None]) | (cols == labels.long()[:, None])
    return scaled.masked_fill(~keep, -math.inf)


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
    **loss_options,
) -> GRPOLossOutput:
    """Reference for ``grpo_fast.ops.grpo_loss_from_logits`` (same arguments, same output).

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
    )
    return GRPOLossOutput(
        loss, logp, entropy, rows.kl, rows.clipped, rows.log_ratio, rows.parts, rows.entropy_threshold
    )
