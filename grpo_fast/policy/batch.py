"""From trajectories to microbatches: sequences, label positions, advantages and loss weights.

The unit is the rollout's own ``Trajectory`` (``grpo_fast.rollout.trajectory``): its prompt, its
response tokens with a role each, its advantage. Only sampled tokens are labels (a loss, a
gradient, an entropy); inserted tokens (a tool's output) are context, like the prompt.

The loss weights carry the length normalization (``core.length_norm_weights`` over the sampled
tokens), computed once for the whole rollout batch (with global counts across data-parallel
ranks), so that the microbatch losses ``Σ w·ℓ`` add up to the batch loss however the batch is
split or packed.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass

import torch

from grpo_fast.algo.length_norm import length_norm_weights
from grpo_fast.policy.shared_attention import SharedLayout
from grpo_fast.rollout.base import Rollout
from grpo_fast.rollout.trajectory import Trajectory

# Microbatch's [N] per-selected-token fields (labels first): one list for every check and slice
PER_TOKEN_FIELDS = (
    "labels",
    "advantages",
    "loss_weights",
    "old_logprobs",
    "ref_logprobs",
    "sampler_logprobs",
    "sequence_ids",
    "response_index",
    "returns",
    "old_values",
)


@dataclass
class Microbatch:
    """One microbatch of sequences, right-padded, with the per-token quantities of its responses.

    Shapes: b sequences of padded length L; n = number of labels (sampled response tokens) in
    the microbatch.

    Fields:
        input_ids: ``[b, L]`` int64; attention_mask: ``[b, L]`` (1 = real token), None for
            packed rows and for shared prompts (``shared`` says who attends to whom).
        position_ids: ``[b, L]`` or None (packed rows restart positions per sequence).
        select: ``[b, L]`` bool, the positions whose *next* token is a sampled response token
            (the hidden state at t predicts token t+1); with shared prompts a prompt's last
            position predicts the first token of each of its responses (``select_index``
            repeats it). An inserted token is never selected.
        labels: ``[n]`` int64, the sampled tokens, in row-major order of ``select``.
        advantages, loss_weights: ``[n]`` fp32.
        old_logprobs, ref_logprobs: ``[n]`` fp32 or None (filled by no-grad passes).
        sampler_logprobs: ``[n]`` fp32 log-probs from the rollout engine, or None.
        sequence_ids: ``[n]`` int64, which sequence of the microbatch each label belongs to
            (0 … sequences − 1), or None.
        response_index: ``[n]`` int64, which trajectory of ``make_microbatches``' input each
            label belongs to, or None.
        returns, old_values: ``[n]`` fp32 with a value model (``loss.advantage=gae``): each
            token's value target and the value it had when the advantages were computed (the
            value clip's centre); None without one.
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
    returns: torch.Tensor | None = None
    old_values: torch.Tensor | None = None
    select_index: torch.Tensor | None = None
    label_bounds: tuple[int, int] | None = None
    cu_seqlens: torch.Tensor | None = None
    max_seqlen: int | None = None
    shared: SharedLayout | None = None

    def __post_init__(self) -> None:
        n = int(self.labels.shape[0])
        for name in PER_TOKEN_FIELDS[1:]:
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


def Sequence(  # named like a type: the shorthand this module always had
    tokens: list[int],
    n_prompt: int,
    advantage: float,
    weight: float,
    sampler_logprobs: list[float] | None = None,
) -> Trajectory:
    """A single-turn ``Trajectory`` from one token list: the prompt ``tokens[:n_prompt]``, then a
    response every token of which is trained with loss weight ``weight`` (the SFT targets, probes
    and hand-built test batches).

        >>> t = Sequence([5, 6, 8, 9], 2, 1.0, 0.5)
        >>> t.prompt_ids, t.sampled_ids, t.loss_weights.tolist()
        ([5, 6], [8, 9], [0.5, 0.5])
    """
    return Trajectory.single_turn(
        list(tokens[:n_prompt]),
        list(tokens[n_prompt:]),
        advantage=advantage,
        loss_weight=weight,
        sampler_logprobs=None if sampler_logprobs is None else list(sampler_logprobs),
    )


def assign_loss_weights(
    trajectories: list[Trajectory],
    *,
    length_norm: str,
    max_length: int,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
) -> None:
    """Set each trajectory's ``loss_weights`` ``[S_i]``: the length normalization of its sampled
    tokens (``core.length_norm_weights`` over the ``[R, max S]`` mask of sampled tokens; inserted
    tokens count nowhere). ``num_sequences``, ``num_tokens``: the global counts when this is one
    rank's share (defaults: these trajectories, their sampled tokens).

    Example (sequence_mean over 2 responses of 2 and 1 sampled tokens: 1/(2·2), 1/(1·2)):
        >>> ts = [Trajectory([1], [3, 4]), Trajectory([1], [5])]
        >>> assign_loss_weights(ts, length_norm="sequence_mean", max_length=4)
        >>> [t.loss_weights.tolist() for t in ts]
        [[0.25, 0.25], [0.5]]
    """
    counts = torch.tensor([t.num_sampled for t in trajectories], dtype=torch.long)
    width = max(int(counts.max().item()), 1) if trajectories else 1
    mask = torch.arange(width)[None, :] < counts[:, None]
    w = length_norm_weights(
        mask,
        length_norm,
        max_length=max_length,
        num_sequences=len(trajectories) if num_sequences is None else num_sequences,
        num_tokens=num_tokens,
    )
    for t, row, n in zip(trajectories, w, counts.tolist()):
        t.loss_weights = row[:n]


def loss_trajectories(
    rollout: Rollout,
    *,
    length_norm: str,
    max_length: int,
    num_sequences: int | None = None,
    num_tokens: float | None = None,
    keep: list[bool] | None = None,
    advantages: torch.Tensor | None = None,
) -> list[Trajectory]:
    """Copies of the rollout's trajectories that enter the loss, in rollout order, each with its
    loss weights (``assign_loss_weights``): those with a sampled token and not left out by
    ``keep``. The rollout's own trajectories are not changed (shallow copies: the token lists are
    shared), so a batch finalized once reads the same after its step as before it.

    Args:
        rollout: the batch; each trajectory's advantages (``Trajectory.sampled_advantages``)
            are used as they are, unless ``advantages`` ``[R]`` is given (then each copy's one
            advantage is set from it first).
        length_norm, max_length: see ``core.length_norm_weights``.
        num_sequences, num_tokens: the global counts of the kept responses and their sampled
            tokens when this is one rank's share.
        keep: ``[R]`` bool, False for responses left out of the loss altogether (no loss, not
            counted in the default normalizers; ``loss.mask_truncated``).
    """
    trajectories = rollout.trajectories
    r = len(trajectories)
    keep = [True] * r if keep is None else list(keep)
    if len(keep) != r or (advantages is not None and tuple(advantages.shape) != (r,)):
        raise ValueError(
            f"{r} responses, keep of {len(keep)}, advantages of shape "
            f"{None if advantages is None else tuple(advantages.shape)}"
        )
    kept = [copy.copy(t) for t, k in zip(trajectories, keep) if k]
    if advantages is not None:
        for t, a in zip(kept, [a for a, k in zip(advantages.tolist(), keep) if k]):
            t.advantage, t.token_advantages = a, None
    assign_loss_weights(
        kept,
        length_norm=length_norm,
        max_length=max_length,
        num_sequences=num_sequences,
        num_tokens=num_tokens,
    )
    return [t for t in kept if t.num_sampled > 0]


def make_microbatches(
    trajectories: list[Trajectory],
    micro_batch_size: int,
    pad_id: int,
    packing: bool,
    share_prompts: bool = False,
) -> list[Microbatch]:
    """Microbatches of ``trajectories``, longest first; each token of a microbatch knows its
    trajectory's index in ``trajectories`` (``Microbatch.response_index``). Only sampled tokens
    are labels; inserted tokens (a tool's output) and prompts are context. A trajectory without
    ``loss_weights`` gets weight 0 (scoring passes).

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
    rows = list(enumerate(trajectories))
    if share_prompts:
        return shared_prompt_microbatches(rows, micro_batch_size, pad_id, packing)
    length = lambda row: len(row[1].prompt_ids) + row[1].num_tokens
    order = sorted(rows, key=length, reverse=True)
    if not packing:
        return [
            _collate([[row] for row in order[i : i + micro_batch_size]], pad_id, packing=False)
            for i in range(0, len(order), micro_batch_size)
        ]
    cap = micro_batch_size * length(order[0]) if order else 0
    bins: list[list[tuple[int, Trajectory]]] = []
    room: list[int] = []
    for row in order:
        for i, free in enumerate(room):
            if length(row) <= free:
                bins[i].append(row)
                room[i] -= length(row)
                break
        else:
            bins.append([row])
            room.append(cap - length(row))
    return [_collate([b], pad_id, packing=True) for b in bins]


class _Tokens:
    """The per-label lists of one microbatch, in the order its labels are selected."""

    def __init__(self):
        self.labels, self.adv, self.w, self.slp, self.seq_ids, self.resp_idx = [], [], [], [], [], []
        self.returns, self.values = [], []

    def add(self, index: int, t: Trajectory) -> None:
        n = t.num_sampled
        self.labels.extend(t.sampled_ids)
        self.adv.extend(t.token_advantages.tolist() if t.token_advantages is not None else [t.advantage] * n)
        self.w.append(t.loss_weights if t.loss_weights is not None else torch.zeros(n))
        self.seq_ids.extend([len(self.slp)] * n)
        self.resp_idx.extend([index] * n)
        self.slp.append(t.sampler_logprobs)
        self.returns.append(t.token_returns)
        self.values.append(t.token_values)

    def fields(self) -> dict[str, torch.Tensor | None]:
        """labels, advantages, loss weights, the sampler's log-probs (when every trajectory has
        them), the sequence ids and the response indices, the value model's returns and old
        values (when every trajectory has them), as tensors."""
        sampler = returns = old_values = None
        if self.slp and all(x is not None for x in self.slp):
            sampler = torch.tensor([v for x in self.slp for v in x], dtype=torch.float32)
        if self.returns and all(x is not None for x in self.returns):  # a value model's targets
            returns = torch.cat(self.returns).float()
            old_values = torch.cat(self.values).float()
        return dict(
            labels=torch.tensor(self.labels, dtype=torch.long),
            advantages=torch.tensor(self.adv, dtype=torch.float32),
            loss_weights=torch.cat(self.w).float() if self.w else torch.zeros(0),
            sampler_logprobs=sampler,
            sequence_ids=torch.tensor(self.seq_ids, dtype=torch.long),
            response_index=torch.tensor(self.resp_idx, dtype=torch.long),
            returns=returns,
            old_values=old_values,
        )


def _collate(rows: list[list[tuple[int, Trajectory]]], pad_id: int, packing: bool) -> Microbatch:
    # Built as flat Python lists and turned into tensors once: per-sequence tensor writes cost
    # ~10 small torch ops a response (~4 ms of the tiny preset's 36-ms SFT step at 64 responses)
    width = max(sum(len(t.prompt_ids) + t.num_tokens for _, t in row) for row in rows)
    b = len(rows)
    ids, attn, pos = [pad_id] * (b * width), [0] * (b * width), [0] * (b * width)
    chosen = []  # flat b·width positions whose hidden state predicts a sampled token
    tokens = _Tokens()
    starts = []  # packed: where each sequence of the one row starts
    for r, row in enumerate(rows):
        at, base = 0, r * width
        for index, t in row:
            n_p, n = len(t.prompt_ids), len(t.prompt_ids) + t.num_tokens
            starts.append(at)
            ids[base + at : base + at + n] = [*t.prompt_ids, *t.token_ids]
            attn[base + at : base + at + n] = [1] * n
            pos[base + at : base + at + n] = range(n)
            # the hidden state at p predicts token p+1: each sampled token's position minus one
            first = base + at + n_p - 1
            chosen.extend(
                range(first, first + t.num_tokens)
                if t.roles is None
                else (first + p for p in t.label_positions)
            )
            tokens.add(index, t)
            at += n
        if packing and at < width:  # the tail is its own "sequence" so nothing attends across
            pos[base + at : base + width] = range(width - at)
            starts.append(at)
    select = torch.zeros(b * width, dtype=torch.bool)
    select[torch.tensor(chosen, dtype=torch.long)] = True
    cu_seqlens = max_seqlen = None
    if packing:
        cu_seqlens = torch.tensor([*starts, width], dtype=torch.int32)
        max_seqlen = int(cu_seqlens.diff().max())
    return Microbatch(
        input_ids=torch.tensor(ids, dtype=torch.long).view(b, width),
        attention_mask=None if packing else torch.tensor(attn, dtype=torch.long).view(b, width),
        position_ids=torch.tensor(pos, dtype=torch.long).view(b, width) if packing else None,
        select=select.view(b, width),
        **tokens.fields(),
        cu_seqlens=cu_seqlens,
        max_seqlen=max_seqlen,
    )


def shared_prompt_microbatches(
    rows: list[tuple[int, Trajectory]], micro_batch_size: int, pad_id: int, packing: bool
) -> list[Microbatch]:
    """Microbatches in which each prompt is computed once for all its responses; ``rows``: the
    trajectories with their response indices (``make_microbatches`` passes them).

    The responses of one prompt (the same prompt tokens) are laid out as ``[prompt, r_1 … r_k]``
    in one segment: every response attends to the prompt and, causally, to itself only (the
    ``SharedLayout`` in ``shared``, which ``shared_attention`` gathers by: no ``[L, L]`` mask, and
    the attention work of the unshared layout), with the positions it would have alone
    (``P … P + |r| − 1``). A prompt token is then computed once per segment instead of once per
    response, in the forward and in the backward (its keys and values get the sum of the
    responses' gradients): the same loss and gradients as one row per sequence, to fp32 summation
    order. Each response's first label is predicted from the prompt's last position, which all
    its segment's responses select (``select_index`` repeats it); an inserted token is context,
    never selected.

    A microbatch holds at most ``micro_batch_size`` responses: a prompt whose responses do not fit
    is split, carrying the prompt once in each microbatch it reaches. Without ``packing`` each
    segment is a row (right-padded to the longest); with ``packing`` a microbatch's segments share
    one row (the layout keeps them apart). Prompts with the longest segments first.

    Example (prompt [5, 6] with responses [8, 9] and [7]; one row of 5):
        >>> mb = shared_prompt_microbatches([(0, Sequence([5, 6, 8, 9], 2, 1.0, 0.5)), (1, Sequence([5, 6, 7], 2, -1.0, 0.5))],
        ...                                 micro_batch_size=2, pad_id=0, packing=False)[0]
        >>> mb.input_ids.tolist(), mb.position_ids.tolist(), mb.select_index.tolist(), mb.labels.tolist()
        ([[5, 6, 8, 9, 7]], [[0, 1, 2, 3, 2]], [1, 2, 1], [8, 9, 7])
    """
    groups: dict[tuple[int, ...], list[tuple[int, Trajectory]]] = {}
    for row in rows:
        groups.setdefault(tuple(row[1].prompt_ids), []).append(row)
    segments = []  # (prompt, responses) with at most micro_batch_size responses each
    for prompt, members in groups.items():
        members = sorted(members, key=lambda row: row[1].num_tokens, reverse=True)
        for i in range(0, len(members), micro_batch_size):
            segments.append((list(prompt), members[i : i + micro_batch_size]))
    segments.sort(key=lambda seg: len(seg[0]) + sum(t.num_tokens for _, t in seg[1]), reverse=True)
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


def _collate_shared(
    rows: list[list[tuple[list[int], list[tuple[int, Trajectory]]]]], pad_id: int
) -> Microbatch:
    """One microbatch of rows, each a list of ``(prompt, responses)`` segments."""
    # flat Python lists, made tensors once (as ``_collate``): 10 -> 1 ms a tiny-preset step
    width = max(sum(len(p) + sum(t.num_tokens for _, t in resp) for p, resp in row) for row in rows)
    b = len(rows)
    ids, pos = [pad_id] * (b * width), [0] * (b * width)
    prompt_spans, response_spans = [], []  # (start, length) / (segment, start, length), flat in b·L
    index = []
    tokens = _Tokens()
    for r, row in enumerate(rows):
        at, base = 0, r * width
        for prompt, responses in row:
            n_p, p0 = len(prompt), base + at
            ids[p0 : p0 + n_p] = prompt
            pos[p0 : p0 + n_p] = range(n_p)
            prompt_spans.append((p0, n_p))
            at += n_p
            for i, t in responses:
                n, a = t.num_tokens, base + at
                ids[a : a + n] = t.token_ids
                pos[a : a + n] = range(n_p, n_p + n)
                response_spans.append((len(prompt_spans) - 1, a, n))
                # a sampled token at response position p is predicted at the position before it:
                # the prompt's last token for p = 0, else the response's own token p − 1
                if t.roles is None:
                    index.extend([p0 + n_p - 1] if n else [])  # an empty response selects nothing
                    index.extend(range(a, a + n - 1))
                else:
                    index.extend(p0 + n_p - 1 if p == 0 else a + p - 1 for p in t.label_positions)
                tokens.add(i, t)
                at += n
    select_index = torch.tensor(index, dtype=torch.long)
    select = torch.zeros(b * width, dtype=torch.bool)
    select[select_index] = True
    return Microbatch(
        input_ids=torch.tensor(ids, dtype=torch.long).view(b, width),
        attention_mask=None,
        position_ids=torch.tensor(pos, dtype=torch.long).view(b, width),
        select=select.view(b, width),
        **tokens.fields(),
        select_index=select_index,
        shared=SharedLayout.build(b, width, prompt_spans, response_spans),
    )
