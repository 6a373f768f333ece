"""Evaluation: greedy (or ``rollout.eval_temperature``) answers to eval problems, graded by the task's reward.

In the loop: a fixed subset every ``eval_every`` steps, the whole set every ``full_eval_every``.
Standalone, a zero-shot baseline of any checkpoint or hub model:

    python -m grpo_fast.evaluate --model PATH [--preset NAME] [--limit N] [--out F.jsonl] [key=value ...]

Metrics: ``accuracy`` (the share of responses correct: ``grpo_fast.task.rewards.correct``), ``format_rate`` (mean format reward),
``reward_mean``, ``response_length_mean`` (tokens), ``truncated_fraction``; with a tool
environment (``rollout.environment``) also ``tool_call_rate`` (the share of responses that called
the tool) and ``tool_calls_mean``, and each record holds its turns.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import sys
from pathlib import Path

import torch

from grpo_fast import dist
from grpo_fast.config import Config, load_config
from grpo_fast.errors import ConfigError, UserError, cli_errors
from grpo_fast.policy.checkpoint import check_model_folder
from grpo_fast.rollout.multi_turn import turn_texts
from grpo_fast.rollout.sampling import sampling_params
from grpo_fast.task.data import Example
from grpo_fast.task.rewards import correct


def evaluate(
    backend,
    task,
    examples: list[Example],
    cfg: Config,
    device: torch.device,
    world: dist.DistInfo | None = None,
    progress=None,
    graded=None,
):
    """Grade ``examples`` (this rank's share of them under data parallelism).

    Returns ``(metrics, records)``: metrics over all ranks; records (prompt, response, ground
    truth, reward parts, length) for this rank's examples. ``graded``: called on every rank once
    its share is graded, with what the generation or grading raised (or None), before the ranks'
    sums; it raises when any rank failed (the loop's agreement, ``grpo_fast.loop.agreement``), so
    that no rank waits in the sums for one that stopped. Without it an error is raised at once.
    """
    world = world or dist.DistInfo()
    mine = examples[world.dp.rank :: world.dp.size]  # this data-parallel rank's share
    params = sampling_params(cfg.rollout, task.stop, for_eval=True)
    tools = getattr(backend, "tools", None) is not None  # rollout.environment: the turns too
    records, error = [], None
    try:
        if mine:
            rollout = backend.generate([task.prompt_ids(e) for e in mine], params, progress=progress)
            backend.sleep()
            records = [_record(task, ex, t, tools) for ex, t in zip(mine, rollout.trajectories)]
    except BaseException as exc:
        if graded is None:
            raise
        error = exc
    if graded is not None:
        graded(error)
    acc = sum(rec["correct"] for rec in records)
    fmt = sum(rec.get("format_reward", float("nan")) for rec in records)
    rew = sum(rec["reward"] for rec in records)
    length = sum(rec["length"] for rec in records)
    trunc = sum(rec["finish_reason"] == "length" for rec in records)
    acc, fmt, rew, length, trunc, n = dist.all_reduce_sum(
        [acc, fmt, rew, length, trunc, len(records)], device, axis=world.dp
    )
    n = max(n, 1.0)
    metrics = {
        "accuracy": acc / n,
        "format_rate": fmt / n,
        "reward_mean": rew / n,
        "response_length_mean": length / n,
        "truncated_fraction": trunc / n,
        "num_examples": n,
    }
    if tools:  # the share of responses that called the tool, and the calls per response
        calling = sum(rec["tool_calls"] > 0 for rec in records)
        calls = sum(rec["tool_calls"] for rec in records)
        calling, calls = dist.all_reduce_sum([calling, calls], device, axis=world.dp)
        metrics.update(tool_call_rate=calling / n, tool_calls_mean=calls / n)
    return metrics, records


def _record(task, ex: Example, t, tools: bool) -> dict:
    """One graded response's sample record (``tools``: with its tool calls and turns)."""
    return {
        "prompt": task.prompt_text(ex),
        "response": t.text,
        "ground_truth": ex.answer,
        **(scores := task.reward_fn(t.text, ex.answer)),
        "correct": correct(scores),  # the loop's rule (grpo_fast.task.rewards.correct)
        "length": t.num_tokens,
        "finish_reason": t.finish_reason,
        **(tool_record(t, task.tokenizer) if tools else {}),
    }


def tool_record(t, tokenizer) -> dict:
    """A multi-turn response's part of its sample record: its tool calls' count and its turns,
    each the text the model wrote and what the tool put back."""
    return {
        "tool_calls": len(t.tool_calls),
        "turns": turn_texts(t, lambda ids: tokenizer.decode(ids, skip_special_tokens=True)),
    }


def parse_args(argv, prog: str = "python -m grpo_fast.evaluate"):
    p = argparse.ArgumentParser(prog=prog, description=__doc__.split("\n\n")[0])
    p.add_argument("--model", required=True, help="a checkpoint folder, a hub name, or builtin:tiny")
    p.add_argument("--preset", default="tiny", help="the preset whose task, template and sampling to use")
    p.add_argument("--config", action="append", default=[], metavar="FILE.yaml")
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems only")
    p.add_argument("--out", default=None, help="write per-problem records (JSONL) here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def _name_the_flag(main):
    """The errors of loading ``--model`` (``model.name_or_path`` inside) name the flag the user
    typed: ``--model 'x': no such folder``."""

    @functools.wraps(main)
    def wrapper(*args, **kwargs):
        try:
            return main(*args, **kwargs)
        except UserError as exc:
            exc.args = (str(exc).replace("model.name_or_path=", "--model "),)
            raise

    return wrapper


@cli_errors
@_name_the_flag
def main(argv: list[str] | None = None, prog: str = "python -m grpo_fast.evaluate") -> int:
    from grpo_fast.policy.lora import adapter_base, load_with_adapter
    from grpo_fast.policy.model import (
        autocast_dtype,
        load_policy,
        load_tokenizer,
        quiet_transformers,
        resolve_device,
    )
    from grpo_fast.rollout import BackendContext, make_backend
    from grpo_fast.task.loader import load_task

    args = parse_args(argv, prog)
    if args.limit is not None and args.limit < 1:
        raise ConfigError(f"--limit must be at least 1 (the problems to evaluate), got {args.limit}")
    check_model_folder(args.model, "re-save or re-download the model")  # a damaged file: one line
    quiet_transformers()
    # A LoRA run's final/ (or checkpoint) is a peft adapter: its base from adapter_config.json
    base = adapter_base(Path(args.model)) if Path(args.model).is_dir() else None
    cfg = load_config(args.preset, args.config, [*args.overrides, f"model.name_or_path={base or args.model}"])
    device = resolve_device(cfg)
    tokenizer = load_tokenizer(args.model if base is not None else cfg.model.name_or_path)
    task = load_task(cfg, tokenizer)
    if base is None:
        model = load_policy(cfg, tokenizer, device)
    else:  # the base as the run had it (4-bit with model.load_in_4bit), then the trained adapter
        plain = dataclasses.replace(cfg.model, lora=dataclasses.replace(cfg.model.lora, r=0))
        model = load_with_adapter(
            load_policy(dataclasses.replace(cfg, model=plain), tokenizer, device), args.model
        )
    if cfg.model.name_or_path.startswith("builtin:"):
        print("note: builtin:tiny is a freshly initialized model (random weights)", file=sys.stderr)
    backend = make_backend(BackendContext(cfg, model, tokenizer, device, autocast_dtype(cfg, device)))
    examples = task.eval[: args.limit] if args.limit else task.eval
    metrics, records = evaluate(backend, task, examples, cfg, device)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    print(json.dumps({f"eval/{k}": v for k, v in metrics.items()}, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
