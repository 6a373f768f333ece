"""The one interface every rollout backend implements, what it returns, and how a backend module
declares itself to the registry (``BackendSpec``)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any, Protocol

import torch

from grpo_fast.rollout.trajectory import Group, Trajectory


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


class Rollout:
    """A batch of responses: P groups (``groups``), each a prompt and its trajectories; R = Σ
    group sizes responses, in group order.

    Built from groups (``Rollout(groups=[...])``, what the backends return), or, for a backend
    that returns flat lists of single-turn responses, from the lists this type always took:
    ``Rollout(prompt_ids, response_ids, response_text, finish_reason, sampler_logprobs,
    group_sizes, policy_version)``, prompt i owning the next ``group_sizes[i]`` responses (R / P
    each when None; texts default to "", finish reasons to "stop", versions to 0).

    Flat views, in group order: ``prompt_ids`` ``[P]``, ``trajectories`` / ``response_ids`` /
    ``response_text`` / ``finish_reason`` / ``policy_version`` ``[R]``, ``sampler_logprobs`` ``[R]``
    lists of ``[S_i]`` (None unless every response has them), ``sizes`` ``[P]``.
    """

    def __init__(
        self,
        prompt_ids: list[list[int]] | None = None,
        response_ids: list[list[int]] | None = None,
        response_text: list[str] | None = None,
        finish_reason: list[str] | None = None,
        sampler_logprobs: list[list[float]] | None = None,
        group_sizes: list[int] | None = None,
        policy_version: list[int] | None = None,
        *,
        groups: list[Group] | None = None,
    ):
        if groups is not None:
            if prompt_ids is not None or response_ids is not None:
                raise ValueError("Rollout takes groups or the flat lists, not both")
            self.groups = list(groups)
            return
        prompt_ids, response_ids = prompt_ids or [], response_ids or []
        r, p = len(response_ids), len(prompt_ids)
        response_text = [""] * r if response_text is None else response_text
        finish_reason = ["stop"] * r if finish_reason is None else finish_reason
        sizes = list(group_sizes) if group_sizes is not None else ([r // p] * p if p else [])
        lists_ok = len(response_text) == len(finish_reason) == r
        if not lists_ok or sum(sizes) != r or len(sizes) != p:
            raise ValueError(
                f"inconsistent rollout: {p} prompts (group sizes {group_sizes}), {r} responses, "
                f"{len(response_text)} texts, {len(finish_reason)} finish reasons"
            )
        if sampler_logprobs is not None and [len(x) for x in sampler_logprobs] != [
            len(x) for x in response_ids
        ]:
            raise ValueError("sampler_logprobs must have one log-prob per response token")
        if policy_version is not None and len(policy_version) != r:
            raise ValueError(f"{len(policy_version)} policy versions for {r} responses")
        self.groups, at = [], 0
        for prompt, n in zip(prompt_ids, sizes):
            rows = range(at, at + n)
            trajectories = [
                Trajectory(
                    prompt,
                    list(response_ids[i]),
                    sampler_logprobs=None if sampler_logprobs is None else list(sampler_logprobs[i]),
                    finish_reason=finish_reason[i],
                    text=response_text[i],
                    policy_version=0 if policy_version is None else policy_version[i],
                )
                for i in rows
            ]
            self.groups.append(Group(prompt, trajectories))
            at += n

    def __repr__(self) -> str:
        return (
            f"Rollout({len(self.groups)} groups of {self.sizes}, {self.num_response_tokens} response tokens)"
        )

    @property
    def trajectories(self) -> list[Trajectory]:
        """``[R]`` every response, in group order."""
        return [t for g in self.groups for t in g.trajectories]

    @property
    def prompt_ids(self) -> list[list[int]]:
        return [g.prompt_ids for g in self.groups]

    @property
    def response_ids(self) -> list[list[int]]:
        return [t.token_ids for t in self.trajectories]

    @property
    def response_text(self) -> list[str]:
        return [t.text for t in self.trajectories]

    @property
    def finish_reason(self) -> list[str]:
        return [t.finish_reason for t in self.trajectories]

    @property
    def sampler_logprobs(self) -> list[list[float]] | None:
        lps = [t.sampler_logprobs for t in self.trajectories]
        return None if any(x is None for x in lps) else lps

    @property
    def policy_version(self) -> list[int]:
        """``[R]`` the policy version that sampled each response (the oldest, when a weight push
        landed while it was sampled)."""
        return [t.policy_version for t in self.trajectories]

    @property
    def sizes(self) -> list[int]:
        """``[P]`` responses per prompt."""
        return [g.size for g in self.groups]

    @property
    def group_sizes(self) -> list[int] | None:
        """``[P]`` responses per prompt when they differ, else None (every group as large)."""
        sizes = self.sizes
        return None if len(set(sizes)) <= 1 else sizes

    @property
    def group_size(self) -> int:
        """The responses per prompt when every prompt has as many (ValueError otherwise)."""
        sizes = set(self.sizes)
        if len(sizes) > 1:
            raise ValueError(f"this rollout's group sizes differ: {self.sizes}")
        return sizes.pop() if sizes else 0

    @property
    def num_response_tokens(self) -> int:
        """Sampled and inserted tokens of every response."""
        return sum(t.num_tokens for t in self.trajectories)

    @property
    def num_sampled_tokens(self) -> int:
        return sum(t.num_sampled for t in self.trajectories)

    def response_prompt_ids(self) -> list[list[int]]:
        """``[R]``: the prompt each response answers."""
        return [g.prompt_ids for g in self.groups for _ in g.trajectories]

    def select_groups(self, groups: list[int]) -> Rollout:
        """The rollout of groups ``groups`` (indices into ``groups``), in that order (the same
        ``Group`` objects)."""
        return Rollout(groups=[self.groups[g] for g in groups])

    @staticmethod
    def concat(parts: list[Rollout]) -> Rollout:
        """One rollout of ``parts``' groups, in order."""
        return Rollout(groups=[g for p in parts for g in p.groups])


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
        groups.append(parts[n].groups[taken[n]])
        taken[n] += 1
    return Rollout(groups=groups)


class RolloutBackend(Protocol):
    """Generates responses with the policy version it was last given: everything the loop calls.

    Weights leave the trainer one way: ``stage(model)`` takes what a load needs of the trainer's
    weights now (``keep=True``: a host copy that stays valid while the trainer goes on — the
    pipeline stages each version and its producer loads it later; ``keep=False``: to be loaded at
    once, so a backend may read the trainer's tensors in place), then ``load_weights(staged,
    version)`` makes the backend serve them as policy version ``version`` (an engine apart is
    pushed and probed there: ``WeightSyncError`` when it serves something else, ``EngineError``
    when it died or timed out). ``sync_weights`` is both at once (lockstep, after every optimizer
    step). ``version``: the policy version served (``Trajectory.policy_version`` of what it
    samples; None before the first load). ``sleep()`` frees the backend's GPU memory before the
    training phase; ``close()`` stops what the backend started (a worker, an engine apart).
    """

    @property
    def version(self) -> int | None: ...

    def stage(self, model: torch.nn.Module, keep: bool = True) -> Any: ...

    def load_weights(self, staged: Any, version: int) -> None: ...

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        """Responses to ``prompt_ids``; ``progress(n)`` (optional) is called as prompts complete."""
        ...

    def sleep(self) -> None: ...

    def close(self) -> None: ...


def sync_weights(backend: RolloutBackend, model: torch.nn.Module, version: int) -> None:
    """``model``'s weights served by ``backend`` as policy version ``version`` now: staged to be
    loaded at once, then loaded (``RolloutBackend``)."""
    backend.load_weights(backend.stage(model, keep=False), version)


class WeightsFromStage:
    """``update_weights(model, step)``, the backends' older name for ``sync_weights``, kept for
    callers of it (one definition for every backend)."""

    def update_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        sync_weights(self, model, step)


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
    step: int = 0  # the policy's optimizer step (a resumed run's): the version of the first push
    warn: Any = None  # a warning line to the user (the run's logger), e.g. a fleet's engine going down


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
