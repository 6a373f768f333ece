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

With fp32 logits on ``torch_chunked`` (a CPU's backend), the forward kernel leaves ``e = exp(s − m)`` in the
chunk's buffer instead of the logits (``token_logprobs_fwd_exps``: 5 passes over each tile of a few
rows while it sits in cache), and with no entropy term the backward makes no pass over the chunk:
``dlogits = c1·(e − S·δ_y)`` with ``c1 = −g_lp/(T·S)`` per row, so the two gradient GEMMs read
``e`` (``S`` taken off each label entry) and the row scaling moves to their ``[C, D]`` operands
(``_Gradients._add_exps_chunk``). With
an entropy term ``dlogits`` is written over ``e`` (``dlogits_from_exps``: ``s − m = log e``). N 4,096,
D 256, V 32,768 fp32 forward + backward, 1,024-row chunks, one thread, CPU time (medians of 4
alternating in one process, 2 shared cores at load 8-10, 2026-12-03): 3.10 s, 1.11x its three
GEMMs, where the logits kernels' 6 + 3 passes over 64 x 16,384 tiles took 4.36 s, 1.33x
(``bench/peers/test_bench_liger_loss.py`` has the comparison with Liger-Kernel).

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

Default chunk (``default_chunk_size``): from a memory budget (``CHUNK_LOGITS_BYTES`` on CUDA,
``CPU_CHUNK_LOGITS_BYTES`` on a CPU) and, on CUDA, GEMM efficiency.
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
    V = 151,936 bf16, CPU:  220 rows fit in 64 MiB: 128 rows (37 MiB)
    V = 32,768 fp32, CUDA:  2,048 rows (256 MiB);  CPU: 512 rows (64 MiB)

These are formulas, not yet GPU measurements: ``bench/test_bench_fused_linear_grpo_loss.py`` has
``chunk_size`` as an axis for the first GPU run to settle it.

On a CPU the GEMM floor does not apply: its ridge point is far lower (a few cores' FLOP/s over
their memory bandwidth), and one thread's GEMMs run as fast on 256 rows as on 1,024, so memory
decides, with a budget of half CUDA's (``CPU_CHUNK_LOGITS_BYTES``, 64 MiB). N 4,096, D 256,
V 32,768 fp32 forward + backward, one thread, CPU time (median of 4 alternating in one process,
2 shared cores at load ≈ 8; peak RSS growth each in a fresh process):

    chunk      op      its 3 GEMMs   peak
      256    3.18 s      2.70 s      74 MB
      512    3.20 s      2.81 s     107 MB   (the default)
    1,024    3.10 s      2.80 s     174 MB   (the 128 MiB budget before 2026-12-03)

against Liger-Kernel 0.8.5's fused-linear GRPO loss on the same problem, 131 MB (its chunk: one
sequence of 256 rows).

An eager ``[N, V]`` path at N = 8,192, V = 151,936 holds 2.5 GB of bf16 logits plus ≥ 3 fp32
copies (≥ 15 GB) for its backward.

Sequence parallelism (``across``, ``grpo_fast.policy.sequence_parallel``): each rank of an sp group
calls the op on the rows it holds, a share of every sequence (no rank computes another's logits).
The statistics of whole rows reduce over the group inside the row math (GSPO's per-sequence mean
log-ratio, with its gradient; the top-entropy quantile); ``loss`` and the per-row outputs are the
rank's, and the ranks' losses sum to the whole batch's. Token-mean normalization needs nothing
here: it is in ``loss_weights``, counted before the split.
"""

from __future__ import annotations

from dataclasses import dataclass
from types import ModuleType
from typing import NamedTuple

import torch
from torch.autograd.function import once_differentiable

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.algo.reference import eager_grpo_loss_from_logits
from grpo_fast.algo.token_loss import GRPOLossOutput, LossParts, weighted_grpo_loss
from grpo_fast.algo.truncation import truncates
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
    "CPU_CHUNK_LOGITS_BYTES",
    "GEMM_MIN_ROWS",
    "default_chunk_size",
    "fused_linear_grpo_loss",
]

CHUNK_LOGITS_BYTES = 128 * 2**20  # the memory budget of one chunk of logits on CUDA
CPU_CHUNK_LOGITS_BYTES = 64 * 2**20  # and on a CPU (module docstring: peak against Liger's)
CHUNK_LOGITS_MAX_BYTES = 2**30  # the most the GEMM floor may take
GEMM_MIN_ROWS = 2048  # on CUDA: the weight-gradient GEMM above the ridge point (module docstring)
_GEMM_ROWS = 128

_GRADS_USED = (
    "fused_linear_grpo_loss: the gradients were computed in the forward and handed over by the first "
    "backward; call the op again for a second backward"
)


def default_chunk_size(num_rows: int, vocab_size: int, dtype: torch.dtype, device_type: str = "cuda") -> int:
    """Rows per chunk: what ``CHUNK_LOGITS_BYTES`` (CUDA) or ``CPU_CHUNK_LOGITS_BYTES`` (any
    other device) of ``[C, V]`` logits hold, raised on CUDA to ``GEMM_MIN_ROWS`` while those take
    at most ``CHUNK_LOGITS_MAX_BYTES``; a multiple of 128 when at least 128 rows fit, at most
    ``num_rows`` (see the module docstring for the numbers).

    Example: ``default_chunk_size(8192, 151936, torch.bfloat16) == 2048`` (CUDA), and ``128``
    with ``device_type="cpu"``.
    """
    row_bytes = vocab_size * dtype.itemsize
    if device_type == "cuda":
        rows = CHUNK_LOGITS_BYTES // row_bytes
        rows = max(rows, min(GEMM_MIN_ROWS, CHUNK_LOGITS_MAX_BYTES // row_bytes))
    else:
        rows = CPU_CHUNK_LOGITS_BYTES // row_bytes
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
    # the forward leaves exp(s − m) in the chunk's fp32 logits buffer, the backward reads it
    # (torch_chunked with fp32 logits: token_logprobs_fwd_exps, _Gradients._add_exps_chunk)
    exps: bool = False

    def chunks(self, n: int):
        for r0 in range(0, n, self.chunk_size):
            yield slice(r0, min(r0 + self.chunk_size, n))

    def forward_stats(self, logits, labels, threshold):
        """The kernel forward of a chunk's ``logits [C, V]``: ``(logp, H, m, log S)``, ``[C]`` fp32
        each; with ``exps``, ``logits`` holds ``exp(s − m)`` afterwards."""
        fwd = self.kernels.token_logprobs_fwd_exps if self.exps else self.kernels.token_logprobs_fwd
        return fwd(logits, labels, 1.0 / self.temperature, threshold)


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
        ``threshold``: their truncated-sampling thresholds (None: the full distribution).
        With ``plan.exps``, ``logits`` holds the forward's ``exp(s − m)`` instead (``_add_exps_chunk``)."""
        plan = self.plan
        inv_t = 1.0 / plan.temperature
        if plan.exps:
            # with no entropy term: no pass over the chunk (on CUDA a host-device sync per chunk,
            # as token_logprobs_bwd's with_entropy)
            if not bool(g_h.ne(0).any()):
                self._add_exps_chunk(logits, h, rows, labels, g_lp, stats[1])
                return
            plan.kernels.dlogits_from_exps(logits, labels, g_lp, g_h, *stats[1:], inv_t)
        else:
            plan.kernels.token_logprobs_bwd(logits, labels, g_lp, g_h, *stats, inv_t, logits, threshold)
        if self.grad_hidden is not None and self.grad_hidden.dtype == plan.compute_dtype:
            torch.mm(logits, self.w, out=self.grad_hidden[rows])
        elif self.grad_hidden is not None:
            self.grad_hidden[rows] = logits @ self.w
        if self.grad_weight is not None:
            _accumulate_fp32(self.grad_weight, logits.t(), h)

    def _add_exps_chunk(self, exps, h, rows: slice, labels, g_lp, log_norm) -> None:
        """A chunk's gradients with no entropy term from ``exps = exp(s − m)`` ``[C, V]`` fp32:
        ``dlogits = c1·(exps − S·δ_y)`` with ``c1 = −g_lp / (T·S)`` per row (``c1·S = −g_lp/T``, the
        label's term), so after ``S`` is taken off each row's label entry (``C`` writes)

            grad_hidden[rows] = c1 ⊙ (exps @ W)              [C, D]
            grad_weight      += expsᵀ @ (c1 ⊙ h)             [V, D]

        the same two GEMMs as ``dlogits`` would take, the row scaling on ``[C, D]`` operands."""
        inv_t = 1.0 / self.plan.temperature
        # S and c1 = −g_lp / (T·S) from the kernel's fp32 log S, each rounded once from fp64 (as
        # the kernels' backward): c1·S = −g_lp/T to an fp32 rounding
        sum_exp = torch.exp(log_norm.double())  # [C]
        c1 = (g_lp.double() / sum_exp).mul_(-inv_t).float()[:, None]  # [C, 1]
        exps.scatter_add_(1, labels.long()[:, None], sum_exp.float().neg_()[:, None])
        if self.grad_hidden is not None:
            direct = self.grad_hidden.dtype == torch.float32
            gh = torch.mm(exps, self.w, out=self.grad_hidden[rows] if direct else None).mul_(c1)  # [C, D]
            if not direct:
                self.grad_hidden[rows] = gh  # hidden in bf16/fp16 with compute_dtype=fp32: one rounding
        if self.grad_weight is not None:
            self.grad_weight.addmm_(exps.t(), h * c1)


def _row_math(lp, ent, rows: RowInputs, options: LossOptions, track: bool, across=None):
    """``weighted_grpo_loss`` of rows whose ``lp, ent`` came from the kernel; with ``track``, also
    the per-row upstream gradients ``(g_lp, g_H)`` of the loss (``across``: sequence parallelism,
    the whole-row statistics reduced over the group, their gradients too)."""
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
            across=across,
        )
    grads = None
    if track:
        grads = torch.autograd.grad(loss, (lp, ent), allow_unused=True, materialize_grads=True)
    return loss.detach(), out, grads


class FusedLinearGRPOLoss(torch.autograd.Function):
    """``(hidden [N, D], weight [V, D], rows, options, plan, weight_cast, across) -> (loss, logprobs,
    entropy, kl, clipped, log_ratio, parts [3], threshold)``.

    Only ``loss`` is differentiable (in ``hidden`` and ``weight``); the other outputs are detached.
    ``kl`` is an empty tensor when there is no ``ref_logprobs``; ``parts`` is ``(pg, kl, entropy)``;
    ``threshold`` is the top-entropy threshold (empty when there is none). ``plan.two_pass``: the
    row math runs once over all ``N`` rows between a statistics pass and a gradient pass (module
    docstring). ``across``: sequence parallelism (``fused_linear_grpo_loss``).
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
        across=None,
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
        # One [C, V] buffer holds every chunk's logits, then their gradient (or exps): never two chunks
        # alive at once (N=4096, D=256, V=32768 fp32 on CPU, 1,024-row chunks: peak 291 -> 177 MiB),
        # and on CPU no fresh mmap, zero-filled page by page on first touch, per chunk.
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
                stats = plan.forward_stats(logits, rows.labels[c], thr)
                for out, chunk in zip((logprobs, entropy, row_max, log_norm, thresholds), (*stats, thr)):
                    if out is not None:
                        out[c] = chunk
            # the row math once over all N rows (sequence ratios, entropy quantiles): g_lp, g_H [N]
            full_loss, out, g = _row_math(logprobs, entropy, rows, options, track, across)
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
                    if plan.exps:  # the same ops on the same tiles as pass 1: bitwise its exps
                        plan.kernels.exps_of_logits(logits, rows.labels[c], row_max[c], inv_temperature, thr)
                    grads.add_chunk(logits, h, c, rows.labels[c], g[0][c], g[1][c], stats, thr)
        else:  # one pass: each chunk's row math, then its gradients, while its logits exist
            for c in plan.chunks(n):
                h = hidden[c].to(plan.compute_dtype)
                logits = chunk_logits(h)
                thr = sampler_thresholds(logits, inv_temperature, plan.top_k, plan.top_p)  # [C] | None
                lp, ent, row_max, log_norm = plan.forward_stats(logits, rows.labels[c], thr)
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
        return grad_hidden, grad_weight, None, None, None, None, None


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


def _eager(hidden, weight, rows: RowInputs, temperature, options, top_k, top_p, across) -> GRPOLossOutput:
    """``backend="eager"``: the ``[N, V]`` logits in the compute dtype, then the eager reference."""
    return eager_grpo_loss_from_logits(
        hidden @ weight.t(), rows.labels, rows.advantages, rows.loss_weights, temperature=temperature,
        options=options, top_k=top_k, top_p=top_p, across=across, old_logprobs=rows.old_logprobs,
        ref_logprobs=rows.ref_logprobs, sequence_ids=rows.sequence_ids,
    )  # fmt: skip


def _plan(hidden, vocab_size, backend, compute, temperature, chunk_size, two_pass, top_k, top_p) -> ChunkPlan:
    """The op's ``ChunkPlan``: the default chunk when ``chunk_size`` is None, and ``exps`` for
    ``torch_chunked`` with fp32 logits."""
    if chunk_size is None:
        chunk_size = default_chunk_size(hidden.shape[0], vocab_size, compute, hidden.device.type)
    exps = backend == "torch_chunked" and compute == torch.float32
    return ChunkPlan(temperature, chunk_size, compute, kernels_for(backend), two_pass, top_k, top_p, exps)


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
    across=None,
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
            (CUDA: 128 MiB of logits, at least 2,048 rows within 1 GiB; CPU: 64 MiB).
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
        across: sequence parallelism: these rows are one rank's share of their sequences (module
            docstring, "Sequence parallelism").

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
        return _eager(
            hidden.to(compute), weight.to(compute), rows, temperature, options, top_k, top_p, across
        )
    if not torch.is_grad_enabled():
        # Under no_grad a Function still sees needs_input_grad=True for inputs that require grad:
        # detach them so a no-grad pass (π_old, π_ref, probes) skips the two gradient GEMMs.
        hidden, weight = hidden.detach(), weight.detach()
    rows = rows._replace(labels=labels.contiguous())
    two_pass = options.needs_all_rows if two_pass is None else two_pass
    plan = _plan(
        hidden, weight.shape[0], resolved, compute, float(temperature), chunk_size, two_pass, top_k, top_p
    )
    cast = None if weight_cast is None else weight_cast.detach()
    loss, logprobs, entropy, kl, clipped, log_ratio, parts, threshold = FusedLinearGRPOLoss.apply(
        hidden, weight, rows, options, plan, cast, across
    )
    kl = kl if ref_logprobs is not None else None
    threshold = threshold[0] if threshold.numel() else None
    return GRPOLossOutput(
        loss, logprobs, entropy, kl, clipped, log_ratio, LossParts(*parts.unbind()), threshold
    )
