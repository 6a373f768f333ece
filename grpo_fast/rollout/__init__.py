"""Rollout backends behind one interface (``RolloutBackend``), found by registry (``registry``).

``hf`` (transformers decoding: ``rollout/hf/``) and ``vllm`` (a vLLM engine: ``rollout/vllm/``,
its placements in ``placement/``, its weight transport in ``transfer/``) are the two packages
that declare a ``BACKEND``; ``make_backend`` builds the configured one. Beside them: the backend
protocol (``base.py``), the registry, sampling settings, the trajectory type and multi-turn
rollouts. Backends take the run's config as a plain object and import nothing above them.
"""

from __future__ import annotations

from grpo_fast.rollout.base import Rollout, RolloutBackend, SamplingParams, generate_groups
from grpo_fast.rollout.registry import BackendContext, backend, backends
from grpo_fast.rollout.trajectory import Group, Role, Trajectory

__all__ = [
    "BackendContext",
    "Group",
    "Role",
    "Rollout",
    "RolloutBackend",
    "SamplingParams",
    "Trajectory",
    "backend",
    "backends",
    "generate_groups",
    "make_backend",
]


def make_backend(ctx: BackendContext) -> RolloutBackend:
    """The configured backend (``ctx.cfg.rollout.backend``), built with the current policy
    loaded (a backend with its own weights has had them pushed and probed)."""
    return backend(ctx.cfg.rollout.backend).build(ctx)
