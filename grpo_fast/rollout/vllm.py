"""Rollouts with a colocated, in-process vLLM engine in sleep mode (one GPU, trainer beside it).

Each rollout, in the order every colocated framework uses (see shared/notes/vllm-colocate.md):

    empty the trainer's cache → wake weights → push the policy's weights (HF names, vLLM's
    ``load_weights`` fuses qkv / gate_up) → reset the prefix cache → wake the KV cache →
    generate (with the sampled tokens' post-temperature log-probs) → sleep

Never ``collective_rpc("reload_weights")`` after a push: it re-reads the checkpoint from disk
and silently discards training (TRL issue #5312).

Everything that touches vLLM lives in ``VLLMEngine`` below; ``VLLMBackend`` only orchestrates
and is tested on CPU against a fake engine with the same five methods (tests/test_rollout_vllm.py).
vLLM cannot be installed on the CPU machines; the ``gpu`` tests run it for real.
"""

from __future__ import annotations

import os
from collections.abc import Iterable
from typing import Any, Protocol

import torch

from grpo_fast.rollout.base import Rollout, SamplingParams


class Engine(Protocol):
    """The boundary with vLLM: the five things the backend needs from it."""

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[dict[str, Any]]]: ...

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None: ...

    def wake_up(self, tags: list[str]) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int) -> None: ...


class VLLMEngine:
    """A real ``vllm.LLM``, in-process, sleep mode on. Written against vLLM 0.10-0.11 (V1 engine).

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
        data_parallel: bool = False,
    ):
        # The V1 engine exposes its model to this process only without multiprocessing.
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        from vllm import LLM

        # Under torchrun, one engine per rank (tensor parallel 1) on this rank's GPU: the
        # external launcher makes vLLM join the existing process group instead of spawning
        # workers (LOCAL_RANK picks the device), as TRL's and verl's colocate modes do.
        extra = {"distributed_executor_backend": "external_launcher"} if data_parallel else {}
        self.llm = LLM(
            model=model_path,
            dtype=dtype,
            gpu_memory_utilization=gpu_memory_utilization,
            max_model_len=max_model_len,
            enable_sleep_mode=True,
            enable_prefix_caching=True,
            seed=seed,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
            tensor_parallel_size=1,
            **extra,
        )

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams) -> list[list[dict[str, Any]]]:
        from vllm import SamplingParams as VSP
        from vllm.inputs import TokensPrompt

        sp = VSP(
            n=params.n,
            temperature=params.temperature,
            top_p=params.top_p,
            max_tokens=params.max_tokens,
            min_tokens=params.min_tokens,
            stop=list(params.stop) or None,
            include_stop_str_in_output=True,
            logprobs=0,  # the sampled token's log-prob only
        )
        outs = self.llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompt_ids], sp, use_tqdm=False)
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
                    }
                )
            result.append(group)
        return result

    def load_weights(self, named_tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        # The one reach-in into vLLM internals (vLLM 0.10-0.11, V1 engine in-process): the
        # model object of the single worker. Its load_weights maps HF names onto vLLM's fused
        # qkv_proj / gate_up_proj and copies into the existing (woken) buffers.
        engine = self.llm.llm_engine
        executor = getattr(engine, "model_executor", None)
        if executor is None:  # newer layouts keep the executor inside the engine core
            executor = engine.engine_core.engine_core.model_executor
        executor.driver_worker.worker.model_runner.model.load_weights(weights=named_tensors)

    def wake_up(self, tags: list[str]) -> None:
        self.llm.wake_up(tags=tags)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()

    def sleep(self, level: int) -> None:
        self.llm.sleep(level=level)


class VLLMBackend:
    """Orchestrates one colocated engine: weight push, sleep/wake, outputs → ``Rollout``."""

    def __init__(self, engine: Engine, tokenizer, sleep_level: int = 1):
        self.engine = engine
        self.tokenizer = tokenizer
        self.sleep_level = sleep_level
        self.asleep = False
        self._pending_model: torch.nn.Module | None = None
        self.calls: list[str] = []  # the order of engine calls, for logs and tests

    def update_weights(self, model: torch.nn.Module) -> None:
        """Remember the model; its weights are pushed right before the next generate (weights awake, KV asleep)."""
        self._pending_model = model

    def sleep(self) -> None:
        if not self.asleep:
            self.engine.sleep(self.sleep_level)
            self.calls.append(f"sleep({self.sleep_level})")
            self.asleep = True

    def _wake_and_push(self) -> None:
        if torch.cuda.is_available():
            # Return the trainer's cached blocks to the driver so vLLM's pool can take them.
            # (Once per rollout, not in the training hot loop.)
            torch.cuda.empty_cache()
        if self.asleep:
            self.engine.wake_up(["weights"])
            self.calls.append("wake_up(weights)")
        if self._pending_model is not None:
            self.engine.load_weights(_hf_named_tensors(self._pending_model))
            self.calls.append("load_weights")
            self._pending_model = None
        elif self.asleep and self.sleep_level == 2:
            raise RuntimeError("vLLM slept at level 2 (weights discarded) and no weights were pushed")
        self.engine.reset_prefix_cache()  # cached prefixes were computed with the old weights
        self.calls.append("reset_prefix_cache")
        if self.asleep:
            self.engine.wake_up(["kv_cache"])
            self.calls.append("wake_up(kv_cache)")
        self.asleep = False

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        self._wake_and_push()
        groups = self.engine.generate(prompt_ids, params)
        self.calls.append("generate")
        if progress is not None:
            progress(len(prompt_ids))
        if len(groups) != len(prompt_ids) or any(len(g) != params.n for g in groups):
            raise RuntimeError(
                f"vLLM returned {[len(g) for g in groups]} responses for {len(prompt_ids)} prompts × {params.n}"
            )
        flat = [c for g in groups for c in g]
        logprobs = [c["logprobs"] for c in flat]
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=[c["token_ids"] for c in flat],
            response_text=[c["text"] for c in flat],
            finish_reason=[c["finish_reason"] for c in flat],
            sampler_logprobs=None if any(lp is None for lp in logprobs) else logprobs,
        )


def _hf_named_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The policy's tensors under their Hugging Face names, as views (no copy).

    vLLM's ``load_weights`` copies each into its own buffer, casting to its dtype (bf16), so
    the push needs no second copy of the model on the trainer's side.
    """
    model = getattr(model, "module", model)  # DDP
    for name, p in model.state_dict().items():
        yield name, p.detach()
