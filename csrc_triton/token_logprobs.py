"""Triton kernels for per-token log-probs and entropy of tempered logits, and their launchers.

Math, per row of logits ``z`` with ``s = z / T`` (``p = softmax(s)``, label ``y``):

    m = max_j s_j,  S = Σ_j exp(s_j − m),  A = Σ_j exp(s_j − m)·(s_j − m)
    logp = (s_y − m) − log S,  H = log S − A / S

Forward: one program per row, one pass over the vocabulary in ``BLOCK_V`` tiles with an online
max (``S`` and ``A`` are rescaled whenever ``m`` grows). It writes ``logp`` and ``H`` and, for the
backward, the pair ``(m, log S)``: the log-normalizer kept in two parts so that
``log p_j = (s_j − m) − log S`` stays exact for huge logits. (One fp32 ``lse = m + log S`` would
round at ulp(lse): 4.9e-4 at |z| ≈ 1e4, a 5e-4 relative error on every p_j.)

Backward: one program per row, one pass that reads ``z`` and writes

    ∂ℓ/∂z_j = (g_lp·(δ_jy − p_j) − g_H·p_j·(log p_j + H)) / T

into ``grad_logits``, which may be ``logits`` itself (each element is read before it is written,
by the same program).

Truncated sampling (top-k / top-p, ``HAS_THRESHOLD``): each row has a threshold ``τ``
(``grpo_fast.algo.core.truncation_threshold``, computed by the caller from the same fp32 ``s``);
both passes treat every ``s_j < τ`` but the label's as ``−inf``, so ``m``, ``S``, ``A``, ``logp``,
``H`` and ``p_j`` above are those of ``softmax`` over the kept tokens, and a left-out token's
gradient is 0 (the set is piecewise constant in ``z``).

The rows never interact: a row's outputs do not depend on the other rows of the call (batch
invariance), and the tile size depends only on ``V``.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

__all__ = ["token_logprobs_bwd", "token_logprobs_fwd"]

# One tile is BLOCK_V logits of one row. Not tuned on a GPU yet: 8192 bf16 = 16 KB per program
# step and 16 elements per thread at 16 warps, the range Liger and flash-attention use for
# vocab-sized rows. ptxas for sm_90a (triton 3.9): fwd 40, bwd 58 registers per thread, no spills.
_MAX_BLOCK_V = 8192


def _launch_config(vocab_size: int) -> tuple[int, int]:
    """``(BLOCK_V, num_warps)`` for rows of ``vocab_size``; never depends on the number of rows."""
    block_v = min(_MAX_BLOCK_V, triton.next_power_of_2(vocab_size))
    num_warps = 16 if block_v >= 8192 else 8 if block_v >= 2048 else 4
    return block_v, num_warps


@triton.jit
def _token_logprobs_fwd_kernel(
    # pointers
    logits_ptr,  # [N, V] fp32 / bf16 / fp16, unit stride along V
    labels_ptr,  # [N] int32 / int64, in [0, V)
    logp_ptr,  # [N] fp32 out: log p(label)
    entropy_ptr,  # [N] fp32 out: H
    row_max_ptr,  # [N] fp32 out: m (0 for a row of only −inf)
    log_norm_ptr,  # [N] fp32 out: log S
    threshold_ptr,  # [N] fp32: truncated sampling's threshold τ (read only with HAS_THRESHOLD)
    # sizes
    V,
    # strides
    stride_logits_n,
    # runtime scalars
    inv_temperature,
    BLOCK_V: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_n
    label = tl.load(labels_ptr + row)
    if HAS_THRESHOLD:
        thr = tl.load(threshold_ptr + row)

    m = float("-inf")  # running max of s
    sum_exp = 0.0  # S = Σ exp(s − m)
    sum_exp_shift = 0.0  # A = Σ exp(s − m)·(s − m)
    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))
        s = z.to(tl.float32) * inv_temperature  # [BLOCK_V]
        if HAS_THRESHOLD:  # the tokens truncated sampling leaves out (the label kept): probability 0
            s = tl.where((s >= thr) | (cols == label), s, float("-inf"))
        m_new = tl.maximum(m, tl.max(s, axis=0))  # [BLOCK_V] -> []
        # A finite reference point: m_new is still −inf while every logit so far is −inf.
        ref = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp(m - ref)  # rescales the old sums; 0 while m = −inf
        # Re-centre A on the new max: Σ e·(s − m_new) = α·(A + (m − m_new)·S). While m = −inf, S = 0.
        shift = tl.where(m == float("-inf"), 0.0, m - ref)
        d = s - ref  # [BLOCK_V]
        e = tl.exp(d)
        # exp(−inf)·(−inf) would be NaN; a NaN logit still gives NaN here (e != 0).
        ed = tl.where(e == 0.0, 0.0, e * d)
        sum_exp_shift = alpha * (sum_exp_shift + shift * sum_exp) + tl.sum(ed, axis=0)  # [BLOCK_V] -> []
        sum_exp = alpha * sum_exp + tl.sum(e, axis=0)  # [BLOCK_V] -> []
        m = m_new

    ref = tl.where(m == float("-inf"), 0.0, m)
    log_norm = tl.log(sum_exp)
    s_label = tl.load(row_ptr + label).to(tl.float32) * inv_temperature
    tl.store(logp_ptr + row, (s_label - ref) - log_norm)
    tl.store(entropy_ptr + row, log_norm - sum_exp_shift / sum_exp)
    tl.store(row_max_ptr + row, ref)
    tl.store(log_norm_ptr + row, log_norm)


@triton.jit
def _round_to_bf16(x):
    """fp32 -> bf16, rounding to nearest even with integer ops (NaN kept)."""
    bits = x.to(tl.uint32, bitcast=True)
    bits = bits + 0x7FFF + ((bits >> 16) & 1)
    rounded = ((bits >> 16) << 16).to(tl.float32, bitcast=True)
    return tl.where(x == x, rounded, x).to(tl.bfloat16)


@triton.jit
def _token_logprobs_bwd_kernel(
    # pointers
    logits_ptr,  # [N, V] fp32 / bf16 / fp16, unit stride along V
    grad_logits_ptr,  # [N, V] out, same dtype; may be logits_ptr (in-place)
    labels_ptr,  # [N] int
    grad_logp_ptr,  # [N] fp32: g_lp = ∂loss/∂logp
    grad_entropy_ptr,  # [N] fp32: g_H = ∂loss/∂H
    row_max_ptr,  # [N] fp32: m from the forward
    log_norm_ptr,  # [N] fp32: log S from the forward
    entropy_ptr,  # [N] fp32: H from the forward
    threshold_ptr,  # [N] fp32: the forward's τ (read only with HAS_THRESHOLD)
    # sizes
    V,
    # strides
    stride_logits_n,
    stride_grad_n,
    # runtime scalars
    inv_temperature,
    BLOCK_V: tl.constexpr,
    ROUND_BF16_IN_SOFTWARE: tl.constexpr,
    HAS_THRESHOLD: tl.constexpr,
):
    row = tl.program_id(0).to(tl.int64)
    row_ptr = logits_ptr + row * stride_logits_n
    grad_row_ptr = grad_logits_ptr + row * stride_grad_n
    label = tl.load(labels_ptr + row)
    g_lp = tl.load(grad_logp_ptr + row)
    g_h = tl.load(grad_entropy_ptr + row)
    ref = tl.load(row_max_ptr + row)
    log_norm = tl.load(log_norm_ptr + row)
    entropy = tl.load(entropy_ptr + row)
    if HAS_THRESHOLD:
        thr = tl.load(threshold_ptr + row)

    for v0 in range(0, V, BLOCK_V):
        cols = v0 + tl.arange(0, BLOCK_V)
        z = tl.load(row_ptr + cols, mask=cols < V, other=float("-inf"))
        s = z.to(tl.float32) * inv_temperature  # [BLOCK_V]
        if HAS_THRESHOLD:  # a left-out token has p = 0: gradient 0
            s = tl.where((s >= thr) | (cols == label), s, float("-inf"))
        log_p = (s - ref) - log_norm  # [BLOCK_V]
        p = tl.exp(log_p)
        # p·(log p + H) is 0 where p is 0 (a −inf logit would give 0·(−inf) = NaN); NaN stays NaN.
        ent = tl.where(p == 0.0, 0.0, p * (log_p + entropy))
        dz = (tl.where(cols == label, g_lp, 0.0) - (g_lp * p + g_h * ent)) * inv_temperature
        if ROUND_BF16_IN_SOFTWARE:
            dz_out = _round_to_bf16(dz)
        else:
            dz_out = dz.to(grad_logits_ptr.dtype.element_ty)
        tl.store(grad_row_ptr + cols, dz_out, mask=cols < V)


def token_logprobs_fwd(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, threshold: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Launch the forward kernel: ``[N, V], [N] -> (logp, entropy, row_max, log_norm)``, each ``[N]`` fp32.

    ``logits`` must have unit stride along V; inputs are assumed valid (``grpo_fast.ops`` checks).
    ``threshold`` ``[N]`` fp32 contiguous: the truncated distribution's τ per row (module docstring).
    """
    n, v = logits.shape
    outs = tuple(torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
    if n == 0:
        return outs
    block_v, num_warps = _launch_config(v)
    has_threshold = threshold is not None
    _token_logprobs_fwd_kernel[(n,)](
        logits, labels, *outs, threshold if has_threshold else outs[0], v, logits.stride(0), inv_temperature,
        BLOCK_V=block_v, HAS_THRESHOLD=has_threshold, num_warps=num_warps,
    )  # fmt: skip
    return outs


def token_logprobs_bwd(
    logits: torch.Tensor,
    labels: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    row_max: torch.Tensor,
    log_norm: torch.Tensor,
    entropy: torch.Tensor,
    inv_temperature: float,
    out: torch.Tensor,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """Launch the backward kernel: write ``∂loss/∂logits [N, V]`` into ``out`` (may be ``logits``).

    ``grad_logp, grad_entropy``: ``[N]`` fp32 contiguous; ``row_max, log_norm, entropy``: the
    forward's ``[N]`` outputs; ``threshold``: the forward's. Returns ``out``.
    """
    n, v = logits.shape
    if n == 0:
        return out
    block_v, num_warps = _launch_config(v)
    # 2026-11 (triton 3.9): the interpreter truncates fp32 -> bf16 casts (runtime/interpreter.py
    # cast_impl ignores the rounding mode), twice the error of a GPU's round-to-nearest-even.
    round_bf16 = out.dtype == torch.bfloat16 and os.environ.get("TRITON_INTERPRET") == "1"
    _token_logprobs_bwd_kernel[(n,)](
        logits,
        out,
        labels,
        grad_logp,
        grad_entropy,
        row_max,
        log_norm,
        entropy,
        threshold if threshold is not None else entropy,
        v,
        logits.stride(0),
        out.stride(0),
        inv_temperature,
        BLOCK_V=block_v,
        ROUND_BF16_IN_SOFTWARE=round_bf16,
        HAS_THRESHOLD=threshold is not None,
        num_warps=num_warps,
    )
    return out
