"""Shared-prompt attention (``train.share_prompts``): each response attends to its prompt's keys and
values and, causally, to itself, without an ``[L, L]`` mask over the packed row.

A shared-prompt microbatch lays each prompt out once, followed by its responses:
``[prompt, r_1 … r_k]`` (``batch.shared_prompt_microbatches``). The linear layers run on that row
as it is (each prompt token once, not once per response); only attention needs to know who sees
whom. A dense block mask over the row would make attention cost ``(P + Σ|r|)²`` scores where each
response on its own costs ``|r| · (P + |r|)``: for an R1-Zero step (P ≈ 150, 8 responses of ≈ 500
tokens) 17.2 M scores against 2.6 M, which would eat what the shared prompt saves. Here instead,
per layer:

- the prompts: ``[S_p, h, P, d]`` queries over their own keys, causal (one SDPA call);
- the responses: ``[S_r, h, R, d]`` queries over ``[their prompt's keys ; their own]``
  ``[S_r, h, P + R, d]``, gathered from the row by index (one SDPA call, a ``[S_r, 1, R, P + R]``
  bool mask for the causal part and the padding);

then scattered back into the row. That is the unshared layout's attention work exactly (less the
prompt's repeated queries), and the gradient of a prompt key or value is the sum over the
responses that gathered it (``index_select``'s backward is an ``index_add``): the same gradients
as one row per sequence, to fp32 summation order.

It plugs into transformers (written against 5.24) as an attention implementation registered
under ``grpo_fast_shared+<base>`` (``enable``): a call that carries a ``SharedLayout`` in its
keyword arguments (``shared_prompt_layout=``, which the decoder hands down to every layer's
attention, also when a checkpointed layer recomputes in the backward) takes this path; every
other call (generation, evaluation) goes to the base implementation (``sdpa`` or ``eager``)
unchanged, with its mask built as the base builds it. Only models that dispatch attention through
transformers' interface are taken (``_supports_attention_backend``), and a forward in which not
every layer took the layout stops (``check_used``): a layer that drops its keyword arguments
would otherwise attend over the whole row.
"""

from __future__ import annotations

from dataclasses import dataclass, fields

import torch
import torch.nn.functional as F

from grpo_fast.errors import ConfigError

PREFIX = "grpo_fast_shared+"
# Attention implementations a shared-prompt forward wraps: calls without a layout (generation,
# evaluation) keep them; the shared forward itself runs torch's SDPA with a mask (on CUDA the
# memory-efficient kernel). Not flash-attention: transformers tests for it by name in places, so a
# renamed flash implementation is not known to behave as the original (unmeasured: no CUDA here).
BASES = ("sdpa", "eager")


# Rows up to this many tokens are attended with one dense [L, L] block mask instead of the gathers:
# there the attention is small and the gathers' per-call work is not (the tiny preset's rows of
# ≤ 48 tokens: optimization phase 0.062 s dense against 0.071 s gathered on 2 cores).
DENSE_MAX_WIDTH = 128


@dataclass
class SharedLayout:
    """Who attends to whom in one shared-prompt microbatch of b rows of L tokens.

    Either ``dense_mask`` (rows of at most ``DENSE_MAX_WIDTH`` tokens) or the gather indices, flat
    into the microbatch's ``b·L`` tokens. Shapes: S_p prompt segments of up to P tokens, S_r
    responses of up to R tokens.

    Fields:
        dense_mask: ``[b, 1, L, L]`` bool (True = attend): each prompt causal, each response its
            prompt and itself causally, a padding token itself only.
        prompt_index: ``[S_p, P]`` int64, each segment's prompt tokens (a shorter prompt repeats its
            first token in the padding slots).
        prompt_mask: ``[S_p, 1, P, P]`` bool (True = attend), causal within each prompt, or None
            when every prompt has P tokens (then ``is_causal``).
        response_index: ``[S_r, R]`` int64, each response's tokens (padded like the prompts).
        key_index: ``[S_r, P + R]`` int64, the keys each response sees: its prompt's P slots, then
            its own R.
        response_mask: ``[S_r, 1, R, P + R]`` bool: a response token sees its prompt's real tokens
            and its own up to itself; a padding slot sees its prompt's first token only (never an
            empty softmax row).
        prompt_src, prompt_dst, response_src, response_dst: ``[*]`` int64, where the real tokens'
            outputs go: row ``src`` of the flattened ``[S·P]`` (``[S·R]``) output to token ``dst``
            of the ``b·L`` row (padding slots are not written back).
    """

    dense_mask: torch.Tensor | None = None
    prompt_index: torch.Tensor | None = None
    prompt_mask: torch.Tensor | None = None
    response_index: torch.Tensor | None = None
    key_index: torch.Tensor | None = None
    response_mask: torch.Tensor | None = None
    prompt_src: torch.Tensor | None = None
    prompt_dst: torch.Tensor | None = None
    response_src: torch.Tensor | None = None
    response_dst: torch.Tensor | None = None
    used: int = 0  # attention calls that took this layout in the forward (``check_used``)

    @classmethod
    def build(
        cls,
        rows: int,
        width: int,
        prompts: list[tuple[int, int]],
        responses: list[tuple[int, int, int]],
        dense_max_width: int | None = None,
    ) -> SharedLayout:
        """For ``rows`` rows of ``width`` tokens, from ``prompts``: ``(start, length)`` of each
        segment's prompt in the flat ``rows·width`` tokens, and ``responses``: ``(segment, start,
        length)`` of each response (lengths ≥ 1). A dense mask when ``width ≤ dense_max_width``
        (None: ``DENSE_MAX_WIDTH``).

        Example (one row: prompt [0, 1], responses [2, 3] and [4]):
            >>> lay = SharedLayout.build(1, 5, [(0, 2)], [(0, 2, 2), (0, 4, 1)], dense_max_width=0)
            >>> lay.key_index.tolist(), lay.response_mask[1, 0].int().tolist()
            ([[0, 1, 2, 3], [0, 1, 4, 4]], [[1, 1, 1, 0], [1, 0, 0, 0]])
            >>> SharedLayout.build(1, 5, [(0, 2)], [(0, 2, 2), (0, 4, 1)]).dense_mask[0, 0].int().tolist()
            [[1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0], [1, 1, 1, 1, 0], [1, 1, 0, 0, 1]]
        """
        if width <= (DENSE_MAX_WIDTH if dense_max_width is None else dense_max_width):
            return cls(dense_mask=_dense_mask(rows, width, prompts, responses))
        p_len = torch.tensor([n for _, n in prompts])
        p_max = int(p_len.max())
        slot = torch.arange(p_max)
        p_start = torch.tensor([s for s, _ in prompts])
        p_valid = slot[None, :] < p_len[:, None]  # [S_p, P]
        prompt_index = torch.where(p_valid, p_start[:, None] + slot[None, :], p_start[:, None])
        prompt_mask = None
        if not bool(p_valid.all()):
            causal = slot[None, :, None] >= slot[None, None, :]  # [1, P, P]
            prompt_mask = causal & p_valid[:, None, :]
            prompt_mask[:, :, 0] = True  # never an empty row (a padding slot sees the real tokens)
            prompt_mask = prompt_mask[:, None]

        seg = torch.tensor([g for g, _, _ in responses])
        r_len = torch.tensor([n for _, _, n in responses])
        r_max = int(r_len.max())
        rslot = torch.arange(r_max)
        r_start = torch.tensor([s for _, s, _ in responses])
        r_valid = rslot[None, :] < r_len[:, None]  # [S_r, R]
        response_index = torch.where(r_valid, r_start[:, None] + rslot[None, :], r_start[:, None])
        key_index = torch.cat([prompt_index[seg], response_index], dim=1)
        sees_prompt = p_valid[seg][:, None, :].expand(-1, r_max, -1)  # [S_r, R, P]
        sees_self = (rslot[:, None] >= rslot[None, :])[None] & r_valid[:, None, :]  # [S_r, R, R]
        response_mask = torch.cat([sees_prompt, sees_self], dim=2)
        pad_rows = ~r_valid
        response_mask[pad_rows] = False
        response_mask[..., 0] |= pad_rows  # key 0 is the prompt's first token, always real
        return cls(
            prompt_index=prompt_index,
            prompt_mask=prompt_mask,
            response_index=response_index,
            key_index=key_index,
            response_mask=response_mask[:, None],
            prompt_src=p_valid.flatten().nonzero().squeeze(1),
            prompt_dst=prompt_index[p_valid],
            response_src=r_valid.flatten().nonzero().squeeze(1),
            response_dst=response_index[r_valid],
        )

    def to(self, device: torch.device, non_blocking: bool = True) -> SharedLayout:
        """The same layout on ``device`` (copied, never read: no sync)."""
        move = lambda t: t.to(device, non_blocking=non_blocking) if isinstance(t, torch.Tensor) else t
        return SharedLayout(**{f.name: move(getattr(self, f.name)) for f in fields(self)})


def _dense_mask(rows: int, width: int, prompts, responses) -> torch.Tensor:
    """``[rows, 1, width, width]`` bool from the spans, by broadcasting (no per-span loop: the tiny
    preset's 288 spans cost 24 ms of ``tril`` calls in a 73 ms optimization phase that way)."""
    total = rows * width
    piece = torch.full((total,), -1)  # which span each token is in (−1: padding)
    segment = torch.full((total,), -1)  # the prompt segment of that span
    is_prompt = torch.zeros(total, dtype=torch.bool)
    starts = [s for s, _ in prompts] + [s for _, s, _ in responses]
    lengths = [n for _, n in prompts] + [n for _, _, n in responses]
    segs = list(range(len(prompts))) + [g for g, _, _ in responses]
    n_tok = torch.tensor(lengths)
    token = torch.repeat_interleave(torch.tensor(starts), n_tok) + (
        torch.arange(int(n_tok.sum())) - torch.repeat_interleave(n_tok.cumsum(0) - n_tok, n_tok)
    )
    piece[token] = torch.repeat_interleave(torch.arange(len(starts)), n_tok)
    segment[token] = torch.repeat_interleave(torch.tensor(segs), n_tok)
    is_prompt[token] = torch.repeat_interleave(torch.arange(len(starts)) < len(prompts), n_tok)
    view = lambda t: t.view(rows, width)
    piece, segment, is_prompt = view(piece), view(segment), view(is_prompt)
    col = torch.arange(width)
    causal = col[:, None] >= col[None, :]  # [L, L]: key ≤ query
    same_piece = (piece[:, :, None] == piece[:, None, :]) & (piece[:, :, None] >= 0) & causal
    own_prompt = is_prompt[:, None, :] & (segment[:, None, :] == segment[:, :, None]) & ~is_prompt[:, :, None]
    padding_self = (piece < 0)[:, :, None] & torch.eye(width, dtype=torch.bool)
    return (same_piece | (own_prompt & (segment[:, :, None] >= 0)) | padding_self)[:, None]


def attention(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    layout: SharedLayout,
    scaling: float | None = None,
    dropout: float = 0.0,
) -> torch.Tensor:
    """Shared-prompt attention over a packed row.

    ``query`` ``[b, h, L, d]``, ``key`` / ``value`` ``[b, h_kv, L, d]`` (h a multiple of h_kv, the
    grouped-query layout) → ``[b, L, h, d]`` (transformers' attention output layout). Tokens that
    belong to no prompt or response (the row's padding; never read) get zeros from the gathers, and
    attend to themselves under the dense mask.
    """
    b, h, length, d = query.shape
    rep = h // key.shape[1]
    if layout.dense_mask is not None:
        if rep > 1:
            key, value = key.repeat_interleave(rep, dim=1), value.repeat_interleave(rep, dim=1)
        out = F.scaled_dot_product_attention(
            query, key, value, attn_mask=layout.dense_mask, dropout_p=dropout, scale=scaling
        )  # [b, h, L, d]
        return out.transpose(1, 2)
    flat = lambda t: t.transpose(1, 2).reshape(b * length, t.shape[1], d)  # [b·L, heads, d]
    q, k, v = flat(query), flat(key), flat(value)

    def gather(t: torch.Tensor, index: torch.Tensor, heads_rep: int) -> torch.Tensor:
        g = t.index_select(0, index.flatten()).view(*index.shape, t.shape[1], d).transpose(1, 2)
        return g.repeat_interleave(heads_rep, dim=1) if heads_rep > 1 else g  # [S, h, T, d]

    def sdpa(qi, ki, mask) -> torch.Tensor:
        return F.scaled_dot_product_attention(
            gather(q, qi, 1),
            gather(k, ki, rep),
            gather(v, ki, rep),
            attn_mask=mask,
            dropout_p=dropout,
            is_causal=mask is None,
            scale=scaling,
        )  # [S, h, T, d]

    out_p = sdpa(layout.prompt_index, layout.prompt_index, layout.prompt_mask)
    out_r = sdpa(layout.response_index, layout.key_index, layout.response_mask)
    rows = lambda o: o.transpose(1, 2).reshape(-1, h, d)  # [S·T, h, d]
    out = q.new_zeros(b * length, h, d)
    out = out.index_copy(0, layout.prompt_dst, rows(out_p).index_select(0, layout.prompt_src))
    out = out.index_copy(0, layout.response_dst, rows(out_r).index_select(0, layout.response_src))
    return out.view(b, length, h, d)


def _wrapped(base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(module, query, key, value, attention_mask, **kwargs):
        layout = kwargs.pop("shared_prompt_layout", None)
        if layout is None:  # eager is the model's own function, not in the registry
            fn = _eager_of(module) if base == "eager" else ALL_ATTENTION_FUNCTIONS[base]
            return fn(module, query, key, value, attention_mask, **kwargs)
        layout.used += 1
        if kwargs.get("sliding_window") is not None:
            raise ValueError("train.share_prompts does not support sliding-window attention layers")
        out = attention(
            query, key, value, layout, scaling=kwargs.get("scaling"), dropout=kwargs.get("dropout", 0.0)
        )
        return out, None

    return forward


def _eager_of(module):
    """The model's own eager attention function (every transformers model defines one in its
    modeling file as ``eager_attention_forward``)."""
    import sys

    return sys.modules[type(module).__module__].eager_attention_forward


def enable(model: torch.nn.Module) -> None:
    """Let ``model``'s attention take shared-prompt layouts: its attention implementation becomes
    ``grpo_fast_shared+<base>`` (registered on first use, with the base's mask builder), which
    behaves as the base for every call without a layout. Idempotent. ``ConfigError`` for a model
    that does not dispatch through transformers' attention interface (``_supports_attention_backend``
    false: StableLM, Falcon in 5.24) and for a base not in ``BASES``."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    config = model.config
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    if not getattr(base, "_supports_attention_backend", False):
        raise ConfigError(
            f"train.share_prompts=true: {type(base).__name__} does not dispatch its attention through "
            "transformers' attention interface, which the shared forward plugs into: set "
            "train.share_prompts=false"
        )
    current = config._attn_implementation or "eager"
    if PREFIX in current:  # already wrapped (also inside sequence parallelism's wrapper, policy/ulysses.py)
        return
    if current not in BASES:
        raise ConfigError(
            f"train.share_prompts=true: the model's attention {current!r} is not one it can wrap "
            f"({', '.join(BASES)}): set model.attn_implementation=sdpa or train.share_prompts=false"
        )
    name = PREFIX + current
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _wrapped(current))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    config._attn_implementation = name


def check_used(model: torch.nn.Module, layout: SharedLayout) -> None:
    """After a shared-prompt forward: every decoder layer's attention took the layout. A model
    whose layers do not hand their keyword arguments to the attention (transformers 5.24:
    Nemotron's decoder layer), or that picks its attention by another name, would have run its
    base attention under the all-True placeholder mask, every token seeing the whole row: a
    ``ConfigError`` then, not a silently wrong loss."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    if layout.used == 0 or (layers is not None and layout.used != layers):
        raise ConfigError(
            f"train.share_prompts=true: {type(model).__name__}'s attention took the shared layout in "
            f"{layout.used} of {layers if layers is not None else 'its'} layers (its layers do not pass "
            "their keyword arguments to transformers' attention interface): set train.share_prompts=false"
        )


def placeholder_mask(input_ids: torch.Tensor) -> torch.Tensor:
    """A ``[b, 1, 1, 1]`` bool stand-in for the attention mask of a shared-prompt forward:
    transformers hands a 4-D mask to the attention as it is (masking_utils, 5.24), so it builds no
    ``[b, 1, L, L]`` mask from the position ids (which restart in every response) and the shared
    path, which ignores it, pays nothing for it."""
    return torch.ones(input_ids.shape[0], 1, 1, 1, dtype=torch.bool, device=input_ids.device)
