"""From a rollout to microbatches: sequences, response positions, advantages and loss weights.

The loss weights carry the length normalization (``core.length_norm_weights``), computed once
for the whole rollout batch (with global counts across data-parallel ranks), so that the
microbatch losses ``Σ w·ℓ`` add up to the batch loss however the batch is split or packed.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from grpo_fast.algo.core import length_norm_weights
from grpo_fast.policy.shared_attention import SharedLayout


@dataclass
class Microbatch:
    """One microbatch of sequences, right-padded, with the per-token quantities of its responses.

    Shapes: b sequences of padded length L; n = number of response tokens in the microbatch.

    Fields:
        input_ids: ``[b, L]`` int64; attention_mask: ``[b, L]`` (1 = real token), None for
            packed rows and for shared prompts (``shared`` says who attends to whom).
        position_ids: ``[b, L]`` or None (packed rows restart positions per sequence).
        select: ``[b, L]`` bool, the positions whose *next* token is a response token (the
            hidden state at t predicts token t+1); with shared prompts a prompt's last position
            predicts the first token of each of its responses (``select_index`` repeats it).
        labels: ``[n]`` int64, the response tokens, in row-major order of ``select``.
        advantages, loss_weights: ``[n]`` fp32.
        old_logprobs, ref_logprobs: ``[n]`` fp32 or None (filled by no-grad passes).
        sampler_logprobs: ``[n]`` fp32 log-probs from the rollout engine, or None.
        sequence_ids: ``[n]`` int64, which sequence of the microbatch each response token
            belongs to (0 … sequences − 1), or None.
        response_index: ``[n]`` int64, which response of the rollout each token belongs to (the
            sequences' ``response_index``), or None when a sequence has none.
        select_index: ``[n]`` int64, the flat indices (into ``b·L``) of ``select``'s positions;
            derived from ``select`` at construction (on the CPU, where the batch is built), so the
            forward gathers with ``index_select`` instead of boolean-mask indexing, which is a
            host-device sync on CUDA (it must count the mask to size its output).
        label_bounds: ``(min, max)`` of ``labels`` as Python ints (None when n = 0), read at
            construction: the loss checks the labels against the vocabulary with these two
            numbers, not by reading ``labels`` (on CUDA another host-device sync per microbatch).
        cu_seqlens: ``[S + 1]`` int32, packed rows only (b = 1): where each of the row's S
            sequences starts, then L (a padded tail counts as one more sequence);
            max_seqlen: the longest of them. What flash-attention's varlen kernel takes, given
            so that transformers does not derive them from ``position_ids`` in every layer (a
            ``nonzero`` and a max read back to the host, two syncs per layer).
        shared: with shared prompts (``shared_prompt_microbatches``), each prompt's and each
            response's token indices, which the attention gathers (``shared_attention``).

    Built on the CPU (``make_microbatches``), then moved with ``to(device)``, which copies the
    tensors without reading them: the derived fields cost no host-device sync on CUDA. Built
    from CUDA tensors, ``__post_init__`` syncs to derive them.

    Example (two sequences packed in one row of 6: prompts [5] and [6, 7], responses [8, 9] and [2]):
        >>> mb = make_microbatches([Sequence([5, 8, 9], 1, 1.0, 0.5), Sequence([6, 7, 2], 2, -1.0, 0.5)],
        ...                        micro_batch_size=2, pad_id=0, packing=True)[0]
        >>> mb.labels.tolist(), mb.select_index.tolist(), mb.label_bounds, mb.cu_seqlens.tolist()
        ([8, 9, 2], [0, 1, 4], (2, 9), [0, 3, 6])
    """

    input_ids: torch.Tensor
    attention_mask: torch.Tensor | None
    position_ids: torch.Tensor | None
    select: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    loss_weights: torch.Tensor
    old_logprobs: torch.Tensor | None = None
    ref_logprobs: torch.Tensor | None = None
    sampler_logprobs: torch.Tensor | None = None
    sequence_ids: torch.Tensor | None = None
    response_index: torch.Tensor | None = None
    select_index: torch.Tensor | None = None
    label_bounds: tuple[int, int] | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    shared: SharedLayout | None = None

    def __post_init__(self) -> None:
        n = int(self.labels.shape[0])
        for name in (
            "advantages",
            "loss_weights",
            "old_logprobs",
            "ref_logprobs",
            "sampler_logprobs",
            "sequence_ids",
            "response_index",
        ):
            t = getattr(self, name)
            if t is not None and tuple(t.shape) != (n,):
                raise ValueError(f"Microbatch.{name} has shape {tuple(t.shape)}, expected ({n},)")
        if self.select.shape != self.input_ids.shape:
            raise ValueError(
                f"Microbatch.select {tuple(self.select.shape)} != input_ids {tuple(self.input_ids.shape)}"
            )
        if self.select_index is None:
            self.select_index = self.select.flatten().nonzero().squeeze(1)
        if tuple(self.select_index.shape) != (n,):
            raise ValueError(f"Microbatch.select marks {self.select_index.shape[0]} positions for {n} labels")
        if self.label_bounds is None and n:
            self.label_bounds = tuple(int(x) for x in torch.aminmax(self.labels))
        if (self.cu_seqlens is None) != (self.max_seqlen is None):
            raise ValueError("Microbatch.cu_seqlens and max_seqlen come together")
        if self.cu_seqlens is not None and self.input_ids.shape[0] != 1:
            raise ValueError(
                f"Microbatch.cu_seqlens is for one packed row, got {self.input_ids.shape[0]} rows"
            )

    def to(self, device: torch.device) -> Microbatch:
        """The same microbatch with its tensors on ``device`` (copied, never read: no sync)."""
        move = lambda t: t.to(device, non_blocking=True) if isinstance(t, torch.Tensor | SharedLayout) else t
        return Microbatch(**{k: move(v) for k, v in self.__dict__.items()})


@dataclass
class Sequence:
    """One prompt + response. ``tokens = prompt + response``; ``n_prompt = len(prompt)``."""

    tokens: list[int]
    n_prompt: int
    advantage: float
    weight: float  # the per-token loss weight of this sequence's response tokens
    sampler_logprobs: list[float] | None = None  # [len(response)], from the rollout engine
    response_index: int | None = None  # which response of the rollout this is, when the caller tracks it

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
            response_index=i,
        )
        for i, resp in enumerate(response_ids)
        if len(resp) > 0 and keep[i]
    ]


def make_microbatches(
    seqs: list[Sequence], micro_batch_size: int, pad_id: int, packing: bool, share_prompts: bool = False
) -> list[Microbatch]:
    """Microbatches of the rollout's sequences, longest first.

    ``share_prompts`` (``train.share_prompts``): the responses of one prompt share one copy of it
    (``shared_prompt_microbatches``).

    Without packing: ``micro_batch_size`` rows per microbatch, one sequence per row,
    right-padded to the longest in the microbatch (sorting by length keeps that padding small).

    With packing (padding-free): each microbatch is ONE row holding up to the same token budget,
    ``micro_batch_size × (longest sequence)``, filled first-fit-decreasing; positions restart at
    0 for each sequence and no attention mask is passed, so transformers builds the
    block-causal mask from the position ids (flash-attention 2 runs varlen). Same peak
    activations as the padded worst case, no compute spent on padding.
    """
    if share_prompts:
        return shared_prompt_microbatches(seqs, micro_batch_size, pad_id, packing)
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
    labels, adv, w, slp, seq_ids, resp_idx = [], [], [], [], [], []
    starts = []  # packed: where each sequence of the one row starts
    for r, row in enumerate(rows):
        at = 0
        for s in row:
            n = len(s.tokens)
            starts.append(at)
            ids[r, at : at + n] = torch.tensor(s.tokens)
            attn[r, at : at + n] = 1
            pos[r, at : at + n] = torch.arange(n)
            # the hidden state at t predicts token t+1: select t = n_prompt−1 … n−2
            select[r, at + s.n_prompt - 1 : at + n - 1] = True
            labels.extend(s.tokens[s.n_prompt :])
            adv.extend([s.advantage] * s.n_response)
            w.extend([s.weight] * s.n_response)
            seq_ids.extend([len(slp)] * s.n_response)
            resp_idx.extend([s.response_index] * s.n_response)
            slp.append(s.sampler_logprobs)
            at += n
        if packing and at < width:  # the tail is its own "sequence" so nothing attends across
            pos[r, at:] = torch.arange(width - at)
            starts.append(at)
    cu_seqlens = max_seqlen = None
    if packing:
        cu_seqlens = torch.tensor([*starts, width], dtype=torch.int32)
        max_seqlen = int(cu_seqlens.diff().max())
    return Microbatch(
        input_ids=ids,
        attention_mask=None if packing else attn,
        position_ids=pos if packing else None,
        select=select,
        **_per_token_fields(labels, adv, w, slp, seq_ids, resp_idx),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )


def _per_token_fields(labels, adv, w, slp, seq_ids, resp_idx) -> dict[str, torch.Tensor | None]:
    """The per-response-token tensors of a microbatch from its lists, in either layout: labels,
    advantages, loss weights, the sampler's log-probs (when every sequence has them), the
    sequence ids and the response indices (when every sequence has one)."""
    sampler = None
    if slp and all(x is not None for x in slp):
        sampler = torch.tensor([v for x in slp for v in x], dtype=torch.float32)
    return dict(
        labels=torch.tensor(labels, dtype=torch.long),
        advantages=torch.tensor(adv, dtype=torch.float32),
        loss_weights=torch.tensor(w, dtype=torch.float32),
        sampler_logprobs=sampler,
        sequence_ids=torch.tensor(seq_ids, dtype=torch.long),
        response_index=None if None in resp_idx else torch.tensor(resp_idx, dtype=torch.long),
    )


def shared_prompt_microbatches(
    seqs: list[Sequence], micro_batch_size: int, pad_id: int, packing: bool
) -> list[Microbatch]:
    """Microbatches in which each prompt is computed once for all its responses.

    The sequences of one prompt (the same prompt tokens) are laid out as ``[prompt, r_1 … r_k]``
    in one segment: every response attends to the prompt and, causally, to itself only (the
    ``SharedLayout`` in ``shared``, which ``shared_attention`` gathers by: no ``[L, L]`` mask, and
    the attention work of the unshared layout), with the positions it would have alone (``P … P + |r| − 1``). A prompt token is then computed once per segment instead of
    once per response, in the forward and in the backward (its keys and values get the sum of the
    responses' gradients): the same loss and gradients as one row per sequence, to fp32 summation
    order. Each response's first label is predicted from the prompt's last position, which all
    its segment's responses select (``select_index`` repeats it).

    A microbatch holds at most ``micro_batch_size`` responses: a prompt whose responses do not fit
    is split, carrying the prompt once in each microbatch it reaches. Without ``packing`` each
    segment is a row (right-padded to the longest); with ``packing`` a microbatch's segments share
    one row (the layout keeps them apart). Prompts with the longest segments first.

    Example (prompt [5, 6] with responses [8, 9] and [7]; one row of 5):
        >>> mb = shared_prompt_microbatches([Sequence([5, 6, 8, 9], 2, 1.0, 0.5), Sequence([5, 6, 7], 2, -1.0, 0.5)],
        ...                                 micro_batch_size=2, pad_id=0, packing=False)[0]
        >>> mb.input_ids.tolist(), mb.position_ids.tolist(), mb.select_index.tolist(), mb.labels.tolist()
        ([[5, 6, 8, 9, 7]], [[0, 1, 2, 3, 2]], [1, 2, 1], [8, 9, 7])
    """
    groups: dict[tuple[int, ...], list[Sequence]] = {}
    for s in seqs:
        groups.setdefault(tuple(s.tokens[: s.n_prompt]), []).append(s)
    segments = []  # (prompt, responses) with at most micro_batch_size responses each
    for prompt, members in groups.items():
        members = sorted(members, key=lambda s: s.n_response, reverse=True)
        for i in range(0, len(members), micro_batch_size):
            segments.append((list(prompt), members[i : i + micro_batch_size]))
    segments.sort(key=lambda seg: len(seg[0]) + sum(s.n_response for s in seg[1]), reverse=True)
    batches, current, count = [], [], 0
    for seg in segments:
        if current and count + len(seg[1]) > micro_batch_size:
            batches.append(current)
            current, count = [], 0
        current.append(seg)
        count += len(seg[1])
    if current:
        batches.append(current)
    rows_of = (lambda b: [b]) if packing else (lambda b: [[seg] for seg in b])
    return [_collate_shared(rows_of(b), pad_id) for b in batches]


def _collate_shared(rows: list[list[tuple[list[int], list[Sequence]]]], pad_id: int) -> Microbatch:
    """One microbatch of rows, each a list of ``(prompt, responses)`` segments."""
    width = max(sum(len(p) + sum(s.n_response for s in resp) for p, resp in row) for row in rows)
    b = len(rows)
    ids = torch.full((b, width), pad_id, dtype=torch.long)
    pos = torch.zeros((b, width), dtype=torch.long)
    select = torch.zeros((b, width), dtype=torch.bool)
    prompt_spans, response_spans = [], []  # (start, length) / (segment, start, length), flat in b·L
    index, labels, adv, w, slp, seq_ids, resp_idx = [], [], [], [], [], [], []
    for r, row in enumerate(rows):
        at = 0
        for prompt, responses in row:
            n_p, p0 = len(prompt), at
            ids[r, at : at + n_p] = torch.tensor(prompt)
            pos[r, at : at + n_p] = torch.arange(n_p)
            prompt_spans.append((r * width + p0, n_p))
            at += n_p
            for s in responses:
                n = s.n_response
                ids[r, at : at + n] = torch.tensor(s.tokens[s.n_prompt :])
                pos[r, at : at + n] = torch.arange(n_p, n_p + n)
                response_spans.append((len(prompt_spans) - 1, r * width + at, n))
                # label t of the response is predicted at the position before it: the prompt's
                # last token for the first, then the response's own tokens
                before = [r * width + p0 + n_p - 1] + [r * width + at + t for t in range(n - 1)]
                index.extend(before)
                select[r, p0 + n_p - 1] = True
                select[r, at : at + n - 1] = True
                labels.extend(s.tokens[s.n_prompt :])
                adv.extend([s.advantage] * n)
                w.extend([s.weight] * n)
                seq_ids.extend([len(slp)] * n)
                resp_idx.extend([s.response_index] * n)
                slp.append(s.sampler_logprobs)
                at += n
    return Microbatch(
        input_ids=ids,
        attention_mask=None,
        position_ids=pos,
        select=select,
        **_per_token_fields(labels, adv, w, slp, seq_ids, resp_idx),
        select_index=torch.tensor(index, dtype=torch.long),
        shared=SharedLayout.build(b, width, prompt_spans, response_spans),
    )
