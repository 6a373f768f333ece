"""The end of a step: health checks, evaluation, samples and the metrics line; then the stops
(non-finite steps in a row, a pending SIGTERM/SIGINT) and the periodic checkpoint. And the end
of the run: the final checkpoint and model, and the summary on stdout (where the model is, the
final evaluation, the report's command).

A signal during an evaluation ends it after its current generate chunk (one process): the
step's row is written without it, the step is checkpointed and the run stops.
"""

from __future__ import annotations

import json
import signal
import time
from pathlib import Path

import torch

from grpo_fast import dist, threads
from grpo_fast.errors import EngineError, Preempted, TrainingStopped
from grpo_fast.loop import preempt
from grpo_fast.loop.agreement import agree
from grpo_fast.loop.checkpointing import engine_stopped, save_checkpoint
from grpo_fast.loop.state import Run
from grpo_fast.obs.metrics import PhaseProgress
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.policy import parallel
from grpo_fast.policy.lora import is_lora, merged_model
from grpo_fast.tools.evaluate import evaluate_sets, tool_record


def evaluate_run(run: Run, step: int, full: bool, progress: PhaseProgress | None = None) -> dict[str, float]:
    """Every eval set's subset (``full``: all its problems) at the ``eval`` section's sampling,
    split over ranks (``evaluate_sets``: the metrics ``eval/<set>/...`` and the first set's
    ``eval/...``; ``full``: ``eval_full/``); rank 0 writes each set's first
    ``logging.samples_per_dump`` records to ``samples/eval_step_<step>.jsonl``."""
    share = lambda s: len((s.task.eval if full else s.subset)[run.world.dp.rank :: run.world.dp.size])
    preempt.check_unit()  # a signal before it began: not a chunk of it
    if progress is not None:
        progress.phase("eval", sum(share(s) for s in run.eval_sets))
    advance = preempt.unit_callback(progress.advance_phase if progress is not None else None)
    with run.generation_weights(), preempt.rewards_abandonable():  # a reward that hangs: Interrupt
        metrics, records = evaluate_sets(
            run.eval_backend(),
            run.eval_sets,
            run.cfg,
            run.device,
            full=full,
            prefix="eval_full/" if full else "eval/",
            world=run.world,
            progress=advance,
            graded=lambda error: agree(run.agree, run.world, error, what="evaluation"),  # every rank together
        )
    if run.world.is_main:
        n = run.cfg.logging.samples_per_dump
        firsts = [rec for s in run.eval_sets for rec in [r for r in records if r["set"] == s.name][:n]]
        _dump_samples(run.out / "samples" / f"eval_step_{step}.jsonl", firsts)
    return metrics


def end_of_step(run: Run, step: int, batch, result, row: dict, progress: PhaseProgress) -> None:
    """Health checks, evaluation, samples and the metrics line; then the stops (non-finite
    steps in a row, a pending SIGTERM/SIGINT) and the periodic checkpoint."""
    cfg, out = run.cfg, run.out
    warnings = []  # printed after the step's own line
    if threads.follower is not None:  # threads.intra_op=auto on a CPU run: this step's count, then the next's
        row["time/cpu_threads"] = torch.get_num_threads()
        if (change := threads.follow_machine()) is not None:
            warnings.append(f"step {step}: {change}")
    if cfg.health.enabled:
        for ev in run.health.update(step, row, batch.rollout.response_text):
            row[f"health/{ev.kind}"] = ev.value
            warnings.append(f"[health] step {step} {ev.severity}: {ev.message} — {ev.suggestion}")
            if run.world.is_main:
                with open(out / "health.jsonl", "a") as fh:
                    fh.write(json.dumps(ev.to_dict()) + "\n")
    cut = None  # the signal that cut this step's evaluation short
    try:
        if cfg.eval_every and (step % cfg.eval_every == 0 or step == cfg.steps) and run.eval_subset_size:
            t0 = time.perf_counter()
            row.update(evaluate_run(run, step, full=False, progress=progress))
            row["time/eval_s"] = time.perf_counter() - t0
        if cfg.full_eval_every and (step % cfg.full_eval_every == 0 or step == cfg.steps):
            t0 = time.perf_counter()
            row.update(evaluate_run(run, step, full=True, progress=progress))
            row["time/eval_full_s"] = time.perf_counter() - t0
    except preempt.Interrupt as stop:
        cut = stop.signum
    except EngineError as exc:  # the engine apart died during the evaluation: the row without it
        run.logger.log(step, row)
        progress.step_done()
        raise engine_stopped(run, step, exc, f"step {step}'s evaluation (the step's row has none)") from None
    if run.world.is_main and cfg.logging.sample_every and step % cfg.logging.sample_every == 0:
        records = _sample_records(
            run.task, batch.rollout, cfg.logging.samples_per_dump, tools=cfg.rollout.environment != "none"
        )
        _dump_samples(out / "samples" / f"step_{step}.jsonl", records)
    run.logger.log(step, row)
    run.logger.summary(step, cfg.steps, row)
    for line in warnings:
        run.logger.event(line)
    progress.step_done()
    _stop_after_nonfinite_steps(run, step, result.stats.nonfinite)
    signum = cut or preempt.pending(run.world, run.device)  # SIGTERM/SIGINT during this step
    due = cfg.checkpoint_every and step % cfg.checkpoint_every == 0 and step < cfg.steps
    if due or signum is not None:
        save_checkpoint(run, step)
        signum = signum or preempt.pending(run.world, run.device)  # or during the write
    if signum is not None:
        where = run.ckpt_root / ckpt.step_dir_name(step)
        during = f"step {step}'s evaluation (cut short: the step's row has none)" if cut else f"step {step}"
        raise Preempted(
            f"{signal.Signals(signum).name} during {during}: checkpoint {where} written "
            "after it; resume=true continues from there",
            signum,
        )


def _stop_after_nonfinite_steps(run: Run, step: int, what: str) -> None:
    """``TrainingStopped`` after ``train.max_nonfinite_steps`` steps in a row whose update was
    not applied (``TrainState.nonfinite_run``); ``what``: this step's non-finite quantities."""
    limit, n = run.cfg.train.max_nonfinite_steps, run.trainer.state.nonfinite_run
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


def finish(run: Run, t_start: float, first: int = 0) -> None:
    """The final checkpoint and model. With checkpoints on, the last step leaves one too (the
    loop skips it), so that ``resume=true steps=N`` extends a finished run from its final step.
    ``first``: the step this process started after (a resume's), for the summary."""
    cfg = run.cfg
    last = ckpt.latest_checkpoint(run.ckpt_root)
    if cfg.checkpoint_every and (last is None or last.name != ckpt.step_dir_name(run.trainer.state.step)):
        save_checkpoint(run, run.trainer.state.step)
    save_dtype = None if cfg.train.save_dtype == "auto" else getattr(torch, cfg.train.save_dtype)
    # FSDP: gathered once, by every rank; written by rank 0 (under LoRA: the adapter)
    final, is_main = run.out / "final", run.world.is_main
    sharded = parallel.save_full_model(
        run.model, run.trainer.policy_loss, run.tokenizer, final, is_main, save_dtype
    )
    if run.world.is_main:
        if is_lora(run.model):  # the adapter in peft's format; merged for serving on request
            if not sharded:
                ckpt.save_pretrained_atomic(run.model, run.tokenizer, run.out / "final")
            if cfg.train.save_merged:
                merged = merged_model(run.out / "final", save_dtype)
                ckpt.save_pretrained_atomic(merged, run.tokenizer, run.out / "final_merged")
        elif not sharded:
            ckpt.save_pretrained_atomic(run.model, run.tokenizer, run.out / "final", dtype=save_dtype)
        print(_summary(run, time.perf_counter() - t_start, first), flush=True)
    dist.barrier()
    run.logger.close()


def _summary(run: Run, seconds: float, first: int) -> str:
    """The run's result, for stdout: the steps this process ran and the step reached, the final
    model's folder, the last evaluation, the report's command."""
    step, n = run.trainer.state.step, run.trainer.state.step - first
    ran = f"{n} step{'s' * (n != 1)} in {seconds:.1f}s"
    if first:
        ran += f" (resumed at step {first}; now at step {step})"
    lines = [f"done: {ran}; model in {run.out / 'final'}"]
    last = run.logger.last_eval()
    if last is not None:
        lines.append(f"final eval: {last[1]} {last[2]:.3f} at step {last[0]}")
    lines.append(f"report: grpo-fast report {run.out}")
    return "\n".join(lines)


def _sample_records(task, rollout, limit: int, tools: bool = False) -> list[dict]:
    """The first ``limit`` responses of the batch as sample records: prompt, response, ground
    truth, what the reward function scored (in the rollout phase: scored once), length, finish;
    ``tools`` (``rollout.environment``): the tool calls' count and the turns (``tool_record``)."""
    recs = []
    for group in rollout.groups:
        for t in group.trajectories:
            if len(recs) == limit:
                return recs
            ex = group.example
            recs.append(
                {
                    "prompt": task.prompt_text(ex),
                    "response": t.text,
                    "ground_truth": ex.answer,
                    **t.scores,
                    "length": t.num_tokens,
                    "finish_reason": t.finish_reason,
                    **(tool_record(t, task.tokenizer) if tools else {}),
                }
            )
    return recs


def _dump_samples(path: Path, records: list[dict]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w") as fh:
        for rec in records:
            fh.write(json.dumps(rec) + "\n")
