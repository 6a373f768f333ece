"""Reward functions: ``reward_fn(response, ground_truth) -> {"reward": float, ...}``.

Registered rewards (``REWARD_FNS``; add your own with ``@register_reward("name")``):

``r1_zero``
    For the ``r1_zero`` prompt. ``format_reward`` is 1 when the response holds
    ``</think> <answer>`` and a closed ``<answer>…</answer>`` pair. The answer is the text of
    the LAST such pair, unboxed when it holds ``\\boxed{…}``; ``answer_reward`` is 1 when it is
    equivalent to the ground truth (``is_equivalent``). ``reward = format_reward · answer_reward``:
    an unformatted response scores 0 even when its answer is right.
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

Reward functions never raise on any response or ground-truth string and always return floats.
The loop calls every reward, registered or your own, through ``GuardedReward``: one that raises
or returns a non-number stops the run with one line naming it and the response
(``data.reward_errors=zero``: that response scores 0 and is counted in ``train/reward_errors``).

Several rewards with weights (``data.reward`` a list, ``data.reward_weights``) are one
``WeightedReward``: ``reward = Σ_k w_k·reward_k``, each part guarded on its own and reported as
``"reward/NAME"`` (its unweighted reward) beside the sum.
"""

from __future__ import annotations

import atexit
import json
import math
import os
import re
import select
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from fractions import Fraction

from grpo_fast.errors import ConfigError, RewardError

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
_WORKER_SOURCE = r"""
import json, logging, signal, sys
try:  # Linux: die with the parent, even when it is SIGKILLed (PR_SET_PDEATHSIG = 1)
    import ctypes
    ctypes.CDLL(None).prctl(1, signal.SIGKILL)
except (OSError, AttributeError):
    pass
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


class MathGrader:
    """Symbolic answer equivalence (math-verify) with a hard per-call time limit.

    One worker process, started on first use, serves calls one at a time (a lock makes the
    grader safe to share between threads). A call that does not answer within ``timeout_s``
    returns False; the worker is killed and a fresh one started at once, so the next call
    waits only for what is left of its start-up (≈0.5 s).

    Args:
        timeout_s: hard limit per comparison, in seconds: past it the worker is killed.
        soft_timeout_s: the worker's own limit (SIGALRM), which interrupts Python-level work
            without losing the worker; below ``timeout_s`` so it normally fires first.
        startup_timeout_s: how long to wait for a worker to start before raising.

    Example:
        >>> MathGrader().equivalent("(x+1)^2", "x^2+2x+1")  # doctest: +SKIP
        True
    """

    def __init__(self, timeout_s: float = 1.0, soft_timeout_s: float = 0.6, startup_timeout_s: float = 60.0):
        self.timeout_s = timeout_s
        self.soft_timeout_s = soft_timeout_s
        self.startup_timeout_s = startup_timeout_s
        self._lock = threading.Lock()
        self._proc: subprocess.Popen | None = None
        self._stderr = None
        self._ready = False
        self._buf = b""

    def equivalent(self, gold: str, pred: str) -> bool:
        """True if math-verify proves ``pred`` equal to ``gold`` within ``timeout_s``."""
        request = json.dumps([gold, pred, self.soft_timeout_s]).encode() + b"\n"
        with self._lock:
            proc = self._ready_worker()
            try:
                proc.stdin.write(request)
                proc.stdin.flush()
                reply = self._read_line(proc, self.timeout_s)
            except OSError:  # the worker died under us (broken pipe)
                reply = None
            if reply is None:
                self._restart()
                return False
            return reply == b"1"

    def close(self) -> None:
        """Stop the worker (a later call starts a new one)."""
        with self._lock:
            self._kill()

    def _ready_worker(self) -> subprocess.Popen:
        if self._proc is None or self._proc.poll() is not None:
            self._restart()
        if not self._ready:
            if self._read_line(self._proc, self.startup_timeout_s) != b"ready":
                self._stderr.seek(0)
                tail = self._stderr.read()[-2000:].decode(errors="replace")
                self._kill()
                raise RuntimeError(f"the math grading worker did not start:\n{tail}")
            self._ready = True
        return self._proc

    def _restart(self) -> None:
        self._kill()
        # A file, not a pipe: a chatty worker never blocks. It lives as long as the worker.
        self._stderr = tempfile.TemporaryFile()  # noqa: SIM115
        self._proc = subprocess.Popen(
            [sys.executable, "-W", "ignore", "-c", _WORKER_SOURCE],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            bufsize=0,
        )

    def _kill(self) -> None:
        if self._proc is not None:
            self._proc.kill()
            self._proc.wait()
            self._proc.stdin.close()
            self._proc.stdout.close()
            self._stderr.close()
        self._proc, self._stderr, self._ready, self._buf = None, None, False, b""

    def _read_line(self, proc: subprocess.Popen, timeout_s: float) -> bytes | None:
        """One reply line (without the newline), or None on timeout or end of file."""
        deadline = time.monotonic() + timeout_s
        fd = proc.stdout.fileno()
        while b"\n" not in self._buf:
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not select.select([fd], [], [], remaining)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                return None
            self._buf += chunk
        line, self._buf = self._buf.split(b"\n", 1)
        return line


_GRADER = MathGrader()
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
        self._zero: dict[str, float] = {"reward": 0.0}  # an error's score: 0 for each key seen

    def for_batch(self, step: int) -> _BatchReward:
        return _BatchReward(self, step)

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        return self.score(response, ground_truth, where="")[0]

    def score(self, response: str, ground_truth: str, where: str) -> tuple[dict[str, float], bool]:
        """``(score dict, whether it is a tolerated error's zeros)`` for one response; ``where``
        (e.g. ``"response 5 of step 3's rollout batch"``) goes into the error message."""
        try:
            out = self.fn(response, ground_truth)
            problem = _not_a_score(out)
        except Exception as exc:  # the user's code: whatever it raises is reported, not a traceback
            out, problem = None, f"raised {type(exc).__name__}: {exc}"
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

    def for_batch(self, step: int) -> _BatchReward:
        return _BatchReward(self, step)

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        return self.score(response, ground_truth, where="")[0]

    def score(self, response: str, ground_truth: str, where: str) -> tuple[dict[str, float], list[str]]:
        """``(combined score dict, names of the parts whose error was scored 0)``."""
        out: dict[str, float] = {"reward": 0.0}
        extras: dict[str, float] = {}
        failed: list[str] = []
        for part, w, name in zip(self.parts, self.weights, self.names):
            s, bad = part.score(response, ground_truth, where)
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

    def __call__(self, response: str, ground_truth: str) -> dict[str, float]:
        where = f"response {self.index} of step {self.step}'s rollout batch"
        self.index += 1
        out, failed = self.guard.score(response, ground_truth, where)
        if isinstance(failed, bool):  # a single GuardedReward
            failed = [self.guard.name] if failed else []
        for name in failed:
            self.errors_by_part[name] += 1
        self.errors += len(failed)
        self.scores.append(out)
        return out


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
