"""Setup: from a config to a ``Run`` ready for its first step.

Data first (a bad file fails in seconds), then the tokenizer, the policy, the memory plan, the
optional SFT warm start, the KL reference, the optimizer and schedule, the prompt sampler, a
resume from the latest checkpoint, the rollout backend; then the step-0 evaluation.
"""

from __future__ import annotations

import copy
import dataclasses
import functools
import json
import random
from pathlib import Path

import numpy as np
import torch

from grpo_fast import dist, threads
from grpo_fast.algo.advantages import GROUP_ESTIMATORS
from grpo_fast.algo.control import AdaptiveKLController
from grpo_fast.algo.difficulty import PassRateTable
from grpo_fast.algo.prompt_sampler import PromptSampler
from grpo_fast.config import Config
from grpo_fast.errors import ConfigError
from grpo_fast.loop import agreement
from grpo_fast.loop.checkpointing import restore, stop_within
from grpo_fast.loop.optim import build_optimizer, build_scheduler
from grpo_fast.loop.sft import sft_warm_start
from grpo_fast.loop.state import RolloutSide, Run, Trainer, TrainState
from grpo_fast.loop.step_end import evaluate_run
from grpo_fast.obs import eta, run_folder
from grpo_fast.obs.health import HealthMonitor, HealthThresholds
from grpo_fast.obs.metrics import MetricsLogger
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.policy import parallel
from grpo_fast.policy.batch import Sequence, make_microbatches
from grpo_fast.policy.lora import AdapterOffLoss, is_lora, trainable_counts
from grpo_fast.policy.loss import PolicyLoss, build_policy_loss
from grpo_fast.policy.model import autocast_dtype, load_policy, load_tokenizer, policy_dtype, precision_note
from grpo_fast.policy.teacher import load_teacher, served_teacher
from grpo_fast.policy.value import ValueHead
from grpo_fast.rollout import BackendContext, backend, make_backend
from grpo_fast.rollout.hf.process import start_worker_server
from grpo_fast.task import tiny
from grpo_fast.task.loader import Task, load_eval_sets, load_task
from grpo_fast.task.registry import task as task_spec
from grpo_fast.tools import dry_run, plan


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed)
    torch.manual_seed(seed)


def setup(cfg: Config, device: torch.device, world: dist.DistInfo, out: Path, engine) -> Run:
    """Data, tokenizer, policy, memory plan, optional SFT warm start, KL reference, optimizer,
    resume, rollout backend; then the step-0 evaluation. ``engine``: a rollout engine to use
    instead of starting one (tests pass a fake vLLM engine)."""
    # Every rank starts from the same seed (same init, same prompts); each rank's rollout
    # sampling gets its own seed (grpo_fast.rollout.sampling.sampling_rng).
    seed_everything(cfg.seed)
    # the cores others keep busy (threads.OtherWork), read once the model is built: for the
    # thread count and the plan line's "expect it slower"
    other_work = eta.setup_meter()
    if world.is_main:
        out.mkdir(parents=True, exist_ok=True)
    dist.barrier()
    logger = MetricsLogger(cfg, out, enabled=world.is_main)

    task: Task = load_task(cfg)  # the data first: a bad file fails in seconds, before any model loads
    eval_sets = load_eval_sets(cfg, task)  # and eval.sets (a missing one: one line)
    if cfg.rollout.placement == "process" and cfg.rollout.backend == "hf":
        start_worker_server()  # its imports (~5 s of a core) beside the model's load, not after
    ckpt.check_model_folder(cfg.model.name_or_path, "re-save or re-download the model")
    tokenizer = load_tokenizer(cfg.model.name_or_path)
    for t in {id(t): t for t in (task, *(s.task for s in eval_sets))}.values():
        t.tokenizer = tokenizer
    model, warm_base = _load_model(cfg, out, tokenizer, device, world)
    parallel.check_model(model, world)  # sp: heads that do not divide, ...: one line now
    amp = autocast_dtype(cfg, device)
    teacher = None
    if cfg.distill.teacher is not None:  # before the warm start: a teacher that cannot serve stops now
        dtype = amp or policy_dtype(cfg, device)
        if cfg.distill.placement == "server":  # a vLLM server: its prompt log-probs, no weights here
            teacher = served_teacher(cfg, tokenizer, out, dtype)
        else:
            rows = model.get_output_embeddings().weight.shape[0]
            teacher = load_teacher(
                cfg.distill.teacher, tokenizer, rows, dtype, device, cfg.distill.load_in_4bit
            )
            parallel.prepare_model(teacher, world)  # sp: its attention by all-to-all as the student's
    cpu_threads = _set_threads(cfg, model, device, other_work)  # before the plan: its estimate counts them
    # what the run will do, its inputs loaded
    _announce_plan(cfg, world, logger, device, cpu_threads, others=other_work.latest)
    asked, cfg = cfg, plan.resolve_auto(cfg, model.config, device, world.dp.size)
    cfg, clamped = plan.clamp_micro_batch(cfg, world.dp.size)  # an sp group trains its dp rank's batch
    if clamped:
        logger.event(clamped)
    n_prompts = cfg.rollout.prompts_per_step
    if n_prompts % world.ranks.size:  # each rank generates its share (under sequence parallelism too)
        raise ConfigError(
            f"rollout.batch_size / rollout.group_size = {n_prompts} prompts per step do not split "
            f"evenly over {world.ranks.size} ranks"
        )
    resume_from = ckpt.latest_checkpoint(out / "checkpoints") if cfg.resume else None
    sft_from = run_folder.resumable(out) if cfg.resume and resume_from is None else None  # a warm start's
    autos = None
    if world.is_main:  # config.yaml: the run's config; a resume adds a dated line once it has loaded
        seen = {"device": str(device), "model.dtype": str(next(model.parameters()).dtype).split(".")[-1]}
        seen["train.mixed_precision"] = {torch.bfloat16: "bf16", torch.float16: "fp16"}.get(amp, "no")
        autos = run_folder.resolved_from_auto(asked, cfg, seen)
        if resume_from is None:
            run_folder.record_config(out, cfg, sft_from, autos)
    if cfg.resume and resume_from is None and sft_from is None:
        logger.event(f"resume=true but {out / 'checkpoints'} holds no checkpoint: starting from scratch")
    sft_steps = 0
    if resume_from is None and cfg.sft.steps > 0:
        sft_steps = sft_warm_start(
            cfg, model, tokenizer, task, device, amp, out if world.is_main else None, logger, world, sft_from
        )
    if warm_base:  # the warm start made the base (sft.target=base): it is frozen, the adapter goes on it
        model = _adapter_on_warm_base(cfg, model, out, tokenizer, device, world, sft_steps)
    run = _build_run(cfg, device, world, out, logger, task, tokenizer, model, amp, teacher, eval_sets)
    run.sft_steps, run.rollout.prompts_per_rank = sft_steps, n_prompts // world.ranks.size
    if resume_from is not None:
        restore(run, resume_from)  # a refusal here (another world size, ...) leaves config.yaml as it was
        if world.is_main:
            run_folder.record_config(out, cfg, resume_from, autos)
        logger.truncate_after(run.trainer.state.step)
        logger.event(f"resumed from {resume_from} at step {run.trainer.state.step}")
        sft_steps = run.sft_steps  # the run's warm start, for a step-0 row not written yet
    with stop_within(run, run.trainer.state.step, "the rollout engine's start"):  # the warm start kept
        run.rollout.backend = _make_backend(run, engine)

    model_row = _announce_trainable(run)
    if run.trainer.state.step == 0 and cfg.eval_every and run.eval_subset_size and not logger.has_row(0):
        # a signal, or a failed engine (on any rank: every rank together): the warm start kept
        with stop_within(run, 0, "the evaluation before GRPO", together=True):
            row = evaluate_run(run, 0, full=False)
        logger.log(0, {**row, "sft/steps": sft_steps, "world_size": world.world_size, **model_row})
        logger.event(f"step 0 (before GRPO): eval/accuracy {row['eval/accuracy']:.3f}")
    return run


def _announce_trainable(run: Run) -> dict[str, float]:
    """Under LoRA: one line with the trainable share (and the 4-bit base), and the
    ``model/trainable_params`` / ``model/trainable_fraction`` metrics of the step-0 row."""
    if not is_lora(run.model):
        return {}
    trainable, total = trainable_counts(run.model)
    base = (
        "a 4-bit NF4 base"
        if run.cfg.model.load_in_4bit
        else f"a frozen {policy_dtype(run.cfg, run.device)} base"
    )
    run.logger.event(
        f"LoRA r={run.cfg.model.lora.r} on {base}: {trainable:,} of {total:,} parameters train "
        f"({100 * trainable / total:.2f}%)"
    )
    return {"model/trainable_params": float(trainable), "model/trainable_fraction": trainable / total}


def _load_model(cfg: Config, out: Path, tokenizer, device, world) -> tuple[torch.nn.Module, bool]:
    """The policy, and whether the warm start is to make its LoRA base first (``sft.target=base``
    with a warm start not done yet: the model is then the plain base, the adapter comes after)."""
    folder = out / "base"
    warm_base = (
        cfg.model.lora.r
        and cfg.sft.steps > 0
        and cfg.sft.resolved_target(cfg.model.name_or_path) == "base"
        and not (folder / "config.json").is_file()  # written once the warm start is done
    )
    if warm_base:
        plain = dataclasses.replace(
            cfg.model, lora=dataclasses.replace(cfg.model.lora, r=0), load_in_4bit=False
        )
        return load_policy(dataclasses.replace(cfg, model=plain), tokenizer, device), True
    return load_policy(cfg, tokenizer, device, base_path=_lora_base(cfg, out, tokenizer, world)), False


def _adapter_on_warm_base(cfg: Config, model, out: Path, tokenizer, device, world, sft_steps: int):
    """After a warm start of the whole model under LoRA: that model is the base, written once to
    ``output_dir/base`` (rank 0; its ``warm_start.json`` says how many steps made it), then loaded
    as the run's base (in 4-bit with ``model.load_in_4bit``) with a fresh adapter on it."""
    folder = out / "base"
    if world.is_main:
        ckpt.save_pretrained_atomic(model, tokenizer, folder)
        (folder / "warm_start.json").write_text(json.dumps({"sft_steps": sft_steps}) + "\n")
    dist.barrier()
    del model
    return load_policy(cfg, tokenizer, device, base_path=str(folder.resolve()))


def _lora_base(cfg: Config, out: Path, tokenizer, world: dist.DistInfo) -> str | None:
    """Under LoRA, the folder of a base that exists only in this run (the built-in model):
    written once to ``output_dir/base`` (rank 0), so that the adapter's
    ``base_model_name_or_path`` resolves and a 4-bit base loads through bitsandbytes. None
    otherwise (the base is ``model.name_or_path``)."""
    folder = out / "base"
    if not cfg.model.lora.r:
        return None
    if cfg.model.name_or_path in tiny.BUILTINS:
        if world.is_main and not (folder / "config.json").is_file():
            base = tiny.build_model(tokenizer, seed=cfg.seed)
            ckpt.save_pretrained_atomic(base, tokenizer, folder)
        # every rank, the folder there before or not: a rank that saw rank 0's new folder and
        # skipped the barrier left rank 0 in it (a hang, 6 of 24 two-rank LoRA runs)
        dist.barrier()
        return str(folder.resolve())
    if (folder / "config.json").is_file():  # made by this run's warm start, or before
        return str(folder.resolve())
    return None


def _build_run(
    cfg, device, world, out, logger, task, tokenizer, model, amp, teacher=None, eval_sets=()
) -> Run:
    """The run's modules and helpers around the loaded (and possibly warm-started) policy."""
    kl_ctl = AdaptiveKLController(cfg.loss.beta, cfg.loss.target_kl) if cfg.loss.target_kl else None
    # The KL reference is the policy GRPO starts from (after any warm start), frozen, kept in
    # the autocast dtype when there is one (bf16: half the memory of fp32 master weights). Under
    # LoRA it is the same model with the adapter off: no second copy.
    ref_model = ref_loss = None
    lora = is_lora(model)
    parallel.prepare_model(model, world)  # sp: attention by all-to-all (the KL reference's too)
    policy_loss = build_policy_loss(cfg, model, amp)
    value_head = None
    if cfg.loss.advantage == "gae":  # the value model: a head on the policy's hidden states
        value_head = ValueHead(model.config.hidden_size).to(device)
        policy_loss.attach_value_head(value_head, cfg.critic.trunk_coef, cfg.critic.value_clip)
    if (cfg.loss.beta > 0 or kl_ctl is not None) and lora:
        ref_loss = AdapterOffLoss(policy_loss)
    elif cfg.loss.beta > 0 or kl_ctl is not None:
        ref_model = copy.deepcopy(model).eval().requires_grad_(False)
        if amp is not None:
            ref_model.to(amp)
        ref_loss = build_policy_loss(cfg, ref_model, amp)
    # distill.teacher: its log-probs through the same fused op, forward only
    teacher_loss = teacher  # distill.placement=server: the ServedTeacher, asked per response
    if isinstance(teacher, torch.nn.Module):
        teacher_loss = build_policy_loss(cfg, teacher, amp)
    # FSDP2: each rank holds 1/N of the weights, gradients and optimizer state
    frozen = [m for m in (ref_loss if ref_model is not None else None, teacher_loss)
              if isinstance(m, torch.nn.Module)]  # fmt: skip
    sharded = parallel.shard(cfg, world, [policy_loss, *frozen], amp, device)
    value_params = list(value_head.parameters()) if value_head is not None else []
    optimizer = build_optimizer(cfg, model.parameters(), value_params)  # over the shards, under FSDP
    policy = parallel.wrap(policy_loss, world, device)  # DDP when data parallel and not sharded
    pass_rates, sampler = _prompt_sampler(cfg, task)
    sft_loss = None
    if cfg.sft.mix_coef > 0 and sharded:  # the sharded root itself, on the full vocabulary
        sft_loss = functools.partial(policy_loss, truncated=False)
    elif cfg.sft.mix_coef > 0:  # advantage 1, on-policy, the default options: the plain NLL
        sft_loss = PolicyLoss(model, autocast=amp, backend=cfg.loss.kernel_backend)
    params = [p for p in model.parameters() if p.requires_grad] + value_params
    thresholds = {**cfg.health.thresholds, "auto_temperature_boost": cfg.health.auto_temperature}
    return Run(
        cfg=cfg,
        device=device,
        world=world,
        out=out,
        logger=logger,
        task=task,
        tokenizer=tokenizer,
        model=model,
        amp=amp,
        trainer=Trainer(
            policy,
            optimizer,
            params,
            cfg,
            world,
            device,
            sft_loss,
            scheduler=build_scheduler(cfg, optimizer),
            policy_loss=policy_loss,
            ref_model=ref_model,
            ref_loss=ref_loss,
            kl_ctl=kl_ctl,
            state=TrainState(beta=cfg.loss.beta, entropy_coef=_entropy_coef_start(cfg)),
            value_head=value_head,
            teacher_loss=teacher_loss,
        ),
        rollout=RolloutSide(backend=None, sampler=sampler, pass_rates=pass_rates),
        health=HealthMonitor(
            HealthThresholds(**thresholds), group_baseline=cfg.loss.advantage in GROUP_ESTIMATORS
        ),
        eval_sets=eval_sets,
        agree=agreement.make_group(world, cfg.rollout.request_timeout),
    )


def _set_threads(cfg: Config, model: torch.nn.Module, device: torch.device, other_work=None) -> str:
    """torch's intra-op threads for this run (``grpo_fast.threads.choose_threads``: the machine's
    cores shared among this machine's ranks, the other work on them, the model's hidden size and
    the OpenMP wait); an automatic count on a CPU run then follows the machine at step ends
    (``threads.follower``). ``other_work``: a ``threads.OtherWork`` started with the setup (its
    reading, when the setup took long enough to make one, else the 1-minute load average, which
    lags and counts the last minute's runs). Returns what the plan line says of them, e.g. ``2 CPU
    threads (auto: 2 cores, other work 0.1, following the machine), OpenMP wait spin 30000``."""
    local_ranks = threads.local_ranks()
    cores = max(1, threads.usable_cores() // local_ranks)
    hidden = getattr(getattr(model, "config", None), "hidden_size", None)
    busy = other_work.read() if other_work is not None else None
    # local ranks are each other's "other work": the machine's cores less it, shared among them
    if busy is not None:  # the other local ranks (as busy as this one, at most) are not "other work"
        load, name = max(0.0, busy - (local_ranks - 1) * cores), "other work"
    else:
        load, name = threads.load_average(), "load"
    choice = threads.choose_threads(cfg.threads.intra_op, device.type, hidden, cores, load, load_name=name)
    # Only a change: re-setting torch's own count (the OMP_NUM_THREADS it started with) re-sets
    # MKL's and OpenMP's too, and made the tiny preset's steps 20-40% slower on 2 cores (median
    # step 70-80 → 87-98 ms, OMP_NUM_THREADS=2, alternating, 2026-12-04).
    if choice is not None and choice.threads != torch.get_num_threads():
        torch.set_num_threads(choice.threads)
    # auto: the count follows the other work on this machine's cores at step ends (train.run removes it)
    follow = choice is not None and choice.follow
    reading = other_work.read if other_work is not None else None  # None: a fresh OtherWork
    threads.follower = threads.ThreadFollower(cores, threads.usable_cores(), reading) if follow else None
    n = torch.get_num_threads()
    why = choice.why if choice is not None else "torch's default"
    return f"{n} CPU thread{'s' if n > 1 else ''} ({why}), OpenMP wait {threads.wait_policy_in_effect()}"


def _announce_plan(
    cfg: Config,
    world: dist.DistInfo,
    logger,
    device: torch.device,
    cpu_threads: str = "",
    others: float | None = None,
) -> None:
    """One line, before the run starts: the warm start, the GRPO steps, the evaluations, and
    about how long it takes on this machine (``grpo_fast.obs.eta``); then ``cpu_threads``.
    ``others``: the cores other work kept busy during the setup (None: unknown, the estimate
    reads the load average)."""
    s, r = cfg.sft, cfg.rollout
    first = ""
    if cfg.resume and run_folder.resumable(Path(cfg.output_dir)) is not None:  # else: a fresh start
        first = f"continue the run in {cfg.output_dir} from its latest checkpoint, then "
    elif s.steps > 0:
        until = ""
        if s.target_accuracy is not None:
            until = (
                f" (it stops once greedy accuracy on {s.check_size} training problems reaches "
                f"{s.target_accuracy:g}, checked every {s.check_every} steps)"
            )
        first = f"an SFT warm start of up to {s.steps} steps{until}, then "
    grpo = f"GRPO to step {cfg.steps}, {r.prompts_per_step} prompts × {r.group_size} responses each"
    said = dry_run.evaluations(cfg)  # "an evaluation every 25 steps", "… at steps 0 and 6"
    evals = f", {said}{_eval_source(cfg)}" if said else ""
    ranks = f", on {world.world_size} ranks" if world.enabled else ""
    if world.is_main:  # the other ranks print nothing
        precision = precision_note(cfg, device)
        threads_note = f"; {cpu_threads}" if cpu_threads else ""  # before the estimate, which ends the line
        logger.event(
            f"plan: {first}{grpo}{evals}{ranks}{precision}{threads_note}; "
            f"{eta.plan_estimate(cfg, device, world.world_size, others)}"
        )


def _eval_source(cfg: Config) -> str:
    """Where the evaluations' problems come from, when the training problems are the user's own
    file (``data.train_path``) and ``data.eval_path`` is not set: easy to miss, so the plan says it."""
    d = cfg.data
    if not d.train_path or d.eval_path:
        return ""
    spec = task_spec(d.task)
    where = (
        "the built-in eval problems" if spec.builtin else f"{d.hub_name or spec.hub_name} [{spec.eval_split}]"
    )
    return f" on {where} (data.eval_path is not set)"


def _entropy_coef_start(cfg: Config) -> float | None:
    """The adaptive entropy coefficient's start, ``loss.entropy_coef``, with ``loss.entropy_target``
    (None without it: the coefficient is then ``loss.entropy_coef`` throughout)."""
    return cfg.loss.entropy_coef if cfg.loss.entropy_target is not None else None


def _prompt_sampler(cfg: Config, task: Task) -> tuple[PassRateTable | None, PromptSampler]:
    """The prompt sampler and, when an option needs one, the per-prompt pass-rate table
    (``rollout.difficulty_filter``, ``rollout.adaptive_group_size``, ``rollout.curriculum``
    without ``data.difficulty_field``); both are checkpointed."""
    r = cfg.rollout
    difficulty = None
    if cfg.data.difficulty_field is not None:
        difficulty = [ex.difficulty for ex in task.train]
    by_rate = r.curriculum != "none" and difficulty is None
    table = None
    if r.difficulty_filter is not None or r.adaptive_group_size or by_rate:
        table = PassRateTable(len(task.train))
    band = None if r.difficulty_filter is None else list(r.difficulty_filter)
    pace = (
        (r.curriculum_start, r.curriculum_steps or max(cfg.steps // 2, 1))
        if r.curriculum == "paced"
        else None
    )
    sampler = PromptSampler(
        len(task.train),
        cfg.seed,
        table=table,
        difficulty_filter=band,
        curriculum=r.curriculum,
        difficulty=difficulty if r.curriculum != "none" else None,
        pace=pace,
    )
    return table, sampler


def _make_backend(run: Run, engine):
    """The rollout backend; for one with its own weights (``needs_weight_push``: vllm), the folder
    it starts from and the weight-sync probe.

    Such an engine loads a Hugging Face folder: ``model.name_or_path`` itself, unless the policy
    exists only here (the built-in model, or a warm start just ran), in which case it is written
    to ``output_dir/rollout_init`` first. Either way the current policy is pushed before the
    first rollout, and probed after every push.
    """
    cfg, model, tokenizer, world = run.cfg, run.model, run.tokenizer, run.world
    spec = backend(cfg.rollout.backend)
    ctx = BackendContext(cfg, model, tokenizer, run.device, run.amp, engine=engine, warn=run.logger.event)
    if not spec.needs_weight_push:
        return make_backend(ctx)
    from grpo_fast.rollout.vllm import WeightSyncProbe, vllm_dtype, weight_sync_tolerance

    if engine is None and is_lora(model):  # the engine serves the base; the adapter (or merge) is pushed
        ctx.model_path = parallel.unwrap(model).peft_config["default"].base_model_name_or_path
    elif engine is None and (cfg.model.name_or_path.startswith("builtin:") or run.sft_steps > 0):
        model_path = run.out / "rollout_init"
        dtype = vllm_dtype(model, run.amp)
        whole = parallel.save_full_model(
            model, run.trainer.policy_loss, tokenizer, model_path, world.is_main, dtype
        )
        if not whole and world.is_main:  # FSDP gathered and wrote it; else rank 0 writes it
            ckpt.save_pretrained_atomic(model, tokenizer, model_path, dtype=dtype)
        dist.barrier()
        ctx.model_path = str(model_path)
    # The probe: a fixed, real sequence of this task (the first eval problem and its answer).
    ex = (run.task.eval or run.task.train)[0]
    probe_ids = run.task.prompt_ids(ex) + tokenizer(ex.answer, add_special_tokens=False)["input_ids"]
    options = run.trainer.scoring_options()

    def trainer_logprobs(token_ids: list[int]) -> torch.Tensor:
        seq = Sequence(tokens=list(token_ids), n_prompt=1, advantage=0.0, weight=0.0)
        mb = make_microbatches([seq], 1, tokenizer.pad_token_id, packing=False)[0].to(run.device)
        with torch.no_grad():
            # the fused op, as the loss computes them; the full vocabulary's, as vLLM's prompt log-probs
            return run.trainer.policy_loss(mb, options, 1.0, truncated=False).logprobs

    ctx.probe = WeightSyncProbe(probe_ids, trainer_logprobs, weight_sync_tolerance(cfg, model, run.amp))
    return make_backend(ctx)
