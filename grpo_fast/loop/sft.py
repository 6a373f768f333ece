"""A supervised warm start before GRPO: NLL of ``answer + EOS`` given the prompt.

Like a real run starts from a pretrained base model, the tiny task starts from a model that
solves some of its problems: GRPO needs groups with mixed rewards to learn anything.
``sft.target_accuracy`` stops the warm start as soon as greedy accuracy on a sample of
*training* problems (never the eval set) reaches the target, so GRPO always starts from a
comparable base, whatever the seed (without it, 350 steps gave 0.22–0.51 across seeds 0–2).

It runs through the same fused lm_head + loss path as GRPO: with advantage 1, on-policy and
``sequence_mean`` weights, the GRPO loss gradient is exactly the per-sequence mean NLL gradient
(−Σ w·∇log π), and the NLL itself is read off the returned log-probs. Logged separately, to
``sft_metrics.jsonl``, so the GRPO curve in ``metrics.jsonl`` shows only what GRPO did. Every
data-parallel rank runs the same warm start (same seed, same batches, same weights).
"""

from __future__ import annotations

import contextlib
import json
import random
import time
from pathlib import Path

import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import Config
from grpo_fast.policy.batch import build_sequences, make_microbatches
from grpo_fast.policy.loss import PolicyLoss


def sft_warm_start(cfg: Config, model, tokenizer, task, device, amp, out_dir: Path | None, logger) -> int:
    """Run the warm start; returns the number of SFT steps taken."""
    from grpo_fast.rollout.hf import HFBackend
    from grpo_fast.tools.evaluate import evaluate

    s = cfg.sft
    rng = random.Random(cfg.seed + 1)
    check_set = random.Random(cfg.seed + 2).sample(task.train, min(s.check_size, len(task.train)))
    checker = HFBackend(model, tokenizer, generation_batch_size=max(len(check_set), 1), autocast_dtype=amp)
    optimizer = torch.optim.AdamW(
        [p for p in model.parameters() if p.requires_grad], lr=s.lr, weight_decay=0.0
    )
    policy = PolicyLoss(model, autocast=amp, backend=cfg.loss.kernel_backend)
    options = LossOptions()  # advantage 1, on-policy, sequence-mean weights: the NLL's gradient
    model.train()
    t0 = time.perf_counter()
    step = 0
    with open(out_dir / "sft_metrics.jsonl", "w") if out_dir is not None else contextlib.nullcontext() as log:
        for step in range(1, s.steps + 1):
            batch = [task.train[rng.randrange(len(task.train))] for _ in range(s.batch_size)]
            prompts = [task.prompt_ids(e) for e in batch]
            eos = [tokenizer.eos_token_id]
            answers = [tokenizer(e.answer, add_special_tokens=False)["input_ids"] + eos for e in batch]
            seqs = build_sequences(
                prompts, answers, torch.ones(len(batch)), length_norm="sequence_mean", max_length=1
            )
            nll = 0.0
            for mb in make_microbatches(seqs, len(seqs), tokenizer.pad_token_id, packing=False):
                mb = mb.to(device)
                out = policy(mb, options, temperature=1.0)
                out.loss.backward()
                nll += -(mb.loss_weights * out.logprobs).sum().item()  # host-device sync
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)  # none left behind for GRPO's first rollout
            row = {"step": step, "sft/loss": nll, "sft/lr": s.lr}
            reached = False
            if s.target_accuracy is not None and step % s.check_every == 0:
                metrics, _ = evaluate(checker, task, check_set, cfg, device)
                row["sft/train_accuracy"] = metrics["accuracy"]
                reached = metrics["accuracy"] >= s.target_accuracy
            row["time/elapsed_s"] = time.perf_counter() - t0
            if log is not None and ("sft/train_accuracy" in row or step % 10 == 0 or step == s.steps):
                log.write(json.dumps(row) + "\n")
            if reached or step % 100 == 0 or step == s.steps:
                acc = (
                    f"  train accuracy {row['sft/train_accuracy']:.3f}" if "sft/train_accuracy" in row else ""
                )
                logger.event(
                    f"sft warm start {step}/{s.steps}  nll {nll:.3f}{acc}  {row['time/elapsed_s']:.1f}s"
                )
            if reached:
                logger.event(
                    f"sft warm start: reached sft.target_accuracy={s.target_accuracy} after {step} steps"
                )
                break
    return step
