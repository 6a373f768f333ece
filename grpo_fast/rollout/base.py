"""The one interface every rollout backend implements, what it returns, and how a backend module
declares itself to the registry (``BackendSpec``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

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
    # top-k sampling (0 = off), applied after the temperature and before top_p (vLLM, transformers)
    top_k: int = 0


@dataclass
class Rollout:
    """Responses to P prompts, grouped consecutively: prompt i owns the next ``sizes[i]`` rows
    (``n`` each, unless ``group_sizes`` says otherwise: ``rollout.adaptive_group_size``).

    Fields (R = Σ sizes responses):
        prompt_ids: ``[P]`` lists of prompt token ids.
        response_ids: ``[R]`` lists of the sampled token ids (EOS included when sampled).
        response_text: ``[R]`` decoded responses (special tokens skipped).
        finish_reason: ``[R]`` ``"stop"`` (EOS or a stop string) or ``"length"``.
        sampler_logprobs: ``[R]`` lists of per-token log-probs from the sampler (after
            temperature), or None when the backend does not provide them (hf).
        group_sizes: ``[P]`` responses per prompt, or None: R / P each.
    """

    prompt_ids: list[list[int]]
    response_ids: list[list[int]]
    response_text: list[str]
    finish_reason: list[str]
    sampler_logprobs: list[list[float]] | None = None
    group_sizes: list[int] | None = None

    def __post_init__(self) -> None:
        r = len(self.response_ids)
        uneven = self.group_sizes is None and r % max(len(self.prompt_ids), 1)
        bad_sizes = self.group_sizes is not None and (
            len(self.group_sizes) != len(self.prompt_ids) or sum(self.group_sizes) != r
        )
        if not (len(self.response_text) == len(self.finish_reason) == r) or uneven or bad_sizes:
            raise ValueError(
                f"inconsistent rollout: {len(self.prompt_ids)} prompts (group sizes {self.group_sizes}), "
                f"{r} responses, {len(self.response_text)} texts, {len(self.finish_reason)} finish reasons"
            )
        if self.sampler_logprobs is not None and [len(x) for x in self.sampler_logprobs] != [
            len(x) for x in self.response_ids
        ]:
            raise ValueError("sampler_logprobs must have one log-prob per response token")

    @property
    def sizes(self) -> list[int]:
        """``[P]`` responses per prompt."""
        if self.group_sizes is not None:
            return list(self.group_sizes)
        return (
            [len(self.response_ids) // len(self.prompt_ids)] * len(self.prompt_ids) if self.prompt_ids else []
        )

    @property
    def group_size(self) -> int:
        """The responses per prompt when every prompt has as many (ValueError otherwise)."""
        sizes = set(self.sizes)
        if len(sizes) > 1:
            raise ValueError(f"this rollout's group sizes differ: {self.sizes}")
        return sizes.pop() if sizes else 0

    @property
    def num_response_tokens(self) -> int:
        return sum(len(x) for x in self.response_ids)

    def response_prompt_ids(self) -> list[list[int]]:
        """``[R]``: the prompt each response answers."""
        return [p for p, n in zip(self.prompt_ids, self.sizes) for _ in range(n)]

    def select_groups(self, groups: list[int]) -> Rollout:
        """The rollout of prompts ``groups`` (indices into ``prompt_ids``) and their responses, in that order."""
        starts = [0]
        for n in self.sizes:
            starts.append(starts[-1] + n)
        rows = [i for g in groups for i in range(starts[g], starts[g + 1])]
        pick = lambda xs: None if xs is None else [xs[i] for i in rows]
        return Rollout(
            prompt_ids=[self.prompt_ids[g] for g in groups],
            response_ids=pick(self.response_ids),
            response_text=pick(self.response_text),
            finish_reason=pick(self.finish_reason),
            sampler_logprobs=pick(self.sampler_logprobs),
            group_sizes=[self.sizes[g] for g in groups] if self.group_sizes is not None else None,
        )

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """One rollout of ``parts``' prompts and responses, in order (group sizes kept)."""
        cat = lambda name: [x for p in parts for x in getattr(p, name)]
        sizes = [n for p in parts for n in p.sizes]
        slp = None if any(p.sampler_logprobs is None for p in parts) else cat("sampler_logprobs")
        return Rollout(
            prompt_ids=cat("prompt_ids"),
            response_ids=cat("response_ids"),
            response_text=cat("response_text"),
            finish_reason=cat("finish_reason"),
            sampler_logprobs=slp,
            group_sizes=None if len(set(sizes)) <= 1 else sizes,
        )


def generate_groups(
    backend, prompt_ids: list[list[int]], sizes: list[int], params: SamplingParams, progress=None
) -> Rollout:
    """Prompt i's ``sizes[i]`` responses (``rollout.adaptive_group_size``), from one ``generate``
    call per distinct size (each with a seed of its own, derived from ``params.seed``); with one
    size this is ``backend.generate(prompt_ids, replace(params, n=size))``."""
    if len(sizes) != len(prompt_ids):
        raise ValueError(f"{len(sizes)} group sizes for {len(prompt_ids)} prompts")
    distinct = sorted(set(sizes))
    if len(distinct) == 1:
        return backend.generate(prompt_ids, replace(params, n=distinct[0]), progress=progress)
    parts: dict[int, Rollout] = {}
    for n in distinct:
        seed = None if params.seed is None else (params.seed + 7919 * n) % 2**31
        which = [p for p, k in zip(prompt_ids, sizes) if k == n]
        parts[n] = backend.generate(which, replace(params, n=n, seed=seed), progress=progress)
    taken = dict.fromkeys(distinct, 0)  # groups of each size used so far
    groups = []
    for n in sizes:
        groups.append(parts[n].select_groups([taken[n]]))
        taken[n] += 1
    out = Rollout.concat(groups)
    if out.group_sizes is None:  # concat drops uniform sizes; these differ by construction
        out.group_sizes = list(sizes)
    return out


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


@dataclass
class BackendContext:
    """What a backend is built from: the run's config and policy, and for a backend with its own
    weights (``needs_weight_push``) the folder it starts from, a ready engine to use instead
    (tests pass a fake one), and the weight-sync probe run after every push."""

    cfg: Any
    model: Any
    tokenizer: Any
    device: Any
    amp: Any = None
    engine: Any = None
    model_path: str | None = None
    probe: Any = None


@dataclass(frozen=True)
class BackendSpec:
    """One rollout backend: ``build(ctx) -> RolloutBackend`` with the current policy loaded.

    ``check_config(cfg)`` raises ``ConfigError`` for a value of a key this backend owns (e.g.
    ``rollout.vllm_kwargs``); ``grpo_fast.config.validate`` runs every backend's, whichever is
    chosen, so that a config file stays valid when the backend is switched. ``missing()`` returns
    None when the backend can run on this machine, else the one-line reason and fix (checked
    with the device, and by ``grpo-fast doctor``).
    """

    name: str
    summary: str
    build: Callable[[BackendContext], Any]
    needs_weight_push: bool = False
    sampler_logprobs: bool = False
    sleep_mode: bool = False
    check_config: Callable[[Any], None] = field(default=lambda cfg: None)
    missing: Callable[[], str | None] = field(default=lambda: None)
