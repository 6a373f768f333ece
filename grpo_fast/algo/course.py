"""The Stanford CS336 (Spring 2025) assignment-5 helper API, for course code.

Name for name and signature for signature, so course code can ``from grpo_fast import ...`` (or
``from grpo_fast.algo.course import ...``) and keep working: ``tokenize_prompt_and_output``,
``compute_entropy``, ``get_response_log_probs``, ``masked_mean``, ``masked_normalize``,
``compute_group_normalized_rewards``, ``compute_naive_policy_gradient_loss``,
``compute_grpo_clip_loss``, ``compute_policy_gradient_loss``, ``sft_microbatch_train_step``,
``grpo_microbatch_train_step``. Each keeps the course's positional arguments and return values;
``compute_group_normalized_rewards`` adds keyword-only extras (``scale_rewards``,
``reduce_sums``, ``reward_shaping``) whose defaults give the course's behaviour.

The training loop does not use this module: it works on the GRPO family in ``grpo_fast.algo.core``
(per-token losses as ``grpo_token_loss``, length normalization as loss weights). Where a course
function is that family with the course's defaults it calls it: ``compute_grpo_clip_loss`` is
``core.grpo_clip_loss`` with one symmetric clip range, ``compute_group_normalized_rewards``
scores the responses and hands them to ``core.normalize_group_rewards``. ``compute_entropy`` is
defined in ``grpo_fast.algo.core`` (the eager reference of the fused ops uses it) and re-exported here.

Shapes: ``B`` sequences, ``T`` tokens per sequence, ``V`` vocabulary.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

from grpo_fast.algo.advantages import _check_group_sizes, compute_gae, normalize_group_rewards
from grpo_fast.algo.loss_options import LOSS_TYPES, LossOptions
from grpo_fast.algo.token_loss import compute_entropy, grpo_clip_loss

__all__ = [
    "compute_entropy",
    "compute_gae",
    "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "get_response_log_probs",
    "grpo_microbatch_train_step",
    "masked_mean",
    "masked_normalize",
    "sft_microbatch_train_step",
    "tokenize_prompt_and_output",
]


# ----------------------------------------------------------------------------------------------
# Tokenization and log-probs
# ----------------------------------------------------------------------------------------------


def tokenize_prompt_and_output(prompt_strs: list[str], output_strs: list[str], tokenizer) -> dict:
    """Tokenize prompts and outputs separately, concatenate, right-pad, and shift by one.

    Args:
        prompt_strs: B prompt strings.
        output_strs: B output (response) strings, one per prompt.
        tokenizer: a Hugging Face tokenizer with a ``pad_token_id``.

    Returns:
        dict with exactly three keys, each ``[B, L - 1]`` where ``L`` is the longest
        prompt+output length:
        ``input_ids`` (the sequence without its last token, int64), ``labels`` (the sequence
        without its first token, int64) and ``response_mask`` (bool, True where the label is an
        output token). Padding uses ``tokenizer.pad_token_id`` and is never in the mask.

    Example:
        >>> batch = tokenize_prompt_and_output(["1+1="], ["2"], tok)  # doctest: +SKIP
        >>> batch["labels"][0, batch["response_mask"][0]]  # the ids of "2"  # doctest: +SKIP
    """
    if len(prompt_strs) != len(output_strs):
        raise ValueError(f"prompt_strs has {len(prompt_strs)} items but output_strs has {len(output_strs)}")
    if tokenizer.pad_token_id is None:
        raise ValueError("tokenizer.pad_token_id is None: set a pad token before tokenizing")
    prompt_ids = tokenizer(list(prompt_strs), add_special_tokens=False)["input_ids"]
    output_ids = tokenizer(list(output_strs), add_special_tokens=False)["input_ids"]
    seqs = [p + o for p, o in zip(prompt_ids, output_ids)]
    max_len = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), max_len), tokenizer.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(seqs), max_len), dtype=torch.bool)
    for i, (p, s) in enumerate(zip(prompt_ids, seqs)):
        ids[i, : len(s)] = torch.tensor(s, dtype=torch.long)
        mask[i, len(p) : len(s)] = True
    return {"input_ids": ids[:, :-1], "labels": ids[:, 1:], "response_mask": mask[:, 1:]}


def get_response_log_probs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    labels: torch.Tensor,
    return_token_entropy: bool = False,
) -> dict[str, torch.Tensor]:
    """Per-token conditional log-probs ``log p(labels[b, t] | input_ids[b, :t+1])``.

    Args:
        model: a causal LM returning ``.logits`` of shape ``[B, T, V]``.
        input_ids, labels: ``[B, T]`` int64 (as from ``tokenize_prompt_and_output``).
        return_token_entropy: also return the next-token entropy at every position.

    Returns:
        ``{"log_probs": [B, T]}`` and, if asked, ``"token_entropy": [B, T]`` (no other keys).
        This materializes ``[B, T, V]`` logits: it is the reference; the engine uses
        ``grpo_fast.ops`` on response positions only.
    """
    logits = model(input_ids).logits
    log_probs = torch.log_softmax(logits.float(), dim=-1)
    out = {"log_probs": log_probs.gather(-1, labels.unsqueeze(-1)).squeeze(-1)}
    if return_token_entropy:
        out["token_entropy"] = compute_entropy(logits.float())
    return out


# ----------------------------------------------------------------------------------------------
# Masked reductions
# ----------------------------------------------------------------------------------------------


def masked_mean(tensor: torch.Tensor, mask: torch.Tensor, dim: int | None = None) -> torch.Tensor:
    """``sum(tensor · mask) / sum(mask)`` over ``dim`` (all elements when None).

    A slice with no unmasked element gives NaN, as the mean of nothing does.

    Example:
        >>> masked_mean(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([True, True, False]))
        tensor(1.5000)
    """
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / mask.sum()
    return (tensor * mask).sum(dim=dim) / mask.sum(dim=dim)


def masked_normalize(
    tensor: torch.Tensor,
    mask: torch.Tensor,
    dim: int | None = None,
    normalize_constant: float = 1.0,
) -> torch.Tensor:
    """``sum(tensor · mask) / normalize_constant`` over ``dim`` (all elements when None).

    Example:
        >>> masked_normalize(torch.tensor([1.0, 2.0, 9.0]), torch.tensor([1, 1, 0]), normalize_constant=2.0)
        tensor(1.5000)
    """
    mask = mask.to(tensor.dtype)
    if dim is None:
        return (tensor * mask).sum() / normalize_constant
    return (tensor * mask).sum(dim=dim) / normalize_constant


# ----------------------------------------------------------------------------------------------
# Rewards and advantages
# ----------------------------------------------------------------------------------------------


def compute_group_normalized_rewards(
    reward_fn: Callable[[str, str], dict[str, float]],
    rollout_responses: list[str],
    repeated_ground_truths: list[str],
    group_size: int | Sequence[int],
    advantage_eps: float,
    normalize_by_std: bool = True,
    *,
    scale_rewards: str | None = None,
    reduce_sums: Callable[[list[float]], list[float]] | None = None,
    reward_shaping: Sequence[float] | torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, float]]:
    """Score every response and normalize its reward within its group.

    Groups are consecutive runs of ``group_size`` responses to the same prompt, or, with a list
    of sizes (``rollout.adaptive_group_size``), consecutive runs of ``group_size[j]`` responses
    for group ``j``. ``reward_shaping`` (``[B]``, e.g. ``overlong_penalty``) is added to each
    raw reward first: ``r_i = reward_fn(...)["reward"] + shaping_i`` is the reward returned, the
    one the advantage and the ``reward_*`` statistics use (``metadata["reward_shaping_mean"]``
    is its mean). The rewards are then normalized by ``grpo_fast.algo.core.normalize_group_rewards``
    (its docstring has the formulas): ``A_i = r_i − mean(group)``, divided by a std chosen by
    ``scale_rewards`` (``group``, ``batch`` or ``none``); ``scale_rewards=None`` keeps the CS336
    flag: ``group`` if ``normalize_by_std`` else ``none``. A zero-variance group gets advantage
    exactly 0, never NaN.

    Args:
        reward_fn: ``reward_fn(response, ground_truth) -> {"reward": float, ...}``; other
            float keys (``format_reward``, ``answer_reward``) are averaged into the metadata.
        rollout_responses, repeated_ground_truths: ``B = n_prompts · group_size`` strings each.
        group_size, advantage_eps, normalize_by_std, scale_rewards, reduce_sums: as
            ``grpo_fast.algo.core.normalize_group_rewards``.

    Returns:
        ``(advantages [B] fp32, raw_rewards [B] fp32, metadata)``: ``normalize_group_rewards``'s
        metadata, plus ``reward_shaping_mean`` (with ``reward_shaping``) and ``<key>_mean`` for
        each other float key of the reward function's dict.

    Example:
        Rewards ``[1, 0, 0, 0]`` in one group: mean 0.25, unbiased std 0.5, so without std
        the advantages are ``[0.75, -0.25, -0.25, -0.25]`` and with std ``[1.5, -0.5, -0.5, -0.5]``.
    """
    if len(rollout_responses) != len(repeated_ground_truths):
        raise ValueError(
            f"rollout_responses has {len(rollout_responses)} items but repeated_ground_truths "
            f"has {len(repeated_ground_truths)}"
        )
    _check_group_sizes(group_size, len(rollout_responses))  # before scoring: reward_fn can be slow
    if reward_shaping is not None and len(reward_shaping) != len(rollout_responses):
        raise ValueError(
            f"reward_shaping has {len(reward_shaping)} items for {len(rollout_responses)} responses"
        )
    scores = [reward_fn(r, g) for r, g in zip(rollout_responses, repeated_ground_truths)]
    raw_rewards = torch.tensor([float(s["reward"]) for s in scores], dtype=torch.float32)
    if reward_shaping is not None:
        shaping = torch.as_tensor(reward_shaping, dtype=torch.float32)
        raw_rewards = raw_rewards + shaping
    advantages, metadata = normalize_group_rewards(
        raw_rewards,
        group_size,
        advantage_eps,
        normalize_by_std,
        scale_rewards=scale_rewards,
        reduce_sums=reduce_sums,
    )
    if reward_shaping is not None:
        metadata["reward_shaping_mean"] = shaping.mean().item()
    n = len(scores)
    for key in scores[0]:
        if key != "reward" and isinstance(scores[0][key], (int, float, bool)):
            metadata[f"{key}_mean"] = sum(float(s[key]) for s in scores) / n
    return advantages, raw_rewards, metadata


# ----------------------------------------------------------------------------------------------
# Per-token policy-gradient losses
# ----------------------------------------------------------------------------------------------


def compute_naive_policy_gradient_loss(
    raw_rewards_or_advantages: torch.Tensor, policy_log_probs: torch.Tensor
) -> torch.Tensor:
    """REINFORCE per-token loss ``−A · log π``: ``[B, 1]`` and ``[B, T]`` -> ``[B, T]``."""
    return -raw_rewards_or_advantages * policy_log_probs


def compute_grpo_clip_loss(
    advantages: torch.Tensor,
    policy_log_probs: torch.Tensor,
    old_log_probs: torch.Tensor,
    cliprange: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Symmetric GRPO-Clip (CS336 API): ``grpo_clip_loss`` with ``clip_low = clip_high = cliprange``.

    ``[B, 1]``, ``[B, T]``, ``[B, T]`` -> ``(loss [B, T], {"clipped": bool [B, T], "ratio": [B, T]})``.
    ``cliprange``: ε, any number ≥ 0 (a Python number or a one-element tensor); the ratio is
    clipped to ``[1 − ε, 1 + ε]``, so ``ε ≥ 1`` leaves it (always > 0) no lower clip, and
    ``ε = inf`` no clip at all. That is wider than a training run's ``loss.clip_low``, below 1.

    Example:
        ``A = 1, log π − log π_old = 0.5``: ``r = e^0.5 ≈ 1.6487 > 1.2`` → clipped, loss ``−1.2``;
        with ``cliprange=10`` nothing in ``(0, 11]`` is clipped: loss ``−1.6487``.
    """
    eps = _clip_range(cliprange)
    options = LossOptions(clip_low=eps, clip_high=eps)
    return grpo_clip_loss(advantages, policy_log_probs, old_log_probs, options)


def _clip_range(cliprange: float) -> float:
    """``cliprange`` as a float: ``TypeError`` for a non-number, ``ValueError`` outside [0, ∞]."""
    try:
        eps = float(cliprange)
    except (TypeError, ValueError, RuntimeError):  # RuntimeError: a tensor of more than one element
        raise TypeError(f"cliprange must be a number, got {cliprange!r}") from None
    if not eps >= 0:  # NaN too
        raise ValueError(f"cliprange must be a number >= 0 (1 or more: no lower clip), got {eps}")
    return eps


def compute_policy_gradient_loss(
    policy_log_probs: torch.Tensor,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Dispatch to a per-token loss ``[B, T]`` by ``loss_type``.

    ``no_baseline``: ``−r·log π`` (needs ``raw_rewards [B, 1]``);
    ``reinforce_with_baseline``: ``−A·log π`` (needs ``advantages [B, 1]``);
    ``grpo_clip``: clipped surrogate (needs ``advantages``, ``old_log_probs``, ``cliprange``).
    Any other ``loss_type`` is a ValueError.
    """
    if loss_type == "no_baseline":
        if raw_rewards is None:
            raise ValueError("loss_type='no_baseline' needs raw_rewards")
        return compute_naive_policy_gradient_loss(raw_rewards, policy_log_probs), {}
    if loss_type == "reinforce_with_baseline":
        if advantages is None:
            raise ValueError("loss_type='reinforce_with_baseline' needs advantages")
        return compute_naive_policy_gradient_loss(advantages, policy_log_probs), {}
    if loss_type == "grpo_clip":
        missing = [
            name
            for name, value in (
                ("advantages", advantages),
                ("old_log_probs", old_log_probs),
                ("cliprange", cliprange),
            )
            if value is None
        ]
        if missing:
            raise ValueError(f"loss_type='grpo_clip' needs {', '.join(missing)}")
        return compute_grpo_clip_loss(advantages, policy_log_probs, old_log_probs, cliprange)
    raise ValueError(f"unknown loss_type {loss_type!r}; expected one of {', '.join(LOSS_TYPES[:3])}")


# ----------------------------------------------------------------------------------------------
# Microbatch train steps
# ----------------------------------------------------------------------------------------------


def sft_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    normalize_constant: float = 1.0,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Negative log-likelihood of the response, backpropagated for one microbatch.

    ``loss = mean_b(−Σ_t m·log π / normalize_constant) / gradient_accumulation_steps``;
    calls ``loss.backward()`` (gradients accumulate across calls) and returns the loss.
    ``policy_log_probs, response_mask: [B, T]``.
    """
    per_seq = masked_normalize(
        -policy_log_probs, response_mask, dim=-1, normalize_constant=normalize_constant
    )
    loss = per_seq.mean() / gradient_accumulation_steps
    loss.backward()
    return loss, {"nll_per_sequence": per_seq.detach(), "num_response_tokens": response_mask.sum()}


def grpo_microbatch_train_step(
    policy_log_probs: torch.Tensor,
    response_mask: torch.Tensor,
    gradient_accumulation_steps: int,
    loss_type: str,
    raw_rewards: torch.Tensor | None = None,
    advantages: torch.Tensor | None = None,
    old_log_probs: torch.Tensor | None = None,
    cliprange: float | None = None,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Policy-gradient loss for one microbatch, backpropagated.

    ``loss = mean_b(masked_mean_t(ℓ, m)) / gradient_accumulation_steps`` with ``ℓ`` from
    ``compute_policy_gradient_loss``; calls ``loss.backward()`` and returns the loss and the
    loss metadata (``clipped`` for ``grpo_clip``). ``policy_log_probs, response_mask: [B, T]``.
    """
    per_token, meta = compute_policy_gradient_loss(
        policy_log_probs, loss_type, raw_rewards, advantages, old_log_probs, cliprange
    )
    loss = masked_mean(per_token, response_mask, dim=-1).mean() / gradient_accumulation_steps
    loss.backward()
    if "clipped" in meta:
        meta["clip_fraction"] = masked_mean(meta["clipped"].float(), response_mask)
    return loss, meta
