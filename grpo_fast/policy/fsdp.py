"""FSDP2 (ZeRO-3-style sharding) of the policy: ``train.parallelism=fsdp`` under torchrun.

torch's own ``fully_shard`` (written against torch 2.13), no sharding of ours: each decoder layer
is one FSDP unit, and the root unit is the ``PolicyLoss`` module, which holds what is left (the
embeddings, the final norm and the lm_head, tied or not). ``PolicyLoss.forward`` runs the
decoder and then ``fused_linear_grpo_loss`` with the lm_head weight, so FSDP gathers the head
once per microbatch forward (the root is not resharded after its forward: the backward needs
it) and reduce-scatters its gradient once, in the backward's final callback. The fused op
computes that gradient inside its forward and returns it from its autograd ``backward``, where
autograd accumulates it into the unsharded parameter's ``.grad`` like any other; FSDP's
post-backward reads it from there (tests/test_fsdp.py: the same update as DDP).

Each rank keeps 1/N of the fp32 weights, of their gradients and of the AdamW state (DTensor
shards on dim 0). Under ``train.mixed_precision=bf16`` the gathered weights are bf16 and the
gradients are reduced in fp32 (``MixedPrecisionPolicy``); ``train.fsdp_cpu_offload`` keeps the
shards, their gradients and the optimizer step in CPU RAM (``CPUOffloadPolicy``).

Gradient accumulation reduce-scatters every microbatch's gradients (FSDP's default), rather
than deferring to the last microbatch (``set_requires_gradient_sync(False)``): deferring keeps
every layer's unsharded gradient until the last microbatch, a full fp32 gradient per rank, which
is what sharding is for. Measured on CPU (2 gloo ranks): bench/test_bench_fsdp.py.

What every rank must do alike: FSDP gathers each unit in each forward, so every rank runs the
same number of forwards (``padding_count`` tops a rank's microbatches up with zero-weight
fillers, ``fillers``), and transformers ``generate`` on the training model (the hf
backend, the evaluations) runs inside ``gathered`` (the whole model unsharded for the phase, no
gather per decoded token, whatever each rank generates).
"""

from __future__ import annotations

import contextlib
import dataclasses

import torch
from torch import nn

from grpo_fast import dist
from grpo_fast.policy import checkpoint as ckpt
from grpo_fast.policy.batch import Microbatch, Sequence, make_microbatches
from grpo_fast.policy.lora import is_adapter_name, is_lora

__all__ = [
    "adapter_files",
    "decoder_layers",
    "fillers",
    "full_state_dict",
    "gathered",
    "gathered_adapter",
    "is_sharded",
    "local_bytes",
    "padding_count",
    "plain_model",
    "save_adapter",
    "save_full_model",
    "shard_policy",
    "to_local_value",
]


def decoder_layers(model: nn.Module) -> list[nn.Module]:
    """The model's decoder layers, one FSDP unit each: the modules whose class transformers
    names in ``_no_split_modules`` (``Qwen2DecoderLayer``), else the decoder's ``layers``."""
    names = set(getattr(model, "_no_split_modules", None) or ())
    found = [m for m in model.modules() if type(m).__name__ in names]
    if found:
        return found
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    return list(backbone.layers)


def _policies(amp: torch.dtype | None, cpu_offload: bool, device: torch.device):
    """``(layer mixed precision, root mixed precision, offload policy)``. Under autocast the
    gathered weights are in the autocast dtype and gradients reduce in fp32; the root does not
    cast its inputs (the microbatch's fp32 advantages and loss weights must stay fp32)."""
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, OffloadPolicy

    layer = MixedPrecisionPolicy(param_dtype=amp, reduce_dtype=torch.float32 if amp else None)
    root = dataclasses.replace(layer, cast_forward_inputs=False)
    offload = CPUOffloadPolicy(pin_memory=device.type == "cuda") if cpu_offload else OffloadPolicy()
    return layer, root, offload


def shard_policy(
    policy_loss: nn.Module,
    amp: torch.dtype | None,
    device: torch.device,
    world_size: int,
    cpu_offload: bool = False,
) -> nn.Module:
    """Shard ``policy_loss`` (a ``PolicyLoss``) in place over ``world_size`` ranks: each decoder
    layer of its model, then the module itself as the root. Returns it (now an ``FSDPModule``);
    the optimizer must be built after this, over the sharded parameters.

    The root is initialized here (a private step of torch 2.13's FSDP2, ``_lazy_init``, which
    FSDP otherwise runs at the first forward): the first forward may be a ``generate`` of the
    bare model, which would otherwise make its first decoder layer the root.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device.type, (world_size,))
    layer_mp, root_mp, offload = _policies(amp, cpu_offload, device)
    for layer in decoder_layers(policy_loss.model):
        fully_shard(layer, mesh=mesh, mp_policy=layer_mp, offload_policy=offload)
    fully_shard(policy_loss, mesh=mesh, mp_policy=root_mp, offload_policy=offload)
    policy_loss._get_fsdp_state()._lazy_init()
    policy_loss.register_forward_hook(_reshard_after_no_grad_forward)
    return policy_loss


def _reshard_after_no_grad_forward(module, _inputs, _output) -> None:
    """The root keeps its weights gathered after a forward, for the backward; a no-grad forward
    (π_old, π_ref, the weight-sync probe) has none, so they are freed at once."""
    if not torch.is_grad_enabled():
        module.reshard()


def is_sharded(module) -> bool:
    """Whether ``module`` is (or its DDP-less wrapper holds) an FSDP unit."""
    from torch.distributed.fsdp import FSDPModule

    return isinstance(module, FSDPModule)


def _units(root: nn.Module) -> list[nn.Module]:
    from torch.distributed.fsdp import FSDPModule

    return [m for m in root.modules() if isinstance(m, FSDPModule)]


@contextlib.contextmanager
def gathered(root: nn.Module | None):
    """Every unit of ``root`` unsharded for the block, none resharded after its forward: what
    ``generate`` on the training model needs (one gather per unit for the phase, instead of one
    per decoded token, and no collective that depends on how much each rank generates). Peak:
    the whole model in the gathered dtype. A no-op for an unsharded ``root`` (or None)."""
    if root is None or not is_sharded(root):
        yield
        return
    units = _units(root)
    layers = [u for u in units if u is not root]
    for unit in units:
        unit.unshard()
    for layer in layers:
        layer.set_reshard_after_forward(False, recurse=False)
    try:
        yield
    finally:
        for layer in layers:
            layer.set_reshard_after_forward(True, recurse=False)
        for unit in units:
            unit.reshard()


def padding_count(counts: list[int], device: torch.device, sharded: bool) -> list[int]:
    """For each of this rank's pass counts, how many more it must run so that every rank runs
    as many as the most any rank runs (one collective); zeros when not ``sharded``."""
    if not sharded:
        return [0] * len(counts)
    most = dist.all_reduce_max([float(c) for c in counts], device)
    return [int(m) - c for m, c in zip(most, counts)]


def fillers(count: int, like: Microbatch | None, pad_id: int, device: torch.device) -> list[Microbatch]:
    """``count`` times a 2-token microbatch of weight 0 (its loss and every gradient exactly 0)
    with the optional per-token fields ``like`` has: what a rank with fewer microbatches runs so
    that its FSDP gathers and reduce-scatters pair with the other ranks'."""
    if count == 0:
        return []
    mb = make_microbatches([Sequence([pad_id, pad_id], 1, 0.0, 0.0)], 1, pad_id, packing=False)[0]
    zeros = torch.zeros(1)
    extra = {}
    for name in ("old_logprobs", "ref_logprobs", "sampler_logprobs", "returns", "old_values"):
        if like is not None and getattr(like, name) is not None:
            extra[name] = zeros
    return [dataclasses.replace(mb, **extra).to(device)] * count


def to_local_value(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's global value as a plain tensor (``full_tensor``: a collective; an offloaded
    shard is moved to the mesh's device first: ``dist.whole_tensor``), or ``t``."""
    return dist.whole_tensor(t)


def _local(t: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def local_bytes(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> dict[str, int]:
    """Bytes this rank holds of the weights, their gradients and the optimizer state (the
    local shards of DTensors; whole tensors otherwise). The weights include a 4-bit base's
    quantization state (bitsandbytes keeps each NF4 weight's block absmaxes and code table on
    its ``Linear4bit`` module, whole on every rank). A tensor shared by several entries counts
    once: tied weights, and 8-bit AdamW's code tables (one per state, shared by every parameter)."""
    params = {id(p): p for p in model.parameters()}.values()
    out = {
        "weights": _unique_bytes([*(_local(p) for p in params), *_quant_state_tensors(model)]),
        "grads": _unique_bytes(_local(p.grad) for p in params if p.grad is not None),
        "optimizer": 0,
    }
    if optimizer is not None:
        values = (v for state in optimizer.state.values() for v in state.values())
        out["optimizer"] = _unique_bytes(
            _local(v) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0
        )
    return out


def _quant_state_tensors(model: nn.Module) -> list[torch.Tensor]:
    """The tensors of the bitsandbytes ``QuantState`` s on ``model``'s modules (absmax, code, and
    a nested state's), or none."""
    out = []
    for module in model.modules():
        state = getattr(module, "quant_state", None)
        while state is not None and hasattr(state, "absmax"):
            out += [t for t in (state.absmax, getattr(state, "code", None)) if isinstance(t, torch.Tensor)]
            state = getattr(state, "state2", None)
    return out


def _unique_bytes(tensors) -> int:
    """The bytes of ``tensors``, each (storage, offset, size) counted once."""
    seen = {(t.untyped_storage().data_ptr(), t.storage_offset(), t.numel()): t for t in tensors}
    return sum(t.numel() * t.element_size() for t in seen.values())


def full_state_dict(model: nn.Module) -> dict[str, torch.Tensor]:
    """``model``'s full state dict on rank 0, on the CPU (every rank must call it: each shard is
    gathered once, one tensor at a time); an empty dict on the other ranks."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

    return get_model_state_dict(model, options=StateDictOptions(full_state_dict=True, cpu_offload=True))


def plain_model(model: nn.Module, state: dict[str, torch.Tensor]) -> nn.Module:
    """A plain (unsharded) copy of the Hugging Face ``model`` on the CPU holding ``state``
    (``full_state_dict``'s), built on the meta device so the weights are not allocated twice;
    tied weights tied again. What rank 0 writes with ``save_pretrained``."""
    with torch.device("meta"):
        copy = type(model)(model.config)
    copy.load_state_dict(state, strict=False, assign=True)
    copy.tie_weights()
    missing = [n for n, p in copy.named_parameters() if p.is_meta]
    if missing:
        raise RuntimeError(f"the gathered state dict lacks {missing[:3]}")
    return copy.eval()


def save_full_model(
    model: nn.Module, tokenizer, folder, is_main: bool, dtype: torch.dtype | None = None
) -> None:
    """The sharded ``model`` in Hugging Face format (``save_pretrained``, atomically, in ``dtype``
    when given) to ``folder``: gathered once to rank 0's CPU (every rank calls it), written by
    rank 0; loadable by transformers and vLLM like an unsharded run's. A LoRA policy: its adapter
    alone, in peft's format (``save_adapter``; ``dtype`` does not apply, as under DDP)."""
    if is_lora(model):
        save_adapter(model, tokenizer, folder, is_main)
        return
    state = full_state_dict(model)
    if is_main:
        ckpt.save_pretrained_atomic(plain_model(model, state), tokenizer, folder, dtype=dtype)


def gathered_adapter(model: nn.Module) -> dict[str, torch.Tensor]:
    """A peft policy's adapter, ``{state-dict name: whole tensor}`` (``...q_proj.lora_A.default.weight``:
    ``[r, in]``, ``lora_B``: ``[out, r]``): under FSDP each shard gathered (a collective: every
    rank calls it and gets them all), otherwise the parameters themselves."""
    peft_model = dist.unwrap(model)
    return {n: to_local_value(p.detach()) for n, p in peft_model.named_parameters() if is_adapter_name(n)}


class _AdapterFiles:
    """What ``save_pretrained_atomic`` writes for a peft model whose adapter was gathered: peft's
    ``save_pretrained`` (adapter_config.json, adapter_model.safetensors) from those tensors."""

    def __init__(self, peft_model: nn.Module, tensors: dict[str, torch.Tensor]):
        self.peft_model, self.tensors = peft_model, tensors

    def save_pretrained(self, folder, safe_serialization: bool = True) -> None:
        self.peft_model.save_pretrained(
            folder, safe_serialization=safe_serialization, state_dict=self.tensors
        )


def adapter_files(model: nn.Module, tensors: dict[str, torch.Tensor]) -> _AdapterFiles:
    """``model``'s adapter, as ``gathered_adapter`` returned it, for ``save_pretrained_atomic``."""
    return _AdapterFiles(dist.unwrap(model), tensors)


def save_adapter(model: nn.Module, tokenizer, folder, is_main: bool) -> None:
    """A (sharded or not) peft policy's adapter and the tokenizer to ``folder``, atomically, in
    peft's format: what a DDP LoRA run writes. Gathered on every rank (a collective), written by
    rank 0."""
    tensors = gathered_adapter(model)
    if is_main:
        ckpt.save_pretrained_atomic(adapter_files(model, tensors), tokenizer, folder)
