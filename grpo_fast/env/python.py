"""``python``: tool-integrated reasoning with a Python interpreter (Qwen2.5-Math / ToRL format).

The model writes a fenced block and asks for its output by opening an output block, where its
turn stops (the stop string ``` ```output ```)::

    Let me compute it.
    ```python
    from sympy import factorint
    print(factorint(360))
    ```
    ```output

The sandbox (``grpo_fast.sandbox``) runs the last ```` ```python ```` block of the turn, and what
goes back closes the output block around what the model would see in a terminal, stdout and
stderr in the order written (a traceback included), then generation continues::

    {2: 3, 3: 2, 5: 1}
    ```

A call that hit a limit says so on a last line (``[timed out after 10 s]``); an output longer
than the caller's limit is cut with a visible marker. Variables, imports and files persist from
call to call within a response: each call replays the response's earlier cells first, output
dropped (docs/tools.md: what that costs). Cells that hit a limit are not replayed.
"""

from __future__ import annotations

import dataclasses
import re
from collections.abc import Sequence

from grpo_fast.env.base import (
    Environment,
    EnvironmentSpec,
    OutputLimit,
    ToolCall,
    ToolResult,
    split_stop,
    truncate,
)
from grpo_fast.sandbox import Limits, Sandbox, SandboxResult, bwrap_status

__all__ = ["ENVIRONMENT", "PythonEnvironment"]

OPEN_CODE = "```python"
OPEN_OUTPUT = "```output"
CLOSE = "```"
_FENCE = re.compile(r"^([ \t]*)(```)", re.MULTILINE)  # a line of the output that opens or closes a block
_REPLAYED = ("ok", "error")  # a cell that hit a limit would hit it again at every later call


def _note(result: SandboxResult, limits: Limits) -> str:
    """The line the model reads under the output when the call hit a limit (no timings: the
    same call gives the same text)."""
    notes = {
        "timeout": f"[timed out after {limits.timeout_s:g} s]",
        "cpu": f"[killed at the {limits.cpu_seconds} s CPU-time limit]",
        "signal": f"[killed by signal {result.signal}]",
        "output": f"[stopped: more than {limits.output_bytes:,} bytes of output]",
    }
    return notes.get(result.status, "")


class PythonEnvironment(Environment):
    """Python in the sandbox, a REPL per response.

    Args:
        limits: the sandbox's limits per call (``grpo_fast.sandbox.Limits``; its ``timeout_s`` is
            the seconds-per-call cap).
        isolation: ``"bwrap"`` or ``"unsafe"`` (``grpo_fast.sandbox.Sandbox``).
        workers: calls at once (default: this process's CPUs, at most 8).
        timeout_s: the wall clock of one call, in place of ``limits.timeout_s``.

    Example:
        >>> env = PythonEnvironment()  # doctest: +SKIP
        >>> call = env.parse("```python\\nprint(6 * 7)\\n```\\n```output")  # doctest: +SKIP
        >>> env.execute([(env.new_state(), call)], OutputLimit())[0].text  # doctest: +SKIP
        '\\n42\\n```\\n'
    """

    name = "python"
    stop_strings = (OPEN_OUTPUT,)

    def __init__(
        self,
        limits: Limits | None = None,
        isolation: str = "bwrap",
        workers: int | None = None,
        timeout_s: float | None = None,
    ):
        if timeout_s is not None:  # the rollout's seconds-per-call cap (rollout.tool_timeout_s)
            limits = dataclasses.replace(limits or Limits(), timeout_s=timeout_s)
        self.sandbox = Sandbox(limits, isolation=isolation, workers=workers)

    def new_state(self) -> list[str]:
        """The response's cells so far that later calls replay."""
        return []

    def parse(self, turn_text: str) -> ToolCall | None:
        """The last ```` ```python ```` block of the turn (up to its closing fence, or the end)."""
        text, stop = split_stop(str(turn_text), self.stop_strings)
        start = text.rfind(OPEN_CODE)
        if start < 0:
            return None
        code = text[start + len(OPEN_CODE) :]
        end = code.find(CLOSE)
        code = code if end < 0 else code[:end]
        return ToolCall(request=code.lstrip("\n").rstrip() + "\n", stop=stop)

    def execute(self, calls: Sequence[tuple[list[str], ToolCall]], limit: OutputLimit) -> list[ToolResult]:
        results = self.sandbox.run_batch([(call.request, list(state)) for state, call in calls])
        out = []
        for (state, call), result in zip(calls, results):
            if result.status in _REPLAYED:
                state.append(call.request)
            out.append(self.result_for(call, result, limit))
        return out

    def result_for(self, call: ToolCall, result: SandboxResult, limit: OutputLimit) -> ToolResult:
        """The ToolResult of one sandbox call: the output block the model is shown. A line of the
        output that would close the block (a fence, ```` ``` ````) is escaped (``\\```…``): the
        block's end is ours (the sandbox has escaped control characters already)."""
        shown = _FENCE.sub(r"\1\\\2", result.output.rstrip("\n"))
        note = _note(result, self.sandbox.limits)
        if note:
            shown = f"{shown}\n{note}" if shown else note
        opening = "\n" if call.stop == OPEN_OUTPUT else f"\n{OPEN_OUTPUT}\n"  # the model's or ours
        # a cut can bring one fence to the start of a line (the kept tail's): room for its "\\"
        shown, truncated = truncate(shown, limit.inside(f"{opening}\n{CLOSE}\n\\"))
        shown = _FENCE.sub(r"\1\\\2", shown)
        text = f"{opening}{shown}\n{CLOSE}\n" if shown else f"{opening}{CLOSE}\n"
        return ToolResult(
            text, result.ok, result.status, truncated or result.status == "output", result.seconds
        )


def _missing() -> str | None:
    """Why the sandbox cannot run here (bubblewrap missing or too old), naming the fix."""
    return bwrap_status()[1]


ENVIRONMENT = EnvironmentSpec(
    name="python",
    summary="```python blocks run in the sandbox; their output comes back as an ```output block",
    build=PythonEnvironment,
    missing=_missing,
    takes=("timeout_s", "isolation", "workers"),
)
