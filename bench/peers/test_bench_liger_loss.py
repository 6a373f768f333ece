"""The fused lm_head + GRPO loss, forward + backward from hidden states: grpo_fast's
``fused_linear_grpo_loss`` against Liger-Kernel's ``LigerFusedLinearGRPOLoss`` and torch's own
``F.linear_cross_entropy`` (cross-entropy only: the floor of the lm_head + log-softmax work).

    python -m pytest bench/peers/test_bench_liger_loss.py --benchmark-json OUT.json
    python -m pytest -m gpu bench/peers/test_bench_liger_loss.py       # CUDA (skipped without one)

The implementations alternate round by round in one test (``ROUNDS`` each, after one warm-up
call each, which also runs Liger's ``torch.compile`` of its loss math); peak memory is measured
per implementation in a fresh process on CPU (``grpo_fast.obs.memory.peak_rss_growth``) and with
``max_memory_allocated`` on CUDA. On CPU, grpo_fast runs its ``torch_chunked`` backend and Liger
its chunked torch path (``liger_kernel.chunked_loss`` is plain torch + ``torch.compile``, no Triton);
on CUDA, grpo_fast runs its Triton kernels. Whether each computes the entropy is recorded: ours
does, Liger's GRPO loss does not.
"""

from __future__ import annotations

import os
import shlex
import time

import pytest
import torch

from bench.peers.workloads import LOSS_ENTROPY, LOSS_WHAT, VERSIONS, build_loss_step, dist_version, median
from bench.test_bench_train_step import COMMAND_ENV, device_name
from grpo_fast.obs.memory import peak_cuda_memory, peak_rss_growth

PEERS_MISSING = (
    "needs the peers extra: pip install -e '.[dev,peers]' in its own environment (liger-kernel, trl)"
)
IMPLS = ("grpo_fast", "grpo_fast_chunk256", "liger", "torch_linear_cross_entropy")
PACKAGE = {
    "grpo_fast": "grpo_fast",
    "grpo_fast_chunk256": "grpo_fast",
    "liger": "liger-kernel",
    "torch_linear_cross_entropy": "torch",
}
ROUNDS = 3
GPU_ROUNDS = 10


def run_loss_duel(benchmark, request, n: int, d: int, v: int, dtype: str, device: str, rounds: int) -> None:
    steps = {impl: build_loss_step(impl, n, d, v, dtype, device) for impl in IMPLS}
    for step in steps.values():
        step()  # warm-up: Liger's torch.compile, thread pools, allocator
    times: dict[str, list[float]] = {impl: [] for impl in IMPLS}
    counter = iter(range(rounds))
    loads = [os.getloadavg()[0]]

    def one_round() -> None:
        i = next(counter)
        order = IMPLS[i % len(IMPLS) :] + IMPLS[: i % len(IMPLS)]  # each goes first in turn
        for impl in order:
            t0 = time.perf_counter()
            steps[impl]()  # synchronizes on CUDA before returning
            times[impl].append(time.perf_counter() - t0)

    benchmark.pedantic(one_round, rounds=rounds, iterations=1)
    loads.append(os.getloadavg()[0])
    if device == "cuda":
        peaks = {impl: peak_cuda_memory(step) for impl, step in steps.items()}
    else:
        del steps  # free the inputs before the children allocate their own
        peaks = {impl: peak_rss_growth(build_loss_step, impl, n, d, v, dtype, device) for impl in IMPLS}
    loads.append(os.getloadavg()[0])
    bytes_per = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    args = shlex.join(request.config.invocation_params.args)
    env = " ".join(f"{k}={os.environ[k]}" for k in COMMAND_ENV if k in os.environ)
    benchmark.extra_info.update(
        impl="+".join(IMPLS),
        device=device_name(torch.device(device)),
        load_average_1m=max(loads),
        load_average_1m_all=loads,
        cpu_count=os.cpu_count(),
        versions={m: dist_version(m) for m in VERSIONS} | {"cuda": torch.version.cuda},
        command=f"{env} python -m pytest {args}".strip(),
        torch_threads=torch.get_num_threads(),
        peer_comparison={
            "kind": "loss_op",
            "case": f"N={n:,}, D={d}, V={v:,}, {dtype}, 16 sequences, forward + backward",
            "memory": "max_memory_allocated of one call" if device == "cuda" else "RSS growth of one call",
            "logits_bytes": n * v * bytes_per,
            "rounds": rounds,
            "impls": [
                {
                    "impl": impl,
                    "ours": impl == "grpo_fast",  # the default: what the loop runs
                    "version": dist_version(PACKAGE[impl]),
                    "what": LOSS_WHAT[impl],
                    "entropy": LOSS_ENTROPY[impl],
                    "time_s": median(times[impl]),
                    "time_s_all": [round(t, 5) for t in times[impl]],
                    "peak_memory_bytes": peaks[impl],
                }
                for impl in IMPLS
            ],
        },
    )


@pytest.mark.benchmark(group="peers-loss-cpu")
def test_loss_vs_liger_cpu(benchmark, request):
    pytest.importorskip("liger_kernel", reason=PEERS_MISSING)
    run_loss_duel(benchmark, request, 4096, 256, 32768, "float32", "cpu", ROUNDS)


@pytest.mark.gpu
@pytest.mark.benchmark(group="peers-loss-gpu")
@pytest.mark.parametrize("n", [2048, 8192, 16384])
def test_loss_vs_liger_gpu(benchmark, request, n):
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    pytest.importorskip("liger_kernel", reason=PEERS_MISSING)
    run_loss_duel(benchmark, request, n, 1536, 151936, "bfloat16", "cuda", GPU_ROUNDS)
