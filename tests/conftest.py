"""Test setup shared by every test module.

Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set
before ``triton`` is first imported, so it is set here, at collection time.

Under pytest-xdist (``make test`` runs ``-n 2``) each worker is one process per core: torch
and the processes a test starts (training runs, ``mp.spawn`` ranks, vLLM) get one intra-op
thread each (``OMP_NUM_THREADS=1``), instead of two per worker fighting over two cores at
OpenMP barriers. The ``slow`` tests (a minute or more each) are handed out first, so that
the workers do not end on one long tail. Nothing here changes a plain ``pytest`` run, except
that ``XDG_CACHE_HOME`` points at a temporary folder (each test its own): the runs the tests
start write their timing history (``grpo_fast.obs.eta``) there, never into ``~/.cache``, and
the machine's load reads as idle to the runs a test makes in its own process.

The user's run folders are data: a test never reads or changes them. Every test runs with its
working directory in a temporary folder of its own (the module fixtures in one for the session),
so a run with a default ``output_dir`` (``runs/tiny``, ``runs/grpo``) writes there, and a process
a test starts inherits that folder; ``PYTHONPATH`` leads with this checkout, so such a process
imports the package under test from anywhere. Tests name the repository's files by absolute path
(``REPO / "configs" / ...``). As a second line, the session compares the repository's ``runs/``
(names, sizes, modification times) before and after, and fails if anything there changed.
"""

import os
import sys
from pathlib import Path

import pytest
import torch
from run_folders import stat_tree  # tests/run_folders.py (pytest puts tests/ on sys.path)

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from support.collection import group_module_fixtures  # tests/support/collection.py

from grpo_fast.testing import skip_unrunnable_items  # after TRITON_INTERPRET is set

REPO = Path(__file__).resolve().parents[1]
USER_RUNS = REPO / "runs"  # where `make run` and every preset's output_dir write, relative to the checkout
_RUNS_BEFORE = pytest.StashKey[dict]()  # stat_tree(USER_RUNS) when the session started

# The tests build their models, tokenizers and data; nothing downloads. The Hugging Face Hub is off
# for the session and the processes the tests start, so that a preset's Hub dataset fails at once
# (the dry run's "could not load ... pass a local .jsonl" line) instead of after huggingface_hub's
# retries on a machine without internet: 23 s of back-off each (measured: a dry run of rtx4090).
os.environ.setdefault("HF_HUB_OFFLINE", "1")

XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... (unset without -n)
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the processes tests start
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


@pytest.hookimpl(tryfirst=True)  # before pytest-xdist's, which reads the xdist_group marks
def pytest_collection_modifyitems(config, items):
    skip_unrunnable_items(items)
    if XDIST_WORKER:  # every worker must collect the same order; sort is stable
        items.sort(key=lambda item: "slow" not in item.keywords)
        group_module_fixtures(items)


# The timing history of grpo_fast.obs.eta lives in $XDG_CACHE_HOME/grpo_fast: the runs the tests
# start write it into a folder of their own, never the real ~/.cache. The tools that keep their
# caches under that variable keep them where they are (the models, vLLM's compiled graphs).
_REAL_CACHE = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
_PINNED_CACHES = {"HF_HOME": "huggingface", "TORCH_HOME": "torch", "VLLM_CACHE_ROOT": "vllm"}


@pytest.fixture(scope="session", autouse=True)
def _session_cache_home(tmp_path_factory):
    """For the session (the module-scoped fixtures' runs too): a cache folder of its own."""
    with pytest.MonkeyPatch.context() as mp:
        for var, sub in _PINNED_CACHES.items():
            if var not in os.environ:
                mp.setenv(var, os.path.join(_REAL_CACHE, sub))
        mp.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))
        yield


@pytest.fixture(autouse=True)
def _cache_home(tmp_path_factory, monkeypatch):
    """Each test a timing history of its own: no plan line quotes another test's run."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path_factory.mktemp("xdg_cache")))


@pytest.fixture(scope="session", autouse=True)
def _session_outside_the_checkout(tmp_path_factory):
    """For the session (the module fixtures' runs): the working directory in a temporary folder,
    and this checkout first on ``PYTHONPATH`` for the processes the tests start."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("PYTHONPATH", os.pathsep.join(p for p in (str(REPO), os.environ.get("PYTHONPATH")) if p))
        mp.chdir(tmp_path_factory.mktemp("cwd"))
        yield


@pytest.fixture(autouse=True)
def _cwd_of_its_own(tmp_path_factory, monkeypatch):
    """Each test a working directory of its own: a default ``output_dir`` is a fresh folder."""
    monkeypatch.chdir(tmp_path_factory.mktemp("cwd"))


def pytest_sessionstart(session):
    if not XDIST_WORKER:  # the controller (or a plain run) watches; the workers run the tests
        session.config.stash[_RUNS_BEFORE] = stat_tree(USER_RUNS)


def pytest_sessionfinish(session, exitstatus):
    before = session.config.stash.get(_RUNS_BEFORE, None)
    if before is None:
        return
    after = stat_tree(USER_RUNS)
    if after != before:
        changed = sorted(k for k in before.keys() | after.keys() if before.get(k) != after.get(k))
        sys.stderr.write(
            f"\nerror: the tests changed {USER_RUNS}, the user's run folders ({len(changed)} paths: "
            f"{', '.join(changed[:5])}{' ...' if len(changed) > 5 else ''}); a test must run in its own folder\n"
        )
        session.exitstatus = pytest.ExitCode.TESTS_FAILED


@pytest.fixture(scope="session")
def tiny_preset_run(tmp_path_factory) -> Path:
    """The README's main job as a user starts it (``--preset tiny``: seed 0, the hf sampler,
    lockstep), run once on the worker that needs it: its output folder. Two tests read it:
    test_train's learning bar and test_pipeline's staleness-1 comparison, which ran the same
    command each (~150 s of a worker on CI's machine); both carry ``xdist_group("tiny_preset")``,
    so they land on one worker."""
    from test_train import _cli  # `python -m grpo_fast.train --preset tiny ...`

    out = tmp_path_factory.mktemp("tiny_preset") / "run"
    res = _cli("tiny", f"output_dir={out}", "logging.progress=false", timeout=1800)
    assert res.returncode == 0, res.stderr[-2000:]
    return out


@pytest.fixture(scope="session")
def tiny_straight_run(tmp_path_factory) -> Path:
    """The uninterrupted 10-step tiny run (``test_train._train_cmd``: hf sampler, a value head, 40
    warm-start steps, an evaluation and a checkpoint every 3 steps) the kill-and-resume tests compare with,
    run once on the worker that needs it: its output folder, which no test writes to. Read by
    test_train's SIGKILL test (hf) and test_faults' SIGTERM test, which ran the same command each
    (~20 s of a worker on CI's machine); both carry ``xdist_group("tiny_straight")``."""
    import subprocess

    from test_train import _train_cmd

    out = tmp_path_factory.mktemp("tiny_straight") / "run"
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    subprocess.run(_train_cmd(out), check=True, env=env, capture_output=True, timeout=600)
    return out


@pytest.fixture(autouse=True)
def _idle_machine(monkeypatch):
    """An idle machine for the plan line, the timing history (``grpo_fast.obs.eta``) and the
    thread count of the runs a test makes in its own process: the tests share a busy machine,
    whose load would add "expect it slower" to a plan line and keep a run's timings out of the
    history. The tests of the load set their own (``monkeypatch.setattr(eta, "machine_load",
    ...)``, ``eta.other_work_meter``)."""
    from grpo_fast.obs import eta

    monkeypatch.setattr(eta, "machine_load", lambda: 0.0)
    monkeypatch.setattr(eta, "other_work_meter", IdleMeter)
    for plans in ("_PLAN_LOADS", "_RUN_METERS", "_PLAN_KEYS"):  # what one test's plan line left
        monkeypatch.setattr(eta, plans, {})


class IdleMeter:
    """``eta.other_work_meter`` on an idle machine: no other work, ever."""

    latest = 0.0

    def read(self) -> float:
        return 0.0


# Real in-process vLLM engines (``VLLMEngine``) that tests start, stopped at known points: vLLM's
# engine core, when it stops, tears down vLLM's distributed state for the whole process, so one
# that a test dropped in a reference cycle, collected during a later test's engine step, broke
# that engine ("pipeline model parallel group is not initialized", seen once in CI depending on
# the order the xdist workers drew the vllm tests). An engine started by a test's body (directly
# or by a run inside it) stops when that test ends; one a fixture started, when its module's
# tests on this worker end.
_ENGINES: dict[int, tuple[str, object]] = {}  # id -> (phase that started it, weakref)


def _track_vllm_engines() -> None:
    import weakref

    from grpo_fast.rollout.vllm import VLLMEngine

    if getattr(VLLMEngine.__init__, "_tracked", False):
        return
    init = VLLMEngine.__init__

    def tracked(self, *args, **kwargs):
        init(self, *args, **kwargs)
        _ENGINES[id(self)] = (_ENGINE_PHASE[0], weakref.ref(self))

    tracked._tracked = True
    VLLMEngine.__init__ = tracked


_ENGINE_PHASE = ["setup"]


def _shutdown_engines(phase: str | None) -> None:
    for key, (started, ref) in list(_ENGINES.items()):
        engine = ref()
        if engine is None or phase is None or started == phase:
            _ENGINES.pop(key)
            if engine is not None:
                engine.shutdown()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_call(item):
    _ENGINE_PHASE[0] = "call"
    yield
    _ENGINE_PHASE[0] = "setup"


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    yield
    if "vllm" not in item.keywords:
        return
    _shutdown_engines("call")
    if nextitem is None or nextitem.module is not item.module:  # its module's fixtures are gone
        _shutdown_engines(None)


_track_vllm_engines()
