"""Top-k / top-p sampling truncation as the samplers apply it: the per-row threshold of the kept
set (``truncation_threshold``, vLLM's and transformers' order of operations), for the hf sampler
and for the trainer's log-probs of the distribution actually sampled from."""

from __future__ import annotations

import math

import torch

__all__ = ["truncated_logits", "truncates", "truncation_threshold"]


def truncates(top_k: int, top_p: float, vocab_size: int) -> bool:
    """Whether top-k (``0 < top_k < V``) and/or top-p (``top_p < 1``) sampling leaves tokens out."""
    return 0 < top_k < vocab_size or top_p < 1.0


@torch.no_grad()
def truncation_threshold(scaled: torch.Tensor, top_k: int = 0, top_p: float = 1.0) -> torch.Tensor:
    """Per row, the threshold ``τ`` of top-k and/or top-p sampling: ``[R, V] -> [R]`` (``scaled``'s
    dtype): the sampler keeps exactly the tokens with ``s_j ≥ τ`` (``s`` = the logits after the
    temperature), draws from ``softmax`` over them, and ``log π_trunc(a) = s_a − logsumexp_kept s``.

    The order of operations is vLLM's (0.32, ``apply_top_k_top_p_pytorch``) and transformers'
    (temperature, then ``TopKLogitsWarper``, then ``TopPLogitsWarper``):

    1. top-k (``0 < top_k < V``): the ``top_k`` largest ``s``; a tie with the k-th value is kept
       (both mask ``s < s_(k)``).
    2. top-p (``top_p < 1``), on the softmax of what top-k kept: from the largest down, the
       smallest prefix whose mass reaches ``top_p`` (a token is kept iff the mass strictly above
       it is ``< top_p``: vLLM's "ascending cumulative sum ≤ 1 − p" removed); the prefix sums in
       float64. A tie with the last kept value is kept (vLLM breaks such ties by its sort order).

    ``τ`` is the midpoint between the last kept value and the largest left-out one (``−inf``
    when nothing is left out), so that a kernel recomputing ``s`` to the last ulp keeps the same
    set: the kept values and the left-out ones are ``τ`` apart on either side. No truncation
    (``truncates`` false): ``−inf``. The sampled token is kept by the kernels whatever ``τ``
    (``truncated_logits``): recomputed under other weights (π_ref, a later epoch) it may fall
    outside, where its log-prob would be ``−inf``.

    Example:
        >>> s = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax: 0.644 0.237 0.087 0.032
        >>> truncation_threshold(s, top_k=2), truncation_threshold(s, top_p=0.9)  # keeps 2 / 3 tokens
        (tensor([0.5000]), tensor([-0.5000]))
    """
    r, v = scaled.shape
    k = top_k if 0 < top_k < v else 0
    inf = torch.full((r,), -math.inf, dtype=scaled.dtype, device=scaled.device)
    if not truncates(k, top_p, v):
        return inf
    if top_p >= 1.0:  # top-k alone: no sort
        kth = scaled.topk(k, dim=-1).values[:, -1:]  # [R, V] -> [R, 1]: s_(k)
        below = scaled.masked_fill(scaled >= kth, -math.inf).amax(-1)  # the largest left out
        return (kth[:, 0] + below) / 2  # −inf when only −inf entries are left out
    values = scaled.sort(dim=-1, descending=True).values  # [R, V]: s_(1) ≥ s_(2) ≥ …
    kept = torch.full((r,), v, dtype=torch.long, device=scaled.device)  # how many, a prefix of values
    if k:
        kept = (values >= values[:, k - 1 : k]).sum(-1)  # [R, V] -> [R]: k, and the ties of s_(k)
    in_k = torch.arange(v, device=scaled.device) < kept[:, None]
    probs = torch.softmax(values.double().masked_fill(~in_k, -math.inf), dim=-1)  # [R, V] fp64
    above = torch.cumsum(probs, dim=-1).roll(1, dims=-1)  # the mass strictly above each position:
    above[:, 0] = 0.0  # the sums shifted one place (nondecreasing, unlike cumsum − p)
    reach = (above < top_p) & in_k  # a prefix: the smallest one reaching top_p
    last = values.gather(1, (reach.sum(-1).clamp_min(1) - 1)[:, None])  # the last kept value
    kept = (values >= last).sum(-1)  # and its ties
    cut = kept < v
    below = values.gather(1, kept.clamp(max=v - 1)[:, None]).squeeze(1)  # the largest left out
    last = values.gather(1, (kept - 1).clamp_min(0)[:, None]).squeeze(1)
    return torch.where(cut, (last + below) / 2, inf)


def truncated_logits(scaled: torch.Tensor, labels: torch.Tensor, threshold: torch.Tensor) -> torch.Tensor:
    """``scaled`` ``[N, V]`` with the entries below the row's ``threshold`` ``[N]`` set to ``−inf``,
    the label's kept whatever its value (see ``truncation_threshold``)."""
    cols = torch.arange(scaled.shape[1], device=scaled.device)
    keep = (scaled >= threshold[:, None]) | (cols == labels.long()[:, None])
    return scaled.masked_fill(~keep, -math.inf)
