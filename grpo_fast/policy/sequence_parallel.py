"""Sequence parallelism (``train.sequence_parallel=N``): the N ranks of an sp group
(``grpo_fast.dist``'s ``sp`` axis) train one batch, each holding 1/N of every sequence's tokens.

``shard(mb, world.sp)`` cuts a microbatch's token dimension: the rows are padded to a multiple of N
(``L → L'``) and rank r keeps columns ``[r·L'/N, (r+1)·L'/N)`` of the token ids and position ids
(positions stay those of the whole row, so RoPE is unchanged), and of the per-token fields the
labels whose *predicting* position it holds (the hidden state at t predicts token t+1: a label's
rank is its position's, wherever the label token itself lies). What attention needs of the whole
row travels with it (``SequenceShard``): which tokens see which (causal rows, the packed row's
sequences, or the shared-prompt layout, widened to ``L'``) and the process group.

Then ``PolicyLoss`` runs the decoder on the rank's tokens with Ulysses attention (``policy/ulysses.py``)
and the fused head and loss on its own response tokens: no rank computes another rank's
``[tokens × vocab]`` logits. The loss is a partial sum over the rank's tokens (the loss weights
already hold the batch's normalizers, counted before the split, token_mean's included); the
statistics that need whole rows reduce across the group inside the op (``SequenceShard.sum`` and
``gather``: GSPO's per-sequence mean log-ratio, the top-entropy quantile, and the sampler
correction's per-sequence importance ratio). Each rank's parameter gradient is then a partial sum;
DDP or FSDP over every rank (dp × sp) averages them and the loop's ``loss × world_size`` makes that
the sum, the batch's gradient.

Example (one padded row of 5 tokens, 2 ranks: padded to 6, 3 each):
    >>> mb = make_microbatches([Sequence([5, 6, 7, 8, 9], 2, 1.0, 0.25)], 1, pad_id=0, packing=False)[0]
    >>> s0 = shard(mb, Axis(0, 2)); s1 = shard(mb, Axis(1, 2))
    >>> s0.input_ids.tolist(), s1.input_ids.tolist(), s1.position_ids.tolist()
    ([[5, 6, 7]], [[8, 9, 0]], [[3, 4, 5]])
    >>> s0.labels.tolist(), s1.labels.tolist()   # label 8 is predicted at position 2, on rank 0
    ([7, 8], [9])
"""

from __future__ import annotations

import dataclasses
import os
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from grpo_fast.dist import Axis
from grpo_fast.errors import ConfigError
from grpo_fast.policy import shared_attention, ulysses
from grpo_fast.policy.batch import PER_TOKEN_FIELDS, Microbatch
from grpo_fast.policy.shared_attention import SharedLayout

__all__ = ["SequenceShard", "ShardedMicrobatch", "across", "group_size", "local_hidden_states", "shard"]

CAUSAL, SEGMENTS, SHARED = "causal", "segments", "shared"


def group_size(cfg) -> int:
    """``train.sequence_parallel``, the sp group size ``grpo_fast.dist.init`` builds the mesh with;
    ``ConfigError`` (one line) unless torchrun started a multiple of it ranks (read from the
    environment, before any process group exists)."""
    size = int(cfg.train.sequence_parallel)
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if size > 1 and (world == 1 or world % size):
        raise ConfigError(
            f"train.sequence_parallel={size} splits each sequence over {size} ranks: launch a multiple of "
            f"{size} ranks with torchrun (this run has {world}), or set train.sequence_parallel=1"
        )
    return size


@dataclass
class SequenceShard:
    """What one sp rank knows of the whole microbatch it holds a slice of.

    Fields:
        rank, size, group: this rank's place in the sp group and the group's process group.
        width: ``L'``, the rows' padded length (a multiple of ``size``); this rank holds columns
            ``[rank·L'/size, (rank+1)·L'/size)``.
        kind: ``causal`` (right-padded rows: causal attention, nothing else to mask), ``segments``
            (``segments`` says which tokens may see each other, causally), ``shared`` (``shared``).
        segments: ``[b, L']`` int64, the sequence each token belongs to (``segments`` only).
        shared: the shared-prompt layout over the ``[b, L']`` rows (``shared`` only).
        num_sequences: sequences in the whole microbatch (``sequence_ids`` are ``0 … num_sequences − 1``).
        used: layers that took this shard in the current forward (``ulysses.check_used``).
    """

    rank: int
    size: int
    group: Any
    width: int
    kind: str
    segments: torch.Tensor | None = None
    shared: SharedLayout | None = None
    num_sequences: int = 0
    used: int = 0
    _mask: torch.Tensor | None = field(default=None, repr=False)

    def to(self, device: torch.device) -> SequenceShard:
        """The same shard with its tensors on ``device`` (copied, never read: no sync)."""
        return dataclasses.replace(
            self,
            segments=None if self.segments is None else self.segments.to(device, non_blocking=True),
            shared=None if self.shared is None else self.shared.to(device),
            _mask=None,
        )

    def mask(self) -> torch.Tensor | None:
        """The attention mask over the whole rows: None for ``causal`` (SDPA's ``is_causal``), else
        ``[b, 1, L', L']`` bool (True = attend; same sequence and not in the future), built once per
        microbatch on first use (a checkpointed recompute reuses it)."""
        if self.kind == CAUSAL:
            return None
        if self._mask is None:
            seg = self.segments
            pos = torch.arange(self.width, device=seg.device)
            causal = pos[:, None] >= pos[None, :]  # [L', L']
            self._mask = ((seg[:, :, None] == seg[:, None, :]) & causal)[:, None]
        return self._mask

    # The row reductions the loss op runs across the group (``fused_linear_grpo_loss(across=...)``).

    def sum(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over the group's ranks (same shape); differentiable (the gradient of each
        rank's input is the sum of every rank's output gradient)."""
        return _AllReduceSum.apply(t, self.group)

    def gather(self, t: torch.Tensor) -> torch.Tensor:
        """The group's 1-D ``t`` concatenated in rank order (lengths may differ; not differentiable)."""
        n = torch.tensor([t.numel()], device=t.device)
        sizes = [torch.empty_like(n) for _ in range(self.size)]
        torch_dist.all_gather(sizes, n, group=self.group)
        counts = [int(x) for x in sizes]  # host-device sync (the top-entropy threshold needs them)
        padded = F.pad(t.detach(), (0, max(counts) - t.numel()))
        parts = [torch.empty_like(padded) for _ in range(self.size)]
        torch_dist.all_gather(parts, padded.contiguous(), group=self.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])


class _AllReduceSum(torch.autograd.Function):
    @staticmethod
    def forward(ctx, t: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        out = t.clone()
        torch_dist.all_reduce(out, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        out = grad.clone()
        torch_dist.all_reduce(out, group=ctx.group)
        return out, None


@dataclass
class ShardedMicrobatch(Microbatch):
    """One sp rank's slice of a microbatch (``shard``): ``Microbatch``'s fields over its tokens
    (``input_ids``, ``position_ids``, ``select`` ``[b, L'/N]``; the per-token fields of the labels
    its positions predict, in the whole microbatch's order; no ``attention_mask``, ``cu_seqlens`` or
    ``shared``: ``sp`` holds what attention needs of the whole rows)."""

    sp: SequenceShard | None = None

    def to(self, device: torch.device) -> ShardedMicrobatch:
        """The same slice with its tensors on ``device`` (copied, never read: no sync)."""
        move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor) else t
        fields = {k: move(v) for k, v in self.__dict__.items() if k != "sp"}
        return ShardedMicrobatch(**fields, sp=None if self.sp is None else self.sp.to(device))


def shard(mb: Microbatch, sp: Axis) -> Microbatch:
    """This sp rank's slice of ``mb`` (the module docstring); ``mb`` itself when ``sp.size`` is 1.
    Build it on the CPU, where ``make_microbatches`` builds ``mb``, then move it with ``to``."""
    if sp.size == 1:
        return mb
    if isinstance(mb, ShardedMicrobatch):
        raise ValueError("shard: the microbatch is already one rank's slice")
    rows, length = mb.input_ids.shape
    width = -(-length // sp.size) * sp.size
    pad, s = width - length, width // sp.size
    lo, hi = sp.rank * s, (sp.rank + 1) * s
    if mb.position_ids is None:  # padded rows: positions 0 … L'−1, as transformers gives them
        positions = torch.arange(width).expand(rows, width)
    elif mb.shared is None:  # packed: the padding is a sequence of its own (positions from 0)
        positions = torch.cat([mb.position_ids, torch.arange(pad).expand(rows, pad)], dim=1)
    else:  # shared prompts: the padding belongs to no span
        positions = F.pad(mb.position_ids, (0, pad))
    kind, segments, layout = _attention_of(mb, width, positions)
    # the labels whose predicting position this rank holds, in the microbatch's order
    row, col = mb.select_index // length, mb.select_index % length
    mine = (col >= lo) & (col < hi)
    per_token = {
        name: None if getattr(mb, name) is None else getattr(mb, name)[mine] for name in PER_TOKEN_FIELDS
    }
    n_seq = int(mb.sequence_ids.max()) + 1 if mb.sequence_ids is not None and mb.sequence_ids.numel() else 0
    columns = lambda t: t[:, lo:hi].contiguous()  # [b, L'] -> [b, L'/N], its own storage
    return ShardedMicrobatch(
        input_ids=columns(F.pad(mb.input_ids, (0, pad))),
        attention_mask=None,
        position_ids=columns(positions),
        select=columns(F.pad(mb.select, (0, pad))),
        **per_token,
        select_index=(row * s + col - lo)[mine],
        sp=SequenceShard(sp.rank, sp.size, sp.group, width, kind, segments, layout, n_seq),
    )


def _attention_of(
    mb: Microbatch, width: int, positions: torch.Tensor
) -> tuple[str, torch.Tensor | None, SharedLayout | None]:
    """``(kind, segments, shared layout)`` of ``mb``'s rows padded to ``width`` (``SequenceShard``);
    ``positions`` ``[b, width]``: the padded rows' position ids."""
    rows, length = mb.input_ids.shape
    pad = width - length
    if mb.shared is not None:
        return SHARED, None, _widened(mb.shared, rows, length, width)
    if mb.position_ids is not None:  # packed: each sequence (and the padding) starts at position 0
        return SEGMENTS, (positions == 0).long().cumsum(1), None
    mask = mb.attention_mask
    if mask is None or bool((mask[:, 1:] <= mask[:, :-1]).all()):  # right-padded: causal is enough
        return CAUSAL, None, None
    # any other padding: the real tokens are one sequence, each padding token one of its own
    col = torch.arange(width, device=mask.device).expand(rows, width)
    real = F.pad(mask, (0, pad)).bool()
    return SEGMENTS, torch.where(real, torch.zeros_like(col), col + 1), None


def _widened(layout: SharedLayout, rows: int, length: int, width: int) -> SharedLayout:
    """``layout`` (over ``rows × length`` tokens) over rows of ``width ≥ length`` tokens: every flat
    index moved to its row's new stride; a dense mask grown, each new token attending to itself."""
    if width == length:
        return layout
    moved = lambda t: None if t is None else (t // length) * width + t % length
    dense = None
    if layout.dense_mask is not None:
        dense = torch.zeros(rows, 1, width, width, dtype=torch.bool, device=layout.dense_mask.device)
        dense[:, :, :length, :length] = layout.dense_mask
        tail = torch.arange(length, width)
        dense[:, 0, tail, tail] = True
    return dataclasses.replace(
        layout,
        dense_mask=dense,
        prompt_index=moved(layout.prompt_index),
        response_index=moved(layout.response_index),
        key_index=moved(layout.key_index),
        prompt_dst=moved(layout.prompt_dst),
        response_dst=moved(layout.response_dst),
        used=0,
    )


def across(mb: Microbatch) -> SequenceShard | None:
    """The sp group a microbatch's rows are split over (what the loss op and the sampler correction
    reduce whole-row statistics across), or None for a whole microbatch."""
    return mb.sp if isinstance(mb, ShardedMicrobatch) else None


def local_hidden_states(
    model: torch.nn.Module, backbone: torch.nn.Module, mb: ShardedMicrobatch
) -> torch.Tensor:
    """The decoder's last hidden states at this rank's tokens, ``[b, L'/N, D]``, by Ulysses attention
    (``model`` is enabled on first use). The attention mask passed to transformers is a placeholder:
    the shard says who sees whom over the whole rows."""
    ulysses.enable(model, mb.sp.size)
    mb.sp.used = 0
    hidden = backbone(
        input_ids=mb.input_ids,
        position_ids=mb.position_ids,
        attention_mask=shared_attention.placeholder_mask(mb.input_ids),
        use_cache=False,
        **{ulysses.KWARG: mb.sp},
    ).last_hidden_state
    ulysses.check_used(model, mb.sp)
    return hidden
