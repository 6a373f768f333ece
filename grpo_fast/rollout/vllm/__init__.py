"""The ``vllm`` rollout backend: ``VLLMBackend`` drives a vLLM engine wherever it runs.

- ``backend.py``: ``VLLMBackend`` (weight push and probe, sleep/wake, outputs → ``Rollout``),
  how one is built from the config, and the backend's ``BACKEND`` declaration;
- ``placement/``: where the engine runs (``rollout.placement``), one module each: ``colocated``
  (``VLLMEngine``, in the trainer's process), ``process`` (a child process), ``server`` (a vLLM
  server, also one server for every torchrun rank: ``apart``, ``ranks``), and the ``Engine``
  boundary they all meet;
- ``transfer/``: how the trainer's weights reach an engine: what a push sends and the weight-sync
  probe (``weights``), the in-place reload (``reload``), the transports to an engine apart from
  the trainer (``transport``) and their side inside vLLM's workers (``_worker``);
- ``deadline.py``: the limits every wait on an engine apart from the trainer runs under.

The names below are the package's: the loop, the tests and the benchmarks import them here. The
backend registry (``grpo_fast.rollout.registry``) finds ``BACKEND`` here; importing the package
does not import vLLM.
"""

from __future__ import annotations

from grpo_fast.errors import EngineDied, EngineError, EngineTimeout
from grpo_fast.rollout.vllm.backend import BACKEND, VLLM_MANAGED_ARGS, VLLMBackend, WeightSyncError, turn_seed
from grpo_fast.rollout.vllm.placement import Engine
from grpo_fast.rollout.vllm.placement.colocated import VLLMEngine
from grpo_fast.rollout.vllm.transfer.weights import (
    WEIGHT_SYNC_TOLERANCE,
    WeightSyncProbe,
    dequantized_base_tensors,
    hf_named_tensors,
    host_copies,
    is_sharded,
    merged_named_tensors,
    tied_names,
    vllm_dtype,
    weight_sync_tolerance,
)

__all__ = [
    "BACKEND",
    "VLLM_MANAGED_ARGS",
    "WEIGHT_SYNC_TOLERANCE",
    "Engine",
    "EngineDied",
    "EngineError",
    "EngineTimeout",
    "VLLMBackend",
    "VLLMEngine",
    "WeightSyncError",
    "WeightSyncProbe",
    "dequantized_base_tensors",
    "hf_named_tensors",
    "host_copies",
    "is_sharded",
    "merged_named_tensors",
    "tied_names",
    "turn_seed",
    "vllm_dtype",
    "weight_sync_tolerance",
]
