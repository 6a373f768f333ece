"""Reward functions: ``reward_fn(response, ground_truth) -> {"reward": float, ...}``.

Registered rewards (``REWARD_FNS``; add your own with ``@register_reward("name")``):

``r1_zero``
    For the ``r1_zero`` prompt. ``format_reward`` is 1 when the response holds
    ``</think> <answer>`` and a closed ``<answer>…</answer>`` pair. The answer is the text of
    the LAST such pair, unboxed when it holds ``\\boxed{…}``; ``answer_reward`` is 1 when it is
    equivalent to the ground truth (``is_equivalent``). ``reward = format_reward · answer_reward``:
    an unformatted response scores 0 even when its answer is right.
``boxed``
    For the ``math_tir`` prompt (tool-integrated reasoning): the last ``\\boxed{…}`` outside the
    response's ```` ```python ```` / ```` ```output ```` blocks, graded as ``r1_zero``'s answer;
    ``format_reward`` is 1 when there is one; ``reward = answer_reward``.
``gsm8k``
    Numeric: the last number inside the last ``<answer>…</answer>`` if there is one, else the
    last number in the response, compared to the ground truth as an exact rational (commas
    stripped, so ``1,000 = 1000.0``). ``format_reward`` is the ``r1_zero`` format check, reported
    but not required: ``reward = answer_reward``.

Grading (``is_equivalent``) runs cheapest first and stops at the first verdict:

1. normalized string match (``normalize_answer``: ``\\dfrac``→``\\frac``, ``\\left``/``\\right``,
   ``\\text{}``, units, ``^\\circ``, ``\\%``, ``\\$``, thousands separators, ``x =`` prefixes, …);
2. two plain numbers (integers, decimals, ``a/b``, ``\\frac{a}{b}``) are compared exactly, or
   after rounding to 6 decimals when one is written as a decimal — a final verdict either way;
3. symbolic equivalence with math-verify (``(x+1)^2 = x^2+2x+1``, intervals, sets, matrices)
   in a worker process under a hard time limit (``MathGrader``), so grading never hangs, on
   the main thread or off it. Inputs known to be slow (over ``MAX_SYMBOLIC_CHARS``
   characters, brackets nested deeper than ``MAX_NESTING``, numeric exponent towers, 6-digit
   exponents, factorials of factorials) skip this step and count as not equivalent.

A reward function may also take the whole example and the trajectory, as keyword arguments
``example`` (``grpo_fast.task.data.Example``: question, answer, solution, difficulty) and
``trajectory`` (``grpo_fast.rollout.Trajectory``: its token ids and roles, turns, finish reason,
the tool calls of a multi-turn response): declare either (or ``**context``) and it is passed;
a ``(response, ground_truth)`` function is called as it always was.

Reward functions never raise on any response or ground-truth string and always return floats.
The loop calls every reward, registered or your own, through ``GuardedReward``: one that raises
or returns a non-number stops the run with one line naming it and the response
(``data.reward_errors=zero``: that response scores 0 and is counted in ``train/reward_errors``).
``score_batch`` scores a batch with up to N calls at once (the grader keeps up to N worker
processes, ``grpo_fast.sandbox.WorkerPool``), each score the one a one-by-one call gives.

Several rewards with weights (``data.reward`` a list, ``data.reward_weights``) are one
``WeightedReward``: ``reward = Σ_k w_k·reward_k``, each part guarded on its own and reported as
``"reward/NAME"`` (its unweighted reward) beside the sum.
"""

from __future__ import annotations

import atexit
import inspect
import json
import math
import re
import sys
from collections.abc import Callable, Mapping
from fractions import Fraction

from grpo_fast.errors import ConfigError, RewardError
from grpo_fast.sandbox.pool import default_workers, ordered_map
from grpo_fast.sandbox.worker import DIE_WITH_PARENT, WorkerPool

__all__ = [
    "MAX_NESTING",
    "MAX_SYMBOLIC_CHARS",
    "REWARD_FNS",
    "GuardedReward",
    "MathGrader",
    "RewardFn",
    "WeightedReward",
    "extract_boxed",
    "extract_last_number",
    "get_reward_fn",
    "gsm8k_reward_fn",
    "is_equivalent",
    "normalize_answer",
    "parse_r1_zero_response",
    "r1_zero_reward_fn",
    "register_reward",
    "score_batch",
]

RewardFn = Callable[[str, str], dict[str, float]]

MAX_SYMBOLIC_CHARS = 400  # longer answers are graded by string/number match only
MAX_NESTING = 12  # deeper {}/()/[] nesting: parse time grows fast (300 levels of \frac ≈ 1.2 s)

# ----------------------------------------------------------------------------------------------
# Extraction
# ----------------------------------------------------------------------------------------------

_BOXED_CMDS = ("\\boxed", "\\fbox")


def extract_boxed(text: str) -> str | None:
    """Content of the last ``\\boxed{…}``, ``\\boxed …`` or ``\\fbox{…}`` in ``text``, or None.

    Braces are matched with escapes honored (``\\boxed{\\{1,2\\}}`` → ``\\{1,2\\}``). An unclosed
    last box gives None. Linear in ``len(text)``.

    Example:
        >>> extract_boxed("so $x = \\\\boxed{\\\\frac{1}{2}}$.")
        '\\\\frac{1}{2}'
        >>> extract_boxed("\\\\boxed 5$") , extract_boxed("no box") , extract_boxed("\\\\boxed{1")
        ('5', None, None)
    """
    start, cmd = max((text.rfind(c), c) for c in _BOXED_CMDS)
    if start < 0:
        return None
    i = start + len(cmd)
    if text.startswith(" ", i):  # "\boxed 5": one bare token
        token = text[i:].lstrip().split("$", 1)[0].split(None, 1)
        return token[0] if token else None
    if not text.startswith("{", i):
        return None
    depth = 0
    j = i
    while j < len(text):
        ch = text[j]
        if ch == "\\":
            j += 2  # an escaped character (\{, \}, \\) never opens or closes a group
            continue
        if ch == "{":
            depth += 1
        elif ch == "}":
            depth -= 1
            if depth == 0:
                return text[i + 1 : j]
        j += 1
    return None


_NUMBER_RE = re.compile(r"(?<![\w.])-?(?:\d{1,3}(?:,\d{3})+(?![\d])|\d+)(?:\.\d+)?|(?<![\w.])-?\.\d+")


def extract_last_number(text: str) -> Fraction | None:
    """The last number in ``text`` as an exact rational (commas stripped), or None.

    None also when that number is longer than 40 characters (no grader needs that).

    Example:
        >>> extract_last_number("3 apples cost $1,250.50, so -2 left")
        Fraction(-2, 1)
    """
    matches = _NUMBER_RE.findall(text)
    return _to_fraction(matches[-1].replace(",", "")) if matches else None


def parse_r1_zero_response(response: str) -> tuple[bool, str | None]:
    """``(formatted, answer)`` for an ``r1_zero`` response.

    ``answer`` is the text of the last closed ``<answer>…</answer>`` pair (None if there is
    none); ``formatted`` additionally needs ``</think> <answer>`` somewhere in the response.

    Example:
        >>> parse_r1_zero_response("2+2 is 4 </think> <answer> 4 </answer>")
        (True, ' 4 ')
    """
    end = response.rfind("</answer>")
    begin = response.rfind("<answer>", 0, end) if end >= 0 else -1
    if begin < 0:
        return False, None
    return "</think> <answer>" in response, response[begin + len("<answer>") : end]


# ----------------------------------------------------------------------------------------------
# Normalization and cheap comparisons
# ----------------------------------------------------------------------------------------------

_SIZING_RE = re.compile(r"\\(?:left|right|bigl|bigr|Bigl|Bigr|big|Big|bigg|Bigg)(?![a-zA-Z])")
_SPACING_RE = re.compile(r"\\\\|\\[,;:! ]|~|\\(?:quad|qquad|displaystyle)(?![a-zA-Z])")
_TEXT_RE = re.compile(
    r"\\(?:text|textbf|textit|textrm|textnormal|mathrm|mathbf|mbox|operatorname)\s*\{([^{}]*)\}"
)
_UNIT_CMDS = ("\\text", "\\mbox", "\\mathrm")
_UNIT_TAIL_RE = re.compile(r"\\(?:text|mbox|mathrm)\s*\{\s*[a-zA-Z][a-zA-Z .]*\}(?:\^\{?\d\}?)?\s*")
_DEGREE_RE = re.compile(r"\^\s*\{\s*\\circ\s*\}|\^\s*\\circ|\\circ|°|\\degree(?![a-zA-Z])")
_THOUSANDS_RE = re.compile(r"^-?\d{1,3}(?:,\d{3})+(?:\.\d+)?$")
_WHITESPACE_RE = re.compile(r"\s+")
_LONE_SPACE_RE = re.compile(r"(?<![a-zA-Z]) | (?![a-zA-Z])")  # keep a space between two letters
_FRAC_SHORT_RE = (
    (re.compile(r"\\frac(\d)(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\frac(\d)\{"), r"\\frac{\1}{"),
    (re.compile(r"\\frac\{([^{}]*)\}(\d)"), r"\\frac{\1}{\2}"),
    (re.compile(r"\\sqrt(\d)"), r"\\sqrt{\1}"),
)
_DECIMAL_RE = re.compile(r"^-?(?:\d+(?:\.\d*)?|\.\d+)$")
_RATIO_RE = re.compile(r"^(-?\d+)/(\d+)$|^(-?)\\frac\{(-?\d+)\}\{(\d+)\}$")
_MAX_NUMBER_CHARS = 40  # Fraction() of a 100k-digit string is slow (and over int's digit limit)


def normalize_answer(answer: str) -> str:
    """Canonical string form of a final answer, for exact-match grading.

    Unboxes, drops sizing (``\\left``), spacing (``\\,``, ``\\!``), ``\\text{}`` wrappers, a
    trailing unit (``10\\text{ cm}`` → ``10``), degrees, ``\\%``, ``\\$``, a trailing period, a
    one-letter assignment (``x = 3`` → ``3``) and thousands separators (``1,000`` / ``1{,}000``);
    ``\\dfrac``/``\\tfrac`` → ``\\frac``, ``\\frac12`` → ``\\frac{1}{2}``, ``\\sqrt2`` → ``\\sqrt{2}``,
    ``.5`` → ``0.5``; whitespace is removed except between two letters.

    Example:
        >>> normalize_answer("\\\\boxed{\\\\dfrac12}") , normalize_answer("x = 1{,}000 \\\\text{ cm}.")
        ('\\\\frac{1}{2}', '1000')
    """
    s = answer.strip()
    boxed = extract_boxed(s)
    if boxed is not None:
        s = boxed
    s = _SIZING_RE.sub("", s)
    s = _SPACING_RE.sub(lambda m: m.group() if m.group() == "\\\\" else " ", s)  # keep "\\" rows
    s = s.replace("\\dfrac", "\\frac").replace("\\tfrac", "\\frac").replace("{,}", ",")
    s = _DEGREE_RE.sub("", s)
    s = s.replace("\\%", "").replace("%", "").replace("\\$", "").replace("$", "")
    s = _strip_unit(s.strip().rstrip(".").rstrip())
    for _ in range(4):  # nested \text{\textbf{…}}: peel a few levels, each pass is linear
        s, n = _TEXT_RE.subn(r"\1", s)
        if not n:
            break
    head, eq, tail = s.partition("=")
    if eq and len(head.strip()) == 1 and head.strip().isalpha() and "=" not in tail:  # "x = 3"
        s = tail
    s = _LONE_SPACE_RE.sub("", _WHITESPACE_RE.sub(" ", s).strip())
    for pattern, repl in _FRAC_SHORT_RE:
        s = pattern.sub(repl, s)
    if _THOUSANDS_RE.match(s):
        s = s.replace(",", "")
    if s.startswith(".") or s.startswith("-."):
        s = s.replace(".", "0.", 1)
    if len(s) == 3 and s[0] == "(" and s[2] == ")" and s[1].isalpha():  # "(A)" → "A"
        s = s[1]
    return s


def _strip_unit(s: str) -> str:
    """Drop a trailing ``\\text{ unit}`` (optionally squared/cubed) that follows a number.

    String search, not one regex over the whole answer: a backtracking pattern like
    ``^(.*\\d.*?)\\s*\\text…$`` is quadratic on a 100k-character answer full of digits.
    """
    cut = max(s.rfind(cmd) for cmd in _UNIT_CMDS)
    if cut > 0 and _UNIT_TAIL_RE.fullmatch(s, cut) and any(ch.isdigit() for ch in s[:cut]):
        return s[:cut]
    return s


def _to_fraction(s: str) -> Fraction | None:
    """``s`` as an exact rational if it is a plain number (``-3``, ``0.25``, ``1/4``, ``\\frac{1}{4}``)."""
    if len(s) > _MAX_NUMBER_CHARS:
        return None
    if _DECIMAL_RE.match(s):
        return Fraction(s)
    m = _RATIO_RE.match(s)
    if not m:
        return None
    if m.group(1) is not None:
        num, den = int(m.group(1)), int(m.group(2))
    else:
        num, den = int(m.group(4)) * (-1 if m.group(3) else 1), int(m.group(5))
    return Fraction(num, den) if den else None


def _numbers_equal(a: str, fa: Fraction, b: str, fb: Fraction) -> bool:
    """Exact equality, or equality after rounding to 6 decimals when one side is a decimal."""
    if fa == fb:
        return True
    return ("." in a or "." in b) and round(float(fa), 6) == round(float(fb), 6)


# Numbers too big to build: numeric exponent towers (9^{9^9}, 9^9^9; symbolic ones such as
# e^{x^2} are fine), 6+ digit exponents or factorials, factorials of factorials or of powers
# ((10!)!, (10^{10})!).
_HUGE_RE = re.compile(
    r"\d\s*\^\s*\{\s*\d+\s*\^|\d\s*\^\s*\d+\s*\^|\^\s*\{?\s*\d{6}|\d{6}\s*!"
    r"|\([^()]*[!^][^()]*\)\s*!|\{[^{}]*[!^][^{}]*\}\s*!"
)


def _too_costly(s: str) -> bool:
    """True for answers math-verify may take seconds (or forever) on: see ``MAX_*``.

    ``9^{9^{9^9}}``, ``9^9^9``, ``9^{99999999}`` make sympy build astronomically large
    integers inside C code that no signal can interrupt.
    """
    if len(s) > MAX_SYMBOLIC_CHARS or _HUGE_RE.search(s):
        return True
    depth = 0
    for ch in s:
        if ch in "{([":
            depth += 1
            if depth > MAX_NESTING:
                return True
        elif ch in "})]":
            depth = max(depth - 1, 0)
    return False


# ----------------------------------------------------------------------------------------------
# Symbolic equivalence in a time-limited worker process
# ----------------------------------------------------------------------------------------------

# The worker imports only math-verify (≈0.5 s to start, vs ≈1.5 s for anything importing the
# grpo_fast package, which pulls in torch). Protocol, one JSON line per request on stdin:
# [gold, pred, soft_timeout_s] -> "1" or "0" on stdout. The soft timeout (SIGALRM, fine on the
# worker's main thread) interrupts slow Python-level work and keeps the worker; the parent's
# hard timeout kills it when C code that never checks for signals (one huge big-integer
# multiplication, a regex backtracking in a parser) holds on.
# Written against math-verify 0.9.0: parse(..., parsing_timeout=None) and
# verify(..., timeout_seconds=None) turn off its own signal.alarm timeouts.
_WORKER_SOURCE = (
    DIE_WITH_PARENT
    + r"""
import json, logging, signal, sys
logging.disable(logging.CRITICAL)
reply, sys.stdout = sys.stdout, sys.stderr  # stray prints must not corrupt the protocol
from math_verify import parse, verify

class Deadline(BaseException):
    pass

def on_alarm(signum, frame):
    raise Deadline

def equivalent(gold, pred):
    g = parse("\\boxed{" + gold + "}", parsing_timeout=None)
    p = parse("\\boxed{" + pred + "}", parsing_timeout=None)
    return bool(g) and bool(p) and verify(g, p, timeout_seconds=None)

signal.signal(signal.SIGALRM, on_alarm)
equivalent("\\frac{1}{2}", "x+1")  # load sympy's lazy parts before reporting ready
reply.write("ready\n")
reply.flush()
for line in sys.stdin:
    gold, pred, soft_s = json.loads(line)
    ok = False
    try:
        signal.setitimer(signal.ITIMER_REAL, soft_s)
        try:
            ok = equivalent(gold, pred)
        finally:
            signal.setitimer(signal.ITIMER_REAL, 0)
    except (Deadline, Exception):
        pass
    reply.write("1\n" if ok else "0\n")
    reply.flush()
"""
)


class MathGrader:
    """Symbolic answer equivalence (math-verify) with a hard per-call time limit.

    Up to ``workers`` worker processes (``grpo_fast.sandbox.WorkerPool``), started when first
    needed, each serving one call at a time: the grader is safe to share between threads, and
    that many calls run at once. A call that does not answer within ``timeout_s`` returns False;
    its worker is killed and a fresh one started at once, so the next call waits only for what
    is left of its start-up (≈0.5 s).

    Args:
        timeout_s: hard limit per comparison, in seconds: past it the worker is killed.
        soft_timeout_s: the worker's own limit (SIGALRM), which interrupts Python-level work
            without losing the worker; below ``timeout_s`` so it normally fires first.
        startup_timeout_s: how long to wait for a worker to start before raising.
        workers: worker processes at most (each ≈60 MB once math-verify is loaded).

    Example:
        >>> MathGrader().equivalent("(x+1)^2", "x^2+2x+1")  # doctest: +SKIP
        True
    """

    def __init__(
        self,
        timeout_s: float = 1.0,
        soft_timeout_s: float = 0.6,
        startup_timeout_s: float = 60.0,
        workers: int = 1,
    ):
        self.timeout_s = timeout_s
        self.soft_timeout_s = soft_timeout_s
        self._pool = WorkerPool(
            [sys.executable, "-W", "ignore", "-c", _WORKER_SOURCE],
            size=workers,
            startup_timeout_s=startup_timeout_s,
            name="math grading worker",
        )

    def equivalent(self, gold: str, pred: str) -> bool:
        """True if math-verify proves ``pred`` equal to ``gold`` within ``timeout_s``."""
        request = json.dumps([gold, pred, self.soft_timeout_s]).encode() + b"\n"
        return self._pool.request(request, self.timeout_s) == b"1"

    def close(self) -> None:
        """Stop the workers (a later call starts new ones)."""
        self._pool.close()

    @property
    def _proc(self):
        """The first worker's process (None before the first call)."""
        return self._pool.workers[0].proc if self._pool.workers else None


_GRADER = MathGrader(workers=default_workers(cap=4))  # one per concurrent scorer (score_batch)
atexit.register(_GRADER.close)


def is_equivalent(pred: str, gold: str, grader: MathGrader | None = None) -> bool:
    """Whether the answer ``pred`` matches the ground truth ``gold`` (both may be LaTeX).

    String match, then plain-number match, then symbolic equivalence (see the module
    docstring). Never raises; takes at most ``grader.timeout_s`` (+ process start-up after a
    timed-out call) however pathological the input.

    Example:
        >>> is_equivalent("0.5", "\\\\dfrac{1}{2}"), is_equivalent("1,000", "1000")
        (True, True)
    """
    p, g = normalize_answer(pred), normalize_answer(gold)
    if not p or not g:
        return False
    if p == g:
        return True
    fp, fg = _to_fraction(p), _to_fraction(g)
    if fp is not None and fg is not None:
        return _numbers_equal(p, fp, g, fg)
    if _too_costly(p) or _too_costly(g):
        return False
    return (grader or _GRADER).equivalent(g, p)


# ----------------------------------------------------------------------------------------------
# Reward functions and their registry
# ----------------------------------------------------------------------------------------------

REWARD_FNS: dict[str, RewardFn] = {}


def correct(scores: Mapping) -> float:
    """Whether a response solved its problem, from what the reward function returned for it: the
    one rule that the pass rates, the step's ``train/accuracy`` and evaluation's ``accuracy`` read
    (the loop sets it on each trajectory where it scores it, ``Trajectory.correct``). The reward's
    ``answer_reward`` when it reports one; else 1.0 when its ``reward`` is full (≥ 1), 0.0 if not.
    Never the shaped reward (overlong, tool-error or KL terms move a reward, not correctness).

        >>> correct({"reward": 0.0, "answer_reward": 1.0}), correct({"reward": 1.0}), correct({"reward": 0.5})
        (1.0, 1.0, 0.0)
    """
    if "answer_reward" in scores:
        return float(scores["answer_reward"])
    return float(float(scores["reward"]) >= 1.0)


def register_reward(name: str) -> Callable[[RewardFn], RewardFn]:
    """Decorator: register ``reward_fn(response, ground_truth) -> {"reward": float, ...}``.

    Example:
        >>> @register_reward("exact")  # doctest: +SKIP
        ... def exact(response, ground_truth):
        ...     return {"reward": float(response.strip() == ground_truth)}
    """

    def decorator(fn: RewardFn) -> RewardFn:
        if REWARD_FNS.get(name, fn) is not fn:
            raise ValueError(f"a different reward function is already registered as {name!r}")
        REWARD_FNS[name] = fn
        return fn

    return decorator


def get_reward_fn(name: str) -> RewardFn:
    """The registered reward function ``name``.

    Raises:
        ConfigError: unknown name (the message lists the registered ones).
    """
    try:
        return REWARD_FNS[name]
    except KeyError:
        raise ConfigError(
            f"unknown reward {name!r}: registered rewards are {', '.join(sorted(REWARD_FNS))}"
        ) from None


class GuardedReward:
    """A reward function as the loop calls it: one that raises, or returns anything but a mapping
    whose ``"reward"`` is a finite number, stops the run with one line (``RewardError``) naming
    the function, the problem and the response — unless ``on_error="zero"``
    (``data.reward_errors=zero``), which scores that response 0 and counts it.

    ``for_batch(step)`` gives the callable for one rollout batch: it knows each response's index
    and counts the batch's errors (``train/reward_errors``). Called directly (evaluation, sample
    dumps) the guard is the same, without an index.

    Example:
        >>> guard = GuardedReward(lambda r, g: {"reward": 1 / len(r)}, "inverse_length", "zero")
        >>> score = guard.for_batch(step=1)
        >>> score("ab", "x"), score("", "x"), score.errors
        ({'reward': 0.5}, {'reward': 0.0}, 1)
    """

    def __init__(self, fn: RewardFn, name: str, on_error: str = "raise"):
        if on_error not in ("raise", "zero"):
            raise ValueError(f"on_error must be raise or zero, not {on_error!r}")
        self.fn, self.name, self.on_error = fn, name, on_error
        self.context = context_arguments(fn)  # which of example / trajectory it takes
        self._zero: dict[str, float] = {"reward": 0.0}  # an error's score: 0 for each key seen

    @property
    def concurrent(self) -> bool:
        """Whether ``data.reward_workers=auto`` may run it on threads: a reward built into
        grpo_fast (stateless, its grader in worker processes), not a user's own function."""
        return getattr(self.fn, "__module__", "").startswith("grpo_fast.")

    def for_batch(self, step: int) -> _BatchReward:
        return _BatchReward(self, step)

    def __call__(self, response: str, ground_truth: str, **context) -> dict[str, float]:
        return self.score(response, ground_truth, where="", **context)[0]

    def score(self, response: str, ground_truth: str, where: str, **context) -> tuple[dict[str, float], bool]:
        """``(score dict, whether it is a tolerated error's zeros)`` for one response; ``where``
        (e.g. ``"response 5 of step 3's rollout batch"``) goes into the error message;
        ``context`` (``example``, ``trajectory``): passed on where the function takes them."""
        return self.settle(self.call(response, ground_truth, **context), response, ground_truth, where)

    def call(self, response: str, ground_truth: str, **context) -> tuple[object, str | None]:
        """``(what the function returned, what is wrong with it or None)``: the part of ``score``
        that ``score_batch`` runs on several threads (it changes no state)."""
        try:
            out = self.fn(response, ground_truth, **{k: v for k, v in context.items() if k in self.context})
            return out, _not_a_score(out)
        except Exception as exc:  # the user's code: whatever it raises is reported, not a traceback
            return None, f"raised {type(exc).__name__}: {exc}"

    def settle(
        self, called: tuple[object, str | None], response: str, ground_truth: str, where: str
    ) -> tuple[dict[str, float], bool]:
        """The rest of ``score``, in response order: the error's zeros (the keys seen so far) or
        the ``RewardError``."""
        out, problem = called
        if problem is None:
            if out.keys() != self._zero.keys():  # the same keys as the others (averaged per key)
                self._zero = {k: 0.0 for k, v in out.items() if isinstance(v, (int, float))}
            return out, False
        if self.on_error == "zero":
            return dict(self._zero), True
        at = f" on {where}" if where else ""
        raise RewardError(
            f"reward function {self.name!r} {problem}{at} (response {response[:60]!r}, ground truth "
            f"{ground_truth[:60]!r}); fix it, or set data.reward_errors=zero to score such responses 0 "
            "(counted in train/reward_errors)"
        )


class WeightedReward:
    """Several guarded reward functions as one: ``reward = Σ_k w_k·reward_k``.

    Each call returns ``{"reward": Σ_k w_k·r_k, "reward/NAME_k": r_k, ...}``: ``r_k`` is part
    ``k``'s own (unweighted) ``"reward"``, and every other key (``format_reward``,
    ``answer_reward``) is taken from the first part that returns it, so ``[r1_zero, bonus]``
    keeps ``r1_zero``'s accuracy keys. Each part keeps its guard: a failing part stops the run
    with the line naming that part's function, or (``data.reward_errors=zero``) scores that part
    0 and counts one error, the other parts' scores standing.

    ``names`` (default: each part's ``name``) are the NAMEs of ``"reward/NAME"``.
    ``for_batch(step)`` gives the callable for one rollout batch, with ``errors`` (the failed
    part-calls of the batch, all parts together), ``errors_by_part`` and ``scores`` (every
    returned dict, in call order).

    Example:
        >>> length = GuardedReward(lambda r, g: {"reward": len(r) / 10}, "length")
        >>> exact = GuardedReward(lambda r, g: {"reward": float(r == g), "answer_reward": float(r == g)}, "exact")
        >>> both = WeightedReward([exact, length], [1.0, -0.5])
        >>> both("42", "42")  # 1·1 − 0.5·0.2 = 0.9
        {'reward': 0.9, 'reward/exact': 1.0, 'reward/length': 0.2, 'answer_reward': 1.0}
    """

    def __init__(
        self, parts: list[GuardedReward], weights: list[float] | None = None, names: list[str] | None = None
    ):
        weights = [1.0] * len(parts) if weights is None else [float(w) for w in weights]
        if not parts or len(weights) != len(parts):
            raise ValueError(f"{len(parts)} reward parts need as many weights, got {len(weights)}")
        names = [p.name for p in parts] if names is None else list(names)
        if len(names) != len(parts) or len(set(names)) != len(names):
            raise ValueError(f"reward part names must differ, got {names}")
        self.parts, self.weights, self.names = list(parts), weights, names
        self.name = " + ".join(f"{w:g}·{n}" for w, n in zip(weights, names))

    @property
    def concurrent(self) -> bool:
        return all(part.concurrent for part in self.parts)

    def for_batch(self, step: int) -> _BatchReward:
        return _BatchReward(self, step)

    def __call__(self, response: str, ground_truth: str, **context) -> dict[str, float]:
        return self.score(response, ground_truth, where="", **context)[0]

    def score(
        self, response: str, ground_truth: str, where: str, **context
    ) -> tuple[dict[str, float], list[str]]:
        """``(combined score dict, names of the parts whose error was scored 0)``."""
        return self.settle(self.call(response, ground_truth, **context), response, ground_truth, where)

    def call(self, response: str, ground_truth: str, **context) -> list[tuple[object, str | None]]:
        """Each part's ``GuardedReward.call``."""
        return [part.call(response, ground_truth, **context) for part in self.parts]

    def settle(
        self, called: list[tuple[object, str | None]], response: str, ground_truth: str, where: str
    ) -> tuple[dict[str, float], list[str]]:
        """Each part's ``GuardedReward.settle``, then the weighted sum."""
        out: dict[str, float] = {"reward": 0.0}
        extras: dict[str, float] = {}
        failed: list[str] = []
        for part, w, name, part_called in zip(self.parts, self.weights, self.names, called):
            s, bad = part.settle(part_called, response, ground_truth, where)
            if bad:
                failed.append(name)
            r = float(s["reward"])
            out["reward"] += w * r
            out[f"reward/{name}"] = r
            for k, v in s.items():
                if k != "reward":
                    extras.setdefault(k, v)
        out.update(extras)
        return out, failed


class _BatchReward:
    """``GuardedReward`` / ``WeightedReward`` for one rollout batch: numbers its responses,
    counts their errors (``errors``; per part: ``errors_by_part``), keeps what they scored
    (``scores``: one dict per call, in order)."""

    def __init__(self, guard: GuardedReward | WeightedReward, step: int):
        self.guard, self.step = guard, step
        self.index, self.errors = 0, 0
        names = guard.names if isinstance(guard, WeightedReward) else [guard.name]
        self.errors_by_part: dict[str, int] = dict.fromkeys(names, 0)
        self.scores: list[dict[str, float]] = []
        self.concurrent = guard.concurrent

    def __call__(self, response: str, ground_truth: str, **context) -> dict[str, float]:
        return self._record(self.guard.score(response, ground_truth, self._where(), **context))

    def score_batch(
        self, responses: list[str], ground_truths: list[str], workers: int, contexts: list[dict] | None = None
    ) -> list[dict[str, float]]:
        """``[self(r, g, **c) for r, g, c in zip(responses, ground_truths, contexts)]``, the reward
        functions run on up to ``workers`` threads; numbering, error counts and ``scores`` as one
        by one."""
        contexts = contexts or [{}] * len(responses)
        called = ordered_map(
            lambda item: self.guard.call(item[0], item[1], **item[2]),
            list(zip(responses, ground_truths, contexts)),
            workers,
        )
        return [
            self._record(self.guard.settle(c, r, g, self._where()))
            for c, r, g in zip(called, responses, ground_truths)
        ]

    def _where(self) -> str:
        where = f"response {self.index} of step {self.step}'s rollout batch"
        self.index += 1
        return where

    def _record(self, scored: tuple[dict[str, float], bool | list[str]]) -> dict[str, float]:
        out, failed = scored
        if isinstance(failed, bool):  # a single GuardedReward
            failed = [self.guard.name] if failed else []
        for name in failed:
            self.errors_by_part[name] += 1
        self.errors += len(failed)
        self.scores.append(out)
        return out


CONTEXT_ARGUMENTS = ("example", "trajectory")


def context_arguments(fn) -> frozenset[str]:
    """Which of ``CONTEXT_ARGUMENTS`` the reward function ``fn`` takes by keyword (all of them
    with ``**kwargs``; none for ``(response, ground_truth)``, or a callable whose signature
    cannot be read)."""
    try:
        params = inspect.signature(fn).parameters.values()
    except (TypeError, ValueError):
        return frozenset()
    if any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params):
        return frozenset(CONTEXT_ARGUMENTS)
    keyword = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)
    return frozenset(p.name for p in params if p.kind in keyword and p.name in CONTEXT_ARGUMENTS)


def score_batch(
    reward_fn: Callable[[str, str], dict[str, float]],
    responses: list[str],
    ground_truths: list[str],
    workers: int | None = None,
    contexts: list[dict] | None = None,
) -> list[dict[str, float]]:
    """Score ``responses[i]`` against ``ground_truths[i]`` with ``reward_fn``, up to ``workers``
    calls at once (default: this process's CPUs, at most 4); the scores in input order, each the
    dict a one-by-one call returns.

    ``reward_fn`` is the task's reward as the loop holds it — a ``for_batch(step)`` callable
    (its response numbers, error counts and ``scores`` come out as if called one by one: the
    functions run concurrently, the guard's bookkeeping and any ``RewardError`` in order), a
    ``GuardedReward`` / ``WeightedReward``, or any ``fn(response, ground_truth) -> dict``. The
    functions run on threads: the math grader (``is_equivalent``) runs that many worker
    processes; a user's function that keeps shared mutable state must lock it (or pass
    ``workers=1``: the calls then run one by one on this thread). ``contexts``: each response's
    ``example`` / ``trajectory`` keywords, for a reward function that takes them.

    Example:
        >>> score_batch(gsm8k_reward_fn, ["<answer> 4 </answer>", "5"], ["4", "4"], workers=2)
        [{'format_reward': 0.0, 'answer_reward': 1.0, 'reward': 1.0}, {'format_reward': 0.0, 'answer_reward': 0.0, 'reward': 0.0}]
    """
    responses, ground_truths = list(responses), list(ground_truths)
    if len(responses) != len(ground_truths):
        raise ValueError(f"{len(responses)} responses but {len(ground_truths)} ground truths")
    workers = workers or default_workers(cap=4)
    contexts = list(contexts) if contexts is not None else [{}] * len(responses)
    if isinstance(reward_fn, _BatchReward):
        return reward_fn.score_batch(responses, ground_truths, workers, contexts)
    items = list(zip(responses, ground_truths, contexts))
    if isinstance(reward_fn, (GuardedReward, WeightedReward)):
        called = ordered_map(lambda item: reward_fn.call(item[0], item[1], **item[2]), items, workers)
        return [reward_fn.settle(c, r, g, "")[0] for c, (r, g, _) in zip(called, items)]
    return ordered_map(lambda item: reward_fn(item[0], item[1]), items, workers)


def _not_a_score(out) -> str | None:
    """What is wrong with a reward function's return value, or None."""
    if not isinstance(out, Mapping):
        return f"returned {type(out).__name__} {out!r:.60}, not a dict with a 'reward' number"
    if "reward" not in out:
        return f"returned a dict without a 'reward' key (keys: {sorted(out)[:5]})"
    r = out["reward"]
    if isinstance(r, bool) or not isinstance(r, (int, float)):
        return f"returned reward {r!r:.60} ({type(r).__name__}), not a number"
    if not math.isfinite(r):
        return f"returned reward {r}, not a finite number"
    return None


def _scores(formatted: bool, correct: bool, reward: bool) -> dict[str, float]:
    return {"format_reward": float(formatted), "answer_reward": float(correct), "reward": float(reward)}


@register_reward("r1_zero")
def r1_zero_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """R1-Zero reward: format ``</think> <answer> … </answer>`` and a correct final answer.

    Returns ``{"format_reward", "answer_reward", "reward"}``, each 0.0 or 1.0, with
    ``reward = format_reward · answer_reward`` (see the module docstring).

    Example:
        >>> r1_zero_reward_fn("1/2 of 1 </think> <answer> \\\\boxed{0.5} </answer>", "\\\\frac{1}{2}")
        {'format_reward': 1.0, 'answer_reward': 1.0, 'reward': 1.0}
    """
    formatted, answer = parse_r1_zero_response(str(response))
    if not formatted:
        return _scores(False, False, False)
    correct = is_equivalent(answer, str(ground_truth))
    return _scores(True, correct, correct)


# a ```python or ```output block of a tool-integrated response (its closing fence optional)
_TOOL_BLOCK = re.compile(r"```(?:python|output)\b.*?(?:```|\Z)", re.DOTALL)


@register_reward("boxed")
def boxed_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """Tool-integrated reasoning (the ``math_tir`` prompt): the answer is the last ``\\boxed{}``
    of the response outside its ```` ```python ```` and ```` ```output ```` blocks (a box the code
    printed is not the model's answer); ``format_reward`` is 1 when there is one,
    ``answer_reward`` when it is equivalent to the ground truth (``is_equivalent``);
    ``reward = answer_reward``.

    Example:
        >>> boxed_reward_fn("```python\\nprint(1/2)\\n```\\n```output\\n0.5\\n```\\nSo \\\\boxed{\\\\frac12}.", "0.5")
        {'format_reward': 1.0, 'answer_reward': 1.0, 'reward': 1.0}
    """
    answer = extract_boxed(_TOOL_BLOCK.sub("", str(response)))
    correct = answer is not None and is_equivalent(answer, str(ground_truth))
    return _scores(answer is not None, correct, correct)


@register_reward("gsm8k")
def gsm8k_reward_fn(response: str, ground_truth: str) -> dict[str, float]:
    """GSM8K reward: the last number of the answer (or response) equals the ground truth.

    Returns ``{"format_reward", "answer_reward", "reward"}``, each 0.0 or 1.0, with
    ``reward = answer_reward`` (see the module docstring).

    Example:
        >>> gsm8k_reward_fn("so 1,000 - 28 = 972 </think> <answer> 972 </answer>", "972")
        {'format_reward': 1.0, 'answer_reward': 1.0, 'reward': 1.0}
    """
    response = str(response)
    formatted, answer = parse_r1_zero_response(response)
    pred = extract_last_number(answer if answer is not None else response)
    gold = extract_last_number(str(ground_truth))
    correct = pred is not None and pred == gold
    return _scores(formatted, correct, correct)
