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
``rollout.is_correction=true`` (truncated importance sampling, ``grpo_fast.algo.sampler_correction``).

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
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from grpo_fast import dist
from grpo_fast.algo.core import (
    AdaptiveKLController,
    entropy_threshold,
    informative_groups,
    kl_early_stop,
    kl_penalty,
    normalize_group_rewards,
    overlong_penalty,
    sequence_mean,
)
from grpo_fast.algo.difficulty import PassRateTable
from grpo_fast.algo.sampler_correction import sampler_importance_weights
from grpo_fast.config import Config, load_config, to_yaml
from grpo_fast.errors import ConfigError, Preempted, TrainingStopped, cli_errors
from grpo_fast.loop import preempt
from grpo_fast.loop.optim import PromptSampler, build_optimizer, build_scheduler
from grpo_fast.loop.sft import sft_warm_start
from grpo_fast.obs.health import HealthMonitor, HealthThresholds
from grpo_fast.obs.metrics import MetricsLogger, PhaseProgress, gpu_stats, peak_memory_gb, reset_peak_memory
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.policy.batch import Sequence, build_sequences, make_microbatches
from grpo_fast.policy.model import (
    PolicyLoss,
    autocast_dtype,
    build_policy_loss,
    load_policy,
    load_tokenizer,
    quiet_transformers,
    resolve_device,
)
from grpo_fast.rollout import (
    Rollout,
    SamplingParams,
    generate_groups,
    make_backend,
    vllm_dtype,
    weight_sync_tolerance,
)
from grpo_fast.rollout.vllm import WeightSyncProbe, step_seed
from grpo_fast.task.loader import Task, load_task
from grpo_fast.tools import plan
from grpo_fast.tools.evaluate import evaluate


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


@dataclass
class Trainer:
    """What the optimization phase works with: the loss module (``PolicyLoss``, DDP-wrapped when
    data parallel), the optimizer and its trainable parameters, and where it runs."""

    policy: torch.nn.Module
    optimizer: torch.optim.Optimizer
    params: list[torch.nn.Parameter]
    cfg: Config
    world: dist.DistInfo = field(default_factory=dist.DistInfo)
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    # sft.mix_coef > 0: the plain NLL module on the same model (the supervised microbatches)
    sft_loss: torch.nn.Module | None = None


@dataclass
class Run:
    """One training run from setup to the final model: what it loaded and built (fixed after
    ``setup``) and what changes from step to step (``state``, the sampler, the controllers)."""

    cfg: Config
    device: torch.device
    world: dist.DistInfo
    out: Path
    logger: MetricsLogger
    task: Task
    tokenizer: object
    model: torch.nn.Module
    amp: torch.dtype | None
    trainer: Trainer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    policy_loss: torch.nn.Module  # PolicyLoss itself (no DDP): the no-grad passes and the probe
    ref_model: torch.nn.Module | None
    ref_loss: torch.nn.Module | None
    backend: object
    sampler: PromptSampler
    health: HealthMonitor
    kl_ctl: AdaptiveKLController | None
    state: TrainState
    eval_subset: list
    pass_rates: PassRateTable | None = None  # per-prompt pass rates, when an option uses them
    sft_steps: int = 0
    local_prompts: int = 0  # prompts per step on this rank
    nonfinite_run: int = 0  # consecutive steps not applied (train.max_nonfinite_steps stops the run)

    @property
    def ckpt_root(self) -> Path:
        return self.out / "checkpoints"

    def save_checkpoint(self, step: int) -> None:
        """Everything an exact resume needs, written atomically by rank 0 (every rank's RNG)."""
        rngs = dist.all_gather_objects(ckpt.rng_state())
        if self.world.is_main:
            extra = {
                "train_state": {"step": self.state.step, "beta": self.state.beta},
                "optimizer": self.trainer.optimizer.state_dict(),
                "scheduler": self.scheduler.state_dict(),
                "sampler": self.sampler.state_dict(),
                "health": self.health.state_dict(),
                "rng": rngs,
                "world_size": self.world.world_size,
            }
            if self.kl_ctl is not None:
                extra["kl_controller"] = self.kl_ctl.state_dict()
            if self.pass_rates is not None:
                extra["pass_rates"] = self.pass_rates.state_dict()
            if self.ref_model is not None:
                extra["ref_model"] = self.ref_model.state_dict()
            ckpt.save_checkpoint(
                self.ckpt_root, step, self.model, self.tokenizer, extra, keep=self.cfg.keep_checkpoints
            )
        dist.barrier()

    def restore(self, path: Path) -> None:
        saved = ckpt.load_state(path)
        if saved["world_size"] != self.world.world_size:
            raise ConfigError(
                f"resume=true: {path} was written by {saved['world_size']} rank(s); "
                f"resume with the same number of ranks (now {self.world.world_size})"
            )
        ckpt.load_model_weights(self.model, path)
        if self.ref_model is not None:
            self.ref_model.load_state_dict(saved["ref_model"])
        self.trainer.optimizer.load_state_dict(saved["optimizer"])
        self.scheduler.load_state_dict(saved["scheduler"])
        self.sampler.load_state_dict(saved["sampler"])
        self.health.load_state_dict(saved["health"])
        if self.kl_ctl is not None:
            self.kl_ctl.load_state_dict(saved["kl_controller"])
        if self.pass_rates is not None and "pass_rates" in saved:
            self.pass_rates.load_state_dict(saved["pass_rates"])
        self.state = TrainState(**saved["train_state"])
        ckpt.set_rng_state(saved["rng"][self.world.rank])

    def evaluate(self, step: int, full: bool, progress: PhaseProgress | None = None) -> dict[str, float]:
        """Greedy accuracy on the eval subset (``full``: the whole eval set), split over ranks."""
        examples = self.task.eval if full else self.eval_subset
        if progress is not None:
            progress.phase("eval", len(examples[self.world.rank :: self.world.world_size]))
        advance = progress.advance_phase if progress is not None else None
        metrics, records = evaluate(
            self.backend, self.task, examples, self.cfg, self.device, world=self.world, progress=advance
        )
        if self.world.is_main:
            n = self.cfg.logging.samples_per_dump
            _dump_samples(self.out / "samples" / f"eval_step_{step}.jsonl", records[:n])
        prefix = "eval_full/" if full else "eval/"
        return {prefix + k: v for k, v in metrics.items()}


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
class OptimizationResult:
    """The optimization phase's result: the first epoch's statistics and the step's counts."""

    stats: _Stats
    counts: dict[str, float]  # global: trained/all sequences and tokens
    skipped_tokens: int
    extra: dict[str, float]  # sampler-correction metrics
    lr: float
    seconds: float = 0.0


def _train(cfg: Config, device: torch.device, world: dist.DistInfo, out: Path, engine) -> Path:
    """Setup, then per step: rollout phase → optimization phase → metrics, eval, checkpoint."""
    t_start = time.perf_counter()
    run = setup(cfg, device, world, out, engine)
    cfg = run.cfg  # with the planner's "auto" values resolved
    with PhaseProgress(cfg.logging.progress and world.is_main, cfg.steps, run.state.step) as progress:
        for step in range(run.state.step + 1, cfg.steps + 1):
            t0 = time.perf_counter()
            reset_peak_memory(device)
            batch = rollout_phase(run, step, progress)
            result = optimization_phase(run, step, batch, progress)
            row = step_metrics(run, step, batch, result, time.perf_counter() - t0)
            end_of_step(run, step, batch, result, row, progress)
    finish(run, t_start)
    return out


# ---------------------------------------------------------------- setup


def setup(cfg: Config, device: torch.device, world: dist.DistInfo, out: Path, engine) -> Run:
    """Data, tokenizer, policy, memory plan, optional SFT warm start, KL reference, optimizer,
    resume, rollout backend; then the step-0 evaluation."""
    # Every rank starts from the same seed (same init, same prompts); each rank's rollout
    # sampling gets its own seed (sampling_rng).
    seed_everything(cfg.seed)
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logger = MetricsLogger(cfg, out, enabled=world.is_main)

    task: Task = load_task(cfg)  # the data first: a bad file fails in seconds, before any model loads
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    task.tokenizer = tokenizer
    model = load_policy(cfg, tokenizer, device)
    amp = autocast_dtype(cfg, device)
    cfg = plan.resolve_auto(cfg, model.config, device, world.world_size)
    if world.is_main:
        (out / "config.yaml").write_text(to_yaml(cfg))
    n_prompts = cfg.rollout.batch_size // cfg.rollout.group_size
    if n_prompts % world.world_size:
        raise ConfigError(
            f"rollout.batch_size / rollout.group_size = {n_prompts} prompts per step do not split "
            f"evenly over {world.world_size} ranks"
        )
    kl_ctl = AdaptiveKLController(cfg.loss.beta, cfg.loss.target_kl) if cfg.loss.target_kl else None
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
    policy_loss = build_policy_loss(cfg, model, amp)
    policy = policy_loss
    if world.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy = DDP(policy_loss, device_ids=[device.index] if device.type == "cuda" else None)
    pass_rates, sampler = _prompt_sampler(cfg, task)
    sft_loss = None
    if cfg.sft.mix_coef > 0:  # the GRPO loss options off: advantage 1, on-policy = plain NLL
        sft_loss = PolicyLoss(model, autocast=amp, loss_options={"backend": cfg.loss.kernel_backend})
    trainer = Trainer(
        policy, optimizer, [p for p in model.parameters() if p.requires_grad], cfg, world, device, sft_loss
    )
    run = Run(
        cfg=cfg,
        device=device,
        world=world,
        out=out,
        logger=logger,
        task=task,
        tokenizer=tokenizer,
        model=model,
        amp=amp,
        trainer=trainer,
        scheduler=build_scheduler(cfg, optimizer),
        policy_loss=policy_loss,
        ref_model=ref_model,
        ref_loss=build_policy_loss(cfg, ref_model, amp) if ref_model is not None else None,
        backend=None,
        sampler=sampler,
        health=HealthMonitor(
            HealthThresholds(
                **{**cfg.health.thresholds, "auto_temperature_boost": cfg.health.auto_temperature}
            )
        ),
        kl_ctl=kl_ctl,
        state=TrainState(beta=cfg.loss.beta),
        eval_subset=task.eval_subset(cfg.data.eval_subset_size, cfg.seed),
        sft_steps=sft_steps,
        local_prompts=n_prompts // world.world_size,
        pass_rates=pass_rates,
    )
    if resume_from is not None:
        run.restore(resume_from)
        logger.truncate_after(run.state.step)
        logger.event(f"resumed from {resume_from} at step {run.state.step}")
    run.backend = _make_backend(run, engine)

    if run.state.step == 0 and cfg.eval_every and run.eval_subset:
        row = run.evaluate(0, full=False)
        logger.log(0, {**row, "sft/steps": sft_steps, "world_size": world.world_size})
        logger.event(f"step 0 (before GRPO): eval/accuracy {row['eval/accuracy']:.3f}")
    return run


def _prompt_sampler(cfg: Config, task: Task) -> tuple[PassRateTable | None, PromptSampler]:
    """The prompt sampler and, when an option needs one, the per-prompt pass-rate table
    (``rollout.difficulty_filter``, ``rollout.adaptive_group_size``, ``rollout.curriculum``
    without ``data.difficulty_field``); both are checkpointed."""
    r = cfg.rollout
    difficulty = None
    if cfg.data.difficulty_field is not None:
        difficulty = [ex.difficulty for ex in task.train]
    by_rate = r.curriculum == "easy_first" and difficulty is None
    table = None
    if r.difficulty_filter is not None or r.adaptive_group_size or by_rate:
        table = PassRateTable(len(task.train))
    band = None if r.difficulty_filter is None else list(r.difficulty_filter)
    sampler = PromptSampler(
        len(task.train),
        cfg.seed,
        table=table,
        difficulty_filter=band,
        curriculum=r.curriculum,
        difficulty=difficulty if r.curriculum == "easy_first" else None,
    )
    return table, sampler


# ---------------------------------------------------------------- rollout phase


def rollout_phase(run: Run, step: int, progress: PhaseProgress) -> RolloutBatch:
    """This rank's prompts → G responses each → rewards → group-normalized advantages.

    With ``rollout.dynamic_sampling`` (DAPO) the groups whose task rewards are all equal are
    dropped and more prompts are drawn, for at most ``rollout.max_sampling_rounds`` rounds, until
    every rank has its share of ``rollout.batch_size`` responses from informative groups (the
    reward shaping terms, overlong and KL, do not count: they would make every group look
    informative). With ``rollout.adaptive_group_size`` each prompt's group size comes from its
    pass rate. The shaping terms are added to the kept responses' rewards, then the advantages
    are normalized over the kept groups.
    """
    t0 = time.perf_counter()
    cfg, r = run.cfg, run.cfg.rollout
    temperature = r.temperature + run.health.shared_temperature_boost(step)  # rank 0's, on every rank
    reward_fn = run.task.reward_fn.for_batch(step)  # numbers the responses, counts reward errors
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
    groups = _Groups.concat(kept)
    sampling_meta = {}
    if r.dynamic_sampling:
        g_have, g_target, g_gen, g_drop = dist.all_reduce_sum(
            [float(have), float(target), float(generated_groups), float(dropped_groups)], run.device
        )
        sampling_meta = {
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

    if run.pass_rates is not None:
        table = run.pass_rates.summary()
        sampling_meta["rollout/prompts_seen_fraction"] = table["seen_fraction"]
        sampling_meta["rollout/pass_rate_mean"] = table["pass_rate_mean"]
    if r.difficulty_filter is not None:  # prompts the current pass over the data leaves out
        sampling_meta["rollout/filtered_prompts"] = float(run.sampler.skipped)
    rollout = groups.rollout
    rewards = groups.rewards
    if r.adaptive_group_size:
        sizes = dist.all_gather_objects(rollout.sizes)
        sampling_meta["rollout/group_size_min"] = float(min(min(x) for x in sizes))
        sampling_meta["rollout/group_size_max"] = float(max(max(x) for x in sizes))
    if cfg.data.overlong_buffer > 0:  # DAPO's soft overlong punishment
        penalty = overlong_penalty(
            [len(x) for x in rollout.response_ids],
            r.max_tokens,
            cfg.data.overlong_buffer,
            cfg.data.overlong_penalty,
        )
        sampling_meta["rollout/overlong_penalty_mean"] = penalty.mean().item()
        rewards = rewards + penalty
    kl_tokens = None
    if cfg.loss.kl_in_reward:  # β·Σ k1 of each response leaves its reward (verl's use_kl_in_reward)
        kl_sums, kl_tokens = _response_kl_k1(run, rollout, temperature)
        rewards = rewards - run.state.beta * kl_sums
    advantages, norm_meta = normalize_group_rewards(
        rewards,
        rollout.sizes,
        cfg.loss.advantage_eps,
        scale_rewards=cfg.loss.scale_rewards,
        reduce_sums=lambda sums: dist.all_reduce_sum(sums, run.device),  # batch: std over all ranks
    )
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
        extra=sampling_meta,
        seconds=time.perf_counter() - t0,
    )


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


def _generate_round(
    run: Run, step: int, round_: int, temperature: float, reward_fn, progress: PhaseProgress
) -> _Groups:
    """One round of the rollout phase on this rank: draw prompts, generate their groups, score
    them; the pass-rate table (when one is kept) sees every scored group."""
    cfg, world, r = run.cfg, run.world, run.cfg.rollout
    n = run.local_prompts
    idx = run.sampler.next(n * world.world_size)[world.rank * n : (world.rank + 1) * n]
    examples = [run.task.train[i] for i in idx]
    prompt_ids = [run.task.prompt_ids(e) for e in examples]
    sizes = [r.group_size] * len(idx)
    if r.adaptive_group_size:  # by pass rate, this rank's total kept: n·G responses
        sizes = run.pass_rates.group_sizes(
            idx, r.group_size, r.min_group_size, r.max_group_size, n * r.group_size
        )
    params = SamplingParams(
        n=r.group_size,
        temperature=temperature,
        top_p=r.top_p,
        max_tokens=r.max_tokens,
        min_tokens=r.min_tokens,
        stop=tuple(run.task.stop),
        seed=step_seed(cfg.seed, step, world.rank, round=round_),  # the same samples after a resume
    )
    progress.phase("rollout" if round_ == 0 else f"rollout {round_ + 1}", len(prompt_ids))
    with sampling_rng(params.seed if world.enabled else None, run.device):
        rollout = generate_groups(run.backend, prompt_ids, sizes, params, progress=progress.advance_phase)
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


def _response_kl_k1(
    run: Run, rollout: Rollout, temperature: float
) -> tuple[torch.Tensor, tuple[float, float]]:
    """``loss.kl_in_reward``: each response's Σ_t k1_t = Σ_t (log π − log π_ref) of its sampled
    tokens, ``[R]`` fp32 on the CPU, from no-grad passes of the fused op (the policy's and the
    reference's); and (Σ k1, tokens) over this rank, for the metrics. Each scoring sequence
    carries its response's index in the advantage slot (these passes compute no loss), so the
    sums land on the right response whatever the microbatch order or packing."""
    cfg = run.cfg
    seqs = [
        Sequence(list(p) + list(resp), len(p), advantage=float(i), weight=0.0)
        for i, (p, resp) in enumerate(zip(rollout.response_prompt_ids(), rollout.response_ids))
        if resp
    ]
    sums = torch.zeros(len(rollout.response_ids), dtype=torch.float64, device=run.device)
    mbs = make_microbatches(
        seqs, int(cfg.train.micro_batch_size), run.tokenizer.pad_token_id, cfg.train.packing
    )
    with torch.no_grad():
        for mb in mbs:
            mb = mb.to(run.device)
            k1 = run.policy_loss(mb, 0.0, temperature).logprobs - run.ref_loss(mb, 0.0, temperature).logprobs
            sums.index_add_(0, mb.advantages.long(), k1.double())
    sums = sums.float().cpu()  # host-device sync, once per step
    return sums, (sums.sum().item(), float(sum(s.n_response for s in seqs)))


# ---------------------------------------------------------------- optimization phase


def optimization_phase(
    run: Run, step: int, batch: RolloutBatch, progress: PhaseProgress
) -> OptimizationResult:
    """Sequences → microbatches → π_old/π_ref → the epochs of optimizer steps → LR step → weight
    push to the rollout engine."""
    t0 = time.perf_counter()
    cfg, rollout = run.cfg, batch.rollout
    # loss.mask_truncated: responses that hit max_tokens leave the loss and its normalizers
    keep = [not (cfg.loss.mask_truncated and f == "length") for f in rollout.finish_reason]
    lengths = [len(x) for x, k in zip(rollout.response_ids, keep) if k]
    # one collective for the global counts (token_mean needs Σ tokens over all ranks)
    g_seqs, g_tokens, g_all_seqs, g_all_tokens = dist.all_reduce_sum(
        [len(lengths), sum(lengths), len(keep), rollout.num_response_tokens], run.device
    )
    seqs = build_sequences(
        rollout.prompt_ids,
        rollout.response_ids,
        batch.advantages,
        length_norm=cfg.loss.length_norm,
        max_length=cfg.rollout.max_tokens,
        num_sequences=int(g_seqs),
        num_tokens=g_tokens,
        sampler_logprobs=rollout.sampler_logprobs,
        keep=keep,
    )
    if not seqs:  # all left out (loss.mask_truncated): one zero-weight response keeps the step's shape
        i = next(i for i, x in enumerate(rollout.response_ids) if x)
        p = rollout.prompt_ids[i // rollout.group_size]
        seqs = [Sequence(list(p) + list(rollout.response_ids[i]), len(p), 0.0, 0.0)]
    beta = 0.0 if cfg.loss.kl_in_reward else run.state.beta  # kl_in_reward: the KL is in the rewards
    trained = _sequences_with_gradient(cfg, seqs, beta)
    skipped_tokens = sum(s.n_response for s in seqs) - sum(s.n_response for s in trained)
    mbs = [
        mb.to(run.device)
        for mb in make_microbatches(
            trained, int(cfg.train.micro_batch_size), run.tokenizer.pad_token_id, cfg.train.packing
        )
    ]
    ref_loss = None if cfg.loss.kl_in_reward else run.ref_loss
    extra = _prepare_old_and_ref(cfg, mbs, run.policy_loss, ref_loss, batch.temperature)
    sft_mbs = _sft_microbatches(run, batch.examples) if cfg.sft.mix_coef > 0 else []
    progress.phase("train", cfg.train.epochs_per_rollout_batch * (len(mbs) + len(sft_mbs)))
    stats = optimize_on_rollout(
        run.trainer,
        mbs,
        sft_mbs=sft_mbs,
        beta=beta,
        temperature=batch.temperature,
        logger=run.logger,
        step=step,
        on_microbatch=progress.advance_phase,
    )
    lr = run.scheduler.get_last_lr()[0]
    run.scheduler.step()
    run.backend.update_weights(run.model, step=step)  # vllm: push + weight-sync probe (may stop the run)
    counts = {"seqs": g_seqs, "tokens": g_tokens, "all_seqs": g_all_seqs, "all_tokens": g_all_tokens}
    return OptimizationResult(stats, counts, skipped_tokens, extra, lr, seconds=time.perf_counter() - t0)


def _sft_microbatches(run: Run, examples: list) -> list:
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
    (total,) = dist.all_reduce_sum([float(sum(len(s) for _, s in pairs))], run.device)
    w = cfg.sft.mix_coef / max(total, 1.0)
    seqs = [Sequence(list(p) + list(s), len(p), advantage=1.0, weight=w) for p, s in pairs]
    mb_size = int(cfg.train.micro_batch_size)
    return [mb.to(run.device) for mb in make_microbatches(seqs, mb_size, tok.pad_token_id, cfg.train.packing)]


def _step_cast_cache(trainer: Trainer):
    """``PolicyLoss.step_cast_cache`` of the trainer's loss module (DDP: the wrapped module)."""
    return getattr(trainer.policy, "module", trainer.policy).step_cast_cache(trainer.device)


def _accumulate_gradients(
    trainer: Trainer, mbs, sft_mbs, epoch_stats, beta, temperature, on_microbatch
) -> None:
    """Forward and backward of every microbatch of one optimizer step (the supervised ones
    first); under DDP the gradients are all-reduced once, on the last microbatch."""
    cfg, world, lo = trainer.cfg, trainer.world, trainer.cfg.loss
    for mb in sft_mbs:
        sync = trainer.policy.no_sync() if world.enabled else contextlib.nullcontext()
        with sync:
            out_mb = trainer.sft_loss(mb, 0.0, 1.0)
            (out_mb.loss * world.world_size).backward()
        epoch_stats.add_sft(out_mb, mb, cfg.sft.mix_coef)
        if on_microbatch is not None:
            on_microbatch(1)
    for i, mb in enumerate(mbs):
        last = i == len(mbs) - 1
        sync = trainer.policy.no_sync() if world.enabled and not last else contextlib.nullcontext()
        with sync:
            out_mb = trainer.policy(mb, beta, temperature)
            # DDP averages gradients over ranks; the weights already hold global
            # normalizers, so scale by the world size to recover the sum.
            (out_mb.loss * world.world_size).backward()
        epoch_stats.add(
            out_mb, mb, beta, lo.entropy_coef, lo.importance_sampling_level, lo.top_entropy_quantile
        )
        if on_microbatch is not None:
            on_microbatch(1)


def optimize_on_rollout(
    trainer: Trainer,
    mbs: list,
    *,
    sft_mbs: list = (),
    beta: float,
    temperature: float,
    logger: MetricsLogger | None = None,
    step: int = 0,
    on_microbatch=None,
) -> _Stats:
    """The optimization phase on one rollout batch: ``train.epochs_per_rollout_batch`` passes,
    each one optimizer step over all microbatches (gradients accumulated; under DDP synced once,
    on the last microbatch), stopping early once KL(π_old ‖ π) exceeds ``loss.kl_early_stop``.

    ``sft_mbs`` (``sft.mix_coef``): supervised microbatches, run first in every epoch through
    ``trainer.sft_loss`` (temperature 1, no KL): their gradient adds ``mix_coef`` × ∇NLL to the
    GRPO gradient. Under DDP they run before the synced microbatch, which all-reduces the
    gradients accumulated so far, theirs included.

    The gradients are freed (set to None) after every optimizer step, so none are allocated
    while the next rollout runs. Returns the first epoch's token-level statistics (what the
    step's metrics report).
    """
    cfg, world, device, optimizer = trainer.cfg, trainer.world, trainer.device, trainer.optimizer
    lo = cfg.loss
    epochs = cfg.train.epochs_per_rollout_batch
    stats = _Stats()
    for epoch in range(epochs):
        optimizer.zero_grad(set_to_none=True)  # no-op unless the SFT warm start left gradients
        epoch_stats = _Stats()
        with _step_cast_cache(trainer):  # under autocast: each weight cast once per step
            _accumulate_gradients(trainer, mbs, sft_mbs, epoch_stats, beta, temperature, on_microbatch)
        grad_norm = torch.nn.utils.clip_grad_norm_(trainer.params, cfg.train.grad_clip or float("inf"))
        # host-device sync, once per optimizer step: a NaN/inf loss or gradient norm must not
        # reach the weights (nor AdamW's moments), so it is checked before the step.
        loss_v, norm_v = torch.stack([epoch_stats.sums["loss"], grad_norm.float()]).tolist()
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
            if kl_early_stop(approx_kl, lo.kl_early_stop):
                if logger is not None:
                    logger.event(
                        f"step {step}: KL(π_old ‖ π) {approx_kl:.3f} > loss.kl_early_stop={lo.kl_early_stop}, "
                        f"stopping after epoch {epoch + 1}"
                    )
                break
    return stats


# ---------------------------------------------------------------- metrics, eval, checkpoint


def step_metrics(
    run: Run, step: int, batch: RolloutBatch, result: OptimizationResult, step_s: float
) -> dict[str, float]:
    """The step's metrics row (one all-reduce for the token-level sums across ranks); updates
    the adaptive β and the step counter."""
    cfg, world, device = run.cfg, run.world, run.device
    totals = result.stats.global_totals(
        world, device, batch.raw_rewards, batch.rollout, batch.reward_meta, result.skipped_tokens
    )
    if run.kl_ctl is not None:  # adapts β to the KL it penalizes (in the loss, or in the rewards)
        run.state.beta = run.kl_ctl.update(totals["kl"], int(result.counts["seqs"]))
    run.state.step = step
    c = result.counts
    prompt_tokens = sum(map(len, batch.rollout.prompt_ids)) * batch.rollout.group_size * world.world_size
    return {
        "train/loss": totals["loss"],
        "train/reward_mean": totals["reward_mean"],
        "train/reward_std": totals["reward_std"],
        "train/accuracy": totals["accuracy"],
        "train/format_rate": totals["format_rate"],
        "train/entropy_mean": totals["entropy"],
        "train/response_length_mean": c["all_tokens"] / max(c["all_seqs"], 1),
        "train/truncated_fraction": totals["truncated"],
        "train/zero_variance_fraction": totals["zero_variance"],
        "train/skipped_fraction": totals["skipped"],
        **_reward_errors(cfg, batch.reward_fn, device),
        "train/grad_norm": result.stats.grad_norm,
        "train/clip_fraction": totals["clip_fraction"],
        "train/clip_fraction_low": totals["clip_fraction_low"],  # clipped with r < 1
        "train/clip_fraction_high": totals["clip_fraction_high"],  # clipped with r > 1
        "train/loss_pg": totals["loss_pg"],  # train/loss = loss_pg + loss_kl + loss_entropy
        "train/loss_kl": totals["loss_kl"],
        "train/loss_entropy": totals["loss_entropy"],
        # the top_entropy_quantile threshold, mean over microbatches (0 when off)
        "train/entropy_threshold": totals["entropy_threshold"],
        "train/kl": totals["kl"],
        "train/beta": run.state.beta,
        "train/lr": result.lr,
        "train/temperature": batch.temperature,
        "time/rollout_s": batch.seconds,
        "time/train_s": result.seconds,
        "time/step_s": step_s,
        "memory/peak_gb": peak_memory_gb(device),
        "throughput/tokens_per_s": (c["all_tokens"] + prompt_tokens) / step_s,
        "world_size": world.world_size,
        **totals["reward_parts"],
        **totals["sft"],  # sft.mix_coef: the supervised term's per-token NLL (not in train/loss)
        **_rollout_metrics(run.backend, totals),
        **batch.extra,
        **result.extra,
        **gpu_stats(device),
    }


def end_of_step(
    run: Run, step: int, batch: RolloutBatch, result: OptimizationResult, row: dict, progress: PhaseProgress
) -> None:
    """Health checks, evaluation, samples and the metrics line; then the stops (non-finite
    steps in a row, a pending SIGTERM/SIGINT) and the periodic checkpoint."""
    cfg, out = run.cfg, run.out
    if cfg.health.enabled:
        for ev in run.health.update(step, row, batch.rollout.response_text):
            row[f"health/{ev.kind}"] = ev.value
            run.logger.event(f"[health] step {step} {ev.severity}: {ev.message} — {ev.suggestion}")
            if run.world.is_main:
                with open(out / "health.jsonl", "a") as fh:
                    fh.write(json.dumps(ev.to_dict()) + "\n")
    if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps) and run.eval_subset:
        row.update(run.evaluate(step, full=False, progress=progress))
    if cfg.full_eval_every and (step % cfg.full_eval_every == 0 or step == cfg.steps):
        row.update(run.evaluate(step, full=True, progress=progress))
    if run.world.is_main and cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
        records = _sample_records(run.task, batch.examples, batch.rollout, cfg)
        _dump_samples(out / "samples" / f"step_{step}.jsonl", records)
    run.logger.log(step, row)
    run.logger.summary(step, cfg.steps, row)
    progress.step_done()

    nonfinite = result.stats.nonfinite
    run.nonfinite_run = run.nonfinite_run + 1 if nonfinite else 0
    if run.nonfinite_run >= cfg.train.max_nonfinite_steps:
        latest = ckpt.latest_checkpoint(run.ckpt_root)
        first = step - run.nonfinite_run + 1
        raise TrainingStopped(
            f"steps {first}-{step}: {run.nonfinite_run} steps in a row with a non-finite "
            f"{nonfinite} (train.max_nonfinite_steps={cfg.train.max_nonfinite_steps}), none "
            f"applied (the weights are step {first - 1}'s); "
            + (f"{latest} is intact" if latest else "no checkpoint was written yet")
            + ": lower train.lr or train.grad_clip, or check the rewards, then resume=true"
        )
    signum = preempt.pending(run.world, run.device)  # SIGTERM/SIGINT during this step
    due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps
    if due or signum is not None:
        run.save_checkpoint(step)
    if signum is not None:
        where = run.ckpt_root / ckpt.step_dir_name(step)
        raise Preempted(
            f"{signal.Signals(signum).name} during step {step}: checkpoint {where} written "
            "after it; resume=true continues from there",
            signum,
        )


def finish(run: Run, t_start: float) -> None:
    """The final checkpoint and model. With checkpoints on, the last step leaves one too (the
    loop skips it), so that ``resume=true steps=N`` extends a finished run from its final step."""
    cfg = run.cfg
    last = ckpt.latest_checkpoint(run.ckpt_root)
    if cfg.checkpoint_every and (last is None or last.name != ckpt.step_dir_name(run.state.step)):
        run.save_checkpoint(run.state.step)
    if run.world.is_main:
        save_dtype = None if cfg.train.save_dtype == "auto" else getattr(torch, cfg.train.save_dtype)
        ckpt.save_pretrained_atomic(run.model, run.tokenizer, run.out / "final", dtype=save_dtype)
        run.logger.event(
            f"done: {cfg.steps} steps in {time.perf_counter() - t_start:.1f}s; model in {run.out / 'final'}"
        )
    dist.barrier()
    run.logger.close()


class _Stats:
    """Token-level sums over the microbatches of one epoch, by name (kept on the device until the
    end of the step; ``global_totals`` all-reduces them in one collective)."""

    FIELDS = (
        "loss",
        "entropy",
        "clipped",
        "kl_ref",  # Σ KL(π ‖ π_ref) per token, when there is a reference
        "kl_old",  # Σ k3 of KL(π_old ‖ π), when there is a π_old
        "tokens",
        "sampler_gap",  # Σ |log p_trainer − log p_sampler|
        "clip_low",  # clipped with r < 1
        "clip_high",  # clipped with r > 1
        "loss_pg",  # Σ w·pg
        "loss_kl",  # Σ w·β·KL
        "loss_entropy",  # −Σ w·c·H
        "entropy_threshold",  # Σ over microbatches (loss.top_entropy_quantile < 1)
        "microbatches",
        "sft_nll",  # sft.mix_coef: Σ of −log p / N over the solution tokens (N: over all ranks)
        "sft_tokens",
    )

    def __init__(self):
        self.sums: dict[str, torch.Tensor] | None = None
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
        zero = torch.zeros((), device=out.entropy.device)
        self.has_ref = out.kl is not None
        row = dict.fromkeys(self.FIELDS, zero)
        row["tokens"] = torch.tensor(float(mb.labels.numel()), device=zero.device)
        row["microbatches"] = torch.ones((), device=zero.device)
        row["loss"] = loss = out.loss.detach().float()
        row["entropy"] = out.entropy.sum()
        row["clipped"] = out.clipped.float().sum()
        if out.kl is not None:
            row["kl_ref"] = out.kl.sum()
        if mb.old_logprobs is not None:
            # KL(π_old ‖ π) from samples of π_old: k3 with d = log π_old − log π is e^(−d) − 1 + d
            row["kl_old"] = kl_penalty(mb.old_logprobs, out.logprobs.detach(), "k3").sum()
            # the side of the range a clipped ratio left it on (on-policy nothing is clipped)
            log_ratio = out.logprobs.detach() - mb.old_logprobs
            if level == "sequence":  # GSPO clips the response's ratio
                log_ratio = sequence_mean(log_ratio, mb.sequence_ids)
            row["clip_low"] = (out.clipped & (log_ratio < 0)).float().sum()
            row["clip_high"] = (out.clipped & (log_ratio > 0)).float().sum()
        # the trainer-vs-sampler gap on the sampled tokens, from this forward's log-probs: no extra pass
        if mb.sampler_logprobs is not None:
            row["sampler_gap"] = (out.logprobs - mb.sampler_logprobs).abs().sum()
        # the loss split: Σ w·(pg + β·KL − c·H), each term from the op's per-token values
        if beta != 0 and out.kl is not None:
            row["loss_kl"] = beta * (mb.loss_weights * out.kl).sum()
        if entropy_coef != 0:
            row["loss_entropy"] = -entropy_coef * (mb.loss_weights * out.entropy).sum()
        row["loss_pg"] = loss - row["loss_kl"] - row["loss_entropy"]
        if top_entropy_quantile < 1:  # the op's own: the same quantile of the same entropies
            row["entropy_threshold"] = entropy_threshold(
                out.entropy, mb.loss_weights != 0, top_entropy_quantile
            ).float()
        if self.sums is None:
            self.sums = row
        else:
            self.sums = {k: self.sums[k] + row[k] for k in self.FIELDS}

    def add_sft(self, out, mb, mix_coef: float) -> None:
        """A supervised microbatch: its weights are mix_coef / N, so −Σ w·log p / mix_coef is its
        share of the per-token mean NLL."""
        zero = torch.zeros((), device=out.logprobs.device)
        row = dict.fromkeys(self.FIELDS, zero)
        row["sft_nll"] = -(mb.loss_weights * out.logprobs.detach()).sum() / mix_coef
        row["sft_tokens"] = torch.tensor(float(mb.labels.numel()), device=zero.device)
        self.sums = row if self.sums is None else {k: self.sums[k] + row[k] for k in self.FIELDS}

    def _values(self) -> dict[str, float]:
        if self.sums is None:
            return dict.fromkeys(self.FIELDS, 0.0)
        return dict(zip(self.FIELDS, torch.stack([self.sums[k] for k in self.FIELDS]).tolist()))  # sync

    def kl_to_old(self, world: dist.DistInfo, device: torch.device) -> float:
        s = dict(zip(self.FIELDS, dist.all_reduce_sum(list(self._values().values()), device)))
        return s["kl_old"] / max(s["tokens"], 1.0)

    def global_totals(
        self, world, device, raw_rewards, rollout, reward_meta, skipped_tokens: int = 0
    ) -> dict[str, float]:
        """The step's totals over all ranks (one all-reduce), as means where they are means."""
        r = raw_rewards.double()
        n = len(raw_rewards)
        acc = reward_meta.get("answer_reward_mean", float((raw_rewards == 1).float().mean().item()))
        local = {
            **self._values(),
            "reward_sum": r.sum().item(),
            "reward_sq": (r * r).sum().item(),
            "correct": acc * n,
            "formatted": reward_meta.get("format_reward_mean", float("nan")) * n,
            "truncated": sum(f == "length" for f in rollout.finish_reason),
            "sequences": n,
            "zero_variance_groups": reward_meta["zero_variance_groups"],
            "groups": reward_meta["num_groups"],
            "skipped": skipped_tokens,
            "kl_reward_sum": reward_meta.get("kl_reward_sum", 0.0),
            "kl_reward_tokens": reward_meta.get("kl_reward_tokens", 0.0),
        }
        # a weighted reward's parts (data.reward a list): "reward/NAME_mean" on this rank's responses
        parts = sorted(
            k[: -len("_mean")] for k in reward_meta if k.startswith("reward/") and k.endswith("_mean")
        )
        local.update({f"part:{p}": reward_meta[f"{p}_mean"] * n for p in parts})
        g = dict(zip(local, dist.all_reduce_sum(list(local.values()), device)))
        tokens = max(g["tokens"], 1.0)  # the trained ones
        nseq = g["sequences"]
        mean = g["reward_sum"] / nseq
        var = (
            max(g["reward_sq"] / nseq - mean * mean, 0.0) * nseq / max(nseq - 1, 1)
        )  # unbiased, as torch.std
        return {
            "loss": g["loss"],
            "entropy": g["entropy"] / tokens,
            "clip_fraction": g["clipped"] / tokens,
            "clip_fraction_low": g["clip_low"] / tokens,
            "clip_fraction_high": g["clip_high"] / tokens,
            "loss_pg": g["loss_pg"],
            "loss_kl": g["loss_kl"],
            "loss_entropy": g["loss_entropy"],
            "entropy_threshold": g["entropy_threshold"] / max(g["microbatches"], 1.0),
            # KL to the reference policy: in the loss, or (loss.kl_in_reward) k1 per sampled token
            # in the rollout phase; else to π_old (0 when on-policy)
            "kl": (
                g["kl_reward_sum"] / max(g["kl_reward_tokens"], 1.0)
                if "kl_reward_sum" in reward_meta
                else (g["kl_ref"] if self.has_ref else g["kl_old"]) / tokens
            ),
            "reward_parts": {f"train/{p}": g[f"part:{p}"] / nseq for p in parts},
            "sft": {"train/sft_loss": g["sft_nll"], "train/sft_tokens": g["sft_tokens"]}
            if g["sft_tokens"]
            else {},
            "reward_mean": mean,
            "reward_std": math.sqrt(var),
            "accuracy": g["correct"] / nseq,
            "format_rate": g["formatted"] / nseq,
            "truncated": g["truncated"] / nseq,
            "zero_variance": g["zero_variance_groups"] / max(g["groups"], 1),
            "sampler_gap": g["sampler_gap"] / tokens if rollout.sampler_logprobs is not None else None,
            "skipped": g["skipped"] / max(g["tokens"] + g["skipped"], 1.0),
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


def _make_backend(run: Run, engine):
    """The rollout backend; for vllm, the folder the engine starts from and the weight-sync probe.

    vLLM loads a Hugging Face folder: ``model.name_or_path`` itself, unless the policy exists only
    here (the built-in model, or a warm start just ran), in which case it is written to
    ``output_dir/rollout_init`` first. Either way the current policy is pushed before the first
    rollout, and probed after every push.
    """
    cfg, model, tokenizer, task, device, amp, world = (
        run.cfg, run.model, run.tokenizer, run.task, run.device, run.amp, run.world
    )  # fmt: skip
    if cfg.rollout.backend != "vllm":
        return make_backend(cfg, model, tokenizer, device, amp)
    model_path = None
    if engine is None and (cfg.model.name_or_path.startswith("builtin:") or run.sft_steps > 0):
        model_path = run.out / "rollout_init"
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
            return run.policy_loss(mb, 0.0, 1.0).logprobs  # the fused op, as the loss computes them

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


if __name__ == "__main__":
    sys.exit(main())
