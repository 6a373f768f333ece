"""Benchmark harness for ``bench/test_bench_*.py`` (pytest-benchmark).

Run: ``python -m pytest bench/ --benchmark-json=bench.json`` (add ``-m "not slow"`` for the quick
CPU set). Each case records in ``extra_info``: ``peak_memory_bytes`` (CUDA: ``max_memory_allocated``
over one step; CPU: peak RSS growth of one step in a fresh process, ``grpo_fast.obs.memory``) and, on
CUDA, ``gb_per_s`` over the op's traffic floor and ``copy_fraction``, that figure over a plain
device copy measured in the same session (or ``tflops`` for the matmul-bound fused-linear op).
"""

from __future__ import annotations

import contextlib
import os
import platform
import sys
from collections.abc import Callable
from pathlib import Path

import pytest
import torch

# the repository root, for the benchmarks' `bench.` imports under a plain `pytest` (`python -m
# pytest` puts the working directory there already)
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from grpo_fast.obs.memory import copy_bandwidth_gbps, peak_cuda_memory, peak_rss_growth
from grpo_fast.testing import skip_unrunnable_items


def pytest_collection_modifyitems(config, items):
    skip_unrunnable_items(items)


@pytest.fixture(scope="session")
def copy_bandwidth() -> float | None:
    """GB/s of a 1 GiB device copy (``grpo_fast.obs.memory.copy_bandwidth_gbps``), or None without CUDA."""
    return copy_bandwidth_gbps() if torch.cuda.is_available() else None


@pytest.fixture
def run_bench(benchmark, copy_bandwidth):
    """``run(build, *args, device, rounds=5, traffic_bytes=None, flops=None, may_fail=False)``.

    ``build(*args)`` returns the step (it must synchronize on CUDA before returning); it must be a
    picklable module-level function, since on CPU it is rebuilt in a fresh process to measure
    memory. The first call doubles as warm-up (and compilation); with ``may_fail`` an exception
    there skips the case (``torch.compile`` on an unsupported machine, an eager OOM at large N).
    """

    def run(
        build: Callable[..., Callable[[], object]],
        *args,
        device: torch.device,
        rounds: int = 5,
        traffic_bytes: int | None = None,
        flops: int | None = None,
        may_fail: bool = False,
    ) -> None:
        step = build(*args)
        try:
            step()
        except Exception as exc:  # an impl that cannot run here is a skip, with the reason
            if not may_fail:
                raise
            pytest.skip(f"{getattr(build, '__name__', build)}{args}: {type(exc).__name__}: {str(exc)[:200]}")
        benchmark.pedantic(step, rounds=rounds, warmup_rounds=1, iterations=1)
        info = benchmark.extra_info
        # other work on the machine shows here: a 2-core CPU at load 4 is 2x oversubscribed, and
        # torch_chunked's many small ops then wait on OpenMP barriers (seconds instead of ms)
        info["load_average_1m"] = os.getloadavg()[0]
        info["device"] = torch.cuda.get_device_name(device) if device.type == "cuda" else _cpu_name()
        if device.type == "cuda":
            info["peak_memory_bytes"] = peak_cuda_memory(step)
            seconds = benchmark.stats.stats.mean
            if traffic_bytes is not None:
                info["gb_per_s"] = traffic_bytes / seconds / 1e9
                info["copy_gb_per_s"] = copy_bandwidth
                info["copy_fraction"] = info["gb_per_s"] / copy_bandwidth
            if flops is not None:
                info["tflops"] = flops / seconds / 1e12
        else:
            del step  # free the inputs before the child process allocates its own
            info["peak_memory_bytes"] = peak_rss_growth(build, *args)

    return run


def _cpu_name() -> str:
    """The CPU model (``platform.processor()`` is empty on Linux), with the core count."""
    name = platform.processor() or platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as f:
        name = next((ln.split(":", 1)[1].strip() for ln in f if ln.startswith("model name")), name)
    return f"{name} ({os.cpu_count()} cores)"
