"""Prompt templates: the exact R1-Zero text, custom templates, stop strings, bad names."""

import pytest

from grpo_fast.errors import ConfigError
from grpo_fast.task.prompts import TEMPLATES, format_prompt, get_template, stop_strings

R1_ZERO = (
    "A conversation between User and Assistant. The User asks a question, and the Assistant solves it. "
    "The Assistant first thinks about the reasoning process in the mind and then provides the User with "
    "the answer. The reasoning process is enclosed within <think> </think> and answer is enclosed within "
    "<answer> </answer> tags, respectively, i.e., <think> reasoning process here </think> <answer> answer "
    "here </answer>.\nUser: What is $\\frac{1}{2}+\\frac{1}{2}$?\nAssistant: <think>"
)


def test_r1_zero_is_the_deepseek_prompt_word_for_word():
    assert format_prompt("r1_zero", "What is $\\frac{1}{2}+\\frac{1}{2}$?") == R1_ZERO


def test_question_only_is_the_question():
    assert format_prompt("question_only", "2+2?") == "2+2?"


def test_custom_template_keeps_latex_braces_in_template_and_question():
    # str.format would choke on "{x}" and on the question's braces; plain replacement does not.
    assert format_prompt("Solve {x}: {question}\nA:", "\\boxed{1}") == "Solve {x}: \\boxed{1}\nA:"
    assert get_template("Q: {question}").name == "custom"


def test_stop_strings_r1_zero_stops_at_answer_and_custom_has_none():
    assert stop_strings("r1_zero") == ["</answer>"]
    assert stop_strings("question_only") == []
    assert stop_strings("Q: {question}") == []


def test_stop_strings_returns_a_copy():
    stop_strings("r1_zero").append("oops")
    assert TEMPLATES["r1_zero"].stop == ("</answer>",)


def test_unknown_template_names_the_valid_ones():
    with pytest.raises(ConfigError, match=r"'r1_zreo'.*question_only, r1_zero.*\{question\}"):
        format_prompt("r1_zreo", "2+2?")
