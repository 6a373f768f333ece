"""fused_linear_grpo_loss forward + backward from hidden states: the materialized eager path,
torch.compile of it, torch_chunked, triton, and Liger-Kernel's fused-linear GRPO loss (CUDA only),
beside ``gemm_floor``: the op's three GEMMs alone at the same shape, the time it cannot go below.
And a ``chunk_size`` axis: rows of logits per lm_head chunk, default against smaller and larger; and
a ``frozen_head`` axis: the lm_head trainable (full fine-tuning) or frozen (LoRA: no ``[V, D]`` fp32
gradient, 2 GEMMs a chunk instead of 3).

The op is matmul-bound: 3 GEMMs of 2·N·D·V FLOP each (logits, grad_hidden, grad_weight), so CUDA
cases report ``tflops``.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.testing import fused_linear_workload

CPU_SHAPES = [
    pytest.param(1024, 256, 32768, id="N1024-D256-V32768"),
    pytest.param(4096, 256, 32768, id="N4096-D256-V32768", marks=pytest.mark.slow),
]
GPU_SHAPES = [pytest.param(n, 1536, 151936, id=f"N{n}-D1536-V151936") for n in (2048, 8192, 16384)]


def build_liger_step(n: int, d: int, v: int, dtype: torch.dtype, device: str):
    """Liger-Kernel's chunked fused-linear GRPO loss on the same problem, as 16 sequences.

    Written against Liger-Kernel 0.6 (liger_kernel/chunked_loss/grpo_loss.py, read 2026-11):
    ``LigerFusedLinearGRPOLoss(beta, use_ref_model, loss_type, ...)(_input [B, T, D],
    lin_weight [V, D], selected_token_ids [B, T], attention_mask [B, T], advantages [B],
    old_per_token_logps=[B, T])`` returns ``(loss, metrics)``.
    """
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    b, t = 16, n // 16
    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(b, t, d, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (b, t), generator=g, device=device)
    mask = torch.ones(b, t, device=device, dtype=torch.int64)
    advantages = torch.randn(b, generator=g, device=device)
    old = torch.randn(b, t, generator=g, device=device) - math.log(v)
    loss_fn = LigerFusedLinearGRPOLoss(beta=0.0, use_ref_model=False, loss_type="grpo")

    def step() -> None:
        loss, _ = loss_fn(hidden, weight, labels, mask, advantages, old_per_token_logps=old)
        loss.backward()
        hidden.grad = None
        weight.grad = None
        torch.cuda.synchronize()  # sync point: the timer stops after the kernels

    return step


def build_gemm_floor_step(n: int, d: int, v: int, dtype: torch.dtype, device: str):
    """The fused op's three GEMMs and nothing else, on its default chunks: per chunk ``logits = h·Wᵀ``,
    ``grad_hidden = logits·W`` and ``grad_weight += logitsᵀ·h`` (the op's fp32 accumulation), into
    buffers made once. The op's time over this row is what its softmax, entropy and gradient
    elementwise work, row math and allocations cost."""
    from grpo_fast.ops.fused_linear_grpo_loss import _accumulate_fp32, default_chunk_size

    g = torch.Generator(device).manual_seed(0)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype)
    weight = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype)
    chunk = default_chunk_size(n, v, dtype, torch.device(device).type)
    logits = torch.empty(chunk, v, dtype=dtype, device=device)
    grad_hidden = torch.empty_like(hidden)
    grad_weight = torch.zeros(v, d, dtype=torch.float32, device=device)

    def step() -> None:
        for r0 in range(0, n, chunk):
            h = hidden[r0 : r0 + chunk]
            z = torch.mm(h, weight.t(), out=logits[: h.shape[0]])  # [C, V]
            torch.mm(z, weight, out=grad_hidden[r0 : r0 + chunk])  # [C, D]
            _accumulate_fp32(grad_weight, z.t(), h)  # [V, D] fp32
        if hidden.is_cuda:
            torch.cuda.synchronize()  # sync point: the timer stops after the kernels

    return step


# The issue-12 loss variants on the fused op: (loss options, lm_head GEMMs per chunk). GSPO and
# the entropy quantile run the two-pass mode (one more logits GEMM).
VARIANTS = {
    "cispo": (dict(loss_type="cispo", clip_low=0.999, clip_high=0.28), 3),
    "gspo-two-pass": (dict(importance_sampling_level="sequence", clip_low=3e-4, clip_high=4e-4), 4),
    "top-entropy-0.2-two-pass": (dict(top_entropy_quantile=0.2), 4),
}


def build_variant_step(variant: str, n: int, d: int, v: int, dtype: torch.dtype, device: str):
    """One fused fwd+bwd (``triton``) with a ``VARIANTS`` loss on responses of 64 tokens, off-policy."""
    backend = "triton" if device == "cuda" else "torch_chunked"
    return fused_linear_workload(backend, n, d, v, dtype, device, **VARIANTS[variant][0])


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "d", "v"), GPU_SHAPES[:2])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_gpu_variants(run_bench, variant, n, d, v):
    gemms = VARIANTS[variant][1]
    run_bench(
        build_variant_step, variant, n, d, v, torch.bfloat16, "cuda",
        device=torch.device("cuda"), rounds=10, flops=gemms * 2 * n * d * v,
    )  # fmt: skip


@pytest.mark.parametrize(("n", "d", "v"), CPU_SHAPES)
@pytest.mark.parametrize("impl", ["eager", "compiled", "torch_chunked", "gemm_floor"])
def test_cpu(run_bench, impl, n, d, v):
    if impl == "gemm_floor":
        build, args = build_gemm_floor_step, (n, d, v, torch.float32, "cpu")
    else:
        build, args = fused_linear_workload, (impl, n, d, v, torch.float32, "cpu")
    run_bench(build, *args, device=torch.device("cpu"), rounds=3, may_fail=impl == "compiled")


@pytest.mark.gpu
@pytest.mark.parametrize(("n", "d", "v"), GPU_SHAPES)
@pytest.mark.parametrize("impl", ["eager", "compiled", "torch_chunked", "triton", "liger", "gemm_floor"])
def test_gpu(run_bench, impl, n, d, v):
    if impl == "liger":
        pytest.importorskip("liger_kernel")
        build, args = build_liger_step, (n, d, v, torch.bfloat16, "cuda")
    elif impl == "gemm_floor":
        build, args = build_gemm_floor_step, (n, d, v, torch.bfloat16, "cuda")
    else:
        build, args = fused_linear_workload, (impl, n, d, v, torch.bfloat16, "cuda")
    run_bench(
        build,
        *args,
        device=torch.device("cuda"),
        rounds=10,
        flops=3 * 2 * n * d * v,
        may_fail=impl in ("eager", "compiled", "liger"),
    )


# The chunk_size axis (issue 11, item 9): rows of logits per lm_head chunk. On CUDA the default is
# 2,048 rows at V = 151,936 bf16 (the GEMM-efficiency floor: the fp32 weight-gradient GEMM at
# ≈ C·D / (C + 4·D) = 384 FLOP/byte, D = 1,536), against 384 from the 128 MiB budget alone (90).
# On CPU the default is the 64 MiB budget's 512 rows at V = 32,768 fp32 (1,024 before 2026-12-03).
CPU_CHUNKS = [256, 512, 1024]
GPU_CHUNKS = [384, 1024, 2048, 4096]


def build_chunk_step(chunk_size: int, n: int, d: int, v: int, dtype: torch.dtype, device: str):
    """One fused fwd+bwd (``triton`` on CUDA, ``torch_chunked`` on CPU) with ``chunk_size`` rows
    per chunk, on-policy with old log-probs, as ``grpo_fast.testing.fused_linear_workload``."""
    backend = "triton" if device == "cuda" else "torch_chunked"
    return fused_linear_workload(backend, n, d, v, dtype, device, chunk_size=chunk_size)


@pytest.mark.parametrize("chunk_size", CPU_CHUNKS, ids=lambda c: f"chunk{c}")
def test_cpu_chunk_size(run_bench, benchmark, chunk_size):
    n, d, v = 1024, 256, 32768
    benchmark.extra_info["impl"] = "torch_chunked"
    run_bench(
        build_chunk_step, chunk_size, n, d, v, torch.float32, "cpu", device=torch.device("cpu"), rounds=3
    )


@pytest.mark.gpu
@pytest.mark.parametrize("chunk_size", GPU_CHUNKS, ids=lambda c: f"chunk{c}")
def test_gpu_chunk_size(run_bench, benchmark, chunk_size):
    n, d, v = 8192, 1536, 151936
    benchmark.extra_info["impl"] = "triton"
    run_bench(
        build_chunk_step, chunk_size, n, d, v, torch.bfloat16, "cuda",
        device=torch.device("cuda"), rounds=10, flops=3 * 2 * n * d * v,
    )  # fmt: skip


# The frozen_head axis (LoRA, issue 21): the same problem with the lm_head weight trainable (3
# GEMMs a chunk, an fp32 [V, D] gradient accumulator) and frozen (2 GEMMs, no accumulator).
HEADS = {"trainable": False, "frozen": True}


def build_head_step(head: str, n: int, d: int, v: int, dtype: torch.dtype, device: str):
    backend = "triton" if device == "cuda" else "torch_chunked"
    return fused_linear_workload(backend, n, d, v, dtype, device, frozen_head=HEADS[head])


@pytest.mark.parametrize("head", list(HEADS))
def test_cpu_frozen_head(run_bench, benchmark, head):
    n, d, v = 1024, 256, 32768
    benchmark.extra_info["impl"] = "torch_chunked"
    run_bench(build_head_step, head, n, d, v, torch.float32, "cpu", device=torch.device("cpu"), rounds=3)


@pytest.mark.gpu
@pytest.mark.parametrize("head", list(HEADS))
def test_gpu_frozen_head(run_bench, benchmark, head):
    n, d, v = 8192, 1536, 151936
    benchmark.extra_info["impl"] = "triton"
    gemms = 2 if HEADS[head] else 3
    run_bench(
        build_head_step, head, n, d, v, torch.bfloat16, "cuda",
        device=torch.device("cuda"), rounds=10, flops=gemms * 2 * n * d * v,
    )  # fmt: skip
