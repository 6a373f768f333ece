"""The value model of ``loss.advantage=gae``: a linear head on the policy's last hidden states.

``ValueHead`` maps the hidden states the fused op already has (``[n, D]``, the response positions:
the state before each sampled token) to one value each, ``[n]`` fp32. It lives in the loss module
(``PolicyLoss.value_head``), so DDP and FSDP wrap it with the policy and see it in every forward;
it is not part of the Hugging Face model (nothing of it reaches an engine's weights or the saved
model). ``critic.trunk_coef`` scales the gradient the value loss sends into the shared layers:
0 trains the head alone (no interference with the policy), 1 is a shared-trunk critic.

Why this design (docs/loss.md, "The value model"): on one 24 GB card a second 1.5B critic (its
weights, gradients and AdamW state) does not fit beside the policy; the head adds ``D + 1``
parameters (1,537 for Qwen2.5-1.5B) and no pass of its own in training.
"""

from __future__ import annotations

import torch
from torch import nn

__all__ = ["ValueHead", "clipped_value_loss"]


class ValueHead(nn.Module):
    """``forward(hidden [n, D], trunk_coef) -> values [n]`` fp32.

    Zero-initialized, so every value starts at 0 (the first advantages are the discounted rewards,
    whitened). The hidden states reach the head in fp32; the gradient into them is scaled by
    ``trunk_coef`` (the forward value unchanged).
    """

    def __init__(self, hidden_size: int):
        super().__init__()
        self.proj = nn.Linear(hidden_size, 1)
        nn.init.zeros_(self.proj.weight)
        nn.init.zeros_(self.proj.bias)

    def forward(self, hidden: torch.Tensor, trunk_coef: float) -> torch.Tensor:
        if trunk_coef == 0.0:
            hidden = hidden.detach()
        elif trunk_coef != 1.0:  # forward: hidden; backward: trunk_coef × the gradient
            hidden = hidden.detach() + trunk_coef * (hidden - hidden.detach())
        return self.proj(hidden.float()).squeeze(-1)


def clipped_value_loss(
    values: torch.Tensor,
    returns: torch.Tensor,
    old_values: torch.Tensor,
    weights: torch.Tensor,
    clip: float | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO's clipped value loss, ``Σ_t w_t · ½·max((V_t − R_t)², (V_old,t + clip(V_t − V_old,t, ±c)
    − R_t)²)`` (``clip=None``: the plain squared error), and ``[n]`` bool: the tokens where the
    value left the clip range and the clipped branch was the larger (its gradient is then 0).

    Args:
        values: ``[n]`` the head's values now (differentiable).
        returns: ``[n]`` the targets; old_values: ``[n]`` the values the advantages were computed
            with; weights: ``[n]`` the tokens' loss weights (the run's length normalization).
        clip: ``critic.value_clip`` or None.

    Example:
        V = 1.0, V_old = 0, R = 2, c = 0.2: unclipped ½·1² = 0.5, clipped ½·(0.2 − 2)² = 1.62:
        the loss is 1.62 and its gradient 0 (the clip holds V near V_old).
    """
    unclipped = (values - returns) ** 2
    if clip is None:
        return 0.5 * (weights * unclipped).sum(), torch.zeros_like(unclipped, dtype=torch.bool)
    step = values - old_values
    clipped = (old_values + step.clamp(-clip, clip) - returns) ** 2
    # outside the range and the larger: where the clip holds V (within it the two are equal but
    # for rounding)
    held = (step.abs() > clip) & (clipped > unclipped)
    return 0.5 * (weights * torch.maximum(unclipped, clipped)).sum(), held
