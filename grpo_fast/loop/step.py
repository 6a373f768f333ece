"""One training step, for both outlines: ``train`` runs ``step`` from the step after the run's
last to ``cfg.steps``, the batches coming from a **source**.

    batch               the source's finalized batch of step k (``Source.batch``); a signal or
                        a failed engine while it is made: the checkpoint of k − 1, one line
    share_batch         the sp group's batch (loop/sp_group.py; the batch itself without
                        sequence parallelism)
    optimization_phase  microbatches → fused lm_head + loss → backward → step       loop/optimization.py
    publish             the new weights to the rollout side (``Source.publish``); an engine
                        that failed there: the step is done all the same, its row and its
                        checkpoint written, then one line
    close_step          totals, β, the step counter → the metrics row             loop/stats.py
    end_of_step         health, eval, samples, log; stops; checkpoint             loop/step_end.py

Two sources. ``Lockstep`` (the default) generates step k's batch when the step asks for it
(``rollout_phase``: one production round, or dynamic sampling's several) and publishes by
loading the new weights into the backend at once (``RolloutSide.sync_weights``: stage, then
load). The pipeline (``grpo_fast.loop.pipeline.Pipeline``: ``rollout.max_staleness``,
``rollout.placement=process``) takes the batch its producer made from the weights of step
k − 1 − S and publishes by staging the new weights for the producer to load when a job needs them.
"""

from __future__ import annotations

import time
from typing import Protocol

from grpo_fast.errors import EngineError
from grpo_fast.loop import sp_group
from grpo_fast.loop.checkpointing import engine_stopped, stop_within
from grpo_fast.loop.optimization import optimization_phase
from grpo_fast.loop.rollout_phase import RolloutBatch, rollout_phase
from grpo_fast.loop.state import Run
from grpo_fast.loop.stats import close_step
from grpo_fast.loop.step_end import end_of_step
from grpo_fast.obs.metrics import PhaseProgress, reset_peak_memory
from grpo_fast.rollout.fleet import Fleet
from grpo_fast.rollout.registry import backend as rollout_backend


class Source(Protocol):
    """Where a step's batch comes from and where its new weights go."""

    def batch(self, step: int, progress: PhaseProgress, started: float) -> RolloutBatch:
        """This rank's finalized batch of ``step`` (``started``: the step's ``perf_counter``)."""
        ...

    def publish(self, step: int) -> None:
        """The weights after optimizer step ``step`` to the rollout side (``EngineError`` when an
        engine apart from the trainer died or timed out)."""
        ...

    def metrics(self, step: int) -> dict[str, float]:
        """The source's metrics of ``step`` (after ``publish``)."""
        ...


class Lockstep:
    """Generation when the step asks for it, from the weights the last step published."""

    def __init__(self, run: Run):
        self.run = run
        self.publish_s: float | None = None  # the last publish's wall time

    def batch(self, step: int, progress: PhaseProgress, started: float) -> RolloutBatch:
        return rollout_phase(self.run, step, progress)

    def publish(self, step: int) -> None:
        t0 = time.perf_counter()
        self.run.rollout.sync_weights(self.run.model, step)  # stage + load (vllm: push + probe)
        self.publish_s = time.perf_counter() - t0

    def metrics(self, step: int) -> dict[str, float]:
        """``time/weight_sync_s`` (this step's publish, where the backend has weights of its own
        to load) and a fleet's metrics of this step."""
        backend = self.run.rollout.backend
        row = (
            {}
            if self.publish_s is None or not rollout_backend(self.run.cfg.rollout.backend).needs_weight_push
            else {"time/weight_sync_s": self.publish_s}
        )
        if isinstance(backend, Fleet):
            row.update(backend.take_metrics())
        return row


def train(run: Run, source: Source, progress: PhaseProgress) -> None:
    """Every step from the one after ``run``'s last to ``cfg.steps`` (``step``)."""
    for k in range(run.trainer.state.step + 1, run.cfg.steps + 1):
        step(run, source, k, progress)


def step(run: Run, source: Source, k: int, progress: PhaseProgress) -> None:
    """Optimizer step ``k``: the source's batch → the sp group's batch → optimization → publish
    → totals, β, step counter → metrics → end of step (module docstring)."""
    t0 = time.perf_counter()
    reset_peak_memory(run.device)
    # a signal, or a failed engine (on any rank: every rank together): step k - 1's checkpoint
    with stop_within(run, k - 1, f"step {k}'s rollout", together=True):
        batch = source.batch(k, progress, t0)
    # sp groups train their ranks' batches together (loop/sp_group.py); the metrics are each rank's own
    result = optimization_phase(run, k, sp_group.share_batch(run, batch), progress)
    failed = None
    try:
        source.publish(k)
    except EngineError as exc:  # an engine apart died or timed out: the step is done all the same
        failed = exc
    row = close_step(run, k, batch, result, t0)  # totals, β, step counter → metrics row
    row.update(source.metrics(k))
    if failed is not None:  # the step's row, its checkpoint (a resume pushes its weights), one line
        run.logger.log(k, row)
        raise engine_stopped(run, k, failed, f"step {k}'s weight sync") from None
    end_of_step(run, k, batch, result, row, progress)
