"""Test setup shared by every test module.

Without CUDA, Triton kernels run under the interpreter: ``TRITON_INTERPRET=1`` must be set
before ``triton`` is first imported, so it is set here, at collection time.
"""

import os

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

from grpo_fast.testing import skip_unrunnable_items  # after TRITON_INTERPRET is set


def pytest_collection_modifyitems(config, items):
    skip_unrunnable_items(items)
