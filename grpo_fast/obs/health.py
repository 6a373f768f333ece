"""Training-health monitor: practitioners' warning signs of a GRPO run going wrong.

Every step, ``HealthMonitor.update(step, metrics, responses)`` checks (thresholds are
``HealthThresholds`` fields, defaults in brackets):

- ``entropy_low``: ``train/entropy_mean`` < ``entropy_warn_low`` [1.0] → warning (collapse
  risk); < ``entropy_healthy_low`` [1.5] → info (below the healthy band).
- ``entropy_high``: ``train/entropy_mean`` > ``entropy_warn_high`` [4.0] → warning
  (over-exploration); > ``entropy_healthy_high`` [3.0] → info.
- ``grad_norm_spike``: ``train/grad_norm`` > ``grad_norm_spike_factor`` [10] × the median of the
  previous ``grad_norm_window`` [50] finite grad norms → warning.
- ``grad_norm_nonfinite``: ``train/grad_norm`` is NaN or ±inf → critical.
- ``length_collapse`` / ``length_explosion``: ``train/response_length_mean`` at least
  ``length_change_frac`` [0.5] below / above the mean of the previous ``length_window`` [20]
  steps → warning.
- ``repetition``: more than ``repetition_fraction`` [0.1] of the step's responses have
  ``repeated_ngram_ratio(response, repetition_ngram [4]) ≥ repetition_ratio`` [0.5] → warning.
- ``zero_variance``: ``train/zero_variance_fraction`` (groups whose rewards are all equal) >
  ``zero_variance_fraction`` [0.75] → warning (only where the advantage has a group baseline:
  ``loss.advantage`` group, rloo, reinforce_pp_baseline; REINFORCE++ whitens over the batch).

History checks (spike, length) wait for ``min_history`` (5) steps. An event kind is reported
again at most every ``cooldown_steps`` (10) steps while its condition persists, at once when its
severity rises; a critical event is always reported. Every event carries a suggested fix.

Optionally (``auto_temperature_boost``) a repetition event arms an additive rollout-temperature
boost: ``temperature_boost(step) = temperature_boost_amount · (1 − (step − s₀) / temperature_boost_steps)``
for ``s₀ ≤ step < s₀ + temperature_boost_steps``, 0 otherwise, where ``s₀`` is the step of the
latest repetition detection. Under data parallelism the loop uses
``shared_temperature_boost``: rank 0's boost, broadcast, so that every rank samples at the same
temperature.

``state_dict()`` / ``load_state_dict()`` carry the running windows across a resume.
"""

from __future__ import annotations

import math
import statistics
from collections import deque
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

from grpo_fast import dist
from grpo_fast.errors import ConfigError

__all__ = ["SEVERITIES", "HealthEvent", "HealthMonitor", "HealthThresholds", "repeated_ngram_ratio"]

SEVERITIES = ("info", "warning", "critical")  # in rising order

ENTROPY_KEY = "train/entropy_mean"
GRAD_NORM_KEY = "train/grad_norm"
LENGTH_KEY = "train/response_length_mean"
ZERO_VARIANCE_KEY = "train/zero_variance_fraction"


@dataclass(frozen=True)
class HealthThresholds:
    """Every threshold of the health checks (see the module docstring for how each is used).

    Entropies are mean per-token entropies in nats; lengths are in tokens.
    """

    entropy_healthy_low: float = 1.5
    entropy_healthy_high: float = 3.0
    entropy_warn_low: float = 1.0
    entropy_warn_high: float = 4.0
    grad_norm_spike_factor: float = 10.0
    grad_norm_window: int = 50
    length_change_frac: float = 0.5
    length_window: int = 20
    min_history: int = 5
    repetition_ngram: int = 4
    repetition_ratio: float = 0.5
    repetition_fraction: float = 0.1
    zero_variance_fraction: float = 0.75
    cooldown_steps: int = 10
    auto_temperature_boost: bool = False
    temperature_boost_amount: float = 0.2
    temperature_boost_steps: int = 10

    def __post_init__(self):
        if not (
            self.entropy_warn_low
            <= self.entropy_healthy_low
            <= self.entropy_healthy_high
            <= self.entropy_warn_high
        ):
            raise ConfigError(
                "health thresholds: need entropy_warn_low <= entropy_healthy_low <= entropy_healthy_high "
                f"<= entropy_warn_high, got {self.entropy_warn_low}, {self.entropy_healthy_low}, "
                f"{self.entropy_healthy_high}, {self.entropy_warn_high}"
            )
        for name in (
            "grad_norm_window",
            "length_window",
            "min_history",
            "repetition_ngram",
            "temperature_boost_steps",
        ):
            if getattr(self, name) < 1:
                raise ConfigError(f"health thresholds: {name} must be >= 1, got {getattr(self, name)}")


@dataclass(frozen=True)
class HealthEvent:
    """One health finding at ``step``: ``severity`` is one of ``SEVERITIES``; ``value`` is the
    measured quantity the condition tested (an entropy, a grad norm, a share, …)."""

    step: int
    kind: str
    severity: str
    message: str
    suggestion: str
    value: float

    def to_dict(self) -> dict[str, Any]:
        """A JSON-ready dict (one line of ``health.jsonl``)."""
        return asdict(self)


def repeated_ngram_ratio(text: str, n: int = 4) -> float:
    """Share of the word ``n``-grams of ``text`` that repeat an earlier one, in ``[0, 1)``.

    ``1 − distinct / total`` over the ``total = words − n + 1`` n-grams of the
    whitespace-split words; 0.0 when there are fewer than two n-grams. Ordinary prose and
    reasoning score near 0; a response stuck in a loop tends to 1.

    Example:
        >>> repeated_ngram_ratio("a b a b a b", n=2)  # 5 bigrams, 2 distinct: 1 − 2/5
        0.6
    """
    words = text.split()
    total = len(words) - n + 1
    if total < 2:
        return 0.0
    distinct = len({tuple(words[i : i + n]) for i in range(total)})
    return 1.0 - distinct / total


def _finite(metrics: Mapping[str, float], key: str) -> float | None:
    value = metrics.get(key)
    if value is None:
        return None
    value = float(value)
    return value if math.isfinite(value) else None


class HealthMonitor:
    """Runs the health checks step by step (see the module docstring).

    Example:
        >>> mon = HealthMonitor()
        >>> [e.kind for e in mon.update(0, {"train/entropy_mean": 0.4}, [])]
        ['entropy_low']
    """

    def __init__(self, thresholds: HealthThresholds | None = None, group_baseline: bool = True):
        """``group_baseline``: the advantage is a response against its group (``loss.advantage``
        group, rloo, reinforce_pp_baseline), so a group of equal rewards gives no signal and the
        ``zero_variance`` check applies; False (REINFORCE++'s batch baseline) leaves it out."""
        self.thresholds = thresholds or HealthThresholds()
        self.group_baseline = group_baseline
        t = self.thresholds
        self._grad_norms: deque[float] = deque(maxlen=t.grad_norm_window)
        self._lengths: deque[float] = deque(maxlen=t.length_window)
        self._last_reported: dict[str, tuple[int, str]] = {}  # kind -> (step, severity)
        self._boost_start: int | None = None

    def update(self, step: int, metrics: Mapping[str, float], responses: list[str]) -> list[HealthEvent]:
        """Check one step's metrics and sampled responses; returns the events to report.

        Missing metric keys (and NaN values, except for the grad norm) skip their check.
        """
        found = [
            *self._check_entropy(step, metrics),
            *self._check_grad_norm(step, metrics),
            *self._check_length(step, metrics),
            *self._check_repetition(step, responses),
            *self._check_zero_variance(step, metrics),
        ]
        return [event for event in found if self._should_report(event)]

    def temperature_boost(self, step: int) -> float:
        """Additive rollout-temperature boost for ``step`` (0.0 unless armed; see module docstring)."""
        t = self.thresholds
        if not t.auto_temperature_boost or self._boost_start is None:
            return 0.0
        elapsed = step - self._boost_start
        if not 0 <= elapsed < t.temperature_boost_steps:
            return 0.0
        return t.temperature_boost_amount * (1.0 - elapsed / t.temperature_boost_steps)

    def shared_temperature_boost(self, step: int) -> float:
        """``temperature_boost(step)`` as rank 0 decides it, on every rank (one broadcast when
        data parallel; the plain value on one rank). Each rank checks only its own responses for
        repetition, so ranks can disagree on the boost; rank 0's checks are also the ones logged."""
        if not self.thresholds.auto_temperature_boost:
            return 0.0  # the same config on every rank: nothing to agree on
        return dist.broadcast_object(self.temperature_boost(step), src=0)  # host-device sync (nccl)

    def state_dict(self) -> dict[str, Any]:
        """JSON-ready state: running windows, last report per kind, boost start."""
        return {
            "grad_norms": list(self._grad_norms),
            "lengths": list(self._lengths),
            "last_reported": {kind: list(v) for kind, v in self._last_reported.items()},
            "boost_start": self._boost_start,
        }

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore ``state_dict()`` output (windows longer than the thresholds keep their tail)."""
        self._grad_norms.clear()
        self._grad_norms.extend(float(v) for v in state["grad_norms"])
        self._lengths.clear()
        self._lengths.extend(float(v) for v in state["lengths"])
        self._last_reported = {kind: (int(s), str(sev)) for kind, (s, sev) in state["last_reported"].items()}
        self._boost_start = state["boost_start"]

    # ------------------------------------------------------------------------------------------

    def _should_report(self, event: HealthEvent) -> bool:
        last = self._last_reported.get(event.kind)
        rises = last is None or SEVERITIES.index(event.severity) > SEVERITIES.index(last[1])
        if rises or event.severity == "critical" or event.step - last[0] >= self.thresholds.cooldown_steps:
            self._last_reported[event.kind] = (event.step, event.severity)
            return True
        return False

    def _check_entropy(self, step: int, metrics: Mapping[str, float]) -> list[HealthEvent]:
        t = self.thresholds
        h = _finite(metrics, ENTROPY_KEY)
        if h is None:
            return []
        band = f"healthy {t.entropy_healthy_low:g}–{t.entropy_healthy_high:g}"
        if h < t.entropy_healthy_low:
            warn = h < t.entropy_warn_low
            return [
                HealthEvent(
                    step,
                    "entropy_low",
                    "warning" if warn else "info",
                    f"mean token entropy {h:.3g} nats ({band})"
                    + (": collapse risk, the policy is turning deterministic" if warn else ""),
                    "raise rollout.temperature or add loss.entropy_coef (e.g. 1e-3); lower train.lr",
                    h,
                )
            ]
        if h > t.entropy_healthy_high:
            warn = h > t.entropy_warn_high
            return [
                HealthEvent(
                    step,
                    "entropy_high",
                    "warning" if warn else "info",
                    f"mean token entropy {h:.3g} nats ({band})"
                    + (": over-exploration, tokens are close to random" if warn else ""),
                    "lower rollout.temperature or loss.entropy_coef; lower train.lr if a grad-norm spike preceded it",
                    h,
                )
            ]
        return []

    def _check_grad_norm(self, step: int, metrics: Mapping[str, float]) -> list[HealthEvent]:
        t = self.thresholds
        if metrics.get(GRAD_NORM_KEY) is None:
            return []
        g = float(metrics[GRAD_NORM_KEY])
        if not math.isfinite(g):
            return [
                HealthEvent(
                    step,
                    "grad_norm_nonfinite",
                    "critical",
                    f"grad norm is {g}: the update is garbage",
                    "lower train.lr; look for -inf log-probs or a division by a zero token count in the loss",
                    g,
                )
            ]
        events = []
        if len(self._grad_norms) >= t.min_history:
            median = statistics.median(self._grad_norms)
            if median > 0 and g > t.grad_norm_spike_factor * median:
                events.append(
                    HealthEvent(
                        step,
                        "grad_norm_spike",
                        "warning",
                        f"grad norm {g:.3g} is {g / median:.1f}× the running median {median:.3g}",
                        "lower train.lr or train.grad_clip; check the batch for extreme advantages "
                        "or very long responses",
                        g,
                    )
                )
        self._grad_norms.append(g)
        return events

    def _check_length(self, step: int, metrics: Mapping[str, float]) -> list[HealthEvent]:
        t = self.thresholds
        length = _finite(metrics, LENGTH_KEY)
        if length is None:
            return []
        events = []
        if len(self._lengths) >= t.min_history:
            mean = sum(self._lengths) / len(self._lengths)
            change = (length - mean) / mean if mean > 0 else 0.0
            if change <= -t.length_change_frac:
                events.append(
                    HealthEvent(
                        step,
                        "length_collapse",
                        "warning",
                        f"mean response length {length:.4g} is {-change:.0%} below its running mean {mean:.4g}",
                        "check that answers are not cut off at rollout.max_tokens and the format reward still fires; "
                        "loss.length_norm=constant removes sequence_mean's pull towards short responses",
                        length,
                    )
                )
            elif change >= t.length_change_frac:
                events.append(
                    HealthEvent(
                        step,
                        "length_explosion",
                        "warning",
                        f"mean response length {length:.4g} is {change:.0%} above its running mean {mean:.4g}",
                        "check for repetition loops and truncation at rollout.max_tokens; "
                        "loss.length_norm=constant (Dr. GRPO) or a lower train.lr",
                        length,
                    )
                )
        self._lengths.append(length)
        return events

    def _check_repetition(self, step: int, responses: list[str]) -> list[HealthEvent]:
        t = self.thresholds
        if not responses:
            return []
        looping = sum(repeated_ngram_ratio(r, t.repetition_ngram) >= t.repetition_ratio for r in responses)
        share = looping / len(responses)
        if share <= t.repetition_fraction:
            return []
        self._boost_start = step
        return [
            HealthEvent(
                step,
                "repetition",
                "warning",
                f"{share:.0%} of responses loop (repeated {t.repetition_ngram}-gram ratio ≥ {t.repetition_ratio:g})",
                "raise rollout.temperature (or set health.auto_temperature) or add loss.entropy_coef",
                share,
            )
        ]

    def _check_zero_variance(self, step: int, metrics: Mapping[str, float]) -> list[HealthEvent]:
        t = self.thresholds
        share = _finite(metrics, ZERO_VARIANCE_KEY)
        if not self.group_baseline or share is None or share <= t.zero_variance_fraction:
            return []
        return [
            HealthEvent(
                step,
                "zero_variance",
                "warning",
                f"{share:.0%} of groups have identical rewards and give no learning signal",
                "the prompts are too hard or too easy for the policy: filter them by difficulty, raise "
                "rollout.group_size, or raise rollout.temperature",
                share,
            )
        ]
