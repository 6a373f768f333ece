"""Engines apart from the trainer (``rollout.placement=process|server``) without vLLM: the waits
that must raise instead of hanging, a dead server, the weight-sync sequence and the shared-memory
transport, the policy versions, and the threads contract of ``VLLMBackend``; and whole tiny runs
attached to the FAKE server that stop with one line and a resumable checkpoint when it dies or
hangs (at a rollout, a weight sync, an evaluation, the engine's start).

The server side is ``tests/fake_vllm_server.py``'s FAKE server on 127.0.0.1 (canned answers, and
routes told to hang, close or fail); the real engines run in tests/test_vllm_process.py and
tests/test_vllm_server.py (``pytest -m vllm``). Timeouts here are 1-2 s; each test's wall-clock
bound is the behaviour (it would hang, or wait the default hour, without the timeout).
"""

import json
import os
import shutil
import socket
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from fake_vllm_server import FakeVLLMServer

from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.policy.checkpoint import STATE_FILE
from grpo_fast.rollout import BackendContext, backend
from grpo_fast.rollout.base import Rollout, SamplingParams
from grpo_fast.rollout.vllm import EngineDied, EngineError, EngineTimeout, VLLMBackend
from grpo_fast.rollout.vllm.deadline import Deadline, Timeouts
from grpo_fast.rollout.vllm.placement.process import EventLoopThread
from grpo_fast.rollout.vllm.placement.server import ServerEngine, ServerProcess, server_command
from grpo_fast.rollout.vllm.placement.shared import AdapterSlots, sampled_versions
from grpo_fast.rollout.vllm.transfer.transport import (
    ShmTransport,
    StagedShm,
    free_port,
    sync,
    unique_tensors,
)
from grpo_fast.rollout.vllm.transfer.weights import tied_names
from grpo_fast.task import tiny

FAKE = str(Path(__file__).with_name("fake_vllm_server.py"))
PARAMS = SamplingParams(n=2, temperature=1.0, top_p=1.0, max_tokens=3, min_tokens=0, seed=5)


def _timeouts(start=30.0, request=30.0, sync=30.0) -> Timeouts:
    return Timeouts(start=start, request=request, sync=sync)


def _named():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    return model, list(model.state_dict().items())


def _one_line(e: BaseException) -> str:
    text = str(e)
    assert "\n" not in text, text
    return text


# -- waits that raise instead of hanging --------------------------------------------------------


def test_a_sync_that_never_completes_raises_naming_the_wait_and_resumes_the_engine():
    _, named = _named()
    with FakeVLLMServer({"/start_weight_update": "hang"}) as fake:
        engine = ServerEngine(fake.url, timeouts=_timeouts(sync=1.0), dtype="float32")
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout) as err:
            engine.load_weights(named, version=3)
        took = time.monotonic() - t0
        engine.close()
    assert _one_line(err.value) == (
        "the weight sync of step 3 did not finish within 1 s (waiting for POST /start_weight_update); "
        "rollout.sync_timeout sets this limit"
    )
    assert took < 5  # measured ≈ 1.0 s; the default limit is 600 s
    # paused, stuck, then resumed: a failed sync does not leave the engine paused
    assert fake.calls[-3:] == ["/pause", "/start_weight_update", "/resume"]


def test_a_generation_that_never_answers_times_out():
    with FakeVLLMServer({"/inference/v1/generate": "hang"}) as fake:
        engine = ServerEngine(fake.url, timeouts=_timeouts(request=1.0), dtype="float32")
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout) as err:
            engine.generate([[1, 2], [3, 4]], PARAMS)
        took = time.monotonic() - t0
        engine.close()
    assert _one_line(err.value).startswith(
        f"generating 2 prompts × 2 on the vLLM server at {fake.url} did not finish within 1 s"
    )
    assert "rollout.request_timeout" in str(err.value)
    assert took < 5  # measured ≈ 1.0 s


def test_a_connection_the_server_drops_is_a_dead_server():
    with FakeVLLMServer({"/inference/v1/generate": "close"}) as fake:
        engine = ServerEngine(fake.url, timeouts=_timeouts(), dtype="float32")
        with pytest.raises(EngineDied, match="stopped answering during POST /inference/v1/generate"):
            engine.generate([[1, 2]], PARAMS)
        engine.close()


def _start_fake_process(tmp_path, behaviour, start=20.0) -> ServerProcess:
    port = free_port()
    cmd = [sys.executable, FAKE, str(port), json.dumps(behaviour)]
    deadline = Deadline(start, "the fake server's start", "rollout.start_timeout")
    return ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", deadline)


def test_a_server_killed_mid_request_stops_at_once_with_one_line(tmp_path):
    proc = _start_fake_process(tmp_path, {"/inference/v1/generate": "hang"})
    engine = ServerEngine(proc.url, timeouts=_timeouts(request=600.0), dtype="float32", process=proc)
    caught: list[BaseException] = []

    def produce():
        try:
            engine.generate([[1, 2]], PARAMS)
        except BaseException as e:
            caught.append(e)

    producer = threading.Thread(target=produce)
    producer.start()
    for _ in range(200):  # until the request is in flight on the server
        if "request /inference/v1/generate" in (tmp_path / "server.log").read_text():
            break
        time.sleep(0.05)
    t0 = time.monotonic()
    proc.proc.kill()  # SIGKILL: a crash, no goodbye
    producer.join(timeout=30)
    took = time.monotonic() - t0
    engine.close()
    assert not producer.is_alive() and len(caught) == 1
    assert isinstance(caught[0], EngineDied)
    assert _one_line(caught[0]).startswith(
        f"the vLLM server (pid {proc.proc.pid}) exited with code -9 during POST /inference/v1/generate: killed by "
        "SIGKILL (log: "
    )
    assert took < 10  # measured ≈ 0.1 s: the socket closes with the process; the limit was 600 s


def _running(marker: str) -> list[int]:
    """The pids whose command line holds ``marker``."""
    pids = []
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            if marker.encode() in cmdline.read_bytes():
                pids.append(int(cmdline.parent.name))
        except OSError:
            pass
    return pids


def test_a_server_that_never_listens_times_out_and_is_stopped(tmp_path):
    port = free_port()
    marker = f"never-listens-{port}-{time.time_ns()}"
    cmd = [sys.executable, "-c", f"import time; time.sleep(600)  # {marker}"]
    deadline = Deadline(2.0, f"the vLLM server's start on http://127.0.0.1:{port}", "rollout.start_timeout")
    before = time.monotonic()
    with pytest.raises(EngineTimeout) as err:
        ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", deadline)
    assert _one_line(err.value) == (
        f"the vLLM server's start on http://127.0.0.1:{port} did not finish within 2 s (waiting for the server "
        f"to answer GET http://127.0.0.1:{port}/health); rollout.start_timeout sets this limit"
    )
    assert time.monotonic() - before < 25  # 2 s, then SIGTERM (a sleeping python dies at once)
    assert _running(marker) == []  # stopped, not left behind


def test_a_server_that_exits_at_start_says_why(tmp_path):
    port = free_port()
    cmd = [
        sys.executable,
        "-c",
        "import sys; print('ValueError: unrecognized arguments: --bogus'); sys.exit(3)",
    ]
    deadline = Deadline(30.0, "the vLLM server's start", "rollout.start_timeout")
    with pytest.raises(EngineDied) as err:
        ServerProcess(cmd, f"http://127.0.0.1:{port}", tmp_path / "server.log", deadline)
    assert _one_line(err.value).startswith(
        f"the vLLM server exited with code 3 before listening on http://127.0.0.1:{port}: "
        "ValueError: unrecognized arguments: --bogus (log: "
    )


def test_attaching_to_a_server_without_our_weight_transfer_names_the_flags():
    with FakeVLLMServer({"/init_weight_transfer_engine": "error"}) as fake, pytest.raises(EngineError) as err:
        ServerEngine(fake.url, timeouts=_timeouts(), dtype="float32")
    text = _one_line(err.value)
    assert not isinstance(err.value, EngineDied)  # the server is up: it lacks the transport
    assert '--weight-transfer-config \'{"backend": "grpo_fast_shm"}\'' in text
    assert "--worker-extension-cls grpo_fast.rollout.vllm.transfer._worker.WorkerExtension" in text


def test_the_event_loop_wait_times_out_and_cancels_the_coroutine():
    import asyncio

    loop = EventLoopThread()
    cancelled = threading.Event()

    async def forever():
        try:
            await asyncio.sleep(3600)
        except asyncio.CancelledError:
            cancelled.set()
            raise

    try:
        with pytest.raises(
            EngineTimeout,
            match=r"the weight sync of step 1 did not finish within 0.5 s \(waiting for update_weights\)",
        ):
            loop.run(
                forever(),
                Deadline(0.5, "the weight sync of step 1", "rollout.sync_timeout"),
                "update_weights",
            )
        assert cancelled.wait(5)  # the engine call is cancelled (AsyncLLM aborts its requests)
    finally:
        loop.stop()


# -- the config keys, end to end through the registry's build -----------------------------------


def _build(overrides, probe=None):
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    cfg = load_config("tiny", overrides=["rollout.backend=vllm", *overrides], check_device=False)
    ctx = BackendContext(
        cfg, model, tok, torch.device("cpu"), model_path="unused-by-an-attached-server", probe=probe
    )
    return backend("vllm").build(ctx)


def test_the_timeout_keys_bound_the_waits_of_a_run(tmp_path):
    with FakeVLLMServer({"/update_weights": "hang"}) as fake:
        base = ["rollout.placement=server", f"rollout.server_url={fake.url}", f"output_dir={tmp_path}"]
        t0 = time.monotonic()
        with pytest.raises(EngineTimeout, match=r"the weight sync of step 0 did not finish within 1.5 s"):
            _build([*base, "rollout.sync_timeout=1.5"])
        assert time.monotonic() - t0 < 6
        fake.behaviour = {"/inference/v1/generate": "hang"}
        vllm = _build([*base, "rollout.request_timeout=1"])
        with pytest.raises(EngineTimeout, match=r"did not finish within 1 s.*rollout\.request_timeout"):
            vllm.generate([[1, 2]], PARAMS)
        vllm.close()
    assert not list(tmp_path.iterdir())  # attached: the run started no server, wrote no log


def test_start_timeout_bounds_the_start_of_the_server_the_run_starts(tmp_path, monkeypatch):
    import grpo_fast.rollout.vllm.placement.server as vs

    monkeypatch.setattr(
        vs, "server_command", lambda *a, **k: [sys.executable, "-c", "import time; time.sleep(600)"]
    )
    t0 = time.monotonic()
    with pytest.raises(
        EngineTimeout, match=r"the vLLM server's start on http://127.0.0.1:\d+ did not finish within 2 s"
    ):
        _build(["rollout.placement=server", "rollout.start_timeout=2", f"output_dir={tmp_path}"])
    assert time.monotonic() - t0 < 25
    assert (tmp_path / "vllm_server.log").is_file()  # the server's output goes to the run folder


def test_the_server_command_carries_the_transport_and_the_users_flags():
    cmd = server_command("/m", 8123, dtype="bfloat16", max_model_len=64, seed=3, lora_rank=8,
                         extra_args={"enforce_eager": True, "max_num_seqs": 16, "enable_chunked_prefill": False},
                         devices=[1, 2])  # fmt: skip
    line = " ".join(cmd)
    assert cmd[1:3] == ["-m", "vllm.entrypoints.openai.api_server"]
    for part in ("--host 127.0.0.1 --port 8123", "--dtype bfloat16", "--max-model-len 64", "--seed 3",
                 "--enable-scale-out", "--logprobs-mode processed_logprobs", "--generation-config vllm",
                 '--weight-transfer-config {"backend": "grpo_fast_shm"}', "--tensor-parallel-size 2",
                 "--worker-extension-cls grpo_fast.rollout.vllm.transfer._worker.WorkerExtension",
                 "--enable-lora --max-lora-rank 8 --max-loras 2", "--enforce-eager", "--max-num-seqs 16",
                 "--no-enable-chunked-prefill"):  # fmt: skip
        assert part in line, part


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (["rollout.placement=server"], r"rollout.placement=server is a vLLM server \(rollout.backend=vllm\); rollout.backend=hf"),
        (["rollout.backend=vllm", "rollout.server_url=http://127.0.0.1:8000"], "rollout.server_url is for rollout.placement=server"),
        (["rollout.backend=vllm", "rollout.placement=server", "rollout.server_url=127.0.0.1:8000"], "must be http://HOST:PORT"),
        (["rollout.backend=vllm", "rollout.placement=server", "rollout.server_url=ftp://h:8000"], "must be http://HOST:PORT"),
        (["rollout.backend=vllm", "rollout.weight_transfer=nccl"], "rollout.weight_transfer is for rollout.placement=process or server"),
        (["rollout.backend=vllm", "rollout.placement=process", "rollout.weight_transfer=nccl"], "set rollout.engine_devices"),
        (["rollout.backend=vllm", "rollout.placement=process", "rollout.engine_devices=[1,1]"], "distinct GPU indices"),
        (["rollout.backend=vllm", "rollout.placement=server", "rollout.server_url=http://h:1", "rollout.engine_devices=[1]"],
         "the server at rollout.server_url has its own"),
    ],
    ids=["hf", "url-colocated", "url-format", "url-scheme", "nccl-colocated", "nccl-no-devices", "devices-repeat", "devices-attached"],
)  # fmt: skip
def test_placement_keys_refuse_what_does_not_fit(overrides, message):
    with pytest.raises(ConfigError, match=message):
        load_config("tiny", overrides=overrides, check_device=False)


# -- the weight sync and the transport -----------------------------------------------------------


class RecordingControl:
    """Records the control calls; checks each weight file exists while the engine "loads" it."""

    def __init__(self):
        self.calls: list[str] = []
        self.loaded: dict[str, torch.Tensor] = {}

    def pause(self, deadline):
        self.calls.append("pause")

    def resume(self, deadline):
        self.calls.append("resume")

    def start_weight_update(self, deadline):
        self.calls.append("start")

    def update_weights(self, info, deadline):
        from safetensors.torch import load_file

        self.calls.append("update")
        self.loaded.update(load_file(info["path"]))

    def finish_weight_update(self, version, deadline):
        self.calls.append(f"finish({version})")


def test_the_shm_transport_sends_every_weight_once_in_chunks_then_deletes_them():
    model, named = _named()
    transport = ShmTransport(torch.float32, chunk_bytes=200_000)  # the tiny model is ≈ 1.6 MB: several chunks
    control = RecordingControl()
    ties = tied_names(model)  # what the backend leaves out: the tied lm_head is the embedding
    assert ties == {"lm_head.weight": "model.embed_tokens.weight"}
    sent = [(n, t) for n, t in named if n not in ties]
    sync(control, transport, sent, 7, Deadline(30, "sync", "rollout.sync_timeout"))
    updates = control.calls.count("update")
    assert control.calls == ["pause", "start", *["update"] * updates, "finish(7)", "resume"] and updates > 2
    assert set(control.loaded) == {n for n, _ in sent}
    assert all(torch.equal(control.loaded[name], t) for name, t in sent)
    assert not list(transport.dir.iterdir())  # each file deleted once loaded
    transport.close()


def test_the_shm_transport_sends_temporaries_whatever_their_address_and_one_copy_of_an_alias():
    """Tensors made one at a time and freed once converted (a gathered FSDP tensor, a merged LoRA
    weight) each reach the engine with their own values, though one is often allocated where the
    last one was; two names of one tensor in one file are sent once (safetensors holds a storage
    once). Planted: the dedupe by the address of a freed tensor → names dropped, the engine
    keeps their old values."""
    transport = ShmTransport(torch.bfloat16, chunk_bytes=3 * 64 * 64 * 2)  # 3 tensors a file
    made = ((f"w{i}", torch.full((64, 64), float(i))) for i in range(12))
    control = RecordingControl()
    sync(control, transport, made, 1, Deadline(30, "sync", "rollout.sync_timeout"))
    assert sorted(control.loaded) == sorted(f"w{i}" for i in range(12))
    assert all(
        torch.equal(control.loaded[f"w{i}"], torch.full((64, 64), float(i)).bfloat16()) for i in range(12)
    )
    a = torch.ones(8, 8)
    sync(control, ShmTransport(torch.float32), [("a", a), ("tied", a)], 2, Deadline(30, "sync", "s"))
    assert "tied" not in control.loaded and torch.equal(control.loaded["a"], a)


def test_a_version_staged_in_shm_is_written_once_and_every_engine_loads_those_files():
    """A fleet's version (``StagedShm``, bf16, several chunks): two engines' transports and a third
    one later (a restart) each load every tensor, cast once, from the staged files alone; their
    own folders stay empty and the files stay until ``close``; iterating it gives the same tensors;
    a transport of another dtype refuses it. Planted: ``ShmTransport.send`` writing a StagedShm
    again (as pairs) → paths outside the staged folder, and the files deleted after the first engine."""
    _, named = _named()
    sent = [(n, t) for n, t in named if n != "lm_head.weight"]  # the tied head: the embedding
    staged = StagedShm(sent, torch.bfloat16, chunk_bytes=200_000)
    assert len(staged.files) > 2 and staged.nbytes == sum(f.stat().st_size for f in staged.files)
    written = {f: f.stat().st_mtime_ns for f in staged.files}

    class Paths(RecordingControl):
        def update_weights(self, info, deadline):
            self.paths = [*getattr(self, "paths", []), Path(info["path"])]
            super().update_weights(info, deadline)

    for version in (3, 3, 4):  # two engines, then one restarted
        transport, control = ShmTransport(torch.bfloat16), Paths()
        sync(control, transport, staged, version, Deadline(30, "sync", "rollout.sync_timeout"))
        assert control.paths == staged.files and not list(transport.dir.iterdir())
        assert control.calls[-2:] == [f"finish({version})", "resume"]
        assert set(control.loaded) == {n for n, _ in sent}
        assert all(torch.equal(control.loaded[n], t.bfloat16()) for n, t in sent)
        assert transport.bytes_sent == staged.nbytes
    assert {f: f.stat().st_mtime_ns for f in staged.files} == written  # never written again
    back = dict(staged)  # a file lists its names sorted
    assert len(back) == len(sent) and all(torch.equal(back[n], t.bfloat16()) for n, t in sent)
    with pytest.raises(
        ValueError, match=r"staged in torch\.bfloat16 for an engine that serves in torch\.float32"
    ):
        sync(RecordingControl(), ShmTransport(torch.float32), staged, 5, Deadline(30, "sync", "s"))
    staged.close()
    assert not staged.dir.exists()


def test_a_private_shm_folder_sweeps_what_a_gone_process_of_this_namespace_left():
    """``private_dir`` first deletes the folders of its prefix that a process of this PID namespace
    left and that is gone (a SIGKILLed run's staged version); a live process's, another
    namespace's (a container sharing /dev/shm) and another prefix's stay. Planted: the sweep
    without the liveness check → the live one goes; without the namespace in the name → the
    other namespace's goes."""
    import subprocess

    from grpo_fast.rollout.vllm.transfer.transport import _pid_namespace, private_dir

    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True,
                          text=True, check=True).stdout.strip()  # fmt: skip
    prefix = f"grpo_fast_sweeptest{os.getpid()}_"
    ns = _pid_namespace()
    root = private_dir(prefix).parent  # /dev/shm here
    left = {
        "dead": root / f"{prefix}{ns}-{gone}_x",
        "live": root / f"{prefix}{ns}-{os.getppid()}_x",
        "other namespace": root / f"{prefix}1{ns}-{gone}_x",
        "other prefix": root / f"grpo_fast_other{os.getpid()}_{ns}-{gone}_x",
    }
    try:
        for folder in left.values():
            folder.mkdir()
            (folder / "0000.safetensors").write_bytes(b"x")
        mine = private_dir(prefix)
        assert mine.name.startswith(f"{prefix}{ns}-{os.getpid()}_")
        assert {k: v.exists() for k, v in left.items()} == {
            "dead": False, "live": True, "other namespace": True, "other prefix": True
        }  # fmt: skip
    finally:
        for folder in [*left.values(), *root.glob(f"{prefix}*")]:
            shutil.rmtree(folder, ignore_errors=True)


def test_a_failed_sync_resumes_the_engine_and_raises_its_own_error():
    class Failing(RecordingControl):
        def update_weights(self, info, deadline):
            raise EngineDied("the vLLM server at X stopped answering during POST /update_weights (reset)")

    control = Failing()
    with pytest.raises(EngineDied, match="during POST /update_weights"):
        sync(
            control, ShmTransport(torch.float32), _named()[1], 2, Deadline(30, "sync", "rollout.sync_timeout")
        )
    assert control.calls == ["pause", "start", "resume"]


def test_unique_tensors_keeps_distinct_tensors_and_drops_aliases():
    a = torch.zeros(4, 3)
    named = [("a", a), ("alias", a), ("view_row", a[1]), ("b", torch.zeros(4, 3))]
    assert [n for n, _ in unique_tensors(named)] == ["a", "view_row", "b"]


def test_the_oldest_version_of_the_spans_labels_a_response():
    spans = [{"version": "4", "start": 0, "end": 5}, {"version": "3", "start": 5, "end": 9}]
    assert sampled_versions(spans, 9) == [3, 4]  # oldest first, whatever the order of the spans
    assert sampled_versions(None, 9) == [9] and sampled_versions([], 9) == [9]
    assert sampled_versions([{"version": "policy-a", "start": 0, "end": 1}], 9) == [9]  # not ours


def test_an_old_adapter_is_unloaded_only_after_its_last_request():
    slots = AdapterSlots()
    assert slots.acquire(0) == (None, 0)  # no adapter yet: the base, at the engine's version
    assert slots.switch("a1", 1) == []
    held, version = slots.acquire(5)
    assert (held, version) == ("a1", 1)
    assert slots.switch("a2", 2) == []  # a1 is still in use
    assert slots.release(held) == ["a1"]  # its last request finished: unload it now
    assert slots.switch("a3", 3) == ["a2"]  # nothing in flight on a2


# -- ServerEngine against the fake: parsing and versions -----------------------------------------


def test_server_engine_returns_tokens_logprobs_and_the_version_that_sampled_them():
    _, named = _named()
    with FakeVLLMServer() as fake:
        engine = ServerEngine(fake.url, timeouts=_timeouts(), dtype="float32")
        engine.load_weights(named, version=4)
        groups = engine.generate([[1, 2], [3]], PARAMS)
        probe = engine.prompt_logprobs([5, 6, 7])
        engine.close()
    assert [len(g) for g in groups] == [2, 2]
    c = groups[0][0]
    assert (c["token_ids"], c["text"], c["logprobs"], c["version"]) == ([7, 8, 9], "789", [-0.5] * 3, 4)
    assert probe == [-1.0, -1.0]
    bodies = [b for p, b in fake.bodies if p == "/inference/v1/generate"]
    # token ids in, each prompt with its own seed (seed + j·n; the requests run in parallel)
    assert {tuple(b["token_ids"]): b["sampling_params"]["seed"] for b in bodies[:2]} == {(1, 2): 5, (3,): 7}
    assert (
        bodies[0]["sampling_params"]["logprobs"] == 0
        and bodies[0]["sampling_params"]["include_stop_str_in_output"]
    )
    assert [p for p in fake.calls if p not in ("/init_weight_transfer_engine", "/inference/v1/generate")][
        :5
    ] == ["/pause", "/start_weight_update", "/update_weights", "/finish_weight_update", "/resume"]


# -- VLLMBackend: versions and threads ----------------------------------------------------------


class BlockingEngine:
    """A stand-in engine whose ``generate`` blocks until ``release`` is set; records the order
    of events. ``concurrent_updates`` as given."""

    supports_sleep = False

    def __init__(self, concurrent: bool):
        self.concurrent_updates = concurrent
        self.events: list[str] = []
        self.in_generate = threading.Event()
        self.release = threading.Event()
        self.version = None

    def load_weights(self, named, version=None):
        for _ in named:
            pass
        self.events.append(f"load_weights({version})")
        self.version = version

    def reset_prefix_cache(self):
        pass

    def generate(self, prompt_ids, params):
        self.events.append("generate:start")
        version = self.version
        self.in_generate.set()
        assert self.release.wait(10)
        self.events.append("generate:end")
        c = {"token_ids": [1], "text": "1", "finish_reason": "length", "logprobs": [-1.0]}
        if self.concurrent_updates:
            c["version"] = version  # an engine apart labels its own responses
        return [[dict(c) for _ in range(params.n)] for _ in prompt_ids]


@pytest.mark.parametrize("concurrent", [False, True], ids=["colocated", "apart"])
def test_a_push_from_another_thread_waits_for_generate_only_on_the_colocated_engine(concurrent):
    model, _ = _named()
    engine = BlockingEngine(concurrent)
    vllm = VLLMBackend(engine, tokenizer=None, sleep_level=0)
    vllm.update_weights(model, step=1)
    out: list[Rollout] = []
    producer = threading.Thread(target=lambda: out.append(vllm.generate([[1]], PARAMS)))
    producer.start()
    assert engine.in_generate.wait(10)
    trainer = threading.Thread(target=vllm.update_weights, args=(model, 2))
    trainer.start()
    trainer.join(timeout=2)
    pushed_during_generate = not trainer.is_alive()
    engine.release.set()
    producer.join(10)
    trainer.join(10)
    if concurrent:  # the engine takes the update while it generates
        assert pushed_during_generate
        assert engine.events == ["load_weights(1)", "generate:start", "load_weights(2)", "generate:end"]
    else:  # one in-process LLM: the push waits for the generate in progress
        assert not pushed_during_generate
        assert engine.events == ["load_weights(1)", "generate:start", "generate:end", "load_weights(2)"]
    assert out[0].policy_version == [1, 1]  # sampled by the weights of step 1 either way
    assert vllm.policy_version == 2


def test_policy_versions_survive_group_selection_and_concatenation():
    r = Rollout(prompt_ids=[[1], [2]], response_ids=[[5], [6], [7], [8]], response_text=list("abcd"),
                finish_reason=["stop"] * 4, policy_version=[3, 3, 4, 4])  # fmt: skip
    assert r.select_groups([1]).policy_version == [4, 4]
    assert Rollout.concat([r.select_groups([1]), r.select_groups([0])]).policy_version == [4, 4, 3, 3]
    with pytest.raises(ValueError, match="3 policy versions for 4 responses"):
        Rollout(prompt_ids=[[1]], response_ids=[[5]] * 4, response_text=["a"] * 4, finish_reason=["stop"] * 4,
                policy_version=[1, 2, 3])  # fmt: skip


def test_free_port_is_free():
    port = free_port()
    with socket.socket() as s:
        s.bind(("127.0.0.1", port))


# ---------------------------------------------------------------------------- the loop, a run


RUN = [
    "--preset",
    "tiny",
    "sft.steps=0",
    "eval_every=0",
    "checkpoint_every=0",
    "steps=3",
    "rollout.group_size=4",
    "rollout.batch_size=8",
    "train.micro_batch_size=8",
    "data.eval_subset_size=8",
    "logging.progress=false",
    "logging.sample_every=0",
    "rollout.backend=vllm",
    "rollout.placement=server",
    "rollout.weight_sync_tolerance=100",  # the FAKE server's log-probs are canned
]


def _misbehave_after_sync(monkeypatch, fake, at: int, behaviour: dict, before: bool = False):
    """The FAKE server starts ``behaviour`` as step ``at``'s weight sync begins (``before``) or
    once it returned. (A run attached to a server needs no vLLM here: the check that it is
    installed is lifted.)"""
    import dataclasses

    from grpo_fast.loop.state import RolloutSide
    from grpo_fast.rollout import registry

    spec = registry.backends()["vllm"]
    monkeypatch.setitem(registry.backends(), "vllm", dataclasses.replace(spec, missing=lambda: None))

    real = RolloutSide.sync_weights

    def planted(self, model, step):
        if step == at and before:
            fake.behaviour = dict(behaviour)
        real(self, model, step)
        if step == at and not before:
            fake.behaviour = dict(behaviour)

    monkeypatch.setattr(RolloutSide, "sync_weights", planted)


def _run_rows(out: Path) -> list[dict]:
    return [json.loads(ln) for ln in (out / "metrics.jsonl").read_text().splitlines() if ln.strip()]


def _last_err(capsys) -> str:
    lines = [ln for ln in capsys.readouterr().err.splitlines() if ln.strip()]
    return lines[-1]


def test_a_sync_that_hangs_mid_run_stops_with_the_step_s_checkpoint_and_the_resume_pushes_first(
    tmp_path, monkeypatch, capsys
):
    """The server stops answering step 2's weight sync: after rollout.sync_timeout the run stops
    with one line, step 2's row and checkpoint written (its optimizer step was taken); resumed
    against a healthy server it pushes step 2's weights before its first generation and trains
    step 3. Planted: the lockstep loop not catching ``EngineError`` at the sync → the line has no
    checkpoint and the resume starts over at step 1."""
    from grpo_fast.train import main

    with FakeVLLMServer() as fake:
        _misbehave_after_sync(monkeypatch, fake, 2, {"/update_weights": "hang"}, before=True)
        args = [*RUN, f"rollout.server_url={fake.url}", "rollout.sync_timeout=1.5", f"output_dir={tmp_path}"]
        t0 = time.monotonic()
        assert main(args) == 2
        assert time.monotonic() - t0 < 60
        where = tmp_path / "checkpoints" / "step_000002"
        err = _last_err(capsys)
        assert err.startswith("error: the weight sync of step 2 did not finish within 1.5 s"), err
        assert err.endswith(
            f"(during step 2's weight sync): checkpoint {where} of step 2 written; resume=true continues from there"
        ), err
        assert [r["step"] for r in _run_rows(tmp_path) if r["step"] >= 1] == [1, 2]
        assert (where / STATE_FILE).is_file()
        monkeypatch.undo()
        _misbehave_after_sync(monkeypatch, fake, 0, {})  # no vLLM check; no misbehaviour
        fake.behaviour, fake.calls[:] = {}, []
        assert main([*args, "resume=true"]) == 0
        generate = fake.calls.index("/inference/v1/generate")
        assert "/update_weights" in fake.calls[:generate]  # the resume re-synced before its first batch
        assert [r["step"] for r in _run_rows(tmp_path) if r["step"] >= 1] == [1, 2, 3]


def test_a_server_that_drops_step_2_s_rollout_stops_with_step_1_s_checkpoint(tmp_path, monkeypatch, capsys):
    """The server closes every generation request from step 2's rollout on (a dead server): the
    run stops at once with one line and step 1's checkpoint. Planted: ``stop_within`` not
    catching ``EngineError`` → no checkpoint named, none written."""
    from grpo_fast.train import main

    with FakeVLLMServer() as fake:
        _misbehave_after_sync(monkeypatch, fake, 1, {"/inference/v1/generate": "close"})
        args = [*RUN, f"rollout.server_url={fake.url}", f"output_dir={tmp_path}"]
        assert main(args) == 2
    where = tmp_path / "checkpoints" / "step_000001"
    err = _last_err(capsys)
    assert err.startswith("error: "), err
    assert err.endswith(
        f"(during step 2's rollout): checkpoint {where} of step 1 written; resume=true continues from there"
    ), err
    assert (where / STATE_FILE).is_file()
    assert [r["step"] for r in _run_rows(tmp_path) if r["step"] >= 1] == [1]


def test_an_evaluation_the_server_never_answers_stops_with_the_step_s_row_and_checkpoint(
    tmp_path, monkeypatch, capsys
):
    """Step 2's evaluation hangs on the server: after rollout.request_timeout the run stops with
    one line, step 2's row (without an evaluation) and its checkpoint. Planted: ``end_of_step``
    not catching ``EngineError`` → no row for step 2, no checkpoint."""
    from grpo_fast.train import main

    with FakeVLLMServer() as fake:
        _misbehave_after_sync(monkeypatch, fake, 2, {"/inference/v1/generate": "hang"})
        args = [*RUN, f"rollout.server_url={fake.url}", "eval_every=2", "rollout.request_timeout=1.5"]
        assert main([*args, f"output_dir={tmp_path}"]) == 2
    where = tmp_path / "checkpoints" / "step_000002"
    err = _last_err(capsys)
    assert "rollout.request_timeout" in err, err
    assert err.endswith(
        f"(during step 2's evaluation (the step's row has none)): checkpoint {where} of step 2 written; "
        "resume=true continues from there"
    ), err
    assert (where / STATE_FILE).is_file()
    rows = {r["step"]: r for r in _run_rows(tmp_path)}
    assert sorted(rows) == [0, 1, 2] and "eval/accuracy" in rows[0] and "eval/accuracy" not in rows[2]


def test_an_engine_that_fails_its_first_push_after_a_warm_start_keeps_the_warm_start(
    tmp_path, monkeypatch, capsys
):
    """The server never finishes the first weight sync (step 0's, as the engine starts) after a
    2-step warm start: the run stops with one line and the warm-started model as step 0's
    checkpoint. Planted: the engine's start outside ``stop_within`` → the warm start is lost."""
    from grpo_fast.train import main

    with FakeVLLMServer({"/update_weights": "hang"}) as fake:
        _misbehave_after_sync(monkeypatch, fake, -1, {})  # no vLLM check
        args = [*RUN, f"rollout.server_url={fake.url}", "rollout.sync_timeout=1.5", "sft.steps=2"]
        assert main([*args, f"output_dir={tmp_path}"]) == 2
    where = tmp_path / "checkpoints" / "step_000000"
    err = _last_err(capsys)
    assert err.startswith("error: the weight sync of step 0 did not finish within 1.5 s"), err
    assert err.endswith(
        f"(during the rollout engine's start): checkpoint {where} of step 0 (the warm-started model) "
        "written; resume=true continues from there"
    ), err
    assert (where / STATE_FILE).is_file()


def test_a_server_logs_at_info_even_after_an_in_process_engine_quieted_this_process(monkeypatch):
    """An in-process engine sets VLLM_LOGGING_LEVEL=WARNING for this process (its INFO lines each
    step); a server started later writes its own log file, at INFO (the configuration it started
    with, e.g. the weight-transfer backend), unless the user chose a level."""
    from grpo_fast.rollout.vllm.placement import shared

    monkeypatch.delenv("VLLM_LOGGING_LEVEL", raising=False)
    monkeypatch.setattr(shared, "_quieted_here", False)
    assert shared.apart_logging_level() == "INFO"
    shared.quiet_in_process_logging()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "WARNING"
    assert shared.apart_logging_level() == "INFO"
    monkeypatch.setattr(shared, "_quieted_here", False)  # a new process where the user set it
    monkeypatch.setenv("VLLM_LOGGING_LEVEL", "DEBUG")
    shared.quiet_in_process_logging()
    assert os.environ["VLLM_LOGGING_LEVEL"] == "DEBUG" and shared.apart_logging_level() == "DEBUG"


# ---------------------------------------------------------------------------- staleness: the pipeline


STALE = ["rollout.max_staleness=1", "rollout.old_logprobs=sampler", "steps=5"]


def _count_generations(monkeypatch) -> list[int]:
    """The policy version each generation on the engine started with (``VLLMBackend.generate``)."""
    versions: list[int] = []
    real = VLLMBackend.generate

    def counted(self, prompt_ids, params, progress=None):
        versions.append(self.policy_version)
        return real(self, prompt_ids, params, progress=progress)

    monkeypatch.setattr(VLLMBackend, "generate", counted)
    return versions


def _after_load(monkeypatch, version: int, then):
    """``then()`` once the pipeline's producer has loaded policy version ``version`` into the
    engine; returns the real ``VLLMBackend.load_weights``."""
    real = VLLMBackend.load_weights

    def loaded(self, staged, v):
        real(self, staged, v)
        if v == version:
            then()

    monkeypatch.setattr(VLLMBackend, "load_weights", loaded)
    return real


def test_staleness_one_on_a_server_samples_each_step_from_the_weights_two_steps_before(tmp_path, monkeypatch):
    """``rollout.max_staleness=1`` with the server: the producer loads each job's policy version
    into the engine before it generates (step j from version j − 2, step 1 and 2 from the start),
    the responses carry the version the server labels them with, and the run's lag is the bound;
    the evaluations generate with the trainer's model, not the engine (which serves an older
    policy): the server sees only the five batches. Planted: the producer loading the newest
    staged version → lag 0; evaluations on the engine → seven generations."""
    from grpo_fast.train import main

    with FakeVLLMServer() as fake:
        _misbehave_after_sync(monkeypatch, fake, -1, {})  # no vLLM check
        versions = _count_generations(monkeypatch)
        args = [*RUN, *STALE, f"rollout.server_url={fake.url}", "eval_every=2", f"output_dir={tmp_path}"]
        assert main(args) == 0
    rows = {r["step"]: r for r in _run_rows(tmp_path)}
    assert versions[0] == 0  # step 0's evaluation, before the pipeline: the engine
    assert versions[1:] == [0, 0, 1, 2, 3]  # steps 1-5, each from need(j) = max(j - 2, 0)
    assert [rows[s]["rollout/policy_lag"] for s in range(1, 6)] == [0.0, 1.0, 1.0, 1.0, 1.0]
    assert all("eval/accuracy" in rows[s] for s in (0, 2, 4, 5))
    assert all(rows[s]["time/weight_load_s"] >= 0 for s in range(1, 6))


def test_a_server_that_dies_under_the_pipeline_stops_with_one_line_and_the_resume_continues(
    tmp_path, monkeypatch, capsys
):
    """The server drops every generation once the producer has loaded version 2 (step 4's batch,
    made while step 3 trains): the run stops with one line and step 3's checkpoint, holding the
    in-flight job; resumed against a healthy server it pushes version 2 before its first batch
    and trains steps 4-5 at the bound. Planted: the producer's error not reaching the trainer →
    the run waits for the batch until request_timeout (the test's 60 s bound fails)."""
    from grpo_fast.train import main

    with FakeVLLMServer() as fake:
        _misbehave_after_sync(monkeypatch, fake, -1, {})
        real = _after_load(
            monkeypatch, 2, lambda: setattr(fake, "behaviour", {"/inference/v1/generate": "close"})
        )
        args = [
            *RUN,
            *STALE,
            f"rollout.server_url={fake.url}",
            "checkpoint_every=100",
            f"output_dir={tmp_path}",
        ]
        t0 = time.monotonic()
        assert main(args) == 2
        assert time.monotonic() - t0 < 60
        where = tmp_path / "checkpoints" / "step_000003"
        err = _last_err(capsys)
        assert err.startswith("error: "), err
        assert err.endswith(
            f"(during step 4's rollout): checkpoint {where} of step 3 written; resume=true continues from there"
        ), err
        assert [r["step"] for r in _run_rows(tmp_path) if r["step"] >= 1] == [1, 2, 3]
        monkeypatch.setattr(VLLMBackend, "load_weights", real)
        fake.behaviour, fake.calls[:] = {}, []
        assert main([*args, "resume=true"]) == 0
        generate = fake.calls.index("/inference/v1/generate")
        assert "/update_weights" in fake.calls[:generate]  # version 2 pushed before step 4's batch
    rows = {r["step"]: r for r in _run_rows(tmp_path) if r["step"] >= 1}
    assert sorted(rows) == [1, 2, 3, 4, 5]
    assert [rows[s]["rollout/policy_lag"] for s in (4, 5)] == [1.0, 1.0]


def test_a_signal_while_the_server_hangs_a_staleness_batch_stops_within_seconds(
    tmp_path, monkeypatch, capsys
):
    """SIGTERM while the producer waits on a server that never answers step 3's generation (its
    limit, rollout.request_timeout, is 10 minutes): the run stops within seconds with one line
    and a checkpoint, the producer left behind (it ends with the process). Planted: the
    pipeline's close waiting for the producer without a bound → the run waits out the request."""
    import signal

    from grpo_fast.train import main

    with FakeVLLMServer() as fake:
        _misbehave_after_sync(monkeypatch, fake, -1, {})

        def hang_then_signal():  # step 3's batch (version 1) hangs; SIGTERM a second later
            fake.behaviour = {"/inference/v1/generate": "hang"}
            threading.Timer(1.0, os.kill, (os.getpid(), signal.SIGTERM)).start()

        _after_load(monkeypatch, 1, hang_then_signal)
        args = [*RUN, *STALE, f"rollout.server_url={fake.url}", "rollout.request_timeout=600"]
        t0 = time.monotonic()
        assert main([*args, f"output_dir={tmp_path}"]) == 128 + signal.SIGTERM
        assert time.monotonic() - t0 < 60
    err = _last_err(capsys)
    assert err.startswith("error: SIGTERM during "), err
    assert err.endswith("resume=true continues from there"), err
    assert any((d / STATE_FILE).is_file() for d in (tmp_path / "checkpoints").iterdir())


def test_each_engine_of_a_fleet_the_run_starts_gets_its_own_devices_log_and_port(tmp_path, monkeypatch):
    """``rollout.engine_devices=[[1], [2, 3]]`` with ``rollout.num_engines=2``: engine 1's server
    runs tensor parallel on GPUs 2 and 3, logs to ``vllm_server.1.log``; engine 0 on GPU 1. On a
    CPU each engine's OpenMP threads get cores of their own, servers and engine processes alike.
    Planted: every engine given the first list → engine 1 starts on GPU 1; the engine processes
    started without ``cpus`` → unbound."""
    import grpo_fast.rollout.vllm.placement.server as vs
    from grpo_fast.rollout.vllm.placement.apart import engine_apart

    started = []

    class Started(Exception):
        pass

    def start_server(command, port, log_path, timeouts, lora=False, devices=None, cpus=None):
        started.append((command, log_path, devices))
        bound.append(cpus)
        raise Started

    bound: list = []
    monkeypatch.delenv("VLLM_CPU_OMP_THREADS_BIND", raising=False)

    monkeypatch.setattr(vs, "start_server", start_server)
    cfg = load_config(
        "tiny",
        overrides=["rollout.backend=vllm", "rollout.placement=server", "rollout.num_engines=2",
                   "rollout.engine_devices=[[1],[2,3]]", f"output_dir={tmp_path}"],
        check_device=False,
    )  # fmt: skip
    for i in (0, 1):
        with pytest.raises(Started):
            engine_apart(cfg, "/m", "float32", 0, index=i)
    (cmd0, log0, dev0), (cmd1, log1, dev1) = started
    assert (dev0, dev1) == ([1], [2, 3]) and (log0.name, log1.name) == (
        "vllm_server.0.log",
        "vllm_server.1.log",
    )
    tp = [c[c.index("--tensor-parallel-size") + 1] for c in (cmd0, cmd1)]
    assert tp == ["1", "2"]
    assert cmd0[cmd0.index("--port") + 1] != cmd1[cmd1.index("--port") + 1]
    # on a CPU each server's OpenMP threads get their own cores (2 cores: "0" and "1")
    mine = sorted(os.sched_getaffinity(0))
    if len(mine) >= 2 and not torch.cuda.is_available():
        parts = [set(map(int, b.split(","))) for b in bound]
        assert not parts[0] & parts[1] and parts[0] | parts[1] == set(mine), bound
        import grpo_fast.rollout.vllm.placement.process as vp

        def engine_process(path, **kwargs):
            bound.append(kwargs["cpus"])
            raise Started

        monkeypatch.setattr(vp, "ProcessEngine", engine_process)
        cfg = load_config("tiny", overrides=["rollout.backend=vllm", "rollout.placement=process",
                                             "rollout.num_engines=2", f"output_dir={tmp_path}"], check_device=False)  # fmt: skip
        for i in (0, 1):
            with pytest.raises(Started):
                engine_apart(cfg, "/m", "float32", 0, index=i)
        assert bound[2:] == bound[:2], bound  # the same cores as the servers'
