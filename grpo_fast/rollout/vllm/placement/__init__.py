"""Where a vLLM engine runs (``rollout.placement``), each placement a module of its own, and the
boundary every one of them meets (``Engine``), which ``VLLMBackend``
(``grpo_fast.rollout.vllm.backend``) drives:

- ``colocated.py``: ``VLLMEngine``, a ``vllm.LLM`` in the trainer's process (``colocated``);
- ``process.py``: ``ProcessEngine``, vLLM's ``AsyncLLM`` with its engine core in a child process
  (``process``);
- ``server.py``: ``ServerEngine``, a vLLM server the run starts or attaches to, over HTTP
  (``server``);
- ``apart.py``: which engine apart from the trainer a run gets (``engine_apart``), and under
  torchrun the one server every rank shares (``shared_server``), whose pushes ``ranks.py``
  (``RankShare``) makes the leader's alone;
- ``shared.py``: what the placements share (the sampling fields and per-request seeds, the LoRA
  rank slot, the engine's logging level; for the engines apart: the devices of the child, the
  policy versions of an output, the LoRA adapter slots).

How weights reach an engine is ``grpo_fast.rollout.vllm.transfer``'s.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any, Protocol

import torch

from grpo_fast.rollout.base import SamplingParams


class Engine(Protocol):
    """The boundary with vLLM: what the backend needs from it.

    ``generate`` returns, per prompt, ``n`` dicts with ``token_ids``, ``text``,
    ``finish_reason``, ``logprobs`` and, where the engine knows it, ``version``: the policy
    version (``load_weights``' ``version``) that sampled the response (the oldest one when an
    update landed while it was sampled; the engines apart add ``versions``, all of them). ``concurrent_updates``: ``load_weights`` may run while
    a ``generate`` is in flight (engines apart from the trainer); else the backend serializes them.
    """

    supports_sleep: bool

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[dict[str, Any]]]:
        """Per prompt, ``n`` dicts (``token_ids``, ``text``, ``finish_reason``, ``logprobs``);
        ``params`` one for all prompts (prompt j's samples seeded ``seed + j·n + k``) or one per
        prompt (its own ``seed``)."""
        ...

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]: ...

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None: ...

    def load_adapter(self, folder: str, version: int | None = None) -> None: ...

    def wake_up(self, tags: list[str]) -> None: ...

    def reset_prefix_cache(self) -> None: ...

    def sleep(self, level: int) -> None: ...
