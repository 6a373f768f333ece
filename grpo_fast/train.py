"""GRPO training: ``python -m grpo_fast.train --preset NAME [--config F.yaml ...] [key=value ...]``.

The variant: GRPO (Shao et al. 2024) as used for R1-Zero-style reasoning RL, on-policy by
default, with the choices our users reach for as config keys:

- advantages: reward minus the group mean, divided by the group std (``loss.scale_rewards=group``),
  the whole batch's std (``batch``) or nothing (``none``, Dr. GRPO); zero-variance groups get
  zero advantage;
- loss: the clipped surrogate with ``clip_low``/``clip_high`` (DAPO's clip-higher) and an
  optional dual clip or ratio cap ``loss.delta``; CISPO (``loss.type=cispo``: the clipped,
  detached importance weight × advantage × log π); or REINFORCE with/without baseline;
- length normalization as per-token loss weights: ``sequence_mean`` (GRPO), ``constant``
  (Dr. GRPO), ``token_mean`` (DAPO);
- optional KL penalty to the initial policy (k1/k2/k3, fixed or adaptive β), entropy bonus,
  several epochs per rollout batch with KL early stop.

Where it deviates from the paper: the KL term is off by default (β = 0, as in DAPO and
Dr. GRPO); with one epoch per rollout batch (the default) the importance ratio is 1, so π_old
is never computed — the loss is the on-policy policy gradient and its clipping never triggers.
With ``rollout.backend=vllm`` the samples come from vLLM's copy of the weights; their small
log-prob gap to the trainer is logged (``rollout/logprob_abs_diff``) and corrected only with
``rollout.is_correction=true`` (truncated importance sampling, ``grpo_fast.sampler_correction``).

Each step reads top to bottom: rollout phase (sample prompts → generate → rewards →
advantages), then optimization phase (microbatches → fused lm_head + loss → backward →
clip → step), then metrics, evaluation and checkpoint.
"""

from __future__ import annotations

import argparse
import contextlib
import copy
import json
import math
import random
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from grpo_fast import checkpoint as ckpt
from grpo_fast import dist, plan, preempt
from grpo_fast.batch import Sequence, build_sequences, make_microbatches
from grpo_fast.config import Config, load_config, to_yaml
from grpo_fast.core import (
    AdaptiveKLController,
    compute_group_normalized_rewards,
    entropy_threshold,
    kl_early_stop,
    kl_penalty,
    sequence_mean,
)
from grpo_fast.errors import ConfigError, Preempted, TrainingStopped, cli_errors
from grpo_fast.evaluate import evaluate
from grpo_fast.health import HealthMonitor, HealthThresholds
from grpo_fast.metrics import MetricsLogger, PhaseProgress, gpu_stats, peak_memory_gb, reset_peak_memory
from grpo_fast.model import (
    autocast_dtype,
    build_policy_loss,
    load_policy,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
)
from grpo_fast.optim import PromptSampler, build_optimizer, build_scheduler
from grpo_fast.rollout import SamplingParams, make_backend, vllm_dtype, weight_sync_tolerance
from grpo_fast.rollout.vllm import WeightSyncProbe, step_seed
from grpo_fast.sampler_correction import sampler_importance_weights
from grpo_fast.sft import sft_warm_start
from grpo_fast.task import Task, load_task


@dataclass
class TrainState:
    """What changes from step to step and must survive a resume."""

    step: int = 0
    beta: float = 0.0


def parse_args(argv: list[str] | None, prog: str = "python -m grpo_fast.train") -> argparse.Namespace:
    """Options and ``key=value`` overrides in any order (``--config`` may follow overrides)."""
    from grpo_fast.cli import presets_and_keys_help

    p = argparse.ArgumentParser(
        prog=prog,
        description="GRPO training. Overrides are OmegaConf dot-list pairs, e.g. train.lr=3e-6 steps=50.",
        epilog=presets_and_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", help="tiny (CPU, default) | smoke | rtx4090 | h100")
    p.add_argument("--config", action="append", default=[], metavar="FILE.yaml", help="layered in order")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config (with each value's source), the memory plan and the data; load no model",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_intermixed_args(argv)


@cli_errors
def main(argv: list[str] | None = None, prog: str = "python -m grpo_fast.train") -> int:
    args = parse_args(argv, prog)
    if args.dry_run:
        from grpo_fast.cli import dry_run

        return dry_run(args.preset, args.config, args.overrides)
    cfg = load_config(args.preset, args.config, args.overrides)
    run(cfg)
    return 0


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


@contextlib.contextmanager
def sampling_rng(seed: int | None, device: torch.device):
    """The torch RNG (CPU, and ``device``'s when CUDA) seeded with ``seed`` inside the block and
    restored after it; ``None`` leaves it alone. Data parallel, every rank starts from the same
    RNG state, so hf ``generate`` would draw the same random numbers on every rank: the loop
    seeds each rank's sampling with its own (run seed, step, rank) seed instead. One rank keeps
    its single stream (the same results as before this existed)."""
    if seed is None:
        yield
        return
    with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
        torch.manual_seed(seed)
        yield


def run(cfg: Config, engine=None) -> Path:
    """Train with ``cfg``; returns the output directory. ``engine``: a rollout engine to use
    instead of building one (tests pass a fake vLLM engine here)."""
    out = Path(cfg.output_dir)
    check_output_dir(out)  # on every rank, before anything loads: a bad path fails in a second
    quiet_transformers()
    device = resolve_device(cfg)
    world = dist.init(device.type)
    try:
        with preempt.handle_signals():  # SIGTERM/SIGINT: checkpoint at the end of the step, then stop
            return _train(cfg, device, world, out, engine)
    finally:
        dist.shutdown()


def check_output_dir(out: Path) -> None:
    """Create ``out`` (and its parents) and write a probe file in it; ``ConfigError`` naming
    ``output_dir`` when either fails (a path under a file, no permission, a read-only mount)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir={str(out)!r} cannot be created: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write_probe_"):
            pass
    except OSError as exc:
        raise ConfigError(f"output_dir={str(out)!r} is not writable: {exc.strerror or exc}") from None


def _train(cfg: Config, device: torch.device, world: dist.DistInfo, out: Path, engine) -> Path:
    t_start = time.perf_counter()
    # Every rank starts from the same seed (same init, same prompts); each rank's rollout
    # sampling gets its own seed (sampling_rng below).
    seed_everything(cfg.seed)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logger = MetricsLogger(cfg, out, enabled=world.is_main)

    # ---------------------------------------------------------------- setup
    task: Task = load_task(cfg)  # the data first: a bad file fails in seconds, before any model loads
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    task.tokenizer = tokenizer
    model = load_policy(cfg, tokenizer, device)
    amp = autocast_dtype(cfg, device)
    cfg = plan.resolve_auto(cfg, model.config, device, world.world_size)
    if world.is_main:
        (out / "config.yaml").write_text(to_yaml(cfg))
    r = cfg.rollout
    n_prompts = r.batch_size // r.group_size
    if n_prompts % world.world_size:
        raise ConfigError(
            f"rollout.batch_size / rollout.group_size = {n_prompts} prompts per step do not split "
            f"evenly over {world.world_size} ranks"
        )
    local_prompts = n_prompts // world.world_size

    state = TrainState(beta=cfg.loss.beta)
    sampler = PromptSampler(len(task.train), cfg.seed)
    kl_ctl = AdaptiveKLController(cfg.loss.beta, cfg.loss.target_kl) if cfg.loss.target_kl else None
    health = HealthMonitor(
        HealthThresholds(**{**cfg.health.thresholds, "auto_temperature_boost": cfg.health.auto_temperature})
    )
    ckpt_root = out / "checkpoints"
    resume_from = ckpt.latest_checkpoint(ckpt_root) if cfg.resume else None
    if cfg.resume and resume_from is None:
        logger.event(f"resume=true but {ckpt_root} holds no checkpoint: starting from scratch")

    sft_steps = 0
    if resume_from is None and cfg.sft.steps > 0:
        sft_steps = sft_warm_start(
            cfg, model, tokenizer, task, device, amp, out if world.is_main else None, logger
        )
    # The KL reference is the policy GRPO starts from (after any warm start), frozen, kept in
    # the autocast dtype when there is one (bf16: half the memory of fp32 master weights).
    ref_model = None
    if cfg.loss.beta > 0 or kl_ctl is not None:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if amp is not None:
            ref_model.to(amp)
    optimizer = build_optimizer(cfg, model.parameters())
    scheduler = build_scheduler(cfg, optimizer)

    if resume_from is not None:
        saved = ckpt.load_state(resume_from)
        if saved["world_size"] != world.world_size:
            raise ConfigError(
                f"resume=true: {resume_from} was written by {saved['world_size']} rank(s); "
                f"resume with the same number of ranks (now {world.world_size})"
            )
        ckpt.load_model_weights(model, resume_from)
        if ref_model is not None:
            ref_model.load_state_dict(saved["ref_model"])
        optimizer.load_state_dict(saved["optimizer"])
        scheduler.load_state_dict(saved["scheduler"])
        sampler.load_state_dict(saved["sampler"])
        health.load_state_dict(saved["health"])
        if kl_ctl is not None:
            kl_ctl.load_state_dict(saved["kl_controller"])
        state = TrainState(**saved["train_state"])
        ckpt.set_rng_state(saved["rng"][world.rank])
        logger.truncate_after(state.step)
        logger.event(f"resumed from {resume_from} at step {state.step}")

    policy_loss = build_policy_loss(cfg, model, amp)
    ref_loss = build_policy_loss(cfg, ref_model, amp) if ref_model is not None else None
    policy = policy_loss
    if world.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy = DDP(policy_loss, device_ids=[device.index] if device.type == "cuda" else None)
    backend = _make_backend(
        cfg, model, tokenizer, task, policy_loss, device, amp, out, world, engine, sft_steps
    )
    eval_subset = task.eval_subset(cfg.data.eval_subset_size, cfg.seed)

    def run_eval(step: int, full: bool, progress: PhaseProgress | None = None) -> dict[str, float]:
        examples = task.eval if full else eval_subset
        if progress is not None:
            progress.phase("eval", len(examples[world.rank :: world.world_size]))
        advance = progress.advance_phase if progress is not None else None
        metrics, records = evaluate(backend, task, examples, cfg, device, world=world, progress=advance)
        prefix = "eval_full/" if full else "eval/"
        if world.is_main:
            _dump_samples(
                out / "samples" / f"eval_step_{step}.jsonl", records[: cfg.logging.samples_per_dump]
            )
        return {prefix + k: v for k, v in metrics.items()}

    if state.step == 0 and cfg.eval_every and eval_subset:
        row = run_eval(0, full=False)
        logger.log(0, {**row, "sft/steps": sft_steps, "world_size": world.world_size})
        logger.event(f"step 0 (before GRPO): eval/accuracy {row['eval/accuracy']:.3f}")

    def save_checkpoint(at_step: int) -> None:
        _save_checkpoint(
            cfg, ckpt_root, at_step, model, ref_model, tokenizer, optimizer, scheduler, sampler, health,
            kl_ctl, state, world,
        )  # fmt: skip

    # ---------------------------------------------------------------- the loop
    params = [p for p in model.parameters() if p.requires_grad]
    nonfinite_run = 0  # consecutive steps not applied (train.max_nonfinite_steps stops the run)
    with PhaseProgress(cfg.logging.progress and world.is_main, cfg.steps, state.step) as progress:
        for step in range(state.step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            reset_peak_memory(device)

            # ---- rollout phase: prompts → G responses each → rewards → group advantages
            idx = sampler.next(n_prompts)[world.rank * local_prompts : (world.rank + 1) * local_prompts]
            examples = [task.train[i] for i in idx]
            prompt_ids = [task.prompt_ids(e) for e in examples]
            temperature = r.temperature + health.shared_temperature_boost(step)  # rank 0's, on every rank
            params_s = SamplingParams(
                n=r.group_size,
                temperature=temperature,
                top_p=r.top_p,
                max_tokens=r.max_tokens,
                min_tokens=r.min_tokens,
                stop=tuple(task.stop),
                seed=step_seed(cfg.seed, step, world.rank),  # the same samples after a resume
            )
            progress.phase("rollout", len(prompt_ids))
            with sampling_rng(params_s.seed if world.enabled else None, device):
                rollout = backend.generate(prompt_ids, params_s, progress=progress.advance_phase)
            backend.sleep()
            gts = [e.answer for e in examples for _ in range(r.group_size)]
            reward_fn = task.reward_fn.for_batch(step)  # numbers the responses, counts reward errors
            advantages, raw_rewards, reward_meta = compute_group_normalized_rewards(
                reward_fn,
                rollout.response_text,
                gts,
                r.group_size,
                cfg.loss.advantage_eps,
                scale_rewards=cfg.loss.scale_rewards,
                reduce_sums=lambda sums: dist.all_reduce_sum(sums, device),  # batch: std over all ranks
            )
            if cfg.loss.type == "no_baseline":  # REINFORCE without a baseline: A = the raw reward
                advantages = raw_rewards
            t_rollout = time.perf_counter() - t0

            # ---- optimization phase
            t1 = time.perf_counter()
            # loss.mask_truncated: responses that hit max_tokens leave the loss and its normalizers
            keep = [not (cfg.loss.mask_truncated and f == "length") for f in rollout.finish_reason]
            lengths = [len(x) for x, k in zip(rollout.response_ids, keep) if k]
            all_tokens = sum(len(x) for x in rollout.response_ids)
            # one collective for the global counts (token_mean needs Σ tokens over all ranks)
            g_seqs, g_tokens, g_all_seqs, g_all_tokens = dist.all_reduce_sum(
                [len(lengths), sum(lengths), len(keep), all_tokens], device
            )
            seqs = build_sequences(
                rollout.prompt_ids,
                rollout.response_ids,
                advantages,
                length_norm=cfg.loss.length_norm,
                max_length=r.max_tokens,
                num_sequences=int(g_seqs),
                num_tokens=g_tokens,
                sampler_logprobs=rollout.sampler_logprobs,
                keep=keep,
            )
            if (
                not seqs
            ):  # all left out (loss.mask_truncated): one zero-weight response keeps the step's shape
                g = r.group_size
                i = next(i for i, x in enumerate(rollout.response_ids) if x)
                p = rollout.prompt_ids[i // g]
                seqs = [Sequence(list(p) + list(rollout.response_ids[i]), len(p), 0.0, 0.0)]
            trained = _sequences_with_gradient(cfg, seqs, state.beta)
            skipped_tokens = sum(s.n_response for s in seqs) - sum(s.n_response for s in trained)
            mbs = [
                mb.to(device)
                for mb in make_microbatches(
                    trained, int(cfg.train.micro_batch_size), tokenizer.pad_token_id, cfg.train.packing
                )
            ]
            extra = _prepare_old_and_ref(cfg, mbs, policy_loss, ref_loss, temperature)
            progress.phase("train", cfg.train.epochs_per_rollout_batch * len(mbs))
            stats = optimize_on_rollout(
                policy,
                optimizer,
                params,
                mbs,
                cfg,
                world,
                device,
                state.beta,
                temperature,
                logger,
                step,
                on_microbatch=progress.advance_phase,
            )
            lr = scheduler.get_last_lr()[0]
            scheduler.step()
            backend.update_weights(model, step=step)  # vllm: push + weight-sync probe (may stop the run)
            t_train = time.perf_counter() - t1

            # ---- metrics (one all-reduce for the token-level sums across ranks)
            totals = stats.global_totals(world, device, raw_rewards, rollout, reward_meta, skipped_tokens)
            if kl_ctl is not None:
                state.beta = kl_ctl.update(totals["kl"], int(g_seqs))
            state.step = step
            step_s = time.perf_counter() - t0
            row = {
                "train/loss": totals["loss"],
                "train/reward_mean": totals["reward_mean"],
                "train/reward_std": totals["reward_std"],
                "train/accuracy": totals["accuracy"],
                "train/format_rate": totals["format_rate"],
                "train/entropy_mean": totals["entropy"],
                "train/response_length_mean": g_all_tokens / max(g_all_seqs, 1),
                "train/truncated_fraction": totals["truncated"],
                "train/zero_variance_fraction": totals["zero_variance"],
                "train/skipped_fraction": totals["skipped"],
                **_reward_errors(cfg, reward_fn, device),
                "train/grad_norm": stats.grad_norm,
                "train/clip_fraction": totals["clip_fraction"],
                "train/clip_fraction_low": totals["clip_fraction_low"],  # clipped with r < 1
                "train/clip_fraction_high": totals["clip_fraction_high"],  # clipped with r > 1
                "train/loss_pg": totals["loss_pg"],  # train/loss = loss_pg + loss_kl + loss_entropy
                "train/loss_kl": totals["loss_kl"],
                "train/loss_entropy": totals["loss_entropy"],
                # the top_entropy_quantile threshold, mean over microbatches (0 when off)
                "train/entropy_threshold": totals["entropy_threshold"],
                "train/kl": totals["kl"],
                "train/beta": state.beta,
                "train/lr": lr,
                "train/temperature": temperature,
                "time/rollout_s": t_rollout,
                "time/train_s": t_train,
                "time/step_s": step_s,
                "memory/peak_gb": peak_memory_gb(device),
                "throughput/tokens_per_s": (
                    g_all_tokens + sum(map(len, rollout.prompt_ids)) * r.group_size * world.world_size
                )
                / step_s,
                "world_size": world.world_size,
                **_rollout_metrics(backend, totals),
                **extra,
                **gpu_stats(device),
            }
            if cfg.health.enabled:
                for ev in health.update(step, row, rollout.response_text):
                    row[f"health/{ev.kind}"] = ev.value
                    logger.event(f"[health] step {step} {ev.severity}: {ev.message} — {ev.suggestion}")
                    if world.is_main:
                        with open(out / "health.jsonl", "a") as fh:
                            fh.write(json.dumps(ev.to_dict()) + "\n")
            if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps) and eval_subset:
                row.update(run_eval(step, full=False, progress=progress))
            if cfg.full_eval_every and (step % cfg.full_eval_every == 0 or step == cfg.steps):
                row.update(run_eval(step, full=True, progress=progress))
            if world.is_main and cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
                _dump_samples(
                    out / "samples" / f"step_{step}.jsonl", _sample_records(task, examples, rollout, cfg)
                )
            logger.log(step, row)
            logger.summary(step, cfg.steps, row)
            progress.step_done()

            nonfinite_run = nonfinite_run + 1 if stats.nonfinite else 0
            if nonfinite_run >= cfg.train.max_nonfinite_steps:
                latest = ckpt.latest_checkpoint(ckpt_root)
                first = step - nonfinite_run + 1
                raise TrainingStopped(
                    f"steps {first}-{step}: {nonfinite_run} steps in a row with a non-finite "
                    f"{stats.nonfinite} (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}), none "
                    f"applied (the weights are step {first - 1}'s); "
                    + (f"{latest} is intact" if latest else "no checkpoint was written yet")
                    + ": lower train.lr or train.grad_clip, or check the rewards, then resume=true"
                )
            signum = preempt.pending(world, device)  # SIGTERM/SIGINT during this step
            due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps
            if due or signum is not None:
                save_checkpoint(step)
            if signum is not None:
                where = ckpt_root / ckpt.step_dir_name(step)
                raise Preempted(
                    f"{signal.Signals(signum).name} during step {step}: checkpoint {where} written "
                    "after it; resume=true continues from there",
                    signum,
                )

    # ---------------------------------------------------------------- the final model
    # With checkpoints on, the last step leaves one too (the loop skips it), so that
    # `resume=true steps=N` extends a finished run from its final step.
    last = ckpt.latest_checkpoint(ckpt_root)
    if cfg.checkpoint_every and (last is None or last.name != ckpt.step_dir_name(state.step)):
        save_checkpoint(state.step)
    if world.is_main:
        save_dtype = None if cfg.train.save_dtype == "auto" else getattr(torch, cfg.train.save_dtype)
        ckpt.save_pretrained_atomic(model, tokenizer, out / "final", dtype=save_dtype)
        logger.event(
            f"done: {cfg.steps} steps in {time.perf_counter() - t_start:.1f}s; model in {out / 'final'}"
        )
    dist.barrier()
    logger.close()
    return out


def optimize_on_rollout(
    policy,
    optimizer,
    params,
    mbs,
    cfg: Config,
    world,
    device,
    beta: float,
    temperature: float,
    logger=None,
    step: int = 0,
    on_microbatch=None,
):
    """The optimization phase on one rollout batch: ``train.epochs_per_rollout_batch`` passes,
    each one optimizer step over all microbatches (gradients accumulated; under DDP synced once,
    on the last microbatch), stopping early once KL(π_old ‖ π) exceeds ``loss.kl_early_stop``.

    The gradients are freed (set to None) after every optimizer step, so none are allocated
    while the next rollout runs. Returns the first epoch's token-level statistics (what the
    step's metrics report).
    """
    epochs = cfg.train.epochs_per_rollout_batch
    stats = _Stats()
    for epoch in range(epochs):
        optimizer.zero_grad(set_to_none=True)  # no-op unless the SFT warm start left gradients
        epoch_stats = _Stats()
        for i, mb in enumerate(mbs):
            last = i == len(mbs) - 1
            sync = policy.no_sync() if world.enabled and not last else contextlib.nullcontext()
            with sync:
                out_mb = policy(mb, beta, temperature)
                # DDP averages gradients over ranks; the weights already hold global
                # normalizers, so scale by the world size to recover the sum.
                (out_mb.loss * world.world_size).backward()
            lo = cfg.loss
            epoch_stats.add(
                out_mb, mb, beta, lo.entropy_coef, lo.importance_sampling_level, lo.top_entropy_quantile
            )
            if on_microbatch is not None:
                on_microbatch(1)
        grad_norm = torch.nn.utils.clip_grad_norm_(params, cfg.train.grad_clip or float("inf"))
        # host-device sync, once per optimizer step: a NaN/inf loss or gradient norm must not
        # reach the weights (nor AdamW's moments), so it is checked before the step.
        loss_v, norm_v = torch.stack([epoch_stats.sums[0], grad_norm.float()]).tolist()
        bad = [not math.isfinite(loss_v), not math.isfinite(norm_v)]
        if world.enabled:  # a rank's loss is its own: every rank skips together
            bad = [b > 0 for b in dist.all_reduce_sum([float(b) for b in bad], device)]
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


class _Stats:
    """Token-level sums over the microbatches of one epoch (kept on the device until the end)."""

    # [loss, entropy, clipped, kl_ref, kl_old, tokens, Σ |log p_trainer − log p_sampler|,
    #  clipped with r < 1, clipped with r > 1, Σ w·pg, Σ w·β·KL, −Σ w·c·H,
    #  Σ entropy thresholds (loss.top_entropy_quantile < 1), microbatches]
    WIDTH = 14

    def __init__(self):
        self.sums: torch.Tensor | None = None
        self.grad_norm = float("nan")
        self.has_ref = False
        self.nonfinite = ""  # "loss" / "grad_norm" / both: that step's optimizer step was skipped

    def add(
        self,
        out,
        mb,
        beta: float = 0.0,
        entropy_coef: float = 0.0,
        level: str = "token",
        top_entropy_quantile: float = 1.0,
    ) -> None:
        n = torch.tensor(float(mb.labels.numel()), device=out.entropy.device)
        zero = torch.zeros((), device=n.device)
        self.has_ref = out.kl is not None
        kl = out.kl.sum() if out.kl is not None else torch.zeros((), device=n.device)
        kl_old = torch.zeros((), device=n.device)
        if mb.old_logprobs is not None:
            # KL(π_old ‖ π) from samples of π_old: k3 with d = log π_old − log π is e^(−d) − 1 + d
            kl_old = kl_penalty(mb.old_logprobs, out.logprobs.detach(), "k3").sum()
        # the trainer-vs-sampler gap on the sampled tokens, from this forward's log-probs: no extra pass
        sampler_gap = torch.zeros((), device=n.device)
        if mb.sampler_logprobs is not None:
            sampler_gap = (out.logprobs - mb.sampler_logprobs).abs().sum()
        # the side of the range a clipped ratio left it on (on-policy nothing is clipped)
        clip_low = clip_high = zero
        if mb.old_logprobs is not None:
            log_ratio = out.logprobs.detach() - mb.old_logprobs
            if level == "sequence":  # GSPO clips the response's ratio
                log_ratio = sequence_mean(log_ratio, mb.sequence_ids)
            clip_low = (out.clipped & (log_ratio < 0)).float().sum()
            clip_high = (out.clipped & (log_ratio > 0)).float().sum()
        # the loss split: Σ w·(pg + β·KL − c·H), each term from the op's per-token values
        kl_term = beta * (mb.loss_weights * out.kl).sum() if beta != 0 and out.kl is not None else zero
        entropy_term = -entropy_coef * (mb.loss_weights * out.entropy).sum() if entropy_coef != 0 else zero
        loss = out.loss.detach().float()
        threshold = zero  # the op's own: the same quantile of the same entropies
        if top_entropy_quantile < 1:
            threshold = entropy_threshold(out.entropy, mb.loss_weights != 0, top_entropy_quantile).float()
        row = torch.stack(
            [
                loss,
                out.entropy.sum(),
                out.clipped.float().sum(),
                kl,
                kl_old,
                n,
                sampler_gap,
                clip_low,
                clip_high,
                loss - kl_term - entropy_term,
                kl_term,
                entropy_term,
                threshold,
                torch.ones((), device=n.device),
            ]
        )
        self.sums = row if self.sums is None else self.sums + row

    def kl_to_old(self, world: dist.DistInfo, device: torch.device) -> float:
        s = dist.all_reduce_sum(self.sums.tolist(), device)  # host-device sync
        return s[4] / max(s[5], 1.0)

    def global_totals(
        self, world, device, raw_rewards, rollout, reward_meta, skipped_tokens: int = 0
    ) -> dict[str, float]:
        s = self.sums.tolist() if self.sums is not None else [0.0] * self.WIDTH  # host-device sync
        r = raw_rewards.double()
        truncated = sum(f == "length" for f in rollout.finish_reason)
        acc = reward_meta.get("answer_reward_mean", float((raw_rewards == 1).float().mean().item()))
        fmt = reward_meta.get("format_reward_mean", float("nan"))
        n = len(raw_rewards)
        local = [
            *s,
            r.sum().item(),
            (r * r).sum().item(),
            acc * n,
            fmt * n,
            truncated,
            n,
            reward_meta["zero_variance_groups"],
            reward_meta["num_groups"],
            skipped_tokens,
        ]
        g = dist.all_reduce_sum(local, device)
        (
            loss,
            ent,
            clipped,
            kl,
            kl_old,
            tokens,
            gap,
            clip_low,
            clip_high,
            loss_pg,
            loss_kl,
            loss_entropy,
            threshold_sum,
            microbatches,
            rsum,
            rsq,
            accn,
            fmtn,
            trunc,
            nseq,
            zv,
            ngroups,
            skipped,
        ) = g
        skipped_fraction = skipped / max(tokens + skipped, 1.0)  # tokens: the trained ones
        tokens = max(tokens, 1.0)
        mean = rsum / nseq
        var = max(rsq / nseq - mean * mean, 0.0) * nseq / max(nseq - 1, 1)  # unbiased, as torch.std
        return {
            "loss": loss,
            "entropy": ent / tokens,
            "clip_fraction": clipped / tokens,
            "clip_fraction_low": clip_low / tokens,
            "clip_fraction_high": clip_high / tokens,
            "loss_pg": loss_pg,
            "loss_kl": loss_kl,
            "loss_entropy": loss_entropy,
            "entropy_threshold": threshold_sum / max(microbatches, 1.0),
            # KL to the reference policy when there is one, else to π_old (0 when on-policy)
            "kl": (kl if self.has_ref else kl_old) / tokens,
            "reward_mean": mean,
            "reward_std": math.sqrt(var),
            "accuracy": accn / nseq,
            "format_rate": fmtn / nseq,
            "truncated": trunc / nseq,
            "zero_variance": zv / max(ngroups, 1),
            "sampler_gap": gap / tokens if rollout.sampler_logprobs is not None else None,
            "skipped": skipped_fraction,
        }


def _sequences_with_gradient(cfg: Config, seqs: list[Sequence], beta: float) -> list[Sequence]:
    """The sequences the optimization phase must run (``train.skip_zero_advantage``).

    With β = 0, no entropy bonus and no entropy quantile (``loss.top_entropy_quantile=1``: the
    quantile would be taken over fewer tokens), every term of a token's loss is a multiple of its advantage,
    so a response whose advantage is exactly 0 (every response of a group whose rewards are all
    equal, under every loss type) has a gradient of exactly 0: its forward and backward are
    skipped. The loss weights were normalized over the whole batch before, so the update is the
    same to fp32 summation order (tests/test_train_optimization.py). If nothing is left, the
    shortest response is kept: every parameter still gets a (zero) gradient, so the optimizer
    steps as it would have, and every rank joins the DDP all-reduce. Token metrics
    (``train/entropy_mean``, ``clip_fraction``, ``rollout/logprob_abs_diff``) are then over the
    trained tokens; ``train/skipped_fraction`` says how many were skipped.
    """
    lo = cfg.loss
    # the entropy quantile is taken over every weighted token, zero-advantage ones included
    exact = beta == 0 and lo.entropy_coef == 0 and lo.top_entropy_quantile >= 1
    if not (cfg.train.skip_zero_advantage and exact):
        return seqs
    kept = [s for s in seqs if s.advantage != 0.0]
    return kept or sorted(seqs, key=lambda s: s.n_response)[:1]


def _prepare_old_and_ref(cfg, mbs, policy_loss, ref_loss, temperature) -> dict[str, float]:
    """π_old, π_ref and the sampler-mismatch weights of each microbatch, before the first epoch.

    π_old and π_ref come from no-grad passes of the same fused module the loss uses
    (``policy_loss``: ``PolicyLoss``, not its DDP wrapper), so the first epoch's ratio
    exp(log π − log π_old) is exactly 1 on every token. With ``rollout.old_logprobs=sampler``,
    π_old is the engine's log-probs instead (one forward pass saved per rollout batch). On-policy
    with one epoch and no correction (the default) nothing runs here: π_old is π itself.
    """
    r = cfg.rollout
    several_epochs = cfg.train.epochs_per_rollout_batch > 1
    trainer_old = r.is_correction or (several_epochs and r.old_logprobs == "trainer")
    weights = []
    for mb in mbs:
        if several_epochs and r.old_logprobs == "sampler":
            mb.old_logprobs = mb.sampler_logprobs
        elif trainer_old:
            with torch.no_grad():
                mb.old_logprobs = policy_loss(mb, 0.0, temperature).logprobs
        if r.is_correction:
            rho = sampler_importance_weights(
                mb.old_logprobs,
                mb.sampler_logprobs,
                mb.sequence_ids,
                level=r.is_level,
                mode=r.is_mode,
                cap=r.is_cap,
            )
            mb.loss_weights = mb.loss_weights * rho
            weights.append(rho)
        if ref_loss is not None:
            with torch.no_grad():
                mb.ref_logprobs = ref_loss(mb, 0.0, temperature).logprobs
    if not weights:
        return {}
    rho = torch.cat(weights)
    cut = (rho == r.is_cap) if r.is_mode == "truncate" else (rho == 0)
    return {  # host-device syncs, once per step
        "rollout/is_weight_mean": rho.mean().item(),
        "rollout/is_cut_fraction": cut.float().mean().item(),
    }


def _make_backend(cfg, model, tokenizer, task, policy_loss, device, amp, out, world, engine, sft_steps):
    """The rollout backend; for vllm, the folder the engine starts from and the weight-sync probe.

    vLLM loads a Hugging Face folder: ``model.name_or_path`` itself, unless the policy exists only
    here (the built-in model, or a warm start just ran), in which case it is written to
    ``output_dir/rollout_init`` first. Either way the current policy is pushed before the first
    rollout, and probed after every push.
    """
    if cfg.rollout.backend != "vllm":
        return make_backend(cfg, model, tokenizer, device, amp)
    model_path = None
    if engine is None and (cfg.model.name_or_path.startswith("builtin:") or sft_steps > 0):
        model_path = out / "rollout_init"
        if world.is_main:
            ckpt.save_pretrained_atomic(model, tokenizer, model_path, dtype=vllm_dtype(model, amp))
        dist.barrier()
        model_path = str(model_path)
    # The probe: a fixed, real sequence of this task (the first eval problem and its answer).
    ex = (task.eval or task.train)[0]
    probe_ids = task.prompt_ids(ex) + tokenizer(ex.answer, add_special_tokens=False)["input_ids"]

    def trainer_logprobs(token_ids: list[int]) -> torch.Tensor:
        seq = Sequence(tokens=list(token_ids), n_prompt=1, advantage=0.0, weight=0.0)
        mb = make_microbatches([seq], 1, tokenizer.pad_token_id, packing=False)[0].to(device)
        with torch.no_grad():
            return policy_loss(mb, 0.0, 1.0).logprobs  # the fused op, as the loss computes them

    probe = WeightSyncProbe(probe_ids, trainer_logprobs, weight_sync_tolerance(cfg, model, amp))
    return make_backend(cfg, model, tokenizer, device, amp, engine=engine, model_path=model_path, probe=probe)


def _reward_errors(cfg: Config, reward_fn, device: torch.device) -> dict[str, float]:
    """``train/reward_errors``: responses scored 0 because the reward function failed, over all
    ranks (with ``data.reward_errors=zero`` only: otherwise the first failure stopped the run)."""
    if cfg.data.reward_errors != "zero":
        return {}
    return {"train/reward_errors": dist.all_reduce_sum([reward_fn.errors], device)[0]}  # host-device sync


def _rollout_metrics(backend, totals: dict) -> dict[str, float]:
    """Sampler-side health: the weight-sync probe of the latest push, and the trainer-vs-sampler
    gap on the sampled tokens (both only when the backend provides them)."""
    row = {}
    if getattr(backend, "weight_sync_abs_diff", None) is not None:
        row["rollout/weight_sync_abs_diff"] = backend.weight_sync_abs_diff
    if totals.get("sampler_gap") is not None:
        row["rollout/logprob_abs_diff"] = totals["sampler_gap"]
    return row


def _sample_records(task, examples, rollout, cfg) -> list[dict]:
    g = cfg.rollout.group_size
    recs = []
    for i, text in enumerate(rollout.response_text[: cfg.logging.samples_per_dump]):
        ex = examples[i // g]
        recs.append(
            {
                "prompt": task.prompt_text(ex),
                "response": text,
                "ground_truth": ex.answer,
                **task.reward_fn(text, ex.answer),
                "length": len(rollout.response_ids[i]),
                "finish_reason": rollout.finish_reason[i],
            }
        )
    return recs


def _dump_samples(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")


def _save_checkpoint(
    cfg, root, step, model, ref_model, tokenizer, optimizer, scheduler, sampler, health, kl_ctl, state, world
) -> None:
    rngs = dist.all_gather_objects(ckpt.rng_state())  # every rank's RNG, for an exact resume
    if world.is_main:
        extra = {
            "train_state": {"step": state.step, "beta": state.beta},
            "optimizer": optimizer.state_dict(),
            "scheduler": scheduler.state_dict(),
            "sampler": sampler.state_dict(),
            "health": health.state_dict(),
            "rng": rngs,
            "world_size": world.world_size,
        }
        if kl_ctl is not None:
            extra["kl_controller"] = kl_ctl.state_dict()
        if ref_model is not None:
            extra["ref_model"] = ref_model.state_dict()
        ckpt.save_checkpoint(root, step, model, tokenizer, extra, keep=cfg.keep_checkpoints)
    dist.barrier()


if __name__ == "__main__":
    sys.exit(main())
