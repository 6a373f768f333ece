"""Ulysses attention (``train.sequence_parallel=N``): each of the N ranks of an sp group holds 1/N
of every sequence's tokens, and attention, the one layer that mixes tokens, swaps the split.

Per decoder layer, on each rank (b rows, L tokens padded to a multiple of N, s = L/N local tokens,
h query and h_kv key/value heads):

    q [b, h, s, d], k, v [b, h_kv, s, d]    this rank's tokens, every head (after RoPE)
      ── all-to-all (one, q, k and v together) ──
    q [b, h/N, L, d], k, v [b, h_kv/N, L, d]    every token, this rank's heads
      ── attention over the whole sequence (causal, the packed block mask, or the shared-prompt layout) ──
    o [b, L, h/N, d]
      ── all-to-all back ──
    o [b, s, h, d]                          this rank's tokens, every head: on to o_proj

so the linear layers, norms and MLPs see s tokens, and attention sees whole sequences for h/N
heads. The query heads must divide by N, and the key/value heads too, unless N is a multiple of
them: then each is repeated before the exchange, so that each rank gets the one its query heads
read (``fits_heads``: Qwen2.5-1.5B's 12 / 2 heads split over 2, 4 or 6 ranks, not 8). The
all-to-all's backward is the same exchange of the
gradients (each is its own adjoint), so the gradient of a key or value reaches the rank that holds
its token. What each rank saves for the backward is its tokens' activations plus, in attention,
its heads' full-length ``q, k, v, o``: the same bytes as its tokens' all-head ones.

It plugs into transformers (written against 5.24) as an attention implementation registered
under ``grpo_fast_sp+<inner>`` (``enable``), wrapped around the shared-prompt one
(``grpo_fast_shared+<base>``, ``policy/shared_attention.py``), which wraps ``sdpa`` or ``eager``: a
call that carries a shard (``sequence_parallel_shard=``, handed down to every layer, also when a
checkpointed layer recomputes in the backward) takes the path above; any other call (generation,
evaluation, the no-grad passes of the rollout phase) goes to the inner implementation unchanged.
The sharded forward runs torch's SDPA on the gathered heads as transformers' ``sdpa`` does (causal
without a mask and the grouped-query heads as they are; under the packed row's mask with the
key/value heads repeated), an ``eager`` model's too (as the shared-prompt path does), or the
shared-prompt attention.
"""

from __future__ import annotations

import torch
import torch.distributed as torch_dist
import torch.nn.functional as F

from grpo_fast.errors import ConfigError
from grpo_fast.policy import shared_attention

PREFIX = "grpo_fast_sp+"
KWARG = "sequence_parallel_shard"  # the forward keyword that carries a SequenceShard to every layer


class _AllToAll(torch.autograd.Function):
    """``x [N, ...]``: block j to rank j of ``group``, block i of the result from rank i
    (``all_to_all_single`` with equal splits). The backward is the same exchange of the gradient."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, group) -> torch.Tensor:
        ctx.group = group
        x = x.contiguous()
        out = torch.empty_like(x)
        torch_dist.all_to_all_single(out, x, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        grad = grad.contiguous()  # (an upstream gradient may come strided: empty_like would keep that)
        out = torch.empty_like(grad)
        torch_dist.all_to_all_single(out, grad, group=ctx.group)
        return out, None


def sequence_to_heads(tensors: list[torch.Tensor], size: int, group) -> list[torch.Tensor]:
    """This rank's tokens of every head → every token of this rank's heads, for several tensors in
    one all-to-all: each ``[b, heads, s, d]`` → ``[b, heads/size, size·s, d]`` (rank r keeps heads
    ``[r·heads/size, (r+1)·heads/size)``; the tokens in rank order).

    Example (2 ranks, ``q [1, 4, 3, 8]``): rank 0 gets ``[1, 2, 6, 8]``, heads 0-1 of tokens 0-5."""
    b, _, s, d = tensors[0].shape
    heads = [t.shape[1] // size for t in tensors]
    # [b, size, heads_i/size, s, d] each, side by side: block j (dim 1) is what rank j receives
    blocks = torch.cat([t.reshape(b, size, h, s, d) for t, h in zip(tensors, heads)], dim=2)
    got = _AllToAll.apply(blocks.transpose(0, 1).contiguous(), group)  # [size (from rank i), b, Σh, s, d]
    full = got.permute(1, 2, 0, 3, 4).reshape(b, sum(heads), size * s, d)  # tokens in rank order
    return list(full.split(heads, dim=1))


def heads_to_sequence(out: torch.Tensor, size: int, group) -> torch.Tensor:
    """The inverse of ``sequence_to_heads`` on attention's output layout: ``[b, L, h/size, d]``
    (every token, this rank's heads) → ``[b, L/size, h, d]`` (this rank's tokens, every head)."""
    b, length, h, d = out.shape
    s = length // size
    blocks = out.reshape(b, size, s, h, d).transpose(0, 1).contiguous()  # block j: rank j's tokens
    got = _AllToAll.apply(blocks, group)  # [size (head group i), b, s, h, d]
    return got.permute(1, 2, 0, 3, 4).reshape(b, s, size * h, d)


def attention(query, key, value, shard, scaling: float | None = None, dropout: float = 0.0) -> torch.Tensor:
    """Ulysses attention of one layer: ``query [b, h, s, d]``, ``key``/``value`` ``[b, h_kv, s, d]``
    (this rank's tokens) → ``[b, s, h, d]``, attending over the whole sequences ``shard`` describes
    (``grpo_fast.policy.sequence_parallel.SequenceShard``).

    Fewer key/value heads than ranks (``N = k·h_kv``: Qwen2.5-1.5B's 2 KV heads over 4 ranks): each
    is repeated k times before the exchange, so that rank r gets the one its query heads read (its
    gradient, summed over the copies, goes back to the one head)."""
    if shard.size > key.shape[1]:
        copies = shard.size // key.shape[1]
        key, value = key.repeat_interleave(copies, dim=1), value.repeat_interleave(copies, dim=1)
    q, k, v = sequence_to_heads([query, key, value], shard.size, shard.group)
    if shard.shared is not None:  # train.share_prompts: the layout over the whole (widened) row
        out = shared_attention.attention(q, k, v, shard.shared, scaling=scaling, dropout=dropout)
    else:
        out = _sdpa(q, k, v, shard.mask(), scaling, dropout)  # [b, L, h/N, d]
    return heads_to_sequence(out, shard.size, shard.group)


def _sdpa(q, k, v, mask: torch.Tensor | None, scaling, dropout) -> torch.Tensor:
    """``q [b, h, L, d]`` over ``k``, ``v`` ``[b, h_kv, L, d]`` → ``[b, L, h, d]``: causal (``mask``
    None; grouped-query heads as they are, as transformers' sdpa runs it without a mask) or under
    the bool ``mask`` ``[b, 1, L, L]`` (the key/value heads repeated, as transformers does then)."""
    rep = q.shape[1] // k.shape[1]
    if mask is not None and rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    out = F.scaled_dot_product_attention(
        q,
        k,
        v,
        attn_mask=mask,
        dropout_p=dropout,
        is_causal=mask is None,
        scale=scaling,
        enable_gqa=mask is None and rep > 1,
    )
    return out.transpose(1, 2)


def _wrapped(inner: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(module, query, key, value, attention_mask, **kwargs):
        shard = kwargs.pop(KWARG, None)
        if shard is None:  # generation, evaluation, an unsharded pass: the inner implementation
            return ALL_ATTENTION_FUNCTIONS[inner](module, query, key, value, attention_mask, **kwargs)
        shard.used += 1
        if kwargs.get("sliding_window") is not None:
            raise ValueError("train.sequence_parallel does not support sliding-window attention layers")
        out = attention(
            query, key, value, shard, scaling=kwargs.get("scaling"), dropout=kwargs.get("dropout", 0.0)
        )
        return out, None

    return forward


def fits_heads(heads: int, kv_heads: int, size: int) -> bool:
    """Whether ``size`` ranks can split a model's heads: each takes ``heads/size`` query heads and
    either ``kv_heads/size`` key/value heads or (``size`` a multiple of ``kv_heads``) a copy of one.

    Example: ``fits_heads(12, 2, 4)`` (Qwen2.5-1.5B over 4 ranks) is True, ``fits_heads(12, 2, 8)`` False.
    """
    return heads % size == 0 and (kv_heads % size == 0 or size % kv_heads == 0)


def check_model(model: torch.nn.Module, size: int) -> None:
    """``ConfigError`` (one line) unless ``model`` can run Ulysses attention over ``size`` ranks:
    it dispatches attention through transformers' interface, its heads split over ``size`` ranks
    (``fits_heads``), it has no sliding-window layers, and its attention is ``sdpa`` or ``eager``."""
    key = f"train.sequence_parallel={size}"
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    if not getattr(base, "_supports_attention_backend", False):
        raise ConfigError(
            f"{key}: {type(base).__name__} does not dispatch its attention through transformers' attention "
            "interface, which Ulysses attention plugs into: set train.sequence_parallel=1"
        )
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    heads = config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or heads
    if not fits_heads(heads, kv_heads, size):
        raise ConfigError(
            f"{key}: the model's {heads} attention heads must divide by {size}, and its {kv_heads} key/value "
            f"heads divide by {size} or {size} by them (each rank attends with 1/{size} of the heads): one of "
            f"{', '.join(map(str, (n for n in range(1, heads + 1) if fits_heads(heads, kv_heads, n))))}"
        )
    if "sliding_attention" in (getattr(config, "layer_types", None) or ()):
        raise ConfigError(
            f"{key}: the model has sliding-window attention layers, which Ulysses attention does not run"
        )
    current = (model.config._attn_implementation or "eager").removeprefix(PREFIX)
    if current.removeprefix(shared_attention.PREFIX) not in shared_attention.BASES:
        raise ConfigError(
            f"{key}: the model's attention {current!r} is not one it can wrap ({', '.join(shared_attention.BASES)}): "
            "set model.attn_implementation=sdpa"
        )


def enable(model: torch.nn.Module, size: int) -> None:
    """Let ``model``'s attention take sequence shards (``check_model`` first): its attention
    implementation becomes ``grpo_fast_sp+grpo_fast_shared+<base>``, which behaves as the inner one
    for every call without a shard. Idempotent."""
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    check_model(model, size)
    if (model.config._attn_implementation or "").startswith(PREFIX):
        return
    shared_attention.enable(model)  # calls with a shared-prompt layout and no shard keep working
    inner = model.config._attn_implementation
    name = PREFIX + inner
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _wrapped(inner))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[inner])
    model.config._attn_implementation = name


def check_used(model: torch.nn.Module, shard) -> None:
    """After a sharded forward: every decoder layer's attention took the shard. A layer that does not
    pass its keyword arguments to the attention would have attended over this rank's tokens only."""
    config = getattr(model, "config", None)
    layers = getattr(getattr(config, "get_text_config", lambda: config)(), "num_hidden_layers", None)
    if shard.used == 0 or (layers is not None and shard.used != layers):
        raise ConfigError(
            f"train.sequence_parallel={shard.size}: {type(model).__name__}'s attention took the sequence shard in "
            f"{shard.used} of {layers if layers is not None else 'its'} layers (its layers do not pass their "
            "keyword arguments to transformers' attention interface): set train.sequence_parallel=1"
        )
