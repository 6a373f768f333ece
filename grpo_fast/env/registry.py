"""The tool environments by name: each environment module declares ``ENVIRONMENT =
EnvironmentSpec(...)``.

``environments()`` finds every such module of ``grpo_fast.env`` by its files (as the rollout
backends' registry does), so adding a built-in environment is one module. A user's environment
lives in their own module and is named by its import path (``my_tools`` or ``lab.tools.search``):
that module's ``ENVIRONMENT`` is used. What a user's module declares, says (``missing``) and
builds is checked here: a name that is no import path, a module that fails to import, a
declaration of the wrong shape, a ``build`` that raises or returns no environment
(``guarded.check_built``) are each one line (``ConfigError``) naming the module.
"""

from __future__ import annotations

import importlib
import pkgutil
from pathlib import Path

from grpo_fast.env.base import Environment, EnvironmentSpec
from grpo_fast.env.guarded import check_built, what_raised
from grpo_fast.errors import ConfigError, shown

__all__ = ["SETTINGS", "cannot_run_here", "environment", "environments", "make_environment"]

SETTINGS = ("timeout_s", "isolation", "workers")  # what EnvironmentSpec.takes may name

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
    if not isinstance(name, str) or not all(part.isidentifier() for part in name.split(".")):
        raise ConfigError(f"unknown tool environment {shown(name)} ({hint}, such as my_tools or lab.tools)")
    try:
        module = importlib.import_module(name)
    except ImportError as exc:
        raise ConfigError(f"unknown tool environment {name!r} ({hint}; importing it: {exc})") from None
    except Exception as exc:  # the user's module raised as it was imported (a SyntaxError too)
        raise ConfigError(
            f"tool environment {name!r}: importing the module raised {what_raised(exc)}"
        ) from None
    spec = getattr(module, "ENVIRONMENT", None)
    if not isinstance(spec, EnvironmentSpec):
        raise ConfigError(
            f"tool environment {name!r}: the module declares no ENVIRONMENT = EnvironmentSpec(...)"
        )
    _check_spec(spec, name)
    return spec


def _check_spec(spec: EnvironmentSpec, name: str) -> None:
    """A user's declaration: ``build`` and ``missing`` callables, ``takes`` a tuple of ``SETTINGS``."""
    for field in ("build", "missing"):
        if not callable(getattr(spec, field)):
            raise ConfigError(
                f"tool environment {name!r}: ENVIRONMENT.{field} is {shown(getattr(spec, field))}, not a function"
            )
    takes = spec.takes
    if (
        isinstance(takes, str)
        or not isinstance(takes, (tuple, list))
        or any(t not in SETTINGS for t in takes)
    ):
        raise ConfigError(
            f"tool environment {name!r}: ENVIRONMENT.takes={shown(takes)} must be a tuple of {', '.join(SETTINGS)}"
        )


def cannot_run_here(name: str) -> str | None:
    """Why the environment ``name`` cannot run on this machine (its ``missing()``), or None.

    Raises:
        ConfigError: no such environment, or a user's ``missing`` raised or returned a non-string.
    """
    spec = environment(name)
    try:
        problem = spec.missing()
    except Exception as exc:
        raise ConfigError(f"tool environment {name!r}: its missing() raised {what_raised(exc)}") from None
    if problem is not None and not isinstance(problem, str):
        raise ConfigError(
            f"tool environment {name!r}: its missing() returned {shown(problem)}, not a str or None"
        )
    return problem


def make_environment(name: str, **options) -> Environment:
    """Build the environment ``name`` with ``options``; one line naming the fix when it cannot
    run here (e.g. ``python`` without bubblewrap). A user's module's build is checked: it must
    return an ``Environment`` with non-empty stop strings (``guarded.check_built``).

    Raises:
        ConfigError: unknown name, ``missing()`` says it cannot run on this machine, or a user's
            build raised or returned something else.
    """
    spec = environment(name)
    problem = cannot_run_here(name)
    if problem is not None and options.get("isolation") != "unsafe":
        raise ConfigError(f"tool environment {name!r} cannot run here: {problem}")
    if name in environments():
        return spec.build(**options)
    try:
        env = spec.build(**options)
    except Exception as exc:  # the user's code
        called = ", ".join(f"{k}={v!r}" for k, v in options.items())
        raise ConfigError(
            f"tool environment {name!r}: its build({called}) raised {what_raised(exc)}"
        ) from None
    return check_built(env, name)
