"""The hf decoder's attention for a decode step on a CPU: one new token a row against the cache.

torch's CPU ``scaled_dot_product_attention`` spends its time on per-(row, head) tasks when each has
one query: for the tiny preset's decode step (256 rows, 4 query heads over 2 KV heads, ~20 cached
positions, head size 32) it takes 1.36 ms a layer where two batched matmuls and a softmax take
0.30 ms (4.5x), and on a mid-size step (32 rows, 8 heads over 4, 300 positions, 64) 1.46 against
0.96 ms (torch 2.13, 2 threads of an AMD EPYC; ``bench/test_bench_rollout.py``). So while the hf
decoder generates (``decode_steps``), the model's attention implementation becomes
``grpo_fast_decode+<its own>``, which computes a one-query step as

    scores [B·KVH, G, K] = q [B·KVH, G, D] @ k [B·KVH, K, D]ᵀ · scaling   (G = H / KVH queries a KV head)
    out    [B·KVH, G, D] = softmax(scores masked, fp32) @ v [B·KVH, K, D]

and hands every other call (the prefill, a multi-turn block of inserted tokens, anything with an
argument it does not model) to the model's own implementation unchanged. Only on a CPU and only
over ``sdpa`` or ``eager`` (their masks: bool, True = attend, or additive float; ``[B, 1, 1, K]``
for one query). Computed in fp32 whatever the inputs (bf16 ones upcast, the output cast back):
against a float64 reference its error is sdpa's in fp32 and below sdpa's in bf16
(tests/test_rollout_hf.py). Training never sees it: the name is restored when generation returns.
"""

from __future__ import annotations

import contextlib
import sys

import torch

PREFIX = "grpo_fast_decode+"
BASES = ("sdpa", "eager")  # the innermost implementations whose masks the one-query path reads
# arguments that change what attention computes; a call that carries one goes to the base
_UNMODELLED = ("softcap", "s_aux", "position_bias", "shared_prompt_layout", "output_attentions")


def one_query_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, mask: torch.Tensor | None, scaling: float
) -> torch.Tensor:
    """Attention of one query a row: ``query [B, H, 1, D]``, ``key``/``value [B, KVH, K, D]`` (H a
    multiple of KVH: grouped queries share their KV head), ``mask`` None, bool (True = attend) or
    additive float, broadcastable to ``[B, 1, 1, K]``. Returns ``[B, 1, H, D]`` in ``value``'s
    dtype (transformers' attention output layout)."""
    b, h, _, d = query.shape
    kvh, k = key.shape[1], key.shape[2]
    g = h // kvh
    # fp32 throughout (bf16 inputs upcast; autocast would lower the matmuls back to bf16)
    with torch.autocast(query.device.type, enabled=False):
        q = query.float().reshape(b * kvh, g, d)
        scores = torch.bmm(q, key.float().reshape(b * kvh, k, d).transpose(1, 2)).view(b, kvh, g, k)
        scores = scores * scaling
        if mask is not None:
            m = mask.reshape(mask.shape[0], 1, 1, k)
            scores = scores.masked_fill(~m, float("-inf")) if m.dtype == torch.bool else scores + m.float()
        out = torch.bmm(scores.softmax(-1).view(b * kvh, g, k), value.float().reshape(b * kvh, k, d))
    return out.to(value.dtype).view(b, h, 1, d).transpose(1, 2)


def _takes_one_query(query, key, attention_mask, dropout: float, kwargs: dict) -> bool:
    if query.shape[2] != 1 or query.device.type != "cpu" or dropout:
        return False
    if query.shape[1] % key.shape[1] or any(kwargs.get(name) is not None for name in _UNMODELLED):
        return False
    if attention_mask is None:
        return True
    return (
        attention_mask.dim() == 4
        and attention_mask.shape[1:3] == (1, 1)
        and attention_mask.shape[-1] == key.shape[2]
    )


def _wrapped(base: str):
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    def forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        if _takes_one_query(query, key, attention_mask, dropout, kwargs):
            scale = scaling if scaling is not None else query.shape[-1] ** -0.5
            return one_query_attention(query, key, value, attention_mask, scale), None
        # eager is the model's own function (every modeling file defines eager_attention_forward)
        fn = (
            sys.modules[type(module).__module__].eager_attention_forward
            if base == "eager"
            else ALL_ATTENTION_FUNCTIONS[base]
        )
        return fn(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)

    return forward


def _innermost(name: str) -> str:
    """The base under grpo_fast's wrappers (``grpo_fast_shared+sdpa`` -> ``sdpa``)."""
    return name.rsplit("+", 1)[-1]


@contextlib.contextmanager
def decode_steps(model: torch.nn.Module):
    """While inside: ``model``'s one-query attention calls take ``one_query_attention`` (module
    docstring), when the model is on a CPU, dispatches through transformers' attention interface
    and its base is ``sdpa`` or ``eager``; otherwise nothing changes. The implementation's name is
    restored on the way out, an exception included."""
    config = getattr(model, "config", None)
    current = getattr(config, "_attn_implementation", None) or ""
    base = model.get_base_model() if hasattr(model, "get_base_model") else model  # under peft
    param = next(model.parameters(), None)
    if (
        param is None
        or param.device.type != "cpu"
        or PREFIX in current
        or _innermost(current) not in BASES
        or not getattr(base, "_supports_attention_backend", False)
    ):
        yield
        return
    from transformers import AttentionInterface
    from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface

    name = PREFIX + current
    if name not in AttentionInterface._global_mapping:
        AttentionInterface.register(name, _wrapped(current))
        AttentionMaskInterface.register(name, ALL_MASK_ATTENTION_FUNCTIONS[current])
    config._attn_implementation = name
    try:
        yield
    finally:
        config._attn_implementation = current
