"""The fused lm_head + GRPO loss, forward + backward from hidden states: grpo_fast's
``fused_linear_grpo_loss`` against Liger-Kernel's ``LigerFusedLinearGRPOLoss`` and torch's own
``F.linear_cross_entropy`` (cross-entropy only: the floor of the lm_head + log-softmax work), beside
``grpo_fast_gemm_floor``: grpo_fast's three GEMMs alone on its chunks, the time it cannot go below.

    python -m pytest bench/peers/test_bench_liger_loss.py --benchmark-json OUT.json
    python -m pytest -m gpu bench/peers/test_bench_liger_loss.py       # CUDA (skipped without one)

On CPU every timed call runs in a fresh process (``fresh_process_call``): build the inputs, one
warm-up call (which also runs Liger's ``torch.compile`` of its loss math), then the timed call,
whose peak RSS growth is measured too (``grpo_fast.obs.memory``: VmHWM reset after the warm-up).
Rounds alternate the implementations, each going first in turn; the figures are medians over
``ROUNDS`` rounds, of the wall time and of the process's CPU time (``cpu_time_s``: on a shared
machine, the wall time less the waits for a core), each also over the GEMM floor's. No
implementation's allocator state, thread pools or compiled code is left in another's process. On
CUDA the implementations alternate in one process (``GPU_ROUNDS`` rounds,
after one warm-up call each) and peak memory is ``max_memory_allocated`` of one call.

On CPU, grpo_fast runs its ``torch_chunked`` backend and Liger its chunked torch path
(``liger_kernel.chunked_loss`` is plain torch + ``torch.compile``, no Triton); on CUDA, grpo_fast
runs its Triton kernels. Whether each computes the entropy is recorded: ours does, Liger's GRPO
loss does not.
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import shlex
import time
from concurrent.futures import ProcessPoolExecutor

import pytest
import torch

from bench.peers.workloads import LOSS_ENTROPY, LOSS_WHAT, VERSIONS, build_loss_step, dist_version, median
from bench.test_bench_fused_linear_grpo_loss import build_gemm_floor_step
from bench.workloads_train_step import COMMAND_ENV, device_name
from grpo_fast.obs.memory import peak_cuda_memory, process_peak_bytes, reset_process_peak

PEERS_MISSING = (
    "needs the peers extra: pip install -e '.[dev,peers]' in its own environment (liger-kernel, trl)"
)
FLOOR = "grpo_fast_gemm_floor"
IMPLS = ("grpo_fast", "grpo_fast_chunk256", "liger", "torch_linear_cross_entropy", FLOOR)
PACKAGE = {
    "grpo_fast": "grpo_fast",
    "grpo_fast_chunk256": "grpo_fast",
    "liger": "liger-kernel",
    "torch_linear_cross_entropy": "torch",
    FLOOR: "grpo_fast",
}
WHAT = {
    **LOSS_WHAT,
    FLOOR: "grpo_fast's three GEMMs alone on its default chunks (logits, grad_hidden, grad_weight): its floor",
}
ENTROPY = {**LOSS_ENTROPY, FLOOR: False}
ROUNDS = 3
GPU_ROUNDS = 10
CALL_TIMEOUT_S = 1800


def build_step(impl: str, n: int, d: int, v: int, dtype: str, device: str):
    """The step of ``impl``: ``bench.peers.workloads.build_loss_step``, or the GEMM floor."""
    if impl == FLOOR:
        return build_gemm_floor_step(n, d, v, getattr(torch, dtype), device)
    return build_loss_step(impl, n, d, v, dtype, device)


def timed_call(impl: str, n: int, d: int, v: int, dtype: str, device: str) -> tuple[float, int, float, float]:
    """``(seconds, peak RSS growth in bytes, 1-minute load, CPU seconds)`` of one call of ``impl``'s
    step after a warm-up call, in this process. What ``fresh_process_call`` runs in its child. The
    CPU time (this process's, all threads) is the figure that other work on a shared machine
    disturbs least: with one thread it is the wall time less the time spent waiting for a core."""
    import ctypes
    import gc

    step = build_step(impl, n, d, v, dtype, device)
    step()  # warm-up: torch.compile, thread pools, first-touch of the inputs
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give the warm-up's freed heap pages back
    reset_process_peak()
    before = process_peak_bytes()  # = VmRSS right after the reset
    c0, t0 = time.process_time(), time.perf_counter()
    step()
    seconds, cpu_seconds = time.perf_counter() - t0, time.process_time() - c0
    return seconds, process_peak_bytes() - before, os.getloadavg()[0], cpu_seconds


def fresh_process_call(
    impl: str, n: int, d: int, v: int, dtype: str, device: str
) -> tuple[float, int, float, float]:
    """``timed_call`` in a newly spawned process (the parent's environment, ``OMP_NUM_THREADS``
    included)."""
    with ProcessPoolExecutor(max_workers=1, mp_context=multiprocessing.get_context("spawn")) as pool:
        return pool.submit(timed_call, impl, n, d, v, dtype, device).result(timeout=CALL_TIMEOUT_S)


def _cpu_rounds(n, d, v, dtype, rounds):
    """Per implementation: ``timed_call``'s figures for ``rounds`` fresh-process calls, alternating."""
    runs: dict[str, list[tuple[float, int, float, float]]] = {impl: [] for impl in IMPLS}
    for i in range(rounds):
        order = IMPLS[i % len(IMPLS) :] + IMPLS[: i % len(IMPLS)]  # each goes first in turn
        for impl in order:
            runs[impl].append(fresh_process_call(impl, n, d, v, dtype, "cpu"))
    return runs


def _cuda_rounds(n, d, v, dtype, rounds):
    """The same on CUDA, alternating in this process; the peak is one call's ``max_memory_allocated``."""
    steps = {impl: build_step(impl, n, d, v, dtype, "cuda") for impl in IMPLS}
    for step in steps.values():
        step()  # warm-up: Liger's torch.compile, Triton's kernels, the caching allocator
    runs: dict[str, list[tuple[float, int, float, float]]] = {impl: [] for impl in IMPLS}
    for i in range(rounds):
        order = IMPLS[i % len(IMPLS) :] + IMPLS[: i % len(IMPLS)]
        for impl in order:
            c0, t0 = time.process_time(), time.perf_counter()
            steps[impl]()  # synchronizes before returning
            runs[impl].append((time.perf_counter() - t0, 0, os.getloadavg()[0], time.process_time() - c0))
    peaks = {impl: peak_cuda_memory(step) for impl, step in steps.items()}
    return {impl: [(t, peaks[impl], load, c) for t, _, load, c in runs[impl]] for impl in IMPLS}


def run_loss_duel(benchmark, request, n: int, d: int, v: int, dtype: str, device: str, rounds: int) -> None:
    measure = _cuda_rounds if device == "cuda" else _cpu_rounds
    runs: dict = {}

    def all_rounds() -> None:
        runs.update(measure(n, d, v, dtype, rounds))

    # one pedantic round holds every call (on CPU each in its own process): its time is the
    # session's wall time, the figures are in extra_info["peer_comparison"]
    benchmark.pedantic(all_rounds, rounds=1, iterations=1)
    loads = [run[2] for impl in IMPLS for run in runs[impl]]
    times = {impl: [run[0] for run in runs[impl]] for impl in IMPLS}
    cpu_times = {impl: [run[3] for run in runs[impl]] for impl in IMPLS}
    floor, cpu_floor = median(times[FLOOR]), median(cpu_times[FLOOR])
    bytes_per = torch.tensor([], dtype=getattr(torch, dtype)).element_size()
    args = shlex.join(request.config.invocation_params.args)
    env = " ".join(f"{k}={os.environ[k]}" for k in COMMAND_ENV if k in os.environ)
    benchmark.extra_info.update(
        impl="+".join(IMPLS),
        device=device_name(torch.device(device)),
        load_average_1m=max(loads),
        load_average_1m_all=[round(x, 2) for x in loads],
        cpu_count=os.cpu_count(),
        versions={m: dist_version(m) for m in VERSIONS} | {"cuda": torch.version.cuda},
        command=f"{env} python -m pytest {args}".strip(),
        torch_threads=torch.get_num_threads(),
        peer_comparison={
            "kind": "loss_op",
            "case": f"N={n:,}, D={d}, V={v:,}, {dtype}, 16 sequences, forward + backward",
            "memory": (
                "max_memory_allocated of one call, all in one process"
                if device == "cuda"
                else "RSS growth of the timed call; every call in a fresh process, after one warm-up call"
            ),
            "logits_bytes": n * v * bytes_per,
            "rounds": rounds,
            "impls": [
                {
                    "impl": impl,
                    "ours": impl == "grpo_fast",  # the default: what the loop runs
                    "version": dist_version(PACKAGE[impl]),
                    "what": WHAT[impl],
                    "entropy": ENTROPY[impl],
                    "time_s": median(times[impl]),
                    "time_s_all": [round(t, 5) for t in times[impl]],
                    "time_over_gemm_floor": median(times[impl]) / floor,
                    "cpu_time_s": median(cpu_times[impl]),
                    "cpu_time_s_all": [round(t, 5) for t in cpu_times[impl]],
                    "cpu_time_over_gemm_floor": median(cpu_times[impl]) / cpu_floor,
                    # the floor's buffers are made before its timed call: no peak of its own
                    "peak_memory_bytes": None if impl == FLOOR else int(median([r[1] for r in runs[impl]])),
                    "peak_memory_bytes_all": [run[1] for run in runs[impl]],
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
