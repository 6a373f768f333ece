"""The end of a step: health checks, evaluation, samples and the metrics line; then the stops
(non-finite steps in a row, a pending SIGTERM/SIGINT) and the periodic checkpoint. And the end
of the run: the final checkpoint and model.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import torch

from grpo_fast import dist
from grpo_fast.errors import Preempted, TrainingStopped
from grpo_fast.loop import preempt
from grpo_fast.loop.checkpointing import save_checkpoint
from grpo_fast.loop.state import Run
from grpo_fast.obs.metrics import PhaseProgress
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.tools.evaluate import evaluate


def evaluate_run(run: Run, step: int, full: bool, progress: PhaseProgress | None = None) -> dict[str, float]:
    """Greedy accuracy on the eval subset (``full``: the whole eval set), split over ranks; rank 0
    writes the first ``logging.samples_per_dump`` records to ``samples/eval_step_<step>.jsonl``."""
    examples = run.task.eval if full else run.eval_subset
    if progress is not None:
        progress.phase("eval", len(examples[run.world.rank :: run.world.world_size]))
    advance = progress.advance_phase if progress is not None else None
    metrics, records = evaluate(
        run.backend, run.task, examples, run.cfg, run.device, world=run.world, progress=advance
    )
    if run.world.is_main:
        n = run.cfg.logging.samples_per_dump
        _dump_samples(run.out / "samples" / f"eval_step_{step}.jsonl", records[:n])
    prefix = "eval_full/" if full else "eval/"
    return {prefix + k: v for k, v in metrics.items()}


def end_of_step(run: Run, step: int, batch, result, row: dict, progress: PhaseProgress) -> None:
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
        row.update(evaluate_run(run, step, full=False, progress=progress))
    if cfg.full_eval_every and (step % cfg.full_eval_every == 0 or step == cfg.steps):
        row.update(evaluate_run(run, step, full=True, progress=progress))
    if run.world.is_main and cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
        records = _sample_records(run.task, batch.examples, batch.rollout, cfg)
        _dump_samples(out / "samples" / f"step_{step}.jsonl", records)
    run.logger.log(step, row)
    run.logger.summary(step, cfg.steps, row)
    progress.step_done()
    _stop_after_nonfinite_steps(run, step, result.stats.nonfinite)
    signum = preempt.pending(run.world, run.device)  # SIGTERM/SIGINT during this step
    due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps
    if due or signum is not None:
        save_checkpoint(run, step)
    if signum is not None:
        where = run.ckpt_root / ckpt.step_dir_name(step)
        raise Preempted(
            f"{signal.Signals(signum).name} during step {step}: checkpoint {where} written "
            "after it; resume=true continues from there",
            signum,
        )


def _stop_after_nonfinite_steps(run: Run, step: int, what: str) -> None:
    """``TrainingStopped`` after ``train.max_nonfinite_steps`` steps in a row whose update was
    not applied (``TrainState.nonfinite_run``); ``what``: this step's non-finite quantities."""
    limit, n = run.cfg.train.max_nonfinite_steps, run.state.nonfinite_run
    if n < limit:
        return
    latest = ckpt.latest_checkpoint(run.ckpt_root)
    first = step - n + 1
    raise TrainingStopped(
        f"steps {first}-{step}: {n} steps in a row with a non-finite "
        f"{what} (train.max_nonfinite_steps={limit}), none "
        f"applied (the weights are step {first - 1}'s); "
        + (f"{latest} is intact" if latest else "no checkpoint was written yet")
        + ": lower train.lr or train.grad_clip, or check the rewards, then resume=true"
    )


def finish(run: Run, t_start: float) -> None:
    """The final checkpoint and model. With checkpoints on, the last step leaves one too (the
    loop skips it), so that ``resume=true steps=N`` extends a finished run from its final step."""
    cfg = run.cfg
    last = ckpt.latest_checkpoint(run.ckpt_root)
    if cfg.checkpoint_every and (last is None or last.name != ckpt.step_dir_name(run.state.step)):
        save_checkpoint(run, run.state.step)
    if run.world.is_main:
        save_dtype = None if cfg.train.save_dtype == "auto" else getattr(torch, cfg.train.save_dtype)
        ckpt.save_pretrained_atomic(run.model, run.tokenizer, run.out / "final", dtype=save_dtype)
        run.logger.event(
            f"done: {cfg.steps} steps in {time.perf_counter() - t_start:.1f}s; model in {run.out / 'final'}"
        )
    dist.barrier()
    run.logger.close()


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
