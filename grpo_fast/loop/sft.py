"""A supervised warm start before GRPO: NLL of ``answer + EOS`` given the prompt (a task may ask
for its worked solutions instead, ``TaskSpec.warm_start``; with ``rollout.environment`` they are
demonstrations whose tool outputs are inserted as in a rollout, context and never targets).

Like a real run starts from a pretrained base model, the tiny task starts from a model that
solves some of its problems: GRPO needs groups with mixed rewards to learn anything.
``sft.target_accuracy`` stops the warm start as soon as greedy accuracy on a sample of
*training* problems (never the eval set) reaches the target, so GRPO always starts from a
comparable base, whatever the seed (without it, 350 steps gave 0.22–0.51 across seeds 0–2).

It runs through the same fused lm_head + loss path as GRPO: with advantage 1, on-policy and
``sequence_mean`` weights, the GRPO loss gradient is exactly the per-sequence mean NLL gradient
(−Σ w·∇log π), and the NLL itself is read off the returned log-probs. Logged separately, to
``sft_metrics.jsonl`` (a line at a time, flushed), so the GRPO curve in ``metrics.jsonl`` shows
only what GRPO did. Every data-parallel rank runs the same warm start (same seed, same batches,
same weights).

It shows a progress bar with the time left (on a terminal) and a line every 100 steps or 30 s
with the most time it can still take. SIGTERM/SIGINT stop it after the current step: its
progress (weights, optimizer, batch order, RNGs) goes to ``checkpoints/sft_warm_start``, which
``resume=true`` continues from, exactly as if it had not stopped.
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

from grpo_fast import dist, threads
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import Config, EvalConfig
from grpo_fast.errors import Preempted
from grpo_fast.loop import preempt
from grpo_fast.loop.checkpointing import load_sft_progress, remove_sft_progress, save_sft_progress
from grpo_fast.loop.optim import adamw, fused_optimizer, lora_lr_scale
from grpo_fast.obs.metrics import PhaseProgress, format_eta
from grpo_fast.policy.batch import assign_loss_weights, make_microbatches
from grpo_fast.policy.lora import is_lora
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout import Trajectory, multi_turn


def sft_warm_start(
    cfg: Config,
    model,
    tokenizer,
    task,
    device,
    amp,
    out_dir: Path | None,
    logger,
    world: dist.DistInfo | None = None,
    resume_from: Path | None = None,
) -> int:
    """Run the warm start (from a stopped one's progress with ``resume_from``); returns the
    number of SFT steps taken. ``out_dir``: where rank 0 writes (None on the other ranks)."""
    from grpo_fast.rollout.hf import HFBackend
    from grpo_fast.tools.evaluate import evaluate

    s = cfg.sft
    rng = random.Random(cfg.seed + 1)
    check_set = random.Random(cfg.seed + 2).sample(task.train, min(s.check_size, len(task.train)))
    tools = multi_turn.from_config(cfg, tokenizer)  # rollout.environment: demonstrations and checks use it
    checker = HFBackend(
        model, tokenizer, generation_batch_size=max(len(check_set), 1), autocast_dtype=amp, tools=tools
    )
    lr = s.lr * (lora_lr_scale(cfg) if is_lora(model) else 1.0)  # a warm start on the adapter: its lr
    trained = [p for p in model.parameters() if p.requires_grad]
    optimizer = adamw(trained, fused_optimizer(cfg, trained), lr=lr, weight_decay=0.0)
    policy = PolicyLoss(model, autocast=amp, backend=cfg.loss.kernel_backend)
    options = LossOptions()  # advantage 1, on-policy, sequence-mean weights: the NLL's gradient
    model.train()
    start, t0 = 0, time.perf_counter()
    if resume_from is not None:  # a stopped warm start: its weights, optimizer, batch order, RNGs
        start = load_sft_progress(resume_from, model, optimizer, rng)
        logger.event(f"sft warm start: resumed from {resume_from} after step {start}")
    step, world, shown = start, world or dist.DistInfo(), [t0]
    show_bar = cfg.logging.progress and out_dir is not None
    with _sft_log(out_dir, start) as log, PhaseProgress(show_bar, s.steps, start, "SFT warm start") as bar:
        for step in range(start + 1, s.steps + 1):
            batch = [task.train[rng.randrange(len(task.train))] for _ in range(s.batch_size)]
            prompts = [task.prompt_ids(e) for e in batch]
            seqs = _targets(task, batch, prompts, tokenizer, tools, cfg.rollout.max_tokens)
            assign_loss_weights(seqs, length_norm="sequence_mean", max_length=1)
            nll = 0.0
            for mb in make_microbatches(seqs, len(seqs), tokenizer.pad_token_id, packing=False):
                mb = mb.to(device)
                out = policy(mb, options, temperature=1.0)
                out.loss.backward()
                nll += -(mb.loss_weights * out.logprobs).sum().item()  # host-device sync
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # none left behind for GRPO's first rollout
            row = {"step": step, "sft/loss": nll, "sft/lr": lr}
            reached = False
            if s.target_accuracy is not None and step % s.check_every == 0:
                # one greedy answer a problem, whatever eval.* asks of the evaluations
                metrics, _ = evaluate(checker, task, check_set, cfg, device, sampling=EvalConfig())
                row["sft/train_accuracy"] = metrics["accuracy"]
                reached = metrics["accuracy"] >= s.target_accuracy
            row["time/elapsed_s"] = time.perf_counter() - t0
            if log is not None and ("sft/train_accuracy" in row or step % 10 == 0 or step == s.steps):
                log.write(json.dumps(row) + "\n")
            bar.step_done()
            _progress_line(logger, s, step, start, row, reached, shown)
            if (change := threads.follow_machine()) is not None:  # threads.intra_op=auto on a CPU
                logger.event(f"sft warm start, step {step}: {change}")
            if reached:
                logger.event(
                    f"sft warm start: reached sft.target_accuracy={s.target_accuracy} after {step} steps"
                )
                break
            signum = preempt.pending(world, device)  # SIGTERM/SIGINT: stop after this step
            if signum is not None:
                saved = None
                if out_dir is not None:  # rank 0
                    saved = save_sft_progress(out_dir, model, tokenizer, step, optimizer, rng)
                raise Preempted(
                    f"{preempt.signal_name(signum)} during the SFT warm start, after step {step} of at "
                    f"most {s.steps}: its progress is in {saved or 'checkpoints/sft_warm_start'}; "
                    "resume=true continues it",
                    signum,
                )
    if out_dir is not None:
        remove_sft_progress(out_dir)  # done: a resume now starts from GRPO's checkpoints
    return step


def _targets(task, batch, prompts, tokenizer, tools, max_tokens: int) -> list[Trajectory]:
    """The warm start's sequences: ``task.warm_start_text`` + EOS after each prompt, every token a
    label; with a tool environment the text is a demonstration, run through it
    (``multi_turn.demonstrations``): the tool's outputs are inserted tokens, context only."""
    texts = [task.warm_start_text(e) for e in batch]
    if tools is not None:
        seqs = multi_turn.demonstrations(tools, prompts, texts, max_tokens)
        for t in seqs:
            t.advantage = 1.0
        return seqs
    eos = [tokenizer.eos_token_id]
    # one batched call (the fast tokenizer's; the same ids as a call a text): 1.6 -> 0.8 ms for 64
    answers = [ids + eos for ids in tokenizer(texts, add_special_tokens=False)["input_ids"]]
    return [Trajectory.single_turn(p, a, advantage=1.0) for p, a in zip(prompts, answers)]


def _sft_log(out_dir: Path | None, start: int):
    """``sft_metrics.jsonl``, line-buffered (each row reaches the file as it is written); after a
    resume at step ``start``, the rows up to it kept and the rest dropped."""
    if out_dir is None:
        return contextlib.nullcontext()
    path = out_dir / "sft_metrics.jsonl"
    if start == 0 or not path.is_file():
        return open(path, "w", buffering=1)
    kept = [ln for ln in path.read_text().splitlines() if ln.strip() and _step_of(ln) <= start]
    path.write_text("".join(ln + "\n" for ln in kept))
    return open(path, "a", buffering=1)


def _step_of(line: str) -> int:
    try:
        return int(json.loads(line)["step"])
    except (ValueError, KeyError, TypeError):
        return 1 << 62  # a partial last line (killed mid-write): dropped


def _progress_line(logger, s, step: int, start: int, row: dict, reached: bool, shown: list[float]) -> None:
    """A line at the first accuracy check, every 100 steps, every 30 s, at the end: the NLL, the
    train accuracy when checked, the time so far and the most the rest can take."""
    now, elapsed = time.perf_counter(), row["time/elapsed_s"]
    first_check = step == start + (s.check_every if s.target_accuracy is not None else 10)
    if not (reached or first_check or step % 100 == 0 or step == s.steps or now - shown[0] >= 30):
        return
    shown[0] = now
    acc = f"  train accuracy {row['sft/train_accuracy']:.3f}" if "sft/train_accuracy" in row else ""
    left = ""
    if not reached and step < s.steps:
        left = f"  (at most {format_eta(elapsed / (step - start) * (s.steps - step))} left)"
    logger.event(f"sft warm start {step}/{s.steps}  nll {row['sft/loss']:.3f}{acc}  {elapsed:.1f}s{left}")
