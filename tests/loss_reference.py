"""A second, deliberately plain implementation of the GRPO loss family, for the tests only.

Python floats (float64) and loops, one token at a time, written from the papers' formulas, with
the gradient written out by hand (no autograd). It imports nothing from ``grpo_fast`` and nothing
but the standard library (``tests/test_loss_reference.py`` checks both), so a wrong formula in
``grpo_fast.algo.core`` cannot hide in the reference it is compared with.

For token t of response i, with ``lp = log π(y_t)`` (after temperature T), ``old``/``ref`` the
behaviour and reference policies' log-probs, ``A`` the advantage and ``w`` the loss weight:

- ratio: ``r = exp(lp − old)`` (``old`` = ``lp`` held fixed when on-policy), or GSPO's
  ``s_i = exp(mean_{u ∈ i}(lp_u − old_u))`` for every token of i (Zheng et al. 2025);
- ``grpo_clip`` (PPO's surrogate, DAPO's asymmetric range): ``pg = −min(r̃·A, clip(r, 1 − ε_low,
  1 + ε_high)·A)`` with ``r̃ = min(r, δ)`` under the cap δ (INTELLECT-2), and for ``A < 0`` the dual
  clip (Ye et al. 2020) ``pg ← min(pg, −c·A)``;
- ``reinforce_with_baseline`` / ``no_baseline``: ``pg = −r̃·A``;
- ``cispo`` (MiniMax-M1): ``pg = −sg(clip(r, 1 − ε_low, min(1 + ε_high, δ)))·A·lp``;
- ``sapo`` (arXiv 2511.20347): ``pg = −(4/τ)·σ(τ·(r − 1))·A``, τ = τ_pos for ``A > 0``, else τ_neg;
- top-entropy (Wang et al. 2025): ``pg ← pg·[H ≥ q]``, q the (1 − ρ)-quantile (linear
  interpolation) of the entropies of the tokens with ``w ≠ 0``;
- KL (Schulman's estimators, ``d = ref − lp``): k1 ``−d``, k2 ``d²/2``, k3 ``e^d − d − 1``;
- ``ℓ = pg + β·KL − c·H``; the loss ``Σ_t w_t·ℓ_t``.

A token is "clipped" where the clip, the cap or the dual clip decides its term: its gradient
through the ratio is 0 (``grpo_clip``, the unclipped types with δ), or its CISPO weight is clipped.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

KNOWN_TYPES = ("grpo_clip", "reinforce_with_baseline", "no_baseline", "cispo", "sapo")


@dataclass
class PlainOptions:
    """The loss options, with the paper defaults (written here again on purpose)."""

    type: str = "grpo_clip"
    clip_low: float = 0.2
    clip_high: float = 0.2
    dual_clip: float | None = None
    delta: float | None = None
    importance_sampling_level: str = "token"
    top_entropy_quantile: float = 1.0
    beta: float = 0.0
    kl_estimator: str = "k3"
    entropy_coef: float = 0.0
    sapo_tau_pos: float = 1.0
    sapo_tau_neg: float = 1.05


@dataclass
class PlainResult:
    """The reference's outputs, as Python floats and lists (``N`` tokens, vocabulary ``V``)."""

    loss: float
    per_token: list[float]  # ℓ_t
    logprobs: list[float]
    entropy: list[float]
    kl: list[float] | None
    clipped: list[bool]
    log_ratio: list[float]
    pg: float  # Σ w·pg
    kl_part: float  # β·Σ w·KL
    entropy_part: float  # −c·Σ w·H
    threshold: float | None
    grad_logits: list[list[float]] = field(default_factory=list)  # ∂loss/∂z, [N][V]
    g_lp: list[float] = field(default_factory=list)  # ∂loss/∂lp
    g_h: list[float] = field(default_factory=list)  # ∂loss/∂H
    # the size of what ∂loss/∂lp sums and of how fast it moves with lp: where its terms cancel
    # (the KL's 1 − e^d near d = 0), a rounding of lp still moves it by ~β·e^d·δlp
    g_lp_size: list[float] = field(default_factory=list)


def _log_softmax(row: list[float], temperature: float) -> list[float]:
    z = [x / temperature for x in row]
    m = max(z)
    lse = m + math.log(sum(math.exp(x - m) for x in z))
    return [x - lse for x in z]


def _quantile(values: list[float], q: float) -> float:
    """Linear interpolation between the closest ranks (numpy's and torch's default)."""
    if not values:
        return math.inf
    s = sorted(values)
    pos = q * (len(s) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(s) - 1)
    return s[lo] + (pos - lo) * (s[hi] - s[lo])


def _kl(lp: float, ref: float, estimator: str) -> tuple[float, float, float]:
    """``(KL estimate, ∂/∂lp, |∂²/∂lp²|)``."""
    d = ref - lp
    if estimator == "k1":
        return -d, 1.0, 0.0
    if estimator == "k2":
        return 0.5 * d * d, -d, 1.0
    if estimator == "k3":
        return math.exp(d) - d - 1.0, 1.0 - math.exp(d), math.exp(d)
    raise ValueError(estimator)


def _pg(r: float, a: float, lp: float, o: PlainOptions) -> tuple[float, float, float, bool]:
    """``(pg, ∂pg/∂r, ∂pg/∂lp with r held fixed, clipped)`` of one token."""
    lo, hi = 1.0 - o.clip_low, 1.0 + o.clip_high
    capped = r if o.delta is None else min(r, o.delta)
    cap_slope = 1.0 if o.delta is None or r < o.delta else 0.0
    if o.type == "grpo_clip":
        unclipped = capped * a
        clipped = min(max(r, lo), hi) * a
        if clipped < unclipped:  # the clipped term is the min: constant in r outside the range
            pg, slope, is_clipped = -clipped, (-a if lo < r < hi else 0.0), not (lo < r < hi)
        else:
            pg, slope, is_clipped = -unclipped, -a * cap_slope, cap_slope == 0.0
        if o.dual_clip is not None and a < 0 and pg > -o.dual_clip * a:
            pg, slope, is_clipped = -o.dual_clip * a, 0.0, True
        return pg, slope, 0.0, is_clipped
    if o.type in ("reinforce_with_baseline", "no_baseline"):
        return -capped * a, -a * cap_slope, 0.0, cap_slope == 0.0
    if o.type == "cispo":
        top = hi if o.delta is None else min(hi, o.delta)
        weight = min(max(r, lo), top)  # detached: no ∂/∂r
        return -weight * a * lp, 0.0, -weight * a, not (lo <= r <= top)
    if o.type == "sapo":
        tau = o.sapo_tau_pos if a > 0 else o.sapo_tau_neg
        sig = 1.0 / (1.0 + math.exp(-tau * (r - 1.0)))
        return -(4.0 / tau) * sig * a, -4.0 * sig * (1.0 - sig) * a, 0.0, False
    raise ValueError(f"no plain reference for loss type {o.type!r}")


def plain_grpo_loss(
    logits: list[list[float]],
    labels: list[int],
    advantages: list[float],
    weights: list[float],
    options: PlainOptions,
    *,
    old_logprobs: list[float] | None = None,
    ref_logprobs: list[float] | None = None,
    sequence_ids: list[int] | None = None,
    temperature: float = 1.0,
) -> PlainResult:
    """The loss ``Σ_t w_t·ℓ_t`` of ``N`` tokens (module docstring), its parts and ``∂/∂logits``."""
    n = len(labels)
    log_p = [_log_softmax(row, temperature) for row in logits]
    lp = [log_p[t][labels[t]] for t in range(n)]
    ent = [-sum(math.exp(x) * x for x in row if x > -math.inf) for row in log_p]
    result = plain_row_loss(lp, ent, advantages, weights, options, old_logprobs=old_logprobs,
                            ref_logprobs=ref_logprobs, sequence_ids=sequence_ids)  # fmt: skip
    for t in range(n):
        p = [math.exp(x) for x in log_p[t]]
        row = []
        for j, pj in enumerate(p):
            d_lp_dz = ((1.0 if j == labels[t] else 0.0) - pj) / temperature
            d_h_dz = -pj * (log_p[t][j] + ent[t]) / temperature if pj > 0 else 0.0
            row.append(result.g_lp[t] * d_lp_dz + result.g_h[t] * d_h_dz)
        result.grad_logits.append(row)
    return result


def plain_row_loss(
    lp: list[float],
    ent: list[float],
    advantages: list[float],
    weights: list[float],
    options: PlainOptions,
    *,
    old_logprobs: list[float] | None = None,
    ref_logprobs: list[float] | None = None,
    sequence_ids: list[int] | None = None,
) -> PlainResult:
    """The loss of ``plain_grpo_loss`` from the per-token log-probs and entropies themselves
    (``∂loss/∂lp``, ``∂loss/∂H``; no logits, no ``grad_logits``)."""
    o = options
    n = len(lp)
    old = list(lp) if old_logprobs is None else list(old_logprobs)
    token_log_ratio = [lp[t] - old[t] for t in range(n)]
    members: dict[int, list[int]] = {}
    if o.importance_sampling_level == "sequence":
        for t in range(n):
            members.setdefault(sequence_ids[t], []).append(t)
        log_ratio = [sum(token_log_ratio[u] for u in members[sequence_ids[t]]) / len(members[sequence_ids[t]])
                     for t in range(n)]  # fmt: skip
    else:
        log_ratio = token_log_ratio
    threshold = None
    keep = [True] * n
    if o.top_entropy_quantile < 1.0:
        threshold = _quantile([ent[t] for t in range(n) if weights[t] != 0], 1.0 - o.top_entropy_quantile)
        keep = [ent[t] >= threshold for t in range(n)]
    g_lp, g_h, g_lp_size = [0.0] * n, [0.0] * n, [0.0] * n
    loss = pg_sum = kl_sum = ent_sum = 0.0
    kl_values, clipped, per_token = ([] if ref_logprobs is not None else None), [], []
    for t in range(n):
        a, w = advantages[t], weights[t]
        r = math.exp(log_ratio[t])
        pg, d_r, d_lp, is_clipped = _pg(r, a, lp[t], o)
        clipped.append(is_clipped)
        if not keep[t]:
            pg, d_r, d_lp = 0.0, 0.0, 0.0
        # ∂r/∂lp: r for a token's own ratio; s_i/|i| for every token u of a GSPO sequence
        if o.importance_sampling_level == "sequence":
            for u in members[sequence_ids[t]]:
                g_lp[u] += w * d_r * r / len(members[sequence_ids[t]])
                g_lp_size[u] += abs(w * d_r * r / len(members[sequence_ids[t]]))
        else:
            g_lp[t] += w * d_r * r
            g_lp_size[t] += abs(w * d_r * r)
        g_lp[t] += w * d_lp
        g_lp_size[t] += abs(w * d_lp)
        term = pg
        pg_sum += w * pg
        if ref_logprobs is not None:
            k, dk, d2k = _kl(lp[t], ref_logprobs[t], o.kl_estimator)
            kl_values.append(k)
            if o.beta != 0.0:
                term += o.beta * k
                kl_sum += w * o.beta * k
                g_lp[t] += w * o.beta * dk
                g_lp_size[t] += abs(w * o.beta) * (abs(dk) + d2k)
        if o.entropy_coef != 0.0:
            term -= o.entropy_coef * ent[t]
            ent_sum -= w * o.entropy_coef * ent[t]
            g_h[t] -= w * o.entropy_coef
        per_token.append(term)
        loss += w * term
    return PlainResult(
        loss,
        per_token,
        lp,
        ent,
        kl_values,
        clipped,
        log_ratio,
        pg_sum,
        kl_sum,
        ent_sum,
        threshold,
        [],
        g_lp,
        g_h,
        g_lp_size,
    )


def plain_length_norm_weights(lengths: list[int], length_norm: str, max_length: int) -> list[list[float]]:
    """Per-token weights of responses of ``lengths`` (B of them): GRPO's per-sequence mean then batch
    mean ``1/(|o_b|·B)``, Dr. GRPO's ``1/(L·B)``, DAPO's token mean ``1/Σ|o|``."""
    b, total = len(lengths), sum(lengths)
    if length_norm == "sequence_mean":
        return [[1.0 / (n * b)] * n for n in lengths]
    if length_norm == "constant":
        return [[1.0 / (max_length * b)] * n for n in lengths]
    if length_norm == "token_mean":
        return [[1.0 / total] * n for n in lengths]
    raise ValueError(length_norm)
