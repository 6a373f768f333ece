"""Per-token log-probs and entropy of tempered logits, without an ``[N, V]`` fp32 tensor.

Call chain: ``csrc_triton/token_logprobs.py`` kernels (or ``_torch_chunked``) -> ``TokenLogprobs``
(``torch.autograd.Function``) -> ``token_logprobs_and_entropy`` (validates, dispatches).

Memory, ``N`` tokens, vocabulary ``V``, logits in dtype ``b`` bytes: the eager reference keeps
several ``[N, V]`` fp32 tensors for its backward (≥ 3·4·N·V bytes); this op saves 3 fp32 per row
(row max, log-normalizer, entropy) and writes ``∂/∂logits`` once (``b·N·V`` bytes, or nothing with
``inplace_grad=True``, which reuses the logits buffer).
"""

from __future__ import annotations

from types import ModuleType

import torch
from torch.autograd.function import once_differentiable

from grpo_fast.algo.core import eager_token_logprobs_and_entropy
from grpo_fast.ops._backend import (
    check_backend,
    check_label_range,
    check_per_token,
    check_temperature,
    kernels_for,
)

__all__ = ["TokenLogprobs", "token_logprobs_and_entropy"]

_INPLACE_USED = (
    "token_logprobs_and_entropy(inplace_grad=True): the logits buffer was overwritten by its "
    "gradient in the first backward, so a second backward through it cannot run. Pass "
    "inplace_grad=False (one more [N, V] buffer in the backward) or recompute the logits."
)


class TokenLogprobs(torch.autograd.Function):
    """``(logits [N, V], labels [N]) -> (logp [N] fp32, entropy [N] fp32)``, differentiable in logits.

    Saves ``logits`` plus three fp32 per row. The backward writes ``∂loss/∂logits`` into a new
    buffer, or into ``logits`` itself when ``inplace_grad`` (then bumps its version counter, so any
    other autograd node that saved those logits refuses to run on the overwritten values).
    """

    @staticmethod
    def forward(
        ctx,
        logits: torch.Tensor,
        labels: torch.Tensor,
        temperature: float,
        kernels: ModuleType,
        inplace_grad: bool,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_temperature = 1.0 / temperature
        logp, entropy, row_max, log_norm = kernels.token_logprobs_fwd(logits, labels, inv_temperature)
        ctx.save_for_backward(logits, labels, row_max, log_norm, entropy)
        ctx.inv_temperature = inv_temperature
        ctx.kernels = kernels
        ctx.inplace_grad = inplace_grad
        ctx.grad_written = False
        return logp, entropy

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_logp: torch.Tensor, grad_entropy: torch.Tensor):
        if ctx.grad_written:
            raise RuntimeError(_INPLACE_USED)
        logits, labels, row_max, log_norm, entropy = ctx.saved_tensors
        out = logits if ctx.inplace_grad else torch.empty_like(logits)
        ctx.kernels.token_logprobs_bwd(
            logits,
            labels,
            grad_logp.float().contiguous(),
            grad_entropy.float().contiguous(),
            row_max,
            log_norm,
            entropy,
            ctx.inv_temperature,
            out,
        )
        if ctx.inplace_grad:
            # The kernel wrote behind autograd's back: record it, so that a node that saved these
            # logits raises "modified by an inplace operation" instead of using gradients as logits.
            torch.autograd.graph.increment_version(logits)
            ctx.grad_written = True
        return out, None, None, None, None


def prepare_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    backend: str,
    inplace_grad: bool,
    **vectors: torch.Tensor | None,
) -> str:
    """Validate ``logits [N, V]``, ``labels [N]``, other ``[N]`` vectors, the backend and
    ``inplace_grad``; return the resolved backend."""
    check_per_token("logits", logits, labels, backend, **vectors)
    resolved = check_backend(backend, logits.device)
    if inplace_grad and logits.requires_grad and logits.is_leaf:
        raise ValueError(
            "inplace_grad=True needs logits computed by an op (e.g. lm_head), not a leaf tensor: "
            "the leaf's .grad would be its own data buffer"
        )
    if inplace_grad and logits.stride(-1) != 1:
        raise ValueError("inplace_grad=True needs logits with unit stride along V (a copy would be written)")
    check_label_range(labels, logits.shape[1])
    return resolved


def apply_token_logprobs(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, backend: str, inplace_grad: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch an already validated call (``backend`` resolved, never ``auto``)."""
    if backend == "eager":
        return eager_token_logprobs_and_entropy(logits, labels, temperature)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return TokenLogprobs.apply(
        logits, labels.contiguous(), float(temperature), kernels_for(backend), inplace_grad
    )


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    backend: str = "auto",
    *,
    inplace_grad: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of each row of ``softmax(logits / temperature)``.

    Args:
        logits: ``[N, V]`` fp32, bf16 or fp16 (fp64 with ``backend="eager"``); ``-inf`` entries
            (a padded vocabulary) have probability 0.
        labels: ``[N]`` int64/int32 in ``[0, V)``; out of range is a ``ValueError``.
        temperature: ``T > 0``, a runtime kernel argument (no recompile per value).
        backend: ``"auto"`` (``triton`` on CUDA, else ``torch_chunked``), ``"triton"``,
            ``"torch_chunked"`` or ``"eager"`` (the ``grpo_fast.algo.core`` reference).
        inplace_grad: the backward writes ``∂/∂logits`` into the logits buffer (saves ``[N, V]``
            of memory). The logits must not be read again after the backward, nor be a leaf; a
            second backward raises ``RuntimeError``. Ignored by ``eager``.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32)``, both differentiable w.r.t. ``logits``. A row with
        a NaN logit gives NaN in both, and NaN gradients for that row.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])  # uniform over 4
        >>> token_logprobs_and_entropy(logits, torch.tensor([2]))  # (−log 4, log 4)
        (tensor([-1.3863]), tensor([1.3863]))
    """
    check_temperature(temperature)
    resolved = prepare_logits(logits, labels, backend, inplace_grad)
    return apply_token_logprobs(logits, labels, temperature, resolved, inplace_grad)
