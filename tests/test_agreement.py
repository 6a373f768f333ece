"""``grpo_fast.loop.agreement.agree``: every rank raises together once any rank's unit of rollout
work failed. The two collectives are played in one process (rank 0's view of a world of 2, the
other rank's contribution written in); the 2-rank runs are in tests/test_vllm_ranks.py (lockstep)
and tests/test_pipeline.py (the pipeline)."""

import pytest
import torch

from grpo_fast import dist
from grpo_fast.errors import EngineDied, EngineError, TrainingStopped
from grpo_fast.loop import agreement

RANK_0 = dist.DistInfo(rank=0, world_size=2)


def _other_rank(monkeypatch, flags: list[float], error: tuple[bool, str] | None) -> None:
    """Rank 1's side of the all-reduce (``flags``: its failure flag and values) and of the gather."""

    def all_reduce(t, op, group):
        assert op == torch.distributed.ReduceOp.MAX and group == "agree"
        t.copy_(torch.maximum(t, torch.tensor(flags, dtype=t.dtype)))

    def all_gather_object(out, obj, group):
        assert group == "agree"
        out[0], out[1] = obj, error

    monkeypatch.setattr(torch.distributed, "all_reduce", all_reduce)
    monkeypatch.setattr(torch.distributed, "all_gather_object", all_gather_object)


def test_no_failure_gives_every_rank_the_largest_values(monkeypatch):
    _other_rank(monkeypatch, [0.0, 3.0, 1.0], None)
    assert agreement.agree("agree", RANK_0, None, [2.0, 4.0]) == [3.0, 4.0]


def test_an_engine_failure_elsewhere_is_an_engine_error_naming_the_rank(monkeypatch):
    """So that every rank writes the checkpoint together (``checkpointing.stop_within``)."""
    _other_rank(monkeypatch, [1.0], (True, "the vLLM server at http://h:1 stopped answering"))
    with pytest.raises(EngineError, match=r"^rank 1: the vLLM server at http://h:1 stopped answering$"):
        agreement.agree("agree", RANK_0, None)


def test_another_failure_elsewhere_stops_the_run_naming_the_rank_and_what_failed(monkeypatch):
    _other_rank(monkeypatch, [1.0], (False, "division by zero"))
    with pytest.raises(TrainingStopped, match=r"^rank 1's rollout producer failed: division by zero$") as got:
        agreement.agree("agree", RANK_0, None, what="rollout producer")
    assert not isinstance(got.value, EngineError)  # no rank writes a checkpoint: the failed one cannot


def test_the_failed_rank_raises_its_own_error(monkeypatch):
    _other_rank(monkeypatch, [0.0], None)
    own = EngineDied("the engine process exited with code -9")
    with pytest.raises(EngineDied) as got:
        agreement.agree("agree", RANK_0, own)
    assert got.value is own


def test_a_world_of_one_runs_no_collective(monkeypatch):
    monkeypatch.setattr(torch.distributed, "all_reduce", None)  # a call would fail
    assert agreement.agree(None, dist.DistInfo(), None, [1.0, 2.0]) == [1.0, 2.0]
    with pytest.raises(ZeroDivisionError):
        agreement.agree(None, dist.DistInfo(), ZeroDivisionError("division by zero"))
    assert agreement.make_group(dist.DistInfo(), 60.0) is None
