"""Tool environments (grpo_fast.env): the registry (built-ins and a user's module), the python
environment's format (parse a turn, run a batch in the sandbox, the text that goes back, state
from turn to turn, errors and limits reported), the calculator (exact values, nothing executed),
and the caller's output cap with its visible marker."""

from __future__ import annotations

import re
import textwrap

import pytest

from grpo_fast.env import (
    Environment,
    OutputLimit,
    ToolCall,
    environment,
    environments,
    make_environment,
    truncate,
)
from grpo_fast.env import python as python_env
from grpo_fast.env.calculator import CalculatorEnvironment, CalculatorError, evaluate
from grpo_fast.env.python import PythonEnvironment
from grpo_fast.errors import ConfigError
from grpo_fast.sandbox import Limits, bwrap_status

_, BWRAP_PROBLEM = bwrap_status()
needs_bwrap = pytest.mark.skipif(BWRAP_PROBLEM is not None, reason=f"no sandbox here: {BWRAP_PROBLEM}")
SLACK_S = 60.0  # a call that ends by itself: far above its ≈0.2 s idle


@pytest.fixture(scope="module")
def python():
    if BWRAP_PROBLEM is not None:
        pytest.skip(f"no sandbox here: {BWRAP_PROBLEM}")
    return PythonEnvironment(Limits(timeout_s=SLACK_S), workers=2)


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------

USER_MODULE = textwrap.dedent(
    """
    from grpo_fast.env import Environment, EnvironmentSpec, ToolCall, ToolResult, split_stop, truncate

    class Reverse(Environment):
        name = "reverse"
        stop_strings = ("</rev>",)

        def parse(self, turn_text):
            text, stop = split_stop(turn_text, self.stop_strings)
            start = text.rfind("<rev>")
            return None if start < 0 else ToolCall(text[start + 5 :], stop)

        def execute(self, calls, limit):
            results = []
            for _, call in calls:
                shown, cut = truncate(call.request[::-1], limit)
                results.append(ToolResult(f"<out>{shown}</out>", True, "ok", cut, 0.0))
            return results

    ENVIRONMENT = EnvironmentSpec(name="reverse", summary="reverses text", build=Reverse)
    """
)


def test_the_registry_finds_the_builtins():
    assert sorted(environments()) == ["calculator", "python"]
    assert environment("calculator").build is CalculatorEnvironment
    assert environment("python").build is PythonEnvironment
    assert isinstance(make_environment("calculator"), CalculatorEnvironment)


def test_a_users_environment_is_one_module(tmp_path, monkeypatch):
    (tmp_path / "my_reverse_tool.py").write_text(USER_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    env = make_environment("my_reverse_tool")
    assert isinstance(env, Environment) and env.stop_strings == ("</rev>",)
    call = env.parse("flip it <rev>abc</rev>")
    assert call == ToolCall("abc", "</rev>")
    assert env.execute([(env.new_state(), call)], OutputLimit())[0].text == "<out>cba</out>"


def test_unknown_or_empty_modules_are_one_line(tmp_path, monkeypatch):
    with pytest.raises(
        ConfigError, match=r"^unknown tool environment 'pyton' \(built in: calculator, python; or"
    ):
        environment("pyton")
    (tmp_path / "not_a_tool.py").write_text("x = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(
        ConfigError, match=r"^tool environment 'not_a_tool': the module declares no ENVIRONMENT"
    ):
        environment("not_a_tool")


def test_python_without_bubblewrap_stops_in_one_line_naming_the_fix(monkeypatch):
    monkeypatch.setattr(
        python_env,
        "bwrap_status",
        lambda: (None, "bubblewrap (bwrap) is not installed; install it: apt-get install -y bubblewrap"),
    )
    with pytest.raises(ConfigError) as info:
        make_environment("python")
    assert str(info.value) == (
        "tool environment 'python' cannot run here: bubblewrap (bwrap) is not installed; install it: "
        "apt-get install -y bubblewrap"
    )


# ----------------------------------------------------------------------------------------------
# python: parse
# ----------------------------------------------------------------------------------------------

FENCE = "```"


@pytest.mark.parametrize(
    ("turn", "expected"),
    [
        (
            f"Let me check.\n{FENCE}python\nprint(1)\n{FENCE}\n{FENCE}output",
            ToolCall("print(1)\n", f"{FENCE}output"),
        ),
        (f"{FENCE}python\nx = 2\nx\n{FENCE}\n", ToolCall("x = 2\nx\n", None)),  # stop string not in the text
        (
            f"{FENCE}python\na = 1\n{FENCE}\ntext\n{FENCE}python\nb = 2\n{FENCE}\n{FENCE}output",
            ToolCall("b = 2\n", f"{FENCE}output"),
        ),
        (f"{FENCE}python\nunclosed = 1\n{FENCE}output", ToolCall("unclosed = 1\n", f"{FENCE}output")),
        (f"no code here\n{FENCE}output", None),
        ("", None),
    ],
    ids=["one-block", "no-stop-in-text", "last-block", "unclosed", "no-block", "empty"],
)
def test_python_parses_the_last_code_block_of_the_turn(turn, expected):
    env = PythonEnvironment(isolation="unsafe")  # parsing runs nothing
    assert env.stop_strings == (f"{FENCE}output",)
    assert env.parse(turn) == expected


# ----------------------------------------------------------------------------------------------
# python: execute
# ----------------------------------------------------------------------------------------------


@needs_bwrap
def test_python_runs_a_batch_in_order_and_closes_the_output_block(python):
    turns = [
        f"{FENCE}python\nprint(6 * 7)\n{FENCE}\n{FENCE}output",
        f"{FENCE}python\nimport sympy\nsympy.factor(sympy.Symbol('x')**2 - 1)\n{FENCE}\n",
        f"{FENCE}python\nx = 1\n{FENCE}\n{FENCE}output",
        f"{FENCE}python\n1 / 0\n{FENCE}\n{FENCE}output",
    ]
    calls = [(python.new_state(), python.parse(t)) for t in turns]
    results = python.execute(calls, OutputLimit())
    assert [r.text for r in results[:3]] == [
        "\n42\n```\n",  # the model opened the output block: we fill and close it
        "\n```output\n(x - 1)*(x + 1)\n```\n",  # it did not (stop string not in its text): we open it
        "\n```\n",  # no output: an empty block
    ]
    assert results[3].text.startswith('\nTraceback (most recent call last):\n  File "<cell 1>", line 1')
    assert results[3].text.endswith("ZeroDivisionError: division by zero\n```\n")
    assert [(r.ok, r.status, r.truncated) for r in results] == [(True, "ok", False)] * 3 + [
        (False, "error", False)
    ]
    assert all(0 < r.seconds < SLACK_S for r in results)


@needs_bwrap
def test_python_state_persists_across_turns_of_one_response_only(python):
    first, second = python.new_state(), python.new_state()
    code = lambda src: ToolCall(src, f"{FENCE}output")
    python.execute([(first, code("x = 40\nprint('set')")), (second, code("y = 1"))], OutputLimit())
    results = python.execute([(first, code("print(x + 2)")), (second, code("print(x)"))], OutputLimit())
    assert results[0].text == "\n42\n```\n"  # the earlier cell replayed, its "set" not shown again
    assert "NameError: name 'x' is not defined" in results[1].text  # another response's state
    assert first == ["x = 40\nprint('set')", "print(x + 2)"]


@needs_bwrap
def test_python_reports_a_limit_on_a_last_line_and_does_not_replay_it():
    env = PythonEnvironment(Limits(timeout_s=1.0, cpu_s=600), workers=1)
    state = env.new_state()
    (r,) = env.execute(
        [(state, ToolCall("print('partial', flush=True)\nwhile True:\n    pass\n", None))], OutputLimit()
    )
    assert (r.text, r.ok, r.status) == (
        "\n```output\npartial\n[timed out after 1 s]\n```\n",
        False,
        "timeout",
    )
    assert state == []  # replaying it would time out every later call


@needs_bwrap
def test_python_cuts_long_output_at_the_callers_limit_with_a_marker(python):
    call = ToolCall("for i in range(1000):\n    print(i)\n", f"{FENCE}output")
    (r,) = python.execute([(python.new_state(), call)], OutputLimit(max_chars=100))
    body = r.text[1 : -len("\n```\n")]
    assert len(r.text) <= 100 and r.truncated and r.ok  # the fences inside the cap too
    assert body.startswith("0\n1\n2\n") and body.endswith("998\n999")  # the start and the end kept
    assert "characters of output cut ...]" in body


# ----------------------------------------------------------------------------------------------
# The output cap
# ----------------------------------------------------------------------------------------------


def test_truncate_by_characters_keeps_the_start_and_the_end():
    text = "".join(f"{i:03d}\n" for i in range(250))  # 1,000 characters
    out, cut = truncate(text, OutputLimit(max_chars=200))
    assert cut and len(out) <= 200 and out.startswith("000\n001\n") and out.endswith("248\n249\n")
    # the marker for 1,000 is 42 characters: room 200 − 42 = 158, a third (52) from the end, the
    # rest (106) from the start; 1,000 − 158 = 842 cut
    marker = "[... 842 characters of output cut ...]"
    head, tail = out.split(f"\n{marker}\n")
    assert (len(head), len(tail)) == (106, 52) and text.startswith(head) and text.endswith(tail)
    assert truncate(text, OutputLimit(max_chars=1000)) == (text, False)
    assert truncate(text, OutputLimit()) == (text, False)
    tiny, cut = truncate(text, OutputLimit(max_chars=5))  # below the marker: the marker alone
    assert cut and tiny == "\n[... 1,000 characters of output cut ...]\n"


def test_truncate_by_tokens_uses_the_callers_tokenizer():
    words = lambda s: len(s.split())  # a stand-in tokenizer: one token per word
    text = " ".join(f"w{i}" for i in range(500))
    out, cut = truncate(text, OutputLimit(max_tokens=60, count_tokens=words))
    assert cut and words(out) <= 60 and words(out) >= 55  # the longest cut that fits, marker included
    assert out.startswith("w0 w1 ") and out.endswith("w498 w499")
    assert truncate(text, OutputLimit(max_tokens=500, count_tokens=words)) == (text, False)


def test_output_limits_are_checked():
    with pytest.raises(
        ValueError, match=r"OutputLimit\.max_chars must be a whole number >= 1 or None, got 0"
    ):
        OutputLimit(max_chars=0)
    with pytest.raises(ValueError, match=r"max_tokens needs count_tokens"):
        OutputLimit(max_tokens=10)


# ----------------------------------------------------------------------------------------------
# calculator
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("expression", "value"),
    [
        ("123*45", "5535"),  # 123·45 = 5535
        (" 987 * 654 ", "645498"),
        ("2^10 - 1", "1023"),
        ("2**-2", "0.25"),
        ("7 / 2", "3.5"),
        ("1/3", "0.333333333333"),  # 12 significant digits
        ("0.1 + 0.2", "0.3"),  # exact rationals: not 0.30000000000000004
        ("-(3 - 5) * 4", "8"),
        ("17 // 5, ", None),  # a tuple is not arithmetic
        ("17 // 5", "3"),
        ("17 % 5", "2"),
        ("12×3÷4", "9"),
        ("10**999", "1" + "0" * 999),
    ],
)
def test_calculator_values(expression, value):
    if value is None:
        with pytest.raises(CalculatorError):
            evaluate(expression)
    else:
        assert evaluate(expression) == value


@pytest.mark.parametrize(
    ("expression", "message"),
    [
        ("__import__('os').system('id')", "not arithmetic"),
        ("x + 1", "not arithmetic: x"),
        ("(1).__class__", "not arithmetic"),
        ("1 / 0", "division by zero"),
        ("5 % 0", "division by zero"),
        ("0 ** -1", "division by zero"),
        ("9 ** 9 ** 9", "exponent over 1000"),
        ("(10 ** 999) * 100", "a number over 1000 digits"),
        ("2 ** 0.5", "only whole-number exponents"),
        ("1" * 201, "expression over 200 characters"),
        ("1 +", "cannot read '1 +'"),
        ("", "empty expression"),
        ("1e400", "number too large"),
    ],
)
def test_calculator_refuses_anything_else(expression, message):
    with pytest.raises(CalculatorError, match=re.escape(message)):
        evaluate(expression)


def test_calculator_turns_and_results():
    env = CalculatorEnvironment()
    assert env.stop_strings == ("</calc>",)
    calls = [env.parse(t) for t in ["so <calc>123*45</calc>", "<calc>1/0</calc>", "<calc>2+2", "no call"]]
    assert calls[:3] == [ToolCall("123*45", "</calc>"), ToolCall("1/0", "</calc>"), ToolCall("2+2", None)]
    assert calls[3] is None
    results = env.execute([(None, c) for c in calls[:3]], OutputLimit())
    assert [r.text for r in results] == [
        "<result>5535</result>",
        "<result>error: division by zero</result>",
        "</calc><result>4</result>",  # the stop string was not in the text: we close the call
    ]
    assert [(r.ok, r.status) for r in results] == [(True, "ok"), (False, "error"), (True, "ok")]
    (long,) = env.execute([(None, ToolCall("10**200", "</calc>"))], OutputLimit(max_chars=60))
    # the cap holds the whole text that goes back, the calculator's tags included
    assert long.truncated and len(long.text) <= 60 and "characters of output cut" in long.text
    assert long.text.startswith("<result>10") and long.text.endswith("0</result>")
