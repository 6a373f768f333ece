"""``HFProcessBackend``: the hf decoder in a worker process (``rollout.placement=process``), for
a producer apart from the trainer (``grpo_fast.loop.pipeline``), with its own copy of the weights
and its own torch threads (``rollout.worker_threads``), so that on a CPU generation and the
optimizer's step run on separate cores.

It takes the weights of a policy version as ``HFCopyBackend`` does
(``grpo_fast.rollout.hf.copied``: ``load_weights(tensors, version)``, the trainable parameters by
name, copied exactly). The worker gets them through shared memory: one ``[numel]`` buffer per
tensor, allocated once, written by the parent, read by the worker on a ``load`` message; the
worker then sends the digest of the parameters it holds (``weights_digest``), which must equal
the staged tensors' (``WeightSyncError`` otherwise: the probe of every load). Several workers (a
fleet, ``grpo_fast.rollout.fleet``) share one set of buffers: written once, read by each.

Every wait on the worker has a limit and raises one line (``grpo_fast.errors.EngineTimeout``,
``EngineDied``): its start (``rollout.start_timeout``), a rollout (``request_timeout``), a weight
load (``sync_timeout``). The worker ignores SIGINT/SIGTERM (the run stops it; a Ctrl-C reaches
the whole process group) and exits when its parent is gone (the end of its lifeline pipe closes).

Workers fork from one server per trainer process (``multiprocessing``'s forkserver, which
imported torch and the model code once: ``grpo_fast.rollout.hf._forkserver``): the first worker
of a process waits for the server's imports as a spawned one waited for its own; each later one
(a fleet's, a restart, the next run in the same process) starts in a fraction of a second.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import pickle
import signal
import threading
import time
import traceback
from dataclasses import dataclass

import torch

from grpo_fast.errors import EngineDied, EngineTimeout, WeightSyncError
from grpo_fast.rollout.base import Rollout, SamplingParams, WeightsFromStage
from grpo_fast.rollout.hf.copied import _generator, stage_trainable, trainable_tensors, weights_digest
from grpo_fast.rollout.hf.decoder import HFBackend


@dataclass(frozen=True)
class Timeouts:
    """Seconds to wait for the worker: to start, for one rollout, for one weight load."""

    start: float = 900.0
    request: float = 3600.0
    sync: float = 600.0


def worker_threads(setting, cpus: int | None = None, workers: int = 1) -> int:
    """Each worker's torch threads for ``rollout.worker_threads`` (an int, or auto: the workers
    share half the CPUs this process may use, at least 1 each)."""
    if setting != "auto":
        return int(setting)
    cpus = cpus if cpus is not None else len(os.sched_getaffinity(0))
    return max(1, cpus // 2 // workers)


# what the forkserver imports before it forks a worker (its docstring: why, and the SIGTERM rule)
FORKSERVER_PRELOAD = ["grpo_fast.rollout.hf._forkserver"]


def worker_context():
    """The ``multiprocessing`` context the workers start from: ``forkserver``, preloaded with
    ``FORKSERVER_PRELOAD`` (the server starts at the first worker; ``start_worker_server`` starts
    it earlier)."""
    import torch.multiprocessing as mp  # shared-memory tensors travel to the child by handle

    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(FORKSERVER_PRELOAD)
    return ctx


def start_worker_server() -> None:
    """Start the workers' server now, so that its imports (torch, the model code: ~5 s of a core)
    run while this process builds its model, not after."""
    from multiprocessing import forkserver

    worker_context()
    forkserver.ensure_running()


def shared_buffers(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """``[numel]``-shaped shared-memory copies of ``model``'s trainable tensors, by name: what the
    parent writes a policy version into and its workers read it from."""
    return {n: t.to("cpu", copy=True).share_memory_() for n, t in trainable_tensors(model).items()}


def worker_payload(
    model: torch.nn.Module, tokenizer, generation_batch_size: int, autocast_dtype=None
) -> bytes:
    """What a worker starts from (the model, the tokenizer, the batch size, the autocast dtype),
    pickled: made once, so that a worker restarted mid-run never reads the trainer's model while
    it trains (a fleet keeps it)."""
    return pickle.dumps((model, tokenizer, generation_batch_size, autocast_dtype))


class HFProcessBackend(WeightsFromStage):
    """The hf decoder in a worker process (forked from the workers' server: ``worker_context``)
    with its own copy of the weights.

    The parent pickles the model and tokenizer to the worker once (its start); after that, a
    policy version is its trainable tensors written into shared memory and a ``load`` message
    (``load_weights``). ``generate`` sends the prompts and the sampling parameters (the worker
    seeds its stream with ``params.seed``) and waits for the ``Rollout``; the worker reports each
    finished chunk (``progress``). One caller at a time: the producer's thread, or the lockstep
    loop's. ``version`` is the policy version the worker holds; ``sync_seconds`` the last load's
    wall time (shared-memory write + the worker's copy).
    """

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        generation_batch_size: int,
        *,
        threads: int = 1,
        timeouts: Timeouts = Timeouts(),
        autocast_dtype=None,
        payload: bytes | None = None,
        shm: dict[str, torch.Tensor] | None = None,
        name: str | None = None,
    ):
        """``payload`` (``worker_payload``) instead of pickling ``model`` now; ``shm``
        (``shared_buffers``) shared with other workers instead of buffers of its own; ``name``:
        how messages call it (``the hf rollout worker 1``)."""
        self.timeouts = timeouts
        self.version = 0
        self.sync_seconds: float | None = None
        self.name = "the hf rollout worker" + (f" {name}" if name else "")
        self._broken: str | None = None  # a wait that ran out: the worker's state is unknown
        self._ids = itertools.count()
        # [numel] per trainable tensor, shared with the worker: the parent writes, the worker copies
        self._shm = shm if shm is not None else shared_buffers(model)
        ctx = worker_context()  # never fork this process (its threads: the producer's, torch's)
        self._conn, child = ctx.Pipe()
        # the worker's lifeline: it exits when this end closes (a close, or this process's death)
        lifeline, self._lifeline = ctx.Pipe(duplex=False)
        self._proc = ctx.Process(
            target=_serve,
            args=(child, self._shm, threads, lifeline),
            daemon=True,
            name="grpo_fast-hf-worker",
        )
        self._proc.start()
        child.close()
        lifeline.close()
        if payload is None:
            payload = worker_payload(model, tokenizer, generation_batch_size, autocast_dtype)
        try:
            self._call("start", payload, limit=timeouts.start, key="start_timeout", doing="starting")
        except BaseException:  # no backend to close it later: the worker goes now
            self.close()
            raise

    @property
    def pid(self) -> int | None:
        return self._proc.pid

    @property
    def who(self) -> str:
        """The worker as messages name it: ``the hf rollout worker (pid 1234)``."""
        return f"{self.name} (pid {self.pid})"

    stage = staticmethod(stage_trainable)  # a policy version of ``model``, for ``load_weights``

    def load_weights(self, tensors: dict[str, torch.Tensor], version: int) -> None:
        """Policy version ``version``'s trainable parameters (``trainable_tensors``), into the
        worker: written into shared memory, then copied by the worker into its model and probed
        (``load_shared``)."""
        t0 = time.perf_counter()
        for name, value in tensors.items():
            self._shm[name].copy_(value)
        self.load_shared(version, weights_digest(self._shm))
        self.sync_seconds = time.perf_counter() - t0

    def load_shared(self, version: int, expect: list[tuple[int, int]]) -> None:
        """Policy version ``version`` from the shared buffers as they are now (written by the
        caller), copied by the worker into its model; ``expect``: the buffers' ``weights_digest``,
        which the worker's parameters must match after the copy (``WeightSyncError`` naming the
        first tensor that differs, and the worker is not trusted again)."""
        doing = f"loading the weights of policy version {version}"
        got = self._call("load", version, limit=self.timeouts.sync, key="sync_timeout", doing=doing)
        if got != expect:
            names = list(self._shm)
            bad = [names[i] for i, (a, b) in enumerate(zip(got, expect)) if a != b] or names
            self._broken = f"{self.who} failed the probe of policy version {version}'s load"
            raise WeightSyncError(
                f"{self.who} serves other weights than policy version {version}'s after its load: "
                f"the digest of {len(bad)} of {len(names)} tensors differs (first {bad[0]})"
            )
        self.version = version

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        doing = f"generating {len(prompt_ids)} prompts × {params.n}"
        return self._call(
            "generate",
            prompt_ids,
            params,
            limit=self.timeouts.request,
            key="request_timeout",
            doing=doing,
            progress=progress,
        )

    def worker_weights(self) -> dict[str, torch.Tensor]:
        """The worker's ``state_dict`` as it is now (a copy): what it samples from."""
        return self._call(
            "state", limit=self.timeouts.request, key="request_timeout", doing="sending its weights"
        )

    def sleep(self) -> None:
        """Nothing to free: the worker's memory is its own."""

    def close(self) -> None:
        """Stop the worker (a ``close`` message, then SIGKILL if it has not exited within 2 s)."""
        if self._proc.exitcode is None:
            with contextlib.suppress(OSError):  # already gone
                self._conn.send(("close", next(self._ids)))
            self._proc.join(2.0)
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join(5.0)
        self._conn.close()
        self._lifeline.close()

    def _died(self, doing: str) -> EngineDied:
        self._proc.join(1.0)
        code = self._proc.exitcode
        how = (
            f"killed by {signal.Signals(-code).name}"
            if code is not None and code < 0
            else f"exit code {code}"
            if code is not None
            else "its pipe closed"
        )
        self._broken = f"{self.who} exited ({how})"
        return EngineDied(f"{self._broken} while {doing}")

    def _call(self, kind: str, *args, limit: float, key: str, doing: str, progress=None):
        """Send one request and wait for its answer: at most ``limit`` seconds (``rollout.<key>``),
        ``EngineDied`` as soon as the worker is gone. ``progress(n)`` gets the worker's chunk
        reports; if it raises, the request is abandoned (its late answer is skipped)."""
        if self._broken is not None:
            raise EngineDied(f"{self._broken}; cannot go on {doing}")
        rid = next(self._ids)
        try:
            self._conn.send((kind, rid, *args))
        except OSError:
            raise self._died(doing) from None
        t0 = time.monotonic()
        while True:
            left = limit - (time.monotonic() - t0)
            if left <= 0:
                self._broken = f"{self.who} did not answer in time"
                raise EngineTimeout(f"{self.who} did not finish {doing} within rollout.{key}={limit:g} s")
            if not self._conn.poll(min(left, 0.1)):
                if self._proc.exitcode is not None:
                    raise self._died(doing)
                continue
            try:
                what, mid, body = self._conn.recv()
            except (EOFError, OSError):
                raise self._died(doing) from None
            if mid != rid:  # an abandoned request's late answer
                continue
            if what == "progress":
                if progress is not None:
                    progress(body)
                continue
            if what == "error":  # a bug in the worker keeps its traceback
                raise RuntimeError(f"{self.who} raised while {doing}:\n{body}")
            return body


# ------------------------------------------------------------------------------------ the worker


def _plain_attention(model: torch.nn.Module) -> None:
    """The attention implementations the trainer's process registered as wrappers around a base
    (``grpo_fast_shared+sdpa``: ``train.share_prompts``; ``grpo_fast_sp+grpo_fast_shared+sdpa``:
    sequence parallelism around it) are not registered here: the worker runs the innermost base,
    which is what each wrapper runs for every call without a shared-prompt layout or an sp shard
    (generation makes neither)."""
    config = getattr(model, "config", None)
    impl = getattr(config, "_attn_implementation", None)
    if impl and "+" in impl:
        config._attn_implementation = impl.rsplit("+", 1)[1]


def _watch_parent(lifeline) -> None:
    """End the worker once its parent is gone (a SIGKILL leaves no one to close it): the parent
    never writes to the lifeline, so a read returns only at the end of the pipe, when the parent's
    end is closed (by ``close``, or by the kernel at its death)."""
    with contextlib.suppress(EOFError, OSError):
        lifeline.recv()
    os._exit(0)


def _serve(conn, shm: dict[str, torch.Tensor], threads: int, lifeline) -> None:
    """The worker's loop: one request at a time, each answered ``("done", id, result)`` or
    ``("error", id, traceback)``; a ``generate`` also sends ``("progress", id, n)`` per chunk."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when the worker stops
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    torch.set_num_threads(threads)
    threading.Thread(target=_watch_parent, args=(lifeline,), daemon=True).start()
    backend, params = None, {}
    while True:
        try:
            kind, rid, *args = conn.recv()
        except (EOFError, OSError):
            return
        try:
            if kind == "close":
                conn.send(("done", rid, None))
                return
            if kind == "start":
                model, tokenizer, batch, amp = pickle.loads(args[0])
                _plain_attention(model)
                model.requires_grad_(False)
                backend, params = HFBackend(model, tokenizer, batch, amp), dict(model.named_parameters())
                result = os.getpid()
            elif kind == "load":
                with torch.no_grad():
                    for name, value in shm.items():
                        params[name].copy_(value)
                backend.version = int(args[0])
                result = weights_digest({name: params[name] for name in shm})
            elif kind == "generate":
                prompt_ids, sp = args
                backend.generator = _generator(sp, torch.device("cpu"))
                report = lambda n, rid=rid: conn.send(("progress", rid, n))
                result = backend.generate(prompt_ids, sp, progress=report)
            elif kind == "state":
                result = {k: v.detach().clone() for k, v in backend.model.state_dict().items()}
            else:
                raise ValueError(f"unknown request {kind!r}")
            conn.send(("done", rid, result))
        except Exception:
            conn.send(("error", rid, traceback.format_exc()))
