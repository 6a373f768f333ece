"""The hf decoder's KV cache: transformers' ``DynamicCache`` with each full-attention layer's keys
and values written into buffers allocated once for the whole decode.

transformers' ``DynamicLayer`` concatenates every step (``torch.cat([keys, new])``): a decode of T
tokens copies the growing cache T times, O(T²) bytes. On the long-response workload (6 layers,
D = 512, 32 rows, 64 tokens after ~60 prompt tokens, 2 threads of an AMD EPYC) ``aten::cat`` was
10% of the decoder's time. ``PreallocatedLayer`` holds ``[B, KVH, capacity, D]`` buffers (capacity:
the prompt's width plus ``max_tokens``, known before the prefill) and writes each step's keys
and values into the next positions; its ``keys`` / ``values`` are views of the filled part, so
attention reads exactly what it read before. A multi-turn decode that outgrows the capacity (tool
output) doubles it. Sliding-window and other layer kinds keep transformers' own class.
"""

from __future__ import annotations

import torch


def _layer_class():
    from transformers.cache_utils import DynamicLayer

    class PreallocatedLayer(DynamicLayer):
        """A ``DynamicLayer`` whose keys/values ``[B, KVH, n, D]`` are views of preallocated
        ``[B, KVH, capacity, D]`` buffers (module docstring)."""

        def __init__(self, capacity: int):
            super().__init__()
            self.capacity = capacity
            self._k: torch.Tensor | None = None
            self._v: torch.Tensor | None = None
            self._n = 0

        def update(self, key_states, value_states, *args, **kwargs):
            if not self.is_initialized:
                self.lazy_initialization(key_states, value_states)
            n, add = self._n, key_states.shape[-2]
            if self._k is None or n + add > self._k.shape[-2]:
                self._allocate(key_states.shape[0], n + add, key_states, value_states)
            self._k[:, :, n : n + add].copy_(key_states)
            self._v[:, :, n : n + add].copy_(value_states)
            self._set_length(n + add)
            return self.keys, self.values

        def _allocate(self, batch: int, need: int, k_like: torch.Tensor, v_like: torch.Tensor) -> None:
            """New buffers of ``batch`` rows and room for at least ``need`` positions (twice the old
            room when outgrown), the filled part copied over."""
            room = 0 if self._k is None else self._k.shape[-2]
            cap = max(need, self.capacity, 2 * room if room < need else room)
            k = k_like.new_empty(batch, k_like.shape[1], cap, k_like.shape[3])
            v = v_like.new_empty(batch, v_like.shape[1], cap, v_like.shape[3])
            if self._n:
                k[:, :, : self._n].copy_(self.keys)
                v[:, :, : self._n].copy_(self.values)
            self._k, self._v = k, v

        def _set_length(self, n: int) -> None:
            self._n = n
            self.keys, self.values = self._k[:, :, :n], self._v[:, :, :n]

        def _rebuild(self, keys: torch.Tensor, values: torch.Tensor) -> None:
            n, self._n, self._k, self._v = keys.shape[-2], 0, None, None
            self._allocate(keys.shape[0], n, keys, values)
            self._k[:, :, :n].copy_(keys)
            self._v[:, :, :n].copy_(values)
            self._set_length(n)

        def batch_repeat_interleave(self, repeats: int) -> None:
            if self._n:
                self._rebuild(
                    self.keys.repeat_interleave(repeats, 0), self.values.repeat_interleave(repeats, 0)
                )

        def batch_select_indices(self, indices: torch.Tensor) -> None:
            if self._n:
                self._rebuild(self.keys[indices], self.values[indices])

        def crop(self, tokens_to_remove: int) -> None:
            if tokens_to_remove > 0:
                raise ValueError(f"crop takes a negative count of tokens to remove, not {tokens_to_remove}")
            if tokens_to_remove and self._n:
                self._set_length(max(self._n + tokens_to_remove, 0))

        def reset(self) -> None:
            super().reset()
            self._k = self._v = None
            self._n = 0

        def get_seq_length(self) -> int:
            return self._n

    return PreallocatedLayer


_CLASS = None


def decode_cache(model: torch.nn.Module, capacity: int):
    """A ``DynamicCache`` for ``model`` whose full-attention layers preallocate ``capacity``
    positions (``PreallocatedLayer``), or None where transformers builds no per-layer cache from
    the config (the forward then makes its own, as before)."""
    global _CLASS
    from transformers.cache_utils import DynamicCache, DynamicLayer

    if _CLASS is None:
        _CLASS = _layer_class()
    config = getattr(model, "config", None)
    if config is None:
        return None
    try:
        cache = DynamicCache(config=config)
    except (TypeError, ValueError, AttributeError, KeyError):  # a config transformers cannot lay out
        return None
    if not cache.layers:
        return None
    for i, layer in enumerate(cache.layers):
        if type(layer) is DynamicLayer:
            cache.layers[i] = _CLASS(capacity)
    return cache
