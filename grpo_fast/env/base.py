"""What a tool environment is: how a turn ends, what it asks, how a batch of requests runs, what
goes back into the context.

A multi-turn rollout drives an environment like this (the rollout owns the caps: calls per
response, turns, tokens of a tool output, seconds per call):

1. generate with ``env.stop_strings`` as stop strings (``env.new_state()`` once per response);
2. for each row whose turn ended on one of them, ``call = env.parse(turn_text)``, where
   ``turn_text`` is the text of the turn's sampled tokens, stop string included when the sampled
   tokens hold it. ``None``: the turn asks nothing, the response ends there;
3. ``results = env.execute([(state, call), ...], limit)`` for all those rows at once (a python
   batch runs concurrently in the sandbox pool);
4. tokenize ``result.text`` once and append it as *inserted* tokens (context, never a label),
   then continue generating from the row's token ids.

``ToolResult`` also says whether the tool failed (``ok``, ``status``), whether its output was
cut at the caller's limit (``truncated``; the text then holds a visible marker) and how long the
call took (``seconds``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

__all__ = [
    "Environment",
    "EnvironmentSpec",
    "OutputLimit",
    "ToolCall",
    "ToolResult",
    "split_stop",
    "truncate",
]


@dataclass(frozen=True)
class ToolCall:
    """The request a turn ends with.

    Attributes:
        request: what the tool is given (the code, the expression).
        stop: the stop string the turn's text ends with, or None when the sampled text does not
            hold it (the result text then opens what the stop string would have).
    """

    request: str
    stop: str | None = None


@dataclass(frozen=True)
class ToolResult:
    """What one call gives back.

    Attributes:
        text: the text to insert after the turn (tokenized once by the caller).
        ok: False for a tool error: the code raised or hit a limit, the expression did not
            evaluate (a rollout may count or penalize these).
        status: the tool's own word for the outcome (the sandbox's ``STATUSES``, ``ok``/``error``).
        truncated: the tool's output was cut at the caller's limit (``text`` holds the marker).
        seconds: wall time of the call.
    """

    text: str
    ok: bool
    status: str
    truncated: bool
    seconds: float


@dataclass(frozen=True)
class OutputLimit:
    """The caller's cap on what goes back after one call (``ToolResult.text``, the environment's
    wrapping included: ``inside``): characters, or tokens by the caller's tokenizer
    (``count_tokens(text) -> int``), or both; None: no cap. The marker counts toward the cap."""

    max_chars: int | None = None
    max_tokens: int | None = None
    count_tokens: Callable[[str], int] | None = field(default=None, compare=False)

    def __post_init__(self):
        for name in ("max_chars", "max_tokens"):
            value = getattr(self, name)
            if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
                raise ValueError(f"OutputLimit.{name} must be a whole number >= 1 or None, got {value!r}")
        if self.max_tokens is not None and self.count_tokens is None:
            raise ValueError("OutputLimit.max_tokens needs count_tokens (the caller's tokenizer)")

    def inside(self, wrapping: str) -> OutputLimit:
        """The limit for an output that goes back inside ``wrapping`` (the text an environment
        puts around it: ``<result></result>``, the fences of an output block): the wrapping's
        characters and tokens taken off, so that the whole text that goes back is within this
        limit (at least 1 is left: a limit smaller than the wrapping cannot be held, and the
        rollout then cuts the tokens themselves).

        Example:
            >>> OutputLimit(max_chars=100).inside("<result></result>").max_chars
            83
        """
        chars = None if self.max_chars is None else max(self.max_chars - len(wrapping), 1)
        tokens = None
        if self.max_tokens is not None:
            tokens = max(self.max_tokens - (self.count_tokens(wrapping) if wrapping else 0), 1)
        return OutputLimit(max_chars=chars, max_tokens=tokens, count_tokens=self.count_tokens)


def _marker(cut: int) -> str:
    return f"\n[... {cut:,} characters of output cut ...]\n"


def _cut(text: str, budget: int) -> str:
    """``text`` in at most ``budget`` characters, marker included: two thirds from the start, a
    third from the end (a traceback's last line is what says what went wrong)."""
    if len(text) <= budget:
        return text
    marker = _marker(len(text))  # the longest marker this text can need
    room = max(budget - len(marker), 0)
    head, tail = room - room // 3, room // 3
    return text[:head] + _marker(len(text) - head - tail) + (text[len(text) - tail :] if tail else "")


def truncate(text: str, limit: OutputLimit) -> tuple[str, bool]:
    """``(text within limit, whether it was cut)``.

    The cut keeps the first two thirds and the last third of the room and puts a visible marker
    in between (``[... N characters of output cut ...]``); below the marker's own length only
    the marker is left. By tokens: the longest such cut whose token count is within
    ``max_tokens`` (a binary search: O(log n) calls of ``count_tokens``).

    Example:
        >>> truncate("x" * 100, OutputLimit(max_chars=60))
        ('xxxxxxxxxxxxxx\\n[... 80 characters of output cut ...]\\nxxxxxx', True)
    """
    out = text
    if limit.max_chars is not None:
        out = _cut(out, limit.max_chars)
    if limit.max_tokens is not None and limit.count_tokens(out) > limit.max_tokens:
        # a token spans at most a few dozen characters: no need to search past that
        low, high = 0, min(len(out), 64 * limit.max_tokens)
        while low < high:
            mid = (low + high + 1) // 2
            if limit.count_tokens(_cut(text, mid)) <= limit.max_tokens:
                low = mid
            else:
                high = mid - 1
        out = _cut(text, low) if low else _marker(len(text)).strip("\n")
    return out, out != text


class Environment(ABC):
    """A tool a model calls between turns. Subclass it in a module of your own and declare
    ``ENVIRONMENT = EnvironmentSpec(...)`` there (docs/where-to-add-what.md).

    Attributes:
        name: the registry name.
        stop_strings: a turn that ends with one of these may hold a request.
    """

    name: str = ""
    stop_strings: tuple[str, ...] = ()

    def new_state(self) -> object:
        """Per-response state, kept by the caller and passed back with each call (default:
        None, for a stateless tool)."""
        return None

    @abstractmethod
    def parse(self, turn_text: str) -> ToolCall | None:
        """The request a turn's text ends with, or None when it asks nothing. Never raises on
        any text."""

    @abstractmethod
    def execute(self, calls: Sequence[tuple[object, ToolCall]], limit: OutputLimit) -> list[ToolResult]:
        """Run a batch of ``(state, call)`` pairs (concurrently where the tool allows); one
        result per pair, in order. A failing call is a result with ``ok=False``, never an
        exception (the tool's input is model-written)."""

    def close(self) -> None:  # noqa: B027 (optional: a stateless tool holds nothing)
        """Release what the environment holds (processes, pools)."""


@dataclass(frozen=True)
class EnvironmentSpec:
    """A module's declaration of its environment (``ENVIRONMENT = EnvironmentSpec(...)``).

    Attributes:
        name: what a run calls it.
        summary: one line for listings.
        build: ``build(**options) -> Environment``.
        missing: why it cannot run on this machine (one line naming the fix), or None.
        takes: the rollout's settings ``build`` accepts as keywords, of ``timeout_s`` (seconds
            per call: ``rollout.tool_timeout_s``), ``isolation`` (``rollout.tool_isolation``) and
            ``workers`` (``rollout.tool_workers``); a tool that needs none declares none.
    """

    name: str
    summary: str
    build: Callable[..., Environment]
    missing: Callable[[], str | None] = lambda: None
    takes: tuple[str, ...] = ()


def split_stop(turn_text: str, stop_strings: Sequence[str]) -> tuple[str, str | None]:
    """``(text without the trailing stop string, that stop string or None)``."""
    for stop in stop_strings:
        if turn_text.endswith(stop):
            return turn_text[: -len(stop)], stop
    return turn_text, None
