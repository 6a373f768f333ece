"""token_logprobs_and_entropy against the float64 eager reference, on both kernel backends.

Without CUDA, ``triton`` runs under the interpreter (tests/conftest.py), so shapes stay small:
N ≤ 40 rows at V = 32,003. The ``gpu`` tests use the real shape (V = 151,936, N = 8,192, bf16).
"""

from __future__ import annotations

import contextlib
import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from grpo_fast.algo.core import eager_token_logprobs_and_entropy
from grpo_fast.ops import token_logprobs_and_entropy
from grpo_fast.testing import assert_close_to_reference, backend_device, logit_grad_scale, logit_scale

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy, interpreter

BACKENDS = ["torch_chunked", "triton"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
# (N, V, vocabulary tile): odd vocabularies (not a multiple of any tile), N small enough for the
# interpreter. The last shape has several tiles per row: the triton forward's running max and
# sums combined across tiles, the backward's loop, torch_chunked's backward blocks, all at a tile
# of 1,024 (``_vocab_tile``: 4 full tiles and a masked one of 3 columns). At their own sizes
# (8,192; 16,384) test_neg_inf_entries (V = 20,000) has several, and test_real_shape_on_gpu.
# The interpreter's cost is rows x tiles, not V: triton at N = 16, V = 4,099 in tiles of 1,024
# took 0.7 s against 0.9 s at V = 32,003 in tiles of 8,192 (2026-12-06, load 4). Planted: the
# triton forward's sums not rescaled by the new max (``sum_exp = sum_exp + ...``), or the
# torch_chunked backward's label column not offset by its block (no ``- v0``) → the last shape fails.
SMALL_TILE = 1024
SHAPES = [
    pytest.param(63, 1000, None, id="N63-V1000"),
    pytest.param(33, 4099, None, id="N33-V4099"),
    pytest.param(16, 4099, SMALL_TILE, id=f"N16-V4099-tile{SMALL_TILE}"),
]


def _vocab_tile(monkeypatch, tile: int | None) -> None:
    """Both backends' vocabulary tile cut to ``tile`` (None: their own): the triton launchers'
    ``_MAX_BLOCK_V`` and torch_chunked's ``VOCAB_BLOCK``, read at each call."""
    if tile is None:
        return
    from grpo_fast.ops import _torch_chunked

    monkeypatch.setattr(_torch_chunked, "VOCAB_BLOCK", tile)
    with contextlib.suppress(ImportError):  # no triton here: only torch_chunked runs
        from csrc_triton import token_logprobs as triton_kernels

        monkeypatch.setattr(triton_kernels, "_MAX_BLOCK_V", tile)


def _random_logits(n: int, v: int, seed: int, scale: float = 3.0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return scale * torch.randn(n, v, generator=g)


def _finite_labels(logits: torch.Tensor, seed: int) -> torch.Tensor:
    """A random label per row among its finite logits."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(logits.shape, generator=g).masked_fill(~logits.isfinite(), -1.0)
    return scores.argmax(dim=1)


def _check_against_reference(
    logits: torch.Tensor,
    labels: torch.Tensor,
    dtype: torch.dtype,
    temperature: float,
    backend: str,
    entropy_grad: bool = True,
) -> None:
    """Outputs and the logits gradient (random upstream gradients on both outputs; with
    ``entropy_grad=False`` none on the entropy, the loss without an entropy term) vs float64."""
    device = backend_device(backend)
    n = logits.shape[0]
    g = torch.Generator().manual_seed(1)
    g_lp, g_h = torch.randn(n, generator=g), torch.randn(n, generator=g)
    if not entropy_grad:
        g_h = torch.zeros(n)

    def run(fn, z: torch.Tensor, dev: torch.device):
        z = z.detach().to(dev, copy=True).requires_grad_()
        lp, h = fn(z, labels.to(dev), temperature)
        (lp * g_lp.to(dev, lp.dtype) + h * g_h.to(dev, h.dtype)).sum().backward()
        return lp, h, z.grad

    ours = run(lambda z, y, t: token_logprobs_and_entropy(z, y, t, backend=backend), logits.to(dtype), device)
    ref = run(eager_token_logprobs_and_entropy, logits.to(dtype).double(), torch.device("cpu"))
    eager = run(eager_token_logprobs_and_entropy, logits.to(dtype), torch.device("cpu"))
    assert ours[0].dtype == ours[1].dtype == torch.float32
    zs = logit_scale(logits.to(dtype), temperature)  # what each row's log-softmax subtracts
    lps = zs + ref[0].detach().abs().nan_to_num(0.0, 0.0, 0.0)  # z_y/T = log π + logsumexp
    gs = logit_grad_scale(logits.to(dtype), labels, temperature, g_lp, g_h)
    for name, a, r, e, scale in zip(("logprobs", "entropy", "grad_logits"), ours, ref, eager, (lps, zs, gs)):
        assert_close_to_reference(a, r, e, name=name, scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "v", "tile"), SHAPES)
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
def test_matches_float64_reference(backend, dtype, n, v, tile, temperature, monkeypatch):
    _vocab_tile(monkeypatch, tile)
    logits = _random_logits(n, v, seed=v)
    _check_against_reference(logits, _finite_labels(logits, seed=n), dtype, temperature, backend)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fp16_matches_float64_reference(backend):
    logits = _random_logits(33, 4099, seed=3)
    _check_against_reference(logits, _finite_labels(logits, seed=3), torch.float16, 0.7, backend)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(
    ("temperature", "entropy_grad"), [(0.7, True), (1.0, False)], ids=["T0.7", "T1-no-entropy"]
)
def test_neg_inf_entries(backend, dtype, temperature, entropy_grad):
    """A padded vocabulary (−inf tail), −inf inside rows, a row whose first 8,192-wide tile is all
    −inf (the online max starts at −inf), and a row of only −inf (NaN, as in the reference); at
    T = 0.7 with an entropy gradient, and at T = 1 without one (the default loss's backward)."""
    logits = _random_logits(12, 20000, seed=4)
    logits[:, -1000:] = -math.inf  # padded vocabulary
    logits[::3, 100:4000:7] = -math.inf
    logits[1, :16000] = -math.inf
    logits[2] = -math.inf
    _check_against_reference(
        logits, _finite_labels(logits, seed=4), dtype, temperature, backend, entropy_grad
    )


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_huge_logits(backend, dtype):
    """±1e4 entries (near one-hot rows) and rows shifted by +1e4 (exp(s − lse) must stay exact)."""
    logits = _random_logits(36, 4099, seed=5)
    logits[::3, ::7] = 1e4
    logits[1::3, ::5] = -1e4
    logits[2::3] += 1e4
    _check_against_reference(logits, _finite_labels(logits, seed=5), dtype, 1.0, backend)


def test_huge_logits_leave_ordinary_rows_their_own_tolerance():
    """``test_huge_logits``' rows: eager's fp32 log-prob is ~1e-3 off where the label's logit is
    −1e4 (log π ≈ −1e4, an fp32 ulp there), ~1e-6 at most elsewhere. An op 100x eager's worst
    ordinary-row error off on one ordinary row, still below the extreme rows' error, is off: the
    tolerance of an entry is its own (one from the worst row passed it)."""
    logits = _random_logits(36, 4099, seed=5)
    logits[::3, ::7] = 1e4
    logits[1::3, ::5] = -1e4
    logits[2::3] += 1e4
    labels = _finite_labels(logits, seed=5)
    ref, _ = eager_token_logprobs_and_entropy(logits.double(), labels)
    eager, _ = eager_token_logprobs_and_entropy(logits, labels)
    err = (eager.double() - ref).abs()
    extreme = ref.abs() > 1000
    worst_ordinary, worst = err[~extreme].max().item(), err[extreme].max().item()
    assert worst > 300 * worst_ordinary  # the spread one tolerance for all rows would hide
    scale = logit_scale(logits) + ref.abs()
    assert_close_to_reference(eager, ref, eager, name="logprobs", scale=scale)
    row = int((~extreme).nonzero()[0])
    bad = eager.clone()
    bad[row] += 100 * worst_ordinary
    with pytest.raises(AssertionError, match=rf"(?s)1 of 36 entries.*at \({row},\)"):
        assert_close_to_reference(bad, ref, eager, name="logprobs", scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_values(backend):
    """Two logits [0, ln 3] at T = 1: p = [1/4, 3/4]; label 1 and g_lp = 1, g_H = 0."""
    device = backend_device(backend)
    z = torch.tensor([[0.0, math.log(3.0)]], device=device).requires_grad_()
    lp, h = token_logprobs_and_entropy(z.clone(), torch.tensor([1], device=device), backend=backend)
    # logp = ln(3/4) ≈ −0.28768; H = −(1/4·ln 1/4 + 3/4·ln 3/4) ≈ 0.56234
    torch.testing.assert_close(lp.cpu(), torch.tensor([math.log(0.75)]))
    torch.testing.assert_close(h.cpu(), torch.tensor([-(0.25 * math.log(0.25) + 0.75 * math.log(0.75))]))
    lp.sum().backward()
    # ∂logp/∂z = δ_y − p = [0 − 1/4, 1 − 3/4]
    torch.testing.assert_close(z.grad.cpu(), torch.tensor([[-0.25, 0.25]]))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("v", [4099, 32003])
def test_batch_invariance_bitwise(backend, dtype, v):
    """A row's outputs and gradient are bitwise equal whichever rows share the call, in any order."""
    device = backend_device(backend)
    n = 70 if v < 30000 else 40  # torch_chunked: a full 64-row tile and a padded one, or one padded
    logits = _random_logits(n, v, seed=6).to(dtype).to(device)
    labels = _finite_labels(logits.cpu(), seed=6).to(device)
    g = torch.Generator().manual_seed(6)
    g_lp, g_h = torch.randn(n, generator=g).to(device), torch.randn(n, generator=g).to(device)

    def run(idx: torch.Tensor):
        z = logits[idx].clone().requires_grad_()
        lp, h = token_logprobs_and_entropy(z, labels[idx], 0.7, backend=backend)
        (lp * g_lp[idx] + h * g_h[idx]).sum().backward()
        return lp, h, z.grad

    full = run(torch.arange(n, device=device))
    g = torch.Generator().manual_seed(7)
    subsets = [torch.tensor([5]), torch.tensor([n - 1, 0, 33]), torch.randperm(n, generator=g)[: n // 2]]
    for idx in subsets:
        part = run(idx.to(device))
        for name, a, b in zip(("logprobs", "entropy", "grad_logits"), part, full):
            assert torch.equal(a, b[idx.to(device)]), (
                f"{name} of rows {idx.tolist()[:5]}... changed with the batch"
            )


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_propagates_to_its_row_only(backend):
    device = backend_device(backend)
    logits = _random_logits(8, 4099, seed=8).to(device)
    labels = _finite_labels(logits.cpu(), seed=8).to(device)
    clean_lp, clean_h = token_logprobs_and_entropy(logits, labels, backend=backend)
    bad = logits.clone()
    bad[3, 2000] = math.nan
    z = bad.clone().requires_grad_()
    lp, h = token_logprobs_and_entropy(z, labels, backend=backend)
    (lp + h).sum().backward()
    assert lp[3].isnan() and h[3].isnan()
    assert z.grad[3].isnan().all(), "every gradient entry of the NaN row is NaN"
    keep = torch.arange(8, device=device) != 3
    assert torch.equal(lp[keep], clean_lp[keep]) and torch.equal(h[keep], clean_h[keep])
    assert z.grad[keep].isfinite().all()


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_grad(backend, dtype):
    """inplace_grad gives the same gradient bitwise, in the logits' own buffer; reuse is refused."""
    device = backend_device(backend)
    base = _random_logits(20, 4099, seed=9).to(dtype).to(device)
    labels = _finite_labels(base.cpu(), seed=9).to(device)

    def grad_of(inplace: bool) -> tuple[torch.Tensor, torch.Tensor]:
        leaf = base.clone().requires_grad_()
        logits = leaf * 1.0  # a non-leaf, as an lm_head output is
        lp, h = token_logprobs_and_entropy(logits, labels, 0.7, backend=backend, inplace_grad=inplace)
        (lp - 0.1 * h).sum().backward()
        return leaf.grad, logits

    expected, _ = grad_of(False)
    got, logits = grad_of(True)
    assert torch.equal(got, expected)
    assert torch.equal(logits.detach(), expected), "the logits buffer now holds the gradient"


@pytest.mark.parametrize("backend", BACKENDS)
def test_inplace_grad_refuses_reuse(backend):
    device = backend_device(backend)
    base = _random_logits(4, 1000, seed=10).to(device)
    labels = _finite_labels(base.cpu(), seed=10).to(device)

    # a second backward through the overwritten logits
    logits = base.clone().requires_grad_() * 1.0
    lp, _ = token_logprobs_and_entropy(logits, labels, backend=backend, inplace_grad=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="inplace_grad=True"):
        lp.sum().backward()

    # another op that saved the same logits for its backward sees them modified
    leaf = base.clone().requires_grad_()
    logits = leaf * 1.0
    other = (logits * logits).sum()  # saves logits
    lp, _ = token_logprobs_and_entropy(logits, labels, backend=backend, inplace_grad=True)
    lp.sum().backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        other.backward()

    # a leaf's .grad would alias its data
    with pytest.raises(ValueError, match="not a leaf"):
        token_logprobs_and_entropy(base.clone().requires_grad_(), labels, backend=backend, inplace_grad=True)


# ------------------------------------------- the fused head's in-place kernels (torch_chunked, CPU)


def _fused_head_logits(truncated: bool, temperature: float):
    """N = 37 rows (not a multiple of a forward tile's 127), V = 4,099: −inf inside rows, a row of
    2,000 leading −inf, and with ``truncated`` top-p 0.8 thresholds (``sampler_thresholds``)."""
    from grpo_fast.ops.token_logprobs import sampler_thresholds

    logits = _random_logits(37, 4099, seed=11)
    logits[::4, 100:3000:7] = -math.inf
    logits[1, :2000] = -math.inf
    labels = _finite_labels(logits, seed=11)
    thr = sampler_thresholds(logits, 1 / temperature, 0, 0.8) if truncated else None
    return logits, labels, thr


@pytest.mark.parametrize("truncated", [False, True], ids=["full", "top_p0.8"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
def test_fwd_exps_same_outputs_and_leaves_exps(temperature, truncated):
    """``token_logprobs_fwd_exps``: bitwise ``token_logprobs_fwd``'s four outputs, and over the
    logits ``exp(s − m)``: bitwise what ``exps_of_logits`` recomputes from the logits and ``m`` (the
    two-pass mode's gradient pass), within 1 ulp of float64 ``exp`` of the fp32 ``s − m``, and exactly
    0 at −inf entries and left-out tokens."""
    from grpo_fast.ops import _torch_chunked as kernels

    logits, labels, thr = _fused_head_logits(truncated, temperature)
    inv_t = 1 / temperature
    plain = kernels.token_logprobs_fwd(logits, labels, inv_t, thr)
    exps = logits.clone()
    outs = kernels.token_logprobs_fwd_exps(exps, labels, inv_t, thr)
    for name, a, b in zip(("logp", "entropy", "row_max", "log_norm"), outs, plain):
        assert torch.equal(a, b), name
    again = kernels.exps_of_logits(logits.clone(), labels, outs[2], inv_t, thr)
    assert torch.equal(again, exps)
    s = logits * inv_t if temperature != 1.0 else logits  # fp32, as the kernel rounds it
    if thr is not None:
        keep = (s >= thr[:, None]) | (torch.arange(4099) == labels[:, None])
        s = s.masked_fill(~keep, -math.inf)
    d = s - outs[2][:, None]  # fp32 s − m
    expected = d.double().exp()
    assert torch.equal(exps[expected == 0], torch.zeros(int((expected == 0).sum())))
    ulp = torch.finfo(torch.float32).eps * expected
    assert ((exps.double() - expected).abs() <= ulp).all()


@pytest.mark.parametrize("truncated", [False, True], ids=["full", "top_p0.8"])
@pytest.mark.parametrize("temperature", [1.0, 0.7], ids=["T1", "T0.7"])
@pytest.mark.parametrize("entropy_grad", [True, False], ids=["entropy", "no-entropy"])
def test_dlogits_from_exps_matches_float64_reference(entropy_grad, temperature, truncated):
    """``dlogits_from_exps`` over the forward's exps (the fused head's backward with an entropy
    term), random upstream gradients on log-probs and entropies (or none on the entropies): within
    2x eager's error of float64, as ``test_neg_inf_entries`` asks of ``token_logprobs_bwd``;
    exactly 0 at −inf entries and left-out tokens."""
    from grpo_fast.ops import _torch_chunked as kernels

    logits, labels, thr = _fused_head_logits(truncated, temperature)
    trunc = dict(top_p=0.8) if truncated else {}
    g = torch.Generator().manual_seed(12)
    g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)
    if not entropy_grad:
        g_h = torch.zeros(37)
    exps = logits.clone()
    _, h, _, log_norm = kernels.token_logprobs_fwd_exps(exps, labels, 1 / temperature, thr)
    dz = kernels.dlogits_from_exps(exps, labels, g_lp, g_h, log_norm, h, 1 / temperature)

    def eager(z: torch.Tensor) -> torch.Tensor:
        z = z.clone().requires_grad_()
        e_lp, e_h = eager_token_logprobs_and_entropy(z, labels, temperature, **trunc)
        (e_lp * g_lp.to(z.dtype) + e_h * g_h.to(z.dtype)).sum().backward()
        return z.grad

    ref, base = eager(logits.double()), eager(logits)
    s64 = logits.double() / temperature
    if thr is not None:
        from grpo_fast.algo.core import truncated_logits, truncation_threshold

        s64 = truncated_logits(s64, labels, truncation_threshold(s64, 0, 0.8))
    scale = logit_grad_scale(s64 * temperature, labels, temperature, g_lp, g_h)
    assert_close_to_reference(dz, ref, base, name="grad_logits", scale=scale)
    zero = ~s64.isfinite()
    assert zero.any() and torch.equal(dz[zero], torch.zeros(int(zero.sum())))


def test_assert_helper_reports_mismatch():
    ref = torch.tensor([1.0, 2.0, math.nan, -math.inf], dtype=torch.float64)
    eager = torch.tensor([1.0, 2.001, math.nan, -math.inf])  # eager is off by 1e-3 on entry 1 only
    assert_close_to_reference(torch.tensor([1.0, 2.0015, math.nan, -math.inf]), ref, eager)
    # entry 0: eager is exact there, so 1.5e-3 off is off (one tolerance from the worst entry,
    # 2 x 1e-3, passed it)
    with pytest.raises(AssertionError, match=r"(?s)1 of 4 entries.*at \(0,\).*tolerance 2 x 0 \+"):
        assert_close_to_reference(torch.tensor([1.0015, 2.0, math.nan, -math.inf]), ref, eager)
    with pytest.raises(AssertionError, match=r"(?s)1 of 4 entries.*max abs err 0\.003.*at \(1,\)"):
        assert_close_to_reference(torch.tensor([1.0, 2.003, math.nan, -math.inf]), ref, eager)
    with pytest.raises(AssertionError, match=r"(?s)actual: 4 values, 0 NaN, 1 inf.*at \(2,\)"):
        assert_close_to_reference(torch.tensor([1.0, 2.0, 0.0, -math.inf]), ref, eager)


def test_assert_helper_tolerance_per_row_and_scale():
    """A 2-D tensor's entries share their row's eager error (a row of a gradient comes out of the
    same reductions); the atol is two fp32 ulps of the row's largest |ref| by default, of the given
    ``scale`` otherwise (a float for every entry, a tensor per entry)."""
    ref = torch.tensor([[1.0, 1.0], [1.0, 1.0]], dtype=torch.float64)
    eager = torch.tensor([[1.0, 1.001], [1.0, 1.0]])  # row 0 is 1e-3 off somewhere, row 1 exact
    assert_close_to_reference(torch.tensor([[1.0019, 1.0], [1.0, 1.0]]), ref, eager)
    with pytest.raises(AssertionError, match=r"(?s)1 of 4 entries.*at \(1, 0\)"):
        assert_close_to_reference(torch.tensor([[1.0, 1.0], [1.0001, 1.0]]), ref, eager)
    ulp_off = torch.tensor([[1.0, 1.0], [1.0, 1.0 + 2**-22]])  # 2 fp32 ulps at 1: the default atol
    assert_close_to_reference(ulp_off, ref, ref.float())
    with pytest.raises(AssertionError, match=r"at \(1, 1\)"):
        assert_close_to_reference(ulp_off, ref, ref.float(), scale=0.5)
    assert_close_to_reference(ulp_off, ref, ref.float(), scale=torch.tensor([0.5, 1.0]))  # per column


def test_eager_backend_is_the_reference():
    logits = _random_logits(5, 300, seed=11)
    labels = _finite_labels(logits, seed=11)
    got = token_logprobs_and_entropy(logits, labels, 0.7, backend="eager")
    want = eager_token_logprobs_and_entropy(logits, labels, 0.7)
    assert all(torch.equal(a, b) for a, b in zip(got, want))


@pytest.mark.parametrize(
    ("change", "error"),
    [
        pytest.param(lambda z, y: (z, y - y - 1), r"labels must be in \[0, V\)", id="label-negative"),
        pytest.param(lambda z, y: (z, y.fill_(100)), r"\[0, 100\), got min 100", id="label-eq-V"),
        pytest.param(lambda z, y: (z, y[:-1]), "labels must be", id="labels-short"),
        pytest.param(lambda z, y: (z[0], y), "logits must be 2-D", id="logits-1d"),
        pytest.param(lambda z, y: (z.long(), y), "logits dtype", id="logits-int"),
        pytest.param(lambda z, y: (z, y.float()), "labels must be int64 or int32", id="labels-float"),
        pytest.param(lambda z, y: (z, y.to("meta")), "labels is on meta", id="labels-device"),
    ],
)
@pytest.mark.parametrize("backend", BACKENDS)
def test_bad_inputs(change, error, backend):
    logits, labels = change(torch.randn(6, 100), torch.randint(0, 100, (6,)))
    with pytest.raises(ValueError, match=error):
        token_logprobs_and_entropy(logits, labels, backend=backend)


def test_bad_options(monkeypatch):
    logits, labels = torch.randn(2, 10), torch.tensor([1, 2])
    with pytest.raises(ValueError, match="unknown backend 'cuda'"):
        token_logprobs_and_entropy(logits, labels, backend="cuda")
    for t in (0.0, -1.0, math.inf, math.nan):
        with pytest.raises(ValueError, match="temperature must be finite and > 0"):
            token_logprobs_and_entropy(logits, labels, t)
    monkeypatch.setenv("TRITON_INTERPRET", "0")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="TRITON_INTERPRET=1"):
            token_logprobs_and_entropy(logits, labels, backend="triton")
    with pytest.raises(ValueError, match="float64 is not supported by backend='torch_chunked'"):
        token_logprobs_and_entropy(logits.double(), labels, backend="torch_chunked")


_COMPILE_FOR_SM90 = textwrap.dedent(
    """
    # Written against triton 3.9: ASTSource + GPUTarget compile without a GPU (ptxas is bundled).
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from csrc_triton import token_logprobs as k

    vec = {"labels_ptr": "*i64", "V": "i32", "stride_logits_n": "i32", "inv_temperature": "fp32",
           "threshold_ptr": "*fp32"}
    for dt in ("bf16", "fp16", "fp32"):
        block_v, num_warps = k._launch_config(151936)
        fwd = {"logits_ptr": f"*{dt}", "logp_ptr": "*fp32", "entropy_ptr": "*fp32",
               "row_max_ptr": "*fp32", "log_norm_ptr": "*fp32", **vec}
        bwd = {"logits_ptr": f"*{dt}", "grad_logits_ptr": f"*{dt}", "grad_logp_ptr": "*fp32",
               "grad_entropy_ptr": "*fp32", "row_max_ptr": "*fp32", "log_norm_ptr": "*fp32",
               "entropy_ptr": "*fp32", "stride_grad_n": "i32", **vec}
        kernels = [(k._token_logprobs_fwd_kernel, fwd, {"BLOCK_V": block_v}),
                   (k._token_logprobs_bwd_kernel, bwd, {"BLOCK_V": block_v, "ROUND_BF16_IN_SOFTWARE": False})]
        # HAS_THRESHOLD: top-k / top-p sampling's masked log-sum-exp, and without it
        for (fn, sig, const), has in ((kern, h) for kern in kernels for h in (False, True)):
            const = {**const, "HAS_THRESHOLD": has}
            sig = {name: sig[name] for name in fn.arg_names if name in sig}
            compiled = triton.compile(ASTSource(fn=fn, signature=sig, constexprs=const),
                                      target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps})
            assert compiled.asm["cubin"], fn.__name__
    print("ok")
    """
)


def test_kernels_compile_for_sm90():
    """The interpreter forgives what the compiler rejects: compile both kernels for an H100/H200."""
    pytest.importorskip("triton.backends.nvidia")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_DEFAULT_FP_FUSION"] = "1"
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    result = subprocess.run(
        [sys.executable, "-c", _COMPILE_FOR_SM90],
        cwd=root,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert result.returncode == 0 and result.stdout.strip().endswith("ok"), result.stderr[-3000:]


@pytest.mark.gpu
def test_real_shape_on_gpu():
    """V = 151,936, N = 8,192 bf16 on CUDA; 256 rows checked against float64 (batch invariance
    makes the rows of the full call the rows of a small one)."""
    n, v, device = 8192, 151936, torch.device("cuda")
    g = torch.Generator(device=device).manual_seed(12)
    logits = (3 * torch.randn(n, v, generator=g, device=device)).to(torch.bfloat16).requires_grad_()
    labels = torch.randint(0, v, (n,), generator=g, device=device)
    g_lp, g_h = torch.randn(n, generator=g, device=device), torch.randn(n, generator=g, device=device)
    lp, h = token_logprobs_and_entropy(logits, labels, 0.7, backend="triton")
    (lp * g_lp + h * g_h).sum().backward()
    rows = torch.linspace(0, n - 1, 256, device=device).long()
    sub = logits.detach()[rows]

    def run(z):
        z = z.requires_grad_()
        a, b = eager_token_logprobs_and_entropy(z, labels[rows], 0.7)
        (a * g_lp[rows].to(a.dtype) + b * g_h[rows].to(b.dtype)).sum().backward()
        return a, b, z.grad

    ref = run(sub.double())
    eager = run(sub.clone())
    zs = logit_scale(sub, 0.7)
    gs = logit_grad_scale(sub, labels[rows], 0.7, g_lp[rows], g_h[rows])
    for name, a, r, e, scale in zip(
        ("logprobs", "entropy", "grad_logits"),
        (lp[rows], h[rows], logits.grad[rows]),
        ref,
        eager,
        (zs + ref[0].detach().abs().cpu(), zs, gs),
    ):
        assert_close_to_reference(a, r, e, name=name, scale=scale)
