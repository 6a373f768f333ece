"""The optimization phase: sequences → microbatches → π_old/π_ref → the epochs of optimizer steps →
LR step → weight push to the rollout engine.

Each epoch is one optimizer step over all microbatches (gradients accumulated; under DDP synced
once, on the last microbatch). ``optimize_on_rollout`` is that loop on its own, given a
``Trainer`` and microbatches (the benchmarks and tests drive it directly).
"""

from __future__ import annotations

import dataclasses
import math
import time
from dataclasses import dataclass

import torch

from grpo_fast import dist
from grpo_fast.algo.control import kl_early_stop
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.sampler_correction import cut_importance_weights, raw_importance_weights
from grpo_fast.config import Config, shares_prompts
from grpo_fast.loop.state import Run, Trainer
from grpo_fast.loop.stats import StepStats
from grpo_fast.obs.metrics import MetricsLogger, PhaseProgress, phase_peak_gb
from grpo_fast.policy import parallel
from grpo_fast.policy.batch import Microbatch, Sequence, loss_trajectories, make_microbatches
from grpo_fast.rollout import Rollout, Trajectory


@dataclass
class OptimizationResult:
    """The optimization phase's result: the first epoch's statistics and the step's counts."""

    stats: StepStats
    counts: dict[str, float]  # global: trained/all sequences and tokens
    skipped_tokens: int
    extra: dict[str, float]  # sampler-correction metrics
    lr: float
    seconds: float = 0.0


def optimization_phase(run: Run, step: int, batch, progress: PhaseProgress) -> OptimizationResult:
    """``batch`` (the rollout phase's ``RolloutBatch``): its trajectories → loss weights →
    microbatches → π_old/π_ref → the epochs of optimizer steps → LR step. The weights reach the
    rollout side afterwards, in the outline (``RolloutSide.sync_weights``)."""
    t0 = time.perf_counter()
    cfg, rollout, trainer = run.cfg, batch.rollout, run.trainer
    trajectories = rollout.trajectories
    # loss.mask_truncated: responses that hit max_tokens leave the loss and its normalizers;
    # loss.mask_void_turns: so do responses with a turn that yielded neither a call nor an answer
    keep = [
        not (cfg.loss.mask_truncated and t.finish_reason == "length")
        and not (cfg.loss.mask_void_turns and t.void_turns > 0)
        for t in trajectories
    ]
    sampled = [t.num_sampled for t, k in zip(trajectories, keep) if k]
    prompt_tokens = sum(len(t.prompt_ids) for t in trajectories)
    # one collective for the global counts (token_mean needs Σ sampled tokens over all ranks); an sp
    # group trains one batch (loop/sp_group.py): counted once, over the dp ranks
    g_seqs, g_tokens, g_all_seqs, g_all_tokens, g_prompt_tokens = dist.all_reduce_sum(
        [len(sampled), sum(sampled), len(keep), rollout.num_response_tokens, prompt_tokens],
        run.device,
        axis=run.world.dp,
    )
    trained_rows = loss_trajectories(
        rollout,
        length_norm=cfg.loss.length_norm,
        max_length=cfg.rollout.max_tokens,
        num_sequences=int(g_seqs),
        num_tokens=g_tokens,
        keep=keep,
    )
    if (
        not trained_rows
    ):  # all left out (loss.mask_truncated): one zero-weight response keeps the step's shape
        t = next(t for t in trajectories if t.num_sampled)
        trained_rows = [
            Trajectory(t.prompt_ids, t.token_ids, roles=t.roles, loss_weights=torch.zeros(t.num_sampled))
        ]
    options = trainer.loss_options()  # β now (0 with loss.kl_in_reward: the KL is in the rewards)
    # a value model learns from every response, its advantage 0 or not
    trained = (
        trained_rows
        if trainer.value_head is not None
        else sequences_with_gradient(cfg, trained_rows, options)
    )
    skipped_tokens = sum(t.num_sampled for t in trained_rows) - sum(t.num_sampled for t in trained)
    skipped_tokens *= run.world.sp.rank == 0  # the group's batch, counted by one rank (totals sum all)
    mbs = [
        parallel.on_rank(mb, run.world, run.device)  # sp: this rank's 1/N of the tokens
        for mb in make_microbatches(
            trained,
            int(cfg.train.micro_batch_size),
            run.tokenizer.pad_token_id,
            cfg.train.packing,
            share_prompts=shares_prompts(cfg),
        )
    ]
    ref_loss = None if cfg.loss.kl_in_reward else trainer.ref_loss
    sft_mbs = _sft_microbatches(run, batch.examples) if cfg.sft.mix_coef > 0 else []
    # FSDP gathers every unit in every forward: each rank runs as many passes as the most any
    # rank runs (zero-weight fillers; one collective). Nothing under DDP.
    pad_id = run.tokenizer.pad_token_id
    n_scoring, n_train = parallel.filler_counts(
        [len(mbs), len(mbs) + len(sft_mbs)], trainer.policy_loss, run.device
    )
    fillers = parallel.fillers(n_scoring, mbs[0], pad_id, run.device)
    mbs, extra = prepare_old_and_ref(
        cfg, mbs, trainer.policy_loss, ref_loss, batch.temperature, trainer.scoring_options(), fillers
    )
    fillers = parallel.fillers(n_train, mbs[0], pad_id, run.device)
    progress.phase("train", cfg.train.epochs_per_rollout_batch * (len(mbs) + len(sft_mbs)))
    stats = optimize_on_rollout(
        trainer,
        mbs,
        sft_mbs=sft_mbs,
        options=options,
        temperature=batch.temperature,
        logger=run.logger,
        step=step,
        on_microbatch=progress.advance_phase,
        fillers=fillers,
    )
    lr = trainer.scheduler.get_last_lr()[0]
    trainer.scheduler.step()
    counts = {
        "seqs": g_seqs,
        "tokens": g_tokens,
        "all_seqs": g_all_seqs,
        "all_tokens": g_all_tokens,
        "prompt_tokens": g_prompt_tokens,
    }
    return OptimizationResult(stats, counts, skipped_tokens, extra, lr, seconds=time.perf_counter() - t0)


def sequences_with_gradient(cfg: Config, seqs: list[Trajectory], options: LossOptions) -> list[Trajectory]:
    """The sequences the optimization phase must run (``train.skip_zero_advantage``).

    Where the loss says a zero advantage means a zero gradient
    (``LossOptions.zero_advantage_zero_gradient``: its policy-gradient term is proportional to
    the advantage, and no KL, entropy or entropy-quantile term is on), a response whose
    advantage is exactly 0 on every token (every response of a group whose rewards are all equal, under every
    loss type) has a gradient of exactly 0: its forward and backward are skipped. The loss
    weights were normalized over the whole batch before, so the update is the same to fp32
    summation order (tests/test_train_optimization.py). If nothing is left, the shortest
    response is kept: every parameter still gets a (zero) gradient, so the optimizer steps as it
    would have, and every rank joins the DDP all-reduce. Token metrics (``train/entropy_mean``,
    ``clip_fraction``, ``rollout/logprob_abs_diff``) are then over the trained tokens;
    ``train/skipped_fraction`` says how many were skipped.
    """
    if not (cfg.train.skip_zero_advantage and options.zero_advantage_zero_gradient):
        return seqs
    kept = [s for s in seqs if bool(s.sampled_advantages.any())]  # a nonzero advantage on a token
    return kept or sorted(seqs, key=lambda s: s.num_tokens)[:1]


def prepare_old_and_ref(
    cfg: Config,
    mbs: list[Microbatch],
    policy_loss,
    ref_loss,
    temperature: float,
    options: LossOptions,
    fillers: list[Microbatch] = (),
) -> tuple[list[Microbatch], dict[str, float]]:
    """The microbatches with π_old, π_ref and the sampler-mismatch weights, before the first epoch
    (new ``Microbatch`` objects: the ones given are left as they are).

    π_old and π_ref come from no-grad passes of the same fused module the loss uses
    (``policy_loss``: ``PolicyLoss``, not its DDP wrapper; ``options`` with β = 0: they read
    log-probs only), so the first epoch's ratio exp(log π − log π_old) is exactly 1 on every
    token. With ``rollout.old_logprobs=sampler``, π_old is the engine's log-probs instead (one
    forward pass saved per rollout batch; with ``rollout.max_staleness > 0`` from the first epoch,
    where the sampler's policy is behind the trainer's). On-policy with one epoch and no correction (the
    default) nothing runs here: π_old is π itself. ``fillers`` (FSDP): zero-weight microbatches
    that get the same passes, their results dropped, so that every rank runs as many.
    """
    r = cfg.rollout
    several_epochs = cfg.loss.needs_old_logprobs(cfg.train.epochs_per_rollout_batch)
    trainer_old = r.is_correction or (several_epochs and r.old_logprobs == "trainer")
    # rollout.max_staleness > 0: the sampler's policy is behind the trainer's even in the first
    # epoch, so π_old = the sampler's log-probs clips the ratio from the first step on
    sampler_old = r.old_logprobs == "sampler" and (several_epochs or r.max_staleness > 0)
    weights, raw_weights, out = [], [], []
    for mb in mbs:
        old, loss_weights, ref = mb.old_logprobs, mb.loss_weights, mb.ref_logprobs
        if sampler_old:
            old = mb.sampler_logprobs
        elif trainer_old:
            with torch.no_grad():
                old = policy_loss(mb, options, temperature).logprobs
        if r.is_correction:
            raw = raw_importance_weights(
                old,
                mb.sampler_logprobs,
                mb.sequence_ids,
                level=r.is_level,
                across=parallel.across(mb),
            )
            rho = cut_importance_weights(raw, mode=r.is_mode, cap=r.is_cap)
            loss_weights = loss_weights * rho
            weights.append(rho)
            raw_weights.append(raw)
        if ref_loss is not None:
            with torch.no_grad():
                ref = ref_loss(mb, options, temperature).logprobs
        out.append(dataclasses.replace(mb, old_logprobs=old, ref_logprobs=ref, loss_weights=loss_weights))
    with torch.no_grad():
        for mb in fillers:
            if trainer_old:
                policy_loss(mb, options, temperature)
            if ref_loss is not None:
                ref_loss(mb, options, temperature)
    if not weights:
        return out, {}
    rho, raw = torch.cat(weights), torch.cat(raw_weights)
    cut = (rho == r.is_cap) if r.is_mode == "truncate" else (rho == 0)
    return out, {  # host-device syncs, once per step
        "rollout/is_weight_mean": rho.mean().item(),
        "rollout/is_cut_fraction": cut.float().mean().item(),
        # ρ before the cut (fp64): how far the sampler is off, which the cut hides
        "rollout/is_weight_raw_mean": raw.mean().item(),
        "rollout/is_weight_raw_max": raw.max().item(),
    }


def _sft_microbatches(run: Run, examples: list) -> list[Microbatch]:
    """``sft.mix_coef``: microbatches of the step's prompts + their ground-truth solutions (those
    that have one), each token weighted ``mix_coef / N`` with N the solution tokens over all
    ranks, so their loss gradient is ``mix_coef`` × ∇(per-token mean NLL)."""
    cfg, tok = run.cfg, run.tokenizer
    pairs = []
    for ex in examples:
        text = run.task.solution_text(ex)
        if text is not None:
            ids = tok(text, add_special_tokens=False)["input_ids"][: cfg.rollout.max_tokens - 1]
            pairs.append((run.task.prompt_ids(ex), [*ids, tok.eos_token_id]))
    (total,) = dist.all_reduce_sum([float(sum(len(s) for _, s in pairs))], run.device, axis=run.world.dp)
    w = cfg.sft.mix_coef / max(total, 1.0)
    seqs = [Sequence(list(p) + list(s), len(p), advantage=1.0, weight=w) for p, s in pairs]
    mb_size = int(cfg.train.micro_batch_size)
    mbs = make_microbatches(seqs, mb_size, tok.pad_token_id, cfg.train.packing)
    return [parallel.on_rank(mb, run.world, run.device) for mb in mbs]


def _step_cast_cache(trainer: Trainer):
    """``PolicyLoss.step_cast_cache`` of the trainer's loss module (DDP: the wrapped module)."""
    return parallel.unwrap(trainer.policy).step_cast_cache(trainer.device)


def _accumulate_gradients(
    trainer: Trainer,
    mbs,
    sft_mbs,
    epoch_stats: StepStats,
    options: LossOptions,
    temperature,
    on_microbatch,
    fillers=(),
) -> None:
    """Forward and backward of every microbatch of one optimizer step (the supervised ones
    first); under DDP the gradients are all-reduced once, on the last microbatch. ``fillers``
    (FSDP): zero-weight microbatches run last, so that every rank runs as many passes."""
    cfg, world = trainer.cfg, trainer.world
    sft_options = LossOptions()  # advantage 1, on-policy: the plain NLL
    for mb in sft_mbs:
        with parallel.accumulating(trainer.policy, world, True):
            out_mb = trainer.sft_loss(mb, sft_options, 1.0)
            (out_mb.loss * world.world_size).backward()
        epoch_stats.add_sft(out_mb, mb, cfg.sft.mix_coef)
        if on_microbatch is not None:
            on_microbatch(1)
    for i, mb in enumerate(mbs):
        with parallel.accumulating(trainer.policy, world, i < len(mbs) - 1):
            out_mb = trainer.policy(mb, options, temperature)
            # DDP (and FSDP) average gradients over ranks; the weights already hold global
            # normalizers, so scale by the world size to recover the sum. (A value head's loss
            # rides along: GRPOLossOutput.backward_loss.)
            (out_mb.backward_loss * world.world_size).backward()
        epoch_stats.add(out_mb, mb)
        if on_microbatch is not None:
            on_microbatch(1)
    parallel.filler_passes(trainer.policy, fillers, options, temperature)


def optimize_on_rollout(
    trainer: Trainer,
    mbs: list[Microbatch],
    *,
    sft_mbs: list[Microbatch] = (),
    options: LossOptions,
    temperature: float,
    logger: MetricsLogger | None = None,
    step: int = 0,
    on_microbatch=None,
    fillers: list[Microbatch] = (),
) -> StepStats:
    """The optimization phase on one rollout batch: ``train.epochs_per_rollout_batch`` passes,
    each one optimizer step over all microbatches (gradients accumulated; under DDP synced once,
    on the last microbatch), stopping early once KL(π_old ‖ π) exceeds ``loss.kl_early_stop``.
    With a value head (``loss.advantage=gae``) its clipped value loss is added to each
    microbatch's loss; during ``critic.warmup_steps`` only the head steps.

    ``options``: the loss options of this step (β included). ``sft_mbs`` (``sft.mix_coef``):
    supervised microbatches, run first in every epoch through ``trainer.sft_loss`` (temperature 1,
    the default options): their gradient adds ``mix_coef`` × ∇NLL to the GRPO gradient. Under
    DDP they run before the synced microbatch, which all-reduces the gradients accumulated so
    far, theirs included.

    ``fillers`` (FSDP): zero-weight microbatches that top this rank up to the most passes any
    rank runs (``grpo_fast.policy.parallel.filler_counts``).

    The gradients are freed (set to None) after every optimizer step, so none are allocated
    while the next rollout runs. Returns the first epoch's token-level statistics (what the
    step's metrics report).
    """
    cfg, world, device, optimizer = trainer.cfg, trainer.world, trainer.device, trainer.optimizer
    epochs = cfg.train.epochs_per_rollout_batch
    stats = StepStats()
    # critic.warmup_steps: the value head alone steps (the policy's gradients dropped before the step)
    head = trainer.value_head
    critic_only = head is not None and 0 < step <= cfg.critic.warmup_steps  # steps count from 1
    head_ids = {id(p) for p in head.parameters()} if head is not None else set()
    # the policy's gradient norm and clip apart from the value head's: a poorly fit head's large
    # gradient must not shrink the policy's update
    policy_params = [p for p in trainer.params if id(p) not in head_ids]
    head_params = [p for p in trainer.params if id(p) in head_ids]
    for epoch in range(epochs):
        optimizer.zero_grad(set_to_none=True)  # no-op unless the SFT warm start left gradients
        epoch_stats = StepStats()
        with _step_cast_cache(trainer):  # under autocast: each weight cast once per step
            _accumulate_gradients(
                trainer, mbs, sft_mbs, epoch_stats, options, temperature, on_microbatch, fillers
            )
        if critic_only:  # after the backward (DDP and FSDP reduced them): the policy keeps its weights
            for p in policy_params:
                p.grad = None
        grad_norm = parallel.clip_grad_norm(policy_params, cfg.train.grad_clip or float("inf"))
        if head_params:
            value_norm = parallel.clip_grad_norm(head_params, cfg.train.grad_clip or float("inf"))
            grad_norm = torch.stack([grad_norm.float(), value_norm.float()])  # read with the loss, below
        # host-device sync, once per optimizer step: a NaN/inf loss or gradient norm must not
        # reach the weights (nor AdamW's moments), so it is checked before the step.
        loss_v, norm_v, *value_v = torch.cat(
            [epoch_stats.sums["loss"][None], grad_norm.float().reshape(-1)]
        ).tolist()
        bad = [not math.isfinite(loss_v), not all(math.isfinite(x) for x in (norm_v, *value_v))]
        if world.enabled:  # a rank's loss is its own: every rank skips together
            bad = [b > 0 for b in dist.all_reduce_sum([float(b) for b in bad], device, axis=None)]
        nonfinite = " and ".join(q for q, b in zip(("loss", "grad_norm"), bad) if b)
        if nonfinite:
            if logger is not None:
                logger.event(
                    f"step {step}: non-finite {nonfinite} (loss {loss_v}, grad_norm {norm_v}) in epoch "
                    f"{epoch + 1}: optimizer step skipped"
                )
        else:
            optimizer.step()
        # Free the gradients now: kept until the next phase, they would sit beside the rollout
        # engine through the next rollout (Qwen2.5-1.5B: 6.2 GB of fp32 gradients).
        optimizer.zero_grad(set_to_none=True)
        if epoch == 0:
            stats = epoch_stats
            stats.grad_norm = norm_v
            stats.value_grad_norm = value_v[0] if value_v else None
        if nonfinite:
            stats.nonfinite = nonfinite
            break
        if epoch + 1 < epochs:
            approx_kl = epoch_stats.kl_to_old(world, device)
            if kl_early_stop(approx_kl, cfg.loss.kl_early_stop):
                if logger is not None:
                    logger.event(
                        f"step {step}: KL(π_old ‖ π) {approx_kl:.3f} > loss.kl_early_stop={cfg.loss.kl_early_stop}, "
                        f"stopping after epoch {epoch + 1}"
                    )
                break
    return stats


@dataclass
class ResponseScores:
    """No-grad scores of a rollout's responses (``score_responses``), each ``[R]`` in rollout order."""

    kl_sums: torch.Tensor | None = None  # [R] fp32 Σ_t k1_t
    kl_totals: tuple[float, float] | None = None  # (Σ k1, sampled tokens) over this rank
    kl_tokens: list[torch.Tensor] | None = None  # [R] of [S] fp32 k1_t
    values: list[torch.Tensor] | None = None  # [R] of [S] fp32: the value head's (loss.advantage=gae)
    # distill.teacher: [R] of [S] fp32 log π_teacher − log π_student, and the teacher passes' seconds
    distill: list[torch.Tensor] | None = None
    teacher_seconds: float = 0.0
    teacher_peak_gb: float = 0.0  # the largest peak memory of a teacher pass (obs.metrics.phase_peak_gb)


def response_kl_k1(
    run: Run, rollout: Rollout, temperature: float
) -> tuple[torch.Tensor, tuple[float, float]]:
    """``loss.kl_in_reward``: each response's Σ_t k1_t = Σ_t (log π − log π_ref) over its sampled
    tokens, ``[R]`` fp32 on the CPU, and (Σ k1, sampled tokens) over this rank, for the metrics
    (``score_responses`` with ``kl=True``, which also has each token's k1)."""
    scores = score_responses(run, rollout, temperature, kl=True)
    return scores.kl_sums, scores.kl_totals


def score_responses(
    run: Run, rollout: Rollout, temperature: float, *, kl: bool, teacher: bool = False
) -> ResponseScores:
    """No-grad passes of the fused op over ``rollout`` (the trainer side's modules, which the
    step's finalize asks for): with ``kl`` the policy's and the reference's (``loss.kl_in_reward``:
    k1 per token and its sum per response); when the loss module has a value head
    (``loss.advantage=gae``), the values from the same policy pass; with ``teacher``
    (``distill.teacher``) the teacher's log-probs less that pass's, per token. Each token carries its
    trajectory's index (``Microbatch.response_index``; a trajectory's labels are consecutive, in
    order), so the sums and the tokens land on the right response whatever the microbatch order
    or packing."""
    cfg, trainer = run.cfg, run.trainer
    trajectories = rollout.trajectories
    sums = torch.zeros(len(trajectories), dtype=torch.float64, device=run.device)
    scored = [t for t in trajectories if t.num_sampled]
    index = torch.tensor([i for i, t in enumerate(trajectories) if t.num_sampled], dtype=torch.long)
    mbs = make_microbatches(
        scored,
        int(cfg.train.micro_batch_size),
        run.tokenizer.pad_token_id,
        cfg.train.packing,
        share_prompts=shares_prompts(cfg),
    )
    options = trainer.scoring_options()
    has_values = getattr(trainer.policy_loss, "value_head", None) is not None
    per_token = [torch.zeros(0)] * len(trajectories)
    values = [torch.zeros(0)] * len(trajectories)
    gaps = [torch.zeros(0)] * len(trajectories)
    teacher_s, teacher_peak = 0.0, 0.0
    # distill.placement=server: every response's request in flight during the student's pass
    served = teacher and not isinstance(trainer.teacher_loss, torch.nn.Module)
    asked = trainer.teacher_loss.submit(scored) if served else []
    student = [torch.zeros(0)] * len(trajectories)
    # FSDP: as many passes on every rank (zero-weight fillers); none under DDP
    (missing,) = parallel.filler_counts([len(mbs)], trainer.policy_loss, run.device)
    with torch.no_grad():
        for mb in mbs:
            rows = mb.response_index
            mb = mb.to(run.device)
            out = trainer.policy_loss(mb, options, temperature)
            if kl:
                k1 = out.logprobs - trainer.ref_loss(mb, options, temperature).logprobs
                sums.index_add_(0, index.to(run.device)[mb.response_index], k1.double())
                k1_host = k1.float().cpu()
            v_host = out.values.cpu() if has_values else None
            if served:
                gap_host = out.logprobs.float().cpu()  # the student's; the teacher's come after
            elif teacher:  # the teacher's fused pass; its time is the step's distillation cost
                t0 = time.perf_counter()
                taught, peak = phase_peak_gb(run.device, trainer.teacher_loss, mb, options, temperature)
                gap_host = (taught.logprobs - out.logprobs).float().cpu()
                teacher_s += time.perf_counter() - t0
                teacher_peak = max(teacher_peak, peak)
            for row in rows.unique().tolist():
                mine = rows == row
                if kl:
                    per_token[int(index[row])] = k1_host[mine]
                if has_values:
                    values[int(index[row])] = v_host[mine]
                if teacher:
                    (student if served else gaps)[int(index[row])] = gap_host[mine]
        for filler in parallel.fillers(missing, None, run.tokenizer.pad_token_id, run.device):
            trainer.policy_loss(filler, options, temperature)
            if kl:
                trainer.ref_loss(filler, options, temperature)
            if teacher and not served:
                trainer.teacher_loss(filler, options, temperature)
    if served:  # the time past the student's pass is what the teacher costs the step
        t0 = time.perf_counter()
        for i, future in zip(index.tolist(), asked):
            gaps[i] = future.result() - student[i]
        teacher_s = time.perf_counter() - t0
    scores = ResponseScores(values=values if has_values else None)
    if teacher:
        scores.distill, scores.teacher_seconds, scores.teacher_peak_gb = gaps, teacher_s, teacher_peak
    if kl:
        sums = sums.float().cpu()  # host-device sync, once per step
        scores.kl_sums, scores.kl_tokens = sums, per_token
        scores.kl_totals = (sums.sum().item(), float(sum(t.num_sampled for t in scored)))
    return scores
