"""grpo_loss_from_logits against the float64 eager reference, on both kernel backends.

Every case checks loss, logprobs, entropy, kl and the logits gradient (upstream gradient 0.7 on
the loss) with the 2×-eager tolerance, and ``clipped`` exactly.
"""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.algo.core import GRPOLossOutput, eager_grpo_loss_from_logits, grpo_token_loss
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.ops import grpo_loss_from_logits
from grpo_fast.testing import (
    GRPOInputs,
    assert_close_to_reference,
    backend_device,
    logit_grad_scale,
    logit_scale,
    make_grpo_inputs,
    output_scales,
    row_upstream_grads,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy, interpreter

BACKENDS = ["torch_chunked", "triton"]
DTYPES = [pytest.param(torch.float32, id="fp32"), pytest.param(torch.bfloat16, id="bf16")]
SHAPES = [pytest.param(37, 1000, id="N37-V1000"), pytest.param(16, 32003, id="N16-V32003")]

# name -> (make_grpo_inputs flags, loss options)
CASES = {
    "on-policy": (dict(), dict()),
    "clip-both-sides-T0.7": (dict(off_policy=True), dict(temperature=0.7, clip_low=0.2, clip_high=0.28)),
    "dual-clip": (dict(off_policy=True), dict(dual_clip=3.0)),
    "k1-beta": (dict(with_ref=True), dict(beta=0.1, kl_estimator="k1")),
    "k2-beta": (dict(with_ref=True), dict(beta=0.1, kl_estimator="k2")),
    "k3-beta-entropy": (dict(off_policy=True, with_ref=True), dict(beta=0.04, entropy_coef=0.01)),
    "entropy-bonus": (dict(), dict(temperature=1.3, entropy_coef=0.05)),
    "reinforce-off-policy": (dict(off_policy=True), dict(loss_type="reinforce_with_baseline")),
    "cispo-off-policy": (
        dict(off_policy=True, with_ref=True),
        dict(loss_type="cispo", beta=0.04, clip_high=0.28),
    ),
    # δ = 3 caps the r = 4 tokens (A < 0), as the dual clip does; δ = 1.3 also caps r = 1.5
    "delta-clip": (dict(off_policy=True), dict(delta=3.0)),
    "delta-reinforce": (dict(off_policy=True), dict(loss_type="reinforce_with_baseline", delta=1.3)),
    # GSPO: sequences of 3 rows (the last one shorter), each row's ratio its sequence's
    "gspo-off-policy": (
        dict(off_policy=True, with_ref=True),
        dict(importance_sampling_level="sequence", beta=0.04),
    ),
    "gspo-cispo": (dict(off_policy=True), dict(importance_sampling_level="sequence", loss_type="cispo")),
    # SAPO's gate on ratios 0.3 … 4 of both signs of A (nothing clipped; GSPO's: the fused head's test)
    "sapo-off-policy": (
        dict(off_policy=True, with_ref=True),
        dict(loss_type="sapo", beta=0.04, sapo_tau_neg=1.3),
    ),
    # 80/20: the pg term on the top 30% entropy rows of the call (KL and bonus on all)
    "top-entropy-0.3": (
        dict(off_policy=True, with_ref=True),
        dict(top_entropy_quantile=0.3, beta=0.04, entropy_coef=0.01),
    ),
}


def _run(fn, inputs: GRPOInputs, dtype: torch.dtype, device: torch.device, **options):
    """``(output, logits.grad)`` of ``fn`` with upstream gradient 0.7 on the loss."""
    logits = inputs.logits.to(dtype).to(device, copy=True).requires_grad_()
    on = lambda t: None if t is None else t.to(device)
    out = fn(
        logits,
        inputs.labels.to(device),
        inputs.advantages.to(device),
        inputs.loss_weights.to(device),
        old_logprobs=on(inputs.old_logprobs),
        ref_logprobs=on(inputs.ref_logprobs),
        **options,
    )
    (0.7 * out.loss).backward()
    return out, logits.grad


def _loss_terms_size(ref: GRPOLossOutput, inputs: GRPOInputs, **options) -> float:
    """``Σ_t |w_t·ℓ_t|`` in float64: the size of what the scalar loss sums (its rounding scale)."""
    as64 = lambda t: None if t is None else t.double()
    per_token, _ = grpo_token_loss(
        ref.logprobs.detach(),
        inputs.advantages.double(),
        LossOptions.build(**{k: v for k, v in options.items() if k not in ("temperature", "sequence_ids")}),
        old_logprobs=as64(inputs.old_logprobs),
        ref_logprobs=as64(inputs.ref_logprobs),
        entropy=ref.entropy.detach(),
        sequence_ids=options.get("sequence_ids"),
    )
    return (inputs.loss_weights.double() * per_token).abs().sum().item()


def _check_against_reference(
    inputs: GRPOInputs, dtype: torch.dtype, backend: str, **options
) -> GRPOLossOutput:
    cpu = torch.device("cpu")
    ours, grad = _run(
        grpo_loss_from_logits, inputs, dtype, backend_device(backend), backend=backend, **options
    )
    ref, grad64 = _run(eager_grpo_loss_from_logits, inputs, torch.float64, cpu, **options)
    eager, grad_eager = _run(eager_grpo_loss_from_logits, inputs, dtype, cpu, **options)
    scales = output_scales(
        inputs.logits.to(dtype),
        options.get("temperature", 1.0),
        ref.logprobs,
        inputs.ref_logprobs,
        options.get("kl_estimator", "k3"),
    )
    scales["loss"] = _loss_terms_size(ref, inputs, **options)
    for name in ("loss", "logprobs", "entropy", "kl"):
        a, r, e = getattr(ours, name), getattr(ref, name), getattr(eager, name)
        assert (a is None) == (r is None), name
        if a is not None:
            assert a.dtype == torch.float32, name
            assert_close_to_reference(a, r, e, name=name, scale=scales[name])
    assert torch.equal(ours.clipped.cpu(), ref.clipped), "clipped differs from the float64 reference"
    rows = dict(old_logprobs=inputs.old_logprobs, ref_logprobs=inputs.ref_logprobs, **options)
    g_lp, g_h = row_upstream_grads(
        inputs.logits.to(dtype), inputs.labels, inputs.advantages, inputs.loss_weights, 0.7, **rows
    )
    temperature = options.get("temperature", 1.0)
    grad_scale = logit_grad_scale(inputs.logits.to(dtype), inputs.labels, temperature, g_lp, g_h)
    assert_close_to_reference(grad, grad64, grad_eager, name="grad_logits", scale=grad_scale)
    return ours


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("n", "v"), SHAPES)
@pytest.mark.parametrize("case", list(CASES))
def test_matches_float64_reference(case, n, v, dtype, backend):
    flags, options = CASES[case]
    inputs = make_grpo_inputs(n, v, dtype=dtype, seed=v, temperature=options.get("temperature", 1.0), **flags)
    if options.get("importance_sampling_level") == "sequence":
        options = dict(options, sequence_ids=torch.arange(n) // 3)
    ours = _check_against_reference(inputs, dtype, backend, **options)
    ref = eager_grpo_loss_from_logits(
        inputs.logits.double(), inputs.labels, inputs.advantages, inputs.loss_weights,
        old_logprobs=inputs.old_logprobs, ref_logprobs=inputs.ref_logprobs, **options,
    )  # fmt: skip
    if flags.get("off_policy"):
        clipped = ours.clipped.cpu()
        a = inputs.advantages
        ratio = torch.exp(ref.logprobs.detach().float() - inputs.old_logprobs)
        if "sequence_ids" in options:  # sequence ratios (the advantages here differ per token)
            assert clipped.any() and not clipped.all()
        elif options.get("loss_type", "grpo_clip") in ("grpo_clip", "cispo"):
            assert (clipped & (a > 0)).any() and (clipped & (a < 0)).any(), "both clip sides must be active"
        elif "delta" in options:  # capped exactly where r > δ
            assert clipped.any() and torch.equal(clipped, ratio > options["delta"])
        else:  # the same ratios, never clipped
            assert not clipped.any()


# The math's domain (LossOptions), wider than a training run's loss.* keys (loss.clip_low < 1,
# loss.beta >= 0): what the ops accepted before LossOptions existed, and what the course API's
# cliprange >= 1 needs. Each against the float64 reference, and what it means against the defaults
# (clip 0.2 on both sides, no dual clip, beta 0) on the same inputs: ratios 0.3 ... 4 of both signs
# of A, each >= 6 % away from 0.8 and 1.2 (make_grpo_inputs).
WIDER = {
    "clip_low=1.5": dict(clip_low=1.5),  # [1 − 1.5, 1.2] = [−0.5, 1.2]: no lower clip (r > 0)
    "clip_high=inf": dict(clip_high=math.inf),  # [0.8, inf]: no upper clip
    "dual_clip=inf": dict(dual_clip=math.inf),  # −min(ℓ, inf·|A|) = ℓ: no dual bound
    "beta=-0.1": dict(beta=-0.1),  # −0.1·KL: a bonus for distance from π_ref
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", list(WIDER))
def test_the_ops_take_the_math_s_domain_not_a_training_run_s(case, backend):
    options = WIDER[case]
    inputs = make_grpo_inputs(37, 1000, seed=1000, off_policy=True, with_ref=True)
    ours = _check_against_reference(inputs, torch.float32, backend, **options)
    base, _ = _run(grpo_loss_from_logits, inputs, torch.float32, backend_device(backend), backend=backend)
    ours, base = (GRPOLossOutput(*(t.cpu() if torch.is_tensor(t) else t for t in o)) for o in (ours, base))
    ratio = torch.exp(base.logprobs - inputs.old_logprobs)
    if case == "clip_low=1.5":  # the r < 0.8 tokens (clipped for A < 0) are clipped no more
        assert (base.clipped & (ratio < 0.8)).any()
        assert torch.equal(ours.clipped, base.clipped & (ratio > 1))
    elif case == "clip_high=inf":  # the r > 1.2 tokens (clipped for A > 0) are clipped no more
        assert (base.clipped & (ratio > 1.2)).any()
        assert torch.equal(ours.clipped, base.clipped & (ratio < 1))
    elif case == "dual_clip=inf":  # the same call as no dual clip, bit for bit
        assert torch.equal(ours.loss, base.loss) and torch.equal(ours.clipped, base.clipped)
    else:  # loss(β) = loss(0) + β·Σ_t w_t·KL_t
        kl_term = -0.1 * (inputs.loss_weights * ours.kl).sum()
        assert kl_term.abs() > 1e-3
        torch.testing.assert_close(ours.loss, base.loss + kl_term)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_neg_inf_tail_and_huge_logits(backend, dtype):
    g = torch.Generator().manual_seed(2)
    logits = 3 * torch.randn(24, 4099, generator=g)
    logits[:, -99:] = -math.inf  # padded vocabulary
    logits[::4, ::7] = 1e4
    logits[1::4, ::5] = -1e4
    logits[2::4] += 1e4
    inputs = make_grpo_inputs(24, 4099, dtype=dtype, off_policy=True, with_ref=True, logits=logits.to(dtype))
    _check_against_reference(inputs, dtype, backend, beta=0.04, entropy_coef=0.01)


@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_clipping(backend):
    """Uniform logits over V = 4: logp = −ln 4 for every label, p_j = 1/4, ∂logp/∂z = δ − 1/4.

    Token 0: A = +1, old = logp − 0.5 -> r = e^0.5 ≈ 1.6487 > 1.2: clipped, ℓ = −1.2·1, no gradient.
    Token 1: A = −1, old = logp + ln 2 -> r = 0.5 < 0.8: clipped, ℓ = −(0.8·(−1)) = 0.8, no gradient.
    Token 2: A = +2, old = logp -> r = 1: ℓ = −2, ∂ℓ/∂logp = −r·A = −2.
    Weights 1: loss = −1.2 + 0.8 − 2 = −2.4.
    """
    device = backend_device(backend)
    logp = -math.log(4.0)
    logits = torch.zeros(3, 4, device=device).requires_grad_()
    out = grpo_loss_from_logits(
        logits * 1.0,
        torch.tensor([0, 1, 2], device=device),
        torch.tensor([1.0, -1.0, 2.0], device=device),
        torch.ones(3, device=device),
        old_logprobs=torch.tensor([logp - 0.5, logp + math.log(2.0), logp], device=device),
        backend=backend,
    )
    torch.testing.assert_close(out.loss.cpu(), torch.tensor(-2.4))
    torch.testing.assert_close(out.logprobs.cpu(), torch.full((3,), logp))
    assert out.clipped.tolist() == [True, True, False]
    out.loss.backward()
    expected = torch.zeros(3, 4)
    expected[2] = -2.0 * (torch.tensor([0.0, 0.0, 1.0, 0.0]) - 0.25)  # −2·(δ − p)
    torch.testing.assert_close(logits.grad.cpu(), expected)


@pytest.mark.parametrize("loss_type", ["reinforce_with_baseline", "no_baseline"])
@pytest.mark.parametrize("backend", BACKENDS)
def test_hand_worked_unclipped_loss_types(backend, loss_type):
    """The tokens of ``test_hand_worked_clipping`` with ``ℓ = −r·A``, never clipped.

    Token 0: r = e^0.5 ≈ 1.6487, A = +1: ℓ ≈ −1.6487, ∂ℓ/∂logp = −r·A ≈ −1.6487.
    Token 1: r = 0.5, A = −1: ℓ = 0.5, ∂ℓ/∂logp = 0.5.
    Token 2: r = 1, A = +2: ℓ = −2, ∂ℓ/∂logp = −2.
    Weights 1: loss ≈ −1.6487 + 0.5 − 2 = −3.1487; ∂/∂logits = ∂ℓ/∂logp·(δ − 1/4).
    """
    device = backend_device(backend)
    logp = -math.log(4.0)
    logits = torch.zeros(3, 4, device=device).requires_grad_()
    out = grpo_loss_from_logits(
        logits * 1.0,
        torch.tensor([0, 1, 2], device=device),
        torch.tensor([1.0, -1.0, 2.0], device=device),
        torch.ones(3, device=device),
        old_logprobs=torch.tensor([logp - 0.5, logp + math.log(2.0), logp], device=device),
        loss_type=loss_type,
        backend=backend,
    )
    torch.testing.assert_close(out.loss.cpu(), torch.tensor(-math.exp(0.5) + 0.5 - 2.0))
    assert out.clipped.tolist() == [False, False, False]
    out.loss.backward()
    g = torch.tensor([-math.exp(0.5), 0.5, -2.0])
    torch.testing.assert_close(logits.grad.cpu(), g[:, None] * (torch.eye(4)[:3] - 0.25))


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_inplace_grad_same_gradient(backend, dtype):
    device = backend_device(backend)
    inputs = make_grpo_inputs(33, 4099, dtype=dtype, off_policy=True, with_ref=True)

    def grad(inplace: bool) -> torch.Tensor:
        leaf = inputs.logits.to(device, copy=True).requires_grad_()
        out = grpo_loss_from_logits(
            leaf * 1.0,
            inputs.labels.to(device),
            inputs.advantages.to(device),
            inputs.loss_weights.to(device),
            old_logprobs=inputs.old_logprobs.to(device),
            ref_logprobs=inputs.ref_logprobs.to(device),
            beta=0.04,
            entropy_coef=0.01,
            backend=backend,
            inplace_grad=inplace,
        )
        out.loss.backward()
        return leaf.grad

    assert torch.equal(grad(True), grad(False))


@pytest.mark.parametrize("backend", BACKENDS)
def test_batch_invariance_bitwise(backend):
    device = backend_device(backend)
    inputs = make_grpo_inputs(45, 4099, off_policy=True)
    args = lambda idx: (
        inputs.logits[idx].to(device),
        inputs.labels[idx].to(device),
        inputs.advantages[idx].to(device),
        inputs.loss_weights[idx].to(device),
    )
    full = grpo_loss_from_logits(
        *args(slice(None)), old_logprobs=inputs.old_logprobs.to(device), backend=backend
    )
    idx = torch.tensor([44, 3, 17, 30])
    part = grpo_loss_from_logits(
        *args(idx), old_logprobs=inputs.old_logprobs[idx].to(device), backend=backend
    )
    assert torch.equal(part.logprobs, full.logprobs[idx.to(device)])
    assert torch.equal(part.entropy, full.entropy[idx.to(device)])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize(
    "options",
    [
        pytest.param(dict(loss_type="cispo", delta=1.3), id="cispo-delta"),
        pytest.param(dict(importance_sampling_level="sequence", clip_low=0.05, clip_high=0.05), id="gspo"),
    ],
)
def test_variants_batch_invariance_bitwise(options, backend):
    """A row's log-prob, clipped flag and logits gradient do not depend on the other rows of the
    call: for CISPO/δ (row-local math) any subset; for GSPO any subset of whole sequences (a
    sequence's ratio is its own rows' mean, summed in row order whatever else is there)."""
    device = backend_device(backend)
    inputs = make_grpo_inputs(45, 4099, off_policy=True, seed=9)
    ids = torch.arange(45) // 5

    def run(idx):
        logits = inputs.logits[idx].to(device).requires_grad_()
        extra = dict(sequence_ids=ids[idx].to(device)) if "importance_sampling_level" in options else {}
        out = grpo_loss_from_logits(
            logits, inputs.labels[idx].to(device), inputs.advantages[idx].to(device),
            inputs.loss_weights[idx].to(device), old_logprobs=inputs.old_logprobs[idx].to(device),
            backend=backend, **options, **extra,
        )  # fmt: skip
        out.loss.backward()
        return out, logits.grad

    full, grad_full = run(torch.arange(45))
    idx = torch.cat([torch.arange(40, 45), torch.arange(0, 5), torch.arange(15, 20)])  # sequences 8, 0, 3
    part, grad_part = run(idx)
    d = idx.to(device)
    assert full.clipped.any()
    assert torch.equal(part.logprobs, full.logprobs[d]) and torch.equal(part.clipped, full.clipped[d])
    assert torch.equal(grad_part, grad_full[d])


@pytest.mark.parametrize("backend", BACKENDS)
def test_nan_logits_propagate(backend):
    device = backend_device(backend)
    inputs = make_grpo_inputs(6, 1000)
    logits = inputs.logits.clone()
    logits[4, 10] = math.nan
    leaf = logits.to(device).requires_grad_()
    out = grpo_loss_from_logits(
        leaf * 1.0,
        inputs.labels.to(device),
        inputs.advantages.to(device),
        torch.full((6,), 1 / 6, device=device),
        entropy_coef=0.01,
        backend=backend,
    )
    assert out.loss.isnan() and out.logprobs[4].isnan() and out.entropy[4].isnan()
    out.loss.backward()
    assert leaf.grad[4].isnan().all() and leaf.grad[:4].isfinite().all()


@pytest.mark.parametrize("backend", BACKENDS)
def test_empty_batch(backend):
    device = backend_device(backend)
    logits = torch.zeros(0, 100, device=device, requires_grad=True)
    empty = torch.zeros(0, device=device)
    out = grpo_loss_from_logits(logits, empty.long(), empty, empty, backend=backend)
    assert out.loss.item() == 0.0 and out.logprobs.shape == out.entropy.shape == (0,)
    out.loss.backward()
    assert logits.grad.shape == (0, 100)


_BAD = [
    pytest.param(dict(advantages=torch.zeros(5)), "advantages must be", id="advantages-shape"),
    pytest.param(
        dict(loss_weights=torch.ones(6, dtype=torch.long)),
        "loss_weights must be a floating",
        id="weights-int",
    ),
    pytest.param(
        dict(old_logprobs=torch.zeros(6, device="meta")), "old_logprobs is on meta", id="old-device"
    ),
    pytest.param(dict(beta=0.1), "beta != 0 needs ref_logprobs", id="beta-no-ref"),
    pytest.param(
        dict(ref_logprobs=torch.zeros(6), kl_estimator="k4"), "kl_estimator='k4' is not one of", id="kl-k4"
    ),
    pytest.param(dict(dual_clip=1.0), "dual_clip must be > 1", id="dual-clip-1"),
    pytest.param(dict(loss_type="ppo"), "loss_type='ppo' is not one of", id="loss-type"),
    pytest.param(
        dict(loss_type="no_baseline", dual_clip=3.0),
        "dual_clip applies only to loss_type='grpo_clip'",
        id="dual-clip-no-baseline",
    ),
    pytest.param(dict(clip_low=-0.1), "clip_low must be >= 0", id="clip-low-neg"),
    pytest.param(dict(clip_high=-0.1), "clip_high must be", id="clip-high-neg"),
    pytest.param(dict(clip_high=math.nan), "clip_high=nan is not a number", id="clip-high-nan"),
    pytest.param(dict(beta=math.inf, ref_logprobs=torch.zeros(6)), "beta=inf is not a finite", id="beta-inf"),
    pytest.param(dict(temperature=0.0), "temperature must be", id="temperature-0"),
    pytest.param(
        dict(labels=torch.full((6,), 50)), r"labels must be in \[0, V\) = \[0, 50\)", id="label-eq-V"
    ),
    pytest.param(dict(backend="fast"), "unknown backend", id="backend"),
]


@pytest.mark.parametrize(("override", "error"), _BAD)
def test_bad_inputs(override, error):
    args = dict(
        logits=torch.randn(6, 50),
        labels=torch.randint(0, 50, (6,)),
        advantages=torch.randn(6),
        loss_weights=torch.ones(6),
    )
    args.update(override)
    with pytest.raises(ValueError, match=error):
        grpo_loss_from_logits(**args)


@pytest.mark.gpu
def test_inplace_grad_memory_on_gpu():
    """fwd + bwd with inplace_grad adds ≤ 10 % of the bf16 logits' size (V = 151,936, N = 8,192)."""
    from grpo_fast.obs.memory import peak_cuda_memory

    n, v, device = 8192, 151936, torch.device("cuda")
    leaf = torch.randn(n, v, device=device, dtype=torch.bfloat16).requires_grad_()
    logits = leaf * 1.0  # the lm_head output; leaf.grad below is the upstream consumer's buffer
    labels = torch.randint(0, v, (n,), device=device)
    adv, weights = torch.randn(n, device=device), torch.full((n,), 1 / n, device=device)
    old = torch.randn(n, device=device) - math.log(v)

    def step() -> None:
        out = grpo_loss_from_logits(logits, labels, adv, weights, old_logprobs=old, inplace_grad=True)
        torch.autograd.grad(out.loss, logits)  # the gradient lands in the logits buffer

    extra = peak_cuda_memory(step)
    budget = 0.10 * logits.numel() * logits.element_size()
    assert extra <= budget, f"inplace fwd+bwd added {extra / 2**20:.1f} MiB > {budget / 2**20:.1f} MiB"


@pytest.mark.gpu
@pytest.mark.parametrize("case", ["clip-both-sides-T0.7", "k3-beta-entropy"])
def test_real_shape_on_gpu(case):
    """V = 151,936, N = 8,192 bf16, triton: every output and the gradient of 256 rows vs float64."""
    flags, options = CASES[case]
    n, v, device = 8192, 151936, torch.device("cuda")
    g = torch.Generator(device).manual_seed(3)
    logits = (3 * torch.randn(n, v, generator=g, device=device)).to(torch.bfloat16)  # inputs built on CUDA
    inputs = make_grpo_inputs(
        n, v, dtype=torch.bfloat16, logits=logits, temperature=options.get("temperature", 1.0), **flags
    )
    ours, grad = _run(grpo_loss_from_logits, inputs, torch.bfloat16, device, backend="triton", **options)
    rows = torch.linspace(0, n - 1, 256).long()
    sub = GRPOInputs(*(None if t is None else t[rows] for t in vars(inputs).values()))
    ref, grad64 = _run(eager_grpo_loss_from_logits, sub, torch.float64, device, **options)
    eager, grad_eager = _run(eager_grpo_loss_from_logits, sub, torch.bfloat16, device, **options)
    zs = logit_scale(sub.logits, options.get("temperature", 1.0))
    scale = {"logprobs": zs + ref.logprobs.detach().abs().cpu(), "entropy": zs}
    for name in ("logprobs", "entropy"):
        assert_close_to_reference(
            getattr(ours, name)[rows.to(device)],
            getattr(ref, name),
            getattr(eager, name),
            name=name,
            scale=scale[name],
        )
    rows_kw = dict(old_logprobs=sub.old_logprobs, ref_logprobs=sub.ref_logprobs, **options)
    g_lp, g_h = row_upstream_grads(sub.logits, sub.labels, sub.advantages, sub.loss_weights, 0.7, **rows_kw)
    grad_scale = logit_grad_scale(sub.logits, sub.labels, options.get("temperature", 1.0), g_lp, g_h)
    assert_close_to_reference(grad[rows.to(device)], grad64, grad_eager, name="grad_logits", scale=grad_scale)
