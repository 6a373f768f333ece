"""The ``hf`` rollout backend: transformers decoding, on the training model or on weights of its own.

- ``decoder.py``: ``HFBackend``, the training model itself decodes (no second copy, nothing to
  push; ``decode``, ``decode_turns``, ``sample_next``), and the backend's ``BACKEND`` declaration;
- ``copied.py``: ``HFCopyBackend``, the decoder on a copy of the policy in the training process
  (``rollout.max_staleness > 0``: a producer thread samples while the trainer steps), and what a
  policy version is for a decoder with weights of its own (``trainable_tensors``);
- ``process.py``: ``HFProcessBackend``, the decoder in a worker process with its own weights and
  threads (``rollout.placement=process``).

The backend registry (``grpo_fast.rollout.registry``) finds ``BACKEND`` here.
"""

from __future__ import annotations

from grpo_fast.rollout.hf.copied import HFCopyBackend
from grpo_fast.rollout.hf.decoder import BACKEND, STOP_WINDOW, HFBackend, decode, decode_turns, sample_next
from grpo_fast.rollout.hf.process import HFProcessBackend

__all__ = [
    "BACKEND",
    "STOP_WINDOW",
    "HFBackend",
    "HFCopyBackend",
    "HFProcessBackend",
    "decode",
    "decode_turns",
    "sample_next",
]
