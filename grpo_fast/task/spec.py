"""What a task is: its examples (``Example``) and its declaration (``TaskSpec``), which each task
module of ``grpo_fast.task`` gives as ``TASK = TaskSpec(...)`` (``grpo_fast.task.registry`` finds
them; ``grpo_fast.task.data`` reads their data files)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

__all__ = ["Example", "TaskSpec"]


@dataclass(frozen=True)
class Example:
    """One task item: the question shown to the policy and the extracted ground-truth answer;
    optionally a worked ground-truth ``solution`` and a ``difficulty`` (lower = easier)."""

    question: str
    answer: str
    solution: str | None = None
    difficulty: float | None = None


@dataclass(frozen=True)
class TaskSpec:
    """One task, declared by its module as ``TASK = TaskSpec(...)`` (``grpo_fast.task.registry``
    finds it): its name, the reward it is graded with by default, where its data lives by default
    and which fields hold what (first present wins), how an answer (and a worked solution) is
    read from a record's field; or, for a built-in task, its examples.

    ``extract_answer(value, field, named)``: the ground truth from the answer field's text
    (``named``: the field was named by the user or is called ``answer``), or None when the value
    holds none (``no_answer`` says what was looked for, in the error naming the line).
    ``extract_solution(value, named)``: the worked solution from the solution field's text (``named``:
    the field was named with ``data.solution_field``), or None.
    ``builtin(split)``: the examples of ``"train"`` / ``"eval"`` when the task has its own
    (``data.train_path`` / ``data.eval_path`` replace them); None for a data-file/Hub task.
    """

    name: str
    summary: str
    reward: str  # the default reward (grpo_fast.task.rewards.REWARD_FNS) for data.reward=auto
    question_fields: tuple[str, ...] = ("question", "problem")
    answer_fields: tuple[str, ...] = ("answer", "solution")
    hub_name: str | None = None
    hub_config: str | None = None
    eval_split: str = "test"  # the Hub split evaluated on
    solution_field: str | None = None  # the worked solution's default field, when a record has it
    extract_answer: Callable[[str, str, bool], str | None] = field(
        default=lambda value, name, named: value.strip()
    )
    no_answer: str = "answer"
    extract_solution: Callable[[str, bool], str | None] = field(
        default=lambda value, named: value.strip() or None
    )
    builtin: Callable[[str], list[Example]] | None = None
    builtin_difficulty_field: str | None = None  # the one difficulty field of the built-in examples
    # with a data file and no data.solution_field, the answer is also the worked solution
    solution_is_answer: bool = False
    # alphabet(model.name_or_path): the only characters a data file's text may hold (a tokenizer
    # that knows no others), or None (any); None: no check
    alphabet: Callable[[str], str | None] | None = None
    # what the SFT warm start trains on: "answer" (the bare answer) | "solution" (the worked
    # solution; with a tool environment a demonstration whose tool outputs the warm start inserts)
    warm_start: str = "answer"
