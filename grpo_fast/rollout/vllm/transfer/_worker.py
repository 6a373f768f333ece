"""The inference side of the shared-memory weight transfer: runs inside vLLM's worker processes.

A vLLM engine apart from the trainer (``rollout.placement=process`` or ``server``) is started
with ``weight_transfer_config={"backend": "grpo_fast_shm"}`` and
``worker_extension_cls="grpo_fast.rollout.vllm.transfer._worker.WorkerExtension"``
(``transport.WORKER_EXTENSION``). vLLM imports this module in every worker before it builds the
model's weight-transfer engine, so importing it registers ``ShmWeightTransferEngine`` with vLLM's
``WeightTransferEngineFactory``. The engine then takes vLLM's native weight-sync calls
(``init_weight_transfer_engine``, ``start_weight_update``, ``update_weights``,
``finish_weight_update``: from ``AsyncLLM``, or over HTTP from a server run with
``VLLM_SERVER_DEV_MODE=1``):

- ``update_weights({"path": FILE})``: FILE is a safetensors file the trainer wrote into
  ``/dev/shm`` (``transport.ShmTransport``); its tensors, under Hugging Face names, are loaded
  with vLLM's layerwise reload (``reload.WeightReload``, which also repacks a tied ``lm_head``
  on CPU). A sync may send several files, one per chunk.
- ``start_weight_update`` / ``finish_weight_update``: open and close the layerwise reload.

Why a transport of our own: vLLM 0.32's transports (``nccl``, ``ipc``, ``sparse_nccl``,
``nccl_m2n``, ``sharded_rdt``) all need CUDA (or Ray + NIXL); on a CPU none runs. Files in RAM
work on every platform (GPU too, at the cost of a copy through host memory).

A private module (leading underscore): it imports vLLM at the top, so nothing in grpo_fast
imports it (the backend registry imports the ``grpo_fast.rollout.vllm`` package, which leaves
it out); vLLM's workers import it by name.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

from vllm.distributed.weight_transfer import WeightTransferEngineFactory
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from grpo_fast.rollout.vllm.transfer.reload import WeightReload
from grpo_fast.rollout.vllm.transfer.transport import SHM_BACKEND


@dataclass
class ShmInitInfo(WeightTransferInitInfo):
    """Nothing to rendezvous: the files carry everything."""


@dataclass
class ShmUpdateInfo(WeightTransferUpdateInfo):
    """One chunk: the safetensors file to load (written by the trainer, deleted by it after)."""

    path: str

    def __post_init__(self) -> None:
        if not os.path.isfile(self.path):
            raise ValueError(f"grpo_fast_shm: no weight file {self.path}")


class ShmWeightTransferEngine(WeightTransferEngine[ShmInitInfo, ShmUpdateInfo]):
    """vLLM's worker-side ``WeightTransferEngine`` for weights in shared-memory files."""

    init_info_cls = ShmInitInfo
    update_info_cls = ShmUpdateInfo

    def init_transfer_engine(self, init_info: ShmInitInfo) -> None:
        self._reload: WeightReload | None = None

    def start_weight_update(self) -> None:
        self._reload = WeightReload(self.model, self.model_config)
        self._reload.begin()

    def update_weights(self, update_info: dict) -> None:
        # vLLM's default ends with torch.accelerator.synchronize() for its asynchronous
        # transports; this one loads synchronously, on a CPU too (where there is no accelerator).
        self.receive_weights(self.parse_update_info(update_info))

    def receive_weights(self, update_info: ShmUpdateInfo) -> None:
        from safetensors import safe_open

        if getattr(self, "_reload", None) is None:
            raise RuntimeError("grpo_fast_shm: update_weights before start_weight_update")
        with safe_open(update_info.path, framework="pt", device="cpu") as f:
            # one tensor at a time: the layerwise reload copies each into its layer
            self._reload.load((name, f.get_tensor(name)) for name in f.keys())  # noqa: SIM118 (safe_open is not iterable)

    def finish_weight_update(self) -> None:
        if getattr(self, "_reload", None) is None:
            raise RuntimeError("grpo_fast_shm: finish_weight_update before start_weight_update")
        self._reload.finish()
        self._reload = None

    def shutdown(self) -> None:
        self._reload = None


class WorkerExtension:
    """Mixed into vLLM's worker class (``worker_extension_cls``); importing its module is what
    registers the engine. ``grpo_fast_worker_pid`` names the process that holds the model (for
    ``collective_rpc``: the tests kill it to check that a dead engine stops the run)."""

    def grpo_fast_worker_pid(self) -> int:
        return os.getpid()


with contextlib.suppress(ValueError):  # "already registered": this process imported it before
    WeightTransferEngineFactory.register_engine(SHM_BACKEND, ShmWeightTransferEngine)
