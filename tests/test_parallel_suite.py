"""The suite's parallel run (``make test``: ``pytest -n 2 --dist loadgroup``) keeps shared work on
one worker: the tests of an ``xdist_group`` mark, and the tests that use a module-scoped fixture
(``group_module_fixtures`` of tests/support/collection.py, which tests/conftest.py calls), whose fixture is then
built once. pytest 9.2 with pytest-xdist 3.8 lost every group without a word (pytest-xdist issue
#1386): module fixtures ran once per worker and the 2-rank tests ran beside each other, ~4 min
more of CI; pyproject.toml holds pytest below 9.2. Planted: pytest 9.2 → the marked tests run on
both workers; no ``group_module_fixtures`` → the fixture is built on both."""

import os
import subprocess
import sys
from pathlib import Path

SAMPLE = """
import os

import pytest

LOG = {log!r}


def _log(tag):
    with open(LOG, "a") as f:
        f.write(f"{{tag}} {{os.environ['PYTEST_XDIST_WORKER']}}\\n")


@pytest.fixture(scope="module")
def built():
    _log("built")


@pytest.mark.xdist_group("marked")
@pytest.mark.parametrize("i", range(4))
def test_marked(i):
    _log("marked")
"""
# the module fixture's tests between others, where workers drawing tests in turn would split them
SAMPLE += "".join(
    f"\n\ndef test_free_{k}a():\n    _log('free')\n"
    f"\n\ndef test_free_{k}b():\n    _log('free')\n"
    f"\n\ndef test_shared_{k}(built):\n    _log('shared')\n"
    for k in range(4)
)

CONFTEST = f"""
import sys

import pytest

sys.path.insert(0, {str(Path(__file__).resolve().parent)!r})  # this suite's tests/ folder
from support.collection import group_module_fixtures


@pytest.hookimpl(tryfirst=True)
def pytest_collection_modifyitems(config, items):
    group_module_fixtures(items)
"""


def test_loadgroup_keeps_marked_tests_and_a_module_fixtures_tests_on_one_worker(tmp_path):
    log = tmp_path / "log.txt"
    (tmp_path / "test_sample.py").write_text(SAMPLE.format(log=str(log)))
    (tmp_path / "conftest.py").write_text(CONFTEST)
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTEST_XDIST")}
    cmd = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "--no-loadscope-reorder", "-q"]
    cmd += ["-p", "no:cacheprovider"]
    res = subprocess.run(cmd, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    rows = [line.split() for line in log.read_text().splitlines()]
    workers = {tag: [w for t, w in rows if t == tag] for tag in ("built", "shared", "marked", "free")}
    assert len(workers["shared"]) == 4 and len(workers["marked"]) == 4 and len(workers["free"]) == 8
    assert len(set(workers["marked"])) == 1, workers
    assert workers["built"] == workers["shared"][:1] and len(set(workers["shared"])) == 1, workers
