"""The rollout phase: this rank's prompts → G responses each → rewards → group-normalized advantages.

With ``rollout.dynamic_sampling`` (DAPO) the groups whose task rewards are all equal are dropped
and more prompts are drawn, for at most ``rollout.max_sampling_rounds`` rounds, until every rank
has its share of ``rollout.batch_size`` responses from informative groups (the reward shaping
terms, overlong and KL, do not count: they would make every group look informative). With
``rollout.adaptive_group_size`` each prompt's group size comes from its pass rate. The shaping
terms are added to the kept responses' rewards, then the advantages are normalized over the
kept groups. The phase changes nothing outside what it returns but its own helpers' state: the
prompt sampler's position and the pass-rate table.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from grpo_fast import dist
from grpo_fast.algo.core import (
    informative_groups,
    normalize_each_reward,
    normalize_group_rewards,
    overlong_penalty,
)
from grpo_fast.config import shares_prompts
from grpo_fast.loop import preempt
from grpo_fast.loop.state import Run
from grpo_fast.obs.metrics import PhaseProgress
from grpo_fast.policy import fsdp
from grpo_fast.policy.batch import Sequence, make_microbatches
from grpo_fast.rollout import Rollout, generate_groups
from grpo_fast.rollout.sampling import sampling_params, sampling_rng, step_seed


@dataclass
class RolloutBatch:
    """The rollout phase's result on this rank: P prompts, G responses each (R = P·G)."""

    examples: list  # [P] task examples
    rollout: Rollout  # [R] responses
    temperature: float  # what they were sampled at (the trainer's log-probs use the same)
    advantages: torch.Tensor  # [R] fp32
    raw_rewards: torch.Tensor  # [R] fp32
    reward_meta: dict
    reward_fn: object  # this step's reward function (counts reward errors)
    scores: list[dict] = field(default_factory=list)  # [R] what the reward functions returned
    extra: dict[str, float] = field(default_factory=dict)  # rollout/ metrics (dynamic sampling, shaping)
    seconds: float = 0.0


@dataclass
class _Groups:
    """Generated groups with their task rewards (before any shaping), kept together as they are
    selected and concatenated: P prompts, R responses."""

    indices: list[int]  # [P] into task.train
    examples: list  # [P]
    rollout: Rollout  # [R]
    rewards: torch.Tensor  # [R] the reward functions' rewards
    scores: list[dict]  # [R] what the reward functions returned

    def group(self, g: int) -> _Groups:
        start = sum(self.rollout.sizes[:g])
        rows = slice(start, start + self.rollout.sizes[g])
        return _Groups(
            [self.indices[g]],
            [self.examples[g]],
            self.rollout.select_groups([g]),
            self.rewards[rows],
            self.scores[rows],
        )

    @staticmethod
    def concat(parts: list[_Groups]) -> _Groups:
        return _Groups(
            [i for p in parts for i in p.indices],
            [e for p in parts for e in p.examples],
            Rollout.concat([p.rollout for p in parts]),
            torch.cat([p.rewards for p in parts]),
            [s for p in parts for s in p.scores],
        )


def rollout_phase(run: Run, step: int, progress: PhaseProgress) -> RolloutBatch:
    """This rank's prompts → G responses each → rewards → group-normalized advantages (module
    docstring)."""
    t0 = time.perf_counter()
    cfg = run.cfg
    temperature = cfg.rollout.temperature + run.health.shared_temperature_boost(step)  # rank 0's, everywhere
    reward_fn = run.task.reward_fn.for_batch(step)  # numbers the responses, counts reward errors
    with run.generation_weights():  # FSDP with the hf backend: the whole model gathered for it
        groups, meta = _sample_groups(run, step, temperature, reward_fn, progress)
    rollout, rewards = groups.rollout, groups.rewards
    meta.update(_table_metrics(run, rollout))
    if cfg.data.overlong_buffer > 0:  # DAPO's soft overlong punishment
        penalty = overlong_penalty(
            [len(x) for x in rollout.response_ids],
            cfg.rollout.max_tokens,
            cfg.data.overlong_buffer,
            cfg.data.overlong_penalty,
        )
        meta["rollout/overlong_penalty_mean"] = penalty.mean().item()
        rewards = rewards + penalty
    shaping = penalty if cfg.data.overlong_buffer > 0 else None  # the shaping terms' sum
    kl_tokens = None
    if cfg.loss.kl_in_reward:  # β·Σ k1 of each response leaves its reward (verl's use_kl_in_reward)
        kl_sums, kl_tokens = response_kl_k1(run, rollout, temperature)
        kl_term = run.state.beta * kl_sums
        rewards = rewards - kl_term
        shaping = -kl_term if shaping is None else shaping - kl_term
    reduce_sums = lambda sums: dist.all_reduce_sum(sums, run.device)  # batch: std over all ranks
    advantages, norm_meta = normalize_group_rewards(
        rewards,
        rollout.sizes,
        cfg.loss.advantage_eps,
        scale_rewards=cfg.loss.scale_rewards,
        reduce_sums=reduce_sums,
    )
    if cfg.data.reward_aggregation == "normalize_each":  # GDPO: each reward normalized in its group
        advantages = _normalize_each(run, groups, shaping, reduce_sums)
        norm_meta["advantage_abs_mean"] = advantages.abs().mean().item()
    if cfg.loss.type == "no_baseline":  # REINFORCE without a baseline: A = the raw reward
        advantages = rewards
    reward_meta = {**norm_meta, **_score_means(groups.scores)}
    if kl_tokens is not None:
        reward_meta["kl_reward_sum"], reward_meta["kl_reward_tokens"] = kl_tokens
    return RolloutBatch(
        examples=groups.examples,
        rollout=rollout,
        temperature=temperature,
        advantages=advantages,
        raw_rewards=rewards,
        reward_meta=reward_meta,
        reward_fn=reward_fn,
        scores=groups.scores,
        extra=meta,
        seconds=time.perf_counter() - t0,
    )


def _normalize_each(run: Run, groups: _Groups, shaping: torch.Tensor | None, reduce_sums) -> torch.Tensor:
    """``data.reward_aggregation=normalize_each``: ``[R]`` advantages from each reward (a weighted
    reward's parts, ``"reward/NAME"`` of every score, with their weights; else the one reward)
    normalized in its group, weighted and summed, the shaping terms (overlong, KL) as one more
    reward of weight 1 (``grpo_fast.algo.core.normalize_each_reward``)."""
    cfg, names = run.cfg, run.task.reward_parts
    if names:
        parts = [torch.tensor([float(s[f"reward/{n}"]) for s in groups.scores]) for n in names]
        weights = list(run.task.reward_fn.weights)
    else:
        parts, weights = [groups.rewards], [1.0]
    if shaping is not None:
        parts, weights = [*parts, shaping], [*weights, 1.0]
    return normalize_each_reward(
        parts,
        weights,
        groups.rollout.sizes,
        cfg.loss.advantage_eps,
        scale_rewards=cfg.loss.scale_rewards,
        reduce_sums=reduce_sums,
    )


def _sample_groups(run: Run, step: int, temperature: float, reward_fn, progress) -> tuple[_Groups, dict]:
    """The groups this rank trains on, from one generation round or (dynamic sampling) several,
    and the ``rollout/`` metrics of the sampling."""
    r = run.cfg.rollout
    target = run.local_prompts * r.group_size  # responses this rank trains on
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    kept: list[_Groups] = []
    have = generated_groups = dropped_groups = 0
    for round_ in range(rounds):
        part = _generate_round(run, step, round_, temperature, reward_fn, progress)
        generated_groups += len(part.examples)
        informative = informative_groups(part.rewards, part.rollout.sizes)
        for g, ok in enumerate(informative):
            if r.dynamic_sampling and not ok:
                dropped_groups += 1
            elif have < target:  # whole groups, in order, up to this rank's share
                kept.append(part.group(g))
                have += part.rollout.sizes[g]
        if not r.dynamic_sampling or not dist.all_reduce_sum([float(have < target)], run.device)[0]:
            break
    if r.dynamic_sampling and not kept:  # nothing informative at all: train on the last round (A = 0)
        kept = [part.group(g) for g in range(len(part.examples))]
    meta = {}
    if r.dynamic_sampling:
        g_have, g_target, g_gen, g_drop = dist.all_reduce_sum(
            [float(have), float(target), float(generated_groups), float(dropped_groups)], run.device
        )
        meta = {
            "rollout/sampling_rounds": float(round_ + 1),
            "rollout/dropped_group_fraction": g_drop / max(g_gen, 1.0),
            "rollout/informative_fraction_of_batch": g_have / max(g_target, 1.0),
        }
        if g_have < g_target:
            run.logger.event(
                f"step {step}: dynamic sampling found {int(g_have)} of {int(g_target)} responses in "
                f"informative groups after {round_ + 1} rounds (rollout.max_sampling_rounds="
                f"{r.max_sampling_rounds}): training on what it has"
            )
    return _Groups.concat(kept), meta


def _table_metrics(run: Run, rollout: Rollout) -> dict[str, float]:
    """The pass-rate table's and the difficulty options' ``rollout/`` metrics."""
    r, meta = run.cfg.rollout, {}
    if run.pass_rates is not None:
        table = run.pass_rates.summary()
        meta["rollout/prompts_seen_fraction"] = table["seen_fraction"]
        meta["rollout/pass_rate_mean"] = table["pass_rate_mean"]
    if r.difficulty_filter is not None:  # prompts the current pass over the data leaves out
        meta["rollout/filtered_prompts"] = float(run.sampler.skipped)
    if r.adaptive_group_size:
        sizes = dist.all_gather_objects(rollout.sizes)
        meta["rollout/group_size_min"] = float(min(min(x) for x in sizes))
        meta["rollout/group_size_max"] = float(max(max(x) for x in sizes))
    return meta


def _generate_round(
    run: Run, step: int, round_: int, temperature: float, reward_fn, progress: PhaseProgress
) -> _Groups:
    """One round of the rollout phase on this rank: draw prompts, generate their groups, score
    them; the pass-rate table (when one is kept) sees every scored group."""
    cfg, world, r = run.cfg, run.world, run.cfg.rollout
    n = run.local_prompts
    idx = run.sampler.next(n * world.world_size, step=step)[world.rank * n : (world.rank + 1) * n]
    examples = [run.task.train[i] for i in idx]
    prompt_ids = [run.task.prompt_ids(e) for e in examples]
    sizes = [r.group_size] * len(idx)
    if r.adaptive_group_size:  # by pass rate, this rank's total kept: n·G responses
        sizes = run.pass_rates.group_sizes(
            idx, r.group_size, r.min_group_size, r.max_group_size, n * r.group_size
        )
    seed = step_seed(cfg.seed, step, world.rank, round=round_)  # the same samples after a resume
    params = sampling_params(r, run.task.stop, temperature=temperature, seed=seed)
    progress.phase("rollout" if round_ == 0 else f"rollout {round_ + 1}", len(prompt_ids))
    with sampling_rng(params.seed if world.enabled else None, run.device):
        advance = preempt.unit_callback(progress.advance_phase)  # a signal: stop after this chunk
        rollout = generate_groups(run.backend, prompt_ids, sizes, params, progress=advance)
    run.backend.sleep()
    gts = [e.answer for e, k in zip(examples, sizes) for _ in range(k)]
    scores = [reward_fn(text, gt) for text, gt in zip(rollout.response_text, gts)]
    rewards = torch.tensor([float(s["reward"]) for s in scores], dtype=torch.float32)
    if run.pass_rates is not None:  # every rank's groups, on every rank: the tables stay equal
        correct = [_correct(s) for s in scores]
        groups = [correct[sum(sizes[:j]) : sum(sizes[: j + 1])] for j in range(len(sizes))]
        for rank_idx, rank_groups in dist.all_gather_objects((list(idx), groups)):
            run.pass_rates.update(rank_idx, rank_groups)
    return _Groups(list(idx), examples, rollout, rewards, scores)


def _correct(score: dict) -> float:
    """Whether a response solved its problem, for the pass rates: the answer reward when the
    reward function reports one, else a positive reward."""
    return float(score["answer_reward"]) if "answer_reward" in score else float(score["reward"] > 0)


def _score_means(scores: list[dict]) -> dict[str, float]:
    """``{KEY_mean: mean}`` of every numeric key but ``reward`` the reward functions returned
    (``answer_reward``, ``format_reward``, ``reward/NAME``), over this rank's responses."""
    if not scores:
        return {}
    keys = [k for k, v in scores[0].items() if k != "reward" and isinstance(v, (int, float, bool))]
    return {f"{k}_mean": sum(float(s[k]) for s in scores) / len(scores) for k in keys}


def response_kl_k1(
    run: Run, rollout: Rollout, temperature: float
) -> tuple[torch.Tensor, tuple[float, float]]:
    """``loss.kl_in_reward``: each response's Σ_t k1_t = Σ_t (log π − log π_ref) of its sampled
    tokens, ``[R]`` fp32 on the CPU, from no-grad passes of the fused op (the policy's and the
    reference's); and (Σ k1, tokens) over this rank, for the metrics. Each scoring sequence
    carries its response's index (``Microbatch.response_index``), so the sums land on the right
    response whatever the microbatch order or packing."""
    cfg = run.cfg
    seqs = [
        Sequence(list(p) + list(resp), len(p), advantage=0.0, weight=0.0, response_index=i)
        for i, (p, resp) in enumerate(zip(rollout.response_prompt_ids(), rollout.response_ids))
        if resp
    ]
    sums = torch.zeros(len(rollout.response_ids), dtype=torch.float64, device=run.device)
    mbs = make_microbatches(
        seqs,
        int(cfg.train.micro_batch_size),
        run.tokenizer.pad_token_id,
        cfg.train.packing,
        share_prompts=shares_prompts(cfg),
    )
    options = run.scoring_options()
    # FSDP: as many passes on every rank (zero-weight fillers); none under DDP
    (missing,) = fsdp.padding_count([len(mbs)], run.device, fsdp.is_sharded(run.policy_loss))
    with torch.no_grad():
        for mb in mbs:
            mb = mb.to(run.device)
            policy = run.policy_loss(mb, options, temperature).logprobs
            k1 = policy - run.ref_loss(mb, options, temperature).logprobs
            sums.index_add_(0, mb.response_index, k1.double())
        for filler in fsdp.fillers(missing, None, run.tokenizer.pad_token_id, run.device):
            run.policy_loss(filler, options, temperature)
            run.ref_loss(filler, options, temperature)
    sums = sums.float().cpu()  # host-device sync, once per step
    return sums, (sums.sum().item(), float(sum(s.n_response for s in seqs)))
