"""Processes that run what the trainer must not run in its own: the math grader's worker
(``worker``), model-written code (``sandbox``), and a bounded pool for batches of either
(``pool``). Standard library only; nothing above ``grpo_fast.errors`` is imported."""

from grpo_fast.sandbox.pool import default_workers, ordered_map
from grpo_fast.sandbox.sandbox import (
    BWRAP_FIX,
    ISOLATIONS,
    STATUSES,
    Limits,
    Sandbox,
    SandboxResult,
    SandboxUnavailable,
    bwrap_status,
)
from grpo_fast.sandbox.worker import DIE_WITH_PARENT, WorkerPool, WorkerProcess

__all__ = [
    "BWRAP_FIX",
    "DIE_WITH_PARENT",
    "ISOLATIONS",
    "STATUSES",
    "Limits",
    "Sandbox",
    "SandboxResult",
    "SandboxUnavailable",
    "WorkerPool",
    "WorkerProcess",
    "bwrap_status",
    "default_workers",
    "ordered_map",
]
