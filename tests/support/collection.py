"""Collection hooks of tests/conftest.py for pytest-xdist's ``--dist loadgroup``."""

from __future__ import annotations


def group_module_fixtures(items) -> None:
    """``pytest_collection_modifyitems`` body (``tryfirst``: before pytest-xdist's, which reads the
    marks) for ``--dist loadgroup``: a test that uses a module-scoped fixture and names no
    ``xdist_group`` of its own joins its module's group, ``module_fixtures:<module>``, so that the
    fixture (a 2-rank run, a finished training run: up to a minute each) is built on one worker,
    not once on each worker that draws one of its tests."""
    import pytest

    for item in items:
        defs = getattr(getattr(item, "_fixtureinfo", None), "name2fixturedefs", {})
        shares = any(d and d[-1].scope == "module" for d in defs.values())
        if shares and item.get_closest_marker("xdist_group") is None:
            item.add_marker(pytest.mark.xdist_group(f"module_fixtures:{item.module.__name__}"))
