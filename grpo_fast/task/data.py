"""Task data: (question, ground-truth answer) pairs, read the way each task says (``TaskSpec``,
declared by its module: ``grpo_fast.task.competition_math``, ``gsm8k``, ``tiny``).

Sources, by ``load_examples(task, path)``:

- ``path=None``: the Hugging Face Hub through ``datasets`` (the task's ``hub_name`` /
  ``hub_config``; ``hub_name``/``hub_config`` arguments override them).
- a local ``.jsonl`` file (one JSON object per line; parsed here so errors name the line) or
  ``.parquet`` file (read with pyarrow). A local file is one split: ``split`` is ignored.

Answers (the ground truth the reward compares against): the task's ``extract_answer`` of the
answer field (``math``: the last ``\\boxed{…}``; ``gsm8k`` and ``tiny``: the number after
``####``, or a plain number).

Field names default to the first present of ``TaskSpec.question_fields`` /
``TaskSpec.answer_fields``. Every bad record raises ``DataError`` naming the file and line.

Optional, per example:

- ``solution``, a worked ground-truth solution (``sft.mix_coef``'s target): the
  ``solution_field`` (``data.solution_field``), by default the task's ``TaskSpec.solution_field``
  when a record has it (``math``: ``solution``, as it is; ``gsm8k``: the ``answer`` text before
  ``####``, calculator annotations ``<<48/2=24>>`` removed); None otherwise.
- ``difficulty``, a number, lower = easier (``rollout.curriculum=easy_first``): the
  ``difficulty_field`` (``data.difficulty_field``, no default), a number or the last number of a
  string (MATH's ``"Level 3"`` → 3.0); a value with no number (MATH has a few ``"Level ?"``) → None.

Example:
    >>> write_jsonl("/tmp/tiny.jsonl", [{"question": "1+1?", "answer": "so #### 2"}])  # doctest: +SKIP
    >>> load_examples("gsm8k", "/tmp/tiny.jsonl")  # doctest: +SKIP
    [Example(question='1+1?', answer='2')]
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path
from typing import Any

from grpo_fast.errors import ConfigError, DataError
from grpo_fast.task.registry import tasks
from grpo_fast.task.spec import Example, TaskSpec

__all__ = ["SUPPORTED_EXTENSIONS", "Example", "TaskSpec", "load_examples", "write_jsonl"]

SUPPORTED_EXTENSIONS = (".jsonl", ".parquet")


_LAST_NUMBER_RE = re.compile(r"-?\d+(?:\.\d+)?(?!.*\d)", re.DOTALL)


def load_examples(
    task: str,
    path: str | None = None,
    *,
    split: str = "train",
    question_field: str | None = None,
    answer_field: str | None = None,
    hub_name: str | None = None,
    hub_config: str | None = None,
    solution_field: str | None = None,
    difficulty_field: str | None = None,
    alphabet: str | None = None,
) -> list[Example]:
    """Load ``task`` examples from a local file (``path``) or the Hub (``path=None``).

    Args:
        task: a task's name (``grpo_fast.task.registry.tasks()``: ``math``, ``gsm8k``, ``tiny``).
        path: a ``.jsonl`` or ``.parquet`` file; None loads ``split`` from the Hub.
        split: Hub split (``"train"``, ``"test"``).
        question_field, answer_field: field names; default: the first of the task's
            ``question_fields`` / ``answer_fields`` that a record has.
        hub_name, hub_config: Hub dataset and config instead of the task's defaults; with a
            ``hub_name`` and no ``hub_config``, the dataset's own default config.
        solution_field: the worked solution's field (must be present); None: the task's
            ``solution_field`` where a record has it (see the module docstring).
        difficulty_field: the difficulty's field (must be present); None: no difficulty.
        alphabet: the characters the model's tokenizer knows (the built-in tiny tokenizer's
            ``0123456789+=``: ``TaskSpec.alphabet``), or None for any: a question, answer or
            solution holding another character is refused, naming the line (it would become
            ``<unk>``).

    Returns:
        One ``Example`` per record, in file order.

    Raises:
        ConfigError: unknown task.
        DataError: missing/unreadable/empty file, unsupported extension, malformed JSONL line,
            missing field, or no answer to extract (the message names the file and line).
    """
    if task not in tasks():
        raise ConfigError(f"unknown task {task!r}: choose one of {', '.join(sorted(tasks()))}")
    spec = tasks()[task]
    if path is None:
        if spec.hub_name is None and hub_name is None:
            raise ConfigError(f"task {task!r} has no Hub dataset: give a data file")
        name = hub_name or spec.hub_name
        config = hub_config if hub_config is not None or hub_name else spec.hub_config
        source, records = f"{name} [{split}]", _read_hub(name, config, split)
    else:
        source, records = path, _read_file(Path(path))
    fields = (question_field, answer_field, solution_field, difficulty_field)
    examples = []
    for where, record in records:
        examples.append(_to_example(spec, record, where, *fields))
        if alphabet is not None:
            _check_alphabet(examples[-1], alphabet, where)
    if not examples:
        raise DataError(f"{source}: empty (no records)")
    return examples


def write_jsonl(path: str | Path, records: Iterable[Mapping[str, Any]]) -> Path:
    """Write ``records`` as JSON Lines (UTF-8, one object per line), creating parent folders."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", encoding="utf-8") as f:
        for record in records:
            f.write(json.dumps(record, ensure_ascii=False) + "\n")
    return path


# ----------------------------------------------------------------------------------------------
# Readers: each yields (location for error messages, record)
# ----------------------------------------------------------------------------------------------


def _read_file(path: Path) -> Iterator[tuple[str, dict]]:
    if path.is_dir():
        raise DataError(f"{path}: a folder, not a data file (give a .jsonl or .parquet file in it)")
    if not path.is_file():
        raise DataError(f"{path}: file not found")
    if path.suffix.lower() not in SUPPORTED_EXTENSIONS:
        raise DataError(
            f"{path}: unsupported file type {path.suffix or '(no extension)'!r}; "
            f"use one of {', '.join(SUPPORTED_EXTENSIONS)}"
        )
    if path.stat().st_size == 0:
        raise DataError(f"{path}: empty file")
    return _read_jsonl(path) if path.suffix.lower() == ".jsonl" else _read_parquet(path)


def _read_jsonl(path: Path) -> Iterator[tuple[str, dict]]:
    try:
        with path.open(encoding="utf-8") as f:
            for lineno, line in enumerate(f, start=1):
                if not line.strip():
                    continue
                where = f"{path}:{lineno}"
                try:
                    record = json.loads(line, object_pairs_hook=_unique_keys)
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
                except _DuplicateKey as exc:
                    raise DataError(
                        f"{where}: key {exc.args[0]!r} appears twice in one object (JSON keeps the last "
                        "one without a word): keep one"
                    ) from None
                except RecursionError:
                    raise DataError(f"{where}: not valid JSON (nested too deeply)") from None
                if not isinstance(record, dict):
                    raise DataError(f"{where}: expected a JSON object, got {type(record).__name__}")
                yield where, record
    except UnicodeDecodeError as exc:
        raise DataError(f"{path}: not UTF-8 text ({exc.reason} at byte {exc.start})") from None


class _DuplicateKey(ValueError):
    """A JSON object holding a key twice (``json.loads`` would keep the last one)."""


def _unique_keys(pairs: list[tuple[str, Any]]) -> dict:
    obj = dict(pairs)
    if len(obj) != len(pairs):
        seen = set()
        raise _DuplicateKey(next(k for k, _ in pairs if k in seen or seen.add(k)))
    return obj


def _read_parquet(path: Path) -> Iterator[tuple[str, dict]]:
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        rows = pq.read_table(path).to_pylist()
    except (pa.ArrowException, OSError) as exc:
        raise DataError(f"{path}: not a readable Parquet file ({exc})") from None
    for i, row in enumerate(rows, start=1):
        yield f"{path} row {i}", row


def _read_hub(name: str, config: str | None, split: str) -> Iterator[tuple[str, dict]]:
    import datasets

    try:
        ds = datasets.load_dataset(name, config, split=split)
    except Exception as exc:  # offline, unknown dataset, bad config or split: all fixable by the user
        first_line = (str(exc).strip().splitlines() or [type(exc).__name__])[0]
        raise DataError(
            f"could not load {name!r} (config {config!r}, split {split!r}) from the Hugging Face Hub: "
            f"{first_line}; pass a local .jsonl or .parquet path instead"
        ) from exc
    for i, row in enumerate(ds, start=1):
        yield f"{name} [{split}] row {i}", row


# ----------------------------------------------------------------------------------------------
# Record -> Example
# ----------------------------------------------------------------------------------------------


def _field(record: dict, where: str, explicit: str | None, candidates: tuple[str, ...], what: str) -> str:
    """The field name to read: ``explicit`` if given, else the first candidate present."""
    names = (explicit,) if explicit else candidates
    for name in names:
        if name in record:
            return name
    tried = f"field {explicit!r}" if explicit else f"{what} field (tried {', '.join(map(repr, candidates))})"
    present = ", ".join(map(repr, record)) or "none"
    raise DataError(f"{where}: missing {tried}; fields present: {present}")


def _to_example(
    spec: TaskSpec,
    record: dict,
    where: str,
    question_field: str | None,
    answer_field: str | None,
    solution_field: str | None = None,
    difficulty_field: str | None = None,
) -> Example:
    q_name = _field(record, where, question_field, spec.question_fields, "question")
    a_name = _field(record, where, answer_field, spec.answer_fields, "answer")
    question = record[q_name]
    if not isinstance(question, str) or not question.strip():
        raise DataError(f"{where}: field {q_name!r} must be a non-empty string, got {question!r:.60}")
    value = record[a_name]
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise DataError(f"{where}: field {a_name!r} must be a string or a number, got {type(value).__name__}")
    value = str(value)
    answer = spec.extract_answer(value, a_name, answer_field is not None or a_name == "answer")
    if answer is None:
        raise DataError(f"{where}: no {spec.no_answer} found in field {a_name!r}")
    if not answer.strip():
        raise DataError(f"{where}: empty answer in field {a_name!r}")
    solution = _solution(spec, record, where, solution_field)
    difficulty = None
    if difficulty_field is not None:
        _field(record, where, difficulty_field, (), "difficulty")
        difficulty = _difficulty(record[difficulty_field])
    return Example(question=question, answer=answer.strip(), solution=solution, difficulty=difficulty)


def _solution(spec: TaskSpec, record: dict, where: str, explicit: str | None) -> str | None:
    """The worked solution: the explicit field (required), else the task's default field if the
    record has it, read by the task's ``extract_solution`` (gsm8k's: the text before ``####``,
    calculator annotations removed)."""
    if explicit is not None:
        _field(record, where, explicit, (), "solution")
        name = explicit
    elif spec.solution_field in record:
        name = spec.solution_field
    else:
        return None
    value = record[name]
    if not isinstance(value, str) and explicit is None:  # gsm8k's bare number: no worked solution
        return None
    if not isinstance(value, str):
        raise DataError(
            f"{where}: field {name!r} must be a string (a worked solution), got {type(value).__name__}"
        )
    return spec.extract_solution(value, explicit is not None)


def _check_alphabet(ex: Example, alphabet: str, where: str) -> None:
    for name, text in (("question", ex.question), ("answer", ex.answer), ("solution", ex.solution)):
        unknown = sorted({ch for ch in text or "" if ch not in alphabet})
        if unknown:
            raise DataError(
                f"{where}: the {name} {text[:60]!r} holds {''.join(unknown)!r}, which the tokenizer "
                f"does not know (it knows only {alphabet!r}): it would become <unk>"
            )


def _difficulty(value: Any) -> float | None:
    """A difficulty value as a number: numbers as they are, a string's last number
    (``"Level 3"`` → 3.0), None for anything without one (``"Level ?"``).

    Example:
        >>> _difficulty("Level 3"), _difficulty(2), _difficulty("Level ?")
        (3.0, 2.0, None)
    """
    if isinstance(value, bool):
        return None
    if isinstance(value, (int, float)):
        return float(value) if math.isfinite(value) else None
    m = _LAST_NUMBER_RE.search(str(value))
    return float(m.group()) if m else None


def __getattr__(name: str):
    """``TASKS``: every task by name, as this module always exported it (now the registry's,
    ``grpo_fast.task.registry.tasks``: each task module declares its ``TaskSpec``)."""
    if name == "TASKS":
        return tasks()
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
