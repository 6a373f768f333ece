"""Controllers between steps: the adaptive KL coefficient β, the adaptive entropy coefficient,
and the KL early stop of several epochs per rollout batch."""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["AdaptiveKLController", "adaptive_entropy_coef", "applied_entropy_coef", "kl_early_stop"]


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
