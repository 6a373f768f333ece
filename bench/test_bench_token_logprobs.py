"""token_logprobs_and_entropy forward + backward: eager, torch.compile(eager), torch_chunked, triton.

The triton backend is timed on CUDA only (the CPU interpreter is ~1000x slower by design).
Traffic floor per step: read the logits twice and write their gradient once, 3·N·V·bytes.
"""

from __future__ import annotations

import pytest
import torch

from grpo_fast.algo.core import eager_token_logprobs_and_entropy
from grpo_fast.ops import token_logprobs_and_entropy

CPU_SHAPES = [pytest.param(512, 32768, id="N512-V32768"), pytest.param(128, 151936, id="N128-V151936")]
GPU_SHAPES = [pytest.param(n, 151936, id=f"N{n}-V151936") for n in (2048, 8192, 16384)]
TEMPERATURE = 0.7


def build_step(impl: str, n: int, v: int, dtype: torch.dtype, device: str):
    """Inputs on ``device`` and the step: fwd + grad of ``Σ g_lp·logp + g_H·H`` w.r.t. the logits."""
    g = torch.Generator(device).manual_seed(0)
    logits = (3 * torch.randn(n, v, generator=g, device=device)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    g_lp, g_h = torch.randn(n, generator=g, device=device), torch.randn(n, generator=g, device=device)
    if impl == "eager":
        fn = eager_token_logprobs_and_entropy
    elif impl == "compiled":
        fn = torch.compile(eager_token_logprobs_and_entropy)
    else:
        fn = lambda z, y, t: token_logprobs_and_entropy(z, y, t, backend=impl)

    def step() -> None:
        lp, h = fn(logits, labels, TEMPERATURE)
        torch.autograd.grad((lp * g_lp + h * g_h).sum(), logits)
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
@pytest.mark.parametrize("impl", ["eager", "compiled", "torch_chunked", "triton"])
def test_gpu(run_bench, impl, n, v):
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
        may_fail=impl in ("eager", "compiled"),
    )
