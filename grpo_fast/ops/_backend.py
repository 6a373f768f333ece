"""Backend choice and argument checks shared by the public ops of ``grpo_fast.ops``.

Three backends compute the same per-row quantities:

- ``triton``: ``csrc_triton/token_logprobs.py``, on CUDA, or on CPU under the Triton interpreter
  (``TRITON_INTERPRET=1`` set before ``csrc_triton`` is imported: the tests do this).
- ``torch_chunked``: the same algorithm in plain PyTorch on any device
  (``grpo_fast/ops/_torch_chunked.py``); extra memory is a few 4 MiB tiles, never ``[N, V]``.
- ``eager``: the ``grpo_fast.algo.core`` reference, which materializes ``[N, V]`` in fp32.

``auto`` is ``triton`` on CUDA and ``torch_chunked`` elsewhere, decided per call from the tensors'
device, never at import. Both kernel backends expose ``token_logprobs_fwd`` / ``token_logprobs_bwd``
with one signature; ``kernels_for`` returns the module.

The checks here run only in the public functions, once per call, before any kernel (the loss
options check themselves when a ``LossOptions`` is built).
"""

from __future__ import annotations

import math
import os
from types import ModuleType

import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.token_loss import check_sequence_ids_given

__all__ = [
    "BACKENDS",
    "check_backend",
    "check_dtype",
    "check_label_range",
    "check_per_token",
    "check_sequence_ids",
    "check_temperature",
    "check_truncation",
    "kernels_for",
    "triton_unavailable",
]

BACKENDS = ("auto", "triton", "torch_chunked", "eager")
KERNEL_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def check_backend(backend: str, device: torch.device) -> str:
    """Validate a backend name for tensors on ``device``; returns the resolved name (never ``auto``)."""
    if backend not in BACKENDS:
        raise ValueError(f"unknown backend {backend!r}; expected one of {', '.join(BACKENDS)}")
    if backend == "auto":
        return "triton" if device.type == "cuda" else "torch_chunked"
    if backend == "triton" and (why_not := triton_unavailable(device.type)) is not None:
        raise ValueError(f"backend='triton' {why_not}; got tensors on {device}")
    return backend


def triton_unavailable(device_type: str) -> str | None:
    """Why the Triton kernels cannot run on ``device_type`` (``"cuda"``, ``"cpu"``, ...), or None:
    they need CUDA, or the interpreter (``TRITON_INTERPRET=1`` set before triton is imported)."""
    if device_type == "cuda" or os.environ.get("TRITON_INTERPRET") == "1":
        return None
    return (
        "needs CUDA tensors, or TRITON_INTERPRET=1 set before triton is imported to run under the interpreter"
    )


def kernels_for(backend: str) -> ModuleType:
    """The module with ``token_logprobs_fwd`` / ``token_logprobs_bwd`` for ``triton`` or ``torch_chunked``."""
    if backend == "triton":
        from csrc_triton import token_logprobs  # imports triton, so only when asked for

        return token_logprobs
    from grpo_fast.ops import _torch_chunked

    return _torch_chunked


def check_dtype(name: str, dtype: torch.dtype, backend: str) -> None:
    """``ValueError`` unless ``backend`` computes in ``dtype`` (fp32/bf16/fp16, and fp64 for eager)."""
    allowed = (*KERNEL_DTYPES, torch.float64) if backend == "eager" else KERNEL_DTYPES
    if dtype not in allowed:
        raise ValueError(
            f"{name} dtype {dtype} is not supported by backend={backend!r}; "
            f"expected one of {', '.join(str(d) for d in allowed)}"
        )


def check_per_token(
    matrix_name: str,
    matrix: torch.Tensor,
    labels: torch.Tensor,
    backend: str,
    **vectors: torch.Tensor | None,
) -> None:
    """Check a ``[N, V]`` (or ``[N, D]``) matrix, ``labels [N]`` and optional float ``[N]`` vectors.

    Shapes, dtypes and devices must agree; ``ValueError`` names the argument at fault. The label
    range is checked against ``V`` by the caller (``check_label_range``).
    """
    if matrix.dim() != 2:
        raise ValueError(f"{matrix_name} must be 2-D [N, *], got shape {tuple(matrix.shape)}")
    check_dtype(matrix_name, matrix.dtype, backend)
    n = matrix.shape[0]
    if labels.dim() != 1 or labels.shape[0] != n:
        raise ValueError(f"labels must be [N] = [{n}] to match {matrix_name}, got {tuple(labels.shape)}")
    if labels.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"labels must be int64 or int32, got {labels.dtype}")
    if labels.device != matrix.device:
        raise ValueError(f"labels is on {labels.device} but {matrix_name} is on {matrix.device}")
    for name, t in vectors.items():
        if t is None:
            continue
        if t.dim() != 1 or t.shape[0] != n:
            raise ValueError(f"{name} must be [N] = [{n}] to match {matrix_name}, got {tuple(t.shape)}")
        if not t.is_floating_point():
            raise ValueError(f"{name} must be a floating-point tensor, got {t.dtype}")
        if t.device != matrix.device:
            raise ValueError(f"{name} is on {t.device} but {matrix_name} is on {matrix.device}")


def check_sequence_ids(options: LossOptions, sequence_ids: torch.Tensor | None, labels: torch.Tensor) -> None:
    """``ValueError`` unless ``sequence_ids`` is an ``[N]`` integer tensor on the labels' device,
    given exactly when ``options.importance_sampling_level == "sequence"``."""
    check_sequence_ids_given(options, sequence_ids)
    if sequence_ids is None:
        return
    n = labels.shape[0]
    if sequence_ids.dim() != 1 or sequence_ids.shape[0] != n:
        raise ValueError(f"sequence_ids must be [N] = [{n}], got {tuple(sequence_ids.shape)}")
    if sequence_ids.dtype not in (torch.int64, torch.int32):
        raise ValueError(f"sequence_ids must be int64 or int32, got {sequence_ids.dtype}")
    if sequence_ids.device != labels.device:
        raise ValueError(f"sequence_ids is on {sequence_ids.device} but labels is on {labels.device}")


def check_label_range(labels: torch.Tensor, vocab_size: int, bounds: tuple[int, int] | None = None) -> None:
    """``ValueError`` unless every label is in ``[0, vocab_size)``.

    ``bounds``: the labels' ``(min, max)`` as the caller knows them (``Microbatch.label_bounds``,
    read on the CPU where the batch is built): the check compares two Python ints and reads
    nothing. Without them, one ``aminmax`` kernel and one device-to-host copy of two numbers: on
    CUDA a host-device sync point (≈10 µs) per call; an out-of-range label would otherwise read
    out of bounds in the kernel.
    """
    if labels.numel() == 0:
        return
    lo, hi = bounds if bounds is not None else (int(x) for x in torch.aminmax(labels))
    if lo < 0 or hi >= vocab_size:
        raise ValueError(f"labels must be in [0, V) = [0, {vocab_size}), got min {lo} and max {hi}")


def check_temperature(temperature: float) -> None:
    if not (math.isfinite(temperature) and temperature > 0):
        raise ValueError(f"temperature must be finite and > 0, got {temperature}")


def check_truncation(top_k: int, top_p: float) -> None:
    """``ValueError`` unless ``top_k`` is an int ≥ 0 (0: no top-k) and ``top_p`` in (0, 1] (1: no top-p)."""
    if isinstance(top_k, bool) or not isinstance(top_k, int) or top_k < 0:
        raise ValueError(f"top_k must be an integer >= 0 (0: no top-k), got {top_k!r}")
    if not (isinstance(top_p, (int, float)) and 0 < top_p <= 1):
        raise ValueError(f"top_p must be in (0, 1] (1: no top-p), got {top_p!r}")
