"""The code sandbox and the pool (``grpo_fast.sandbox``), on CPU.

- ``test_call_overhead``: one call of ``print(1)`` — a bare ``python -c`` subprocess
  (``raw-python``), the sandbox's runner without namespaces (``unsafe``: process group, rlimits,
  emptied environment, a temporary working directory) and with bubblewrap (``bwrap``). The
  ``bwrap`` row's ``extra_info["alternating"]`` holds the three medians measured round by round
  in turn (each call a fresh process either way), the figure to compare them by.
- ``test_throughput``: a batch of 16 calls on a pool of 2 (the machine's 2 cores): trivial code,
  and code that imports numpy; ``calls_per_s`` = 16 / the median batch time.
- ``test_replay_cost``: the (k+1)-th call of a response whose k earlier cells each use sympy,
  replayed before it (state across calls: docs/tools.md).
- ``test_score_batch``: 32 responses graded by ``r1_zero`` through ``score_batch`` on 1 and 2
  workers (each needs the math grader's symbolic step).

Run: ``python -m pytest bench/test_bench_sandbox.py -p no:cacheprovider --benchmark-json
bench/results/sandbox-cpu-$(date -u +%F).json``. The load average is in each row.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time

import pytest

from grpo_fast.sandbox import Limits, Sandbox, bwrap_status
from grpo_fast.task.rewards import r1_zero_reward_fn, score_batch

BWRAP_VERSION, BWRAP_PROBLEM = bwrap_status()
COMMAND = (
    "python -m pytest bench/test_bench_sandbox.py -p no:cacheprovider "
    "--benchmark-json bench/results/sandbox-cpu-$(date -u +%F).json"
)
BATCH, WORKERS = 16, 2
LIMITS = Limits(timeout_s=120.0)  # never reached: a call here takes well under a second idle


def _sandbox(isolation: str, workers: int = 1) -> Sandbox:
    if isolation == "bwrap" and BWRAP_PROBLEM is not None:
        pytest.skip(f"no sandbox here: {BWRAP_PROBLEM}")
    return Sandbox(LIMITS, isolation=isolation, workers=workers)


def _record(benchmark, **info) -> None:
    benchmark.extra_info.update(
        load_average_1m=os.getloadavg()[0],
        cpus=len(os.sched_getaffinity(0)),
        versions={"python": sys.version.split()[0], "bubblewrap": BWRAP_VERSION},
        command=COMMAND,
        **info,
    )


def _raw_python() -> None:
    subprocess.run([sys.executable, "-s", "-c", "print(1)"], capture_output=True, check=True)


def _variant(impl: str):
    if impl == "raw-python":
        return _raw_python
    box = _sandbox(impl)
    return lambda: _check(box.run("print(1)"))


def _check(result) -> None:
    assert result.ok and result.output == "1\n", result.status_line()


def _alternating(rounds: int = 15) -> dict[str, float]:
    """Median seconds of each variant, measured round by round in turn."""
    variants = {impl: _variant(impl) for impl in ("raw-python", "unsafe", "bwrap")}
    times: dict[str, list[float]] = {impl: [] for impl in variants}
    for fn in variants.values():
        fn()  # warm the page cache
    for _ in range(rounds):
        for impl, fn in variants.items():
            start = time.perf_counter()
            fn()
            times[impl].append(time.perf_counter() - start)
    return {impl: statistics.median(t) for impl, t in times.items()}


@pytest.mark.parametrize("impl", ["raw-python", "unsafe", "bwrap"])
def test_call_overhead(benchmark, impl):
    step = _variant(impl)
    step()
    benchmark.pedantic(step, rounds=15, warmup_rounds=1, iterations=1)
    info = {"impl": impl, "case": "one call of print(1)"}
    if impl == "bwrap":
        info["alternating"] = _alternating()
    _record(benchmark, **info)


CODE = {"trivial": "print(1)", "numpy": "import numpy as np\nprint(int(np.arange(10).sum()))"}


@pytest.mark.parametrize("code", list(CODE))
def test_throughput(benchmark, code):
    box = _sandbox("bwrap", workers=WORKERS)
    calls = [CODE[code]] * BATCH
    expected = box.run(CODE[code]).output

    def batch():
        results = box.run_batch(calls)
        assert all(r.ok and r.output == expected for r in results)

    benchmark.pedantic(batch, rounds=3, warmup_rounds=1, iterations=1)
    _record(
        benchmark,
        impl="bwrap",
        case=f"{BATCH} calls of the same code (trivial: print(1); numpy: import it, sum), a pool of {WORKERS}",
        calls_per_s=BATCH / benchmark.stats.stats.median,
    )


CELL = "import sympy\nx = sympy.Symbol('x')\nf = sympy.factor(x**4 - 1)"


@pytest.mark.parametrize("earlier_cells", [0, 1, 3, 7])
def test_replay_cost(benchmark, earlier_cells):
    box = _sandbox("bwrap")
    if earlier_cells == 0:  # the first call: the cell itself, nothing replayed
        code, history = CELL + "\nprint(f)", []
    else:
        code, history = "print(f)", [CELL] * earlier_cells

    def step():
        _check_factor(box.run(code, history=history))

    step()
    benchmark.pedantic(step, rounds=5, warmup_rounds=1, iterations=1)
    _record(
        benchmark,
        impl="bwrap",
        case="a call that prints f after earlier_cells replayed sympy cells (0: the cell itself)",
    )


def _check_factor(result) -> None:
    assert result.ok and result.output == "(x - 1)*(x + 1)*(x**2 + 1)\n", result.status_line()


# 32 formatted responses whose answers need the symbolic step (string and number matches fail)
RESPONSES = [f"r </think> <answer> \\boxed{{(x+{k})^2}} </answer>" for k in range(32)]
TRUTHS = [f"x^2+{2 * k}x+{k * k}" for k in range(32)]


@pytest.mark.parametrize("workers", [1, 2])
def test_score_batch(benchmark, workers):
    def step():
        scores = score_batch(r1_zero_reward_fn, RESPONSES, TRUTHS, workers=workers)
        assert [s["reward"] for s in scores] == [1.0] * 32

    step()  # starts the grader's workers
    benchmark.pedantic(step, rounds=3, warmup_rounds=1, iterations=1)
    _record(
        benchmark,
        impl=f"{workers} worker(s)",
        case="32 r1_zero responses, each graded symbolically",
        responses_per_s=32 / benchmark.stats.stats.median,
    )
