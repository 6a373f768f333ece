"""The ``math`` task: competition mathematics (MATH; Hendrycks et al. 2021), graded by ``r1_zero``.

Data: by default the Hub's ``DigitalLearningGmbH/MATH-lighteval`` (MATH's original
``hendrycks/competition_math`` was taken down in January 2025; this is the copy lighteval and
open-r1 use: Parquet, no loading script, 7,500 train / 5,000 test, fields ``problem``/``solution``).
For MATH-500 evaluation: ``data.hub_name=HuggingFaceH4/MATH-500`` (it has a bare ``answer``).

Answer: the content of the last ``\\boxed{…}`` / ``\\boxed …`` / ``\\fbox{…}`` of the answer field.
A value without a box is taken as it is (a bare answer) when the field is called ``answer`` or
was named with ``data.answer_field``; otherwise the record is an error. The worked solution
(``sft.mix_coef``'s target) is the ``solution`` field, as it is.
"""

from __future__ import annotations

from grpo_fast.task.rewards import extract_boxed
from grpo_fast.task.spec import TaskSpec


def extract_answer(value: str, field: str, named: bool) -> str | None:
    """The last box's content; a bare value only from a field that is the answer itself.

    >>> extract_answer("so $\\\\boxed{\\\\frac{1}{2}}$.", "solution", False), extract_answer("7", "answer", True)
    ('\\\\frac{1}{2}', '7')
    """
    answer = extract_boxed(value)
    if answer is None and named:
        answer = value.strip()
    return answer


TASK = TaskSpec(
    name="math",
    summary="competition math (MATH), boxed answers, graded symbolically",
    reward="r1_zero",
    question_fields=("problem", "question"),
    answer_fields=("answer", "solution"),
    hub_name="DigitalLearningGmbH/MATH-lighteval",
    solution_field="solution",
    extract_answer=extract_answer,
    no_answer="\\boxed{...} answer",
)
