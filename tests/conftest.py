"""Test setup shared by every test module.

Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set
before ``triton`` is first imported, so it is set here, at collection time.

Under pytest-xdist (``make test`` runs ``-n 2``) each worker is one process per core: torch
and the processes a test starts (training runs, ``mp.spawn`` ranks, vLLM) get one intra-op
thread each (``OMP_NUM_THREADS=1``), instead of two per worker fighting over two cores at
OpenMP barriers. The ``slow`` tests (a minute or more each) are handed out first, so that
the workers do not end on one long tail. Nothing here changes a plain ``pytest`` run, except
that ``XDG_CACHE_HOME`` points at a temporary folder (each test its own): the runs the tests
start write their timing history (``grpo_fast.obs.eta``) there, never into ``~/.cache``.
"""

import os

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from grpo_fast.testing import skip_unrunnable_items  # after TRITON_INTERPRET is set

XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")  # "gw0", "gw1", ... (unset without -n)
if XDIST_WORKER:
    os.environ.setdefault("OMP_NUM_THREADS", "1")  # inherited by the processes tests start
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))


def pytest_collection_modifyitems(config, items):
    skip_unrunnable_items(items)
    if XDIST_WORKER:  # every worker must collect the same order; sort is stable
        items.sort(key=lambda item: "slow" not in item.keywords)


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
