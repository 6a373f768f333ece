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

from grpo_fast.algo.reference import eager_token_logprobs_and_entropy
from grpo_fast.algo.truncation import truncates, truncation_threshold
from grpo_fast.ops._backend import (
    check_backend,
    check_label_range,
    check_per_token,
    check_temperature,
    check_truncation,
    kernels_for,
)

__all__ = ["TokenLogprobs", "sampler_thresholds", "token_logprobs_and_entropy"]

# Rows of s per sort in sampler_thresholds: the sorted values, their int64 indices and three fp64
# [R, V] buffers of the prefix sums, ≈ 36 bytes per logit: 16 × 151,936 × 36 B ≈ 88 MB at Qwen2.5's
# vocabulary, below one CUDA chunk of logits (128 MiB), whatever the chunk.
THRESHOLD_ROWS = 16


def sampler_thresholds(
    logits: torch.Tensor, inv_temperature: float, top_k: int, top_p: float
) -> torch.Tensor | None:
    """The truncated sampler's threshold of each row of ``logits`` ``[N, V]`` (``[N]`` fp32, or None
    when top-k/top-p leave nothing out), from ``s = z.float()·inv_temperature``, the fp32 values
    the kernels compute: ``grpo_fast.algo.core.truncation_threshold`` on ``THRESHOLD_ROWS`` rows at a
    time (a sort per row for top-p; top-k alone needs none), so nothing ``[N, V]`` is allocated."""
    n, v = logits.shape
    if not truncates(top_k, top_p, v):
        return None
    out = torch.empty(n, dtype=torch.float32, device=logits.device)
    for r0 in range(0, n, THRESHOLD_ROWS):
        s = logits[r0 : r0 + THRESHOLD_ROWS].float() * inv_temperature  # [R, V] fp32, as the kernels
        out[r0 : r0 + THRESHOLD_ROWS] = truncation_threshold(s, top_k, top_p)
    return out


_INPLACE_USED = (
    "token_logprobs_and_entropy(inplace_grad=True): the logits buffer was overwritten by its "
    "gradient in the first backward, so a second backward through it cannot run. Pass "
    "inplace_grad=False (one more [N, V] buffer in the backward) or recompute the logits."
)


class TokenLogprobs(torch.autograd.Function):
    """``(logits [N, V], labels [N]) -> (logp [N] fp32, entropy [N] fp32)``, differentiable in logits.

    Saves ``logits`` plus three fp32 per row (four with top-k/top-p: the threshold). The backward writes ``∂loss/∂logits`` into a new
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
        top_k: int = 0,
        top_p: float = 1.0,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        inv_temperature = 1.0 / temperature
        threshold = sampler_thresholds(logits, inv_temperature, top_k, top_p)
        logp, entropy, row_max, log_norm = kernels.token_logprobs_fwd(
            logits, labels, inv_temperature, threshold
        )
        ctx.save_for_backward(logits, labels, row_max, log_norm, entropy)
        ctx.threshold = threshold
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
            ctx.threshold,
        )
        if ctx.inplace_grad:
            # The kernel wrote behind autograd's back: record it, so that a node that saved these
            # logits raises "modified by an inplace operation" instead of using gradients as logits.
            torch.autograd.graph.increment_version(logits)
            ctx.grad_written = True
        return out, None, None, None, None, None, None


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
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    backend: str,
    inplace_grad: bool,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dispatch an already validated call (``backend`` resolved, never ``auto``)."""
    if backend == "eager":
        return eager_token_logprobs_and_entropy(logits, labels, temperature, top_k=top_k, top_p=top_p)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    return TokenLogprobs.apply(
        logits, labels.contiguous(), float(temperature), kernels_for(backend), inplace_grad, top_k, top_p
    )


def token_logprobs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    backend: str = "auto",
    *,
    inplace_grad: bool = False,
    top_k: int = 0,
    top_p: float = 1.0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Log-prob of each label and entropy of each row of ``softmax(logits / temperature)``, or,
    with ``top_k`` / ``top_p``, of the truncated distribution top-k/top-p sampling draws from.

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
        top_k, top_p: the sampler's truncation (``top_k`` 0 = none, ``top_p`` in (0, 1], 1 =
            none): each row's kept set is its ``top_k`` largest ``s = z/T`` and/or the smallest
            prefix reaching mass ``top_p`` after them, as vLLM and transformers sample
            (``grpo_fast.algo.core.truncation_threshold``); then ``logp = s_y − logsumexp_kept s``
            and the entropy and gradients are the truncated distribution's (a left-out token's
            gradient is 0). The label is always kept. Computed from the logits in rows of 16
            (a sort per row for top-p), never ``[N, V]`` fp32.

    Returns:
        ``(logprobs [N] fp32, entropy [N] fp32)``, both differentiable w.r.t. ``logits``. A row with
        a NaN logit gives NaN in both, and NaN gradients for that row.

    Example:
        >>> logits = torch.tensor([[0.0, 0.0, 0.0, 0.0]])  # uniform over 4
        >>> token_logprobs_and_entropy(logits, torch.tensor([2]))  # (−log 4, log 4)
        (tensor([-1.3863]), tensor([1.3863]))
    """
    check_temperature(temperature)
    check_truncation(top_k, top_p)
    resolved = prepare_logits(logits, labels, backend, inplace_grad)
    return apply_token_logprobs(logits, labels, temperature, resolved, inplace_grad, top_k, top_p)
