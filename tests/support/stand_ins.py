"""Stand-ins for the tests that drive one part of the loop without the rest of a run."""

from __future__ import annotations

import torch


def rollout_phase_run(cfg, task, backend, *, logger=None, beta: float = 0.0):
    """A stand-in ``Run`` holding just what the rollout phase (producer and finalize) reads, on one
    rank: the config, the task, a ``RolloutSide`` around ``backend`` with the prompt sampler and
    pass-rate table setup would build, a health monitor, and a trainer side that only has β (no
    model: tests of the rollout-side options drive the phase with a scripted backend)."""
    import contextlib
    from types import SimpleNamespace

    from grpo_fast import dist
    from grpo_fast.loop.setup import _prompt_sampler
    from grpo_fast.loop.state import RolloutSide
    from grpo_fast.obs.health import HealthMonitor, HealthThresholds

    pass_rates, sampler = _prompt_sampler(cfg, task)
    side = RolloutSide(backend, sampler, pass_rates, cfg.rollout.batch_size // cfg.rollout.group_size)
    if logger is None:  # the events the phase logs, kept in .lines
        logger = SimpleNamespace(lines=[])
        logger.event = logger.lines.append
    return SimpleNamespace(
        cfg=cfg,
        world=dist.DistInfo(),
        device=torch.device("cpu"),
        health=HealthMonitor(HealthThresholds()),
        task=task,
        rollout=side,
        logger=logger,
        trainer=SimpleNamespace(state=SimpleNamespace(beta=beta)),
        generation_weights=contextlib.nullcontext,  # unsharded: nothing to gather
        agree=None,  # one rank: no agreement group (grpo_fast.loop.agreement)
    )


def plan_threads_note() -> str:
    """What the plan line says of the CPU threads in a test's in-process run: conftest's (or the
    user's) ``OMP_NUM_THREADS``, and the OpenMP wait of the pytest process (not a command: the
    environment's), e.g. ``1 CPU thread (OMP_NUM_THREADS=1), OpenMP wait spin``."""
    import os

    from grpo_fast import threads

    n = int(os.environ["OMP_NUM_THREADS"])
    return f"{n} CPU thread{'s' if n > 1 else ''} (OMP_NUM_THREADS={n}), OpenMP wait {threads.wait_policy_in_effect()}"
