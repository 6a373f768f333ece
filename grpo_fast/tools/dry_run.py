"""``grpo-fast train --dry-run``: what a run would do, printed, without loading the model.

The resolved config with each value's source, the memory plan for the device, the data (counts,
a prompt as the model sees it). Touches no network for the model (hub configs and tokenizers come
from the local cache only). It refuses what the run refuses before it trains, with the run's own
lines (``tests/test_dry_run_refuses.py`` runs both over the same bad configs); what only the
model's modules tell (LoRA's target modules, the heads sequence parallelism splits) it checks on
the model's skeleton, built on the meta device from its config (no weights read).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

from grpo_fast.config import AUTO, Config, config_sources, load_config, validate
from grpo_fast.config_checks import check_paths
from grpo_fast.errors import ConfigError, UserError, one_line


def dry_run(preset: str, config_files: list[str], overrides: list[str]) -> int:
    """What ``train`` would run, printed: the resolved config with each value's source, the
    memory plan for the device, the data (counts, a prompt as the model sees it). Loads no
    model and touches no network for the model (hub tokenizers come from the local cache only).

    Returns 0, or 2 when the real run would stop on this machine (no CUDA for a GPU preset,
    data that cannot be loaded); each problem is one ``error:`` line.
    """
    import torch

    from grpo_fast.policy.model import quiet_transformers

    quiet_transformers()
    sources = config_sources(preset, config_files, overrides, check_device=False)
    cfg = load_config(preset, config_files, overrides, check_device=False)
    try:
        check_paths(cfg)  # a name no file can have: nothing below could open it, nor could the run
    except ConfigError as exc:
        print(f"error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    problems: list[str] = []
    try:
        validate(cfg, preset, check_device=True)
    except ConfigError as exc:
        problems.append(str(exc))
    problems += _run_problems(cfg)  # what the real run checks before it trains, the same lines
    skipped = None
    if not problems:  # what the model's modules tell, as the setup checks it once the model is built
        found, skipped = _model_problems(cfg)
        problems += found
    if not problems:  # a user's tool environment, built (its module's code runs: after the checks)
        problems += _environment_problems(cfg)

    print(f"dry run of preset {preset!r}: the resolved config (value  # source)")
    width = max(map(len, sources))
    for key, (value, source) in sources.items():
        print(f"  {key:<{width}} = {value!r:<24}  # {source}")

    print("\nmemory plan:")
    print(_plan_text(cfg, torch))
    from grpo_fast.tools.plan import clamp_micro_batch

    clamped = clamp_micro_batch(cfg)[1]  # the line the run prints (one rank)
    if clamped:
        print(f"  {clamped}")
    print("\n" + _sequence_parallel_text(cfg))

    print("\ndata:")
    try:
        from grpo_fast.task.loader import load_task

        task = load_task(cfg)
    except UserError as exc:
        problems.append(str(exc))
        print(f"  cannot load the data: {exc}")
    else:
        r = cfg.rollout
        n_prompts = r.prompts_per_step
        print(f"  task {task.name}: {len(task.train)} train / {len(task.eval)} eval examples")
        print(
            f"  per step: {n_prompts} prompts × {r.group_size} responses; {cfg.steps} steps use "
            f"{cfg.steps * n_prompts / max(len(task.train), 1):.2f} passes over the train set"
        )
        _print_eval_sets(cfg, task, problems)
        if task.train:
            _print_sample_prompt(task, cfg)
    if skipped is not None:
        print(f"\nmodel checks skipped: {skipped}")
    for msg in problems:
        print(f"error: {one_line(msg)}", file=sys.stderr)
    print("\ndry run: no model was loaded")
    return 2 if problems else 0


def _print_eval_sets(cfg: Config, task, problems: list[str]) -> None:
    """The eval sets as the run loads them (a set that cannot be read: the run's line, in
    ``problems``), each with its problems, template and the subset eval_every grades."""
    from grpo_fast.task.loader import load_eval_sets

    try:
        sets = load_eval_sets(cfg, task)
    except UserError as exc:
        problems.append(str(exc))
        print(f"  cannot load the eval sets: {exc}")
        return
    e = cfg.eval
    temp = e.sampling_temperature(cfg.rollout.temperature)
    how = "greedy" if temp == 0 else f"temperature {temp:g}, top_p {e.top_p:g}"
    when = evaluations(cfg) or "none (eval_every=0)"
    print(
        f"  eval: {when}, {e.k} sample{'s' * (e.k > 1)} a problem ({how}); full sets every {cfg.full_eval_every or 'never'}"
    )
    for s in sets:
        print(
            f"    {s.name}: {len(s.task.eval)} problems, template {s.task.template}, {len(s.subset)} each eval_every"
        )


def _trainable_text(cfg: Config, plan) -> str:
    """What trains: every parameter, or (LoRA) the adapter's share, on a frozen or NF4 base."""
    try:
        arch = _offline_arch(cfg, plan)
    except UserError as exc:
        return f"  trainable parameters: unknown ({exc})"
    trainable = plan.trainable_params(cfg, arch)
    if not cfg.model.lora.r:
        return f"  trainable parameters: all {arch.num_params:,} (full fine-tuning)"
    base = "a 4-bit NF4 base (bitsandbytes)" if cfg.model.load_in_4bit else "a frozen base"
    return (
        f"  trainable parameters: {trainable:,} of {arch.num_params:,} ({100 * trainable / arch.num_params:.2f}%): "
        f"LoRA r={cfg.model.lora.r} on {base}"
    )


def evaluations(cfg: Config, start: int = 0) -> str:
    """When the run evaluates the eval subset, in words (``""``: never): at step 0 (a fresh start),
    every ``eval_every`` steps and at the last step (``grpo_fast.loop.step_end``).

    Example:
        >>> from grpo_fast.config import load_config
        >>> evaluations(load_config("tiny", overrides=["steps=6"]))  # eval_every=25
        'an evaluation at steps 0 and 6'
        >>> evaluations(load_config("tiny", overrides=["steps=60"]))
        'an evaluation every 25 steps and at step 60'
    """
    every, last = cfg.eval_every, cfg.steps
    if not every or cfg.data.eval_subset_size == 0 or last <= start:
        return ""
    first = (start // every + 1) * every  # the first multiple of eval_every after the start
    multiples = (last - first) // every + 1 if first <= last else 0
    if multiples > 1:
        return f"an evaluation every {every} steps" + (f" and at step {last}" if last % every else "")
    steps = sorted({*([0] if start == 0 else []), *([first] if multiples else []), last})
    listed = ", ".join(map(str, steps[:-1])) + " and " if len(steps) > 1 else ""
    return f"an evaluation at step{'s' * (len(steps) > 1)} {listed}{steps[-1]}"


def _run_problems(cfg: Config) -> list[str]:
    """The real run's stops before training that need no model: the OpenMP wait this process
    runs with (``threads.wait_policy``), a sequence-parallel group the ranks do not hold,
    ``output_dir`` (not creatable, not writable, in use, holding a run, a resume that changes a
    run-defining key), a local model folder that is missing or damaged, a distillation teacher
    that cannot serve (``check_teacher``; a served one at ``distill.server_url`` that answers: its
    context and tokenizer). Nothing is created or locked."""
    from grpo_fast import threads
    from grpo_fast.obs import run_folder
    from grpo_fast.policy import sequence_parallel
    from grpo_fast.policy.checkpoint import check_model_folder

    found = []
    asked = cfg.threads.wait_policy
    restarts = threads.wait_policy_restart(asked) is not None and threads.started_by_command
    if not restarts and (problem := threads.wait_policy_problem(asked)) is not None:  # as train.run
        found.append(problem)
    try:
        sequence_parallel.group_size(cfg)
    except ConfigError as exc:
        found.append(str(exc))
    out = Path(cfg.output_dir)
    why = run_folder.output_dir_problem(out)
    owner = run_folder.in_use(out) if why is None and out.is_dir() else None
    if why is not None or owner is not None:
        found.append(why or f"output_dir {out} is in use by {owner}")
    else:
        try:
            run_folder.check_folder(out, cfg)
        except UserError as exc:
            found.append(str(exc))
    name = cfg.model.name_or_path
    try:
        if name.startswith(("/", "./", "../", "~")) and not Path(name).expanduser().is_dir():
            raise ConfigError(f"model.name_or_path={name!r}: no such folder")
        check_model_folder(name, "re-save or re-download the model")
    except UserError as exc:
        found.append(str(exc))
    if cfg.distill.teacher is not None:  # its folder and tokenizer, as the run checks them first
        from grpo_fast.policy.teacher import check_teacher

        try:
            check_teacher(cfg.distill.teacher, _offline_tokenizer(name))
            if cfg.distill.placement == "server" and cfg.distill.server_url is not None:
                from grpo_fast.policy.teacher import check_served

                check_served(cfg, _offline_tokenizer(name))
        except UserError as exc:
            found.append(str(exc))
    return found


def _model_problems(cfg: Config) -> tuple[list[str], str | None]:
    """The setup's refusals that need the model's modules, with the setup's own checks, on the
    model's skeleton (``grpo_fast.policy.model.model_skeleton``: the meta device, no weights):
    LoRA's target modules (``lora.check_targets``, as ``load_policy`` applies the adapter), then
    the heads, layers and attention sequence parallelism needs (``ulysses.check_model``, when the
    ranks hold the group). ``(problems, why the checks were skipped or None)``: a model whose
    config is not on this machine (a hub name not in the local cache) is skipped, not refused
    (the run would download it)."""
    from grpo_fast.policy import sequence_parallel, ulysses
    from grpo_fast.policy.lora import check_targets
    from grpo_fast.policy.model import model_skeleton, resolve_device

    lora, sp = cfg.model.lora, int(cfg.train.sequence_parallel)
    checks_lora = bool(lora.r) and lora.target_modules != "all-linear"
    if not checks_lora and sp == 1:
        return [], None
    try:
        model = model_skeleton(cfg, _offline_tokenizer(cfg.model.name_or_path), resolve_device(cfg))
    except UserError as exc:
        return [], one_line(str(exc))
    try:
        if checks_lora:
            check_targets(model, list(lora.target_modules))
        if sequence_parallel.group_size(cfg) > 1:
            ulysses.check_model(model, sp)
    except ConfigError as exc:
        return [str(exc)], None
    return [], None


def _environment_problems(cfg: Config) -> list[str]:
    """A user's tool environment (``rollout.environment=my_tools``) built as the run builds it
    (``multi_turn.from_config``: its build must return an environment with non-empty stop
    strings), its ``new_state`` called, and its ``parse`` given a turn that is one of its stop
    strings (it must return a ``ToolCall`` or None); then closed. No call is executed."""
    from grpo_fast.env import environments
    from grpo_fast.rollout import multi_turn

    r = cfg.rollout
    if r.environment == "none" or r.environment in environments():
        return []
    try:
        env = multi_turn.from_config(cfg, tokenizer=None).env
        try:
            env.new_state()
            for stop in env.stop_strings:
                env.parse(stop)
        finally:
            env.close()
    except UserError as exc:
        return [str(exc)]
    return []


def _plan_text(cfg: Config, torch) -> str:
    """The planner's table for the run's GPU, or what ``auto`` resolves to on a CPU."""
    from grpo_fast.tools import plan

    device = cfg.device if cfg.device != AUTO else ("cuda" if torch.cuda.is_available() else "cpu")
    if not device.startswith("cuda"):
        resolved = plan.resolve_auto(cfg, None, torch.device("cpu"))
        return (
            "  device cpu: the planner sizes GPU memory only; on the CPU "
            f"train.micro_batch_size={resolved.train.micro_batch_size}, "
            f"loss.chunk_size={cfg.loss.chunk_size} (the fused op's own budget)\n"
            + _trainable_text(cfg, plan)
        )
    if torch.cuda.is_available():
        index = torch.device(device).index or 0
        gpu = torch.cuda.get_device_properties(index).total_memory
        card = f"{torch.cuda.get_device_name(index)}, {gpu / plan.GB:.1f} GB"
    else:
        gpu = 24 * plan.GB
        card = "no GPU here: planned for a 24 GB card"
    try:
        arch = _offline_arch(cfg, plan)
    except UserError as exc:
        return f"  unavailable: {exc}"
    world = int(os.environ.get("WORLD_SIZE", "1"))  # under torchrun, the ranks it started
    mp = plan.plan_memory(cfg, arch, gpu, world)
    head = f"  {cfg.model.name_or_path} ({arch.num_params / 1e9:.2f} B parameters) on {card}\n"
    if cfg.train.parallelism == "fsdp" and world == 1:
        head += (
            "  train.parallelism=fsdp shards over the ranks torchrun starts (none here): "
            "grpo-fast plan --world-size N gives one rank's budget\n"
        )
    body = "\n".join("  " + line for line in mp.table().splitlines())
    if max(mp.train_peak, mp.rollout_peak) > gpu:
        body += (
            f"\n  warning: the plan exceeds the card ({max(mp.train_peak, mp.rollout_peak) / plan.GB:.1f} GB)"
        )
    return head + body


def _sequence_parallel_text(cfg: Config) -> str:
    """The planner's sequence-parallel lines (``plan.sequence_parallel_text``): per-rank activations
    and the longest response that fits 24 / 80 GB cards for N = 1, 2, 4, 8."""
    from grpo_fast.tools import plan

    try:
        arch = _offline_arch(cfg, plan)
    except UserError as exc:
        return f"sequence parallelism: unavailable ({exc})"
    world = int(os.environ.get("WORLD_SIZE", "1"))
    return plan.sequence_parallel_text(cfg, arch, world)


def _offline_arch(cfg: Config, plan):
    """``plan.arch_for`` without the network: a hub model's config.json from the local cache only."""
    name = cfg.model.name_or_path
    if name in plan.KNOWN_ARCHS or name.startswith("builtin:") or Path(name).expanduser().is_dir():
        return plan.arch_for(cfg)
    from transformers import AutoConfig

    try:
        hf = AutoConfig.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise ConfigError(
            f"model.name_or_path={name!r} is neither a local folder nor in the local Hugging Face cache "
            "(the dry run does not download it)"
        ) from None
    return plan.Arch.from_hf_config(hf)


def _shortened(text: str, width: int) -> str:
    """``repr(text)``, its middle left out past ``width`` characters (a data line can be megabytes)."""
    if len(text) <= width:
        return repr(text)
    half = width // 2
    return f"{text[:half]!r} … [{len(text) - 2 * half:,} more characters] … {text[-half:]!r}"


def _offline_tokenizer(name: str):
    from grpo_fast.policy.model import load_tokenizer
    from grpo_fast.task import tiny

    if name in tiny.BUILTINS or Path(name).expanduser().is_dir():
        return load_tokenizer(name)
    if name.startswith(("/", "./", "../", "~")):
        raise ConfigError(f"model.name_or_path={name!r}: no such folder")
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(name, local_files_only=True)
    except (OSError, ValueError):
        raise ConfigError(
            f"model.name_or_path={name!r}: its tokenizer is not in the local Hugging Face cache "
            "(the dry run does not download it)"
        ) from None


def _print_sample_prompt(task, cfg: Config) -> None:
    ex = task.train[0]
    answer = _shortened(ex.answer, 80)
    print(f"  sample prompt (train[0], template {cfg.data.prompt_template!r}; answer {answer}):")
    print("    " + _shortened(task.prompt_text(ex), 400))
    try:
        task.tokenizer = _offline_tokenizer(cfg.model.name_or_path)
    except UserError as exc:
        print(f"  tokenizer not loaded, so the text above is what the template gives: {exc}")
        return
    ids = task.prompt_ids(ex)
    pieces = task.tokenizer.convert_ids_to_tokens(ids)
    print(
        f"  as the model sees it: {len(ids)} tokens (rollout.max_prompt_tokens={cfg.rollout.max_prompt_tokens})"
    )
    print("    " + " ".join(repr(p) for p in pieces[:96]) + (" …" if len(pieces) > 96 else ""))
