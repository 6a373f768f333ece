"""Multi-turn rollouts with a tool environment: the part both backends share.

A response is generated turn by turn. In each turn the backend samples, for every row still
running, until the row's turn ends (EOS, a stop string of the task or of the environment, or the
row's token budget, ``Turns.budget``), then hands each row's sampled ids and log-probs to
``Turns.end_turn``, which reads how the turn ended:

- EOS or a task stop string: the response is done (``"stop"``);
- the environment's stop string: the turn asks for a call (``env.parse`` of the turn's text);
  the calls of all such rows run as one batch (``env.execute``: concurrently in the sandbox
  pool), each result's text is tokenized once and appended as ``Role.INSERTED`` tokens, and the
  row continues from its token ids (the backend prefills the inserted tokens: hf into the row's
  KV cache, vLLM as a token prompt);
- its budget: the response is cut (``"length"``: ``rollout.max_tokens``, sampled tokens over all
  turns; ``"max_response_tokens"``: sampled + inserted tokens).

Token ids in, token ids out: the model's own tokens are never decoded and re-encoded (their text
is only read, to find stop strings and the request), and a tool's text is tokenized once.

The caps (``rollout.*``; ``max_tool_calls=0`` means zero calls, the others are at least 1: no
cap reads 0 as "unlimited"). A response that hits one ends with a finish reason naming it:

====================================  =====================================================
``max_tool_calls``                    calls run per response; a request past it ends the
                                      response unrun (``"max_tool_calls"``; 0: the first)
``max_turns``                         sampled turns per response (auto: calls + 1); a request
                                      in the last turn ends the response unrun (``"max_turns"``)
``max_tool_output_tokens``            tokens inserted after one call, the environment's
                                      wrapping included: a longer output is cut in the middle
                                      with a visible ``[... N characters of output cut ...]``
``max_response_tokens``               sampled + inserted tokens (auto: ``max_tokens +
                                      max_tool_calls × max_tool_output_tokens``, the most a
                                      response can hold); an output that does not fit with
                                      room for one more sampled token ends the response
                                      (``"max_response_tokens"``)
``max_tokens``                        sampled tokens, all turns together (``"length"``)
``tool_timeout_s``                    the environment's (python: the sandbox's wall clock); a
                                      user's module: each call into it, after which the
                                      call is failed and abandoned (``grpo_fast.env.guarded``)
====================================  =====================================================

Example (a scripted turn: the calculator's stop string ends it, the result comes back):
    >>> from grpo_fast.env import make_environment
    >>> from grpo_fast.task import tiny
    >>> tok = tiny.build_tokenizer(tiny.TOOLS_NAME)
    >>> tools = ToolRollout(make_environment("calculator"), tok, 2, 3, 16, 64)
    >>> turns = Turns(tools, [tok("12*34=")["input_ids"]], SamplingParams(1, 1.0, 1.0, 32, 0))
    >>> ids = tok("<calc>12*34</calc>", add_special_tokens=False)["input_ids"]
    >>> inserted = turns.end_turn({0: (ids, [0.0] * len(ids))})
    >>> tok.decode(inserted[0])
    '<result>408</result>'
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from grpo_fast.domains import AUTO
from grpo_fast.env import Environment, OutputLimit, environments, make_environment, truncate
from grpo_fast.env.guarded import GuardedEnvironment
from grpo_fast.env.registry import environment as environment_spec
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.trajectory import Role, Trajectory

__all__ = [
    "CAP_REASONS",
    "ToolCallRecord",
    "ToolRollout",
    "Turns",
    "demonstrations",
    "from_config",
    "max_response_tokens",
    "max_turns",
    "tool_metrics",
    "tool_sums",
    "turn_texts",
]

# The finish reasons of the caps (besides "stop" and "length", which single-turn responses have too)
CAP_REASONS = ("max_tool_calls", "max_turns", "max_response_tokens")
# tokens of a turn's tail decoded to look for a stop string (the hf decoder's check each step)
STOP_WINDOW = 16


@dataclass(frozen=True)
class ToolCallRecord:
    """One tool call of a response (``Trajectory.tool_calls``), for rewards, metrics and dumps.

    Attributes:
        turn: the turn that asked (0-based).
        request: what the tool was given (the code, the expression).
        text: what went back into the context (after the cap), or what would have when it did
            not fit (``inserted == 0``).
        ok: False for a tool error (the code raised or hit a limit, the expression failed).
        status: the tool's word for the outcome.
        truncated: the output was cut at ``rollout.max_tool_output_tokens``.
        seconds: the call's own wall time.
        batch_seconds: its share of its batch's wall time (the batch's time over its calls):
            summed over a rollout, the time the rollout spent waiting for tools.
        inserted: tokens inserted (0: the output did not fit in ``rollout.max_response_tokens``).
    """

    turn: int
    request: str
    text: str
    ok: bool
    status: str
    truncated: bool
    seconds: float
    batch_seconds: float
    inserted: int


@dataclass(frozen=True)
class ToolRollout:
    """What a multi-turn rollout needs besides the sampling parameters: the environment, the
    tokenizer its text is tokenized with, and the caps (module docstring; ``max_tool_calls`` ≥ 0,
    the others ≥ 1)."""

    env: Environment
    tokenizer: Any
    max_tool_calls: int
    max_turns: int
    max_tool_output_tokens: int
    max_response_tokens: int
    # lazily filled: whether a token's own text holds the last character of a stop string
    _enders: dict[int, bool] = field(default_factory=dict, compare=False, repr=False)

    def __post_init__(self) -> None:
        for name in ("max_tool_calls", "max_turns", "max_tool_output_tokens", "max_response_tokens"):
            value, least = getattr(self, name), 0 if name == "max_tool_calls" else 1
            if isinstance(value, bool) or not isinstance(value, int) or value < least:
                raise ValueError(f"ToolRollout.{name} must be a whole number >= {least}, got {value!r}")

    def stops(self, params: SamplingParams) -> tuple[str, ...]:
        """The stop strings of a turn: the task's (``params.stop``) and the environment's."""
        return tuple(dict.fromkeys([*params.stop, *self.env.stop_strings]))

    def encode(self, text: str) -> list[int]:
        """``text``'s token ids (no special tokens added; no warning past the model's length)."""
        return self.tokenizer(text, add_special_tokens=False, verbose=False)["input_ids"]

    def count_tokens(self, text: str) -> int:
        return len(self.encode(text))

    def may_end_stop(self, token: int, stops: tuple[str, ...]) -> bool:
        """Whether ``token``'s text holds the last character of one of ``stops`` (only such a
        token can complete a stop string; decoded once per token id)."""
        hit = self._enders.get(token)
        if hit is None:
            text = self.tokenizer.decode([token])
            hit = any(s[-1] in text for s in stops) or "\ufffd" in text  # a partial UTF-8 byte: check
            self._enders[token] = hit
        return hit


def max_turns(rollout_cfg) -> int:
    """``rollout.max_turns`` with ``auto`` resolved: one more turn than calls."""
    r = rollout_cfg
    return r.max_tool_calls + 1 if r.max_turns == AUTO else int(r.max_turns)


def max_response_tokens(rollout_cfg) -> int:
    """The most tokens one response can hold: ``rollout.max_tokens`` without an environment;
    with one ``rollout.max_response_tokens`` (``auto``: ``max_tokens + max_tool_calls ×
    max_tool_output_tokens``). The context a rollout needs is ``max_prompt_tokens`` + this (the
    vLLM engine's ``max_model_len``, the planner's sequence length)."""
    r = rollout_cfg
    if r.environment == "none":
        return r.max_tokens
    if r.max_response_tokens == AUTO:
        return r.max_tokens + r.max_tool_calls * r.max_tool_output_tokens
    return int(r.max_response_tokens)


def from_config(cfg, tokenizer) -> ToolRollout | None:
    """The run's ``ToolRollout`` (``rollout.environment`` and the caps), or None without an
    environment. The environment is built here: one line naming the fix when it cannot run on
    this machine (``python`` without bubblewrap), or naming the module when a user's build fails;
    a user's module is wrapped so that each call is bounded by ``rollout.tool_timeout_s``, ends at
    a signal and has what it returns checked (``grpo_fast.env.guarded``). ``tokenizer`` may be
    None for a build that runs nothing (the dry run's)."""
    r = cfg.rollout
    if r.environment == "none":
        return None
    settings = {
        "timeout_s": float(r.tool_timeout_s),
        "isolation": r.tool_isolation,
        "workers": None if r.tool_workers == AUTO else int(r.tool_workers),
    }
    takes = environment_spec(r.environment).takes
    env = make_environment(r.environment, **{k: v for k, v in settings.items() if k in takes})
    if r.environment not in environments():  # a user's module: bounded, stoppable, checked
        env = GuardedEnvironment(env, r.environment, float(r.tool_timeout_s))
    return ToolRollout(
        env,
        tokenizer,
        max_tool_calls=r.max_tool_calls,
        max_turns=max_turns(r),
        max_tool_output_tokens=r.max_tool_output_tokens,
        max_response_tokens=max_response_tokens(r),
    )


@dataclass
class _Row:
    """One response being generated."""

    prompt_ids: list[int]
    state: object  # the environment's per-response state
    token_ids: list[int] = field(default_factory=list)
    roles: list[int] = field(default_factory=list)
    logprobs: list[float | None] = field(default_factory=list)
    turn_starts: list[int] = field(default_factory=lambda: [0])
    calls: list[ToolCallRecord] = field(default_factory=list)
    sampled: int = 0
    void_turns: int = 0
    finish_reason: str | None = None  # None while it runs


class Turns:
    """The rows of one ``generate`` call, turn by turn: ``len(prompts) · params.n`` rows, prompt
    ``i``'s samples at ``i·n … i·n + n − 1`` (the backends' order).

    The backend asks which rows run (``running``), how many tokens each may sample this turn
    (``budget``; ``min_tokens_left``: how many before EOS may end it), each row's context
    (``context``: prompt and response ids), hands over each turn's sampled ids and log-probs
    (``end_turn``, which returns the inserted ids of the rows that continue), and finally reads
    the trajectories (``trajectories``).
    """

    def __init__(self, tools: ToolRollout, prompts: list[list[int]], params: SamplingParams):
        self.tools = tools
        self.rows = [_Row(list(p), tools.env.new_state()) for p in prompts for _ in range(params.n)]
        self.max_tokens = params.max_tokens
        self.min_tokens = params.min_tokens
        self.task_stops = tuple(params.stop)
        self.stops = tools.stops(params)
        self.turn = 0  # turns ended so far
        self.tool_seconds = 0.0  # wall time spent in the environment's batches

    # -- what the backend asks ------------------------------------------------------------------

    def running(self) -> list[int]:
        """The rows that sample in this turn."""
        return [i for i, row in enumerate(self.rows) if row.finish_reason is None]

    def budget(self, i: int) -> int:
        """Tokens row ``i`` may sample in this turn (≥ 1 for a running row)."""
        row = self.rows[i]
        return min(self.max_tokens - row.sampled, self.tools.max_response_tokens - len(row.token_ids))

    def min_tokens_left(self, i: int) -> int:
        """Sampled tokens row ``i`` still needs before EOS may end it (``rollout.min_tokens``
        counts the sampled tokens of all turns)."""
        return max(self.min_tokens - self.rows[i].sampled, 0)

    def sampled(self, i: int) -> int:
        return self.rows[i].sampled

    def context(self, i: int) -> list[int]:
        """``[P + T]`` row ``i``'s prompt and response ids so far (the next turn's token prompt)."""
        row = self.rows[i]
        return row.prompt_ids + row.token_ids

    def ends_turn(self, turn_ids: list[int]) -> bool:
        """Whether a turn whose sampled ids so far are ``turn_ids`` has ended: its last token is
        EOS, or its decoded tail holds a stop string (checked only when the last token can
        complete one)."""
        last = turn_ids[-1]
        if last == self.tools.tokenizer.eos_token_id:
            return True
        if not self.stops or not self.tools.may_end_stop(last, self.stops):
            return False
        tail = self.tools.tokenizer.decode(turn_ids[-STOP_WINDOW:], skip_special_tokens=True)
        return any(s in tail for s in self.stops)

    # -- the end of a turn ----------------------------------------------------------------------

    def end_turn(self, outputs: dict[int, tuple[list[int], list[float] | None]]) -> dict[int, list[int]]:
        """Each running row's turn: ``outputs[i] = (sampled ids, their log-probs or None)``.
        Reads how each turn ended, runs the calls of the rows that asked for one (one batch) and
        appends their results as inserted tokens. Returns ``{row: inserted ids}`` for the rows
        that continue (empty when every row is done)."""
        if sorted(outputs) != self.running():
            raise RuntimeError(f"end_turn got rows {sorted(outputs)}, the running ones are {self.running()}")
        asks = []  # (row, call)
        for i, (ids, lps) in outputs.items():
            call = self._append_turn(i, list(ids), lps)
            if call is not None:
                asks.append((i, call))
        asks = [(i, call) for i, call in asks if self._may_call(i)]
        inserted = self._run_calls(asks) if asks else {}
        self.turn += 1
        return inserted

    def _append_turn(self, i: int, ids: list[int], lps: list[float] | None):
        """Append row ``i``'s sampled turn; finish it unless it asks for a call (returned)."""
        row, tok = self.rows[i], self.tools.tokenizer
        if not ids:
            raise RuntimeError(f"row {i} sampled no token in turn {self.turn}")
        row.token_ids += ids
        row.roles += [Role.SAMPLED] * len(ids)
        row.logprobs += list(lps) if lps is not None else [None] * len(ids)
        row.sampled += len(ids)
        text = tok.decode(ids, skip_special_tokens=True)
        if ids[-1] == tok.eos_token_id:
            row.finish_reason = "stop"
            row.void_turns += not text.strip()  # EOS with nothing said
            return None
        stop, end = _first_stop(text, self.stops)
        if stop is not None and stop not in self.tools.env.stop_strings:  # the task's: an answer
            row.finish_reason = "stop"
            return None
        if stop is not None:
            call = self.tools.env.parse(text[:end])
            if call is None:  # the environment's stop string with no request in the turn
                row.finish_reason = "stop"
                row.void_turns += 1
            return call
        # neither EOS nor a stop string: the budget ran out
        row.finish_reason = "length" if row.sampled >= self.max_tokens else "max_response_tokens"
        return None

    def _may_call(self, i: int) -> bool:
        """Whether row ``i``'s request runs, or (a cap) ends its response."""
        row = self.rows[i]
        if len(row.calls) >= self.tools.max_tool_calls:
            row.finish_reason = "max_tool_calls"
        elif len(row.turn_starts) >= self.tools.max_turns:
            row.finish_reason = "max_turns"
        elif row.sampled >= self.max_tokens:  # no token left to sample after the output
            row.finish_reason = "length"
        elif len(row.token_ids) >= self.tools.max_response_tokens:  # no room for another token
            row.finish_reason = "max_response_tokens"
        return row.finish_reason is None

    def _run_calls(self, asks: list[tuple[int, Any]]) -> dict[int, list[int]]:
        """Run the batch, tokenize each result once, insert what fits."""
        tools = self.tools
        limit = OutputLimit(max_tokens=tools.max_tool_output_tokens, count_tokens=tools.count_tokens)
        t0 = time.perf_counter()
        results = tools.env.execute([(self.rows[i].state, call) for i, call in asks], limit)
        wall = time.perf_counter() - t0
        self.tool_seconds += wall
        if len(results) != len(asks):
            raise RuntimeError(
                f"tool environment {tools.env.name!r}: {len(results)} results for {len(asks)} calls"
            )
        inserted = {}
        for (i, call), result in zip(asks, results):
            row = self.rows[i]
            text, ids, cut = self._tokens_of(result.text)
            fits = len(row.token_ids) + len(ids) + 1 <= tools.max_response_tokens  # and one more sampled
            record = ToolCallRecord(
                turn=len(row.turn_starts) - 1,
                request=call.request,
                text=text,
                ok=result.ok,
                status=result.status,
                truncated=result.truncated or cut,
                seconds=result.seconds,
                batch_seconds=wall / len(asks),
                inserted=len(ids) if fits else 0,
            )
            row.calls.append(record)
            if not fits:
                row.finish_reason = "max_response_tokens"
                continue
            row.token_ids += ids
            row.roles += [Role.INSERTED] * len(ids)
            row.turn_starts.append(len(row.token_ids))
            inserted[i] = ids
        return inserted

    def _tokens_of(self, text: str) -> tuple[str, list[int], bool]:
        """``(text, its ids, whether the rollout cut it)``: the result's text tokenized once; an
        environment that returned more than ``max_tool_output_tokens`` (the built-in ones never
        do: they cut inside their wrapping) is cut here, with the marker, and as a last resort
        by tokens."""
        cap = self.tools.max_tool_output_tokens
        ids = self.tools.encode(text)
        if len(ids) <= cap:
            return text, ids, False
        text, _ = truncate(text, OutputLimit(max_tokens=cap, count_tokens=self.tools.count_tokens))
        ids = self.tools.encode(text)[:cap]
        return text, ids, True

    # -- the result -----------------------------------------------------------------------------

    def trajectories(self, policy_version: int | list[int | None] | None = 0) -> list[Trajectory]:
        """``[rows]`` the finished responses, in row order; ``policy_version`` one for all rows or
        one per row (the oldest weights that sampled it)."""
        tok, out = self.tools.tokenizer, []
        versions = policy_version if isinstance(policy_version, list) else [policy_version] * len(self.rows)
        for i, row in enumerate(self.rows):
            if row.finish_reason is None:
                raise RuntimeError(f"row {i} has not finished")
            lps = None if any(x is None for x in row.logprobs) else list(row.logprobs)
            out.append(
                Trajectory(
                    row.prompt_ids,
                    row.token_ids,
                    roles=row.roles,
                    sampler_logprobs=lps,
                    turn_starts=row.turn_starts,
                    finish_reason=row.finish_reason,
                    text=tok.decode(row.token_ids, skip_special_tokens=True),
                    policy_version=versions[i] or 0,
                    tool_calls=row.calls,
                    void_turns=row.void_turns,
                )
            )
        return out


def demonstrations(
    tools: ToolRollout, prompts: list[list[int]], texts: list[str], max_tokens: int
) -> list[Trajectory]:
    """``[B]`` written-out responses as trajectories, for supervised training on tool use: each
    text is the model's part of a response (``"<calc>12*34</calc>408"``), cut after each of the
    environment's stop strings into turns whose tokens are sampled (labels); after a turn that
    asks for a call, the call runs and its output is inserted, exactly as in a rollout (the same
    ``Turns``: one batch of calls per turn, the same caps); EOS ends the last turn. Turns beyond
    a cap or ``max_tokens`` are dropped.

    Example:
        >>> from grpo_fast.env import make_environment
        >>> from grpo_fast.task import tiny
        >>> tok = tiny.build_tokenizer(tiny.TOOLS_NAME)
        >>> tools = ToolRollout(make_environment("calculator"), tok, 2, 3, 16, 64)
        >>> [t] = demonstrations(tools, [tok("12*34=")["input_ids"]], ["<calc>12*34</calc>408"], 32)
        >>> t.text, t.num_turns, t.num_inserted
        ('<calc>12*34</calc><result>408</result>408', 2, 5)
    """
    tok = tools.tokenizer
    pieces = [_pieces(text, tools.env.stop_strings) for text in texts]
    turns = Turns(
        tools, prompts, SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=max_tokens, min_tokens=0)
    )
    while turns.running():
        outputs = {}
        for i in turns.running():
            k = len(turns.rows[i].turn_starts) - 1  # this row's turn
            ids = tools.encode(pieces[i][k]) if k < len(pieces[i]) else []
            if k >= len(pieces[i]) - 1 or not ids:
                ids = [*ids, tok.eos_token_id]
            ids = ids[: turns.budget(i)]
            outputs[i] = (ids, None)
        turns.end_turn(outputs)
    return turns.trajectories()


def _pieces(text: str, stops: tuple[str, ...]) -> list[str]:
    """``text`` cut after each occurrence of one of ``stops`` (the last piece may be empty)."""
    pieces, rest = [], text
    while True:
        stop, end = _first_stop(rest, stops)
        if stop is None:
            return [*pieces, rest]
        pieces.append(rest[:end])
        rest = rest[end:]


def _first_stop(text: str, stops: tuple[str, ...]) -> tuple[str | None, int]:
    """The stop string whose first occurrence in ``text`` ends first, and where it ends (the
    one a sampler stopping at the first completed stop string stopped on)."""
    best, end = None, len(text) + 1
    for s in stops:
        k = text.find(s)
        if k >= 0 and k + len(s) < end:
            best, end = s, k + len(s)
    return best, end


def tool_sums(trajectories: list[Trajectory]) -> dict[str, float]:
    """Counts over responses, to sum over ranks before ``tool_metrics`` reads them."""
    reasons = [t.finish_reason for t in trajectories]
    sums = {
        "responses": len(trajectories),
        "calls": sum(len(t.tool_calls) for t in trajectories),
        "failed": sum(not c.ok for t in trajectories for c in t.tool_calls),
        "truncated": sum(c.truncated for t in trajectories for c in t.tool_calls),
        "calling": sum(bool(t.tool_calls) for t in trajectories),
        "turns": sum(t.num_turns for t in trajectories),
        "inserted": sum(t.num_inserted for t in trajectories),
        "tokens": sum(t.num_tokens for t in trajectories),
        "tool_seconds": sum(c.batch_seconds for t in trajectories for c in t.tool_calls),
        "void": sum(t.void_turns > 0 for t in trajectories),
    }
    sums.update({f"finish:{r}": reasons.count(r) for r in CAP_REASONS})
    return {k: float(v) for k, v in sums.items()}


def tool_metrics(sums: dict[str, float], ranks: int = 1) -> dict[str, float]:
    """The ``rollout/`` metrics of tool use from ``tool_sums`` (summed over ``ranks`` ranks):
    calls per response and the share of responses that call, the share of calls that failed or
    were cut, turns per response, the share of response tokens a tool inserted, the seconds a
    rank's rollout waited for tools, the share of responses with a void turn, and the share that
    each cap ended."""
    n, calls = max(sums["responses"], 1.0), max(sums["calls"], 1.0)
    out = {
        "rollout/tool_calls_mean": sums["calls"] / n,
        "rollout/tool_call_rate": sums["calling"] / n,
        "rollout/tool_error_fraction": sums["failed"] / calls,
        "rollout/tool_output_truncated_fraction": sums["truncated"] / calls,
        "rollout/turns_mean": sums["turns"] / n,
        "rollout/inserted_token_fraction": sums["inserted"] / max(sums["tokens"], 1.0),
        "rollout/tool_seconds": sums["tool_seconds"] / ranks,
        "rollout/void_turn_fraction": sums["void"] / n,
    }
    out.update({f"rollout/finish_{r}": sums[f"finish:{r}"] / n for r in CAP_REASONS})
    return out


def turn_texts(trajectory: Trajectory, decode: Callable[[list[int]], str]) -> list[dict[str, str]]:
    """``[K]`` each turn of a response as ``{"sampled": text, "inserted": text}`` (the inserted
    text empty after the last turn), for sample dumps and reports."""
    ids, roles = trajectory.token_ids, trajectory.role_list
    bounds = [*trajectory.turn_starts, len(ids)]
    turns = []
    for a, b in itertools.pairwise(bounds):
        sampled = [x for x, r in zip(ids[a:b], roles[a:b]) if r == Role.SAMPLED]
        inserted = [x for x, r in zip(ids[a:b], roles[a:b]) if r == Role.INSERTED]
        turns.append({"sampled": decode(sampled), "inserted": decode(inserted)})
    return turns
