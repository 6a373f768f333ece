"""Prompt templates: how a question becomes the text the policy continues.

A template is a registered name (``TEMPLATES``) or any custom string holding ``{question}``.
``r1_zero`` is the DeepSeek-R1-Zero conversation prompt; it ends inside an open ``<think>``
tag, so the response is expected to read ``… </think> <answer> … </answer>``. Generation stops
at ``</answer>``, and the stop string is KEPT in the response (vLLM:
``include_stop_str_in_output=True``) because the reward's format check needs it. ``math_tir``
is tool-integrated reasoning in Qwen2.5-Math's format (Python blocks whose output the ``python``
environment fills in, the answer boxed: ``configs/tir.yaml``).

Example:
    >>> format_prompt("question_only", "What is 2+2?")
    'What is 2+2?'
    >>> stop_strings("r1_zero")
    ['</answer>']
    >>> format_prompt("Q: {question}\\nA:", "2+2?")
    'Q: 2+2?\\nA:'
"""

from __future__ import annotations

from dataclasses import dataclass

from grpo_fast.errors import ConfigError, shown

__all__ = ["PLACEHOLDER", "TEMPLATES", "PromptTemplate", "format_prompt", "get_template", "stop_strings"]

PLACEHOLDER = "{question}"


@dataclass(frozen=True)
class PromptTemplate:
    """A prompt template.

    Attributes:
        name: registry name, or ``"custom"`` for a user-given string.
        text: the template; ``{question}`` is replaced by the question (nothing else is
            interpreted, so LaTeX braces in the template or the question are safe).
        stop: strings that end generation; each is kept at the end of the response.
    """

    name: str
    text: str
    stop: tuple[str, ...] = ()

    def format(self, question: str) -> str:
        """The prompt for ``question``."""
        return self.text.replace(PLACEHOLDER, question)


TEMPLATES: dict[str, PromptTemplate] = {
    "r1_zero": PromptTemplate(
        name="r1_zero",
        text=(
            "A conversation between User and Assistant. The User asks a question, and the Assistant "
            "solves it. The Assistant first thinks about the reasoning process in the mind and then "
            "provides the User with the answer. The reasoning process is enclosed within <think> "
            "</think> and answer is enclosed within <answer> </answer> tags, respectively, i.e., "
            "<think> reasoning process here </think> <answer> answer here </answer>.\n"
            "User: {question}\n"
            "Assistant: <think>"
        ),
        stop=("</answer>",),
    ),
    "question_only": PromptTemplate(name="question_only", text=PLACEHOLDER),
    # Tool-integrated reasoning in Qwen2.5-Math's format (its TIR data, ToRL): reason, write Python in
    # a ```python block and open an ```output block (rollout.environment=python runs the code and
    # fills the block), read the output, go on; the answer in \boxed{} (data.reward=boxed). A base
    # model that goes on to a new "Problem:" is stopped there. configs/tir.yaml sets it all.
    "math_tir": PromptTemplate(
        name="math_tir",
        text=(
            "Solve the following math problem. Integrate step-by-step reasoning with Python code: "
            "write code in a ```python block and follow it with ```output, and the code's output "
            "will be shown there, like this:\n"
            "```python\nprint(2**10 - 1)\n```\n```output\n1023\n```\n"
            "Use what the code prints, and put your final answer within \\boxed{}.\n\n"
            "Problem: {question}\n\n"
            "Solution:"
        ),
        stop=("\n\nProblem:",),
    ),
}


def get_template(name_or_text: str) -> PromptTemplate:
    """A registered template by name, or a custom one from a string holding ``{question}``.

    Raises:
        ConfigError: neither a registered name nor a string with ``{question}``.
    """
    if name_or_text in TEMPLATES:
        return TEMPLATES[name_or_text]
    if PLACEHOLDER in name_or_text:
        return PromptTemplate(name="custom", text=name_or_text)
    raise ConfigError(
        f"unknown prompt template {shown(name_or_text)}: use one of {', '.join(sorted(TEMPLATES))}, "
        f"or a custom template string containing {PLACEHOLDER}"
    )


def format_prompt(template_name: str, question: str) -> str:
    """Fill ``question`` into the template ``template_name`` (a name or a custom string)."""
    return get_template(template_name).format(question)


def stop_strings(template_name: str) -> list[str]:
    """Stop strings for the template (kept in the output); a custom template has none."""
    return list(get_template(template_name).stop)
