"""Parallelism, applied once: everything the training loop asks of data parallelism (DDP),
sharding (FSDP2, ``train.parallelism=fsdp``) and sequence parallelism (Ulysses,
``train.sequence_parallel``), in one module the loop calls and never looks behind (as gpt-fast's
``tp.py``). The loop imports neither ``grpo_fast.policy.fsdp`` nor
``grpo_fast.policy.sequence_parallel`` (tests/test_layers.py holds it); a new parallel dimension
changes this module and its two, not the phases.

At setup (``prepare_model`` → ``shard`` → ``wrap``): the model's attention over the sp group,
each decoder layer an FSDP unit, the DDP wrapper. In a step:

- ``on_rank``: a microbatch as this rank trains it (sp: its 1/N of every sequence's tokens);
- ``fillers`` / ``filler_passes``: under FSDP every rank runs as many forwards as the most any
  rank runs (zero-weight microbatches; one collective), nothing otherwise;
- ``accumulating``: DDP's deferred all-reduce while gradients accumulate (FSDP reduce-scatters
  every microbatch: deferring would keep a whole unsharded gradient per rank);
- ``clip_grad_norm``: the norm over every rank's shards, as a plain tensor;
- ``generation_weights``, ``save_full_model``: the whole model gathered for generation on the
  training model and for the saves and pushes that need it whole;
- ``unwrap``: the module under a DDP wrapper.
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from grpo_fast import dist
from grpo_fast.policy import fsdp, sequence_parallel, ulysses
from grpo_fast.policy.batch import Microbatch

group_size = sequence_parallel.group_size  # ranks that split each sequence (train.sequence_parallel)
across = sequence_parallel.across  # the sp shard a microbatch's sequences span (None: whole)
is_sharded = fsdp.is_sharded
unwrap = dist.unwrap  # the module under a DDP wrapper


# ---------------------------------------------------------------------------------- at setup


def check_model(model: nn.Module, world: dist.DistInfo) -> None:
    """Under sequence parallelism: heads that do not divide over the sp group, or a model outside
    the attention interface, refused in one line before anything else is built."""
    if world.sp.enabled:
        ulysses.check_model(model, world.sp.size)


def prepare_model(model: nn.Module, world: dist.DistInfo) -> None:
    """Under sequence parallelism the model's attention runs by all-to-all over the sp group (the
    KL reference's too: it is built from this model)."""
    if world.sp.enabled:
        ulysses.enable(model, world.sp.size)


def shard(cfg, world: dist.DistInfo, modules: list[nn.Module], amp, device: torch.device) -> bool:
    """FSDP2 on each of ``modules`` (the policy's loss module, a reference copy's) when the run is
    sharded (``train.parallelism=fsdp`` under torchrun): each rank then holds 1/N of the weights,
    gradients and optimizer state. Returns whether it sharded."""
    sharded = cfg.train.parallelism == "fsdp" and world.enabled
    if sharded:
        for module in modules:
            fsdp.shard_policy(module, amp, device, world.world_size, cfg.train.fsdp_cpu_offload)
    return sharded


def wrap(policy_loss: nn.Module, world: dist.DistInfo, device: torch.device) -> nn.Module:
    """The module the optimization phase runs: DDP around ``policy_loss`` when data parallel and
    not sharded, else ``policy_loss`` itself."""
    if not world.enabled or is_sharded(policy_loss):
        return policy_loss
    from torch.nn.parallel import DistributedDataParallel as DDP

    return DDP(policy_loss, device_ids=[device.index] if device.type == "cuda" else None)


# ---------------------------------------------------------------------------------- in a step


def on_rank(mb: Microbatch, world: dist.DistInfo, device: torch.device) -> Microbatch:
    """``mb`` as this rank trains it, on ``device``: under sequence parallelism its 1/N of every
    sequence's tokens (``sequence_parallel.shard``), else all of it."""
    return sequence_parallel.shard(mb, world.sp).to(device)


def filler_counts(counts: list[int], module: nn.Module, device: torch.device) -> list[int]:
    """For each of this rank's pass counts, how many zero-weight passes it adds so that every
    rank runs as many as the most any rank runs: under FSDP (``module`` sharded: its gathers and
    reduce-scatters must pair across ranks; one collective), zeros otherwise."""
    return fsdp.padding_count(counts, device, is_sharded(module))


def fillers(count: int, like: Microbatch | None, pad_id: int, device: torch.device) -> list[Microbatch]:
    """``count`` zero-weight microbatches with the per-token fields ``like`` has (``fsdp.fillers``)."""
    return fsdp.fillers(count, like, pad_id, device)


def filler_passes(policy: nn.Module, fillers_: list[Microbatch], options, temperature: float) -> None:
    """The forward and backward of each filler (weight 0: no loss, no gradient, no statistics).
    With β = 0: a filler's π_ref is a placeholder 0, and k3 = exp(0 − log π) overflows to inf
    below log π ≈ −88.7 (0 · inf = NaN, reduce-scattered to every rank); the ratio exp(log π − 0)
    ≤ 1 stays finite."""
    options = dataclasses.replace(options, beta=0.0)
    for mb in fillers_:  # with a value head its (zero) loss too: the same parameters reduce-scatter
        policy(mb, options, temperature).backward_loss.backward()


def accumulating(policy: nn.Module, world: dist.DistInfo, defer: bool):
    """The context of one microbatch's backward: DDP's ``no_sync`` when ``defer`` (the last
    microbatch all-reduces what accumulated); nothing under FSDP (it reduce-scatters every
    microbatch: ``grpo_fast.policy.fsdp``) or in one process."""
    if defer and world.enabled and not is_sharded(policy):
        return policy.no_sync()
    return contextlib.nullcontext()


def clip_grad_norm(params: list[nn.Parameter], max_norm: float) -> torch.Tensor:
    """``clip_grad_norm_`` over the trainable parameters; under FSDP the norm over every rank's
    shards, as a plain tensor (a collective)."""
    return fsdp.to_local_value(torch.nn.utils.clip_grad_norm_(params, max_norm))


def generation_weights(policy_loss: nn.Module | None):
    """A context for generation on the training model itself (``policy_loss``'s; None: a backend
    with weights of its own): under FSDP every unit gathered for the phase; a no-op otherwise."""
    return fsdp.gathered(policy_loss)


def save_full_model(
    model: nn.Module, policy_loss: nn.Module, tokenizer, folder, is_main: bool, dtype
) -> bool:
    """Under FSDP: the model gathered whole by every rank, written by rank 0 (LoRA: the adapter),
    and True; False otherwise (the caller writes its unsharded model itself)."""
    if not is_sharded(policy_loss):
        return False
    fsdp.save_full_model(model, tokenizer, folder, is_main, dtype)
    return True
