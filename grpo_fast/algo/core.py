"""The GRPO algorithm core in plain PyTorch: the index of the algorithm modules, one concern each,
whose names it re-exports (``from grpo_fast.algo.core import X`` keeps working):

- ``advantages``: group-normalized advantages, GDPO's per-reward normalization, DAPO's
  informative-group filter and overlong penalty; RLOO, REINFORCE++ and GAE (``loss.advantage``);
- ``token_loss``: the per-token GRPO family (clip-higher, dual clip, CISPO, SAPO, GSPO, KL k1/k2/k3,
  entropy bonus, top-entropy mask), the row math every loss op runs, ``GRPOLossOutput``;
- ``length_norm``: the three length normalizations as per-token loss weights;
- ``control``: the adaptive KL coefficient, the adaptive entropy coefficient, the KL early stop;
- ``truncation``: top-k / top-p truncation as the samplers apply it;
- ``reference``: the eager ``[N, V]`` references of the fused ops (``grpo_fast.ops``).

The Stanford CS336 assignment-5 helper API lives in ``grpo_fast.algo.course``, built on these.
"""

from __future__ import annotations

from grpo_fast.algo.advantages import (
    ADVANTAGE_ESTIMATORS,
    SCALE_REWARDS,
    compute_gae,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    informative_groups,
    normalize_each_reward,
    normalize_group_rewards,
    overlong_penalty,
)
from grpo_fast.algo.control import (
    AdaptiveKLController,
    adaptive_entropy_coef,
    applied_entropy_coef,
    kl_early_stop,
)
from grpo_fast.algo.length_norm import LENGTH_NORMS, length_norm_weights
from grpo_fast.algo.reference import eager_grpo_loss_from_logits, eager_token_logprobs_and_entropy
from grpo_fast.algo.token_loss import (
    GRPOLossOutput,
    LossParts,
    RowOutputs,
    check_sequence_ids_given,
    compute_entropy,
    entropy_threshold,
    grpo_clip_loss,
    grpo_token_loss,
    kl_penalty,
    loss_parts,
    sequence_mean,
    weighted_grpo_loss,
)
from grpo_fast.algo.truncation import truncated_logits, truncates, truncation_threshold

__all__ = [
    "ADVANTAGE_ESTIMATORS",
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
    "compute_gae",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
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
