"""Loading the policy, and the module that turns a packed microbatch into the GRPO loss.

``PolicyLoss`` runs the decoder up to its last hidden states, keeps only the response
positions, and hands them with the lm_head weight to ``fused_linear_grpo_loss``: prompt tokens
never reach the lm_head and the ``[tokens × vocab]`` logits never exist. It is an
``nn.Module`` so that DDP/FSDP wrap it and see every forward.
"""

from __future__ import annotations

import contextlib
import importlib.util
import weakref
from pathlib import Path

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from grpo_fast.algo.core import GRPOLossOutput
from grpo_fast.config import AUTO, Config
from grpo_fast.errors import ConfigError
from grpo_fast.ops import fused_linear_grpo_loss
from grpo_fast.policy.batch import Microbatch
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


def build_policy_loss(cfg: Config, model: nn.Module, amp: torch.dtype | None) -> PolicyLoss:
    """The loss module with the ``loss.*`` options of ``cfg`` (β and temperature come per call)."""
    lo = cfg.loss
    return PolicyLoss(
        model,
        autocast=amp,
        loss_options=dict(
            clip_low=lo.clip_low,
            clip_high=lo.clip_high,
            dual_clip=lo.dual_clip,
            delta=lo.delta,
            importance_sampling_level=lo.importance_sampling_level,
            top_entropy_quantile=lo.top_entropy_quantile,
            kl_estimator=lo.kl_estimator,
            entropy_coef=lo.entropy_coef,
            loss_type=lo.type,
            backend=lo.kernel_backend,
            chunk_size=None if lo.chunk_size == AUTO else int(lo.chunk_size),
        ),
    )


def response_hidden_states(model: nn.Module, mb: Microbatch) -> torch.Tensor:
    """Last-layer hidden states at the response positions: ``[n, D]``.

    A packed microbatch under flash-attention hands its precomputed ``cu_seqlens`` / ``max_seqlen``
    to transformers' varlen path (written against transformers 5.24: the ``cu_seq_lens_q/k``,
    ``max_length_q/k`` keyword arguments of ``_flash_attention_forward``), which would otherwise
    derive them from ``position_ids`` in every layer. transformers' mask preparation still reads
    the mask or the position ids once per forward (``find_packed_sequence_indices``,
    ``_ignore_causal_mask_sdpa``): one host-device sync per forward that is not ours.
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    kwargs = {"input_ids": mb.input_ids, "use_cache": False}
    if mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask
    if mb.position_ids is not None:
        kwargs["position_ids"] = mb.position_ids
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    if mb.cu_seqlens is not None and attn.startswith("flash_attention"):
        kwargs.update(
            cu_seq_lens_q=mb.cu_seqlens,
            cu_seq_lens_k=mb.cu_seqlens,
            max_length_q=mb.max_seqlen,
            max_length_k=mb.max_seqlen,
        )
    hidden = backbone(**kwargs).last_hidden_state  # [b, L, D]
    return hidden.flatten(0, 1).index_select(0, mb.select_index)  # [b·L, D] -> [n, D], no sync


class PolicyLoss(nn.Module):
    """``forward(microbatch, beta, temperature) -> GRPOLossOutput``, loss options fixed at construction.

    ``temperature`` is the one the responses were sampled at (the trainer's log-probs must be of
    the same tempered distribution); ``beta`` changes under the adaptive KL controller.

    Under autocast the lm_head GEMMs run in the autocast dtype, from one copy of the (fp32 master)
    lm_head weight in that dtype per optimizer step, not one per microbatch: the copy is kept
    while the weight is unchanged (same storage, same ``_version``, which every in-place update
    bumps) and dropped after every ``optimizer.step()`` (a global ``torch.optim`` step post-hook;
    an optimizer that writes through raw pointers, bitsandbytes' 8-bit AdamW, may not bump
    ``_version``). Memory: one ``[V, D]`` buffer in the autocast dtype, from the first forward
    to the step (Qwen2.5-1.5B: 151,936 × 1,536 bf16 = 467 MB; the planner counts a bf16 copy of
    every weight under autocast), where each microbatch's forward allocated and freed it before.
    """

    def __init__(self, model: nn.Module, *, autocast: torch.dtype | None, loss_options: dict):
        super().__init__()
        self.model = model
        self.autocast = autocast
        self.loss_options = loss_options
        self._head_cast: torch.Tensor | None = None  # [V, D] in the autocast dtype
        self._head_src = None  # weak reference to the weight it was cast from
        self._head_key: tuple | None = None  # (storage, _version) of that weight then
        this = weakref.ref(self)

        def after_step(*_) -> None:
            if (policy := this()) is not None:
                policy.release_head_cast()

        weakref.finalize(self, register_optimizer_step_post_hook(after_step).remove)

    def release_head_cast(self) -> None:
        """Drop the cached lm_head copy (after an optimizer step; the next forward casts anew)."""
        self._head_cast = self._head_src = self._head_key = None

    def _autocast(self, device: torch.device):
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast)

    def step_cast_cache(self, device: torch.device):
        """A context the loop holds around all the microbatches of one optimizer step, so that
        under autocast each backbone weight is cast once per step, not once per microbatch.

        Autocast caches its casts of leaf, requires-grad tensors (the weights) until the
        outermost autocast context exits; this is such a context with autocast *disabled*
        (the backward passes inside it run outside autocast, as they must), and each forward's
        own autocast region nests in it. The weights do not change within a step; the copies,
        one per weight in the autocast dtype, live until the context ends, before
        ``optimizer.step()``. A no-op without autocast.
        """
        if self.autocast is None:
            return contextlib.nullcontext()
        return torch.autocast(device.type, dtype=self.autocast, enabled=False)

    def _head_in_compute_dtype(self, head: torch.Tensor) -> torch.Tensor | None:
        """``head`` ``[V, D]`` in the autocast dtype, cast at most once per weight update; None
        when there is nothing to cast (no autocast, or the weight already in that dtype)."""
        if self.autocast is None or head.dtype == self.autocast:
            return None
        key = (head.untyped_storage().data_ptr(), head._version)
        if self._head_src is None or self._head_src() is not head or key != self._head_key:
            self.release_head_cast()  # free the stale copy before allocating its successor
            with torch.no_grad():
                self._head_cast = head.to(self.autocast)
            self._head_src, self._head_key = weakref.ref(head), key
        return self._head_cast

    def forward(self, mb: Microbatch, beta: float, temperature: float) -> GRPOLossOutput:
        with self._autocast(mb.input_ids.device):
            hidden = response_hidden_states(self.model, mb)
        head = self.model.get_output_embeddings().weight  # [V, D], the (fp32 master) weight itself
        # The op takes the master weight and hands back its gradient as accumulated, in fp32 (no
        # [V, D] casts in the backward; a tied embedding's gradient adds to it as usual); its GEMMs
        # read the cached copy in the compute dtype.
        return fused_linear_grpo_loss(
            hidden,
            head,
            mb.labels,
            mb.advantages,
            mb.loss_weights,
            old_logprobs=mb.old_logprobs,
            ref_logprobs=mb.ref_logprobs,
            temperature=temperature,
            beta=beta,
            compute_dtype=self.autocast or head.dtype,
            weight_cast=self._head_in_compute_dtype(head),
            label_bounds=mb.label_bounds,  # read on the CPU when the microbatch was built: no sync
            # GSPO: which response each token belongs to (its ratio is the response's)
            sequence_ids=mb.sequence_ids
            if self.loss_options.get("importance_sampling_level") == "sequence"
            else None,
            **self.loss_options,
        )
