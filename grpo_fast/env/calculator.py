"""``calculator``: a tiny arithmetic tool, for a CPU task a small model can learn to call.

The model writes ``<calc>123*45</calc>`` (the turn stops at ``</calc>``) and gets
``<result>5535</result>`` back. The expression is evaluated by walking its syntax tree — numbers,
``+ - * / // % **`` (``^`` and ``×`` ``÷`` accepted), unary signs and parentheses, nothing
else: no names, calls or attributes, so nothing of the model's is ever executed. Arithmetic is
exact (rationals); a result that is not a whole number is shown with 12 significant digits.
Bounds: 200 characters of expression, exponents up to 1,000 in size, numbers up to 10^1000. A bad
expression comes back as ``<result>error: …</result>`` with ``ok=False``.
"""

from __future__ import annotations

import ast
import math
import time
from collections.abc import Callable, Sequence
from fractions import Fraction

from grpo_fast.env.base import (
    Environment,
    EnvironmentSpec,
    OutputLimit,
    ToolCall,
    ToolResult,
    split_stop,
    truncate,
)

__all__ = ["ENVIRONMENT", "CalculatorEnvironment", "CalculatorError", "evaluate"]

OPEN, CLOSE = "<calc>", "</calc>"
MAX_CHARS = 200
MAX_EXPONENT = 1000
MAX_DIGITS = 1000
_TOO_BIG = 10**MAX_DIGITS


class CalculatorError(ValueError):
    """An expression the calculator refuses (the message is what the model reads)."""


def _pow(a: Fraction, b: Fraction) -> Fraction:
    if b.denominator != 1:
        raise CalculatorError("only whole-number exponents")
    if abs(b) > MAX_EXPONENT:
        raise CalculatorError(f"exponent over {MAX_EXPONENT}")
    if a == 0 and b < 0:
        raise CalculatorError("division by zero")
    digits = max(math.log10(abs(a.numerator)) if a.numerator else 0.0, math.log10(a.denominator))
    if digits * abs(int(b)) >= MAX_DIGITS + 1:  # checked before the power is built
        raise CalculatorError(f"a number over {MAX_DIGITS} digits")
    return a ** int(b)


def _div(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise CalculatorError("division by zero")
    return a / b


def _floordiv(a: Fraction, b: Fraction) -> Fraction:
    return Fraction(math.floor(_div(a, b)))


def _mod(a: Fraction, b: Fraction) -> Fraction:
    if b == 0:
        raise CalculatorError("division by zero")
    return a % b


_BINARY: dict[type, Callable[[Fraction, Fraction], Fraction]] = {
    ast.Add: lambda a, b: a + b,
    ast.Sub: lambda a, b: a - b,
    ast.Mult: lambda a, b: a * b,
    ast.Div: _div,
    ast.FloorDiv: _floordiv,
    ast.Mod: _mod,
    ast.Pow: _pow,
}
_UNARY: dict[type, Callable[[Fraction], Fraction]] = {ast.UAdd: lambda a: a, ast.USub: lambda a: -a}


def _value(node: ast.AST) -> Fraction:
    if isinstance(node, ast.Constant) and type(node.value) in (int, float):
        return Fraction(node.value)
    if isinstance(node, ast.BinOp) and type(node.op) in _BINARY:
        out = _BINARY[type(node.op)](_value(node.left), _value(node.right))
    elif isinstance(node, ast.UnaryOp) and type(node.op) in _UNARY:
        out = _UNARY[type(node.op)](_value(node.operand))
    else:
        raise CalculatorError(f"not arithmetic: {ast.unparse(node)[:40]}")
    if abs(out.numerator) >= _TOO_BIG or out.denominator >= _TOO_BIG:
        raise CalculatorError(f"a number over {MAX_DIGITS} digits")
    return out


def _show(x: Fraction) -> str:
    if x.denominator == 1:
        return str(x.numerator)
    return format(float(x), ".12g")


def evaluate(expression: str) -> str:
    """The value of an arithmetic expression, as the model will read it.

    Raises:
        CalculatorError: anything that is not plain arithmetic, or out of bounds.

    Example:
        >>> evaluate("123*45"), evaluate("2^10 - 1"), evaluate("7 / 2"), evaluate("1/3")
        ('5535', '1023', '3.5', '0.333333333333')
    """
    text = expression.strip().replace("×", "*").replace("÷", "/").replace("^", "**")
    if not text:
        raise CalculatorError("empty expression")
    if len(text) > MAX_CHARS:
        raise CalculatorError(f"expression over {MAX_CHARS} characters")
    try:
        tree = ast.parse(text, mode="eval")
    except (SyntaxError, ValueError):
        raise CalculatorError(f"cannot read {expression.strip()[:40]!r}") from None
    try:
        return _show(_value(tree.body))
    except (OverflowError, RecursionError):
        raise CalculatorError("number too large") from None


class CalculatorEnvironment(Environment):
    """``<calc>expression</calc>`` → ``<result>value</result>``; stateless, runs in-process.

    Example:
        >>> env = CalculatorEnvironment()
        >>> call = env.parse("so 123 times 45 is <calc>123*45</calc>")
        >>> env.execute([(None, call)], OutputLimit())[0].text
        '<result>5535</result>'
    """

    name = "calculator"
    stop_strings = (CLOSE,)

    def parse(self, turn_text: str) -> ToolCall | None:
        """The expression after the turn's last ``<calc>``."""
        text, stop = split_stop(str(turn_text), self.stop_strings)
        start = text.rfind(OPEN)
        if start < 0:
            return None
        return ToolCall(request=text[start + len(OPEN) :], stop=stop)

    def execute(self, calls: Sequence[tuple[object, ToolCall]], limit: OutputLimit) -> list[ToolResult]:
        return [self._one(call, limit) for _, call in calls]

    def _one(self, call: ToolCall, limit: OutputLimit) -> ToolResult:
        start = time.perf_counter()
        try:
            value, ok = evaluate(call.request), True
        except CalculatorError as exc:
            value, ok = f"error: {exc}", False
        closing = "" if call.stop == CLOSE else CLOSE
        value, truncated = truncate(value, limit.inside(f"{closing}<result></result>"))
        text = f"{closing}<result>{value}</result>"
        return ToolResult(text, ok, "ok" if ok else "error", truncated, time.perf_counter() - start)


ENVIRONMENT = EnvironmentSpec(
    name="calculator",
    summary="<calc>123*45</calc> -> <result>5535</result>: exact arithmetic, nothing executed",
    build=CalculatorEnvironment,
)
