"""LoRA and QLoRA: a peft adapter on a frozen (or 4-bit NF4) base, written with peft, not by hand.

``model.lora.r > 0`` wraps the policy with ``peft.get_peft_model`` (``LoraConfig``: rank,
alpha, dropout, target modules; the embeddings and the lm_head stay frozen, so the fused head
takes its frozen path: no ``[V, D]`` weight gradient, one GEMM less per chunk). With
``model.load_in_4bit`` the base loads through transformers' ``BitsAndBytesConfig`` (NF4,
computing in the run's precision). Only the adapter's parameters train: the optimizer, the
gradient clipping and the DDP all-reduce see nothing else.

The reference policy π_ref of the KL term is the same model with the adapter disabled
(``AdapterOffLoss``, peft's ``disable_adapter()``): no second copy of the weights.

Checkpoints and ``final/`` hold the adapter in peft's format (``adapter_config.json`` +
``adapter_model.safetensors``), whose ``base_model_name_or_path`` must resolve: a base that
exists only in this run (the built-in model) is written once to ``output_dir/base``.
"""

from __future__ import annotations

import contextlib
import sys
import warnings
from pathlib import Path

import torch
from torch import nn

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.token_loss import GRPOLossOutput
from grpo_fast.dist import unwrap
from grpo_fast.errors import ConfigError

__all__ = [
    "AdapterOffLoss",
    "adapter_off",
    "apply_lora",
    "is_adapter_name",
    "is_lora",
    "load_adapter_weights",
    "trainable_counts",
]


def is_adapter_name(name: str) -> bool:
    """Whether the parameter or state-dict entry ``name`` is the adapter's (peft names its
    matrices ``<layer>.lora_A.<adapter>.weight`` and ``<layer>.lora_B.<adapter>.weight``)."""
    return ".lora_" in name


def is_lora(model: nn.Module) -> bool:
    """Whether ``model`` (or the module DDP wraps) is a peft model. Without peft imported no
    model is one: the answer then costs no import (peft's takes ~2 s on a 2-core CPU, paid by
    every run without LoRA before)."""
    if "peft" not in sys.modules:
        return False
    from peft import PeftModel

    return isinstance(unwrap(model), PeftModel)


def apply_lora(model: nn.Module, lora_cfg, base_path: str) -> nn.Module:
    """``model`` with a fresh LoRA adapter (``model.lora``), its base frozen; ``base_path`` is
    recorded as the adapter's ``base_model_name_or_path``. A target module that matches no layer
    is a ``ConfigError`` naming the linear layers the model has."""
    from peft import LoraConfig, get_peft_model

    config = LoraConfig(
        r=lora_cfg.r,
        lora_alpha=lora_cfg.alpha,
        lora_dropout=lora_cfg.dropout,
        target_modules=lora_cfg.target_modules
        if lora_cfg.target_modules == "all-linear"
        else list(lora_cfg.target_modules),
        bias="none",
        task_type="CAUSAL_LM",
    )
    if lora_cfg.target_modules != "all-linear":
        check_targets(model, list(lora_cfg.target_modules))
    with warnings.catch_warnings():  # peft 0.21 asks transformers 5.24 a deprecated question
        warnings.filterwarnings("ignore", message=".*is_gradient_checkpointing.*", category=FutureWarning)
        peft_model = get_peft_model(model, config)
    peft_model.peft_config["default"].base_model_name_or_path = str(base_path)
    return peft_model


def check_targets(model: nn.Module, targets: list[str]) -> None:
    """Each of ``targets`` names (the last part of) at least one linear layer of ``model``."""
    linear = sorted({name.rsplit(".", 1)[-1] for name, m in model.named_modules() if _is_linear(m)})
    output = model.get_output_embeddings()
    head = {name.rsplit(".", 1)[-1] for name, m in model.named_modules() if m is output}
    missing = [t for t in targets if t not in linear or t in head]
    if missing:
        choices = ", ".join(n for n in linear if n not in head)
        raise ConfigError(
            f"model.lora.target_modules: {missing[0]!r} matches no linear layer of the decoder; it has: {choices}"
        )


def _is_linear(module: nn.Module) -> bool:
    if isinstance(module, nn.Linear):
        return True
    try:  # a 4-bit base: bitsandbytes' Linear4bit is an nn.Linear too, and so is any subclass
        import bitsandbytes as bnb

        return isinstance(module, bnb.nn.Linear4bit)
    except ImportError:
        return False


@contextlib.contextmanager
def adapter_off(model: nn.Module):
    """The base policy inside the block: the adapter's contribution is off (peft's
    ``disable_adapter``), the weights untouched."""
    with unwrap(model).disable_adapter():
        yield


class AdapterOffLoss(nn.Module):
    """π_ref under LoRA: ``policy_loss``'s forward with the adapter disabled. No weights of its own
    (``forward(mb, options, temperature)`` as ``PolicyLoss``)."""

    def __init__(self, policy_loss: nn.Module):
        super().__init__()
        self.policy_loss = policy_loss

    def forward(self, mb, options: LossOptions, temperature: float) -> GRPOLossOutput:
        with adapter_off(self.policy_loss.model):
            return self.policy_loss(mb, options, temperature)


def trainable_counts(model: nn.Module) -> tuple[int, int]:
    """``(trainable, all)`` parameter counts (a 4-bit weight counts as its number of values,
    sharded or not: under FSDP its parameter is a DTensor of the packed bytes)."""
    model = unwrap(model)
    bnb = sys.modules.get("bitsandbytes")  # not imported: no 4-bit layer
    nf4 = {id(m.weight) for m in model.modules() if bnb is not None and isinstance(m, bnb.nn.Linear4bit)}
    trainable = total = 0
    for p in model.parameters():
        packed = id(p) in nf4 or getattr(p, "quant_type", None)
        n = p.numel() * (2 if packed else 1)  # NF4 packs two values a byte
        total += n
        trainable += n if p.requires_grad else 0
    return trainable, total


def load_adapter_weights(model: nn.Module, folder: Path) -> None:
    """The adapter saved in ``folder`` (peft's ``adapter_model.safetensors``) into ``model``."""
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    file = Path(folder) / "adapter_model.safetensors"
    if not file.is_file():
        raise ConfigError(
            f"checkpoint {folder} holds no adapter (adapter_model.safetensors): was it a LoRA run?"
        )
    result = set_peft_model_state_dict(unwrap(model), load_file(file))
    if result.unexpected_keys:
        raise ConfigError(
            f"checkpoint {folder}: its adapter does not match model.lora (unexpected {result.unexpected_keys[:3]})"
        )


def adapter_base(folder: Path) -> str | None:
    """The ``base_model_name_or_path`` of the peft adapter in ``folder``, or None when ``folder``
    holds no adapter (``adapter_config.json``)."""
    import json

    config = Path(folder) / "adapter_config.json"
    if not config.is_file():
        return None
    try:
        return json.loads(config.read_text())["base_model_name_or_path"]
    except (ValueError, KeyError) as exc:
        raise ConfigError(f"{config} is not a peft adapter config ({exc})") from None


def load_with_adapter(base: nn.Module, folder: Path) -> nn.Module:
    """``base`` with the trained adapter of ``folder`` on it (peft's ``PeftModel.from_pretrained``)."""
    from peft import PeftModel

    return PeftModel.from_pretrained(base, str(folder))


def merged_model(adapter_folder: Path, dtype: torch.dtype | None) -> nn.Module:
    """The adapter of ``adapter_folder`` merged into a fresh copy of its base, loaded unquantized on
    the CPU (a 4-bit run merges into its full-precision base, not into NF4), in ``dtype`` (None:
    the base's): a plain transformers model, for serving without peft."""
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(adapter_base(adapter_folder), dtype=dtype or "auto")
    return load_with_adapter(base, adapter_folder).merge_and_unload()
