"""``LossOptions``: every option of the per-token GRPO loss, its default and its domain, once.

The eager reference (``grpo_fast.algo.core``), both ops (``grpo_loss_from_logits``,
``fused_linear_grpo_loss``), their autograd Functions and ``PolicyLoss`` take one
``LossOptions``; ``LossConfig`` (the ``loss.*`` config section) extends it, so a config key
``loss.X`` is the option ``X``, with the default and domain written here. A ``LossOptions`` is
validated when it is built: an invalid one cannot exist, and nothing downstream checks again.

The domains here are the math's: every value the formulas are defined for, which the public
functions (the ops, ``grpo_clip_loss``, the course API) accept. Where a training run is narrower
(``loss.clip_low`` below 1, ``loss.beta`` not negative), ``LossConfig`` narrows the key, with why.

It also answers the questions the loop would otherwise answer by assumption:

- ``zero_advantage_zero_gradient``: whether a response whose advantage is exactly 0 has a
  gradient of exactly 0 (the loop's zero-advantage skip);
- ``needs_all_rows``: whether the per-row math needs every row before any gradient (the fused
  op's two-pass mode: GSPO's sequence ratio, the top-entropy threshold);
- ``needs_ref_logprobs``: whether the loss needs π_ref's log-probs (β ≠ 0);
- ``needs_old_logprobs(epochs)``: whether it needs π_old's (off-policy epochs only: on-policy
  every loss type's ratio is exactly 1, π_old being π detached).

Example:
    >>> LossOptions(type="cispo", clip_high=0.28).needs_all_rows
    False
    >>> LossOptions(clip_low=1.5).clip_low  # 1 − clip_low ≤ 0: no lower clip
    1.5
    >>> LossOptions(clip_high=-0.1)
    Traceback (most recent call last):
    ...
    grpo_fast.domains.DomainError: clip_high must be >= 0, got -0.1
"""

from __future__ import annotations

import dataclasses
import difflib
from dataclasses import dataclass
from typing import Any

from grpo_fast.domains import DomainError, OneOf, Range, check_fields, option

__all__ = ["IMPORTANCE_SAMPLING_LEVELS", "KL_ESTIMATORS", "LOSS_TYPES", "LossOptions"]

LOSS_TYPES = ("no_baseline", "reinforce_with_baseline", "grpo_clip", "cispo", "sapo")
KL_ESTIMATORS = ("k1", "k2", "k3")
IMPORTANCE_SAMPLING_LEVELS = ("token", "sequence")

# Loss types whose policy-gradient term is the advantage times something (grpo_clip:
# −min(r·A, clip(r)·A); reinforce/no_baseline: −r·A; cispo: −sg(ŵ)·A·log π; sapo: −g_τ(r)·A, the
# gate's τ chosen by A's sign but the term still A times a function of r): zero, with a zero
# gradient, wherever A = 0. A type whose term is not (an advantage-free regularizer, a gate
# that shifts with A's sign only) must stay out of this set, or the loop's zero-advantage skip
# would drop tokens that carry gradient.
_ZERO_AT_ZERO_ADVANTAGE = frozenset(LOSS_TYPES)

# The public functional ops' keyword for ``type`` (as TRL's and Liger's loss functions spell it).
_KEYWORDS = {"loss_type": "type"}


@dataclass(frozen=True)
class LossOptions:
    """The per-token GRPO loss ``ℓ_t = pg_t + β·KL_t − c·H_t`` (``grpo_fast.algo.core.grpo_token_loss``).

    Fields (config key ``loss.<field>``):
        type: the policy-gradient term ``pg``: ``grpo_clip`` (the clipped surrogate),
            ``reinforce_with_baseline`` / ``no_baseline`` (``−r·A``, never clipped), ``cispo``
            (``−sg(clip(r))·A·log π``), ``sapo`` (``−(4/τ)·σ(τ·(r − 1))·A``: a smooth gate in
            place of the clip, no clip range).
        clip_low, clip_high: the clip range ``[1 − clip_low, 1 + clip_high]``, each ≥ 0 (clip_high >
            clip_low is DAPO's clip-higher; GSPO's are small, e.g. 3e-4 / 4e-4; ``clip_low ≥ 1``
            leaves the ratio, always > 0, no lower clip: the course API's ``cliprange=10``; ``inf``
            no clip on that side).
        dual_clip: ``c > 1`` bounds a negative-advantage token's loss at ``−c·A`` (grpo_clip only;
            ``inf``: no bound, as None).
        delta: ``δ > 1`` caps the unclipped term's ratio at δ, every type but ``sapo``, whose
            gate is bounded already (INTELLECT-2).
        importance_sampling_level: ``token`` (``r_t``) or ``sequence`` (GSPO: the response's
            ``exp(mean_t(log π − log π_old))`` for each of its tokens).
        top_entropy_quantile: ``ρ ∈ (0, 1]``: ``pg`` only on the top-ρ-entropy tokens (80/20).
        beta: the KL coefficient β, any finite number (a negative β rewards distance from
            π_ref; a training run's ``loss.beta`` is ≥ 0; the adaptive controller changes it from
            step to step).
        kl_estimator: ``k1``, ``k2`` or ``k3`` (``grpo_fast.algo.core.kl_penalty``).
        entropy_coef: the entropy bonus ``c`` (negative: an entropy penalty; the adaptive
            controller, ``loss.entropy_target``, changes it from step to step).
        sapo_tau_pos, sapo_tau_neg: SAPO's gate temperatures for ``A > 0`` and ``A ≤ 0``
            (``type="sapo"`` only; TRL's ``sapo_temperature_pos/neg`` defaults, 1.0 and 1.05).
    """

    type: str = option("grpo_clip", OneOf(LOSS_TYPES))
    clip_low: float = option(0.2, Range(0, inf_ok=True))
    clip_high: float = option(0.2, Range(0, inf_ok=True))
    dual_clip: float | None = option(None, Range(1, lo_open=True, none_ok=True, inf_ok=True))
    delta: float | None = option(None, Range(1, lo_open=True, none_ok=True))
    importance_sampling_level: str = option("token", OneOf(IMPORTANCE_SAMPLING_LEVELS))
    top_entropy_quantile: float = option(1.0, Range(0, 1, lo_open=True))
    beta: float = option(0.0, Range())
    kl_estimator: str = option("k3", OneOf(KL_ESTIMATORS))
    entropy_coef: float = option(0.0, Range())
    sapo_tau_pos: float = option(1.0, Range(0, lo_open=True))
    sapo_tau_neg: float = option(1.05, Range(0, lo_open=True))

    def __post_init__(self) -> None:
        self.validate()

    def validate(self, prefix: str = "") -> None:
        """``DomainError`` (a ``ValueError``) naming the first option out of its domain, or an
        inconsistent pair. ``prefix``: the config section (``"loss."``) for the message; without
        one, ``type`` is named ``loss_type``, the ops' keyword."""
        labels = {} if prefix else {v: k for k, v in _KEYWORDS.items()}
        check_fields(self, prefix, labels, names=[f.name for f in dataclasses.fields(LossOptions)])
        if self.dual_clip is not None and self.type != "grpo_clip":
            type_label = prefix + labels.get("type", "type")
            raise DomainError(
                prefix + "dual_clip",
                f"{prefix}dual_clip applies only to {type_label}='grpo_clip', not {self.type!r}",
            )
        if self.delta is not None and self.type == "sapo":
            type_label = prefix + labels.get("type", "type")
            raise DomainError(
                prefix + "delta",
                f"{prefix}delta caps an unbounded ratio; {type_label}='sapo' bounds it with its gate "
                f"(at most 4/τ·|A|): leave {prefix}delta unset",
            )

    @classmethod
    def build(cls, base: LossOptions | None = None, **options: Any) -> LossOptions:
        """``base`` (default: the defaults) with ``options`` replaced; the ops' keyword
        ``loss_type`` means ``type``. An unknown name is a ``TypeError`` naming the nearest.

        Example: ``LossOptions.build(loss_type="cispo", clip_high=0.28)``.
        """
        names = [f.name for f in dataclasses.fields(cls)]
        given = {}
        for key, value in options.items():
            name = _KEYWORDS.get(key, key)
            if name not in names:
                near = difflib.get_close_matches(key, [*names, *_KEYWORDS], n=1)
                hint = f" (did you mean {near[0]!r}?)" if near else ""
                raise TypeError(f"unknown loss option {key!r}{hint}; the options are LossOptions' fields")
            given[name] = value
        if base is None:
            return cls(**given)
        return dataclasses.replace(base, **given) if given else base

    def loss_options(self) -> LossOptions:
        """The ``LossOptions`` part of this object (itself for a ``LossOptions``; the options of
        a ``LossConfig``, which extends it with the loop's loss settings)."""
        if type(self) is LossOptions:
            return self
        return LossOptions(**{f.name: getattr(self, f.name) for f in dataclasses.fields(LossOptions)})

    def with_beta(self, beta: float) -> LossOptions:
        """These options with ``beta`` (the adaptive KL controller's value, or 0 when the KL is
        in the reward); itself when unchanged."""
        return self if beta == self.beta else dataclasses.replace(self, beta=beta)

    def with_entropy_coef(self, entropy_coef: float) -> LossOptions:
        """These options with ``entropy_coef`` (the adaptive entropy controller's value,
        ``loss.entropy_target``); itself when unchanged."""
        return (
            self
            if entropy_coef == self.entropy_coef
            else dataclasses.replace(self, entropy_coef=entropy_coef)
        )

    @property
    def needs_all_rows(self) -> bool:
        """The row math needs statistics over all rows before any gradient: GSPO's sequence ratio
        (a sequence's tokens cross chunks) or the top-entropy threshold (every row's entropy)."""
        return self.importance_sampling_level == "sequence" or self.top_entropy_quantile < 1

    @property
    def zero_advantage_zero_gradient(self) -> bool:
        """A token whose advantage is exactly 0 has loss and gradient exactly 0: true when the
        type's ``pg`` is proportional to the advantage and nothing else is in the loss (β = 0, no
        entropy term) nor depends on the other tokens (no top-entropy threshold, which is taken
        over every weighted token, zero-advantage ones included)."""
        return (
            self.type in _ZERO_AT_ZERO_ADVANTAGE
            and self.beta == 0
            and self.entropy_coef == 0
            and self.top_entropy_quantile >= 1
        )

    @property
    def needs_ref_logprobs(self) -> bool:
        """π_ref's log-probs enter the loss (the KL term, β ≠ 0)."""
        return self.beta != 0

    def needs_old_logprobs(self, epochs: int) -> bool:
        """π_old's log-probs are needed when the optimizer steps more than once on a rollout batch
        (``train.epochs_per_rollout_batch``): on the first, π_old is π detached and every loss
        type's ratio is exactly 1."""
        return epochs > 1
