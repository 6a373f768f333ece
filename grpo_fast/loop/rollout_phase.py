"""The rollout phase, the step's side of it: the producer's rounds (``grpo_fast.loop.producer``),
then what needs the other ranks or the trainer — the finalize: pass rates, dynamic sampling's
round count, reward shaping, the KL in the reward, the advantages (``loss.advantage``).

The step decides the temperature (the health monitor's boost, rank 0's on every rank), then asks
the producer for a round of groups; under torchrun the ranks agree that each did its round
(``grpo_fast.loop.agreement``: a rank whose generation failed stops every rank, together); after
each round every rank's groups enter the pass-rate table (one gather), and with
``rollout.dynamic_sampling`` (DAPO) the groups whose task rewards are all equal are dropped and
another round is asked for, for at most ``rollout.max_sampling_rounds`` rounds, until every rank
has its share of ``rollout.batch_size`` responses from informative groups (the reward shaping
terms, overlong and KL, do not count: they would make every group look informative). With
``rollout.adaptive_group_size`` each prompt's group size comes from its pass rate. The shaping
terms (overlong, tool errors, KL) are added to the kept responses' rewards, then the advantages
come from them (``loss.advantage``: group-normalized over the kept groups, leave-one-out, or
REINFORCE++'s per-token returns whitened over the batch, the KL per token); each trajectory
carries its reward and advantage (per token: ``token_advantages``) from here on.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from grpo_fast import dist
from grpo_fast.algo.advantages import (
    PER_TOKEN_ESTIMATORS,
    compute_gae,
    compute_reinforce_pp_advantages,
    compute_rloo_advantages,
    informative_groups,
    normalize_each_reward,
    normalize_group_rewards,
    overlong_penalty,
    whiten_over_batch,
)
from grpo_fast.loop.agreement import agree
from grpo_fast.loop.optimization import response_kl_k1, score_responses
from grpo_fast.loop.producer import Production, produce
from grpo_fast.loop.state import Run
from grpo_fast.obs.metrics import PhaseProgress
from grpo_fast.rollout import Rollout
from grpo_fast.rollout.multi_turn import tool_metrics, tool_sums


@dataclass
class RolloutBatch:
    """The rollout phase's result on this rank: P groups, R responses (each group its own size
    with ``rollout.adaptive_group_size``), every trajectory scored, with its reward and advantage."""

    rollout: Rollout  # [P] groups, [R] trajectories
    temperature: float  # what they were sampled at (the trainer's log-probs use the same)
    advantages: torch.Tensor  # [R] fp32 (each trajectory's .advantage too)
    raw_rewards: torch.Tensor  # [R] fp32: the rewards the advantages come from (shaping included)
    reward_meta: dict
    reward_fn: object  # this step's reward function (counts reward errors)
    extra: dict[str, float] = field(default_factory=dict)  # rollout/ metrics (dynamic sampling, shaping)
    seconds: float = 0.0

    @property
    def examples(self) -> list:
        """``[P]`` the task examples of the groups."""
        return [g.example for g in self.rollout.groups]

    @property
    def scores(self) -> list[dict]:
        """``[R]`` what the reward function returned for each response."""
        return [t.scores for t in self.rollout.trajectories]


def rollout_phase(run: Run, step: int, progress: PhaseProgress) -> RolloutBatch:
    """This rank's groups for ``step`` from the producer, finalized: pass rates, dynamic sampling,
    shaping, KL in the reward, advantages (module docstring)."""
    t0 = time.perf_counter()
    cfg = run.cfg
    temperature = cfg.rollout.temperature + run.health.shared_temperature_boost(step)  # rank 0's, everywhere
    reward_fn = run.task.reward_fn.for_batch(step)  # numbers the responses, counts reward errors
    with run.generation_weights():  # FSDP with the hf backend: the whole model gathered for it
        rollout, meta = _sample_groups(run, step, temperature, reward_fn, progress)
    return finalize(run, rollout, meta, temperature, reward_fn, t0)


def finalize(
    run: Run, rollout: Rollout, meta: dict, temperature: float, reward_fn, started: float
) -> RolloutBatch:
    """The step's side of a scored ``rollout`` (its groups, sampled at ``temperature``, scored by
    ``reward_fn``): the pass-rate and difficulty metrics, reward shaping, the KL in the reward,
    the advantages. ``meta``: the sampling's ``rollout/`` metrics so far; ``started``: when the
    step's rollout began (``perf_counter``), for ``time/rollout_s``."""
    cfg = run.cfg
    meta.update(_table_metrics(run, rollout))
    outcome, shaping = _shaped_rewards(run, rollout, meta)  # task reward + overlong + tool errors
    scores = _scores(run, rollout, temperature)  # the no-grad passes per token, when any is needed
    rewards, kl_tokens, kl_per_token = outcome, None, None
    if cfg.loss.kl_in_reward:  # β·Σ k1 of each response leaves its reward (verl's use_kl_in_reward)
        if scores is not None:
            kl_sums, kl_tokens, kl_per_token = scores.kl_sums, scores.kl_totals, scores.kl_tokens
        else:
            kl_sums, kl_tokens = response_kl_k1(run, rollout, temperature)  # the trainer's passes
        kl_term = run.trainer.state.beta * kl_sums
        rewards = rewards - kl_term
        shaping = -kl_term if shaping is None else shaping - kl_term
    reduce_sums = lambda sums: dist.all_reduce_sum(sums, run.device, axis=run.world.ranks)  # batch std
    advantages, norm_meta = _response_advantages(run, rollout, rewards, shaping, reduce_sums)
    per_token, returns = _token_advantages(
        run, rollout, outcome, advantages, kl_per_token, scores, reduce_sums, meta
    )
    if per_token is not None:
        advantages = torch.tensor([float(a.mean()) if a.numel() else 0.0 for a in per_token])
    for i, (t, reward, advantage) in enumerate(
        zip(rollout.trajectories, rewards.tolist(), advantages.tolist())
    ):
        t.reward, t.advantage = reward, advantage
        t.token_advantages = None if per_token is None else per_token[i]
        if returns is not None:
            t.token_values, t.token_returns = scores.values[i], returns[i]
    if cfg.loss.advantage != "group" or cfg.distill.teacher is not None:
        meta.update(_advantage_metrics(run, rollout))
    reward_meta = {**norm_meta, **_score_means([t.scores for t in rollout.trajectories])}
    if kl_tokens is not None:
        reward_meta["kl_reward_sum"], reward_meta["kl_reward_tokens"] = kl_tokens
    return RolloutBatch(
        rollout=rollout,
        temperature=temperature,
        advantages=advantages,
        raw_rewards=rewards,
        reward_meta=reward_meta,
        reward_fn=reward_fn,
        extra=meta,
        seconds=time.perf_counter() - started,
    )


def _shaped_rewards(run: Run, rollout: Rollout, meta: dict) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``[R]`` the task rewards plus the shaping terms before the KL (DAPO's overlong penalty, the
    tool-error penalty), and the shaping terms' sum (None without any); their metrics into
    ``meta``."""
    cfg = run.cfg
    rewards, shaping = task_rewards(rollout), None
    if cfg.data.overlong_buffer > 0:  # DAPO's soft overlong punishment
        penalty = overlong_penalty(
            [t.num_sampled for t in rollout.trajectories],
            cfg.rollout.max_tokens,
            cfg.data.overlong_buffer,
            cfg.data.overlong_penalty,
        )
        meta["rollout/overlong_penalty_mean"] = penalty.mean().item()
        rewards, shaping = rewards + penalty, penalty
    if cfg.rollout.environment != "none":  # tool use: its metrics, and the tool-error penalty
        meta.update(_tool_metrics(run, rollout))
        if cfg.data.tool_error_penalty > 0:  # each failed call costs its response
            failed = [float(sum(not c.ok for c in t.tool_calls)) for t in rollout.trajectories]
            tool_term = -cfg.data.tool_error_penalty * torch.tensor(failed, dtype=torch.float32)
            meta["rollout/tool_error_penalty_mean"] = tool_term.mean().item()
            rewards = rewards + tool_term
            shaping = tool_term if shaping is None else shaping + tool_term
    return rewards, shaping


def _scores(run: Run, rollout: Rollout, temperature: float):
    """The finalize's no-grad passes per token (``score_responses``: one policy pass for the value
    head's values, the teacher's gap and k1 per token), when the estimator or distillation needs
    them; None otherwise (the KL's per-response sums then come from ``response_kl_k1``)."""
    cfg, estimator = run.cfg, run.cfg.loss.advantage
    distill = cfg.distill.teacher is not None
    per_token_kl = cfg.loss.kl_in_reward and estimator in PER_TOKEN_ESTIMATORS
    if not (estimator == "gae" or distill or per_token_kl):
        return None
    return score_responses(run, rollout, temperature, kl=cfg.loss.kl_in_reward, teacher=distill)


def _response_advantages(
    run: Run, rollout: Rollout, rewards: torch.Tensor, shaping: torch.Tensor | None, reduce_sums
) -> tuple[torch.Tensor, dict]:
    """``[R]`` one advantage per response and the rewards' metadata: group normalization (or
    RLOO's leave-one-out), GDPO's per-reward normalization, or the raw reward (``no_baseline``).
    The per-token estimators use the metadata (their advantages come after)."""
    cfg = run.cfg
    normalize = compute_rloo_advantages if cfg.loss.advantage == "rloo" else normalize_group_rewards
    advantages, norm_meta = normalize(
        rewards,
        rollout.sizes,
        advantage_eps=cfg.loss.advantage_eps,
        scale_rewards=cfg.loss.scale_rewards,
        reduce_sums=reduce_sums,
    )
    if cfg.data.reward_aggregation == "normalize_each":  # GDPO: each reward normalized in its group
        advantages = _normalize_each(run, rollout, shaping, reduce_sums)
        norm_meta["advantage_abs_mean"] = advantages.abs().mean().item()
    if cfg.loss.type == "no_baseline":  # REINFORCE without a baseline: A = the raw reward
        advantages = rewards
    return advantages, norm_meta


def _token_advantages(
    run: Run, rollout: Rollout, outcome, advantages, kl_per_token, scores, reduce_sums, meta: dict
) -> tuple[list[torch.Tensor] | None, list[torch.Tensor] | None]:
    """Each response's ``[S]`` advantages when they differ along it (None: one per response), and
    GAE's value targets (None without a value head): GAE or REINFORCE++ from the ``outcome`` rewards
    (before the KL) with ``−β·k1_t`` per token; then distillation's teacher term. Their metrics
    into ``meta``."""
    cfg, estimator = run.cfg, run.cfg.loss.advantage
    per_token = returns = None
    beta_kl = None if kl_per_token is None else [-run.trainer.state.beta * k for k in kl_per_token]
    if estimator == "gae":  # GAE from the value head's values: [S] per response, and the targets
        per_token, returns = _gae(run, rollout, outcome, beta_kl, scores.values, reduce_sums)
        meta.update(_value_metrics(run, scores.values, returns))
    elif estimator in PER_TOKEN_ESTIMATORS:  # REINFORCE++ (and its baseline variant)
        per_token = _reinforce_pp(run, rollout, outcome, beta_kl, reduce_sums)
    if cfg.distill.teacher is not None:  # the teacher's per-token gap added to each token's advantage
        per_token = _with_teacher(run, rollout, advantages, per_token, scores.distill)
        meta.update(_distill_metrics(run, scores))
    return per_token, returns


def _reinforce_pp(
    run: Run, rollout: Rollout, outcome: torch.Tensor, kl_rewards: list[torch.Tensor] | None, reduce_sums
) -> list[torch.Tensor]:
    """``loss.advantage=reinforce_pp`` / ``reinforce_pp_baseline``: each response's ``[S]``
    per-token advantages (``grpo_fast.algo.advantages.compute_reinforce_pp_advantages``): the
    outcome reward ``[R]`` (task reward and shaping) on its last sampled token, ``−β·k1_t`` on
    each (``kl_rewards``, with ``loss.kl_in_reward``), returns discounted by ``loss.gamma``,
    whitened over every rank's sampled tokens."""
    cfg = run.cfg
    counts, mask = _sampled_mask(rollout)
    token_rewards = _padded(kl_rewards, mask.shape[1]) if kl_rewards is not None else None
    advantages, _ = compute_reinforce_pp_advantages(
        outcome,
        mask,
        token_rewards,
        cfg.loss.gamma,
        group_sizes=rollout.sizes if cfg.loss.advantage == "reinforce_pp_baseline" else None,
        advantage_eps=cfg.loss.advantage_eps,
        reduce_sums=reduce_sums,
    )
    return [advantages[i, :n].clone() for i, n in enumerate(counts.tolist())]


def _sampled_mask(rollout: Rollout) -> tuple[torch.Tensor, torch.Tensor]:
    """``counts [R]`` each response's sampled tokens and ``mask [R, S_max]`` (its sampled tokens,
    in order, then padding): the per-token estimators' layout."""
    counts = torch.tensor([t.num_sampled for t in rollout.trajectories], dtype=torch.long)
    width = int(counts.max()) if len(counts) else 0
    return counts, torch.arange(width)[None, :] < counts[:, None]


def _padded(rows: list[torch.Tensor], width: int) -> torch.Tensor:
    """``[R, width]`` fp32: each ``[S_i]`` row, zero-padded."""
    out = torch.zeros(len(rows), width)
    for i, row in enumerate(rows):
        out[i, : row.numel()] = row
    return out


def _gae(
    run: Run,
    rollout: Rollout,
    outcome: torch.Tensor,
    kl_rewards: list[torch.Tensor] | None,
    values: list[torch.Tensor],
    reduce_sums,
) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """``loss.advantage=gae``: each response's ``[S]`` advantages and value targets
    (``grpo_fast.algo.advantages.compute_gae``): the outcome reward ``[R]`` on its last sampled
    token, ``−β·k1_t`` on each (``kl_rewards``), the value head's ``values``; the advantages with
    the policy's λ (``critic.policy_lam``, or ``1 − 1/(critic.lam_alpha·l)`` per response of ``l``
    sampled tokens), whitened over every rank's sampled tokens (``critic.whiten_advantages``); the
    targets ``A(critic.lam) + V``."""
    cfg, c = run.cfg, run.cfg.critic
    counts, mask = _sampled_mask(rollout)
    width = mask.shape[1]
    token_rewards = _padded(kl_rewards, width) if kl_rewards is not None else torch.zeros(mask.shape)
    rows = torch.nonzero(counts > 0).squeeze(1)
    token_rewards[rows, counts[rows] - 1] += outcome[rows]
    v = _padded(values, width)
    if c.lam_alpha is not None:  # VAPO's length-adaptive λ: longer responses look further ahead
        policy_lam = (1.0 - 1.0 / (c.lam_alpha * counts.clamp(min=1).float())).clamp(min=0.0)
    else:
        policy_lam = c.policy_lam
    raw, _ = compute_gae(token_rewards, v, mask, cfg.loss.gamma, policy_lam)
    advantages = (
        whiten_over_batch(raw, mask, cfg.loss.advantage_eps, reduce_sums) if c.whiten_advantages else raw
    )
    _, targets = compute_gae(token_rewards, v, mask, cfg.loss.gamma, c.lam)
    n = counts.tolist()
    return [advantages[i, :k].clone() for i, k in enumerate(n)], [
        targets[i, :k].clone() for i, k in enumerate(n)
    ]


def _value_metrics(run: Run, values: list[torch.Tensor], returns: list[torch.Tensor]) -> dict[str, float]:
    """``rollout/value_mean``, ``rollout/return_mean`` and ``rollout/value_explained_variance``
    (``1 − Var(R − V)/Var(R)``: 1 = the values predict the targets, 0 = no better than their
    mean) over every rank's sampled tokens (one all-reduce), before this step's update."""
    v = torch.cat(values).double() if values else torch.zeros(0, dtype=torch.float64)
    r = torch.cat(returns).double() if returns else torch.zeros(0, dtype=torch.float64)
    d = r - v
    n, sv, sr, srr, sd, sdd = dist.all_reduce_sum(
        [
            float(v.numel()),
            v.sum().item(),
            r.sum().item(),
            (r * r).sum().item(),
            d.sum().item(),
            (d * d).sum().item(),
        ],
        run.device,
        axis=run.world.ranks,
    )
    n = max(n, 1.0)
    var_r = srr / n - (sr / n) ** 2
    var_d = sdd / n - (sd / n) ** 2
    row = {"rollout/value_mean": sv / n, "rollout/return_mean": sr / n}
    if var_r > 1e-10:  # undefined when every target is the same (up to rounding)
        row["rollout/value_explained_variance"] = 1.0 - var_d / var_r
    return row


def _with_teacher(
    run: Run,
    rollout: Rollout,
    advantages: torch.Tensor,
    per_token: list[torch.Tensor] | None,
    gaps: list[torch.Tensor],
) -> list[torch.Tensor]:
    """``distill.teacher``: each response's ``[S]`` advantages ``reward_weight · A_t + coef ·
    (log π_teacher − log π_student)_t``, ``A_t`` the estimator's (per token, or the response's own
    on each of its tokens)."""
    d = run.cfg.distill
    base = per_token or [
        torch.full((t.num_sampled,), float(a)) for t, a in zip(rollout.trajectories, advantages.tolist())
    ]
    return [d.reward_weight * a + d.coef * g for a, g in zip(base, gaps)]


def _distill_metrics(run: Run, scores) -> dict[str, float]:
    """``distill/reverse_kl``: the mean over every rank's sampled tokens of log π_student − log
    π_teacher (a sample of the per-token reverse KL to the teacher); ``time/teacher_s``: this rank's
    teacher passes; ``memory/teacher_peak_gb``: this rank's peak memory during them (as
    ``memory/peak_gb`` measures it). ``time/teacher_share`` (their share of ``time/step_s``) is
    ``grpo_fast.loop.stats``'s, which knows the step's time."""
    gap = torch.cat(scores.distill).double() if scores.distill else torch.zeros(0, dtype=torch.float64)
    n, total = dist.all_reduce_sum([float(gap.numel()), gap.sum().item()], run.device, axis=run.world.ranks)
    return {
        "distill/reverse_kl": -total / max(n, 1.0),
        "time/teacher_s": scores.teacher_seconds,
        "memory/teacher_peak_gb": scores.teacher_peak_gb,
    }


def _advantage_metrics(run: Run, rollout: Rollout) -> dict[str, float]:
    """``rollout/advantage_{mean,std,abs_mean}``: the advantages the loss sees, per sampled token,
    over every rank's responses (one all-reduce); logged for the estimators beside ``group``."""
    a = torch.cat([t.sampled_advantages for t in rollout.trajectories]).double()
    n, total, squares, absolute = dist.all_reduce_sum(
        [float(a.numel()), a.sum().item(), (a * a).sum().item(), a.abs().sum().item()],
        run.device,
        axis=run.world.ranks,
    )
    mean = total / max(n, 1.0)
    var = max(squares - n * mean * mean, 0.0) / max(n - 1.0, 1.0)
    return {
        "rollout/advantage_mean": mean,
        "rollout/advantage_std": var**0.5,
        "rollout/advantage_abs_mean": absolute / max(n, 1.0),
    }


def task_rewards(rollout: Rollout) -> torch.Tensor:
    """``[R]`` fp32: each response's reward as the reward function scored it (before shaping)."""
    return torch.tensor([float(t.scores["reward"]) for t in rollout.trajectories], dtype=torch.float32)


def _normalize_each(run: Run, rollout: Rollout, shaping: torch.Tensor | None, reduce_sums) -> torch.Tensor:
    """``data.reward_aggregation=normalize_each``: ``[R]`` advantages from each reward (a weighted
    reward's parts, ``"reward/NAME"`` of every score, with their weights; else the one reward)
    normalized in its group, weighted and summed, the shaping terms (overlong, tool errors, KL) as one more
    reward of weight 1 (``grpo_fast.algo.core.normalize_each_reward``)."""
    cfg, names = run.cfg, run.task.reward_parts
    scores = [t.scores for t in rollout.trajectories]
    if names:
        parts = [torch.tensor([float(s[f"reward/{n}"]) for s in scores]) for n in names]
        weights = list(run.task.reward_fn.weights)
    else:
        parts, weights = [task_rewards(rollout)], [1.0]
    if shaping is not None:
        parts, weights = [*parts, shaping], [*weights, 1.0]
    return normalize_each_reward(
        parts,
        weights,
        rollout.sizes,
        cfg.loss.advantage_eps,
        scale_rewards=cfg.loss.scale_rewards,
        reduce_sums=reduce_sums,
    )


def _sample_groups(run: Run, step: int, temperature: float, reward_fn, progress) -> tuple[Rollout, dict]:
    """The groups this rank trains on, from one production round or (dynamic sampling) several,
    and the ``rollout/`` metrics of the sampling. After each round every rank's groups enter the
    pass-rate table; whether another round runs is decided by all ranks together."""
    r, ranks = run.cfg.rollout, run.world.ranks
    target = run.rollout.prompts_per_rank * r.group_size  # responses this rank trains on
    rounds = r.max_sampling_rounds if r.dynamic_sampling else 1
    kept: list = []  # groups
    have = generated_groups = dropped_groups = 0
    for round_ in range(rounds):
        job = Production(step, round_, temperature, reward_fn)
        try:
            part, error = produce(run.rollout, run.cfg, run.task, run.world, run.device, job, progress), None
        except BaseException as exc:  # under torchrun every rank raises together: grpo_fast.loop.agreement
            part, error = None, exc
        agree(run.agree, run.world, error)
        record_pass_rates(run, part)
        generated_groups += len(part.groups)
        informative = informative_groups(task_rewards(part), part.sizes)
        for group, ok in zip(part.groups, informative):
            if r.dynamic_sampling and not ok:
                dropped_groups += 1
            elif have < target:  # whole groups, in order, up to this rank's share
                kept.append(group)
                have += group.size
        if (
            not r.dynamic_sampling
            or not dist.all_reduce_sum([float(have < target)], run.device, axis=ranks)[0]
        ):
            break
    if r.dynamic_sampling and not kept:  # nothing informative at all: train on the last round (A = 0)
        kept = list(part.groups)
    meta = {}
    if r.dynamic_sampling:
        g_have, g_target, g_gen, g_drop = dist.all_reduce_sum(
            [float(have), float(target), float(generated_groups), float(dropped_groups)],
            run.device,
            axis=ranks,
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
    return Rollout(groups=kept), meta


def record_pass_rates(run: Run, rollout: Rollout) -> None:
    """Every rank's scored groups of this round, on every rank (one gather), into
    the pass-rate table, when one is kept."""
    if run.rollout.pass_rates is None:
        return
    indices = [g.example_index for g in rollout.groups]
    correct = [[t.correct for t in g.trajectories] for g in rollout.groups]
    run.rollout.record_pass_rates(dist.all_gather_objects((indices, correct), axis=run.world.ranks))


def _table_metrics(run: Run, rollout: Rollout) -> dict[str, float]:
    """The pass-rate table's and the difficulty options' ``rollout/`` metrics."""
    r, meta = run.cfg.rollout, {}
    if run.rollout.pass_rates is not None:
        table = run.rollout.pass_rates.summary()
        meta["rollout/prompts_seen_fraction"] = table["seen_fraction"]
        meta["rollout/pass_rate_mean"] = table["pass_rate_mean"]
    if r.difficulty_filter is not None:  # prompts the current pass over the data leaves out
        meta["rollout/filtered_prompts"] = float(run.rollout.sampler.skipped)
    if r.adaptive_group_size:
        sizes = dist.all_gather_objects(rollout.sizes, axis=run.world.ranks)
        meta["rollout/group_size_min"] = float(min(min(x) for x in sizes))
        meta["rollout/group_size_max"] = float(max(max(x) for x in sizes))
    return meta


def _tool_metrics(run: Run, rollout: Rollout) -> dict[str, float]:
    """``rollout/`` metrics of tool use over every rank's kept responses (one all-reduce)."""
    sums = tool_sums(rollout.trajectories)
    total = dist.all_reduce_sum(list(sums.values()), run.device, axis=run.world.dp)
    return tool_metrics(dict(zip(sums, total)), ranks=run.world.dp.size)


def _score_means(scores: list[dict]) -> dict[str, float]:
    """``{KEY_mean: mean}`` of every numeric key but ``reward`` the reward functions returned
    (``answer_reward``, ``format_reward``, ``reward/NAME``), over this rank's responses."""
    if not scores:
        return {}
    keys = [k for k, v in scores[0].items() if k != "reward" and isinstance(v, (int, float, bool))]
    return {f"{k}_mean": sum(float(s[k]) for s in scores) / len(scores) for k in keys}
