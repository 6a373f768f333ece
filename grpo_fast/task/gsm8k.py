"""The ``gsm8k`` task: grade-school math word problems (GSM8K; Cobbe et al. 2021), graded by the
final number (``gsm8k`` reward).

Data: by default the Hub's ``openai/gsm8k`` (config ``main``), fields ``question``/``answer``.

Answer: the text after ``####``, commas stripped (``#### 1,000`` → ``1000``); a value that is
already a plain number is taken as it is. The worked solution (``sft.mix_coef``'s target) is the
``answer`` text before ``####``, calculator annotations ``<<48/2=24>>`` removed.
"""

from __future__ import annotations

import re

from grpo_fast.task.spec import TaskSpec

_PLAIN_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?")
_CALCULATOR_RE = re.compile(r"<<[^<>]*>>")  # GSM8K's "<<48/2=24>>" annotations


def extract_answer(value: str, field: str, named: bool) -> str | None:
    """The number after ``####`` (commas stripped), or a bare number.

    >>> extract_answer("She has 4 + 8 = 12 apples.\\n#### 1,012", "answer", True), extract_answer("42", "answer", True)
    ('1012', '42')
    """
    _, sep, tail = value.rpartition("####")
    answer = (tail if sep else value).strip().replace(",", "")
    if not sep and not _PLAIN_NUMBER_RE.fullmatch(answer):
        return None
    return answer


def extract_solution(value: str, named: bool) -> str | None:
    """The reasoning before ``####``, without calculator annotations; a named field's text as it
    is when it has no ``####``."""
    head, sep, _ = value.rpartition("####")
    if not sep:
        return (value.strip() or None) if named else None
    return _CALCULATOR_RE.sub("", head).strip() or None


TASK = TaskSpec(
    name="gsm8k",
    summary="grade-school math word problems (GSM8K), graded by the final number",
    reward="gsm8k",
    question_fields=("question", "problem"),
    answer_fields=("answer", "solution"),
    hub_name="openai/gsm8k",
    hub_config="main",
    solution_field="answer",
    extract_answer=extract_answer,
    no_answer="'####' answer",
    extract_solution=extract_solution,
)
