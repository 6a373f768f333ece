"""Evaluation: ``eval.k`` answers to each problem of each ``eval.sets`` set, at the ``eval``
section's sampling (greedy by default), graded by the set's reward (docs/evaluation.md).

In the loop: a fixed subset of each set every ``eval_every`` steps, every problem every
``full_eval_every``. Standalone, the same figures for a checkpoint or hub model:

    grpo-fast evaluate --model PATH [--preset NAME] [--sets A,B] [--k K] [--temperature T]
        [--top-p P] [--max-tokens N] [--limit N | --subset] [--out F.jsonl] [key=value ...]

Metrics per set, ``eval/<set>/``: ``avg@k`` (the share of the k·problems samples correct:
``grpo_fast.task.rewards.correct``), ``pass@j`` for j = 2, 4, ... and k (``pass_at_k``, Chen et
al. 2021's unbiased estimator, averaged over problems), ``format_rate`` (mean format reward),
``reward_mean``, ``response_length_mean`` (tokens), ``truncated_fraction``, ``num_examples``
(problems); with a tool environment (``rollout.environment``) also ``tool_call_rate`` (the share
of responses that called the tool) and ``tool_calls_mean``, and each record holds its turns. The
first set's are also ``eval/accuracy`` (= its avg@k), ``eval/format_rate``, ...: the headline.
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
from grpo_fast.rollout.sampling import eval_seed, sampling_params, sampling_rng
from grpo_fast.task.data import Example
from grpo_fast.task.loader import load_eval_sets
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
    seed: int | None = None,
    sampling=None,
):
    """Grade ``examples`` (this rank's share of them under data parallelism), ``eval.k`` samples
    each at the ``eval`` section's sampling (``sampling_params(for_eval=cfg.eval)``), drawn with
    ``seed`` when the temperature is above 0 (``sampling.eval_seed``: this rank's); ``sampling``:
    another ``EvalConfig`` to sample with (the SFT warm start's check: its defaults, one greedy answer).

    Returns ``(metrics, records)``: metrics over all ranks; records (prompt, response, ground
    truth, reward parts, length; ``sample``: its index among the problem's k) for this rank's
    examples, problem by problem. ``metrics["accuracy"]`` is the share of the k·problems samples
    that are correct (avg@k); with k > 1 also ``pass@j`` for j = 2, 4, 8, ... and k (``pass_at_k``,
    averaged over problems); ``num_examples`` counts problems. ``graded``: called on every rank once
    its share is graded, with what the generation or grading raised (or None), before the ranks'
    sums; it raises when any rank failed (the loop's agreement, ``grpo_fast.loop.agreement``), so
    that no rank waits in the sums for one that stopped. Without it an error is raised at once.
    """
    world = world or dist.DistInfo()
    mine = examples[world.dp.rank :: world.dp.size]  # this data-parallel rank's share
    params = sampling_params(cfg.rollout, task.stop, for_eval=sampling or cfg.eval, seed=seed)
    k = params.n
    tools = getattr(backend, "tools", None) is not None  # rollout.environment: the turns too
    records, error = [], None
    try:
        if mine:
            with sampling_rng(params.seed, device):  # the hf decoder on the trainer's model
                rollout = backend.generate([task.prompt_ids(e) for e in mine], params, progress=progress)
            backend.sleep()
            # prompt-major: problem i's k samples are trajectories i·k .. i·k + k − 1
            records = [
                {**_record(task, ex, t, tools), **({"sample": j} if k > 1 else {})}
                for i, ex in enumerate(mine)
                for j, t in enumerate(rollout.trajectories[i * k : (i + 1) * k])
            ]
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
    js = pass_ks(k)
    right = [int(sum(r["correct"] for r in records[i * k : (i + 1) * k])) for i in range(len(records) // k)]
    passes = [sum(pass_at_k(k, c, j) for c in right) for j in js]
    acc, fmt, rew, length, trunc, n, *passes = dist.all_reduce_sum(
        [acc, fmt, rew, length, trunc, len(records), *passes], device, axis=world.dp
    )
    n = max(n, 1.0)
    problems = n / k
    metrics = {
        "accuracy": acc / n,
        "format_rate": fmt / n,
        "reward_mean": rew / n,
        "response_length_mean": length / n,
        "truncated_fraction": trunc / n,
        "num_examples": problems,
        **{f"pass@{j}": p / problems for j, p in zip(js, passes)},
    }
    if tools:  # the share of responses that called the tool, and the calls per response
        calling = sum(rec["tool_calls"] > 0 for rec in records)
        calls = sum(rec["tool_calls"] for rec in records)
        calling, calls = dist.all_reduce_sum([calling, calls], device, axis=world.dp)
        metrics.update(tool_call_rate=calling / n, tool_calls_mean=calls / n)
    return metrics, records


def evaluate_sets(
    backend,
    sets,
    cfg: Config,
    device: torch.device,
    *,
    full: bool = True,
    prefix: str = "eval/",
    world: dist.DistInfo | None = None,
    progress=None,
    graded=None,
):
    """``evaluate`` on each of ``sets`` (``grpo_fast.task.eval_sets.EvalSet``: ``full``: every
    problem, else its subset), each set with its own template, reward and seed
    (``sampling.eval_seed``).

    Returns ``(metrics, records)``. Metrics: each set's under ``<prefix><set>/`` (``avg@k``, the
    ``pass@j``, ``format_rate``, ``reward_mean``, ``response_length_mean``, ``truncated_fraction``,
    ``num_examples``, with tools ``tool_call_rate`` and ``tool_calls_mean``), and the first set's also
    under ``<prefix>`` by ``evaluate``'s names (``eval/accuracy``: the headline the console line,
    the report, the sweep and ``health`` read). Records: this rank's, each with its ``set``.
    """
    world = world or dist.DistInfo()
    metrics, records = {}, []
    for i, s in enumerate(sets):
        seed = eval_seed(cfg.seed, s.name, world.dp.rank)
        examples = s.task.eval if full else s.subset
        m, recs = evaluate(backend, s.task, examples, cfg, device, world, progress, graded, seed=seed)
        if i == 0:
            metrics.update({prefix + key: v for key, v in m.items()})
        avg = f"avg@{cfg.eval.k}"
        metrics.update({f"{prefix}{s.name}/{avg if key == 'accuracy' else key}": v for key, v in m.items()})
        records += [{"set": s.name, **rec} for rec in recs]
    return metrics, records


def pass_at_k(n: int, c: int, k: int) -> float:
    """The unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct (Chen et al.
    2021, "Evaluating Large Language Models Trained on Code", eq. 1): the chance that at least one
    of ``k`` samples drawn without replacement from the ``n`` is correct,
    ``1 − C(n − c, k) / C(n, k)``, computed as ``1 − Π_{i = n−c+1}^{n} (1 − k / i)`` (no huge
    binomials). ``pass_at_k(n, c, 1) == c / n``.

    Example: ``pass_at_k(4, 1, 2) == 0.5`` (1 − C(3, 2)/C(4, 2) = 1 − 3/6).
    """
    if not 1 <= k <= n or not 0 <= c <= n:
        raise ValueError(f"pass_at_k needs 1 <= k <= n and 0 <= c <= n, got n={n}, c={c}, k={k}")
    if n - c < k:  # every draw of k holds a correct one
        return 1.0
    prod = 1.0
    for i in range(n - c + 1, n + 1):
        prod *= 1.0 - k / i
    return 1.0 - prod


def pass_ks(k: int) -> list[int]:
    """The j of the ``pass@j`` metrics an evaluation of ``k`` samples a problem logs: 2, 4, 8, ...
    below ``k``, and ``k`` (none for k = 1: pass@1 is ``accuracy``, avg@k's estimate).

    >>> pass_ks(1), pass_ks(8), pass_ks(12)
    ([], [2, 4, 8], [2, 4, 8, 12])
    """
    if k < 2:
        return []
    js, j = [], 2
    while j < k:
        js.append(j)
        j *= 2
    return [*js, k]


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
    p.add_argument("--sets", default=None, metavar="A,B", help="eval.sets: the sets by name, comma-separated")
    p.add_argument("--k", type=int, default=None, help="eval.k: samples per problem (pass@k, avg@k)")
    p.add_argument(
        "--temperature",
        type=float,
        default=None,
        help="eval.temperature (0 = greedy; default auto: greedy at k = 1, rollout.temperature above)",
    )
    p.add_argument("--top-p", type=float, default=None, help="eval.top_p")
    p.add_argument(
        "--max-tokens", type=int, default=None, help="eval.max_tokens (default: rollout.max_tokens)"
    )
    p.add_argument("--limit", type=int, default=None, help="evaluate the first N problems of each set only")
    p.add_argument(
        "--subset",
        action="store_true",
        help="each set's subset the loop's eval_every grades (data.eval_subset_size, seed)",
    )
    p.add_argument("--out", default=None, help="write per-problem records (JSONL) here")
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_args(argv)


def _eval_overrides(args) -> list[str]:
    """The ``eval.*`` overrides the flags stand for (after the user's ``key=value``: the flags win)."""
    out = []
    if args.sets is not None:
        names = [n.strip() for n in args.sets.split(",")]
        if not all(names):
            raise ConfigError(f"--sets {args.sets!r}: an empty set name (give names separated by commas)")
        out.append("eval.sets=[" + ",".join(names) + "]")
    for flag, key in (
        ("k", "k"),
        ("temperature", "temperature"),
        ("top_p", "top_p"),
        ("max_tokens", "max_tokens"),
    ):
        if getattr(args, flag) is not None:
            out.append(f"eval.{key}={getattr(args, flag)}")
    return out


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
    overrides = [*args.overrides, *_eval_overrides(args), f"model.name_or_path={base or args.model}"]
    cfg = load_config(args.preset, args.config, overrides)
    device = resolve_device(cfg)
    tokenizer = load_tokenizer(args.model if base is not None else cfg.model.name_or_path)
    task = load_task(cfg, tokenizer)
    sets = load_eval_sets(cfg, task)
    for s in sets:
        s.task.tokenizer = tokenizer
        s.task.eval = (s.subset if args.subset else s.task.eval)[: args.limit]  # --limit None: all
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
    metrics, records = evaluate_sets(backend, sets, cfg, device)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        with open(args.out, "w") as fh:
            for rec in records:
                fh.write(json.dumps(rec) + "\n")
    print(json.dumps(metrics, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
