"""The trainer side of a weight sync into a vLLM engine apart from the trainer, through vLLM's
native weight-transfer API.

A sync is vLLM's handshake, driven through a *control* (``ProcessEngine``: ``AsyncLLM`` calls;
``ServerEngine``: the HTTP routes of a server run with ``VLLM_SERVER_DEV_MODE=1``)::

    pause(mode="keep")  →  start_weight_update  →  update_weights(chunk) × k
        →  finish_weight_update(weight_version=str(step))  →  resume

``pause(keep)`` freezes the requests in flight (vLLM preempts them and recomputes their KV
cache with the new weights on resume), so a push does not wait for the generation in progress.

Transports (``rollout.weight_transfer``):

- ``shm`` (``ShmTransport``): each chunk a safetensors file in a private folder of
  ``/dev/shm``, loaded by ``grpo_fast.rollout.vllm.transfer._worker.ShmWeightTransferEngine`` inside the
  engine's workers (so the engine must run on this machine). Works on CPU and GPU. One engine:
  each chunk written, loaded, deleted. Several (a fleet): the version written once
  (``StagedShm``), every engine's transport loading the same files.
- ``nccl`` (``NCCLTransport``): vLLM's own NCCL engines (``WeightTransferTrainerFactory``), a
  broadcast from this process's GPU to the engine's GPUs. Written against vLLM 0.32's API; it
  cannot run on a CPU, so no test here runs it (``tools/gpu_check.sh`` does, on a GPU machine).

Each wait has a deadline (``grpo_fast.rollout.vllm.deadline``): a wait that outlives it raises
``EngineTimeout`` naming what it waited for and for how long.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import socket
import tempfile
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any, Protocol

import torch

from grpo_fast.rollout.vllm.deadline import Deadline

SHM_BACKEND = "grpo_fast_shm"  # grpo_fast.rollout.vllm.transfer._worker registers its engine under this name
WORKER_EXTENSION = "grpo_fast.rollout.vllm.transfer._worker.WorkerExtension"
CHUNK_BYTES = 256 * 2**20  # one safetensors file per 256 MiB: /dev/shm holds one chunk at a time


def bounded(fn: Callable[[], Any], deadline: Deadline, doing: str) -> Any:
    """``fn()`` in a daemon thread, waited for until ``deadline``: its result, its exception, or
    ``EngineTimeout``. For a call with no timeout of its own (an NCCL broadcast or rendezvous);
    on a timeout the thread is left behind (the run stops)."""
    box: dict[str, Any] = {}

    def target() -> None:
        try:
            box["result"] = fn()
        except BaseException as e:  # handed to the caller's thread
            box["error"] = e

    thread = threading.Thread(target=target, name=f"grpo_fast: {doing}", daemon=True)
    thread.start()
    thread.join(deadline.left(doing))
    if thread.is_alive():
        raise deadline.expired(doing)
    if "error" in box:
        raise box["error"]
    return box.get("result")


class Control(Protocol):
    """vLLM's weight-sync control plane (its ``VLLMWeightSyncClient`` methods, plus pause and
    resume), each call bounded by ``deadline``."""

    def init_weight_transfer_engine(self, init_info: dict, deadline: Deadline) -> None: ...

    def pause(self, deadline: Deadline) -> None: ...

    def resume(self, deadline: Deadline) -> None: ...

    def start_weight_update(self, deadline: Deadline) -> None: ...

    def update_weights(self, update_info: dict, deadline: Deadline) -> None: ...

    def finish_weight_update(self, weight_version: str | None, deadline: Deadline) -> None: ...

    def update_weight_version(self, weight_version: str, deadline: Deadline) -> None: ...


def unique_tensors(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """``named`` without the names whose tensor is one already seen (a tied ``lm_head.weight``):
    what a safetensors file can hold. vLLM loads the first name into the shared weight. The
    tensors seen are held until the end: a temporary (a gathered or merged tensor) freed earlier
    would leave its address to the next one, which would then be dropped as its alias."""
    seen: dict[tuple, torch.Tensor] = {}
    for name, t in named:
        key = _alias_key(t)
        if t.numel() and key in seen:
            continue
        seen[key] = t
        yield name, t


def _alias_key(t: torch.Tensor) -> tuple:
    return (t.untyped_storage().data_ptr(), t.storage_offset(), tuple(t.shape), tuple(t.stride()), t.dtype)


def private_dir(prefix: str) -> Path:
    """A new private folder in ``/dev/shm`` (RAM; a temporary folder where there is none), named
    ``<prefix><pid namespace>-<pid>_…``. First, the folders of ``prefix`` that a process of this
    PID namespace left behind and that is gone (a run killed before it could delete its own: a
    staged version is the model's size) are deleted; another namespace's (a container sharing
    ``/dev/shm``) are never touched, since their processes cannot be seen from here."""
    shm = Path("/dev/shm")
    root = shm if shm.is_dir() else Path(tempfile.gettempdir())
    ns = _pid_namespace()
    if ns is not None:
        for old in root.glob(f"{prefix}{ns}-*_*"):
            pid = old.name[len(f"{prefix}{ns}-") :].split("_", 1)[0]
            if pid.isdigit() and not _alive(int(pid)):
                shutil.rmtree(old, ignore_errors=True)
    return Path(tempfile.mkdtemp(prefix=f"{prefix}{ns or 0}-{os.getpid()}_", dir=root))


def _pid_namespace() -> str | None:
    """This process's PID namespace (the inode of ``/proc/self/ns/pid``), None where unreadable."""
    try:
        return str(os.stat("/proc/self/ns/pid").st_ino)
    except OSError:
        return None


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's
        return True
    return True


def chunks(
    named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES
) -> Iterator[dict[str, torch.Tensor]]:
    """``named`` on the host in ``dtype``, in files' worth of at most ``chunk_bytes`` (one tensor
    over it: a file of its own); in a file, a tensor that is one already there (a tied head) is
    left out, as safetensors requires. The sources of a file's tensors are held until it is sent
    (a gathered or merged temporary freed earlier would leave its address to the next one:
    ``unique_tensors``); a tied pair split over two files is sent twice, which loads the same
    values."""
    chunk: dict[str, torch.Tensor] = {}
    sources: dict[tuple, torch.Tensor] = {}
    size = 0
    for name, t in named:
        key = _alias_key(t)
        if t.numel() and key in sources:
            continue
        sources[key] = t
        t = t.detach().to("cpu", dtype).contiguous()
        chunk[name] = t
        size += t.numel() * t.element_size()
        if size >= chunk_bytes:
            yield chunk
            chunk, sources, size = {}, {}, 0
    if chunk:
        yield chunk


class StagedShm:
    """One version's tensors written once into a private folder of ``/dev/shm``: the chunk files
    ``ShmTransport`` sends (``chunks``: at most ``chunk_bytes`` each, in ``dtype``), for several
    engines to load. ``ShmTransport.send`` of it loads these files as they are, writing and
    deleting nothing, so a fleet of N engines (``grpo_fast.rollout.vllm.fleet``) and its restarts
    cost one write a version, not N. Iterating it gives the ``(name, tensor)`` pairs back, read
    from the files (what an engine without the transport loads). The files go with ``close()``
    (or the object); ``nbytes``: their size, the version's in ``dtype``."""

    def __init__(
        self, named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES
    ):
        from safetensors.torch import save_file

        self.dir = private_dir("grpo_fast_staged_")
        self._remove = weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.dtype = dtype
        self.files: list[Path] = []
        try:
            for i, chunk in enumerate(chunks(named, dtype, chunk_bytes)):
                self.files.append(self.dir / f"{i:04d}.safetensors")
                save_file(chunk, str(self.files[-1]))
        except BaseException:
            self.close()
            raise
        self.nbytes = sum(f.stat().st_size for f in self.files)

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        from safetensors import safe_open

        for path in self.files:
            with safe_open(str(path), framework="pt", device="cpu") as f:
                for name in f.keys():  # noqa: SIM118 (safe_open is not iterable)
                    yield name, f.get_tensor(name)

    def close(self) -> None:
        self._remove()


class ShmTransport:
    """Weights as safetensors files in a private folder of ``/dev/shm`` (a temporary folder
    where there is none), at most ``chunk_bytes`` each, in the engine's ``dtype``; each file is
    deleted once the engine has loaded it (``update_weights`` returns after the load). A
    ``StagedShm`` is loaded from its own files, kept for the next engine."""

    backend = SHM_BACKEND

    def __init__(self, dtype: torch.dtype, chunk_bytes: int = CHUNK_BYTES):
        self.dir = private_dir("grpo_fast_weights_")
        weakref.finalize(self, shutil.rmtree, str(self.dir), True)
        self.dtype = dtype
        self.chunk_bytes = int(chunk_bytes)
        self.bytes_sent = 0  # of the latest sync

    def init_info(self) -> dict:
        return {}

    def chunks(self, named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[dict[str, torch.Tensor]]:
        """``chunks(named, self.dtype, self.chunk_bytes)``: what one file of a sync holds."""
        return chunks(named, self.dtype, self.chunk_bytes)

    def send(
        self,
        control: Control,
        named: Iterable[tuple[str, torch.Tensor]] | StagedShm,
        version: str,
        deadline: Deadline,
    ) -> None:
        from safetensors.torch import save_file

        if isinstance(named, StagedShm):
            self._send_staged(control, named, version, deadline)
            return
        control.start_weight_update(deadline)
        self.bytes_sent = 0
        for i, chunk in enumerate(self.chunks(named)):
            path = self.dir / f"v{version}_{i:04d}.safetensors"
            save_file(chunk, str(path))
            self.bytes_sent += path.stat().st_size
            try:
                control.update_weights({"path": str(path)}, deadline)
            finally:
                path.unlink(missing_ok=True)
        control.finish_weight_update(version, deadline)

    def _send_staged(self, control: Control, staged: StagedShm, version: str, deadline: Deadline) -> None:
        if staged.dtype != self.dtype:  # a fleet's engines all serve in one dtype
            raise ValueError(f"weights staged in {staged.dtype} for an engine that serves in {self.dtype}")
        control.start_weight_update(deadline)
        for path in staged.files:
            control.update_weights({"path": str(path)}, deadline)
        self.bytes_sent = staged.nbytes
        control.finish_weight_update(version, deadline)

    def close(self) -> None:
        shutil.rmtree(self.dir, ignore_errors=True)


class NCCLTransport:
    """vLLM's dense NCCL weight transfer (``nccl_engine.NCCLTrainerWeightTransferEngine``): this
    process's GPU is rank 0 of a group with the engine's ``engine_ranks`` workers, rendezvous over
    TCP at ``address`` on a free port; each sync broadcasts the tensors. GPU only (vLLM 0.32 API,
    not run in CI: ``tools/gpu_check.sh``). The rendezvous and each broadcast run under the
    deadline (an NCCL call has no timeout of its own: ``bounded``)."""

    backend = "nccl"

    def __init__(self, control: Control, engine_ranks: int, address: str, deadline: Deadline):
        from vllm.distributed.weight_transfer import WeightTransferTrainerFactory
        from vllm.distributed.weight_transfer.nccl_engine import NCCLTrainerInitInfo

        self.control = control
        self._source = _ListSource()
        info = NCCLTrainerInitInfo(
            master_address=address, master_port=free_port(address), world_size=1 + engine_ranks, rank=0
        )
        client = _BoundClient(control, deadline)
        self.engine = bounded(
            lambda: WeightTransferTrainerFactory.trainer_init(info, client=client, source=self._source),
            deadline,
            "the NCCL rendezvous with the engine",
        )
        self.bytes_sent = 0

    def init_info(self) -> None:
        return None  # the rendezvous above sent it

    def send(
        self, control: Control, named: Iterable[tuple[str, torch.Tensor]], version: str, deadline: Deadline
    ) -> None:
        self._source.items = [(n, t.detach()) for n, t in named]
        self.engine.client = _BoundClient(control, deadline)
        try:
            bounded(self.engine.send_weights, deadline, "the NCCL broadcast of the weights")
        finally:
            self.bytes_sent = sum(t.numel() * t.element_size() for _, t in self._source.items)
            self._source.items = []
        control.update_weight_version(version, deadline)  # send_weights finished the update unlabelled

    def close(self) -> None:
        self.engine.shutdown()


class _BoundClient:
    """vLLM's ``VLLMWeightSyncClient`` over a ``Control`` and one deadline."""

    def __init__(self, control: Control, deadline: Deadline):
        self.control, self.deadline = control, deadline

    def init_weight_transfer_engine(self, init_info: dict) -> None:
        self.control.init_weight_transfer_engine(init_info, self.deadline)

    def start_weight_update(self) -> None:
        self.control.start_weight_update(self.deadline)

    def update_weights(self, update_info: dict) -> None:
        self.control.update_weights(update_info, self.deadline)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.control.finish_weight_update(weight_version, self.deadline)


class _ListSource:
    """A vLLM ``WeightSource`` over the (name, tensor) pairs of the sync in progress."""

    def __init__(self):
        self.items: list[tuple[str, torch.Tensor]] = []

    def metadata(self):
        from vllm.distributed.weight_transfer.base import ParamMeta

        return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.items]

    def __iter__(self):
        return iter(list(self.items))


def nccl_address(url: str) -> str:
    """This machine's address as seen from the server at ``url``: 127.0.0.1 for a local one,
    else the address of the interface that routes to it (no packet is sent)."""
    host = url.split("://", 1)[-1].rsplit(":", 1)[0].strip("[]")
    if host in ("127.0.0.1", "localhost", "::1"):
        return "127.0.0.1"
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect((socket.gethostbyname(host), 9))
        return s.getsockname()[0]


def free_port(host: str = "127.0.0.1") -> int:
    """A TCP port nothing listens on at ``host`` now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def sync(
    control: Control, transport, named: Iterable[tuple[str, torch.Tensor]], version: int, deadline: Deadline
) -> None:
    """One weight sync (the module docstring's sequence). A failed one still tries to resume the
    engine (for at most 10 s), then raises its own error."""
    control.pause(deadline)
    try:
        transport.send(control, named, str(version), deadline)
    except BaseException:
        with contextlib.suppress(Exception):
            control.resume(Deadline(10.0, "resuming the vLLM engine after a failed sync", deadline.key))
        raise
    control.resume(deadline)


def make_transport(
    name: str, control: Control, dtype: str, engine_ranks: int, deadline: Deadline, address: str
):
    """The trainer's side of ``rollout.weight_transfer`` (``shm`` | ``nccl``) for an engine that
    serves in ``dtype`` with ``engine_ranks`` workers, initialized with the engine (vLLM's
    ``init_weight_transfer_engine``: a check, for ``shm``, that the engine has the transport).
    ``address``: where the engine reaches this process (the NCCL rendezvous)."""
    if name == "nccl":
        return NCCLTransport(control, engine_ranks, address, deadline)
    transport = ShmTransport(getattr(torch, dtype))
    control.init_weight_transfer_engine(transport.init_info(), deadline)
    return transport


class SyncedApart:
    """``load_weights`` of an engine the trainer reaches through a control plane and a
    ``transport`` (``ProcessEngine``, ``ServerEngine``): one ``sync`` under ``rollout.sync_timeout``,
    then ``version`` labels what it samples. Needs ``self.timeouts``, ``self.transport``."""

    def sync_deadline(self, what: str, version: int) -> Deadline:
        """The bound of one weight or adapter push (``what``: ``"weight"``, ``"adapter"``)."""
        return Deadline(self.timeouts.sync, f"the {what} sync of step {version}", "rollout.sync_timeout")

    def load_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int | None = None
    ) -> None:
        version = 0 if version is None else version
        sync(self, self.transport, named_tensors, version, self.sync_deadline("weight", version))
        self.version = version
