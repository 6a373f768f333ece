"""A task as the loop sees it: train/eval examples, the prompt template, stop strings, the reward.

``data.task`` picks the data (``math``, ``gsm8k`` through ``grpo_fast.data``; ``tiny`` built in),
``data.prompt_template`` the prompt, ``data.reward`` the reward function: a registered name
(``auto`` = the task's own: ``math`` → ``r1_zero``, ``gsm8k`` → ``gsm8k``, ``tiny`` → ``tiny``)
or ``package.module:function`` for one of your own.
"""

from __future__ import annotations

import importlib
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from grpo_fast import tiny
from grpo_fast.config import AUTO, Config
from grpo_fast.data import Example, load_examples
from grpo_fast.errors import ConfigError
from grpo_fast.prompts import get_template
from grpo_fast.rewards import GuardedReward, get_reward_fn

DEFAULT_REWARD = {"math": "r1_zero", "gsm8k": "gsm8k", "tiny": "tiny"}
EVAL_SPLIT = {"math": "test", "gsm8k": "test"}


@dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    template: str
    stop: list[str]
    reward_fn: GuardedReward  # the data.reward function behind data.reward_errors' guard
    tokenizer: object
    max_prompt_tokens: int
    _ids: dict[str, list[int]] = field(default_factory=dict, repr=False)

    def prompt_text(self, ex: Example) -> str:
        return get_template(self.template).format(ex.question)

    def prompt_ids(self, ex: Example) -> list[int]:
        """Token ids of the prompt, left-truncated to ``rollout.max_prompt_tokens`` (cached)."""
        ids = self._ids.get(ex.question)
        if ids is None:
            ids = self.tokenizer(self.prompt_text(ex))["input_ids"]
            if len(ids) > self.max_prompt_tokens:
                warnings.warn(
                    f"a prompt of {len(ids)} tokens was left-truncated to rollout.max_prompt_tokens="
                    f"{self.max_prompt_tokens}",
                    stacklevel=2,
                )
                ids = ids[-self.max_prompt_tokens :]
            self._ids[ex.question] = ids
        return ids

    def eval_subset(self, size: int, seed: int) -> list[Example]:
        """A fixed random subset of the eval set (the same for every step and every resume)."""
        if size >= len(self.eval):
            return list(self.eval)
        return random.Random(seed).sample(self.eval, size)


def load_task(cfg: Config, tokenizer=None) -> Task:
    """The task of ``cfg`` with its examples loaded and checked. ``tokenizer`` may be attached
    later (``task.tokenizer = ...``): prompts are tokenized on first use."""
    d = cfg.data
    if d.task == "tiny":
        # Local files override the built-in problems: JSONL/Parquet with question and a bare answer.
        train = (
            load_examples("gsm8k", d.train_path, question_field=d.question_field, answer_field=d.answer_field)
            if d.train_path
            else tiny.examples("train")
        )
        evals = (
            load_examples("gsm8k", d.eval_path, question_field=d.question_field, answer_field=d.answer_field)
            if d.eval_path
            else tiny.examples("eval")
        )
    else:
        common = dict(question_field=d.question_field, answer_field=d.answer_field, hub_name=d.hub_name)
        train = load_examples(d.task, d.train_path, split="train", **common)
        evals = load_examples(d.task, d.eval_path, split=EVAL_SPLIT[d.task], **common)
    template = get_template(d.prompt_template)
    reward = DEFAULT_REWARD[d.task] if d.reward == AUTO else d.reward
    if ":" in reward:  # "package.module:function": import it (its @register_reward runs too)
        reward_fn = _import_reward(reward)
    else:
        reward_fn = get_reward_fn(reward)
    reward_fn = GuardedReward(reward_fn, reward, on_error=d.reward_errors)
    return Task(
        name=d.task,
        train=train,
        eval=evals,
        template=d.prompt_template,
        stop=list(template.stop),
        reward_fn=reward_fn,
        tokenizer=tokenizer,
        max_prompt_tokens=cfg.rollout.max_prompt_tokens,
    )


def _import_reward(spec: str) -> Callable[[str, str], dict[str, float]]:
    """``"package.module:function"`` → the function (a user's reward, no registration needed)."""
    module_name, _, attr = spec.partition(":")
    try:
        fn = getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"data.reward={spec!r}: cannot import it ({exc})") from None
    if not callable(fn):
        raise ConfigError(f"data.reward={spec!r} is not a function")
    return fn
