"""The ``torch_chunked`` backend: the token log-prob kernels in plain PyTorch, on any device.

The same algorithm as ``csrc_triton/token_logprobs.py`` (see its docstring for the math), in tiles
whose size depends only on ``V``, never on ``N``: every row goes through the same op sequence on a
tile of the same width whatever shares the call, so its results are bitwise batch invariant.

Forward: tiles of ``tile_rows(V)`` whole rows (``FWD_TILE_BYTES`` of fp32 per tile, one scratch
tile beside it: both stay in a core's cache while the ops pass over them). Per tile of fp32
logits at T = 1 with no ``−inf`` and no truncation, 5 passes: ``m = max s``, ``d = s − m``,
``e = exp(d)``, ``Σ e``, ``Σ e·d`` (the last two as fp32 partial sums of 16, then fp64 over the
partials: ``_row_sum64``). ``token_logprobs_fwd`` writes ``e`` to a second scratch tile;
``token_logprobs_fwd_exps`` writes it over the logits, which the fused head then reads as its
gradient's matrix (``fused_linear_grpo_loss``: with no entropy term its backward makes no pass
over the logits at all). Both compute the same values, bitwise.

Backward (``token_logprobs_bwd``, the logits-level ops): fixed tiles of ``ROW_TILE`` rows (the
last one zero-padded) by ``VOCAB_BLOCK`` columns, 3 passes per block after ``s − m`` with no
entropy term (``g_H = 0``), 6 with one.
"""

from __future__ import annotations

import torch

__all__ = [
    "FWD_TILE_BYTES",
    "ROW_TILE",
    "VOCAB_BLOCK",
    "dlogits_from_exps",
    "exps_of_logits",
    "tile_rows",
    "token_logprobs_bwd",
    "token_logprobs_fwd",
    "token_logprobs_fwd_exps",
]

# The backward's tiles: 64 x 16384 fp32 = 4 MiB. Bigger tiles mean fewer ops, which matters on a
# busy CPU: with 2 OpenMP threads on a loaded 2-core machine each op can wait a scheduler slice
# (~10 ms), and N = 512, V = 32,768 fwd + bwd took 17.5 s with 32 x 8192 tiles against 4.4 s with
# these (0.27 s vs 0.28 s on one uncontended thread).
ROW_TILE = 64
VOCAB_BLOCK = 16384
# The forward's tiles: whole rows, this many fp32 bytes (at least one row), with one scratch tile
# of the same size beside it. On a CPU, a few MiB stay in cache across the tile's passes while the
# ops are few: N 4,096, D 256, V 32,768 fp32, chunks of 512 rows, one thread (CPU time, median of
# 5 alternating in one process, 2 shared cores at load ≈ 9): 3.22 s with 512 KiB tiles (4 rows),
# 3.04 s with 2 MiB (16), 3.05 s with 8 MiB (64), against 2.83 s for the three GEMMs alone. On CUDA
# (torch_chunked as a fallback) each op is a kernel launch: at N 8,192, V 151,936 about 2,700
# tiles of 3 rows, ≈ 12 launches each, against 1,280 tiles of 64 x 16,384 with ≈ 15 before.
FWD_TILE_BYTES = 2**21
# Entries per fp32 partial sum of a row (_row_sum64).
_SUM_GROUP = 16
_NEG_INF = float("-inf")


def tile_rows(vocab_size: int) -> int:
    """Rows per forward tile at ``vocab_size``: ``FWD_TILE_BYTES`` of fp32, at least 1. Never
    depends on the number of rows."""
    return max(1, FWD_TILE_BYTES // (4 * vocab_size))


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

    Used for ``S = Σ e`` and ``A = Σ e·(s − m) ≤ 0``. H = log S − A/S adds two non-negative terms,
    so an error of ``δ`` relative in ``A`` moves ``H`` by at most ``δ·H`` (on the N = 70, V = 4,099
    batch-invariance logits, max |H − H₆₄| 2.5e-7 against 2.4e-7 with an exact fp64 sum; the tests'
    atol is 4 units of 2⁻²⁴ at |H|).
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


def _shift(x, inv_t, labels_tile, thr, ref, out) -> torch.Tensor:
    """``out = s − ref`` for a tile ``x`` ``[R, V]`` of logits (any float dtype) into fp32 ``out``,
    the tokens truncated sampling leaves out at ``−inf``; ``ref`` ``[R, 1]`` fp32, or None for the
    row max of ``s`` (0 for a row of only ``−inf``). Returns ``ref``."""
    if thr is None:
        if ref is None:
            m = x.amax(dim=1, keepdim=True).float()  # [R, V] -> [R, 1]; = max of s: rounding is monotone
            m = m * inv_t if inv_t != 1.0 else m
            ref = torch.where(m == _NEG_INF, 0.0, m)
        _shifted(x, inv_t, ref, out)
        return ref
    _truncated(_scaled(x, inv_t, out), 0, labels_tile, thr)
    if ref is None:
        m = out.amax(dim=1, keepdim=True)  # [R, V] -> [R, 1]
        ref = torch.where(m == _NEG_INF, 0.0, m)
    out.sub_(ref)
    return ref


def _fwd(logits, labels, inv_temperature, threshold, into_logits: bool):
    """The forward of ``token_logprobs_fwd`` (``into_logits``: ``token_logprobs_fwd_exps``)."""
    n, v = logits.shape
    device = logits.device
    r = tile_rows(v)
    shifted = torch.empty(min(r, n), v, device=device)  # d = s − m, then e·d
    exps = None if into_logits else torch.empty_like(shifted)  # e = exp(d)
    labels = labels.long()
    # read before the exps overwrite the logits
    s_label = logits.gather(1, labels[:, None]).squeeze(1).float() * inv_temperature  # [N]
    row_max = torch.empty(n, device=device)
    # S and A in fp64 from fp32 partials of 16 (_row_sum64); the tile's exps stay fp32
    sum_exp = torch.empty(n, dtype=torch.float64, device=device)  # S = Σ exp(s − m)
    sum_exp_shift = torch.empty(n, dtype=torch.float64, device=device)  # A = Σ exp(s − m)·(s − m)
    for r0 in range(0, n, r):
        rows = slice(r0, r0 + r)
        x = logits[rows]  # [R, V]
        d = shifted[: x.shape[0]]
        e = x if into_logits else exps[: x.shape[0]]
        thr = None if threshold is None else threshold[rows, None]
        ref = _shift(x, inv_temperature, labels[rows], thr, None, d)  # d = s − m
        torch.exp(d, out=e)
        sum_exp[rows] = _row_sum64(e)
        ed = d.mul_(e)
        # a −inf logit gives exp(−inf)·(−inf) = NaN: those terms are 0 (a NaN row gives NaN either
        # way). On CPU only when a NaN shows; on CUDA that check is a host-device sync per tile, so
        # there the masked pass always runs
        if thr is not None or e.is_cuda:
            ed.masked_fill_(e == 0.0, 0.0)
        a = _row_sum64(ed)
        if thr is None and not e.is_cuda and bool(a.isnan().any()):
            a = _row_sum64(ed.masked_fill_(e == 0.0, 0.0))
        sum_exp_shift[rows] = a
        row_max[rows] = ref.squeeze(1)
    log_norm = torch.log(sum_exp)  # fp64
    # one fp32 rounding per output: (s_y − m) − log S and log S − A/S are combined in fp64
    logp = ((s_label.double() - row_max.double()) - log_norm).float()
    entropy = (log_norm - sum_exp_shift / sum_exp).float()
    return logp, entropy, row_max, log_norm.float()


def token_logprobs_fwd(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, threshold: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``[N, V], [N] -> (logp, entropy, row_max, log_norm)``, each ``[N]`` fp32; see csrc_triton.
    ``threshold`` ``[N]`` fp32: the truncated distribution's (``grpo_fast.algo.core.truncation_threshold``)."""
    return _fwd(logits, labels, inv_temperature, threshold, into_logits=False)


def token_logprobs_fwd_exps(
    logits: torch.Tensor, labels: torch.Tensor, inv_temperature: float, threshold: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """``token_logprobs_fwd`` (bitwise the same outputs) that leaves ``exp(s − row_max)`` in
    ``logits`` (``[N, V]`` fp32, unit stride along V): 0 where truncated sampling leaves a token out."""
    return _fwd(logits, labels, inv_temperature, threshold, into_logits=True)


def exps_of_logits(
    logits: torch.Tensor,
    labels: torch.Tensor,
    row_max: torch.Tensor,
    inv_temperature: float,
    threshold: torch.Tensor | None = None,
) -> torch.Tensor:
    """Overwrite ``logits`` ``[N, V]`` fp32 with ``exp(s − row_max)``, the forward's ``row_max`` (and
    ``threshold``): bitwise what ``token_logprobs_fwd_exps`` leaves there (the same ops on the same
    tiles). Returns ``logits``."""
    n, v = logits.shape
    r = tile_rows(v)
    shifted = torch.empty(min(r, n), v, device=logits.device)
    labels = labels.long()
    for r0 in range(0, n, r):
        rows = slice(r0, r0 + r)
        x = logits[rows]
        d = shifted[: x.shape[0]]
        thr = None if threshold is None else threshold[rows, None]
        _shift(x, inv_temperature, labels[rows], thr, row_max[rows, None], d)
        torch.exp(d, out=x)
    return logits


def dlogits_from_exps(
    exps: torch.Tensor,
    labels: torch.Tensor,
    grad_logp: torch.Tensor,
    grad_entropy: torch.Tensor,
    log_norm: torch.Tensor,
    entropy: torch.Tensor,
    inv_temperature: float,
) -> torch.Tensor:
    """Overwrite ``exps`` ``[N, V]`` fp32 (``exp(s − m)``, as ``token_logprobs_fwd_exps`` leaves it)
    with ``∂loss/∂logits``; returns it. The formula of ``token_logprobs_bwd`` with ``s − m = log e``:

        dz = e·(c1 + c2·(log e + H − log S)) + δ_y·g_lp / T,   c1 = −g_lp / (T·S),  c2 = −g_H / (T·S)

    ``log e`` for ``e ≥ 2⁻¹²⁶`` is ``s − m`` to one rounding of ``e`` (≤ 1.2e-7 absolute, below
    the ulp of ``log S`` that eager's ``log p`` carries); below that (``s − m < −87.3``: the
    truncated tokens, ``e = 0``) it is clamped, and ``e·(…)`` is then 0 or under 1e-36·|c|.
    """
    n, v = exps.shape
    r = tile_rows(v)
    scratch = torch.empty(min(r, n), v, device=exps.device)
    inv_t = inv_temperature
    # the row coefficients, each rounded once from fp64 (as token_logprobs_bwd)
    inv_s = torch.exp(-log_norm.double())  # 1 / S
    c1 = (grad_logp.double() * inv_s).mul_(-inv_t).float()[:, None]  # [N, 1]
    c2 = (grad_entropy.double() * inv_s).mul_(-inv_t).float()[:, None]
    h_minus_log_s = (entropy.double() - log_norm.double()).float()[:, None]
    tiny = torch.finfo(torch.float32).tiny
    for r0 in range(0, n, r):
        rows = slice(r0, r0 + r)
        e = exps[rows]
        t = scratch[: e.shape[0]]
        torch.clamp(e, min=tiny, out=t).log_().add_(h_minus_log_s[rows])  # log p + H
        torch.addcmul(c1[rows], t, c2[rows], out=t)
        e.mul_(t)
    # + g_lp / T at each row's label column
    return exps.scatter_add_(1, labels.long()[:, None], (grad_logp * inv_t)[:, None])


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
