"""Fused GRPO ops: log-probs, entropy and the GRPO loss without an ``[N, V]`` fp32 tensor.

- ``token_logprobs_and_entropy(logits [N, V], labels [N]) -> (logprobs [N], entropy [N])``
- ``grpo_loss_from_logits(logits [N, V], labels, advantages, loss_weights, ...) -> GRPOLossOutput``
- ``fused_linear_grpo_loss(hidden [N, D], weight [V, D], labels, ...) -> GRPOLossOutput``

Every op takes ``backend="auto" | "triton" | "torch_chunked" | "eager"`` (see ``_backend``) and is
tested against the float64 eager reference in ``grpo_fast.algo.core``.
"""

from grpo_fast.ops.fused_linear_grpo_loss import default_chunk_size, fused_linear_grpo_loss
from grpo_fast.ops.grpo_loss import grpo_loss_from_logits
from grpo_fast.ops.token_logprobs import token_logprobs_and_entropy

__all__ = [
    "default_chunk_size",
    "fused_linear_grpo_loss",
    "grpo_loss_from_logits",
    "token_logprobs_and_entropy",
]
