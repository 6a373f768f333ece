"""Loading the policy: the device, the autocast dtype, the tokenizer and the trainable causal LM.

The module that turns a microbatch into the GRPO loss is ``grpo_fast.policy.loss.PolicyLoss``.
"""

from __future__ import annotations

import importlib.util
from pathlib import Path

import torch
from torch import nn

from grpo_fast.config import AUTO, Config
from grpo_fast.errors import ConfigError
from grpo_fast.task import tiny

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: Config) -> torch.device:
    if cfg.device == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(cfg.device)


def autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for forward passes (None = no autocast)."""
    mp = cfg.train.mixed_precision
    if mp == AUTO:
        mp = "bf16" if device.type == "cuda" else "no"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}[mp]


def quiet_transformers() -> None:
    """No per-file progress bars from transformers (loading/saving weights), and no per-retry
    warnings from the Hub client: our own phases report, and a failed load is one error line."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hub_logging.set_verbosity_error()


def load_tokenizer(name_or_path: str):
    if name_or_path == tiny.BUILTIN_NAME:
        return tiny.build_tokenizer()
    from transformers import AutoTokenizer

    if name_or_path.startswith(("/", "./", "../", "~")) and not Path(name_or_path).expanduser().is_dir():
        raise ConfigError(f"model.name_or_path={name_or_path!r}: no such folder")
    try:
        tok = AutoTokenizer.from_pretrained(name_or_path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path={name_or_path!r}: cannot load a tokenizer ({exc})") from None
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def load_policy(cfg: Config, tokenizer, device: torch.device, hf_config=None) -> nn.Module:
    """The trainable causal LM, on ``device``, in ``model.dtype`` (auto = fp32 master weights).

    ``hf_config``: build a randomly initialized model of that architecture instead of loading
    ``model.name_or_path`` (benchmarks of real shapes without weights).
    """
    m = cfg.model
    dtype = torch.float32 if m.dtype == AUTO else _DTYPES[m.dtype]
    if m.name_or_path == tiny.BUILTIN_NAME and hf_config is None:
        model = tiny.build_model(tokenizer, seed=cfg.seed).to(dtype)
    else:
        from transformers import AutoModelForCausalLM

        attn = m.attn_implementation
        if attn == AUTO:
            has_fa2 = importlib.util.find_spec("flash_attn") is not None
            attn = "flash_attention_2" if device.type == "cuda" and has_fa2 else "sdpa"
        if hf_config is not None:
            with torch.device(device):  # initialize in place: a 1.5 B fp32 model is 6 GB
                model = AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=dtype)
        else:
            try:
                model = AutoModelForCausalLM.from_pretrained(
                    m.name_or_path,
                    dtype=dtype,
                    attn_implementation=attn,
                    trust_remote_code=m.trust_remote_code,
                )
            except (OSError, ValueError) as exc:
                raise ConfigError(
                    f"model.name_or_path={m.name_or_path!r}: cannot load the model ({exc})"
                ) from None
    model.to(device)
    model.config.use_cache = False  # training; generate() turns the cache on for itself
    if m.gradient_checkpointing:
        enable_checkpointing(model)
    # from_pretrained returns eval mode, and transformers checkpoints only in training mode: the
    # policy stays in train mode (rollout backends switch to eval and back around generate).
    model.train()
    return model


def enable_checkpointing(model: nn.Module) -> None:
    """Per-layer activation checkpointing, non-reentrant. transformers ≥ 5.2x names it
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` is deprecated there)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
