"""One vLLM server, many trainer ranks (``rollout.placement=server`` under torchrun).

The server runs on devices of its own (``rollout.engine_devices``, disjoint from the trainer
ranks'), or anywhere at ``rollout.server_url``. Rank 0 (the **leader**) starts it or attaches to
it, and broadcasts its URL (or why it could not) to the other ranks (the **followers**); every
rank sends its own prompts to it (each request with its rank's seed), as each rank's colocated
engine would sample them.

A weight push is the leader's alone, but every rank takes part in it: under FSDP the policy's
tensors are gathered whole one at a time (a collective each), so each follower walks the same
tensors in the same order and drops them, and the leader walks them to the end even when the
server fails half-way (``exhaust``). The trainer's probe log-probs are computed on every rank (a
forward, a collective under FSDP) before the push. Then the leader's outcome — its error, or the
probe's gap and the adapter now served — is broadcast: every rank raises the same error (a dead
server, a wait past ``rollout.sync_timeout``, a stale engine), or records the same gap and labels
its requests with the same policy version and adapter (``ServerEngine.follow``). A push starts
once every rank has reached it, so that none has a request in flight while the weights change.

The barrier and the outcome go over a gloo group of the pushes' own (``shared_server``). With
``rollout.max_staleness > 0`` (``grpo_fast.loop.pipeline``) the pushes are the producers' (a
thread on each rank): the trainers stage each version (the gathers, on every rank; the host copy
on the leader alone) and the producers load it, their broadcasts never interleaved with the
trainers' collectives.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import torch.distributed as torch_dist


@dataclass
class Outcome:
    """What the leader tells the followers after a push: the error it raised (None: the push
    and its probe held), the probe's mean |Δ log p|, the LoRA adapter the server now serves."""

    error: BaseException | None
    abs_diff: float | None
    adapter: Any = None


class RankShare:
    """The trainer ranks' share of one engine: ``rank`` 0 leads (module docstring). ``group``:
    the process group the outcome is broadcast over (None: every rank's default group; a run's
    is a gloo group of the pushes' own, ``placement/apart.py: shared_server``)."""

    def __init__(self, rank: int, group=None):
        self.rank = rank
        self.group = group

    @property
    def leader(self) -> bool:
        return self.rank == 0

    def broadcast(self, obj):
        """The leader's ``obj`` on every rank of the group."""
        box = [obj]
        torch_dist.broadcast_object_list(box, src=0, group=self.group)
        return box[0]

    def push(self, lead: Callable[[], Outcome], follow: Callable[[], None]) -> Outcome:
        """The leader runs ``lead`` (the push and its probe; an error it raises becomes the
        outcome), each follower ``follow`` (the same gathers, nothing sent); then every rank
        gets the leader's outcome and raises its error, if any. The push starts once every rank
        is here: no rank has a request in flight while the weights (or the adapter) change."""
        torch_dist.barrier(group=self.group)
        if self.leader:
            try:
                outcome = lead()
            except BaseException as exc:  # every rank raises it, below
                outcome = Outcome(exc, None)
        else:
            follow()
            outcome = None
        outcome = self.broadcast(outcome)
        if outcome.error is not None:
            raise outcome.error
        return outcome

    def attach(self, start: Callable[[], Any], follower: Callable[[str], Any]):
        """The engine of this rank: the leader's from ``start()`` (which starts or attaches to
        the server), whose ``url`` it broadcasts; a follower's ``follower(url)``. A failed start
        raises the leader's error on every rank."""
        if self.leader:
            try:
                engine = start()
            except BaseException as exc:  # every rank raises it
                self.broadcast(exc)
                raise
            self.broadcast(engine.url)
            return engine
        url = self.broadcast(None)
        if isinstance(url, BaseException):
            raise url
        return follower(url)


def exhaust(items: Iterable) -> None:
    """Walk ``items`` to the end, dropping them (the gathers a push makes on every rank)."""
    for _ in items:
        pass
