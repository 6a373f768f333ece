"""The rollout producer only produces: no collective, nothing of the trainer, each response scored
once; the step's finalize does every collective.

The tests make ``torch.distributed`` look like a world of two ranks whose every collective raises,
then run the producer on the tiny model with the options whose bookkeeping needs the other ranks
(adaptive group sizes, dynamic sampling, the difficulty filter): it must finish. The same patch
stops the finalize (it gathers the pass rates): the patch is live.
"""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.distributed as torch_dist
from support.stand_ins import rollout_phase_run

from grpo_fast import dist
from grpo_fast.config import load_config
from grpo_fast.loop import producer, step_end
from grpo_fast.loop import rollout_phase as phase
from grpo_fast.loop.producer import Production, produce
from grpo_fast.rollout.hf import HFBackend
from grpo_fast.task import tiny
from grpo_fast.task.loader import load_task

OPTIONS = [
    "rollout.group_size=4",
    "rollout.batch_size=16",
    "rollout.adaptive_group_size=true",
    "rollout.max_group_size=8",
    "rollout.dynamic_sampling=true",
    "rollout.difficulty_filter=[0.0,0.9]",
]
COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "barrier",
    "reduce_scatter_tensor",
    "all_to_all_single",
)


@pytest.fixture
def two_ranks_no_collectives(monkeypatch):
    """``torch.distributed`` as a world of 2 in which any collective raises."""

    def refuse(*args, **kwargs):
        raise AssertionError("a collective ran")

    monkeypatch.setattr(torch_dist, "is_initialized", lambda: True)
    monkeypatch.setattr(torch_dist, "get_world_size", lambda group=None: 2)
    for name in COLLECTIVES:
        monkeypatch.setattr(torch_dist, name, refuse)
    return dist.DistInfo(rank=0, world_size=2)


def _run(options=OPTIONS):
    cfg = load_config("tiny", overrides=options)
    tok = tiny.build_tokenizer()
    task = load_task(cfg, tok)
    backend = HFBackend(tiny.build_model(tok, seed=0), tok, generation_batch_size=64)
    backend.version = 7  # as after step 7's weight sync
    return rollout_phase_run(cfg, task, backend)


PROGRESS = SimpleNamespace(phase=lambda *a: None, advance_phase=lambda *a: None)


def test_the_producer_runs_no_collective(two_ranks_no_collectives):
    run = _run()
    world = two_ranks_no_collectives
    run.rollout.prompts_per_rank = 2  # the step's 4 prompts over 2 ranks
    reward_fn = run.task.reward_fn.for_batch(8)
    for round_ in (0, 1):  # dynamic sampling's second round too
        rollout = produce(
            run.rollout, run.cfg, run.task, world, run.device, Production(8, round_, 1.0, reward_fn), PROGRESS
        )
        # this rank's share: 2 of the step's 4 prompts (16 responses at group 4), unseen: 4 each
        assert len(rollout.groups) == 2 and rollout.sizes == [4, 4]
        for g in rollout.groups:
            assert g.example is run.task.train[g.example_index]
            assert g.prompt_ids == run.task.prompt_ids(g.example)
            for t in g.trajectories:
                assert t.prompt_ids is g.prompt_ids and t.policy_version == 7
                assert t.scores == run.task.reward_fn(t.text, g.example.answer)  # scored, once, here
    assert reward_fn.index == 16  # the two rounds' responses, each scored exactly once


def test_a_collective_in_the_producer_is_refused(monkeypatch):
    """Planted: a producer that all-reduces (as the rollout phase once did inside its rounds)
    fails, naming the producer, even on one rank."""
    run = _run()
    real_score = producer.score

    def score_and_reduce(rollout, reward_fn, workers):
        real_score(rollout, reward_fn, workers)
        dist.all_reduce_sum([1.0], torch.device("cpu"))

    monkeypatch.setattr(producer, "score", score_and_reduce)
    job = Production(1, 0, 1.0, run.task.reward_fn.for_batch(1))
    with pytest.raises(RuntimeError, match="a collective inside the rollout producer"):
        produce(run.rollout, run.cfg, run.task, run.world, run.device, job, PROGRESS)


def test_the_finalize_does_the_collectives(two_ranks_no_collectives):
    """The same patch stops the step's side at its first collective (the pass-rate gather): the
    patch is live, and the collectives are there, not in the producer."""
    run = _run()
    run.world = two_ranks_no_collectives
    with pytest.raises(AssertionError, match="a collective ran"):
        phase.rollout_phase(run, 1, PROGRESS)


def test_sample_dumps_read_the_scores_the_rollout_phase_kept():
    """The step's sample records come from the scored batch: the reward function is not called
    again (here it would raise)."""
    run = _run(["rollout.group_size=4", "rollout.batch_size=16"])
    batch = phase.rollout_phase(run, 1, PROGRESS)

    def no_second_scoring(response, ground_truth):
        raise AssertionError("scored twice")

    task = SimpleNamespace(prompt_text=run.task.prompt_text, reward_fn=no_second_scoring)
    records = step_end._sample_records(task, batch.rollout, limit=5)
    assert len(records) == 5
    first = batch.rollout.groups[0]
    for rec, t in zip(records, first.trajectories):
        assert rec["response"] == t.text and rec["reward"] == t.scores["reward"]
        assert rec["ground_truth"] == first.example.answer


def test_a_reward_function_may_take_the_example_and_the_trajectory():
    """A ``(response, ground_truth)`` function is called as before; one that declares ``example``
    and/or ``trajectory`` (or ``**context``) gets them: here the reward is the trajectory's
    token count when the example's question starts with "1", else 0."""
    from grpo_fast.task.rewards import GuardedReward

    seen = []

    def by_context(response, ground_truth, *, example, trajectory):
        seen.append((example.answer == ground_truth, trajectory.text == response))
        return {"reward": float(trajectory.num_tokens) if example.question.startswith("1") else 0.0}

    def any_context(response, ground_truth, **context):
        return {"reward": float(sorted(context) == ["example", "trajectory"])}

    run = _run(["rollout.group_size=4", "rollout.batch_size=16"])
    for fn, check in (
        (by_context, lambda t, ex: t.num_tokens * ex.question.startswith("1")),
        (any_context, lambda t, ex: 1.0),
        (lambda r, g: {"reward": float(r == g)}, lambda t, ex: float(t.text == ex.answer)),
    ):
        job = Production(1, 0, 1.0, GuardedReward(fn, "f").for_batch(1))
        rollout = produce(run.rollout, run.cfg, run.task, run.world, run.device, job, PROGRESS)
        for g in rollout.groups:
            assert [t.scores["reward"] for t in g.trajectories] == [
                check(t, g.example) for t in g.trajectories
            ]
    assert seen and all(a and b for a, b in seen)


def test_reward_workers_scores_a_batch_on_threads_in_order():
    """data.reward_workers: 2 threads score the batch (the scores in rollout order, each the
    one-by-one call's); auto keeps a user's own function on one thread; auto puts a slow built-in
    reward on threads (the first call over SLOW_REWARD_S)."""
    import threading
    import time as _time

    from grpo_fast.task.rewards import GuardedReward

    threads = []

    def slow(response, ground_truth):
        threads.append(threading.get_ident())
        _time.sleep(0.004)
        return {"reward": float(len(response))}

    def scored(workers, fn):
        run = _run(["rollout.group_size=4", "rollout.batch_size=16", f"data.reward_workers={workers}"])
        threads.clear()
        job = Production(1, 0, 1.0, GuardedReward(fn, "slow").for_batch(1))
        rollout = produce(run.rollout, run.cfg, run.task, run.world, run.device, job, PROGRESS)
        assert [t.scores["reward"] for t in rollout.trajectories] == [
            float(len(t.text)) for t in rollout.trajectories
        ]
        return len(set(threads) - {threading.get_ident()})  # the threads besides the caller's

    assert scored(2, slow) == 2
    assert scored("auto", slow) == 0  # a user's function: it may keep state
    slow.__module__ = "grpo_fast.task.builtin_for_the_test"  # as a reward built into grpo_fast
    assert scored("auto", slow) == 2  # slow: threads (this machine's 2 CPUs, at most 4)
