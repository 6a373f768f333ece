"""The ``torch_chunked`` backend: the token log-prob kernels in plain PyTorch, on any device.

The same algorithm as ``csrc_triton/token_logprobs.py`` (see its docstring for the math). Rows go
in fixed tiles of ``ROW_TILE`` (the last one zero-padded) and the vocabulary in blocks of
``VOCAB_BLOCK`` with an online max, so the extra memory is a few ``[ROW_TILE, VOCAB_BLOCK]`` fp32
tiles (4 MiB each), never ``[N, V]``. Neither size depends on N: every row goes through the same op
sequence on a tile of the same shape whatever shares the call, so its results are bitwise batch
invariant.
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


def _row_tile(x: torch.Tensor, r0: int) -> torch.Tensor:
    """Rows ``[r0, r0 + ROW_TILE)`` of ``x`` (``[N, ...]``), zero-padded to ``ROW_TILE`` rows."""
    tile = x[r0 : r0 + ROW_TILE]
    if tile.shape[0] == ROW_TILE:
        return tile
    padded = x.new_zeros((ROW_TILE, *x.shape[1:]))
    padded[: tile.shape[0]] = tile
    return padded


def _truncated(s: torch.Tensor, v0: int, labels_tile: torch.Tensor, thr: torch.Tensor | None) -> torch.Tensor:
    """``s`` ``[R, Vb]`` (columns ``v0 …``) with the tokens truncated sampling leaves out (below the
    row's threshold ``thr`` ``[R, 1]``, the label kept) at ``−inf``; ``s`` itself when ``thr`` is None."""
    if thr is None:
        return s
    cols = torch.arange(v0, v0 + s.shape[1], device=s.device)
    keep = (s >= thr) | (cols == labels_tile[:, None])  # [R, Vb]
    return s.masked_fill_(~keep, float("-inf"))


def token_logprobs_fwd(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, threshold: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, V], [N] -> (logp, entropy, row_max, log_norm)``, each ``[N]`` fp32; see csrc_triton.
    ``threshold`` ``[N]`` fp32: the truncated distribution's (``grpo_fast.algo.core.truncation_threshold``)."""
    n, v = logits.shape
    outs = tuple(torch.empty(n, dtype=torch.float32, device=logits.device) for _ in range(4))
    neg_inf = float("-inf")
    for r0 in range(0, n, ROW_TILE):
        rows = _row_tile(logits, r0)  # [R, V]
        labels_tile = _row_tile(labels, r0).long()
        thr = None if threshold is None else _row_tile(threshold, r0)[:, None]
        m = torch.full((ROW_TILE,), neg_inf, device=logits.device)  # running max of s
        # S and A accumulate in fp64 (the tile's exps stay fp32): an fp32 row sum of V exps is off by
        # a few ulps (N = 37, V = 1000, T = 0.7, row 13: S 2.4e-7 relative, which moved a
        # logp ≈ −19.9 one ulp, 1.9e-6, and the ratio exp(logp − old) with it: grad error 3.15e-7
        # against eager's 1.15e-7; with fp64 sums logp is off 3.6e-7, 0.2 ulp, as eager is).
        sum_exp = torch.zeros(ROW_TILE, dtype=torch.float64, device=logits.device)  # S = Σ exp(s − m)
        sum_exp_shift = torch.zeros(
            ROW_TILE, dtype=torch.float64, device=logits.device
        )  # A = Σ exp(s − m)·(s − m)
        for v0 in range(0, v, VOCAB_BLOCK):
            d = rows[:, v0 : v0 + VOCAB_BLOCK].float() * inv_temperature  # [R, Vb] fp32, s
            d = _truncated(d, v0, labels_tile, thr)
            m_new = torch.maximum(m, d.amax(dim=1))  # [R, Vb] -> [R]
            ref = torch.where(m_new == neg_inf, 0.0, m_new)  # finite while the row is all −inf
            alpha = torch.exp(m - ref).double()
            shift = torch.where(m == neg_inf, 0.0, m - ref).double()
            d.sub_(ref[:, None])  # d = s − ref
            e = torch.exp(d)
            ed = torch.where(e == 0.0, 0.0, e * d)  # exp(−inf)·(−inf) would be NaN
            sum_exp_shift = alpha * (sum_exp_shift + shift * sum_exp) + ed.sum(dim=1, dtype=torch.float64)
            sum_exp = alpha * sum_exp + e.sum(dim=1, dtype=torch.float64)
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
    ``threshold``: the forward's; a left-out token has probability 0, so its gradient is 0."""
    n, v = logits.shape
    for r0 in range(0, n, ROW_TILE):
        k = min(ROW_TILE, n - r0)
        rows = _row_tile(logits, r0)  # [R, V]
        labels_tile = _row_tile(labels, r0).long()
        thr = None if threshold is None else _row_tile(threshold, r0)[:, None]
        g_lp, g_h, ref, lnorm, ent = (
            _row_tile(t, r0)[:, None] for t in (grad_logp, grad_entropy, row_max, log_norm, entropy)
        )
        for v0 in range(0, v, VOCAB_BLOCK):
            width = min(VOCAB_BLOCK, v - v0)
            log_p = rows[:, v0 : v0 + width].float() * inv_temperature  # [R, Vb] fp32
            log_p = _truncated(log_p, v0, labels_tile, thr)
            log_p.sub_(ref).sub_(lnorm)
            p = torch.exp(log_p)
            # p·(log p + H), 0 where p is 0 (a −inf logit would give NaN); NaN stays NaN.
            ent_term = torch.where(p == 0.0, 0.0, p * (log_p + ent))
            dz = (g_lp * p + g_h * ent_term).neg_()  # [R, Vb]
            # + g_lp at the label column, for the rows whose label falls in this block
            in_block = (labels_tile >= v0) & (labels_tile < v0 + width)
            cols = (labels_tile - v0).clamp_(0, width - 1)[:, None]
            dz.scatter_add_(1, cols, torch.where(in_block[:, None], g_lp, 0.0))
            dz.mul_(inv_temperature)
            out[r0 : r0 + k, v0 : v0 + width] = dz[:k]
    return out
