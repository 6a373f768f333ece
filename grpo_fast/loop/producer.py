"""The rollout producer: this rank's prompts → the backend's groups → each response
scored once.

The producer only produces. It runs no collective (``dist.no_collectives``: a collective inside
raises), reads nothing of the trainer (the backend samples from the weights it was last given,
``RolloutSide.sync_weights``) and changes only the rollout side: the prompt sampler's position
(``RolloutSide.draw``). Whatever needs the other ranks or the trainer — the health monitor's
temperature, the pass-rate gather, dynamic sampling's round count, the batch std, the KL in the
reward — is the step's finalize (``grpo_fast.loop.rollout_phase``).

What it returns is a ``Rollout`` of groups, each carrying its task example and its index in the
training set, each trajectory its ``scores`` (what the reward function returned, for the task
reward, the metrics and the sample dumps alike: rewards are scored once).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from grpo_fast import dist
from grpo_fast.loop import preempt
from grpo_fast.loop.state import RolloutSide
from grpo_fast.rollout import Rollout, generate_groups
from grpo_fast.rollout.sampling import sampling_params, sampling_rng, step_seed
from grpo_fast.sandbox.pool import default_workers
from grpo_fast.task.rewards import correct, score_batch


@dataclass(frozen=True)
class Production:
    """What one production is asked for: the step and dynamic-sampling round it belongs to, the
    temperature to sample at (the step decides it, with the health monitor's boost), and the
    batch's reward function (``reward_fn.for_batch(step)``: it numbers and counts)."""

    step: int
    round: int
    temperature: float
    reward_fn: object
    # the prompts (indices into the training set) to generate for, instead of drawing the step's:
    # a batch generated again (grpo_fast.loop.pipeline refuses one sampled by too old a policy)
    prompts: tuple[int, ...] | None = None


def produce(
    side: RolloutSide, cfg, task, world: dist.DistInfo, device: torch.device, job: Production, progress
) -> Rollout:
    """This rank's share of ``job.step``'s prompts (round ``job.round``), their groups generated
    and scored (``generate_production``, then ``score_production``)."""
    rollout = generate_production(side, cfg, task, world, device, job, progress)
    score_production(rollout, job, cfg)
    return rollout


def generate_production(
    side: RolloutSide, cfg, task, world: dist.DistInfo, device: torch.device, job: Production, progress
) -> Rollout:
    """``produce`` up to its scoring: this rank's share of ``job.step``'s prompts (round
    ``job.round``), their groups generated, each group carrying its example and its index in the
    training set: prompt i's group has ``rollout.group_size`` responses, or with
    ``rollout.adaptive_group_size`` a size from its pass rate (the table as the step last
    recorded it). Seeded per (run seed, step, rank, round): a resumed run samples
    what the straight run sampled. ``job.prompts``: these prompts instead of the step's draw.
    The pipeline scores the batch apart (``score_production``), while it generates the next."""
    r = cfg.rollout
    with dist.no_collectives("the rollout producer"):
        idx = side.draw(job.step, world.ranks) if job.prompts is None else list(job.prompts)
        examples = [task.train[i] for i in idx]
        prompt_ids = [task.prompt_ids(e) for e in examples]
        sizes = [r.group_size] * len(idx)
        if r.adaptive_group_size:  # by pass rate, this rank's total kept: n·G responses
            sizes = side.pass_rates.group_sizes(
                idx, r.group_size, r.min_group_size, r.max_group_size, len(idx) * r.group_size
            )
        seed = step_seed(
            cfg.seed, job.step, world.ranks.rank, round=job.round
        )  # the same samples after a resume
        params = sampling_params(r, task.stop, temperature=job.temperature, seed=seed)
        progress.phase("rollout" if job.round == 0 else f"rollout {job.round + 1}", len(prompt_ids))
        with sampling_rng(params.seed if world.enabled else None, device):
            advance = preempt.unit_callback(progress.advance_phase)  # a signal: stop after this chunk
            rollout = generate_groups(side.backend, prompt_ids, sizes, params, progress=advance)
        side.backend.sleep()
        for group, example, i in zip(rollout.groups, examples, idx):
            group.example, group.example_index = example, i
    return rollout


def score_production(rollout: Rollout, job: Production, cfg) -> None:
    """Each response of ``generate_production``'s rollout scored by ``job.reward_fn`` (``score``,
    on ``data.reward_workers`` threads); no collective; a signal abandons a reward that hangs."""
    with dist.no_collectives("the rollout producer"), preempt.rewards_abandonable():
        score(rollout, job.reward_fn, cfg.data.reward_workers)


# auto: a reward whose first call of the batch takes longer than this is scored on threads; the
# tiny task's exact match takes ~5 µs a call, where threads cost 3 ms a step of 256 responses
# (1.3 → 4.3 ms, measured on 2 cores at load 8); r1_zero's symbolic grading takes 10-600 ms.
SLOW_REWARD_S = 0.002


def score(rollout: Rollout, reward_fn, workers="auto") -> None:
    """Each trajectory's ``scores``: ``reward_fn(text, ground truth)`` in rollout order (the
    order the batch reward function numbers its responses by); a reward function that takes
    them also gets the ``example`` and the ``trajectory`` (``grpo_fast.task.rewards``).
    ``workers`` (``data.reward_workers``): threads for the calls after the first."""
    pairs = [(t, g.example) for g in rollout.groups for t in g.trajectories]
    if not pairs:
        return
    context = lambda t, ex: {"example": ex, "trajectory": t}
    t0 = time.perf_counter()
    first, ex = pairs[0]
    first.scores = reward_fn(first.text, ex.answer, **context(first, ex))
    if workers == "auto":
        slow = time.perf_counter() - t0 > SLOW_REWARD_S
        workers = default_workers(cap=4) if slow and getattr(reward_fn, "concurrent", False) else 1
    rest = pairs[1:]
    scores = score_batch(
        reward_fn,
        [t.text for t, _ in rest],
        [ex.answer for _, ex in rest],
        workers=workers,
        contexts=[context(t, ex) for t, ex in rest],
    )
    for (t, _), s in zip(rest, scores):
        t.scores = s
    for t, _ in pairs:
        t.correct = correct(t.scores)  # the one rule: pass rates, accuracy, evaluation
