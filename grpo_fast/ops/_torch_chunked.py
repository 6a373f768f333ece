"""The ``torch_chunked`` backend: the token log-prob kernels in plain PyTorch, on any device.

The same algorithm as ``csrc_triton/token_logprobs.py`` (see its docstring for the math). Rows go
in fixed tiles of ``ROW_TILE`` (the last one zero-padded) and the vocabulary in blocks of
``VOCAB_BLOCK`` with an online max, so the extra memory is a few ``[ROW_TILE, VOCAB_BLOCK]`` fp32
tiles (4 MiB each), never ``[N, V]``. Neither size depends on N: every row goes through the same op
sequence on a tile of the same shape whatever shares the call, so its results are bitwise batch
invariant.

Each op reads and writes whole blocks from memory, so the cost is the number of passes over a block.
Per block of fp32 logits at T = 1 with no ``−inf`` and no truncation, the forward makes 6 passes
(max, ``d = s − m``, ``e = exp(d)``, ``Σ e`` in fp64, ``e·d``, ``Σ e·d`` from fp32 partials) and
the backward 3 (``d``, ``exp``, ``·c1`` into ``out``) when the loss has no entropy term (``g_H = 0``),
6 with one; before 2026-12-02 they made about 12 and 14, with two fp64 copies of the block in the
forward. One fused fwd+bwd (N 4,096, D 256, V 32,768 fp32, CPU, one thread, 2 cores shared at load
≈ 4.2, medians of 3 alternating runs): 4.24 s -> 2.83 s, 2.22x -> 1.48x its three GEMMs (1.91 s;
``bench/test_bench_fused_linear_grpo_loss.py``, ``gemm_floor``).
"""

from __future__ import annotations

import torch

__all__ = ["ROW_TILE", "VOCAB_BLOCK", "token_logprobs_bwd", "token_logprobs_fwd"]

# 64 x 16384 fp32 = 4 MiB per tile. Bigger tiles mean fewer ops, which matters on a busy CPU: with
# 2 OpenMP threads on a loaded 2-core machine each op can wait a scheduler slice (~10 ms), and
# N = 512, V = 32,768 fwd + bwd took 17.5 s with 32 x 8192 tiles against 4.4 s with these
# (0.27 s vs 0.28 s on one uncontended thread).
ROW_TILE = 64
VOCAB_BLOCK = 16384
# Entries per fp32 partial sum of a row (_row_sum64).
_SUM_GROUP = 16


def _row_tile(x: torch.Tensor, r0: int) -> torch.Tensor:
    """Rows ``[r0, r0 + ROW_TILE)`` of ``x`` (``[N, ...]``), zero-padded to ``ROW_TILE`` rows."""
    tile = x[r0 : r0 + ROW_TILE]
    if tile.shape[0] == ROW_TILE:
        return tile
    padded = x.new_zeros((ROW_TILE, *x.shape[1:]))
    padded[: tile.shape[0]] = tile
    return padded


def _row_sum64(x: torch.Tensor) -> torch.Tensor:
    """``Σ_v x[:, v]``, ``[R, W] fp32 -> [R] fp64``: fp32 sums of ``_SUM_GROUP`` entries ``W / 16``
    apart (one read of ``x``, vectorized along the row), then fp64 over those ``W / 16`` partials,
    without the fp64 copy of ``x`` that ``x.sum(1, dtype=torch.float64)`` makes. Each partial rounds at
    most 15 times and their errors are independent: a few units of 2⁻²⁴ relative, not exact.

    Used for ``A = Σ e·(s − m) ≤ 0``: H = log S − A/S adds two non-negative terms, so an error of
    ``δ`` relative in ``A`` moves ``H`` by at most ``δ·H`` (on the N = 70, V = 4,099 batch-invariance
    logits, max |H − H₆₄| 2.5e-7 against 2.4e-7 with an exact fp64 sum; the tests' atol is 4 units
    of 2⁻²⁴ at |H|). ``S`` is summed exactly: ``logp`` and the gradient read ``log S`` directly.
    """
    w = x.shape[1]
    main = w - w % _SUM_GROUP
    total = x[:, :main].unflatten(1, (_SUM_GROUP, main // _SUM_GROUP)).sum(1).sum(1, dtype=torch.float64)
    if main < w:
        total += x[:, main:].sum(1, dtype=torch.float64)
    return total


def _scaled(block: torch.Tensor, inv_temperature: float, out: torch.Tensor) -> torch.Tensor:
    """``out = s = block·inv_temperature`` in fp32 (``block``: logits of any float dtype)."""
    if block.dtype == torch.float32:
        return torch.mul(block, inv_temperature, out=out)
    # bf16 · float with an fp32 out would multiply in bf16: upcast first (exact)
    return out.copy_(block).mul_(inv_temperature)


def _shifted(
    block: torch.Tensor, inv_temperature: float, ref: torch.Tensor, out: torch.Tensor
) -> torch.Tensor:
    """``out = s − ref`` (``ref`` ``[R, 1]`` fp32) with eager's two roundings (``s``, then the
    difference); a single pass at T = 1."""
    if inv_temperature == 1.0:
        return torch.sub(block, ref, out=out)  # block·1 is exact; bf16 − fp32 computes in fp32
    return _scaled(block, inv_temperature, out).sub_(ref)


def _truncated(s: torch.Tensor, v0: int, labels_tile: torch.Tensor, thr: torch.Tensor | None) -> torch.Tensor:
    """``s`` ``[R, Vb]`` (columns ``v0 …``) with the tokens truncated sampling leaves out (below the
    row's threshold ``thr`` ``[R, 1]``, the label kept) at ``−inf``; ``s`` itself when ``thr`` is None."""
    if thr is None:
        return s
    cols = torch.arange(v0, v0 + s.shape[1], device=s.device)
    keep = (s >= thr) | (cols == labels_tile[:, None])  # [R, Vb]
    return s.masked_fill_(~keep, float("-inf"))


def _has_neg_inf(block: torch.Tensor) -> bool:
    """Whether a row of ``block`` has a ``−inf`` entry (per row: a NaN row hides no other row's).
    A host-device sync on CUDA."""
    return bool((block.amin(dim=1) == float("-inf")).any())


def token_logprobs_fwd(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, threshold: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, V], [N] -> (logp, entropy, row_max, log_norm)``, each ``[N]`` fp32; see csrc_triton.
    ``threshold`` ``[N]`` fp32: the truncated distribution's (``grpo_fast.algo.core.truncation_threshold``)."""
    n, v = logits.shape
    device = logits.device
    outs = tuple(torch.empty(n, dtype=torch.float32, device=device) for _ in range(4))
    neg_inf = float("-inf")
    shifted = torch.empty(ROW_TILE, min(VOCAB_BLOCK, v), device=device)  # d = s − m, then e·d
    exps = torch.empty_like(shifted)  # e = exp(d)
    for r0 in range(0, n, ROW_TILE):
        rows = _row_tile(logits, r0)  # [R, V]
        labels_tile = _row_tile(labels, r0).long()
        thr = None if threshold is None else _row_tile(threshold, r0)[:, None]
        m = torch.full((ROW_TILE,), neg_inf, device=device)  # running max of s
        # S and A accumulate in fp64 (the tile's exps stay fp32). An fp32 row sum of V exps is off by a
        # few ulps (N = 37, V = 1000, T = 0.7, row 13: S 2.4e-7 relative, which moved a logp ≈ −19.9 one
        # ulp, 1.9e-6, and the ratio exp(logp − old) with it: grad error 3.15e-7 against eager's 1.15e-7;
        # with fp64 sums logp is off 3.6e-7, 0.2 ulp, as eager is). S is summed exactly in fp64; A only
        # enters H = log S − A/S, where fp32 partial sums of 16 terms (_row_sum64) keep H within an ulp.
        sum_exp = torch.zeros(ROW_TILE, dtype=torch.float64, device=device)  # S = Σ exp(s − m)
        sum_exp_shift = torch.zeros(ROW_TILE, dtype=torch.float64, device=device)  # A = Σ exp(s − m)·(s − m)
        for v0 in range(0, v, VOCAB_BLOCK):
            block = rows[:, v0 : v0 + VOCAB_BLOCK]  # [R, Vb] logits
            d, e = shifted[:, : block.shape[1]], exps[:, : block.shape[1]]
            if thr is None:
                # = max of s: rounding is monotone (aminmax, for the −inf check too, is 4x slower than amax)
                block_max = block.amax(dim=1).float() * inv_temperature  # [R, Vb] -> [R]
            else:
                block_max = _truncated(_scaled(block, inv_temperature, d), v0, labels_tile, thr).amax(dim=1)
            m_new = torch.maximum(m, block_max)
            ref = torch.where(m_new == neg_inf, 0.0, m_new)  # finite while the row is all −inf
            alpha = torch.exp(m - ref).double()
            shift = torch.where(m == neg_inf, 0.0, m - ref).double()
            if thr is None:
                _shifted(block, inv_temperature, ref[:, None], d)  # d = s − ref
            else:
                d.sub_(ref[:, None])
            torch.exp(d, out=e)
            block_sum = e.sum(dim=1, dtype=torch.float64)  # an fp64 copy of e: S must be exact
            if thr is None and not block.is_cuda:
                block_shift = _row_sum64(d.mul_(e))  # Σ e·d
                # a −inf logit gives exp(−inf)·(−inf) = NaN: then again with those terms at 0 (a NaN
                # row gives NaN either way). CPU only: on CUDA the check is a host-device sync per
                # block (~1,300 a forward at N 8k, V 152k), so there the masked pass always runs
                if bool(block_shift.isnan().any()):
                    d = _shifted(block, inv_temperature, ref[:, None], d)
                    block_shift = _row_sum64(d.mul_(e).masked_fill_(e == 0.0, 0.0))
            else:
                block_shift = _row_sum64(d.mul_(e).masked_fill_(e == 0.0, 0.0))
            sum_exp_shift = alpha * (sum_exp_shift + shift * sum_exp) + block_shift
            sum_exp = alpha * sum_exp + block_sum
            m = m_new
        ref = torch.where(m == neg_inf, 0.0, m)
        log_norm = torch.log(sum_exp)  # fp64
        s_label = rows.gather(1, labels_tile[:, None]).squeeze(1).float() * inv_temperature
        k = min(ROW_TILE, n - r0)
        # one fp32 rounding per output: (s_y − m) − log S and log S − A/S are combined in fp64
        outs[0][r0 : r0 + k] = ((s_label.double() - ref.double()) - log_norm)[:k]
        outs[1][r0 : r0 + k] = (log_norm - sum_exp_shift / sum_exp)[:k]
        outs[2][r0 : r0 + k] = ref[:k]
        outs[3][r0 : r0 + k] = log_norm[:k]
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
    """Write ``∂loss/∂logits [N, V]`` into ``out`` (may be ``logits``); see csrc_triton. Returns ``out``.
    ``threshold``: the forward's; a left-out token has probability 0, so its gradient is 0.

    ``dz = (g_lp·(δ_y − p) − g_H·p·(log p + H)) / T = exp(s − m)·(c1 + c2·(log p + H)) + δ_y·g_lp / T``
    with ``c1 = −g_lp / (T·S)``, ``c2 = −g_H / (T·S)`` and ``log p + H = (s − m) + (H − log S)``; with
    no entropy term (every ``g_H`` 0) that is ``exp(s − m)·c1``, two passes over the block after ``s − m``.
    """
    n, v = logits.shape
    device = logits.device
    inv_t = inv_temperature
    # one host-device sync per call on CUDA: whether the loss has an entropy term at all
    with_entropy = bool(grad_entropy.ne(0).any())
    direct = out.dtype == torch.float32  # else dz is rounded to out's dtype once, from fp32
    shifted = torch.empty(ROW_TILE, min(VOCAB_BLOCK, v), device=device)  # s − m, then dz
    probs = torch.empty_like(shifted) if with_entropy else None
    for r0 in range(0, n, ROW_TILE):
        k = min(ROW_TILE, n - r0)
        rows = _row_tile(logits, r0)  # [R, V]
        labels_tile = _row_tile(labels, r0).long()
        thr = None if threshold is None else _row_tile(threshold, r0)[:, None]
        g_lp, g_h, ref, lnorm, ent = (
            _row_tile(t, r0)[:, None] for t in (grad_logp, grad_entropy, row_max, log_norm, entropy)
        )
        # the row coefficients, each rounded once from fp64: c1 = −g_lp / (T·S), c2 = −g_H / (T·S), H − log S
        inv_s = torch.exp(-lnorm.double())  # 1 / S
        c1 = (g_lp.double() * inv_s).mul_(-inv_t).float()  # [R, 1]
        c2 = (g_h.double() * inv_s).mul_(-inv_t).float()
        h_minus_log_s = (ent.double() - lnorm.double()).float()
        # where p = 0 the entropy term is 0, but a row of only −inf (S = 0) stays NaN, as in the reference
        zero_p_grad = torch.where(lnorm == float("-inf"), float("nan"), 0.0)
        label_grad = g_lp * inv_t
        for v0 in range(0, v, VOCAB_BLOCK):
            block = rows[:, v0 : v0 + VOCAB_BLOCK]  # [R, Vb] logits
            width = block.shape[1]
            d = shifted[:, :width]
            dest = out[r0 : r0 + k, v0 : v0 + width]
            # −inf logits give p = 0 but a NaN p·(c1 + c2·(log p + H)); read before dest may overwrite block
            # (on CUDA always: _has_neg_inf is a host-device sync per block)
            guard = with_entropy and (thr is not None or block.is_cuda or _has_neg_inf(block))
            if thr is None:
                _shifted(block, inv_t, ref, d)  # s − m
            else:
                _truncated(_scaled(block, inv_t, d), v0, labels_tile, thr).sub_(ref)
            dz = dest if direct else d[:k]
            if with_entropy:
                e = torch.exp(d, out=probs[:, :width])  # S·p
                t = d.add_(h_minus_log_s)  # log p + H
                t.mul_(c2).add_(c1)
                if guard:
                    torch.where(e == 0.0, zero_p_grad, t, out=t)
                torch.mul(t[:k], e[:k], out=dz)
            else:
                torch.mul(d.exp_()[:k], c1[:k], out=dz)  # exp(s − m)·c1 = −g_lp·p / T
            # + g_lp / T at the label column, for the rows whose label falls in this block
            in_block = (labels_tile[:k] >= v0) & (labels_tile[:k] < v0 + width)
            cols = (labels_tile[:k] - v0).clamp_(0, width - 1)[:, None]
            dz.scatter_add_(1, cols, torch.where(in_block[:, None], label_grad[:k], 0.0))
            if not direct:
                dest.copy_(dz)
    return out
