"""Loading the policy: the device, the autocast dtype, the tokenizer and the trainable causal LM.

The module that turns a microbatch into the GRPO loss is ``grpo_fast.policy.loss.PolicyLoss``.
"""

from __future__ import annotations

import importlib.util
import logging
from pathlib import Path

import torch
from torch import nn

from grpo_fast.config import AUTO, Config, shares_prompts
from grpo_fast.config_checks import devices_here
from grpo_fast.errors import ConfigError
from grpo_fast.task import tiny

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(cfg: Config) -> torch.device:
    """``cfg.device`` as a torch device (``auto``: CUDA when there is one, else the CPU).

    ``ConfigError`` naming ``device`` and this machine's for one it does not have: the config's
    checks say so first where they check the machine, this is for a config built otherwise."""
    if cfg.device == AUTO:
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    try:
        device = torch.device(cfg.device)
    except RuntimeError:
        device = None
    usable = device is not None and (
        device.type == "cpu"
        or (
            device.type == "cuda"
            and torch.cuda.is_available()
            and (device.index or 0) < torch.cuda.device_count()
        )
    )
    if not usable:
        raise ConfigError(f"device={cfg.device!r} is not one this machine runs ({devices_here()})")
    return device


def autocast_dtype(cfg: Config, device: torch.device) -> torch.dtype | None:
    """The autocast dtype for forward passes (None = no autocast): ``train.mixed_precision``, whose
    ``auto`` is bf16 on CUDA and on a CPU that computes bf16 natively (``cpu_computes_bf16``),
    else none (fp32)."""
    mp = cfg.train.mixed_precision
    if mp == AUTO:
        mp = "bf16" if device.type == "cuda" or (device.type == "cpu" and cpu_computes_bf16()) else "no"
    return {"bf16": torch.bfloat16, "fp16": torch.float16, "no": None}[mp]


def cpu_computes_bf16() -> str | None:
    """This CPU's native bf16 dot-product instructions (``"AMX"``, ``"AVX512-BF16"``; torch's own
    probes), or None: an x86 CPU without them (bf16 would be emulated, slower than fp32), or
    another architecture (not probed: an aarch64 CPU with native bf16 reads as None too). With them a bf16 matmul runs at about twice fp32's rate: the optimization step of a
    4-layer D = 512, V = 32,768 model took 0.71-0.74x fp32's time under bf16 autocast on a 2-core
    AMD EPYC with AVX512-BF16 (bench/test_bench_step_options.py -k mixed_precision, 2026-12-07);
    the tiny preset's D = 128 model 1.33x (the casts cost more than its small matmuls save), so
    its preset keeps ``mixed_precision: no`` (docs/training.md, "Mixed precision on a CPU")."""
    probes = (("AMX", "_is_amx_tile_supported"), ("AVX512-BF16", "_is_avx512_bf16_supported"))
    for name, probe in probes:
        check = getattr(torch.cpu, probe, None)
        if check is not None and check():
            return name
    return None


def precision_note(cfg: Config, device: torch.device) -> str:
    """For the plan line: what ``train.mixed_precision=auto`` chose on ``device`` and why, as
    ``"; ..."`` (empty when the config names the precision)."""
    if cfg.train.mixed_precision != AUTO:
        return ""
    if autocast_dtype(cfg, device) is None:
        return "; fp32 (train.mixed_precision=auto: this CPU has no native bf16 dot products)"
    why = "on CUDA" if device.type == "cuda" else f"this CPU has {cpu_computes_bf16()}"
    return f"; bf16 autocast (train.mixed_precision=auto: {why})"


def quiet_transformers() -> None:
    """No per-file progress bars from transformers (loading/saving weights), and no per-retry
    warnings from the Hub client: our own phases report, and a failed load is one error line."""
    from huggingface_hub.utils import logging as hub_logging
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hub_logging.set_verbosity_error()
    # bitsandbytes 0.50 warns at import that an optional inference kernel for AVX512-BF16 CPUs
    # (the `kernels` package) is missing; training never uses it (_keep_nf4_trainable).
    logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)


def load_tokenizer(name_or_path: str):
    if name_or_path in tiny.BUILTINS:
        return tiny.build_tokenizer(name_or_path)
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


def policy_dtype(cfg: Config, device: torch.device) -> torch.dtype:
    """The dtype the policy's weights load in: ``model.dtype``, or for ``auto`` fp32 master
    weights; under LoRA the frozen base needs no master copy, so ``auto`` is the autocast dtype
    (bf16 on CUDA) while peft keeps the adapter in fp32."""
    if cfg.model.dtype != AUTO:
        return _DTYPES[cfg.model.dtype]
    amp = autocast_dtype(cfg, device)
    return amp if (cfg.model.lora.r and amp is not None) else torch.float32


def load_policy(
    cfg: Config, tokenizer, device: torch.device, hf_config=None, base_path: str | None = None
) -> nn.Module:
    """The trainable causal LM, on ``device``, in ``policy_dtype``; with ``model.lora.r > 0`` a
    peft model whose adapter alone trains (``grpo_fast.policy.lora``), on a 4-bit base with
    ``model.load_in_4bit``.

    ``hf_config``: build a randomly initialized model of that architecture instead of loading
    ``model.name_or_path`` (benchmarks of real shapes without weights). ``base_path``: load the
    base from this folder instead (the built-in model written to ``output_dir/base`` for LoRA).
    """
    m = cfg.model
    dtype = policy_dtype(cfg, device)
    source = base_path or m.name_or_path
    if source in tiny.BUILTINS and hf_config is None:
        if m.load_in_4bit:  # bitsandbytes quantizes as transformers loads: from a folder
            raise ValueError("a 4-bit built-in base loads from the folder it was written to: pass base_path")
        model = tiny.build_model(tokenizer, seed=cfg.seed).to(dtype)
    else:
        model = _from_hub_or_folder(cfg, source, dtype, device, hf_config)
    if not m.load_in_4bit:  # bitsandbytes placed the 4-bit model already
        model.to(device)
    else:
        _keep_nf4_trainable(model)
    model.config.use_cache = False  # training; generate() turns the cache on for itself
    if m.lora.r:
        from grpo_fast.policy.lora import apply_lora

        model = apply_lora(model, m.lora, source)
    if m.gradient_checkpointing:
        enable_checkpointing(model)
    # from_pretrained returns eval mode, and transformers checkpoints only in training mode: the
    # policy stays in train mode (rollout backends switch to eval and back around generate).
    model.train()
    return model


def _keep_nf4_trainable(model: nn.Module) -> None:
    """The one reach-in into bitsandbytes (0.50.2): on a CPU with AVX512-BF16, a ``Linear4bit``
    run in eval mode without gradients (our rollouts and evaluations) repacks its weight in place
    for inference (``packing_format_for_cpu``), and its next training forward then fails ("a view
    of a leaf Variable that requires grad is being used in an in-place operation"). The policy
    generates and trains with the same weights, so that repacking is turned off."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def attention_choice(cfg: Config, device: torch.device) -> str:
    """The attention implementation a hub or folder model loads with: ``model.attn_implementation``,
    its ``auto`` being flash-attention 2 on CUDA where installed and nothing wraps the attention,
    else sdpa."""
    attn = cfg.model.attn_implementation
    if attn != AUTO:
        return attn
    has_fa2 = importlib.util.find_spec("flash_attn") is not None
    # train.share_prompts and train.sequence_parallel wrap sdpa or eager attention
    # (policy/shared_attention.py, policy/ulysses.py), not flash
    fa2 = device.type == "cuda" and has_fa2 and not shares_prompts(cfg) and cfg.train.sequence_parallel == 1
    return "flash_attention_2" if fa2 else "sdpa"


def model_skeleton(cfg: Config, tokenizer, device: torch.device) -> nn.Module:
    """The causal LM ``load_policy`` would build, on the meta device: its modules, config and
    attention implementation, no weights read and nothing allocated (the dry run's checks of what
    only the model's modules tell). A hub model's config comes from the local cache only;
    ``ConfigError`` when it is not there."""
    m = cfg.model
    if m.name_or_path in tiny.BUILTINS:
        from transformers import Qwen2ForCausalLM

        with torch.device("meta"):
            return Qwen2ForCausalLM(tiny.build_model_config(tokenizer))
    from transformers import AutoConfig, AutoModelForCausalLM

    try:
        config = AutoConfig.from_pretrained(
            m.name_or_path, local_files_only=True, trust_remote_code=m.trust_remote_code
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path={m.name_or_path!r}: cannot read its config ({exc})") from None
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(
            config, attn_implementation=attention_choice(cfg, device), trust_remote_code=m.trust_remote_code
        )


def _from_hub_or_folder(cfg: Config, source: str, dtype: torch.dtype, device: torch.device, hf_config):
    from transformers import AutoModelForCausalLM

    m = cfg.model
    attn = attention_choice(cfg, device)
    if hf_config is not None:
        with torch.device(device):  # initialize in place: a 1.5 B fp32 model is 6 GB
            return AutoModelForCausalLM.from_config(hf_config, attn_implementation=attn, dtype=dtype)
    extra = {}
    if m.load_in_4bit:
        from transformers import BitsAndBytesConfig

        extra = dict(
            quantization_config=BitsAndBytesConfig(
                load_in_4bit=True,
                bnb_4bit_quant_type="nf4",
                bnb_4bit_compute_dtype=autocast_dtype(cfg, device) or torch.float32,
            ),
            device_map={"": device},
        )
    try:
        return AutoModelForCausalLM.from_pretrained(
            source, dtype=dtype, attn_implementation=attn, trust_remote_code=m.trust_remote_code, **extra
        )
    except (OSError, ValueError) as exc:
        raise ConfigError(f"model.name_or_path={m.name_or_path!r}: cannot load the model ({exc})") from None


def enable_checkpointing(model: nn.Module) -> None:
    """Per-layer activation checkpointing, non-reentrant. transformers ≥ 5.2x names it
    ``activation_checkpointing_enable`` (``gradient_checkpointing_enable`` is deprecated there)."""
    if hasattr(model, "activation_checkpointing_enable"):
        model.activation_checkpointing_enable(activation_checkpointing_kwargs={"use_reentrant": False})
    else:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
