"""grpo_fast: performance-first GRPO training.

The Stanford CS336 assignment-5 helper API (``grpo_fast.algo.course``) is re-exported here, so course
code can ``from grpo_fast import compute_grpo_clip_loss``, together with the engine's GRPO family
from the algorithm core (``grpo_fast.algo.core``). Fused ops live in ``grpo_fast.ops``; the training
loop in ``grpo_fast.train``.
"""

# First, before anything imports torch: a command (python -m grpo_fast.X, grpo-fast) spins only
# briefly between OpenMP regions unless the environment says otherwise (grpo_fast.threads).
from grpo_fast import threads as _threads

if _threads.started_as_command():
    _threads.started_by_command = True
    _threads.prefer_short_wait()
    _threads.command_meter = _threads.OtherWork()  # the setup reads it: a window from the start

from grpo_fast.algo.advantages import compute_reinforce_pp_advantages, compute_rloo_advantages
from grpo_fast.algo.control import AdaptiveKLController, kl_early_stop
from grpo_fast.algo.course import (
    compute_entropy,
    compute_gae,
    compute_group_normalized_rewards,
    compute_grpo_clip_loss,
    compute_naive_policy_gradient_loss,
    compute_policy_gradient_loss,
    get_response_log_probs,
    grpo_microbatch_train_step,
    masked_mean,
    masked_normalize,
    sft_microbatch_train_step,
    tokenize_prompt_and_output,
)
from grpo_fast.algo.length_norm import length_norm_weights
from grpo_fast.algo.token_loss import GRPOLossOutput, grpo_clip_loss, grpo_token_loss, kl_penalty

__version__ = "0.1.0"

__all__ = [
    "AdaptiveKLController",
    "GRPOLossOutput",
    "__version__",
    "compute_entropy",
    "compute_gae",
    "compute_group_normalized_rewards",
    "compute_grpo_clip_loss",
    "compute_naive_policy_gradient_loss",
    "compute_policy_gradient_loss",
    "compute_reinforce_pp_advantages",
    "compute_rloo_advantages",
    "get_response_log_probs",
    "grpo_clip_loss",
    "grpo_microbatch_train_step",
    "grpo_token_loss",
    "kl_early_stop",
    "kl_penalty",
    "length_norm_weights",
    "masked_mean",
    "masked_normalize",
    "sft_microbatch_train_step",
    "tokenize_prompt_and_output",
]
