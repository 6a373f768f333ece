"""Rewards into advantages: group normalization (GRPO's, Dr. GRPO's, the batch std), GDPO's
per-reward normalization, DAPO's informative-group filter and soft overlong penalty; and the
estimators of ``loss.advantage`` beside ``group``: leave-one-out (RLOO), REINFORCE++ and its
group-baseline variant (per-token returns, whitened over the batch), and GAE (per-token, from a
value model's estimates).

Shapes: ``R`` (or ``B``) responses, in groups (``group_size`` an int, or ``[P]`` sizes,
consecutive). The per-token estimators take ``[B, T]`` tensors and a ``mask [B, T]`` of the
tokens the policy sampled; everything else (padding, a tool's inserted output) is a hole: no
reward, no TD error, no advantage, and the discount counts sampled tokens only (the next sampled
token's return and value are carried across a hole).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import torch

__all__ = [
    "ADVANTAGE_ESTIMATORS",
    "GROUP_ESTIMATORS",
    "PER_TOKEN_ESTIMATORS",
    "SCALE_REWARDS",
    "compute_gae",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
    "informative_groups",
    "normalize_each_reward",
    "normalize_group_rewards",
    "overlong_penalty",
    "whiten_over_batch",
]

SCALE_REWARDS = ("group", "batch", "none")  # loss.scale_rewards
# loss.advantage: how rewards become advantages (docs/loss.md, "Advantage estimators")
ADVANTAGE_ESTIMATORS = ("group", "rloo", "reinforce_pp", "reinforce_pp_baseline", "gae")
PER_TOKEN_ESTIMATORS = ("reinforce_pp", "reinforce_pp_baseline", "gae")  # one advantage per token
GROUP_ESTIMATORS = ("group", "rloo", "reinforce_pp_baseline")  # a baseline from the response's group


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


def compute_rloo_advantages(
    rewards: torch.Tensor,
    group_sizes: int | Sequence[int],
    *,
    scale_rewards: str = "none",
    advantage_eps: float = 1e-6,
    reduce_sums: Callable[[list[float]], list[float]] | None = None,
) -> tuple[torch.Tensor, dict[str, float]]:
    """RLOO (REINFORCE leave-one-out; Ahmadian et al. 2024): each response against the mean of
    the *other* responses of its group, ``A_i = r_i − (Σ_{j≠i} r_j)/(G − 1) = G/(G − 1)·(r_i −
    mean(group))``, so the baseline does not contain the response it judges (an unbiased
    estimate). Then scaled as ``normalize_group_rewards``'s ``scale_rewards`` (default ``none``:
    the paper's form; the loop passes ``loss.scale_rewards``). A group of one, or of equal
    rewards, gets exactly 0.

    Args:
        rewards: ``[B]`` fp32, groups contiguous.
        group_sizes: one size for every group, or ``[P]`` sizes summing to ``B``.
        scale_rewards, advantage_eps, reduce_sums: as ``normalize_group_rewards``.

    Returns:
        ``(advantages [B] fp32, metadata)``: ``normalize_group_rewards``'s metadata, its
        ``advantage_abs_mean`` of these advantages.

    Example:
        Rewards ``[1, 0, 0, 0]`` in one group: ``1 − 0 = 1`` and ``0 − 1/3`` three times:
        ``[1.0, −0.3333, −0.3333, −0.3333]`` (GRPO's centred ``[0.75, −0.25, …]`` × 4/3).
    """
    centred, metadata = normalize_group_rewards(
        rewards, group_sizes, advantage_eps, scale_rewards=scale_rewards, reduce_sums=reduce_sums
    )
    sizes = _check_group_sizes(group_sizes, rewards.numel())
    each = torch.tensor(sizes, dtype=torch.float32) if sizes is not None else None
    g = (
        torch.full((rewards.numel(),), float(group_sizes))
        if each is None
        else each.repeat_interleave(each.long())
    )  # [B] the size of each response's group
    advantages = centred * torch.where(g > 1, g / (g - 1).clamp(min=1), torch.zeros_like(g))
    metadata["advantage_abs_mean"] = advantages.abs().mean().item()
    return advantages, metadata


def compute_reinforce_pp_advantages(
    rewards: torch.Tensor,
    mask: torch.Tensor,
    token_rewards: torch.Tensor | None = None,
    gamma: float = 1.0,
    *,
    group_sizes: int | Sequence[int] | None = None,
    advantage_eps: float = 1e-6,
    reduce_sums: Callable[[list[float]], list[float]] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """REINFORCE++ (Hu et al. 2025): per-token returns of the outcome reward and the per-token
    rewards (the KL penalty ``−β·k1_t`` with ``loss.kl_in_reward``), whitened over the batch.

    The outcome reward ``rewards[i]`` lands on response ``i``'s last sampled token; each sampled
    token also gets ``token_rewards[i, t]``. The return is ``G_t = Σ_{s ≥ t} γ^{n(t, s)}·r_s``
    over sampled tokens (``n``: the sampled tokens between them; holes carry the return across),
    and the advantage ``A_t = (G_t − μ)/(σ + advantage_eps)``, ``μ``, ``σ`` (unbiased) over every
    sampled token of the batch (across ranks with ``reduce_sums``). With ``group_sizes`` this is
    REINFORCE++-baseline: each outcome reward first loses its group's mean (``loss.advantage=
    reinforce_pp_baseline``), which removes the prompt's difficulty before the whitening.

    Args:
        rewards: ``[B]`` fp32, each response's outcome reward (task reward and shaping).
        mask: ``[B, T]`` bool, the tokens the policy sampled.
        token_rewards: ``[B, T]`` fp32 or None; read on the mask only.
        gamma: the discount per sampled token, in [0, 1].
        group_sizes: None (REINFORCE++), or the groups (as ``normalize_group_rewards``) whose
            mean each outcome reward loses first.
        advantage_eps: added to σ.
        reduce_sums: a function summing ``[count, Σ G, Σ G²]`` over the data-parallel ranks;
            None = this is the whole batch.

    Returns:
        ``(advantages [B, T], returns [B, T])`` fp32, 0 off the mask.

    Example:
        One token each, rewards ``[1, 0]``, γ = 1: returns ``[[1], [0]]``, μ = 0.5, σ = 0.7071:
        advantages ``[[0.7071], [−0.7071]]``.
    """
    mask = _check_token_inputs(mask, rewards=rewards, token_rewards=token_rewards)
    if not 0.0 <= gamma <= 1.0:
        raise ValueError(f"gamma={gamma} must be in [0, 1]")
    outcome = rewards.float()
    if group_sizes is not None:  # REINFORCE++-baseline: the group's mean off each outcome reward
        outcome, _ = normalize_group_rewards(outcome, group_sizes, 0.0, scale_rewards="none")
    per_token = torch.zeros(mask.shape, dtype=torch.float32)
    if token_rewards is not None:
        per_token = torch.where(mask, token_rewards.float(), per_token)
    last = _last_sampled(mask)  # [B], -1 for a response without a sampled token
    rows = torch.nonzero(last >= 0).squeeze(1)
    per_token[rows, last[rows]] += outcome[rows]
    returns = _discounted_sums(per_token, mask, torch.full((mask.shape[0],), float(gamma)))
    return whiten_over_batch(returns, mask, advantage_eps, reduce_sums), returns


def whiten_over_batch(
    x: torch.Tensor,
    mask: torch.Tensor,
    eps: float = 1e-6,
    reduce_sums: Callable[[list[float]], list[float]] | None = None,
) -> torch.Tensor:
    """``(x − μ)/(σ + eps)`` on the mask, 0 off it: ``μ`` and the unbiased ``σ`` over every masked
    entry of the batch, across data-parallel ranks with ``reduce_sums`` (summing ``[count, Σx,
    Σx²]``; None = this is the whole batch), in float64. ``x``, ``mask``: ``[B, T]``; returns fp32."""
    x64 = x[mask].double()
    sums = [float(x64.numel()), x64.sum().item(), (x64 * x64).sum().item()]
    count, total, squares = reduce_sums(sums) if reduce_sums is not None else sums
    mean = total / max(count, 1.0)
    var = max(squares - count * mean * mean, 0.0) / max(count - 1.0, 1.0)
    return torch.where(mask, (x - mean) / (math.sqrt(var) + eps), 0.0).float()


def compute_gae(
    token_rewards: torch.Tensor,
    values: torch.Tensor,
    mask: torch.Tensor | None = None,
    gamma: float = 0.99,
    lam: float | torch.Tensor = 0.95,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Generalized advantage estimation (Schulman et al. 2016), per token, with holes.

    On each sampled token ``t`` (``mask``), with ``t'`` the next sampled token of the row
    (``V(t') = 0`` after the last): ``δ_t = r_t + γ·V(t') − V(t)`` and ``A_t = δ_t + γλ·A_{t'}``;
    ``returns = A + V`` (the value model's targets). Off the mask (padding, a tool's inserted
    output) there is no TD error and no advantage: the next sampled token's value and advantage
    are carried across, and ``token_rewards`` there are ignored. The advantages are raw (not
    whitened: whitening is the caller's choice). With ``B = 1`` and every token sampled this is the
    CS336 write-up's ``compute_gae(rewards, values, gamma=0.99, lam=0.95)`` (the course API is this
    function; it takes 1-D ``[T]`` inputs too, and ``gamma``/``lam`` by keyword).

    Args:
        token_rewards: ``[B, T]`` (or ``[T]``) fp32, each token's reward (an outcome reward on the
            last sampled token, a KL penalty on each).
        values: ``[B, T]`` (or ``[T]``), the value model's ``V(t)``.
        mask: ``[B, T]`` (or ``[T]``) bool, the sampled tokens; None = all.
        gamma: the discount per sampled token, in [0, 1].
        lam: GAE's λ in [0, 1], one float or ``[B]`` (one per response: a length-adaptive λ).

    Returns:
        ``(advantages, returns)``, fp32, shaped as ``token_rewards``; 0 off the mask.

    Example:
        Rewards ``[0, 1]``, values ``[0.5, 0.5]``, γ = λ = 1: ``δ = [0, 0.5]``, advantages
        ``[0.5, 0.5]``, returns ``[1, 1]``.
    """
    if mask is not None and not isinstance(mask, torch.Tensor):
        raise TypeError(
            f"compute_gae: mask must be a bool tensor or None, got {type(mask).__name__} "
            "(pass gamma= and lam= by keyword)"
        )
    one_dim = token_rewards.dim() == 1
    if one_dim:
        token_rewards, values = token_rewards[None], values[None]
        mask = None if mask is None else mask[None]
    if mask is None:
        mask = torch.ones(token_rewards.shape, dtype=torch.bool)
    mask = _check_token_inputs(mask, token_rewards=token_rewards, values=values)
    b = mask.shape[0]
    lam_t = torch.as_tensor(lam, dtype=torch.float32)
    lam_t = lam_t.expand(b).clone() if lam_t.dim() == 0 else lam_t.float()
    if tuple(lam_t.shape) != (b,):
        raise ValueError(f"compute_gae: lam has shape {tuple(lam_t.shape)}, expected a float or ({b},)")
    if not 0.0 <= gamma <= 1.0 or not bool(((lam_t >= 0) & (lam_t <= 1)).all()):
        raise ValueError(f"compute_gae: gamma={gamma} and lam must be in [0, 1]")
    r, v = token_rewards.float(), values.float()
    advantages = torch.zeros(mask.shape, dtype=torch.float32)
    next_value = torch.zeros(b)
    running = torch.zeros(b)
    for t in range(mask.shape[1] - 1, -1, -1):  # T steps of [B] vector ops
        m = mask[:, t]
        delta = r[:, t] + gamma * next_value - v[:, t]
        running = torch.where(m, delta + gamma * lam_t * running, running)
        next_value = torch.where(m, v[:, t], next_value)
        advantages[:, t] = torch.where(m, running, 0.0)
    returns = torch.where(mask, advantages + v, 0.0)
    if one_dim:
        return advantages[0], returns[0]
    return advantages, returns


def _discounted_sums(x: torch.Tensor, mask: torch.Tensor, discount: torch.Tensor) -> torch.Tensor:
    """``[B, T]``: on the mask, ``Σ_{s ≥ t on the mask} discount^{n(t, s)}·x_s`` (holes carried
    across); 0 off it. ``discount``: ``[B]``."""
    out = torch.zeros(mask.shape, dtype=torch.float32)
    running = torch.zeros(mask.shape[0])
    for t in range(mask.shape[1] - 1, -1, -1):
        m = mask[:, t]
        running = torch.where(m, x[:, t] + discount * running, running)
        out[:, t] = torch.where(m, running, 0.0)
    return out


def _last_sampled(mask: torch.Tensor) -> torch.Tensor:
    """``[B]`` the position of each row's last sampled token, -1 for none."""
    t = mask.shape[1]
    positions = torch.arange(t).expand_as(mask)
    return torch.where(mask, positions, -1).max(dim=1).values if t else torch.full((mask.shape[0],), -1)


def _check_token_inputs(mask: torch.Tensor, **tensors: torch.Tensor | None) -> torch.Tensor:
    """``mask`` as bool, after checking it is ``[B, T]`` and each tensor ``[B, T]`` (or ``[B]`` for
    ``rewards``); a ValueError names the one at fault."""
    if mask.dim() != 2:
        raise ValueError(f"mask has shape {tuple(mask.shape)}, expected [B, T]")
    for name, x in tensors.items():
        want = tuple(mask.shape[:1]) if name == "rewards" else tuple(mask.shape)
        if x is not None and tuple(x.shape) != want:
            raise ValueError(f"{name} has shape {tuple(x.shape)}, expected {want} (mask {tuple(mask.shape)})")
    return mask.bool()


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
