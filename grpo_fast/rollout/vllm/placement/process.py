"""``rollout.placement=process``: the vLLM engine in a process of its own on this machine.

``ProcessEngine`` holds a ``vllm.v1.engine.async_llm.AsyncLLM``: the engine core (scheduler,
model, KV cache) runs in a child process that vLLM spawns, so generation and training do not
share an interpreter (on a CPU they overlap on separate cores; on GPUs the engine can have its
own devices, ``rollout.engine_devices``). ``AsyncLLM`` is asyncio-native: it lives on an event
loop in a daemon thread of ours, and every call from the trainer's or the producer's thread is a
coroutine submitted there and waited for under a deadline.

Weights cannot be pushed into another process's model: they go through vLLM's native
weight-transfer API (``grpo_fast.rollout.vllm.transfer.transport``: pause "keep", start, chunks,
finish with the step as ``weight_version``, resume), the engine started with the transport's
backend and ``grpo_fast.rollout.vllm.transfer._worker.WorkerExtension`` (which registers the
shared-memory one).
A LoRA adapter is synced as an adapter (``rollout.lora_sync=adapter``): ``add_lora`` of the
saved folder; requests in flight keep the adapter they started with, which is unloaded once the
last of them finishes.

Every output records the weight version that sampled it (vLLM's ``weight_versions`` spans); the
engine returns the oldest one per response. A dead engine process raises ``EngineDied`` (vLLM's
``EngineDeadError``, within a second or so of the death); a call that outlives its deadline
raises ``EngineTimeout``.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import multiprocessing
import os
import threading
import time
import uuid
import weakref
from collections.abc import Callable, Coroutine
from typing import Any

from grpo_fast.dist import environ_set
from grpo_fast.errors import EngineDied, EngineError
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm.deadline import Deadline, Timeouts
from grpo_fast.rollout.vllm.placement.shared import (
    AdapterSlots,
    lora_rank_slot,
    request_params,
    sampled_versions,
    sampling_fields,
    versions_fields,
    visible_devices,
)
from grpo_fast.rollout.vllm.transfer.transport import (
    SHM_BACKEND,
    WORKER_EXTENSION,
    SyncedApart,
    make_transport,
)

log = logging.getLogger("grpo_fast")


class EventLoopThread:
    """An asyncio loop in a daemon thread; ``run(coro, deadline, doing)`` waits for ``coro``
    there from any other thread, cancels it when ``deadline`` passes (``EngineTimeout``)."""

    def __init__(self, name: str = "grpo_fast-vllm-loop"):
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name=name, daemon=True)
        self.thread.start()

    def run(
        self, coro: Coroutine, deadline: Deadline, doing: str, dead: Callable[[], str | None] = lambda: None
    ) -> Any:
        """``coro``'s result; ``EngineTimeout`` past ``deadline``; ``EngineDied`` as soon as
        ``dead()`` (checked every second) names a death: a call vLLM never answers once its
        engine core is gone (a utility call such as ``reset_prefix_cache``) fails then, not at
        the deadline. Either way the coroutine is cancelled (AsyncLLM aborts its requests)."""
        import concurrent.futures

        future = asyncio.run_coroutine_threadsafe(coro, self.loop)
        while True:
            try:
                return future.result(timeout=min(1.0, deadline.left(doing)))
            except concurrent.futures.TimeoutError:
                why = dead()
                if why is None and deadline.end > time.monotonic():
                    continue
                future.cancel()
                if why is not None:
                    raise EngineDied(f"{why} (found while waiting for {doing})") from None
                raise deadline.expired(doing) from None
            except EngineError:
                future.cancel()
                raise

    def cancel_tasks(self) -> None:
        """Cancel what still runs on the loop (AsyncLLM's output handler, requests in flight)."""
        import concurrent.futures

        async def cancel_all():
            tasks = [t for t in asyncio.all_tasks() if t is not asyncio.current_task()]
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

        if self.loop.is_running():
            with contextlib.suppress(concurrent.futures.TimeoutError, RuntimeError):
                asyncio.run_coroutine_threadsafe(cancel_all(), self.loop).result(timeout=5)

    def stop(self) -> None:
        self.cancel_tasks()
        if self.loop.is_running():
            self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(timeout=5)


# One engine starts at a time in this process. What its engine core reads as it spawns
# (CUDA_VISIBLE_DEVICES, VLLM_CPU_OMP_THREADS_BIND, ...) is this process's environment, which a second
# engine starting beside it (a fleet's, each in its own thread) would overwrite before the first
# core spawned, or read half-written (CUDA_VISIBLE_DEVICES is numbered from the process's own): a
# test saw engine 0 of [[1], [2, 3]] spawn on GPU 3. A failed start kills the children it made,
# which it can tell from another engine's only while no other starts.
_START_LOCK = threading.Lock()


class ProcessEngine(SyncedApart):
    """An ``AsyncLLM`` (engine core in a child process) behind the ``Engine`` boundary of
    ``grpo_fast.rollout.vllm.placement``; thread-safe: ``generate`` and ``load_weights`` may run
    at once.

    Started with the model folder ``model_path``; ``extra_args``: more ``AsyncEngineArgs``
    (``rollout.vllm_kwargs``); ``lora_rank`` > 0 serves LoRA adapters (two at a time: the one in
    use and the next). Its start waits at most ``timeouts.start`` s (vLLM's own engine-ready
    timeout is set to the same), each ``generate`` ``timeouts.request`` s, each sync
    ``timeouts.sync`` s. ``devices``: the GPUs its core sees; ``cpus``: on a CPU, the cores its
    OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``; a fleet's ``fleet_cpus``), None:
    vLLM's choice. Engines of one process start one at a time (``_START_LOCK``).
    """

    supports_sleep = False  # its memory is its own: nothing to free for the training phase
    concurrent_updates = True

    def __init__(
        self,
        model_path: str,
        *,
        max_model_len: int,
        seed: int,
        timeouts: Timeouts,
        dtype: str = "bfloat16",
        gpu_memory_utilization: float = 0.9,
        extra_args: dict[str, Any] | None = None,
        lora_rank: int = 0,
        weight_transfer: str = "shm",
        devices: list[int] | None = None,
        cpus: str | None = None,
    ):
        self.timeouts = timeouts
        self.cpus = cpus
        self.version: int | None = None
        self.adapters = AdapterSlots()
        self.loop = EventLoopThread()
        self.llm = None
        lora = (
            {"enable_lora": True, "max_lora_rank": lora_rank_slot(lora_rank), "max_loras": 2}
            if lora_rank
            else {}
        )
        args = dict(
            model=model_path,
            dtype=dtype,
            max_model_len=max_model_len,
            seed=seed,
            gpu_memory_utilization=gpu_memory_utilization,
            enable_prefix_caching=True,
            logprobs_mode="processed_logprobs",  # log-probs after temperature, as the trainer computes
            weight_transfer_config={"backend": "nccl" if weight_transfer == "nccl" else SHM_BACKEND},
            worker_extension_cls=WORKER_EXTENSION,
            tensor_parallel_size=max(1, len(devices or [])),
            **lora,
            **(extra_args or {}),  # rollout.vllm_kwargs
        )
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            args.setdefault("enable_chunked_prefill", False)  # CPU_PREFILL_WORKAROUND (placement/shared.py)
        deadline = Deadline(timeouts.start, "the vLLM engine process's start", "rollout.start_timeout")
        self._start(args, devices, deadline)
        self._finalizer = weakref.finalize(self, _shutdown, self.llm, self.loop)
        try:
            self.transport = make_transport(
                weight_transfer, self, dtype, args["tensor_parallel_size"], deadline, "127.0.0.1"
            )
        except BaseException:
            self.close()
            raise

    def _start(self, args: dict[str, Any], devices: list[int] | None, deadline: Deadline) -> None:
        # the environment it reads and writes, and the children it would kill, are the process's
        with _START_LOCK:
            self._start_alone(args, devices, deadline)

    def _start_alone(self, args: dict[str, Any], devices: list[int] | None, deadline: Deadline) -> None:
        env = {"VLLM_ENGINE_READY_TIMEOUT_S": str(int(self.timeouts.start) + 1)}
        from vllm.platforms import current_platform

        if current_platform.is_cpu():
            env.setdefault("VLLM_CPU_KVCACHE_SPACE", os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"))
        if devices:  # the child sees these GPUs only
            env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices)
        if self.cpus is not None:
            env["VLLM_CPU_OMP_THREADS_BIND"] = self.cpus
        before = set(multiprocessing.active_children())
        try:
            with environ_set(env):  # read by vLLM as it spawns the engine core
                self.llm = self.loop.run(self._make(args), deadline, "the engine core to report ready")
        except BaseException as e:
            for child in set(multiprocessing.active_children()) - before:  # a half-started engine core
                child.kill()
            self.loop.stop()
            if isinstance(e, EngineError):
                raise
            raise EngineDied(f"the vLLM engine process failed to start: {_one_line(e)}") from e

    @staticmethod
    async def _make(args: dict[str, Any]):
        """The ``AsyncLLM`` of ``args``: its engine core spawned, ready."""
        from vllm.engine.arg_utils import AsyncEngineArgs
        from vllm.v1.engine.async_llm import AsyncLLM

        return AsyncLLM.from_engine_args(AsyncEngineArgs(**args))

    # -- the control plane of a sync (grpo_fast.rollout.vllm.transfer.transport.Control) --

    def _run(self, coro: Coroutine, deadline: Deadline, doing: str) -> Any:
        from vllm.v1.engine.exceptions import EngineDeadError

        if self.llm is not None and self.llm.errored:
            coro.close()
            raise EngineDied(f"the vLLM engine process is dead (found before {doing})")
        try:
            return self.loop.run(coro, deadline, doing, self._death)
        except EngineDeadError as e:
            raise EngineDied(f"the vLLM engine process died during {doing}") from e

    def _death(self) -> str | None:
        """Why the engine is dead (vLLM marked it so: its engine core or a worker exited), or None."""
        return "the vLLM engine process died" if self.llm is not None and self.llm.errored else None

    def init_weight_transfer_engine(self, init_info: dict, deadline: Deadline) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferInitRequest

        self._run(
            self.llm.init_weight_transfer_engine(WeightTransferInitRequest(init_info)),
            deadline,
            "init_weight_transfer_engine",
        )

    def pause(self, deadline: Deadline) -> None:
        self._run(
            self.llm.pause_generation(mode="keep", clear_cache=True), deadline, "pause_generation(keep)"
        )

    def resume(self, deadline: Deadline) -> None:
        self._run(self.llm.resume_generation(), deadline, "resume_generation")

    def start_weight_update(self, deadline: Deadline) -> None:
        self._run(self.llm.start_weight_update(), deadline, "start_weight_update")

    def update_weights(self, update_info: dict, deadline: Deadline) -> None:
        from vllm.distributed.weight_transfer.base import WeightTransferUpdateRequest

        self._run(
            self.llm.update_weights(WeightTransferUpdateRequest(update_info)), deadline, "update_weights"
        )

    def finish_weight_update(self, weight_version: str | None, deadline: Deadline) -> None:
        self._run(self.llm.finish_weight_update(weight_version), deadline, "finish_weight_update")

    def update_weight_version(self, weight_version: str, deadline: Deadline) -> None:
        self._run(self.llm.update_weight_version(weight_version), deadline, "update_weight_version")

    # -- the Engine boundary (grpo_fast.rollout.vllm.placement.Engine) --

    # load_weights: SyncedApart's

    def load_adapter(self, folder: str, version: int | None = None) -> None:
        from vllm.lora.request import LoRARequest

        version = 0 if version is None else version
        deadline = self.sync_deadline("adapter", version)
        request = LoRARequest(f"grpo_fast_{self.adapters.next_id}", self.adapters.next_id, folder)
        self._run(self.llm.add_lora(request), deadline, "add_lora")
        for old in self.adapters.switch(request, version):
            self._run(self.llm.remove_lora(old.lora_int_id), deadline, "remove_lora")
        self.version = version

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[dict[str, Any]]]:
        from vllm import SamplingParams as VSP
        from vllm.sampling_params import RequestOutputKind

        requests = request_params(params, len(prompt_ids))
        what = f"generating {len(prompt_ids)} prompts × {requests[0][0].n if requests else 0} in the vLLM engine process"
        deadline = Deadline(self.timeouts.request, what, "rollout.request_timeout")

        async def all_prompts():
            return await asyncio.gather(
                *(
                    # FINAL_ONLY: one output with all n completions (a streamed one may hold some)
                    self._one(p, VSP(**sampling_fields(sp, seed), output_kind=RequestOutputKind.FINAL_ONLY))
                    for p, (sp, seed) in zip(prompt_ids, requests)
                )
            )

        return self._run(all_prompts(), deadline, "the responses")

    async def _one(self, prompt: list[int], sp) -> list[dict[str, Any]]:
        adapter, version = self.adapters.acquire(self.version)
        final = None
        try:
            stream = self.llm.generate(
                {"prompt_token_ids": list(prompt)}, sp, f"grpo_fast-{uuid.uuid4().hex}", lora_request=adapter
            )
            async for out in stream:
                final = out
        finally:
            for old in self.adapters.release(
                adapter
            ):  # best effort: an adapter left loaded costs memory only
                try:
                    await self.llm.remove_lora(old.lora_int_id)
                except Exception as e:
                    log.warning("vLLM remove_lora(%d): %s", old.lora_int_id, _one_line(e))
        group = []
        for c in final.outputs:
            if c.finish_reason not in ("stop", "length"):
                raise EngineError(
                    f"vLLM ended a request with finish_reason={c.finish_reason!r} (aborted by another client?)"
                )
            group.append(
                {
                    "token_ids": list(c.token_ids),
                    "text": c.text,
                    "finish_reason": c.finish_reason,
                    "logprobs": [d[t].logprob for t, d in zip(c.token_ids, c.logprobs or [])]
                    if c.logprobs
                    else None,
                    # an adapter's version is the one its request started with; full weights: vLLM's spans
                    **versions_fields(
                        [version] if adapter is not None else sampled_versions(c.weight_versions, version)
                    ),
                }
            )
        return group

    def prompt_logprobs(self, token_ids: list[int]) -> list[float]:
        """``log p(token_ids[t] | token_ids[:t])`` for t = 1 … L−1 at temperature 1: ``[L − 1]``."""
        from vllm import SamplingParams as VSP

        deadline = Deadline(
            self.timeouts.request, "the weight-sync probe's request", "rollout.request_timeout"
        )
        sp = VSP(max_tokens=1, temperature=1.0, prompt_logprobs=0)

        async def probe():
            adapter, _ = self.adapters.acquire(self.version)
            final = None
            try:
                async for out in self.llm.generate(
                    {"prompt_token_ids": list(token_ids)},
                    sp,
                    f"grpo_fast-probe-{uuid.uuid4().hex}",
                    lora_request=adapter,
                ):
                    final = out
            finally:
                self.adapters.release(adapter)
            return final

        out = self._run(probe(), deadline, "the probe's log-probs")
        return [d[t].logprob for t, d in zip(token_ids[1:], out.prompt_logprobs[1:])]

    def reset_prefix_cache(self) -> None:
        # The pause before the update already reset it (pause(keep, clear_cache=True)); a reset
        # with requests running is refused by vLLM (returns False), which is fine here.
        deadline = Deadline(self.timeouts.sync, "resetting the prefix cache", "rollout.sync_timeout")
        self._run(self.llm.reset_prefix_cache(), deadline, "reset_prefix_cache")

    def wake_up(self, tags: list[str]) -> None:
        pass

    def sleep(self, level: int) -> None:
        pass

    def engine_pids(self) -> list[int]:
        """The processes that hold the model (vLLM's workers), for the tests that kill one."""
        deadline = Deadline(
            self.timeouts.request, "asking the engine its worker pids", "rollout.request_timeout"
        )
        return list(self._run(self.llm.collective_rpc("grpo_fast_worker_pid"), deadline, "collective_rpc"))

    def close(self) -> None:
        self._finalizer()


def _shutdown(llm, loop: EventLoopThread) -> None:
    loop.cancel_tasks()  # first: the output handler would log the engine core's exit as an error
    if llm is not None:
        try:
            llm.shutdown(timeout=10)
        except Exception as e:  # at exit: say it, go on
            log.warning("vLLM engine shutdown: %s", _one_line(e))
    loop.stop()


def _one_line(e: BaseException) -> str:
    """``e`` on one line: its type and its message's lines joined (at most 400 characters)."""
    text = " ".join(x.strip() for x in str(e).splitlines() if x.strip())
    return f"{type(e).__name__}: {text[:400]}"
