"""``HFCopyBackend``: the hf decoder on a copy of the policy in the training process
(``rollout.placement=colocated`` with ``rollout.max_staleness > 0``: the producer's thread of
``grpo_fast.loop.pipeline`` samples from the copy while the trainer changes its own weights), and
what a policy version is for an hf backend with weights of its own (this one, and the worker
process of ``grpo_fast.rollout.hf.process``).

Both take the weights of a policy version as ``load_weights(tensors, version)``: the trainable
parameters by name (``trainable_tensors``: what an optimizer step changes; the frozen ones, the
buffers and the tied head came with the copy), copied exactly (``Tensor.copy_``: the sampler's
weights are the trainer's, bit for bit).
"""

from __future__ import annotations

import copy
import time

import torch

from grpo_fast.rollout.base import Rollout, SamplingParams, WeightsFromStage
from grpo_fast.rollout.hf.decoder import HFBackend


def trainable_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``{name: tensor}`` of ``model``'s parameters that train (``requires_grad``), detached, in
    ``named_parameters`` order: what a policy version adds to the copy a sampler started from."""
    return {name: p.detach() for name, p in model.named_parameters() if p.requires_grad}


def staged_tensors(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``trainable_tensors`` copied to the host: a policy version, as the trainer publishes it
    for ``load_weights`` (the producer loads it later, while the trainer has moved on)."""
    return {name: t.to("cpu", copy=True) for name, t in trainable_tensors(model).items()}


def stage_trainable(model: torch.nn.Module, keep: bool = True) -> dict[str, torch.Tensor]:
    """A policy version of ``model`` for a backend with a copy of its own (``load_weights``): the
    trainable tensors, copied to the host (``staged_tensors``) unless they are loaded at once
    (``keep=False``: read in place)."""
    return staged_tensors(model) if keep else trainable_tensors(model)


_DIGEST_CHUNK = 1 << 20  # elements per step of ``weights_digest`` (8 MiB of int64 temporaries)


def weights_digest(tensors: dict[str, torch.Tensor]) -> list[tuple[int, int]]:
    """Per tensor, in ``tensors``' order: (the sum of its raw words, their sum weighted by position
    mod 65,521), as int64 that wraps. Integer arithmetic, so it is the same whatever the thread
    count or the order of the additions: two processes holding the same bytes agree exactly, and
    a stale, torn or permuted copy disagrees. The probe of a worker's weight load; ~1 ms per
    million parameters on one core."""
    weights = torch.arange(_DIGEST_CHUNK, dtype=torch.int64) % 65521 + 1
    out = []
    for t in tensors.values():
        flat = t.detach().contiguous().view(-1)
        words = flat.view(
            {1: torch.int8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[flat.element_size()]
        )
        plain = weighted = 0
        for start in range(0, words.numel(), _DIGEST_CHUNK):
            w = words[start : start + _DIGEST_CHUNK].to(torch.int64)
            plain += int(w.sum())
            weighted += int((w * weights[: w.numel()]).sum())
        out.append((plain % 2**64, weighted % 2**64))
    return out


def _generator(params: SamplingParams, device: torch.device) -> torch.Generator | None:
    """A random stream of the call's own, seeded by ``params.seed`` (None: torch's global one): a
    sampler apart from the trainer draws the same tokens whatever runs beside it."""
    if params.seed is None:
        return None
    return torch.Generator(device=device).manual_seed(int(params.seed))


class HFCopyBackend(WeightsFromStage):
    """hf sampling from a copy of the policy in this process: the trainer's model stays the
    trainer's while a producer thread samples from the copy. ``version``: the policy version the
    copy holds (``Trajectory.policy_version`` of what it samples).

    The copy is a ``deepcopy`` made once, with no gradients; ``load_weights`` then refreshes its
    trainable parameters, exactly."""

    def __init__(self, model: torch.nn.Module, tokenizer, generation_batch_size: int, autocast_dtype=None):
        self.model = copy.deepcopy(model).requires_grad_(False)
        self._params = dict(self.model.named_parameters())
        self._hf = HFBackend(self.model, tokenizer, generation_batch_size, autocast_dtype)
        self.sync_seconds: float | None = None  # the last load's duration

    @property
    def version(self) -> int:
        return self._hf.version

    stage = staticmethod(stage_trainable)  # a policy version of ``model``, for ``load_weights``

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """The trainable parameters of policy version ``version`` (``trainable_tensors``)."""
        t0 = time.perf_counter()
        with torch.no_grad():
            for name, value in tensors.items():
                self._params[name].copy_(value)
        self._hf.version = version
        self.sync_seconds = time.perf_counter() - t0

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        device = next(self.model.parameters()).device
        self._hf.generator = _generator(params, device)
        return self._hf.generate(prompt_ids, params, progress=progress)

    def sleep(self) -> None:
        """Nothing to free."""

    def close(self) -> None:
        """Nothing to stop."""
