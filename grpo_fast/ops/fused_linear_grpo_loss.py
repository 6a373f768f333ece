"""The GRPO loss from hidden states and the lm_head weight: the ``[N, V]`` logits never exist.

Per chunk of ``C`` rows, in the forward (``W`` = the weight in the compute dtype: the caller's
``weight_cast``, or cast once per call):

    logits = hidden_c @ Wᵀ                           [C, V], compute dtype
    logp, H = token_logprobs kernel (forward)        [C] fp32, plus 2 fp32 per row for the backward
    ℓ, g_lp, g_H = per-row GRPO math and its autograd on [C] vectors
    dlogits = token_logprobs kernel (backward)       written over logits, in place
    grad_hidden_c = dlogits @ W                      [C, D]
    grad_weight += dlogitsᵀ @ hidden_c               [V, D], accumulated in fp32

so the gradients are ready when the forward returns; ``backward`` only scales them by the upstream
gradient of ``loss``. Peak extra memory: one chunk of logits, ``grad_hidden`` ``[N, D]``, the fp32
``grad_weight`` ``[V, D]`` and, when the compute dtype differs from the weight's, ``W`` (during the
forward only, unless the caller keeps it as ``weight_cast``). Nothing of it grows with N but ``grad_hidden``.

Two-pass mode (``two_pass``), for row math that needs statistics over rows before any gradient
(GSPO's sequence ratio needs every token of the sequence, and its sequences cross chunks; the
top-entropy threshold needs every row's entropy):

    pass 1, per chunk:  logits = hidden_c @ Wᵀ;  logp, H, m, log S = kernel forward      [C] fp32
    once, on [N]:       ℓ and its autograd -> g_lp, g_H for all N rows
    pass 2, per chunk:  logits = hidden_c @ Wᵀ again;  dlogits, grad_hidden_c, grad_weight as above

One more lm_head GEMM (3 -> 4 per chunk, with the two gradient GEMMs) and 4 fp32 per row kept
between the passes; the peak is the one-pass mode's, one chunk of logits at a time, plus those
few fp32 per row (measured with ``grpo_fast.obs.memory.tracked_peak_bytes``, CPU, N = 1,024, D = 256,
V = 32,768 fp32, chunks of 256 rows, torch_chunked: 93.0 MiB one-pass, two-pass and GSPO alike;
at N = 256 the two-pass peak is 5,824 bytes, 5.7 fp32 per row, above the one-pass one). The
gradient pass reuses pass 1's ``(m, log S)``: the recomputed logits are the same product of the
same operands.

fp32 master weights under bf16 autocast: pass the fp32 weight itself with ``compute_dtype=bf16``.
The fp32 accumulator is then the weight's gradient as returned, with no bf16 rounding and no casts
of ``[V, D]`` in the backward. Casting the weight to bf16 outside the op instead costs two more
``[V, D]`` buffers per call (the gradient cast to bf16, and autograd's cast back to fp32) and
rounds the accumulated gradient to bf16. Measured on CPU (tied Qwen2 embeddings, V = 4,099,
D = 80, ``test_master_weight_under_autocast_allocates_no_cast_gradient``): ``[V, D]`` buffers
allocated per call 5 -> 3 (bf16 weight, fp32 accumulator, fp32 embedding gradient); alive at
once at most 2 fp32 beside the weight and any existing ``.grad``, before and after: the
accumulator and the embedding's gradient, which the tie makes autograd add. ``PolicyLoss``
passes the bf16 copy as ``weight_cast``, cast once per optimizer step: 3 -> 2 buffers allocated
per microbatch after the first of a step, for one bf16 ``[V, D]`` kept until the step.

Default chunk (``default_chunk_size``): from the memory budget and, on CUDA, GEMM efficiency.
The weight-gradient GEMM of a chunk of ``C`` rows, ``grad_weight [V, D] fp32 += dlogitsᵀ [V, C] @
hidden_c [C, D]``, does ``2·V·C·D`` FLOP and moves ``2·V·C + 2·C·D`` bytes of bf16 operands plus
``8·V·D`` of the fp32 accumulator (read and written once per chunk): with ``V ≫ C, D`` its
intensity is ``≈ C·D / (C + 4·D)`` FLOP per byte, which only a larger chunk raises. At D = 1,536
(Qwen2.5-1.5B):

    C =   384:  90 FLOP/byte    (the 128 MiB budget alone at V = 151,936 bf16)
    C = 1,024: 219
    C = 2,048: 384
    C = 4,096: 614

against a ridge point (peak bf16 FLOP/s over HBM bytes/s) of ≈ 165 on an H200 (790 TFLOP/s
measured, 4.8 TB/s) and ≈ 295 on an H100 SXM (989 TFLOP/s, 3.35 TB/s): 384 rows leave that GEMM
memory-bound on both; 2,048 put it above both (D = 3,584, Qwen2.5-7B: 448). The logits GEMM
(``≈ C·D / (C + D)``: 307 at C = 384) and the ``grad_hidden`` one are not the bound ones. So on
CUDA the chunk is at least ``GEMM_MIN_ROWS`` (2,048) rows, as long as they take at most
``CHUNK_LOGITS_MAX_BYTES`` (1 GiB) of logits; above that floor the ``CHUNK_LOGITS_BYTES``
(128 MiB) budget decides. Rounded down to a multiple of 128 rows (whole GEMM tiles) when at least
128 rows fit, and never more than ``N``:

    V = 151,936 bf16, CUDA: 441 rows fit in 128 MiB, the floor makes it 2,048 rows (594 MiB)
    V = 151,936 bf16, CPU:  384 rows (111 MiB)
    V = 32,768 fp32, CUDA:  2,048 rows (256 MiB);  CPU: 1,024 rows (128 MiB)

On a CPU the floor does not apply: its ridge point is far lower (a few cores' FLOP/s over their
memory bandwidth) and its runs are test-sized, so memory alone decides. These are formulas, not
yet GPU measurements: ``bench/test_bench_fused_linear_grpo_loss.py`` has ``chunk_size`` as an
axis for the first GPU run to settle it.

An eager ``[N, V]`` path at N = 8,192, V = 151,936 holds 2.5 GB of bf16 logits plus ≥ 3 fp32
copies (≥ 15 GB) for its backward.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from grpo_fast.algo.core import (
    GRPOLossOutput,
    LossParts,
    eager_grpo_loss_from_logits,
    truncates,
    weighted_grpo_loss,
)
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.ops._backend import (
    check_backend,
    check_dtype,
    check_label_range,
    check_per_token,
    check_sequence_ids,
    check_temperature,
    check_truncation,
    kernels_for,
)
from grpo_fast.ops.token_logprobs import sampler_thresholds

__all__ = [
    "CHUNK_LOGITS_BYTES",
    "CHUNK_LOGITS_MAX_BYTES",
    "GEMM_MIN_ROWS",
    "default_chunk_size",
    "fused_linear_grpo_loss",
]

CHUNK_LOGITS_BYTES = 128 * 2**20  # the memory budget of one chunk of logits
CHUNK_LOGITS_MAX_BYTES = 2**30  # the most the GEMM floor may take
GEMM_MIN_ROWS = 2048  # on CUDA: the weight-gradient GEMM above the ridge point (module docstring)
_GEMM_ROWS = 128

_GRADS_USED = (
    "fused_linear_grpo_loss: the gradients were computed in the forward and handed over by the first "
    "backward; call the op again for a second backward"
)


def default_chunk_size(num_rows: int, vocab_size: int, dtype: torch.dtype, device_type: str = "cuda") -> int:
    """Rows per chunk: what ``CHUNK_LOGITS_BYTES`` of ``[C, V]`` logits hold, raised on CUDA to
    ``GEMM_MIN_ROWS`` while those take at most ``CHUNK_LOGITS_MAX_BYTES``; a multiple of 128
    when at least 128 rows fit, at most ``num_rows`` (see the module docstring for the numbers).

    Example: ``default_chunk_size(8192, 151936, torch.bfloat16) == 2048`` (CUDA), and ``384``
    with ``device_type="cpu"``.
    """
    row_bytes = vocab_size * dtype.itemsize
    rows = CHUNK_LOGITS_BYTES // row_bytes
    if device_type == "cuda":
        rows = max(rows, min(GEMM_MIN_ROWS, CHUNK_LOGITS_MAX_BYTES // row_bytes))
    if rows >= _GEMM_ROWS:
        rows -= rows % _GEMM_ROWS
    return max(1, min(rows, num_rows))


class RowInputs(NamedTuple):
    """The op's per-row inputs, ``[N]`` each (None where absent); none is differentiable."""

    labels: torch.Tensor
    advantages: torch.Tensor
    loss_weights: torch.Tensor
    old_logprobs: torch.Tensor | None
    ref_logprobs: torch.Tensor | None
    sequence_ids: torch.Tensor | None

    def select(self, rows: slice) -> RowInputs:
        return RowInputs(*(None if t is None else t[rows] for t in self))


@dataclass(frozen=True)
class ChunkPlan:
    """How the op runs: rows per chunk, the GEMMs' dtype, the kernels, one pass or two."""

    temperature: float
    chunk_size: int
    compute_dtype: torch.dtype
    kernels: ModuleType
    two_pass: bool
    top_k: int = 0  # the sampler's truncation (grpo_fast.ops.token_logprobs.sampler_thresholds)
    top_p: float = 1.0

    def chunks(self, n: int):
        for r0 in range(0, n, self.chunk_size):
            yield slice(r0, min(r0 + self.chunk_size, n))


def _accumulate_fp32(acc: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> None:
    """``acc [V, D] fp32 += a [V, C] @ b [C, D]``, with ``a``, ``b`` in the model dtype."""
    if a.dtype == torch.float32:
        acc.addmm_(a, b)
    elif acc.is_cuda:
        # cuBLAS reads bf16/fp16 and accumulates into the fp32 buffer in place (aten::addmm.dtype_out).
        torch.addmm(acc, a, b, out_dtype=torch.float32, out=acc)
    else:
        # torch 2.13 has no CPU kernel for addmm.dtype: upcast the chunk (CPU runs are test-sized).
        acc.addmm_(a.float(), b.float())


@dataclass
class _Gradients:
    """The gradient buffers and what a chunk's backward reads: ``w [V, D]`` in the compute dtype,
    ``grad_hidden [N, D]`` (None when ``hidden`` needs none), ``grad_weight [V, D]`` fp32 (None
    when the weight is frozen: no buffer, and one GEMM less per chunk)."""

    w: torch.Tensor
    grad_hidden: torch.Tensor | None
    grad_weight: torch.Tensor | None
    plan: ChunkPlan

    def add_chunk(self, logits, h, rows: slice, labels, g_lp, g_h, stats, threshold=None) -> None:
        """One chunk's gradients from its per-row ``g_lp, g_H [C]``: ``dlogits`` over ``logits
        [C, V]`` (in place), ``grad_hidden[rows] = dlogits @ W``, ``grad_weight += dlogitsᵀ @ h``.
        ``stats``: the kernel's forward statistics of these rows, ``(row_max, log_norm, entropy)``;
        ``threshold``: their truncated-sampling thresholds (None: the full distribution)."""
        plan = self.plan
        inv_t = 1.0 / plan.temperature
        plan.kernels.token_logprobs_bwd(logits, labels, g_lp, g_h, *stats, inv_t, logits, threshold)
        if self.grad_hidden is not None and self.grad_hidden.dtype == plan.compute_dtype:
            torch.mm(logits, self.w, out=self.grad_hidden[rows])
        elif self.grad_hidden is not None:
            self.grad_hidden[rows] = logits @ self.w
        if self.grad_weight is not None:
            _accumulate_fp32(self.grad_weight, logits.t(), h)


def _row_math(lp, ent, rows: RowInputs, options: LossOptions, track: bool):
    """``weighted_grpo_loss`` of rows whose ``lp, ent`` came from the kernel; with ``track``, also
    the per-row upstream gradients ``(g_lp, g_H)`` of the loss."""
    with torch.set_grad_enabled(track):
        lp = lp.detach().requires_grad_(track)
        ent = ent.detach().requires_grad_(track)
        loss, out = weighted_grpo_loss(
            lp,
            ent,
            rows.advantages,
            rows.loss_weights,
            options,
            old_logprobs=rows.old_logprobs,
            ref_logprobs=rows.ref_logprobs,
            sequence_ids=rows.sequence_ids,
        )
    grads = None
    if track:
        grads = torch.autograd.grad(loss, (lp, ent), allow_unused=True, materialize_grads=True)
    return loss.detach(), out, grads


class FusedLinearGRPOLoss(torch.autograd.Function):
    """``(hidden [N, D], weight [V, D], rows, options, plan, weight_cast) -> (loss, logprobs,
    entropy, kl, clipped, log_ratio, parts [3], threshold)``.

    Only ``loss`` is differentiable (in ``hidden`` and ``weight``); the other outputs are detached.
    ``kl`` is an empty tensor when there is no ``ref_logprobs``; ``parts`` is ``(pg, kl, entropy)``;
    ``threshold`` is the top-entropy threshold (empty when there is none). ``plan.two_pass``: the
    row math runs once over all ``N`` rows between a statistics pass and a gradient pass (module
    docstring).
    """

    @staticmethod
    def forward(
        ctx,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        rows: RowInputs,
        options: LossOptions,
        plan: ChunkPlan,
        weight_cast: torch.Tensor | None,
    ):
        n, device = hidden.shape[0], hidden.device
        need_hidden, need_weight = ctx.needs_input_grad[:2]
        track = need_hidden or need_weight
        f32 = dict(dtype=torch.float32, device=device)
        logprobs, entropy = torch.empty(n, **f32), torch.empty(n, **f32)
        kl = torch.empty(n if rows.ref_logprobs is not None else 0, **f32)
        clipped = torch.empty(n, dtype=torch.bool, device=device)
        log_ratio = torch.empty(n, **f32)
        loss, parts = torch.zeros((), **f32), torch.zeros(3, **f32)
        threshold = torch.empty(0, **f32)
        # [V, D] in the compute dtype: the caller's copy, else one cast per call (none when the dtypes agree)
        w = weight_cast if weight_cast is not None else weight.to(plan.compute_dtype)
        grads = _Gradients(
            w,
            torch.empty_like(hidden) if need_hidden else None,
            torch.zeros(weight.shape, **f32) if need_weight else None,
            plan,
        )

        def keep(where, out) -> None:
            clipped[where] = out.clipped
            log_ratio[where] = out.log_ratio
            if out.kl is not None:
                kl[where] = out.kl
            parts.add_(torch.stack(list(out.parts)))

        inv_temperature = 1.0 / plan.temperature
        # One [C, V] buffer holds every chunk's logits, then their gradient: never two chunks alive at
        # once (N=4096, D=256, V=32768 fp32 on CPU: peak 291 -> 177 MiB), and on CPU no fresh 128 MiB
        # mmap, zero-filled page by page on first touch, per chunk.
        logits_buffer = torch.empty(
            min(plan.chunk_size, n), weight.shape[0], dtype=plan.compute_dtype, device=device
        )

        def chunk_logits(h: torch.Tensor) -> torch.Tensor:
            return torch.mm(h, w.t(), out=logits_buffer[: h.shape[0]])  # [C, V], compute dtype

        truncated = truncates(plan.top_k, plan.top_p, weight.shape[0])
        if plan.two_pass:
            # pass 1: log-probs, entropies and the two row statistics of every row, chunk by chunk
            row_max, log_norm = torch.empty(n, **f32), torch.empty(n, **f32)
            thresholds = torch.empty(n, **f32) if truncated else None  # kept for pass 2
            for c in plan.chunks(n):
                logits = chunk_logits(hidden[c].to(plan.compute_dtype))
                thr = sampler_thresholds(logits, inv_temperature, plan.top_k, plan.top_p)  # [C] | None
                stats = plan.kernels.token_logprobs_fwd(logits, rows.labels[c], inv_temperature, thr)
                for out, chunk in zip((logprobs, entropy, row_max, log_norm, thresholds), (*stats, thr)):
                    if out is not None:
                        out[c] = chunk
            # the row math once over all N rows (sequence ratios, entropy quantiles): g_lp, g_H [N]
            full_loss, out, g = _row_math(logprobs, entropy, rows, options, track)
            loss += full_loss
            keep(slice(None), out)
            if out.entropy_threshold is not None:
                threshold = out.entropy_threshold.reshape(1).float()
            if track:
                # pass 2: each chunk's logits again (one more lm_head GEMM), then its gradients
                for c in plan.chunks(n):
                    h = hidden[c].to(plan.compute_dtype)
                    logits = chunk_logits(h)  # the same product as in pass 1
                    stats = (row_max[c], log_norm[c], entropy[c])
                    thr = None if thresholds is None else thresholds[c]
                    grads.add_chunk(logits, h, c, rows.labels[c], g[0][c], g[1][c], stats, thr)
        else:  # one pass: each chunk's row math, then its gradients, while its logits exist
            for c in plan.chunks(n):
                h = hidden[c].to(plan.compute_dtype)
                logits = chunk_logits(h)
                thr = sampler_thresholds(logits, inv_temperature, plan.top_k, plan.top_p)  # [C] | None
                lp, ent, row_max, log_norm = plan.kernels.token_logprobs_fwd(
                    logits, rows.labels[c], inv_temperature, thr
                )
                chunk_loss, out, g = _row_math(lp, ent, rows.select(c), options, track)
                if track:
                    grads.add_chunk(logits, h, c, rows.labels[c], *g, (row_max, log_norm, ent), thr)
                loss += chunk_loss
                logprobs[c], entropy[c] = lp, ent
                keep(c, out)

        ctx.grads = (grads.grad_hidden, grads.grad_weight)  # grad_weight is fp32: an fp32 weight's gradient
        ctx.weight_dtype = weight.dtype
        outputs = (logprobs, entropy, kl, clipped, log_ratio, parts, threshold)
        ctx.mark_non_differentiable(*outputs)
        return loss, *outputs

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_loss: torch.Tensor, *_unused):
        if ctx.grads is None:
            raise RuntimeError(_GRADS_USED)
        grad_hidden, grad_weight = ctx.grads
        ctx.grads = None  # hand the buffers over: no copy of [V, D] kept alive
        if grad_hidden is not None:
            grad_hidden = grad_hidden.mul_(grad_loss)
        if grad_weight is not None:
            grad_weight = grad_weight.mul_(grad_loss).to(ctx.weight_dtype)  # a no-op for fp32
        return grad_hidden, grad_weight, None, None, None, None


def _check_inputs(
    hidden, weight, rows: RowInputs, options, temperature, compute_dtype, chunk_size, two_pass, backend,
    weight_cast, label_bounds,
) -> str:  # fmt: skip
    """``ValueError`` naming the first bad argument of ``fused_linear_grpo_loss``; returns the
    resolved backend."""
    labels = rows.labels
    check_temperature(temperature)
    check_per_token(
        "hidden",
        hidden,
        labels,
        backend,
        advantages=rows.advantages,
        loss_weights=rows.loss_weights,
        old_logprobs=rows.old_logprobs,
        ref_logprobs=rows.ref_logprobs,
    )
    if weight.dim() != 2 or weight.shape[1] != hidden.shape[1]:
        raise ValueError(
            f"weight must be [V, D] with D = {hidden.shape[1]} to match hidden, got {tuple(weight.shape)}"
        )
    if weight.device != hidden.device or (compute_dtype is None and weight.dtype != hidden.dtype):
        raise ValueError(
            f"weight ({weight.dtype}, {weight.device}) must match hidden ({hidden.dtype}, {hidden.device}); "
            "pass compute_dtype to mix dtypes"
        )
    compute = hidden.dtype if compute_dtype is None else compute_dtype
    check_dtype("weight", weight.dtype, backend)
    check_dtype("compute_dtype", compute, backend)
    if chunk_size is not None and chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if options.needs_ref_logprobs and rows.ref_logprobs is None:
        raise ValueError("beta != 0 needs ref_logprobs")
    check_sequence_ids(options, rows.sequence_ids, labels)
    if two_pass is False and options.needs_all_rows:
        raise ValueError(
            "importance_sampling_level='sequence' and top_entropy_quantile < 1 need two_pass (None or True)"
        )
    resolved = check_backend(backend, hidden.device)
    check_label_range(labels, weight.shape[0], label_bounds)
    if weight_cast is not None and (
        weight_cast.shape != weight.shape
        or weight_cast.dtype != compute
        or weight_cast.device != weight.device
    ):
        raise ValueError(
            f"weight_cast must be weight.to({compute}): [V, D] = {tuple(weight.shape)} on {weight.device}, "
            f"got {tuple(weight_cast.shape)} {weight_cast.dtype} on {weight_cast.device}"
        )
    return resolved


def fused_linear_grpo_loss(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    labels: torch.Tensor,
    advantages: torch.Tensor,
    loss_weights: torch.Tensor,
    *,
    old_logprobs: torch.Tensor | None = None,
    ref_logprobs: torch.Tensor | None = None,
    temperature: float = 1.0,
    sequence_ids: torch.Tensor | None = None,
    options: LossOptions | None = None,
    compute_dtype: torch.dtype | None = None,
    chunk_size: int | None = None,
    two_pass: bool | None = None,
    backend: str = "auto",
    weight_cast: torch.Tensor | None = None,
    label_bounds: tuple[int, int] | None = None,
    top_k: int = 0,
    top_p: float = 1.0,
    **loss_options,
) -> GRPOLossOutput:
    """``grpo_loss_from_logits(hidden @ weightᵀ, ...)`` computed chunk by chunk, without ``[N, V]``.

    Args:
        hidden: ``[N, D]`` fp32/bf16/fp16, the last hidden states at the ``N`` response tokens.
        weight: ``[V, D]`` on the same device (the lm_head weight; no bias); the same dtype as
            ``hidden`` unless ``compute_dtype`` is given. A frozen weight (``requires_grad``
            False: LoRA, a frozen head) gets no gradient buffer and one GEMM less per chunk.
        labels, advantages, loss_weights, old_logprobs, ref_logprobs, temperature, sequence_ids,
            options, **loss_options: as ``grpo_loss_from_logits`` (the top-entropy quantile is
            over all ``N`` rows of the call).
        compute_dtype: the dtype of the logits and their GEMMs (what autocast would pick), e.g.
            ``torch.bfloat16`` for an fp32 master ``weight``: the weight is cast once per call,
            ``hidden`` per chunk; each gradient comes back in its input's dtype. Default:
            ``hidden.dtype``.
        chunk_size: rows per chunk; default ``default_chunk_size(N, V, compute_dtype, device)``
            (128 MiB of logits; on CUDA at least 2,048 rows within 1 GiB: module docstring).
        two_pass: the row math once over all ``N`` rows between a statistics pass and a gradient
            pass (one more lm_head GEMM, the same memory). ``None``: exactly when the options
            need it (``LossOptions.needs_all_rows``: GSPO, the top-entropy quantile); ``True``
            for any loss (the same gradients, bitwise); ``False`` where it is needed: ValueError.
        backend: ``"auto"``, ``"triton"``, ``"torch_chunked"``, or ``"eager"`` (materializes
            ``hidden @ weightᵀ`` and calls ``eager_grpo_loss_from_logits``: the baseline).
        weight_cast: ``weight.to(compute_dtype)`` made by the caller (``PolicyLoss`` keeps one per
            optimizer step), used for the GEMMs instead of a cast per call; it must hold
            ``weight``'s current values (not checked). Ignored by ``eager``.
        label_bounds: the labels' ``(min, max)`` if the caller knows them
            (``Microbatch.label_bounds``): the range check then reads no tensor (no host-device
            sync on CUDA). They must be the labels' (not checked).
        top_k, top_p: the sampler's truncation (``token_logprobs_and_entropy``): each chunk's
            per-row thresholds (``sampler_thresholds``), then the kernels' masked log-sum-exp.

    Returns:
        ``GRPOLossOutput``. ``loss`` is differentiable in ``hidden`` and ``weight``, its gradients
        computed during the forward (``loss.backward()`` only scales them); the fp32-accumulated
        weight gradient is cast to ``weight.dtype`` (no cast for an fp32 weight). The other
        fields are detached: ``logprobs``, ``entropy``, ``kl``, ``log_ratio`` fp32 ``[N]``,
        ``clipped`` ``[N]`` bool, ``parts``, ``entropy_threshold``.

    Example:
        >>> hidden = torch.randn(6, 8, requires_grad=True)
        >>> weight = torch.randn(50, 8, requires_grad=True)
        >>> out = fused_linear_grpo_loss(hidden, weight, torch.tensor([1, 2, 3, 4, 5, 6]),
        ...                              torch.ones(6), torch.full((6,), 1 / 6), chunk_size=4)
        >>> out.loss.backward()  # hidden.grad [6, 8], weight.grad [50, 8]
    """
    options = LossOptions.build(options, **loss_options)
    check_truncation(top_k, top_p)
    rows = RowInputs(labels, advantages, loss_weights, old_logprobs, ref_logprobs, sequence_ids)
    compute = hidden.dtype if compute_dtype is None else compute_dtype
    resolved = _check_inputs(
        hidden, weight, rows, options, temperature, compute_dtype, chunk_size, two_pass, backend, weight_cast,
        label_bounds,
    )  # fmt: skip
    if resolved == "eager":  # the baseline: [N, V] logits, then the reference
        logits = hidden.to(compute) @ weight.to(compute).t()
        per_row = dict(old_logprobs=old_logprobs, ref_logprobs=ref_logprobs, sequence_ids=sequence_ids)
        return eager_grpo_loss_from_logits(
            logits, labels, advantages, loss_weights, temperature=temperature, options=options,
            top_k=top_k, top_p=top_p, **per_row,
        )  # fmt: skip
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], weight.shape[0], compute, hidden.device.type)
    if not torch.is_grad_enabled():
        # Under no_grad a Function still sees needs_input_grad=True for inputs that require grad:
        # detach them so a no-grad pass (π_old, π_ref, probes) skips the two gradient GEMMs.
        hidden, weight = hidden.detach(), weight.detach()
    rows = rows._replace(labels=labels.contiguous())
    two_pass = options.needs_all_rows if two_pass is None else two_pass
    plan = ChunkPlan(float(temperature), chunk_size, compute, kernels_for(resolved), two_pass, top_k, top_p)
    cast = None if weight_cast is None else weight_cast.detach()
    loss, logprobs, entropy, kl, clipped, log_ratio, parts, threshold = FusedLinearGRPOLoss.apply(
        hidden, weight, rows, options, plan, cast
    )
    kl = kl if ref_logprobs is not None else None
    threshold = threshold[0] if threshold.numel() else None
    return GRPOLossOutput(
        loss, logprobs, entropy, kl, clipped, log_ratio, LossParts(*parts.unbind()), threshold
    )
