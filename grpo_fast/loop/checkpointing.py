"""A run's checkpoints: everything an exact resume needs, written atomically by rank 0.

The model and tokenizer in Hugging Face format, and ``trainer_state.pt`` with the optimizer, the
LR schedule, the prompt sampler, the health monitor, the KL controller, the pass-rate table, the
frozen reference model when there is one, every rank's RNG states and the step and β
(``grpo_fast.policy.checkpoint`` writes and reads the folders).
"""

from __future__ import annotations

from pathlib import Path

from grpo_fast import dist
from grpo_fast.errors import ConfigError
from grpo_fast.loop.state import Run, TrainState
from grpo_fast.policy import checkpoint as ckpt


def save_checkpoint(run: Run, step: int) -> None:
    """``checkpoints/step_<step>`` of ``run`` as it is now, by rank 0 (every rank's RNG gathered)."""
    rngs = dist.all_gather_objects(ckpt.rng_state())
    if run.world.is_main:
        extra = {
            "train_state": run.state.state_dict(),
            "optimizer": run.trainer.optimizer.state_dict(),
            "scheduler": run.scheduler.state_dict(),
            "sampler": run.sampler.state_dict(),
            "health": run.health.state_dict(),
            "rng": rngs,
            "world_size": run.world.world_size,
        }
        if run.kl_ctl is not None:
            extra["kl_controller"] = run.kl_ctl.state_dict()
        if run.pass_rates is not None:
            extra["pass_rates"] = run.pass_rates.state_dict()
        if run.ref_model is not None:
            extra["ref_model"] = run.ref_model.state_dict()
        ckpt.save_checkpoint(
            run.ckpt_root, step, run.model, run.tokenizer, extra, keep=run.cfg.keep_checkpoints
        )
    dist.barrier()


def restore(run: Run, path: Path) -> None:
    """Load the checkpoint at ``path`` into ``run`` (the same number of ranks that wrote it)."""
    saved = ckpt.load_state(path)
    if saved["world_size"] != run.world.world_size:
        raise ConfigError(
            f"resume=true: {path} was written by {saved['world_size']} rank(s); "
            f"resume with the same number of ranks (now {run.world.world_size})"
        )
    ckpt.load_model_weights(run.model, path)
    if run.ref_model is not None:
        run.ref_model.load_state_dict(saved["ref_model"])
    run.trainer.optimizer.load_state_dict(saved["optimizer"])
    run.scheduler.load_state_dict(saved["scheduler"])
    run.sampler.load_state_dict(saved["sampler"])
    run.health.load_state_dict(saved["health"])
    if run.kl_ctl is not None:
        run.kl_ctl.load_state_dict(saved["kl_controller"])
    if run.pass_rates is not None and "pass_rates" in saved:
        run.pass_rates.load_state_dict(saved["pass_rates"])
    run.state = TrainState.from_state_dict(saved["train_state"])
    ckpt.set_rng_state(saved["rng"][run.world.rank])
