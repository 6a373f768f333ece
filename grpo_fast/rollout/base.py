"""The one interface every rollout backend implements, and what it returns."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass(frozen=True)
class SamplingParams:
    """How to sample. ``temperature == 0`` means greedy (then ``n`` must be 1)."""

    n: int  # responses per prompt (the GRPO group size)
    temperature: float
    top_p: float
    max_tokens: int
    min_tokens: int
    stop: tuple[str, ...] = ()  # stop strings, kept at the end of the response
    # Sampling seed of this call (vllm: prompt j's k-th sample uses seed + j·n + k), or None for
    # the engine's own stream. The loop passes one per (run seed, step, rank): exact resume.
    seed: int | None = None


@dataclass
class Rollout:
    """Responses to P prompts, ``n`` each, grouped consecutively (prompt i owns rows i·n … i·n+n−1).

    Fields (R = P·n responses):
        prompt_ids: ``[P]`` lists of prompt token ids.
        response_ids: ``[R]`` lists of the sampled token ids (EOS included when sampled).
        response_text: ``[R]`` decoded responses (special tokens skipped).
        finish_reason: ``[R]`` ``"stop"`` (EOS or a stop string) or ``"length"``.
        sampler_logprobs: ``[R]`` lists of per-token log-probs from the sampler (after
            temperature), or None when the backend does not provide them (hf).
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    sampler_logprobs: list[list[float]] | None = None

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        if not (len(self.response_text) == len(self.finish_reason) == r) or r % max(len(self.prompt_ids), 1):
            raise ValueError(
                f"inconsistent rollout: {len(self.prompt_ids)} prompts, {r} responses, "
                f"{len(self.response_text)} texts, {len(self.finish_reason)} finish reasons"
            )
        if self.sampler_logprobs is not None and [len(x) for x in self.sampler_logprobs] != [
            len(x) for x in self.response_ids
        ]:
            raise ValueError("sampler_logprobs must have one log-prob per response token")

    @property
    def group_size(self) -> int:
        return len(self.response_ids) // len(self.prompt_ids)

    @property
    def num_response_tokens(self) -> int:
        return sum(len(x) for x in self.response_ids)


class RolloutBackend(Protocol):
    """Generates responses with the *current* policy.

    The loop calls ``update_weights(model, step)`` after every optimizer step that changed the
    policy (a no-op when the backend samples from the training model itself), then
    ``generate``. ``sleep()`` frees the backend's GPU memory before the training phase.
    """

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        """Responses to ``prompt_ids``; ``progress(n)`` (optional) is called as prompts complete."""
        ...

    def update_weights(self, model: torch.nn.Module, step: int = 0) -> None: ...

    def sleep(self) -> None: ...
