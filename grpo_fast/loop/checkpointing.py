"""A run's checkpoints: everything an exact resume needs, written atomically by rank 0.

The model and tokenizer in Hugging Face format, and ``trainer_state.pt`` with the optimizer, the
LR schedule, the prompt sampler, the health monitor, the KL controller, the pass-rate table, the
frozen reference model when there is one, every rank's RNG states, the step and β, and the
number of warm-start steps (``grpo_fast.policy.checkpoint`` writes and reads the folders).
Under ``train.parallelism=fsdp`` the weights, the optimizer state and the reference model are
``torch.distributed.checkpoint`` shards that every rank writes (``grpo_fast.policy.sharded_checkpoint``),
and a resume on another number of ranks loads them resharded.

And what a stop writes (``grpo_fast.loop.preempt``): ``stop_within`` turns a signal in a phase
that changes no weights (a rollout, the evaluation before GRPO) into the checkpoint of the step
before it, written from the state the phase began with, so that a resume is exact; the warm
start's progress goes to ``checkpoints/sft_warm_start`` (``save_sft_progress``). A rollout engine
apart from the trainer that dies or does not answer in time (``EngineError``) stops the run the
same way: in such a phase (the engine's start too) through ``stop_within``; at a step's weight
sync or evaluation, after the step finished, with that step's row and checkpoint
(``engine_stopped``). A resume pushes the checkpoint's weights before its first rollout.
"""

from __future__ import annotations

import contextlib
import random
import shutil
from pathlib import Path

from grpo_fast import dist
from grpo_fast.errors import ConfigError, EngineError, Preempted, TrainingStopped
from grpo_fast.loop import preempt
from grpo_fast.loop.state import Run, TrainState
from grpo_fast.obs.run_folder import SFT_PROGRESS
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.policy import sharded_checkpoint

_DELETE_IT = "delete the folder to resume from the checkpoint before it"


def save_checkpoint(run: Run, step: int) -> None:
    """``checkpoints/step_<step>`` of ``run`` as it is now, by rank 0 (every rank's RNG gathered);
    under ``train.parallelism=fsdp`` every rank writes its own shards (``sharded_checkpoint``)."""
    rngs = dist.all_gather_objects(ckpt.rng_state())
    if run.cfg.train.parallelism == "fsdp":
        trainer_state = _trainer_state(run, step, rngs) if run.world.is_main else None
        models, optimizer = _sharded_models(run), run.trainer.optimizer
        keep = run.cfg.keep_checkpoints
        sharded_checkpoint.save(run.ckpt_root, step, models, optimizer, run.tokenizer, trainer_state, keep)
        return
    if run.world.is_main:
        extra = {**_trainer_state(run, step, rngs), "optimizer": run.trainer.optimizer.state_dict()}
        if run.trainer.ref_model is not None:
            extra["ref_model"] = run.trainer.ref_model.state_dict()
        if run.trainer.value_head is not None:  # loss.advantage=gae (its AdamW state is the optimizer's)
            extra["value_head"] = run.trainer.value_head.state_dict()
        ckpt.save_checkpoint(
            run.ckpt_root, step, run.model, run.tokenizer, extra, keep=run.cfg.keep_checkpoints
        )
    dist.barrier()


def _trainer_state(run: Run, step: int, rngs: list) -> dict:
    """What a checkpoint of step ``step`` holds besides the weights and the optimizer state; in
    a pipelined run, the in-flight work and the prompt sampler before it drew
    (``Pipeline.checkpoint_state``)."""
    extra = {
        "train_state": run.trainer.state.state_dict(),
        "scheduler": run.trainer.scheduler.state_dict(),
        "sampler": run.rollout.sampler.state_dict(),
        "health": run.health.state_dict(),
        "rng": rngs,
        "world_size": run.world.world_size,
        "sft_steps": run.sft_steps,
    }
    if run.trainer.kl_ctl is not None:
        extra["kl_controller"] = run.trainer.kl_ctl.state_dict()
    if run.rollout.pass_rates is not None:
        extra["pass_rates"] = run.rollout.pass_rates.state_dict()
    if run.pipeline is not None:
        extra.update(run.pipeline.checkpoint_state(step))
    return extra


def _sharded_models(run: Run) -> dict:
    """The modules a sharded checkpoint holds, by name."""
    return {
        "model": run.model,
        **({"ref_model": run.trainer.ref_model} if run.trainer.ref_model is not None else {}),
        **({"value_head": run.trainer.value_head} if run.trainer.value_head is not None else {}),
    }


def restore(run: Run, path: Path) -> None:
    """Load the checkpoint at ``path`` into ``run`` (the same number of ranks that wrote it)."""
    ckpt.check_model_folder(path, _DELETE_IT)
    saved = ckpt.load_state(path)
    sharded = run.cfg.train.parallelism == "fsdp"
    if sharded != sharded_checkpoint.is_sharded_checkpoint(path):
        written = "fsdp (sharded)" if not sharded else "ddp (Hugging Face weights)"
        raise ConfigError(
            f"resume=true: {path} was written with train.parallelism={written}; resume with the same"
        )
    if sharded:  # DCP reshards: another number of ranks loads too
        sharded_checkpoint.load(path, _sharded_models(run), run.trainer.optimizer, saved)
    elif saved["world_size"] != run.world.world_size:
        raise ConfigError(
            f"resume=true: {path} was written by {saved['world_size']} rank(s); "
            f"resume with the same number of ranks (now {run.world.world_size})"
        )
    else:
        ckpt.load_model_weights(run.model, path)
        if run.trainer.ref_model is not None:
            run.trainer.ref_model.load_state_dict(saved["ref_model"])
        if run.trainer.value_head is not None:
            if "value_head" not in saved:
                raise ConfigError(f"resume=true: {path} holds no value head (loss.advantage=gae needs one)")
            run.trainer.value_head.load_state_dict(saved["value_head"])
        run.trainer.optimizer.load_state_dict(saved["optimizer"])
    run.trainer.scheduler.load_state_dict(saved["scheduler"])
    run.rollout.sampler.load_state_dict(saved["sampler"])
    run.health.load_state_dict(saved["health"])
    if run.trainer.kl_ctl is not None:
        run.trainer.kl_ctl.load_state_dict(saved["kl_controller"])
    if run.rollout.pass_rates is not None and "pass_rates" in saved:
        run.rollout.pass_rates.load_state_dict(saved["pass_rates"])
    run.rollout.in_flight = saved.get("pipeline")  # a pipelined run's jobs after this step
    run.trainer.state = TrainState.from_state_dict(saved["train_state"])
    run.sft_steps = int(saved.get("sft_steps", run.sft_steps))
    if saved["world_size"] != run.world.world_size:
        run.logger.event(
            f"resume on {run.world.world_size} rank(s) of a checkpoint written by {saved['world_size']}: "
            "the weights and optimizer state are resharded, but each rank's prompts and sampling "
            "streams differ from the run that wrote it"
        )
    if run.world.rank < len(saved["rng"]):
        ckpt.set_rng_state(saved["rng"][run.world.rank])


@contextlib.contextmanager
def stop_within(run: Run, step: int, what: str, together: bool = False):
    """A phase after step ``step`` that changes no weights (``what``: "step 8's rollout", "the
    evaluation before GRPO"), stopped by a signal at the end of its current unit
    (``preempt.Interrupt``, one process only) or by a rollout engine apart from the trainer that
    died or did not answer in time (``EngineError``): the sampler's position, the RNG streams and
    the pass rates — all such a phase changes — are put back as they were when it began (while a
    pipeline runs, its producer owns them: it is stopped instead, and the checkpoint holds its
    in-flight jobs and the sampler before them), the checkpoint of ``step`` is written if it is not there, and ``Preempted`` (``TrainingStopped``)
    says which. Under torchrun a signal lets the step run to its end (``grpo_fast.loop.preempt``),
    and an engine's failure is handled so only in a phase whose ranks raise it ``together`` (the
    step's rollout, ``grpo_fast.loop.agreement``): the checkpoint's save is a
    collective; elsewhere it propagates as it is."""
    if run.world.enabled and not together:
        yield
        return
    pipe = run.pipeline  # a producer apart owns the sampler: it is stopped, its jobs checkpointed
    sampler, rng = run.rollout.sampler.state_dict(), ckpt.rng_state()
    rates = run.rollout.pass_rates.state_dict() if run.rollout.pass_rates is not None else None
    try:
        preempt.check_unit()  # a signal before the phase began: not a unit of it
        yield
    except (preempt.Interrupt, EngineError) as stop:
        if pipe is not None:
            pipe.close()  # the checkpoint holds its in-flight jobs and the sampler before them
        else:
            run.rollout.sampler.load_state_dict(sampler)
            ckpt.set_rng_state(rng)
            if rates is not None:
                run.rollout.pass_rates.load_state_dict(rates)
        if isinstance(stop, EngineError):
            raise engine_stopped(run, step, stop, what) from None
        words = resume_point(run, step)
        raise Preempted(f"{preempt.signal_name(stop.signum)} during {what}: {words}", stop.signum) from None


def engine_stopped(run: Run, step: int, exc: EngineError, what: str) -> TrainingStopped:
    """A rollout engine apart from the trainer died or did not answer in time (``exc``) during
    ``what`` ("step 8's weight sync"), after step ``step`` finished: the checkpoint of ``step`` is
    written unless it is there, and the one line that stops the run (to raise) says both."""
    return TrainingStopped(f"{exc} (during {what}): {resume_point(run, step)}")


def resume_point(run: Run, step: int) -> str:
    """Write the checkpoint of ``step`` unless it is there (or there is nothing to keep: step 0
    without a warm start); what resume=true will do, in words."""
    where = run.ckpt_root / ckpt.step_dir_name(step)
    if step == 0 and run.sft_steps == 0:
        return "nothing was written (no step had finished); resume=true starts the run over"
    if (where / ckpt.STATE_FILE).is_file():
        return f"checkpoint {where} of step {step} is there; resume=true continues from there"
    save_checkpoint(run, step)
    kept = " (the warm-started model)" if step == 0 else ""
    return f"checkpoint {where} of step {step}{kept} written; resume=true continues from there"


def save_sft_progress(out: Path, model, tokenizer, step: int, optimizer, rng: random.Random) -> Path:
    """A stopped warm start after ``step``: its weights, optimizer, batch order and RNG streams."""
    path = out / "checkpoints" / SFT_PROGRESS
    extra = {"sft_step": step, "optimizer": optimizer.state_dict(), "sft_rng": rng.getstate()}
    ckpt.save_pretrained_atomic(model, tokenizer, path, extra={**extra, "rng": ckpt.rng_state()})
    return path


def load_sft_progress(path: Path, model, optimizer, rng: random.Random) -> int:
    """Put a stopped warm start back (``save_sft_progress``); returns the step it stopped after."""
    ckpt.check_model_folder(path, "delete the folder to start the warm start over")
    saved = ckpt.load_state(path)
    ckpt.load_model_weights(model, path)
    optimizer.load_state_dict(saved["optimizer"])
    version, internal, gauss = saved["sft_rng"]
    rng.setstate((version, tuple(internal), gauss))
    ckpt.set_rng_state(saved["rng"])
    return int(saved["sft_step"])


def remove_sft_progress(out: Path) -> None:
    shutil.rmtree(out / "checkpoints" / SFT_PROGRESS, ignore_errors=True)
