"""``Fleet``: one rollout backend over several engines (``rollout.num_engines``), that goes on
when one dies.

**Requests.** ``generate`` cuts the prompts into shards fixed by the call alone: prompts of at
most ``ceil(P / num_engines)`` (and at most one generation batch's worth), shard i sampled with
its own seed (``shard_seed``: the call's seed and i). Each shard goes to the engine in service
with the fewest requests in flight (each engine takes one at a time: its own decoder's batch),
ties to the one that has served fewest; a group never leaves its shard, so a trajectory stays on
one engine. Which engine serves a shard changes nothing it samples: the same weights, the same
seed, the same code — a run whose engine died mid-step samples what the uninterrupted run did.

**Weights.** ``load_weights(staged, version)`` takes the staged version once (``share``: for
the hf workers, written into the shared-memory buffers they all read) and loads it on every
engine in service at once, each probed after its load (``load``: for hf, the digest of the
parameters the worker holds against the staged tensors'). An engine that fails its probe is out
of service, never trusted.

**Failures.** An engine that dies, times out or fails its probe: one warning line naming it and
what happened; its shard in flight goes to another engine with the same seed; the fleet goes on
while ``min_engines`` serve, and restarts it in the background (``start``: a fresh engine, then
the current version loaded and probed under the load lock, so it never serves an older one); it
takes requests again once it passed. A restart is tried ``RESTART_TRIES`` times, each bounded by
the engine's start and sync timeouts; then the engine is given up, in one line. Below
``min_engines``: ``EngineDied``, one line — the loop writes the last step's checkpoint.

**Metrics** (``take_metrics``, per batch): ``fleet/engines_serving``, ``fleet/restarts`` (so
far), and per engine ``fleet/engine<i>/requests``, ``tokens`` (sampled), ``busy_s`` (its
generation wall time), ``loads`` since the last call, ``serving`` (1/0) and ``restarts``. They
describe the machine, not the learning: a failover changes them and nothing else.
"""

from __future__ import annotations

import contextlib
import math
import queue
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

from grpo_fast.errors import EngineDied, EngineError, WeightSyncError
from grpo_fast.rollout.base import Rollout, SamplingParams

RESTART_TRIES = 3  # restarts of one engine in a row before it is given up
RESTART_PAUSE_S = 1.0  # between two tries
SHARD_TRIES = 3  # engines one shard may take down before the call gives up (a request that kills any)
FAILURES = (EngineError, WeightSyncError)  # what takes an engine out of service (anything else is a bug)


def shard_seed(seed: int | None, shard: int) -> int | None:
    """Shard ``shard``'s sampling seed for a call seeded ``seed`` (None stays None)."""
    return None if seed is None else (seed + 1_000_003 * (shard + 1)) % 2**31


def shards(num_prompts: int, n: int, num_engines: int, generation_batch_size: int) -> list[range]:
    """The prompt ranges a call of ``num_prompts`` prompts × ``n`` is cut into: contiguous, at most
    ``ceil(num_prompts / num_engines)`` prompts and ``generation_batch_size // n`` (at least 1)
    each; fixed by these numbers alone (never by which engines serve)."""
    if num_prompts == 0:
        return []
    size = min(math.ceil(num_prompts / num_engines), max(1, generation_batch_size // n))
    return [range(a, min(a + size, num_prompts)) for a in range(0, num_prompts, size)]


def fleet_size(r) -> int:
    """The engines a run's rollout has (``rollout`` section ``r``): the servers listed in
    ``rollout.server_url`` when it is a list of several, else ``rollout.num_engines``."""
    urls = r.server_url if isinstance(r.server_url, list) else None
    return len(urls) if urls and len(urls) > 1 else r.num_engines


def engine_urls(r) -> list[str | None]:
    """Per engine of the fleet (``fleet_size``): the server URL it attaches to, or None for an
    engine the run starts."""
    if isinstance(r.server_url, list):
        return [str(u).rstrip("/") for u in r.server_url]
    return [None if r.server_url is None else str(r.server_url).rstrip("/")] * fleet_size(r)


def engine_device_lists(r) -> list[list[int] | None]:
    """Per engine of the fleet: the GPUs it runs on (``rollout.engine_devices``: one list for one
    engine, a list of lists for a fleet), or None (the trainer's device)."""
    d = r.engine_devices
    if d is None:
        return [None] * fleet_size(r)
    if d and all(isinstance(x, list) for x in d):
        return [list(x) for x in d]
    return [list(d)]


@dataclass
class _Engine:
    index: int
    backend: Any = None
    state: str = "starting"  # starting | serving | down | given up | closed
    busy: bool = False
    restarts: int = 0
    served: int = 0  # requests answered, over the run (the balancer's tie-break)
    counts: dict[str, float] = field(
        default_factory=lambda: dict.fromkeys(("requests", "tokens", "busy_s", "loads"), 0.0)
    )


class _Cancelled(BaseException):
    """The call an engine's request belonged to has ended (a stop, another failure)."""


class Fleet:
    """``num_engines`` engines as one ``RolloutBackend`` (module docstring).

    ``start(i)``: a new engine ``i``, started (raises ``EngineError`` when it cannot);
    ``share(staged)``: what every engine's load of a version reads, made once per version;
    ``load(engine, shared, version)``: one engine loads it and is probed (raises ``EngineError`` /
    ``WeightSyncError``); ``stage``: the member backends' ``stage``; ``warn(line)``: a warning
    line. ``generation_batch_size``: the engines' own (the shards' cap). ``on_close()``: what
    ``close`` frees after the engines (what ``share`` made that outlives a load).
    """

    def __init__(
        self,
        start: Callable[[int], Any],
        share: Callable[[Any], Any],
        load: Callable[[Any, Any, int], None],
        stage: Callable[..., Any],
        *,
        num_engines: int,
        min_engines: int = 1,
        generation_batch_size: int,
        warn: Callable[[str], None] = print,
        what: str = "rollout engine",
        on_close: Callable[[], None] | None = None,
    ):
        if not 1 <= min_engines <= num_engines:
            raise ValueError(f"min_engines={min_engines} must be in 1..num_engines={num_engines}")
        self._start, self._share, self._load, self.stage = start, share, load, stage
        self.num_engines, self.min_engines = num_engines, min_engines
        self.generation_batch_size = generation_batch_size
        self.warn, self.what, self._on_close = warn, what, on_close
        self.version: int | None = None
        self.sync_seconds: float | None = None
        self._shared: Any = None  # the version loaded last, as ``share`` made it
        self._lock = threading.Lock()  # engine states
        self._load_lock = threading.Lock()  # one load at a time: a version's, or a restart's
        self._closed = threading.Event()
        self._restarters: list[threading.Thread] = []
        self.engines = [_Engine(i) for i in range(num_engines)]
        errors: list[BaseException | None] = [None] * num_engines

        def first_start(e: _Engine) -> None:
            try:
                e.backend = start(e.index)
                e.state = "serving"
            except BaseException as exc:
                errors[e.index] = exc

        threads = [threading.Thread(target=first_start, args=(e,), daemon=True) for e in self.engines]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        bugs = [x for x in errors if x is not None and not isinstance(x, FAILURES)]
        failed = [e for e in self.engines if errors[e.index] is not None]
        if bugs or self.num_engines - len(failed) < min_engines:
            self.close()
            raise bugs[0] if bugs else errors[failed[0].index]
        for e in failed:
            self._out_of_service(e, errors[e.index], "starting")

    # ------------------------------------------------------------------ what the loop calls

    def name(self, e: _Engine) -> str:
        who = getattr(e.backend, "who", None)
        return f"{self.what} {e.index}" + (f" ({who})" if who else "")

    @property
    def serving(self) -> list[_Engine]:
        with self._lock:
            return [e for e in self.engines if e.state == "serving"]

    @property
    def weight_sync_abs_diff(self) -> float | None:
        """The largest weight-sync probe difference of the serving engines' latest loads (None
        when no engine reports one: the hf workers' probe is a digest)."""
        diffs = [getattr(e.backend, "weight_sync_abs_diff", None) for e in self.serving]
        diffs = [d for d in diffs if d is not None]
        return max(diffs) if diffs else None

    def load_weights(self, staged: Any, version: int) -> None:
        """Policy version ``version`` on every engine in service, each probed (module docstring);
        ``EngineDied`` when fewer than ``min_engines`` then serve."""
        t0 = time.perf_counter()
        with self._load_lock:
            self._wait_idle()
            shared = self._share(staged)
            engines = self.serving
            errors: dict[int, BaseException] = {}

            def one(e: _Engine) -> None:
                try:
                    self._load(e.backend, shared, version)
                    with self._lock:
                        e.counts["loads"] += 1
                except BaseException as exc:
                    errors[e.index] = exc

            threads = [threading.Thread(target=one, args=(e,), daemon=True) for e in engines]
            for t in threads:
                t.start()
            for t in threads:
                t.join()
            self._shared, self.version = shared, version
            bugs = [x for x in errors.values() if not isinstance(x, FAILURES)]
            if bugs:
                raise bugs[0]
            for e in engines:
                if e.index in errors:
                    self._out_of_service(e, errors[e.index], f"loading policy version {version}")
        self._check_enough(f"loading policy version {version}")
        self.sync_seconds = time.perf_counter() - t0

    def _wait_idle(self) -> None:
        """Until no engine answers a request of a call that ended early (``_drain``): an engine
        takes one caller at a time. Bounded by that request's own timeout, after which the
        engine is out of service."""
        while True:
            with self._lock:
                if not any(e.busy for e in self.engines):
                    return
            time.sleep(0.01)

    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        """The responses to ``prompt_ids``, in their order, from the shards (module docstring);
        ``progress(n)`` is called here (the caller's thread) as prompts complete. What it raises
        ends the call: the requests in flight are abandoned."""
        cuts = shards(len(prompt_ids), params.n, self.num_engines, self.generation_batch_size)
        pending, done = deque(range(len(cuts))), {}
        reported = [0] * len(cuts)  # prompts of each shard counted by progress
        failures = [0] * len(cuts)  # engines each shard's requests took down
        events: queue.Queue = queue.Queue()
        cancel = threading.Event()

        def request(e: _Engine, i: int) -> None:
            def report(n: int) -> None:
                if cancel.is_set():
                    raise _Cancelled
                events.put(("progress", e, i, n))

            t0 = time.perf_counter()
            try:
                part = e.backend.generate(
                    [prompt_ids[j] for j in cuts[i]], replace(params, seed=shard_seed(params.seed, i)), report
                )
                events.put(("done", e, i, (part, time.perf_counter() - t0)))
            except _Cancelled:
                events.put(("cancelled", e, i, None))
            except BaseException as exc:
                events.put(("failed", e, i, exc))

        running = 0
        try:
            while len(done) < len(cuts):
                self._check_enough(f"generating {len(prompt_ids)} prompts × {params.n}")
                with self._lock:
                    idle = [e for e in self.engines if e.state == "serving" and not e.busy]
                    idle.sort(key=lambda e: (e.served, e.index))
                    for e in idle:
                        if not pending:
                            break
                        e.busy = True
                        running += 1
                        threading.Thread(target=request, args=(e, pending.popleft()), daemon=True).start()
                try:
                    kind, e, i, body = events.get(timeout=0.1)
                except queue.Empty:
                    continue
                if kind == "progress":
                    add = min(body, len(cuts[i]) - reported[i])
                    reported[i] += add
                    if progress is not None and add > 0:
                        progress(add)
                    continue
                running -= 1
                with self._lock:
                    e.busy = False
                if kind == "done":
                    part, seconds = body
                    done[i] = part
                    with self._lock:
                        e.served += 1
                        e.counts["requests"] += 1
                        e.counts["tokens"] += part.num_sampled_tokens
                        e.counts["busy_s"] += seconds
                    if progress is not None and reported[i] < len(cuts[i]):
                        progress(len(cuts[i]) - reported[i])
                        reported[i] = len(cuts[i])
                elif kind == "failed":
                    if not isinstance(body, FAILURES):
                        raise body
                    failures[i] += 1
                    what = f"shard {i} ({len(cuts[i])} prompts)"
                    if failures[i] >= SHARD_TRIES:
                        self._out_of_service(e, body, f"{what} not re-sent")
                        raise EngineDied(
                            f"{what} took down {SHARD_TRIES} engines in a row (last: {_line(body)}): the "
                            "request itself fails on every engine"
                        )
                    self._out_of_service(e, body, f"{what} re-sent")
                    pending.appendleft(i)
        finally:
            cancel.set()
            self._drain(events, running)
        return Rollout.concat([done[i] for i in range(len(cuts))])

    def _drain(self, events: queue.Queue, running: int) -> None:
        """After a call ends early: the engines still answering its requests are marked idle as
        each answers (a thread per call, so that the caller goes on at once)."""
        if running <= 0:
            return

        def wait() -> None:
            left = running
            while left > 0 and not self._closed.is_set():
                try:
                    kind, e, _, _ = events.get(timeout=0.5)
                except queue.Empty:
                    continue
                if kind != "progress":
                    left -= 1
                    with self._lock:
                        e.busy = False

        threading.Thread(target=wait, daemon=True, name="grpo_fast-fleet-drain").start()

    def take_metrics(self) -> dict[str, float]:
        """The fleet's metrics since the last call (module docstring)."""
        out: dict[str, float] = {}
        with self._lock:
            out["fleet/engines_serving"] = float(sum(e.state == "serving" for e in self.engines))
            out["fleet/restarts"] = float(sum(e.restarts for e in self.engines))
            for e in self.engines:
                for k, v in e.counts.items():
                    out[f"fleet/engine{e.index}/{k}"] = float(v)
                    e.counts[k] = 0.0
                out[f"fleet/engine{e.index}/serving"] = float(e.state == "serving")
                out[f"fleet/engine{e.index}/restarts"] = float(e.restarts)
        return out

    def sleep(self) -> None:
        """Nothing to free: each engine's memory is its own."""

    def close(self) -> None:
        """Stop every engine and every restart in progress."""
        self._closed.set()
        with self._lock:
            members = [e.backend for e in self.engines if e.backend is not None]
            for e in self.engines:
                e.state = "closed"
        for b in members:
            with contextlib.suppress(Exception):
                b.close()
        for t in self._restarters:
            t.join(5.0)
        self._shared = None
        if self._on_close is not None:
            self._on_close()

    # ------------------------------------------------------------------ failures and restarts

    def _check_enough(self, doing: str) -> None:
        with self._lock:
            serving = sum(e.state == "serving" for e in self.engines)
            states = ", ".join(f"{e.index}: {e.state}" for e in self.engines)
        if serving < self.min_engines:
            raise EngineDied(
                f"{serving} of {self.num_engines} {self.what}s in service, below rollout.min_engines="
                f"{self.min_engines} ({states}), while {doing}"
            )

    def _out_of_service(self, e: _Engine, exc: BaseException, doing: str) -> None:
        """``e`` taken out of service after ``exc``: a warning line, the engine stopped, and a
        restart in the background."""
        with self._lock:
            if e.state in ("closed", "down"):
                return
            e.state, e.busy = "down", False
            backend, e.backend = e.backend, None
            serving = sum(x.state == "serving" for x in self.engines)
        self.warn(
            f"warning: {self.what} {e.index} out of service ({_line(exc)}; {doing}): "
            f"{serving} of {self.num_engines} serve; restarting it in the background"
        )
        if backend is not None:
            with contextlib.suppress(Exception):
                backend.close()
        if self._closed.is_set():
            return
        t = threading.Thread(
            target=self._restart, args=(e,), daemon=True, name=f"grpo_fast-fleet-restart-{e.index}"
        )
        self._restarters.append(t)
        t.start()

    def _restart(self, e: _Engine) -> None:
        """Engine ``e`` started again, loaded with the version the fleet serves and probed, then
        in service; ``RESTART_TRIES`` tries, then given up (one line)."""
        t0, last = time.monotonic(), None
        for _ in range(RESTART_TRIES):
            if self._closed.is_set():
                return
            backend = None
            try:
                backend = self._start(e.index)
                with self._load_lock:
                    if self.version is not None:
                        self._load(backend, self._shared, self.version)
                    with self._lock:
                        if self._closed.is_set():
                            raise _Cancelled
                        e.backend, e.state = backend, "serving"
                        e.restarts += 1
                        e.counts["loads"] += 1
                self.warn(
                    f"warning: {self.name(e)} back in service after {time.monotonic() - t0:.1f} s "
                    f"(restart {e.restarts}), serving policy version {self.version} (probed)"
                )
                return
            except BaseException as exc:
                last = exc
                if backend is not None:
                    with contextlib.suppress(Exception):
                        backend.close()
                if isinstance(exc, _Cancelled) or self._closed.wait(RESTART_PAUSE_S):
                    return
        with self._lock:
            if e.state == "closed":
                return
            e.state = "given up"
        self.warn(
            f"warning: {self.what} {e.index} given up after {RESTART_TRIES} failed restarts in "
            f"{time.monotonic() - t0:.0f} s (last: {_line(last)})"
        )


def _line(exc: BaseException) -> str:
    """The first line of ``exc``'s message (its type's name when it has none)."""
    text = str(exc)
    return text.splitlines()[0] if text else type(exc).__name__
