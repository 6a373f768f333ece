"""The batch an sp group trains (``train.sequence_parallel=N``): every rank's rollout, shared.

Generation stays whole-sequence and is not split: each rank generates, scores and normalizes its
own share of the step's prompts, as under plain data parallelism (the same prompts, seeds and
advantages as a run of as many ranks with ``sequence_parallel=1``, so the rollout engines of every
rank keep working). ``share_batch`` then gathers the N rollout batches of an sp group, in sp-rank
order, onto each of its ranks: that is the dp rank's batch, which the group trains together, each
rank holding 1/N of every sequence's tokens (``grpo_fast.policy.sequence_parallel``). The step's
metrics still come from each rank's own batch (every response counted once over the world).
"""

from __future__ import annotations

import dataclasses

import torch

from grpo_fast import dist
from grpo_fast.loop.rollout_phase import RolloutBatch
from grpo_fast.loop.state import Run
from grpo_fast.rollout import Rollout


def share_batch(run: Run, batch: RolloutBatch) -> RolloutBatch:
    """``batch`` (this rank's groups: prompts, trajectories with their rewards, advantages and
    scores) joined with its sp group's, in sp-rank order: what the optimization phase trains (one
    collective of pickled groups: the token ids, not the ``[tokens × hidden]`` activations).
    ``batch`` itself without sequence parallelism."""
    sp = run.world.sp
    if not sp.enabled:
        return batch
    mine = (batch.rollout, batch.advantages.cpu(), batch.raw_rewards.cpu())
    parts = dist.all_gather_objects(mine, axis=sp)
    return dataclasses.replace(
        batch,
        rollout=Rollout.concat([p[0] for p in parts]),
        advantages=torch.cat([p[1] for p in parts]).to(batch.advantages.device),
        raw_rewards=torch.cat([p[2] for p in parts]).to(batch.raw_rewards.device),
    )
