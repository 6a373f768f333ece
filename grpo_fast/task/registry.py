"""The tasks by name: each task module of ``grpo_fast.task`` declares a ``TASK = TaskSpec(...)``.

``tasks()`` finds every such module of the package by its files (as the rollout backends are
found), so ``data.task``'s choices, ``load_examples`` and the task loader read them here. A new
task is one module: its ``TaskSpec`` (name, default reward, data source and fields, how an answer
is read) and, for a task with its own reward, a ``@register_reward`` function.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from grpo_fast.task.spec import TaskSpec

__all__ = ["TaskSpec", "task", "tasks"]

_FOUND: dict[str, TaskSpec] | None = None


def tasks() -> dict[str, TaskSpec]:
    """Every task of ``grpo_fast.task``, by name: the modules that define ``TASK`` (imported once)."""
    global _FOUND
    if _FOUND is None:
        found = {}
        for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
            if info.name in ("registry", "loader", "data", "eval_sets"):  # a floor above; data reads this
                continue
            spec = getattr(importlib.import_module(f"{__package__}.{info.name}"), "TASK", None)
            if isinstance(spec, TaskSpec):
                if spec.name in found:
                    raise RuntimeError(f"two tasks are named {spec.name!r}")
                found[spec.name] = spec
        _FOUND = found
    return _FOUND


def task(name: str) -> TaskSpec:
    """The task named ``name`` (``KeyError`` when there is none: the config checks first)."""
    return tasks()[name]
