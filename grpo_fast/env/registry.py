"""The tool environments by name: each environment module declares ``ENVIRONMENT =
EnvironmentSpec(...)``.

``environments()`` finds every such module of ``grpo_fast.env`` by its files (as the rollout
backends' registry does), so adding a built-in environment is one module. A user's environment
lives in their own module and is named by its import path (``my_tools`` or ``lab.tools.search``):
that module's ``ENVIRONMENT`` is used.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from grpo_fast.env.base import Environment, EnvironmentSpec
from grpo_fast.errors import ConfigError

__all__ = ["environment", "environments", "make_environment"]

_FOUND: dict[str, EnvironmentSpec] | None = None


def environments() -> dict[str, EnvironmentSpec]:
    """Every built-in environment of ``grpo_fast.env``, by name (each module imported once)."""
    global _FOUND
    if _FOUND is None:
        found = {}
        for info in sorted(pkgutil.iter_modules([str(Path(__file__).parent)]), key=lambda m: m.name):
            spec = getattr(importlib.import_module(f"{__package__}.{info.name}"), "ENVIRONMENT", None)
            if isinstance(spec, EnvironmentSpec):
                if spec.name in found:
                    raise RuntimeError(f"two tool environments are named {spec.name!r}")
                found[spec.name] = spec
        _FOUND = found
    return _FOUND


def environment(name: str) -> EnvironmentSpec:
    """The environment ``name``: a built-in one, or the ``ENVIRONMENT`` of the module at that
    import path.

    Raises:
        ConfigError: no such environment (one line: the built-in names and how to name a module).
    """
    builtin = environments()
    if name in builtin:
        return builtin[name]
    hint = f"built in: {', '.join(sorted(builtin))}; or the import path of a module that declares ENVIRONMENT"
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"unknown tool environment {name!r} ({hint}; importing it: {exc})") from None
    spec = getattr(module, "ENVIRONMENT", None)
    if not isinstance(spec, EnvironmentSpec):
        raise ConfigError(
            f"tool environment {name!r}: the module declares no ENVIRONMENT = EnvironmentSpec(...)"
        )
    return spec


def make_environment(name: str, **options) -> Environment:
    """Build the environment ``name`` with ``options``; one line naming the fix when it cannot
    run here (e.g. ``python`` without bubblewrap).

    Raises:
        ConfigError: unknown name, or ``missing()`` says it cannot run on this machine.
    """
    spec = environment(name)
    problem = spec.missing()
    if problem is not None and options.get("isolation") != "unsafe":
        raise ConfigError(f"tool environment {name!r} cannot run here: {problem}")
    return spec.build(**options)
