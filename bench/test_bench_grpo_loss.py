"""grpo_loss_from_logits forward + backward: eager, torch.compile(eager), torch_chunked, triton
(also with inplace_grad), and Liger-Kernel's Triton GRPO loss when it is installed (CUDA only).

Off-policy (ratio and clipping active), β = 0.04 with k3, entropy bonus 0.01, T = 0.7.
Traffic floor per step: 3·N·V·bytes (read the logits twice, write their gradient once).
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.algo.core import eager_grpo_loss_from_logits
from grpo_fast.ops import grpo_loss_from_logits

CPU_SHAPES = [pytest.param(512, 32768, id="N512-V32768"), pytest.param(128, 151936, id="N128-V151936")]
GPU_SHAPES = [pytest.param(n, 151936, id=f"N{n}-V151936") for n in (2048, 8192, 16384)]
OPTIONS = dict(temperature=0.7, beta=0.04, entropy_coef=0.01)


def _liger_loss(logits, labels, advantages, loss_weights, old_logprobs, ref_logprobs):
    """Liger-Kernel's logits-level Triton GRPO loss on our [N, V] batch, as one sequence.

    Written against Liger-Kernel 0.6 (liger_kernel/transformers/grpo_loss.py, read 2026-11):
    ``triton_grpo_loss(logits [B, L+1, V], old_logp [B, L], ref_logp [B, L], completion_ids [B, L],
    advantages [B], completion_mask [B, L], temperature, beta, eps_low, eps_high, inplace)``; it drops
    the last position, so ``logits`` here is ``[N + 1, V]``. Its return value changed across
    versions (a loss, or a tuple whose first item is the per-token loss).
    """
    from liger_kernel.transformers.grpo_loss import triton_grpo_loss

    out = triton_grpo_loss(
        logits[None],
        old_logprobs[None],
        ref_logprobs[None],
        labels[None],
        advantages[:1],
        (loss_weights[None] > 0).to(torch.int32),
        temperature=OPTIONS["temperature"],
        beta=OPTIONS["beta"],
        eps_low=0.2,
        eps_high=0.2,
        inplace=True,
    )
    loss = out[0] if isinstance(out, tuple) else out
    return loss.sum()


def build_step(impl: str, n: int, v: int, dtype: torch.dtype, device: str):
    """Inputs on ``device`` and the step: the loss and its gradient w.r.t. the logits."""
    g = torch.Generator(device).manual_seed(0)
    rows = n + 1 if impl == "liger" else n
    base = (3 * torch.randn(rows, v, generator=g, device=device)).to(dtype).requires_grad_()
    # inplace_grad needs logits made by an op (the lm_head output in training), not a leaf
    logits = base * 1.0 if impl in ("triton_inplace", "liger") else base
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    advantages = torch.randn(n, generator=g, device=device)
    loss_weights = torch.full((n,), 1.0 / n, device=device)
    old = torch.randn(n, generator=g, device=device) * 0.1 - math.log(v)
    ref = torch.randn(n, generator=g, device=device) * 0.1 - math.log(v)
    args = (logits, labels, advantages, loss_weights)
    kwargs = dict(old_logprobs=old, ref_logprobs=ref, **OPTIONS)
    if impl == "eager":
        loss_fn = lambda: eager_grpo_loss_from_logits(*args, **kwargs).loss
    elif impl == "compiled":
        compiled = torch.compile(eager_grpo_loss_from_logits)
        loss_fn = lambda: compiled(*args, **kwargs).loss
    elif impl == "liger":
        loss_fn = lambda: _liger_loss(logits, labels, advantages, loss_weights, old, ref)
    elif impl == "triton_inplace":
        loss_fn = lambda: grpo_loss_from_logits(*args, backend="triton", inplace_grad=True, **kwargs).loss
    else:
        loss_fn = lambda: grpo_loss_from_logits(*args, backend=impl, **kwargs).loss

    def step() -> None:
        torch.autograd.grad(loss_fn(), logits)
        if logits.is_cuda:
            torch.cuda.synchronize()  # sync point: the timer stops after the kernels

    return step


@pytest.mark.parametrize(("n", "v"), CPU_SHAPES)
@pytest.mark.parametrize("impl", ["eager", "compiled", "torch_chunked"])
def test_cpu(run_bench, impl, n, v):
    run_bench(
        build_step, impl, n, v, torch.float32, "cpu", device=torch.device("cpu"), may_fail=impl == "compiled"
    )


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "v"), GPU_SHAPES)
@pytest.mark.parametrize("impl", ["eager", "compiled", "torch_chunked", "triton", "triton_inplace", "liger"])
def test_gpu(run_bench, impl, n, v):
    if impl == "liger":
        pytest.importorskip("liger_kernel")
    run_bench(
        build_step,
        impl,
        n,
        v,
        torch.bfloat16,
        "cuda",
        device=torch.device("cuda"),
        rounds=10,
        traffic_bytes=3 * n * v * 2,
        may_fail=impl in ("eager", "compiled", "liger"),
    )
