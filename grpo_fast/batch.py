"""From a rollout to microbatches: sequences, response positions, advantages and loss weights.

The loss weights carry the length normalization (``core.length_norm_weights``), computed once
for the whole rollout batch (with global counts across data-parallel ranks), so that the
microbatch losses ``Σ w·ℓ`` add up to the batch loss however the batch is split or packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_fast.core import length_norm_weights
from grpo_fast.model import Microbatch


@dataclass
class Sequence:
    """One prompt + response. ``tokens = prompt + response``; ``n_prompt = len(prompt)``."""

    tokens: list[int]
    n_prompt: int
    advantage: float
    weight: float  # the per-token loss weight of this sequence's response tokens
    sampler_logprobs: list[float] | None = None  # [len(response)], from the rollout engine

    @property
    def n_response(self) -> int:
        return len(self.tokens) - self.n_prompt


def build_sequences(
    prompt_ids: list[list[int]],
    response_ids: list[list[int]],
    advantages: torch.Tensor,
    *,
    length_norm: str,
    max_length: int,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    sampler_logprobs: list[list[float]] | None = None,
    keep: list[bool] | None = None,
) -> list[Sequence]:
    """One ``Sequence`` per response; response ``i`` answers prompt ``i // group_size``.

    Args:
        prompt_ids: ``[P]`` token lists; response_ids: ``[R]`` token lists, R = P·group_size.
        advantages: ``[R]``.
        length_norm, max_length: see ``core.length_norm_weights``.
        num_sequences, num_tokens: the global counts when this is one rank's share.
        sampler_logprobs: ``[R]`` per-token log-probs from the rollout engine, or None.
        keep: ``[R]`` bool, False for responses left out of the loss altogether (no sequence,
            not counted in the default normalizers; ``loss.mask_truncated``). Pass global counts
            of the kept responses as ``num_sequences`` / ``num_tokens``.
    """
    r = len(response_ids)
    if r % len(prompt_ids) or advantages.shape != (r,):
        raise ValueError(f"{len(prompt_ids)} prompts, {r} responses, advantages {tuple(advantages.shape)}")
    g = r // len(prompt_ids)
    keep = [True] * r if keep is None else list(keep)
    if len(keep) != r:
        raise ValueError(f"keep has {len(keep)} entries for {r} responses")
    lengths = torch.tensor([len(x) for x in response_ids])
    width = max(int(lengths.max().item()), 1) if r else 1
    mask = (torch.arange(width)[None, :] < lengths[:, None]) & torch.tensor(keep, dtype=torch.bool)[:, None]
    w = length_norm_weights(
        mask,
        length_norm,
        max_length=max_length,
        num_sequences=sum(keep) if num_sequences is None else num_sequences,
        num_tokens=num_tokens,
    )
    per_seq_w = w.max(dim=1).values.tolist()  # constant along each response
    adv = advantages.tolist()
    return [
        Sequence(
            tokens=list(prompt_ids[i // g]) + list(resp),
            n_prompt=len(prompt_ids[i // g]),
            advantage=adv[i],
            weight=per_seq_w[i],
            sampler_logprobs=None if sampler_logprobs is None else list(sampler_logprobs[i]),
        )
        for i, resp in enumerate(response_ids)
        if len(resp) > 0 and keep[i]
    ]


def make_microbatches(
    seqs: list[Sequence], micro_batch_size: int, pad_id: int, packing: bool
) -> list[Microbatch]:
    """Microbatches of the rollout's sequences, longest first.

    Without packing: ``micro_batch_size`` rows per microbatch, one sequence per row,
    right-padded to the longest in the microbatch (sorting by length keeps that padding small).

    With packing (padding-free): each microbatch is ONE row holding up to the same token budget,
    ``micro_batch_size × (longest sequence)``, filled first-fit-decreasing; positions restart at
    0 for each sequence and no attention mask is passed, so transformers builds the
    block-causal mask from the position ids (flash-attention 2 runs varlen). Same peak
    activations as the padded worst case, no compute spent on padding.
    """
    order = sorted(seqs, key=lambda s: len(s.tokens), reverse=True)
    if not packing:
        rows = [[s] for s in order]
        return [
            _collate(rows[i : i + micro_batch_size], pad_id, packing=False)
            for i in range(0, len(rows), micro_batch_size)
        ]
    cap = micro_batch_size * len(order[0].tokens) if order else 0
    bins: list[list[Sequence]] = []
    room: list[int] = []
    for s in order:
        for i, free in enumerate(room):
            if len(s.tokens) <= free:
                bins[i].append(s)
                room[i] -= len(s.tokens)
                break
        else:
            bins.append([s])
            room.append(cap - len(s.tokens))
    return [_collate([b], pad_id, packing=True) for b in bins]


def _collate(rows: list[list[Sequence]], pad_id: int, packing: bool) -> Microbatch:
    width = max(sum(len(s.tokens) for s in row) for row in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    attn = torch.zeros((b, width), dtype=torch.long)
    pos = torch.zeros((b, width), dtype=torch.long)
    select = torch.zeros((b, width), dtype=torch.bool)
    labels, adv, w, slp, seq_ids = [], [], [], [], []
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            n = len(s.tokens)
            ids[r, at : at + n] = torch.tensor(s.tokens)
            attn[r, at : at + n] = 1
            pos[r, at : at + n] = torch.arange(n)
            # the hidden state at t predicts token t+1: select t = n_prompt−1 … n−2
            select[r, at + s.n_prompt - 1 : at + n - 1] = True
            labels.extend(s.tokens[s.n_prompt :])
            adv.extend([s.advantage] * s.n_response)
            w.extend([s.weight] * s.n_response)
            seq_ids.extend([len(slp)] * s.n_response)
            slp.append(s.sampler_logprobs)
            at += n
        if packing and at < width:  # the tail is its own "sequence" so nothing attends across
            pos[r, at:] = torch.arange(width - at)
    sampler = None
    if all(x is not None for x in slp):
        sampler = torch.tensor([v for x in slp for v in x], dtype=torch.float32)
    return Microbatch(
        input_ids=ids,
        attention_mask=None if packing else attn,
        position_ids=pos if packing else None,
        select=select,
        labels=torch.tensor(labels, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        loss_weights=torch.tensor(w, dtype=torch.float32),
        sampler_logprobs=sampler,
        sequence_ids=torch.tensor(seq_ids, dtype=torch.long),
    )
