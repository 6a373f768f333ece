"""Measured peak memory of a step: host RSS in a fresh process, or CUDA allocator peaks in-process.

``peak_rss_growth(build, *args)`` runs ``build(*args)`` in a new spawned Python process; ``build``
sets up its inputs and returns a thunk (the step). The child calls the thunk once to warm up, frees
what it can (``gc.collect``, glibc ``malloc_trim``), resets the kernel's resident-set high-water
mark (``/proc/self/clear_refs``, Linux ≥ 4.0), runs the thunk again and reports
``VmHWM − VmRSS_before``: the bytes of memory the step touched on top of its inputs. A fresh
process keeps one measurement's allocator state out of the next.

``peak_cuda_memory(thunk)`` is the CUDA counterpart: ``max_memory_allocated`` over the call minus
the memory allocated before it (the caching allocator's view, without fragmentation).

``allocation_timeline(thunk)`` lists the tensor storages the call creates and destroys (CPU or
CUDA), in order, from ``torch.profiler``'s memory timeline: what a test needs to count buffers of
a given size or to take the peak of the bytes a step allocates (``tracked_peak_bytes``), exactly
and in-process, on the CPU too.
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import multiprocessing
import traceback
from collections.abc import Callable

import torch

__all__ = [
    "allocation_timeline",
    "copy_bandwidth_gbps",
    "peak_cuda_memory",
    "peak_rss_growth",
    "process_peak_bytes",
    "reset_process_peak",
    "tracked_peak_bytes",
]


def process_peak_bytes() -> int:
    """This process's peak resident memory since the last ``reset_process_peak`` (VmHWM)."""
    return _status_bytes("VmHWM")


def reset_process_peak() -> None:
    """Reset the peak-RSS mark to the current RSS (Linux ≥ 4.0; a no-op where unsupported)."""
    with contextlib.suppress(OSError), open("/proc/self/clear_refs", "w") as f:
        f.write("5")


def _status_bytes(field: str) -> int:
    """A ``kB`` field of ``/proc/self/status`` (``VmRSS``, ``VmHWM``) in bytes."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1]) * 1024
    raise RuntimeError(f"/proc/self/status has no {field} field")


def _release_free_memory() -> None:
    gc.collect()
    with contextlib.suppress(OSError, AttributeError):  # glibc only
        ctypes.CDLL("libc.so.6").malloc_trim(0)  # give freed heap pages back to the OS


def _child(conn, build: Callable[..., Callable[[], object]], args: tuple, kwargs: dict) -> None:
    try:
        step = build(*args, **kwargs)
        step()  # warm-up: one-time allocations (thread pools, library workspaces) stay out
        _release_free_memory()
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")  # reset VmHWM to the current VmRSS
        before = _status_bytes("VmRSS")
        step()
        conn.send(("ok", _status_bytes("VmHWM") - before))
    except BaseException:
        conn.send(("error", traceback.format_exc()))
    finally:
        conn.close()


def peak_rss_growth(
    build: Callable[..., Callable[[], object]], *args, timeout_s: float = 600.0, **kwargs
) -> int:
    """Peak resident-memory growth in bytes of ``build(*args, **kwargs)()`` in a fresh process (Linux).

    ``build`` must be picklable (a module-level function); it runs in the child, builds the
    inputs (not counted) and returns the step to measure. The step runs twice (warm-up, then the
    measured call), so it must leave its inputs as it found them.

    Example:
        >>> peak_rss_growth(fused_linear_workload, "torch_chunked", 4096, 256, 32768)  # doctest: +SKIP
    """
    ctx = multiprocessing.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    proc = ctx.Process(target=_child, args=(child, build, args, kwargs))
    proc.start()
    child.close()
    if not parent.poll(timeout_s):
        proc.kill()
        proc.join()
        raise TimeoutError(f"peak_rss_growth: {getattr(build, '__name__', build)} took over {timeout_s} s")
    status, value = parent.recv()
    proc.join()
    if status != "ok":
        raise RuntimeError(f"peak_rss_growth: the measured step failed in the child process:\n{value}")
    return value


def peak_cuda_memory(step: Callable[[], object], device: torch.device | int | None = None) -> int:
    """Peak CUDA memory in bytes allocated by ``step()`` on top of what was allocated before it.

    Synchronizes the device before and after (two host-device sync points, outside the step).
    """
    torch.cuda.synchronize(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    step()
    torch.cuda.synchronize(device)
    return torch.cuda.max_memory_allocated(device) - before


def copy_bandwidth_gbps(device: torch.device | str = "cuda") -> float:
    """Device memory bandwidth: bytes read + written by ``dst.copy_(src)`` on 1 GiB, over the time
    of 20 copies after 3 warm-up copies (the reference the kernels' GB/s are compared with)."""
    src = torch.empty(2**28, dtype=torch.float32, device=device)  # 1 GiB
    dst = torch.empty_like(src)
    for _ in range(3):
        dst.copy_(src)
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(20):
        dst.copy_(src)
    end.record()
    torch.cuda.synchronize()  # host-device sync: read the timer
    return 2 * src.numel() * src.element_size() * 20 / (start.elapsed_time(end) / 1e3) / 1e9


def allocation_timeline(step: Callable[[], object]) -> list[tuple[str, object, int]]:
    """``[(event, storage key, bytes)]``, ``event`` ``"create"`` or ``"destroy"``, for the tensor
    storages ``step()`` allocates and frees, in order.

    Reads the allocator's events from the profiler's event tree (``Allocation`` nodes: a
    positive size on create, a negative one on destroy, one allocation id for both; torch 2.13's
    ``torch._C._profiler``, a private API). Not ``profile._memory_profile()``: its data-flow graph
    asserts on tensors that a collective writes from another thread (FSDP under gloo).
    Nothing is hooked into the tensors, so reference counts (which decide, e.g., whether autograd
    adds a gradient in place) are the step's own.
    """
    from torch._C._profiler import _EventType
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if torch.cuda.is_available() else [])
    with profile(activities=activities, profile_memory=True, record_shapes=True) as prof:
        step()
    allocations = []
    stack = list(prof.profiler.kineto_results.experimental_event_tree())
    while stack:
        node = stack.pop()
        stack.extend(node.children)
        if node.tag == _EventType.Allocation:
            f = node.extra_fields
            allocations.append((node.start_time_ns, str(f.device), f.allocation_id, f.alloc_size))
    # by time; at one instant creates first, so a storage made and freed within one profiler tick
    # is never freed before it exists (which would leave it counted as alive)
    allocations.sort(key=lambda a: (a[0], a[3] < 0))
    return [("create" if size > 0 else "destroy", (dev, aid), abs(size)) for _, dev, aid, size in allocations]


def tracked_peak_bytes(step: Callable[[], object]) -> int:
    """The most bytes of storages created by ``step()`` alive at one time (what it allocates on
    top of what existed before it), from ``allocation_timeline``."""
    live: dict[object, int] = {}
    peak = 0
    for event, key, size in allocation_timeline(step):
        if event == "create":
            live[key] = size
        else:
            live.pop(key, None)
        peak = max(peak, sum(live.values()))
    return peak
