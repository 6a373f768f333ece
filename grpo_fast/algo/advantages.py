"""Rewards into advantages: group normalization (GRPO's, Dr. GRPO's, the batch std), GDPO's
per-reward normalization, DAPO's informative-group filter and soft overlong penalty.

Shapes: ``R`` responses, in groups (``group_size`` an int, or ``[P]`` sizes, consecutive).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "SCALE_REWARDS",
    "informative_groups",
    "normalize_each_reward",
    "normalize_group_rewards",
    "overlong_penalty",
]

SCALE_REWARDS = ("group", "batch", "none")  # loss.scale_rewards


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
