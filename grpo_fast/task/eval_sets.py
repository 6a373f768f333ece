"""Evaluation sets by name (``eval.sets``): each a list of problems with the template, stop strings
and reward it is graded with, so that a figure means the same thing in every run that names it.

An entry of ``eval.sets`` is one of:

- ``data.task``'s name (``tiny``, ``math``, ...): the run's own eval set, as the run reads it (its
  eval split or ``data.eval_path``, ``data.prompt_template``, ``data.reward``). ``eval.sets=[]``
  means this one alone, as before the section existed.
- a registered set (``EVAL_SETS``), with its own fixed template and reward: ``tiny``,
  ``tiny_3digit`` and ``tiny_tools`` built in (any CPU, no download); ``gsm8k``, ``math500``,
  ``aime24``, ``amc23`` from the Hugging Face Hub (the cache, or a connection).
- ``NAME=PATH`` or a bare ``PATH`` (``.jsonl`` / ``.parquet``; NAME = the file's stem): a file
  read as ``data.task``'s (``data.question_field`` / ``data.answer_field``), graded as the run's
  own set.
- ``NAME=hub:ORG/DATASET[:CONFIG][@SPLIT]`` or a bare ``hub:...`` (NAME = DATASET): a Hub dataset
  (split ``test`` by default), read and graded as a file set.

A name becomes a metric's middle part (``eval/<name>/avg@k``): letters, digits, ``_ . -``. A set
that cannot be read (no such file, offline and not cached, a character the tokenizer does not
know) is refused in one line naming the entry, before the run starts (and by the dry run):
``grpo_fast.task.loader.load_eval_sets`` loads them.
"""

from __future__ import annotations

import dataclasses
import difflib
import re
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from grpo_fast.errors import ConfigError, DataError, shown
from grpo_fast.task.data import SUPPORTED_EXTENSIONS
from grpo_fast.task.spec import Example

__all__ = ["EVAL_SETS", "EvalSet", "EvalSetSpec", "check_entries", "set_names"]

_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,63}")


@dataclass(frozen=True)
class EvalSetSpec:
    """A registered set: where its problems are, which task reads their fields and answers, and
    the template and reward (None = the task's own, ``TaskSpec.reward``) it is graded with."""

    name: str
    summary: str
    task: str
    template: str
    reward: str | None = None
    builtin: Callable[[], list[Example]] | None = None
    hub_name: str | None = None
    hub_config: str | None = None
    split: str = "test"
    question_field: str | None = None
    answer_field: str | None = None


def _tiny_eval() -> list[Example]:
    from grpo_fast.task import tiny

    return [dataclasses.replace(ex, difficulty=None) for ex in tiny.examples("eval")]


def _tiny_3digit() -> list[Example]:
    from grpo_fast.task import tiny

    return tiny.three_digit_sums()


def _tiny_tools_eval() -> list[Example]:
    from grpo_fast.task import tiny_tools

    return [dataclasses.replace(ex, difficulty=None) for ex in tiny_tools.examples("eval")]


# The math sets keep r1_zero's template and reward, the CS336 write-up's protocol; Qwen2.5 base
# models' MATH score moves by tens of points with the template alone, so a set fixes its own.
EVAL_SETS: dict[str, EvalSetSpec] = {
    s.name: s
    for s in (
        EvalSetSpec(
            "tiny", "the tiny task's 500 held-out two-digit sums", "tiny", "question_only", builtin=_tiny_eval
        ),
        EvalSetSpec(
            "tiny_3digit",
            "500 sums of three-digit numbers below 500: generalization beyond the tiny task's two digits",
            "tiny",
            "question_only",
            builtin=_tiny_3digit,
        ),
        EvalSetSpec(
            "tiny_tools",
            "the tiny_tools task's held-out products",
            "tiny_tools",
            "question_only",
            builtin=_tiny_tools_eval,
        ),
        EvalSetSpec(
            "gsm8k",
            "GSM8K's 1,319 test problems",
            "gsm8k",
            "r1_zero",
            hub_name="openai/gsm8k",
            hub_config="main",
        ),
        EvalSetSpec(
            "math500",
            "MATH-500 (Lightman et al.'s subset of MATH's test split)",
            "math",
            "r1_zero",
            hub_name="HuggingFaceH4/MATH-500",
            answer_field="answer",
        ),
        EvalSetSpec(
            "aime24",
            "AIME 2024's 30 problems (report avg@k or pass@k: greedy on 30 is noisy)",
            "math",
            "r1_zero",
            hub_name="HuggingFaceH4/aime_2024",
            split="train",
            question_field="problem",
            answer_field="answer",
        ),
        EvalSetSpec(
            "amc23",
            "AMC 2023's 40 problems",
            "math",
            "r1_zero",
            hub_name="math-ai/amc23",
            question_field="question",
            answer_field="answer",
        ),
    )
}


HUB = "hub:"  # NAME=hub:ORG/DATASET[:CONFIG][@SPLIT]: a Hub dataset (or a local dataset folder)


@dataclass(frozen=True)
class Entry:
    """One ``eval.sets`` entry, parsed: its metric name and what it is (``run``: data.task's own;
    ``registered``: ``EVAL_SETS[name]``; ``file``: ``path``; ``hub``: ``path`` is the dataset,
    ``config`` and ``split`` its own)."""

    name: str
    kind: str
    path: str | None = None
    config: str | None = None
    split: str = "test"


def _hub_entry(entry: str, name: str | None, spec: str) -> Entry:
    """``hub:ORG/DATASET[:CONFIG][@SPLIT]`` (after ``NAME=``, or bare: NAME = DATASET) → its Entry."""
    spec, at, split = spec.partition("@")
    dataset, colon, config = spec.partition(":")
    if not dataset or (colon and not config) or (at and not split):
        raise ConfigError(
            f"eval.sets: {shown(entry)}: give a Hub dataset as {HUB}ORG/DATASET[:CONFIG][@SPLIT]"
        )
    name = name if name is not None else dataset.rstrip("/").rsplit("/", 1)[-1]
    return Entry(name, "hub", dataset, config or None, split or "test")


def parse_entry(entry: str, run_task: str) -> Entry:
    """``entry`` (an ``eval.sets`` item) → its ``Entry``; ``ConfigError`` naming it otherwise."""
    if not isinstance(entry, str) or not entry.strip():
        raise ConfigError(
            f"eval.sets: {shown(entry)} is not a set name (a registered set, {run_task!r}, or NAME=PATH)"
        )
    name, sep, path = entry.partition("=")
    hub = None
    if entry.startswith(HUB) or path.startswith(HUB):
        hub = _hub_entry(entry, name if sep else None, (path if sep else entry)[len(HUB) :])
        name, sep, path = hub.name, "", ""
    if not sep and Path(entry).suffix.lower() in SUPPORTED_EXTENSIONS:
        name, path, sep = Path(entry).stem, entry, "="
    if sep:
        if not path:
            raise ConfigError(f"eval.sets: {shown(entry)} names no file after '='")
        if Path(path).suffix.lower() not in SUPPORTED_EXTENSIONS:
            raise ConfigError(
                f"eval.sets: {shown(entry)}: {shown(path)} is not a {' or '.join(SUPPORTED_EXTENSIONS)} file"
            )
    if not _NAME.fullmatch(name):
        raise ConfigError(
            f"eval.sets: {shown(entry)}: the set's name {shown(name)} must be letters, digits, '_', '.' or "
            "'-' (at most 64; it is part of the metrics' names)"
        )
    if hub is not None:
        return hub
    if sep:
        return Entry(name, "file", path)
    if name == run_task:
        return Entry(name, "run")
    if name in EVAL_SETS:
        return Entry(name, "registered")
    choices = sorted({run_task, *EVAL_SETS})
    close = difflib.get_close_matches(name, choices, n=1, cutoff=0.6)
    hint = f" (did you mean {close[0]!r}?)" if close else ""
    raise ConfigError(
        f"eval.sets: unknown set {shown(name)}{hint}: one of {', '.join(choices)}, NAME=PATH.jsonl for a file, "
        f"or NAME={HUB}ORG/DATASET for a Hub dataset"
    )


def entries(cfg) -> list[Entry]:
    """``eval.sets`` parsed (``[]`` = data.task's own set alone)."""
    return [parse_entry(e, cfg.data.task) for e in (cfg.eval.sets or [cfg.data.task])]


def set_names(cfg) -> list[str]:
    """The metric names of the run's eval sets, in order (the first is the headline ``eval/``)."""
    return [e.name for e in entries(cfg)]


def check_entries(cfg) -> None:
    """The config-time checks of ``eval.sets``: each entry well formed and known, no name twice."""
    names = set_names(cfg)
    twice = sorted({n for n in names if names.count(n) > 1})
    if twice:
        raise ConfigError(f"eval.sets={list(cfg.eval.sets)} names the set {twice[0]!r} twice")


@dataclass
class EvalSet:
    """A loaded set: its name and a ``Task`` whose ``eval`` holds its problems, with the template,
    stop strings and reward it is graded with (the run's own task for data.task's set)."""

    name: str
    task: object  # grpo_fast.task.loader.Task
    subset: list[Example]  # what eval_every evaluates: data.eval_subset_size problems, fixed seed


def check_alphabet(examples: list[Example], alphabet: str) -> None:
    """A registered set's problems within the tokenizer's characters (a data file's are checked
    line by line as it is read)."""
    for i, ex in enumerate(examples, start=1):
        unknown = sorted({ch for ch in ex.question + ex.answer if ch not in alphabet})
        if unknown:
            raise DataError(
                f"problem {i} holds {''.join(unknown)!r}, which the tokenizer does not know "
                f"(it knows only {alphabet!r})"
            )
