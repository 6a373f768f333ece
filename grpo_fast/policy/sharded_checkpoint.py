"""Sharded checkpoints (``train.parallelism=fsdp``): ``torch.distributed.checkpoint`` (DCP).

A checkpoint ``output_dir/checkpoints/step_000100/`` holds ``dcp/``, where every rank writes its
own shards of the model, of the optimizer state and of the frozen reference model (no gather
on rank 0: DCP's ``.metadata`` says which bytes of which tensor each file holds), and, from rank
0, ``trainer_state.pt`` (what ``grpo_fast.loop.checkpointing`` keeps besides the weights: the
schedule, the prompt sampler, every rank's RNG, ...) and the tokenizer. Atomic like the
Hugging Face checkpoints (``grpo_fast.policy.checkpoint``): everything goes to
``step_000100.tmp/`` first, and rank 0 renames it once every rank's shards are written; a run
killed at any instant leaves the previous checkpoint or the new one. The folder must be on a
file system every rank sees (one node; several nodes: a shared one).

Loading reads into the run's own state dicts (``get_state_dict`` / ``set_state_dict``), so DCP
reshards: a checkpoint written by N ranks loads on M ranks, or on one process without any
process group (the model then unsharded). Except 8-bit AdamW's state: its blocks are each rank's
(``grpo_fast.policy.sharded_optim``), so it loads on the number of ranks that wrote it, and
another number is refused in one line before anything is read.

Under LoRA the frozen base is not written (it is reloaded from its folder, as under DDP): ``dcp/``
holds the adapter's shards and its optimizer state, and rank 0 also writes the adapter in peft's
format (``adapter_config.json`` + ``adapter_model.safetensors``, gathered: a few MB), so that a
checkpoint is an adapter folder ``grpo-fast evaluate --model`` takes, as a DDP run's is.
"""

from __future__ import annotations

import os
import shutil
import sys
from pathlib import Path
from typing import Any

import torch
from torch import nn

from grpo_fast import dist
from grpo_fast.errors import CheckpointError, ConfigError
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.policy.fsdp import adapter_files, gathered_adapter
from grpo_fast.policy.lora import is_adapter_name, is_lora

DCP_DIR = "dcp"


def is_sharded_checkpoint(path: Path) -> bool:
    """Whether the checkpoint folder ``path`` holds DCP shards (``save`` wrote it)."""
    return (Path(path) / DCP_DIR).is_dir()


def _model_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s state for DCP: every entry, or a LoRA policy's adapter alone (its frozen base
    is reloaded from the base folder)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    if not is_lora(model):
        return get_model_state_dict(model)
    state = get_model_state_dict(model, options=StateDictOptions(ignore_frozen_params=True))
    return {k: v for k, v in state.items() if is_adapter_name(k)}


def _load_model_state(model: nn.Module, state: dict[str, torch.Tensor], path: Path) -> None:
    """``state`` (``_model_state``'s) into ``model``; under LoRA the base's entries are not there,
    and every adapter entry must be."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, set_model_state_dict

    lora = is_lora(model)
    result = set_model_state_dict(model, state, options=StateDictOptions(strict=not lora))
    if lora and (result.unexpected_keys or any(is_adapter_name(k) for k in result.missing_keys)):
        raise CheckpointError(
            f"checkpoint {path}: its adapter does not match model.lora "
            f"(missing {[k for k in result.missing_keys if is_adapter_name(k)][:2]}, "
            f"unexpected {list(result.unexpected_keys)[:2]})"
        )


def _quantized_over(optimizer: torch.optim.Optimizer) -> int | None:
    """The ranks an 8-bit AdamW state was quantized over (``sharded_optim.quantized_over``), None
    for another optimizer (bitsandbytes not even imported: not one of its optimizers)."""
    if "bitsandbytes" not in sys.modules:
        return None
    from grpo_fast.policy.sharded_optim import quantized_over

    return quantized_over(optimizer)


def _state_dicts(models: dict[str, nn.Module], optimizer, with_optimizer: bool) -> dict[str, Any]:
    """DCP's view of ``models`` (and of ``optimizer``, when ``with_optimizer``): DTensor shards
    under FSDP, whole tensors otherwise. An optimizer's state dict is only asked for when it has
    a state: asking initializes an empty one with a zero step (torch 2.13), which would change
    the next real step."""
    from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict

    state: dict[str, Any] = {name: _model_state(m) for name, m in models.items()}
    if with_optimizer:
        state["optimizer"] = get_optimizer_state_dict(_optimizer_owner(models), optimizer)
    return state


def _optimizer_owner(models: dict[str, nn.Module]) -> nn.Module:
    """The module whose parameters the optimizer steps, for DCP's names of its state: the policy,
    or, with a value head (``loss.advantage=gae``: a second parameter group), a holder of both
    (``model.*``, ``value_head.*``)."""
    if "value_head" not in models:
        return models["model"]
    holder = nn.Module()
    holder.model, holder.value_head = models["model"], models["value_head"]
    return holder


def save(
    root: Path,
    step: int,
    models: dict[str, nn.Module],
    optimizer: torch.optim.Optimizer,
    tokenizer,
    trainer_state: dict[str, Any] | None,
    keep: int,
) -> Path:
    """Write ``root/step_<step>`` (every rank calls it: a collective) and keep the newest
    ``keep`` checkpoints. ``models``: ``{"model": policy, "ref_model": reference?, "value_head": head?}``;
    ``trainer_state``: rank 0's ``trainer_state.pt`` contents (None elsewhere). A failed write
    raises ``CheckpointError`` on every rank and leaves the previous checkpoint as it was."""
    import torch.distributed.checkpoint as dcp

    root = Path(root)
    target = root / ckpt.step_dir_name(step)
    tmp = target.with_name(target.name + ".tmp")
    main = trainer_state is not None
    _on_every_rank(main, lambda: _fresh_folder(tmp))
    has_optimizer = bool(optimizer.state)
    state = _state_dicts(models, optimizer, has_optimizer)
    adapter = gathered_adapter(models["model"]) if is_lora(models["model"]) else None
    try:
        dcp.save(state, checkpoint_id=str(tmp / DCP_DIR), no_dist=not _distributed())
    except Exception as exc:  # DCP raises on every rank when any rank's write failed
        raise CheckpointError(f"step {step}: cannot write {target}: {str(exc).splitlines()[0]}") from None
    if main:
        quantized = _quantized_over(optimizer) if has_optimizer else None
        trainer_state = {
            **trainer_state,
            "optimizer_saved": has_optimizer,
            "optimizer_quantized_over": quantized,
        }

    def finish() -> None:
        torch.save(trainer_state, tmp / ckpt.STATE_FILE)
        if adapter is not None:
            adapter_files(models["model"], adapter).save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        _fsync_tree(tmp)
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
        _fsync_tree(root, files=False)
        for old in ckpt.list_checkpoints(root)[:-keep]:
            shutil.rmtree(old)

    _on_every_rank(main, finish)
    return target


def _distributed() -> bool:
    """Whether a process group exists (without one, one process reads or writes every shard)."""
    return torch.distributed.is_available() and torch.distributed.is_initialized()


def _fresh_folder(path: Path) -> None:
    if path.exists():
        shutil.rmtree(path)  # a leftover from a run killed mid-write
    path.mkdir(parents=True)


def _on_every_rank(main: bool, work) -> None:
    """``work()`` on rank 0; its failure raised as ``CheckpointError`` on every rank (one
    collective), so that no rank waits for one that stopped."""
    why = None
    if main:
        try:
            work()
        except (OSError, RuntimeError) as exc:
            why = exc.strerror if isinstance(exc, OSError) and exc.strerror else str(exc).splitlines()[0]
    why = dist.broadcast_object(why)
    if why is not None:
        raise CheckpointError(f"cannot write the checkpoint: {why}")


def _fsync_tree(path: Path, files: bool = True) -> None:
    """fsync ``path``'s files (and those of its subfolders) and the folders themselves."""
    for folder, _, names in os.walk(path) if files else [(str(path), [], [])]:
        for name in names:
            with open(os.path.join(folder, name), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(folder, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def load(path: Path, models: dict[str, nn.Module], optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """Load the checkpoint at ``path`` into ``models`` and ``optimizer`` in place, resharded to
    this run's ranks (every rank calls it). ``saved``: its ``trainer_state.pt``."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import set_optimizer_state_dict

    with_optimizer = bool(saved.get("optimizer_saved", True))
    quantized = saved.get("optimizer_quantized_over") if with_optimizer else None
    ranks = torch.distributed.get_world_size() if _distributed() else 1
    if quantized is not None and quantized != ranks:
        raise ConfigError(
            f"resume=true: the 8-bit AdamW state of {path} is quantized in blocks of each of its "
            f"{quantized} rank(s)' shards; resume on {quantized} rank(s) (now {ranks})"
        )
    state = _state_dicts(models, optimizer, with_optimizer)
    try:
        dcp.load(state, checkpoint_id=str(Path(path) / DCP_DIR), no_dist=not _distributed())
    except Exception as exc:
        raise CheckpointError(
            f"checkpoint {path} cannot be read ({str(exc).splitlines()[0]}); delete the folder to resume "
            "from the one before"
        ) from None
    for name, model in models.items():
        _load_model_state(model, state[name], path)
    if with_optimizer:
        set_optimizer_state_dict(_optimizer_owner(models), optimizer, state["optimizer"])
