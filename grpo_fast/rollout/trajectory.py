"""One trajectory type from the sampler to the loss: ``Trajectory`` (one response), ``Group`` (a
prompt and its responses) and ``Rollout`` (a batch of groups).

A response is token ids with a role each (``Role``): ``SAMPLED`` tokens were drawn by the policy
(they are labels: a loss, a gradient, an entropy, a sampler log-prob), ``INSERTED`` tokens were put
there by an environment (a tool's output): context for the next turn, never a label. Today's
single-turn response is the special case of one sampled segment. Group structure lives on the
data (a ``Rollout`` is a list of ``Group``s); nothing downstream finds a response's prompt by
arithmetic.

Each stage fills its own fields: the backend the tokens, roles, sampler log-probs, turns, finish
reason, text and policy version; the rollout producer the scores (what the reward function
returned); the step's finalize the shaped reward and the advantage; the trainer the per-token
loss weights.

Example (a two-turn response: 3 sampled tokens, 2 inserted by a tool, 2 sampled):
    >>> t = Trajectory([5, 6], [7, 8, 9, 3, 4, 10, 2], roles=[1, 1, 1, 2, 2, 1, 1], turn_starts=[0, 5])
    >>> t.num_sampled, t.sampled_ids, t.label_positions
    (5, [7, 8, 9, 10, 2], [0, 1, 2, 5, 6])
"""

from __future__ import annotations

import enum
import itertools
from dataclasses import dataclass, field
from typing import Any

import torch


class Role(enum.IntEnum):
    """What a token is to the trainer."""

    PROMPT = 0  # the prompt: context
    SAMPLED = 1  # drawn by the policy: a label (loss, gradient, entropy, KL, length normalization)
    INSERTED = 2  # put there by an environment (a tool's output): context for the next turn only


@dataclass(eq=False)
class Trajectory:
    """One response to one prompt.

    Fields (T response tokens, S of them sampled):
        prompt_ids: ``[P]`` the prompt's token ids (the group's one list, not a copy).
        token_ids: ``[T]`` the response's token ids, sampled and inserted, in order (EOS
            included when sampled).
        roles: ``[T]`` ``Role.SAMPLED`` or ``Role.INSERTED`` per token; None = all sampled (a
            single-turn response; read through ``role_list``).
        sampler_logprobs: ``[S]`` the sampled tokens' log-probs under the distribution the
            sampler drew from (after temperature, top-k, top-p), or None (a backend without them).
        turn_starts: ``[K]`` where each of the K turns starts in ``token_ids`` (a turn: its
            sampled tokens, then what the environment inserted after them); ``[0]`` for one turn.
        finish_reason: ``"stop"`` (EOS or a stop string), ``"length"`` (rollout.max_tokens), or
            the name of the cap that ended it.
        text: the decoded response (special tokens skipped).
        policy_version: the optimizer steps the sampling weights had taken.
        scores: what the reward function returned (``reward``, ``answer_reward``, parts ...).
        correct: whether it solved its problem (``grpo_fast.task.rewards.correct`` of ``scores``,
            set with them).
        reward: the reward the advantage is computed from (the task reward plus any shaping).
        advantage: the response's advantage (a per-token estimator's: the mean of
            ``token_advantages``).
        token_advantages: ``[S]`` fp32, each sampled token's advantage when the estimator gives
            one per token (``loss.advantage=reinforce_pp``, ``reinforce_pp_baseline``); None =
            every sampled token has ``advantage`` (read through ``sampled_advantages``).
        token_values, token_returns: ``[S]`` fp32 with a value model (``loss.advantage=gae``): the
            value model's estimate at each sampled token when the advantages were computed, and
            its target (GAE with ``critic.lam``, plus that value); None without one.
        loss_weights: ``[S]`` fp32, each sampled token's loss weight (the length normalization):
            set on the trainer's copies (``grpo_fast.policy.batch.loss_trajectories``); None on a
            rollout's trajectories, which the step does not change after its finalize.
        tool_calls: ``[C]`` the tool calls the environment ran for this response, in order
            (``grpo_fast.rollout.multi_turn.ToolCallRecord``: request, what came back, whether it
            failed, its time); empty for a single-turn response.
        void_turns: turns that yielded neither a tool call nor an answer (only whitespace before
            EOS, or a stop string with no request; ``loss.mask_void_turns``).
    """

    prompt_ids: list[int]
    token_ids: list[int]
    roles: list[int] | None = None
    sampler_logprobs: list[float] | None = None
    turn_starts: list[int] = field(default_factory=lambda: [0])
    finish_reason: str = "stop"
    text: str = ""
    policy_version: int = 0
    scores: dict[str, Any] = field(default_factory=dict)
    correct: float = 0.0
    reward: float = 0.0
    advantage: float = 0.0
    token_advantages: torch.Tensor | None = None
    token_values: torch.Tensor | None = None
    token_returns: torch.Tensor | None = None
    loss_weights: torch.Tensor | None = None
    tool_calls: list[Any] = field(default_factory=list)
    void_turns: int = 0

    def __post_init__(self) -> None:
        t = len(self.token_ids)
        if self.roles is not None:
            if len(self.roles) != t:
                raise ValueError(f"Trajectory.roles has {len(self.roles)} entries for {t} tokens")
            if any(r not in (Role.SAMPLED, Role.INSERTED) for r in self.roles):
                raise ValueError("a response token's role is SAMPLED or INSERTED")
            if self.roles and self.roles[0] != Role.SAMPLED:
                raise ValueError("a response starts with a sampled token")
            if all(r == Role.SAMPLED for r in self.roles):
                self.roles = None  # one sampled segment: the single-turn form
        s = self.num_sampled
        if self.sampler_logprobs is not None and len(self.sampler_logprobs) != s:
            raise ValueError(
                f"Trajectory.sampler_logprobs has {len(self.sampler_logprobs)} entries for {s} sampled tokens"
            )
        for name in ("token_advantages", "token_values", "token_returns"):
            x = getattr(self, name)
            if x is not None and tuple(x.shape) != (s,):
                raise ValueError(f"Trajectory.{name} has shape {tuple(x.shape)}, expected ({s},)")
        if self.loss_weights is not None and tuple(self.loss_weights.shape) != (s,):
            raise ValueError(
                f"Trajectory.loss_weights has shape {tuple(self.loss_weights.shape)}, expected ({s},)"
            )
        starts = self.turn_starts
        if (
            not starts
            or starts[0] != 0
            or any(b <= a for a, b in itertools.pairwise(starts))
            or starts[-1] > max(t - 1, 0)
        ):
            raise ValueError(f"Trajectory.turn_starts {starts} is not increasing from 0 within {t} tokens")

    @property
    def num_tokens(self) -> int:
        """T: sampled and inserted tokens."""
        return len(self.token_ids)

    @property
    def num_sampled(self) -> int:
        """S: the tokens that are labels."""
        if self.roles is None:
            return len(self.token_ids)
        return sum(1 for r in self.roles if r == Role.SAMPLED)

    @property
    def sampled_advantages(self) -> torch.Tensor:
        """``[S]`` fp32: each sampled token's advantage (``token_advantages``, else ``advantage``
        on every one)."""
        if self.token_advantages is not None:
            return self.token_advantages
        return torch.full((self.num_sampled,), self.advantage, dtype=torch.float32)

    @property
    def num_inserted(self) -> int:
        return self.num_tokens - self.num_sampled

    @property
    def role_list(self) -> list[int]:
        """``[T]`` the role of every response token."""
        return [Role.SAMPLED] * len(self.token_ids) if self.roles is None else list(self.roles)

    @property
    def label_positions(self) -> list[int]:
        """``[S]`` the positions in ``token_ids`` of the sampled tokens."""
        if self.roles is None:
            return list(range(len(self.token_ids)))
        return [i for i, r in enumerate(self.roles) if r == Role.SAMPLED]

    @property
    def sampled_ids(self) -> list[int]:
        """``[S]`` the sampled tokens: the labels."""
        if self.roles is None:
            return list(self.token_ids)
        return [x for x, r in zip(self.token_ids, self.roles) if r == Role.SAMPLED]

    @property
    def num_turns(self) -> int:
        return len(self.turn_starts)

    @classmethod
    def single_turn(
        cls,
        prompt_ids: list[int],
        response_ids: list[int],
        *,
        advantage: float = 0.0,
        loss_weight: float | None = None,
        sampler_logprobs: list[float] | None = None,
        **fields,
    ) -> Trajectory:
        """A response that is one sampled segment (every token a label); ``loss_weight``: the same
        weight for each of its tokens (None: not set yet)."""
        weights = None if loss_weight is None else torch.full((len(response_ids),), float(loss_weight))
        return cls(
            prompt_ids,
            list(response_ids),
            sampler_logprobs=sampler_logprobs,
            advantage=advantage,
            loss_weights=weights,
            **fields,
        )


@dataclass(eq=False)
class Group:
    """A prompt and its responses (the GRPO group), with the task example it came from.

    Fields:
        prompt_ids: ``[P]`` the prompt's token ids.
        trajectories: ``[n]`` its responses (``n`` may differ between groups:
            ``rollout.adaptive_group_size``).
        example: the task example (question, answer), or None where the caller has none.
        example_index: its index in the task's training set, or None.
    """

    prompt_ids: list[int]
    trajectories: list[Trajectory]
    example: Any = None
    example_index: int | None = None

    def __post_init__(self) -> None:
        for t in self.trajectories:
            t.prompt_ids = self.prompt_ids  # one list for the group

    @property
    def size(self) -> int:
        return len(self.trajectories)
