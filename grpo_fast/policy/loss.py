"""The module that turns a packed microbatch into the GRPO loss: ``PolicyLoss``.

``PolicyLoss`` runs the decoder up to its last hidden states, keeps only the response
positions, and hands them with the lm_head weight to ``fused_linear_grpo_loss``: prompt tokens
never reach the lm_head and the ``[tokens × vocab]`` logits never exist. It is an
``nn.Module`` so that DDP/FSDP wrap it and see every forward.
"""

from __future__ import annotations

import contextlib
import weakref

import torch
from torch import nn
from torch.optim.optimizer import register_optimizer_step_post_hook

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.token_loss import GRPOLossOutput
from grpo_fast.domains import AUTO
from grpo_fast.ops import fused_linear_grpo_loss
from grpo_fast.policy import sequence_parallel, shared_attention
from grpo_fast.policy.batch import Microbatch
from grpo_fast.policy.value import ValueHead, clipped_value_loss


def build_policy_loss(cfg, model: nn.Module, amp: torch.dtype | None) -> PolicyLoss:
    """The loss module for ``model`` with the run's kernel backend and lm_head chunk
    (``loss.kernel_backend``, ``loss.chunk_size``) and the sampler's truncation
    (``trainer_truncation``); the loss options come with each call."""
    lo = cfg.loss
    chunk = None if lo.chunk_size == AUTO else int(lo.chunk_size)
    top_k, top_p = trainer_truncation(cfg)
    return PolicyLoss(
        model, autocast=amp, backend=lo.kernel_backend, chunk_size=chunk, top_k=top_k, top_p=top_p
    )


def trainer_truncation(cfg) -> tuple[int, float]:
    """``(top_k, top_p)`` of the distribution the trainer's log-probs are taken over: the
    sampler's own (``rollout.top_k``, ``rollout.top_p``) when it truncates and
    ``loss.truncated_logprobs`` is ``auto`` or true; ``(0, 1.0)``, the full vocabulary, otherwise."""
    r = cfg.rollout
    if cfg.loss.truncated_logprobs is False or not (r.top_k > 0 or r.top_p < 1):
        return 0, 1.0
    return r.top_k, r.top_p


def response_hidden_states(model: nn.Module, mb: Microbatch) -> torch.Tensor:
    """Last-layer hidden states at the response positions: ``[n, D]`` (one sp rank's slice of a
    microbatch, ``policy/sequence_parallel.py``: at the positions it holds).

    A packed microbatch under flash-attention hands its precomputed ``cu_seqlens`` / ``max_seqlen``
    to transformers' varlen path (written against transformers 5.24: the ``cu_seq_lens_q/k``,
    ``max_length_q/k`` keyword arguments of ``_flash_attention_forward``), which would otherwise
    derive them from ``position_ids`` in every layer. transformers' mask preparation still reads
    the mask or the position ids once per forward (``find_packed_sequence_indices``,
    ``_ignore_causal_mask_sdpa``): one host-device sync per forward that is not ours.
    """
    backbone = model.get_decoder() if hasattr(model, "get_decoder") else model.model
    if isinstance(mb, sequence_parallel.ShardedMicrobatch):  # this sp rank's tokens, Ulysses attention
        hidden = sequence_parallel.local_hidden_states(model, backbone, mb)  # [b, L'/N, D]
        return hidden.flatten(0, 1).index_select(0, mb.select_index)
    kwargs = {"input_ids": mb.input_ids, "use_cache": False}
    attn = getattr(getattr(model, "config", None), "_attn_implementation", None) or ""
    if mb.shared is not None:  # train.share_prompts: the layout, not a mask, says who sees whom
        shared_attention.enable(model)
        kwargs["attention_mask"] = shared_attention.placeholder_mask(mb.input_ids)
        kwargs["shared_prompt_layout"] = mb.shared
    elif mb.attention_mask is not None:
        kwargs["attention_mask"] = mb.attention_mask
    if mb.position_ids is not None:
        kwargs["position_ids"] = mb.position_ids
    if mb.cu_seqlens is not None and attn.startswith("flash_attention"):
        kwargs.update(
            cu_seq_lens_q=mb.cu_seqlens,
            cu_seq_lens_k=mb.cu_seqlens,
            max_length_q=mb.max_seqlen,
            max_length_k=mb.max_seqlen,
        )
    if mb.shared is not None:
        mb.shared.used = 0
    hidden = backbone(**kwargs).last_hidden_state  # [b, L, D]
    if mb.shared is not None:
        shared_attention.check_used(model, mb.shared)
    return hidden.flatten(0, 1).index_select(0, mb.select_index)  # [b·L, D] -> [n, D], no sync


class PolicyLoss(nn.Module):
    """``forward(microbatch, options, temperature) -> GRPOLossOutput``.

    ``options``: the ``LossOptions`` of this call (β changes under the adaptive KL controller;
    the no-grad π_old / π_ref / probe passes need only log-probs, any options do).
    ``temperature`` is the one the responses were sampled at (the trainer's log-probs must be of
    the same tempered distribution). ``backend`` and ``chunk_size`` (None: the op's default) are
    the fused op's, fixed at construction; so are ``top_k`` / ``top_p``, the sampler's truncation
    (``trainer_truncation``: the log-probs of the distribution the responses were drawn from),
    which a call with ``truncated=False`` leaves out (the weight-sync probe: vLLM's prompt
    log-probs are the full vocabulary's).

    Under autocast the lm_head GEMMs run in the autocast dtype, from one copy of the (fp32 master)
    lm_head weight in that dtype per optimizer step, not one per microbatch: the copy is kept
    while the weight is unchanged (same storage, same ``_version``, which every in-place update
    bumps) and dropped after every ``optimizer.step()`` (a global ``torch.optim`` step post-hook;
    an optimizer that writes through raw pointers, bitsandbytes' 8-bit AdamW, may not bump
    ``_version``). Memory: one ``[V, D]`` buffer in the autocast dtype, from the first forward
    to the step (Qwen2.5-1.5B: 151,936 × 1,536 bf16 = 467 MB; the planner counts a bf16 copy of
    every weight under autocast), where each microbatch's forward allocated and freed it before.
    """

    def __init__(
        self,
        model: nn.Module,
        *,
        autocast: torch.dtype | None,
        backend: str = "auto",
        chunk_size: int | None = None,
        top_k: int = 0,
        top_p: float = 1.0,
    ):
        super().__init__()
        self.model = model
        self.autocast = autocast
        self.backend = backend
        self.chunk_size = chunk_size
        self.top_k, self.top_p = top_k, top_p
        # loss.advantage=gae: the value head on these hidden states (attach_value_head)
        self.value_head: ValueHead | None = None
        self.trunk_coef, self.value_clip = 0.0, None
        self._head_cast: torch.Tensor | None = None  # [V, D] in the autocast dtype
        self._head_src = None  # weak reference to the weight it was cast from
        self._head_key: tuple | None = None  # (storage, _version) of that weight then
        this = weakref.ref(self)

        def after_step(*_) -> None:
            if (policy := this()) is not None:
                policy.release_head_cast()

        weakref.finalize(self, register_optimizer_step_post_hook(after_step).remove)

    def attach_value_head(self, head: ValueHead, trunk_coef: float, value_clip: float | None) -> None:
        """``loss.advantage=gae``: every forward also returns the head's values of the response
        positions, and, for a microbatch with ``returns``, the clipped value loss
        (``grpo_fast.policy.value``; ``critic.trunk_coef``, ``critic.value_clip``). Before
        FSDP or DDP wrap this module."""
        self.value_head, self.trunk_coef, self.value_clip = head, float(trunk_coef), value_clip

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

    def forward(
        self, mb: Microbatch, options: LossOptions, temperature: float, truncated: bool = True
    ) -> GRPOLossOutput:
        with self._autocast(mb.input_ids.device):
            hidden = response_hidden_states(self.model, mb)
        head = self.model.get_output_embeddings().weight  # [V, D], the (fp32 master) weight itself
        # The op takes the master weight and hands back its gradient as accumulated, in fp32 (no
        # [V, D] casts in the backward; a tied embedding's gradient adds to it as usual); its GEMMs
        # read the cached copy in the compute dtype.
        out = fused_linear_grpo_loss(
            hidden,
            head,
            mb.labels,
            mb.advantages,
            mb.loss_weights,
            old_logprobs=mb.old_logprobs,
            ref_logprobs=mb.ref_logprobs,
            temperature=temperature,
            # GSPO: which response each token belongs to (its ratio is the response's)
            sequence_ids=mb.sequence_ids if options.importance_sampling_level == "sequence" else None,
            options=options,
            compute_dtype=self.autocast or head.dtype,
            chunk_size=self.chunk_size,
            backend=self.backend,
            weight_cast=self._head_in_compute_dtype(head),
            label_bounds=mb.label_bounds,  # read on the CPU when the microbatch was built: no sync
            top_k=self.top_k if truncated else 0,
            top_p=self.top_p if truncated else 1.0,
            across=sequence_parallel.across(mb),  # sp: whole-row statistics reduce over the group
        )
        if self.value_head is None:
            return out
        values = self.value_head(hidden, self.trunk_coef)  # [n] fp32
        if mb.returns is None:  # a no-grad pass for the values (the step's finalize)
            return out._replace(values=values.detach())
        loss, clipped = clipped_value_loss(
            values, mb.returns, mb.old_values, mb.loss_weights, self.value_clip
        )
        return out._replace(values=values.detach(), value_loss=loss, value_clipped=clipped)
