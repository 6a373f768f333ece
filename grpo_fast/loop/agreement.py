"""Under torchrun, the ranks agree on each unit of rollout work before any collective follows it.

Each rank generates its share of a step's prompts on its own, and a rank whose generation fails
(a dead server, a wait past ``rollout.request_timeout``, a reward function's bug) would otherwise
leave the others in the step's next collective (the pass-rate gather, the gradient all-reduce)
until the process group's timeout: 10 min on NCCL, 30 min on gloo, with torch's traceback, and
only if torchrun does not kill them first. So after each unit — a lockstep production round
(``grpo_fast.loop.rollout_phase``), a batch the pipeline's producer delivered
(``grpo_fast.loop.pipeline``) — the ranks run ``agree``: one all-reduce (MAX) of a failure flag
and the caller's values, and when a rank failed, one gather of the failures' words. Every rank
then raises together: the failed rank its own error; the others an ``EngineError`` naming the
rank when the failure was an engine's (so that every rank writes the last finished step's
checkpoint together: under FSDP that save is a collective), else ``TrainingStopped`` naming it.

The agreement runs on a gloo group of its own (``make_group``: CPU tensors, NCCL or not) whose
timeout is ``rollout.request_timeout`` + 60 s: a rank whose generation is late stops at its own
bound, with one line on every rank, before the others' wait meets the group's timeout.
"""

from __future__ import annotations

from datetime import timedelta

import torch

from grpo_fast import dist
from grpo_fast.errors import EngineError, TrainingStopped

AFTER_REQUEST_TIMEOUT_S = 60  # the agreement's timeout beyond rollout.request_timeout's


def make_group(world: dist.DistInfo, request_timeout: float):
    """The agreement's gloo group over every rank (None in a world of one). Every rank calls it
    at the same point of setup (``torch.distributed.new_group`` is a collective)."""
    if not world.enabled:
        return None
    limit = timedelta(seconds=request_timeout + AFTER_REQUEST_TIMEOUT_S)
    return torch.distributed.new_group(backend="gloo", timeout=limit)


def agree(
    group, world: dist.DistInfo, error: BaseException | None, values: list[float] = (), what: str = "rollout"
) -> list[float]:
    """``values`` (floats, the same length on every rank) reduced to their maximum over every
    rank, once each rank has done its unit of ``what`` ("rollout", "rollout producer"): ``error``
    what this rank's unit raised, or None. When any rank failed, every rank raises (module
    docstring). In a world of one: ``error`` raised if there is one, else ``values``."""
    if not world.enabled:
        if error is not None:
            raise error
        return list(values)
    flags = torch.tensor([float(error is not None), *values], dtype=torch.float64)
    torch.distributed.all_reduce(flags, op=torch.distributed.ReduceOp.MAX, group=group)
    failed, *reduced = flags.tolist()
    if not failed:
        return reduced
    errors = [None] * world.world_size
    mine = None if error is None else (isinstance(error, EngineError), str(error))
    torch.distributed.all_gather_object(errors, mine, group=group)
    if error is not None:
        raise error
    rank, (engine, words) = next((k, e) for k, e in enumerate(errors) if e is not None)
    if engine:
        raise EngineError(f"rank {rank}: {words}")
    raise TrainingStopped(f"rank {rank}'s {what} failed: {words}")
