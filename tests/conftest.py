"""Test setup shared by every test module.

Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set
before ``triton`` is first imported, so it is set here, at collection time.

Under pytest-xdist (``make test`` runs ``-n 2``) each worker is one process per core: torch
and the processes a test starts (training runs, ``mp.spawn`` ranks, vLLM) get one intra-op
thread each (``OMP_NUM_THREADS=1``), instead of two per worker fighting over two cores at
OpenMP barriers. The ``slow`` tests (a minute or more each) are handed out first, so that
the workers do not end on one long tail. Nothing here changes a plain ``pytest`` run.
"""

import os

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
