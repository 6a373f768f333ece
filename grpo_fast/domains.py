"""Value domains, declared once beside each default: the loss options and every config key.

A dataclass field declared with ``option(default, domain)`` carries its domain in its metadata;
``check_fields(obj)`` walks an instance and names the first value outside its field's domain.
``LossOptions`` (``grpo_fast.algo.loss_options``) and the config sections (``grpo_fast.config``)
are such dataclasses, so a key's default and its domain are written on one line, once.

Example:
    >>> @dataclass(frozen=True)
    ... class Opts:
    ...     clip: float = option(0.2, Range(0, 1, hi_open=True))
    >>> check_fields(Opts(clip=1.5))
    Traceback (most recent call last):
    ...
    grpo_fast.domains.DomainError: clip must be in [0, 1), got 1.5
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = [
    "AUTO",
    "RESUME_CLASSES",
    "AutoOrBool",
    "Domain",
    "DomainError",
    "OneOf",
    "Pattern",
    "Range",
    "check_fields",
    "domain_of",
    "option",
]

AUTO = "auto"  # a value the planner or the device resolves at run time


class DomainError(ValueError):
    """A value outside its field's domain; ``key`` is the field's name (with its prefix)."""

    def __init__(self, key: str, message: str):
        super().__init__(message)
        self.key = key


class Domain:
    """What values a field accepts. ``problem(label, value)`` returns None for a good value, else
    the one-line message naming ``label``."""

    def problem(self, label: str, value: Any) -> str | None:  # pragma: no cover - interface
        raise NotImplementedError


def _num(x: float) -> str:
    return f"{x:g}" if isinstance(x, float) else str(x)


@dataclass(frozen=True)
class Range(Domain):
    """A number in ``[lo, hi]`` (either bound open with ``lo_open``/``hi_open``, or absent).

    ``integer``: whole numbers only; ``none_ok``: ``None`` (YAML ``null``) is allowed;
    ``auto_ok``: the string ``"auto"`` is allowed; ``inf_ok``: ±inf is a number like any other
    (within the bounds; NaN never is); ``why``: appended to the message; ``hi_why``: why ``hi`` is where it
    is, appended instead of ``why`` above it (and the message then names the one bound crossed).
    """

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    integer: bool = False
    none_ok: bool = False
    auto_ok: bool = False
    inf_ok: bool = False
    why: str = ""
    hi_why: str = ""

    def describe(self) -> str:
        if self.lo is not None and self.hi is not None:
            left, right = "(" if self.lo_open else "[", ")" if self.hi_open else "]"
            text = f"in {left}{_num(self.lo)}, {_num(self.hi)}{right}"
        elif self.lo is not None:
            text = f"{'>' if self.lo_open else '>='} {_num(self.lo)}"
        elif self.hi is not None:
            text = f"{'<' if self.hi_open else '<='} {_num(self.hi)}"
        else:
            text = "a finite number"
        return text + (" (or null)" if self.none_ok else "")

    def problem(self, label: str, value: Any) -> str | None:
        if value is None and self.none_ok:
            return None
        if value == AUTO and self.auto_ok:
            return None
        kind = "an integer" if self.integer else "a number"
        numeric = isinstance(value, (int, float)) and not isinstance(value, bool)
        if not numeric or (self.integer and not (isinstance(value, int) or float(value).is_integer())):
            prefix = "'auto' or " if self.auto_ok else ""
            return f"{label} must be {prefix}{kind}, got {value!r}"
        if isinstance(value, float) and math.isnan(value):
            return f"{label}={value} is not a number"
        if isinstance(value, float) and math.isinf(value) and not self.inf_ok:  # (an int is finite)
            return f"{label}={value} is not a finite number"
        below = self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo)
        above = self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi)
        if not (below or above):
            return None
        why = (self.hi_why or self.why) if above else self.why
        if self.auto_ok:  # "auto" or a number: the range is the number's
            hi = _num(self.hi) if self.hi is not None else "∞"
            return f"{label}={value} is out of range [{_num(self.lo)}, {hi}]{why}"
        if self.hi_why:  # a bound of its own reason: the message names the side crossed
            side = dataclasses.replace(self, hi=None) if below else dataclasses.replace(self, lo=None)
            return f"{label} must be {side.describe()}, got {value}{why}"
        return f"{label} must be {self.describe()}, got {value}{why}"


@dataclass(frozen=True)
class OneOf(Domain):
    """One of ``choices`` (strings, or small ints such as a sleep level)."""

    choices: tuple

    def problem(self, label: str, value: Any) -> str | None:
        if value in self.choices and not isinstance(value, bool):
            return None
        return f"{label}={value!r} is not one of: {', '.join(str(c) for c in self.choices)}"


@dataclass(frozen=True)
class Pattern(Domain):
    """A string that ``regex`` matches whole; ``words`` says what those are in the message, and
    ``hint`` (called for the message only) may add what this machine has, e.g. its devices."""

    regex: str
    words: str
    hint: Callable[[], str] | None = None

    def problem(self, label: str, value: Any) -> str | None:
        if isinstance(value, str) and re.fullmatch(self.regex, value):
            return None
        hint = f" ({self.hint()})" if self.hint is not None else ""
        return f"{label}={value!r} is not one of: {self.words}{hint}"


@dataclass(frozen=True)
class AutoOrBool(Domain):
    """``"auto"`` (decided at run time from other keys) or a boolean."""

    def problem(self, label: str, value: Any) -> str | None:
        if value == AUTO or isinstance(value, bool):
            return None
        return f"{label}={value!r} is not one of: auto, true, false"


RESUME_CLASSES = ("run", "safe")


def option(
    default: Any = dataclasses.MISSING,
    domain: Domain | None = None,
    *,
    factory: Callable | None = None,
    resume: str | None = None,
):
    """A dataclass field with its default (or ``factory``), its domain, and (config keys) what
    ``resume=true`` may do with it: ``"run"`` (it defines what the run's metrics mean: a resume
    must keep it) or ``"safe"`` (a resume may change it); None: the section's class
    (``grpo_fast.config.resume_class``)."""
    if resume is not None and resume not in RESUME_CLASSES:
        raise ValueError(f"resume must be one of {RESUME_CLASSES}, not {resume!r}")
    meta = {"domain": domain} if domain is not None else {}
    if resume is not None:
        meta["resume"] = resume
    if factory is not None:
        return dataclasses.field(default_factory=factory, metadata=meta)
    return dataclasses.field(default=default, metadata=meta)


def domain_of(cls_or_obj: Any, name: str) -> Domain | None:
    """The domain declared for field ``name`` (None: any value of its type)."""
    for f in dataclasses.fields(cls_or_obj):
        if f.name == name:
            return f.metadata.get("domain")
    raise KeyError(name)


def check_fields(
    obj: Any, prefix: str = "", labels: dict[str, str] | None = None, names: Sequence[str] | None = None
) -> None:
    """``DomainError`` for the first field of ``obj`` (in declaration order) outside its domain.

    ``prefix`` goes before each field's name in the message (``"loss."``); ``labels`` renames
    fields for the message (a public function's keyword spelling); ``names`` restricts the check.
    """
    for f in dataclasses.fields(obj):
        if names is not None and f.name not in names:
            continue
        domain = f.metadata.get("domain")
        if domain is None:
            continue
        label = prefix + (labels or {}).get(f.name, f.name)
        message = domain.problem(label, getattr(obj, f.name))
        if message is not None:
            raise DomainError(prefix + f.name, message)
