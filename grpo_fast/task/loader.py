"""A task as the loop sees it: train/eval examples, the prompt template, stop strings, the reward.

``data.task`` picks the task (a module of ``grpo_fast.task`` declaring ``TASK``, found by
``grpo_fast.task.registry``: ``math``, ``gsm8k``, ``tiny`` built in) and so its data,
``data.prompt_template`` the prompt, ``data.reward`` the reward function: a registered name
(``auto`` = the task's own, ``TaskSpec.reward``: ``math`` → ``r1_zero``, ``gsm8k`` → ``gsm8k``)
or ``package.module:function`` for one of your own; or a list of them with
``data.reward_weights``, summed by ``grpo_fast.task.rewards.WeightedReward``.
"""

from __future__ import annotations

import dataclasses
import importlib
import random
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field

from grpo_fast.config import AUTO, Config
from grpo_fast.errors import ConfigError, DataError, shown
from grpo_fast.task import eval_sets
from grpo_fast.task.data import Example, TaskSpec, load_examples
from grpo_fast.task.prompts import PLACEHOLDER, PromptTemplate, get_template
from grpo_fast.task.registry import task as task_spec
from grpo_fast.task.rewards import GuardedReward, WeightedReward, get_reward_fn


@dataclass
class Task:
    name: str
    train: list[Example]
    eval: list[Example]
    template: str
    stop: list[str]
    # the data.reward function(s) behind data.reward_errors' guard; several: their weighted sum
    reward_fn: GuardedReward | WeightedReward
    tokenizer: object
    max_prompt_tokens: int
    _ids: dict[str, list[int]] = field(default_factory=dict, repr=False)
    _longest_token: int = field(default=0, repr=False)  # characters of the vocabulary's longest token

    def prompt_text(self, ex: Example) -> str:
        return get_template(self.template).format(ex.question)

    def prompt_ids(self, ex: Example) -> list[int]:
        """Token ids of the prompt, left-truncated to ``rollout.max_prompt_tokens`` (cached). A
        prompt far longer than that (more characters than ``max_prompt_tokens + 16`` of the
        vocabulary's longest tokens) is cut to its end before it is tokenized: bounded memory
        and time whatever a data line holds."""
        ids = self._ids.get(ex.question)
        if ids is None:
            text = self.prompt_text(ex)
            if not self._longest_token:
                self._longest_token = max(map(len, self.tokenizer.get_vocab()), default=1)
            cut = len(text) - (self.max_prompt_tokens + 16) * self._longest_token
            ids = self.tokenizer(text[cut:] if cut > 0 else text)["input_ids"]
            if len(ids) > self.max_prompt_tokens:
                size = f"{len(text):,} characters" if cut > 0 else f"{len(ids)} tokens"
                warnings.warn(
                    f"a prompt of {size} was left-truncated to rollout.max_prompt_tokens="
                    f"{self.max_prompt_tokens}",
                    stacklevel=2,
                )
                ids = ids[-self.max_prompt_tokens :]
            self._ids[ex.question] = ids
        return ids

    @property
    def reward_parts(self) -> list[str]:
        """The names NAME of a weighted reward's parts (each score holds ``"reward/NAME"``, the
        loop logs ``train/reward/NAME``); empty for a single reward function."""
        return list(self.reward_fn.names) if isinstance(self.reward_fn, WeightedReward) else []

    def solution_text(self, ex: Example) -> str | None:
        """The response that would solve ``ex`` in the format the reward expects (the target of
        ``sft.mix_coef``), or None when ``ex`` has no ground-truth solution.

        With ``r1_zero`` the prompt ends inside ``<think>``: the worked solution is the reasoning,
        then the answer, ``" {solution} </think> <answer> {answer} </answer>"``; with other
        templates the solution text itself.

        Example:
            ``Example("1+1?", "2", solution="One plus one is 2.")`` under ``r1_zero``:
            ``" One plus one is 2. </think> <answer> 2 </answer>"``.
        """
        if ex.solution is None:
            return None
        if self.template == "r1_zero":
            return f" {ex.solution.strip()} </think> <answer> {ex.answer} </answer>"
        return ex.solution

    def warm_start_text(self, ex: Example) -> str:
        """What the SFT warm start trains on for ``ex``: its answer, or for a task whose
        ``TaskSpec.warm_start`` is ``"solution"`` its worked solution (``tiny_tools``: a
        demonstration, the tool's output left for the rollout's environment to insert)."""
        if task_spec(self.name).warm_start == "solution" and ex.solution is not None:
            return ex.solution
        return ex.answer

    def eval_subset(self, size: int, seed: int) -> list[Example]:
        """A fixed random subset of the eval set (the same for every step and every resume)."""
        if size >= len(self.eval):
            return list(self.eval)
        return random.Random(seed).sample(self.eval, size)


def load_task(cfg: Config, tokenizer=None) -> Task:
    """The task of ``cfg`` with its examples loaded and checked. ``tokenizer`` may be attached
    later (``task.tokenizer = ...``): prompts are tokenized on first use."""
    d = cfg.data
    fields = dict(
        question_field=d.question_field,
        answer_field=d.answer_field,
        solution_field=d.solution_field,
        difficulty_field=d.difficulty_field,
    )
    spec = task_spec(d.task)
    # a data file replaces the task's own problems (or its Hub dataset) for that split only: the
    # evaluation stays on the built-in problems / the Hub's test split unless data.eval_path is given
    alphabet = spec.alphabet(cfg.model.name_or_path) if spec.alphabet is not None else None
    train = _examples(spec, d.train_path, "train", dict(fields, alphabet=alphabet), d.hub_name)
    evals = _examples(spec, d.eval_path, "eval", dict(fields, alphabet=alphabet), d.hub_name)
    template = get_template(d.prompt_template)
    if alphabet is not None:
        _check_template_alphabet(d.prompt_template, template, alphabet)
    if isinstance(d.reward, str):
        reward_fn = _guarded_reward(d.reward, d.task, d.reward_errors)
    else:
        parts = [_guarded_reward(spec, d.task, d.reward_errors) for spec in d.reward]
        names = [p.name.rpartition(":")[2] for p in parts]  # "pkg.mod:bonus" is logged as bonus
        repeated = sorted({n for n in names if names.count(n) > 1})
        if repeated:
            raise ConfigError(f"data.reward={list(d.reward)} names the reward {repeated[0]!r} twice")
        reward_fn = WeightedReward(parts, d.reward_weights, names=names)
    if cfg.sft.mix_coef > 0 and not any(ex.solution is not None for ex in train):
        raise ConfigError(
            f"sft.mix_coef={cfg.sft.mix_coef} needs ground-truth solutions, and no training example "
            "has one: name the field with data.solution_field"
        )
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


def _check_template_alphabet(asked: str, template: PromptTemplate, alphabet: str) -> None:
    """The template's own text (all but ``{question}``) within ``alphabet``, the characters the
    model's tokenizer knows, as a data file's text is (``grpo_fast.task.data``): any other would
    become ``<unk>`` in every prompt."""
    unknown = sorted({ch for ch in template.text.replace(PLACEHOLDER, "") if ch not in alphabet})
    if unknown:
        raise ConfigError(
            f"data.prompt_template={shown(asked)} holds {''.join(unknown)!r}, which the tokenizer does not "
            f"know (it knows only {alphabet!r}): it would become <unk> in every prompt"
        )


def _examples(
    spec: TaskSpec, path: str | None, split: str, fields: dict, hub_name: str | None
) -> list[Example]:
    """A split's examples: from ``path`` when given, else the task's built-in ones, else its Hub
    dataset (the evaluation split is the task's ``eval_split``). A built-in task's one difficulty
    field is its own; a task whose answer is its response takes the answer as the solution."""
    if path is None and spec.builtin is not None:
        return _builtin(spec, split, fields["difficulty_field"])
    if path is None:
        fields = {k: v for k, v in fields.items() if k != "alphabet"}  # the Hub's text: no check
    examples = load_examples(
        spec.name,
        path,
        split=spec.eval_split if split == "eval" else split,
        **fields,
        **({"hub_name": hub_name} if path is None else {}),
    )
    if spec.solution_is_answer and fields["solution_field"] is None:
        examples = [dataclasses.replace(ex, solution=ex.answer) for ex in examples]
    return examples


def _builtin(spec: TaskSpec, split: str, difficulty_field: str | None) -> list[Example]:
    """The built-in examples of ``split``; their difficulty only under the task's own field."""
    examples = spec.builtin(split)
    if difficulty_field is None:
        return [dataclasses.replace(ex, difficulty=None) for ex in examples]
    if difficulty_field != spec.builtin_difficulty_field:
        raise ConfigError(
            f"data.difficulty_field={difficulty_field!r}: the built-in {spec.name} task's difficulty field "
            f"is {spec.builtin_difficulty_field!r}"
        )
    return examples


def _guarded_reward(spec: str, task: str, on_error: str) -> GuardedReward:
    """One ``data.reward`` entry, guarded: ``auto`` (the task's own), a registered name, or
    ``package.module:function``."""
    name = task_spec(task).reward if spec == AUTO else spec
    if ":" in name:  # "package.module:function": import it (its @register_reward runs too)
        return GuardedReward(_import_reward(name), name, on_error=on_error)
    try:
        fn = get_reward_fn(name)
    except ConfigError as exc:
        raise ConfigError(f"data.reward: {exc}") from None
    return GuardedReward(fn, name, on_error=on_error)


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


def load_eval_sets(cfg, task) -> list[eval_sets.EvalSet]:
    """The sets of ``eval.sets`` for the run whose task is ``task`` (``grpo_fast.task.loader.Task``);
    each set's subset drawn with ``cfg.seed`` (the same every evaluation, every resume)."""
    out = []
    for entry in eval_sets.entries(cfg):
        try:
            set_task = task if entry.kind == "run" else _set_task(cfg, task, entry)
        except (DataError, ConfigError) as exc:
            raise type(exc)(f"eval.sets: {shown(entry.name)}: {exc}") from None  # exc names a file's path
        out.append(
            eval_sets.EvalSet(entry.name, set_task, set_task.eval_subset(cfg.data.eval_subset_size, cfg.seed))
        )
    return out


def _set_task(cfg, task, entry: eval_sets.Entry):
    """The ``Task`` grading a registered, file or Hub set: the run's tokenizer and prompt length."""
    run_spec = task_spec(cfg.data.task)
    if entry.kind in ("file", "hub"):  # read and graded as the run's own data
        spec, template, reward = run_spec, cfg.data.prompt_template, task.reward_fn
    else:
        reg = eval_sets.EVAL_SETS[entry.name]
        spec, template = task_spec(reg.task), reg.template
        reward = _guarded_reward(reg.reward or spec.reward, reg.task, cfg.data.reward_errors)
    # the characters the model's tokenizer knows (the built-in tiny tokenizer's: 0-9 + =)
    alphabet_of = run_spec.alphabet or spec.alphabet
    alphabet = alphabet_of(cfg.model.name_or_path) if alphabet_of is not None else None
    if entry.kind in ("file", "hub"):
        hub = entry.kind == "hub"
        examples = load_examples(
            cfg.data.task,
            None if hub else entry.path,
            split=entry.split if hub else "eval",
            question_field=cfg.data.question_field,
            answer_field=cfg.data.answer_field,
            hub_name=entry.path if hub else None,
            hub_config=entry.config,
            alphabet=alphabet,
        )
    else:
        reg = eval_sets.EVAL_SETS[entry.name]
        if reg.builtin is not None:
            examples = reg.builtin()
        else:
            examples = load_examples(
                reg.task,
                None,
                split=reg.split,
                question_field=reg.question_field,
                answer_field=reg.answer_field,
                hub_name=reg.hub_name,
                hub_config=reg.hub_config,
            )
        if alphabet is not None:
            eval_sets.check_alphabet(examples, alphabet)
    if alphabet is not None:
        _check_template_alphabet(template, get_template(template), alphabet)
    return dataclasses.replace(
        task,
        name=spec.name,
        train=[],
        eval=examples,
        template=template,
        stop=list(get_template(template).stop),
        reward_fn=reward,
        _ids={},
    )
