"""Exact log-probs under truncated sampling (``rollout.top_k``, ``rollout.top_p``): the kept set by
hand and against vLLM's own algorithm, the label rule, ties and padding; every backend and the
fused head against the float64 reference (values and gradients); the memory; the config keys and
what reaches the samplers and the trainer. The real vLLM engine: ``tests/test_vllm_truncated.py``."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.algo.core import eager_token_logprobs_and_entropy, truncated_logits, truncation_threshold
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.ops import fused_linear_grpo_loss, grpo_loss_from_logits, token_logprobs_and_entropy
from grpo_fast.policy.loss import build_policy_loss, trainer_truncation
from grpo_fast.rollout.sampling import sampling_params
from grpo_fast.testing import (
    assert_close_to_reference,
    backend_device,
    logit_grad_scale,
    output_scales,
    row_upstream_grads,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # the interpreter

S = torch.tensor([[2.0, 1.0, 0.0, -1.0]])  # softmax 0.6439 0.2369 0.0871 0.0321


def _kept(s, top_k=0, top_p=1.0, labels=None):
    labels = torch.zeros(s.shape[0], dtype=torch.long) if labels is None else labels
    return truncated_logits(s, labels, truncation_threshold(s, top_k, top_p)).isfinite()


def test_kept_sets_by_hand():
    assert _kept(S, top_k=2).tolist() == [[True, True, False, False]]
    # top-p 0.9: the mass above each token is 0, 0.6439, 0.8808 (< 0.9: kept), 0.9679 (left out)
    assert _kept(S, top_p=0.9).tolist() == [[True, True, True, False]]
    assert _kept(S, top_p=0.6).tolist() == [[True, False, False, False]]  # 0.6439 ≥ 0.6 already
    # top-k 3 then top-p 0.7 on the renormalized three (0.6652 0.2447 0.0900): above 0, 0.6652 → 2
    assert _kept(S, top_k=3, top_p=0.7).tolist() == [[True, True, False, False]]
    assert _kept(S, top_k=4).all() and _kept(S).all()  # top-k ≥ V, or nothing: no truncation
    # label 1 under top-k 2: log π = 1 − log(e² + e¹) = −1.31326 (the full one: 1 − 2.44019 = −1.44019)
    logp, entropy = eager_token_logprobs_and_entropy(S.double(), torch.tensor([1]), top_k=2)
    assert logp.item() == pytest.approx(1 - math.log(math.e**2 + math.e), rel=1e-12)
    p = torch.softmax(torch.tensor([2.0, 1.0], dtype=torch.float64), 0)  # H = −Σ p log p over the two
    assert entropy.item() == pytest.approx(-(p * p.log()).sum().item(), rel=1e-12)


def test_the_label_is_kept_ties_are_kept_padding_is_harmless():
    # label 3 is left out by top-k 2 but kept: log π = −1 − logsumexp(2, 1, −1) (not −inf)
    logp, _ = eager_token_logprobs_and_entropy(S.double(), torch.tensor([3]), top_k=2)
    assert logp.item() == pytest.approx(-1 - math.log(math.e**2 + math.e + math.e**-1), rel=1e-12)
    ties = torch.tensor([[3.0, 1.0, 3.0, 3.0, 0.0]])  # the 2nd largest value ties with two others
    assert _kept(ties, top_k=2).tolist() == [[True, False, True, True, False]]
    padded = torch.tensor([[1.0, 0.5, -math.inf, -math.inf]])  # top-k 3 > the 2 finite entries
    assert torch.equal(truncation_threshold(padded, top_k=3), torch.tensor([-math.inf]))


@pytest.mark.parametrize("backend", ["torch_chunked", "triton"])
def test_kernels_keep_the_label(backend):
    """Labels the sampler left out (π_old, π_ref or a later epoch may meet one): both kernels keep
    the label in the set, so its log-prob is finite and the float64 reference's."""
    g = torch.Generator().manual_seed(3)
    z = 3 * torch.randn(16, 300, generator=g)
    labels = z.topk(6, dim=-1).indices[:, 5]  # the 6th most likely token: just left out by top-5
    device = backend_device(backend)
    lp, h = token_logprobs_and_entropy(z.to(device), labels.to(device), 1.0, backend, top_k=5)
    ref, ref_h = eager_token_logprobs_and_entropy(z.double(), labels, 1.0, top_k=5)
    assert lp.isfinite().all()
    torch.testing.assert_close(lp.cpu().double(), ref, rtol=0, atol=1e-5)
    torch.testing.assert_close(h.cpu().double(), ref_h, rtol=0, atol=1e-5)


def _vllm_kept(logits: torch.Tensor, k: int, p: float) -> torch.Tensor:
    """vLLM 0.32's ``apply_top_k_top_p_pytorch`` (v1/sample/ops/topk_topp_sampler.py), line for line
    in fp32: sort ascending, mask below the k-th largest value, softmax + cumulative sum, mask
    where it is ≤ 1 − p (the largest always kept), scatter back."""
    logits_sort, logits_idx = logits.sort(dim=-1, descending=False)
    if k:
        kth = logits_sort.gather(1, torch.full((logits.shape[0], 1), logits.shape[1] - k))
        logits_sort = logits_sort.masked_fill(logits_sort < kth, -float("inf"))
    if p < 1:
        probs_sum = torch.cumsum(logits_sort.softmax(dim=-1), dim=-1)
        mask = probs_sum <= 1 - p
        mask[:, -1] = False
        logits_sort = logits_sort.masked_fill(mask, -float("inf"))
    return logits.scatter(-1, logits_idx, logits_sort).isfinite()


@pytest.mark.parametrize(("k", "p"), [(20, 1.0), (0, 0.9), (20, 0.9), (5, 0.5), (0, 0.99), (50, 0.3)])
def test_same_kept_set_as_vllms_sampler(k, p):
    """400 rows of 1,000 logits, peaked and flat ones (scale 0.3 … 8), after a temperature of 0.7
    (vLLM divides by it first): the same tokens kept as vLLM's own top-k/top-p mask, row by row."""
    g = torch.Generator().manual_seed(k * 7 + int(100 * p))
    scale = torch.logspace(math.log10(0.3), math.log10(8.0), 400)[:, None]
    s = scale * torch.randn(400, 1000, generator=g) / 0.7
    labels = s.argmax(-1)  # a token vLLM keeps (the label rule plays no part)
    ours = truncated_logits(s, labels, truncation_threshold(s, k, p)).isfinite()
    theirs = _vllm_kept(s, k, p)
    assert torch.equal(ours, theirs), f"{int((ours != theirs).any(-1).sum())} rows differ"
    assert (~ours).any(-1).float().mean() > 0.9  # it truncates nearly every row


CASES = [dict(top_k=20), dict(top_p=0.9), dict(top_k=20, top_p=0.9)]
IDS = ["k20", "p0.9", "k20-p0.9"]


@pytest.mark.parametrize("trunc", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["torch_chunked", "triton", "eager"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_token_logprobs_match_float64_reference(dtype, backend, trunc):
    """Log-probs, entropies and the logits gradient (random upstream gradients on both) of the
    truncated distribution, N = 37, V = 1,000 (a −inf tail), T = 0.7; bf16 logits have ties at
    the boundary, kept on both sides alike. A left-out token's gradient is exactly 0."""
    g = torch.Generator().manual_seed(11)
    z = (3 * torch.randn(37, 1000, generator=g)).to(dtype)
    z[:, -40:] = -math.inf
    s64 = z.double() / 0.7
    kept = truncated_logits(s64, s64.argmax(-1), truncation_threshold(s64, **trunc))
    labels = torch.multinomial(torch.softmax(kept, -1), 1, generator=g)[:, 0]  # what the sampler draws
    g_lp, g_h = torch.randn(37, generator=g), torch.randn(37, generator=g)

    def run(fn, dt, device, **kw):
        logits = z.to(dt).to(device, copy=True).requires_grad_()
        lp, h = fn(logits, labels.to(device), 0.7, **kw, **trunc)
        (lp * g_lp.to(device).to(lp.dtype) + h * g_h.to(device).to(h.dtype)).sum().backward()
        return lp, h, logits.grad

    eager = lambda logits, labels, t, **kw: eager_token_logprobs_and_entropy(logits, labels, t, **kw)
    ours = run(token_logprobs_and_entropy, dtype, backend_device(backend), backend=backend)
    ref = run(eager, torch.float64, torch.device("cpu"))
    base = run(eager, dtype, torch.device("cpu"))
    # each entry's scale (grpo_fast.testing): the truncated logits' (left-out entries −inf carry no
    # probability), so the gradient's is that of the kept softmax
    scales = output_scales(kept * 0.7, 0.7, ref[0])
    grad_scale = logit_grad_scale(kept * 0.7, labels, 0.7, g_lp, g_h)
    row = (scales["logprobs"], scales["entropy"])
    for name, a, r, e, scale in zip(
        ("logprobs", "entropy", "grad_logits"), ours, ref, base, (*row, grad_scale)
    ):
        assert_close_to_reference(a, r, e, name=name, scale=scale)
    left_out = ~kept.isfinite()
    assert left_out.float().mean() > 0.9 and torch.equal(
        ours[2].cpu()[left_out], torch.zeros(int(left_out.sum()))
    )
    full = eager_token_logprobs_and_entropy(z.double(), labels, 0.7)[0]
    assert (full - ref[0]).abs().min() > 1e-3  # log Σ_kept π: visibly other log-probs (fp32 error ≈ 1e-6)


def _fused_problem(n=44, d=48, v=4099, seed=0, temperature=0.7, **trunc):
    """hidden ``[n, d]``, weight ``[v, d]``, labels drawn from the truncated sampler at the
    temperature, advantages, weights, and π_old / π_ref near the truncated log-probs (ratios
    e^±0.5, KL of a few tenths)."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(n, d, generator=g)
    weight = 3 * torch.randn(v, d, generator=g) / math.sqrt(d)
    s64 = (hidden.double() @ weight.double().t()) / temperature
    kept = truncated_logits(s64, s64.argmax(-1), truncation_threshold(s64, **trunc))
    labels = torch.multinomial(torch.softmax(kept, -1), 1, generator=g)[:, 0]
    logp64 = torch.log_softmax(kept, -1).gather(1, labels[:, None])[:, 0]
    adv = torch.randn(n, generator=g)
    w = torch.full((n,), 1 / n)
    old = (logp64 - 0.5 * (2 * torch.rand(n, generator=g, dtype=torch.float64) - 1)).float()
    ref = (logp64 + 0.3 * torch.randn(n, generator=g, dtype=torch.float64)).float()
    return hidden, weight, labels, adv, w, old, ref, kept


@pytest.mark.parametrize("trunc", CASES, ids=IDS)
@pytest.mark.parametrize("backend", ["torch_chunked", "triton"])
@pytest.mark.parametrize("mode", ["one-pass", "two-pass"])
def test_fused_head_matches_float64_reference(mode, backend, trunc):
    """``fused_linear_grpo_loss`` in chunks of 12 rows (44 rows: a tail of 8), off-policy with
    β = 0.04 and an entropy bonus, against the reference on the materialized logits; the two-pass
    mode keeps each chunk's thresholds for its gradient pass."""
    hidden, weight, labels, adv, w, old, ref_lp, kept = _fused_problem(**trunc)
    opts = dict(temperature=0.7, beta=0.04, entropy_coef=0.01, clip_high=0.28, **trunc)
    device = backend_device(backend)

    def run(fn, dt, dev, **kw):
        h = hidden.to(dev, dt, copy=True).requires_grad_()
        wt = weight.to(dev, dt, copy=True).requires_grad_()
        args = [x.to(dev) for x in (labels, adv, w)]
        out = fn(h, wt, *args, old_logprobs=old.to(dev), ref_logprobs=ref_lp.to(dev), **opts, **kw)
        (0.7 * out.loss).backward()
        return out, h.grad, wt.grad

    materialized = lambda h, wt, *a, **kw: grpo_loss_from_logits(h @ wt.t(), *a, backend="eager", **kw)
    ours = run(fused_linear_grpo_loss, torch.float32, device, backend=backend, chunk_size=12,
               two_pass=mode == "two-pass")  # fmt: skip
    ref = run(materialized, torch.float64, torch.device("cpu"))
    eager = run(materialized, torch.float32, torch.device("cpu"))
    # each entry's scale (grpo_fast.testing): the truncated logits' (left-out entries −inf carry no
    # probability), with the lm_head GEMM's terms |h|·|W|ᵀ that every output of a row inherits
    terms = hidden.double().abs() @ weight.double().abs().t()
    z_kept = kept * 0.7
    scales = output_scales(z_kept, 0.7, ref[0].logprobs, ref_lp, "k3", terms=terms)
    loss_scale = sum(abs(x.item()) for x in ref[0].parts)
    assert_close_to_reference(ours[0].loss, ref[0].loss, eager[0].loss, name="loss", scale=loss_scale)
    for name, scale in scales.items():
        a, r, e = (getattr(x[0], name) for x in (ours, ref, eager))
        assert_close_to_reference(a, r, e, name=name, scale=scale)
    # the gradients: the kept softmax's ∂/∂z scale through the two GEMMs (lm_head_grad_scales'
    # rule on the truncated logits); the weight's sums one GEMM per chunk (4 chunks of ≤ 12 rows)
    rows = dict(old_logprobs=old, ref_logprobs=ref_lp, **opts)
    g_lp, g_h = row_upstream_grads(hidden.double() @ weight.double().t(), labels, adv, w, 0.7, **rows)
    dz = logit_grad_scale(z_kept, labels, 0.7, g_lp, g_h, terms=terms)
    grad_scales = (dz @ weight.double().abs(), 4 * dz.t() @ hidden.double().abs())
    for name, a, r, e, scale in zip(
        ("grad_hidden", "grad_weight"), ours[1:], ref[1:], eager[1:], grad_scales
    ):
        assert_close_to_reference(a, r, e, name=name, scale=scale)


def test_fused_head_memory_is_one_chunk_whatever_n():
    """The thresholds are taken 16 rows at a time from each chunk's logits: with top-p the op's
    peak grows by less than one chunk of logits, and by the same at N = 512 as at N = 1,024."""
    from grpo_fast.obs.memory import tracked_peak_bytes

    v, chunk = 8192, 256

    def peak(n, **trunc):
        hidden, weight, labels, adv, w, old, _, _ = _fused_problem(n=n, d=32, v=v, seed=1, top_p=0.9)
        hidden.requires_grad_(), weight.requires_grad_()

        def step():
            fused_linear_grpo_loss(hidden, weight, labels, adv, w, old_logprobs=old, chunk_size=chunk,
                                   backend="torch_chunked", **trunc).loss.backward()  # fmt: skip
            hidden.grad = weight.grad = None

        return tracked_peak_bytes(step)

    extra = [peak(n, top_p=0.9) - peak(n) for n in (512, 1024)]
    assert 0 < extra[0] < chunk * v * 4  # less than one [256, V] fp32 chunk
    assert extra[1] == pytest.approx(extra[0], rel=0.05, abs=4 * 1024)  # 4 fp32 per row more at most


def test_config_keys_reach_the_samplers_and_the_trainer():
    cfg = load_config("tiny", overrides=["rollout.top_k=5", "rollout.top_p=0.9"])
    assert sampling_params(cfg.rollout).top_k == 5 and sampling_params(cfg.rollout).top_p == 0.9
    assert sampling_params(cfg.rollout, for_eval=True).top_k == 0  # greedy eval: no truncation
    assert trainer_truncation(cfg) == (5, 0.9)  # auto: on, since the sampler truncates
    assert trainer_truncation(load_config("tiny")) == (0, 1.0)
    assert trainer_truncation(
        load_config("tiny", overrides=["rollout.top_p=0.9", "loss.truncated_logprobs=false"])
    ) == (0, 1.0)
    assert trainer_truncation(
        load_config("tiny", overrides=["rollout.top_k=3", "loss.truncated_logprobs=true"])
    ) == (3, 1.0)
    from grpo_fast.task import tiny

    policy = build_policy_loss(cfg, tiny.build_model(tiny.build_tokenizer(), seed=0), None)
    assert (policy.top_k, policy.top_p) == (5, 0.9)
    with pytest.raises(
        ConfigError, match=r"^config key 'rollout\.top_k' .*could not be converted to Integer"
    ):
        load_config("tiny", overrides=["rollout.top_k=2.5"])
    with pytest.raises(ConfigError, match=r"^rollout\.top_k must be >= 0, got -1"):
        load_config("tiny", overrides=["rollout.top_k=-1"])
    with pytest.raises(
        ConfigError, match=r"^loss\.truncated_logprobs='maybe' is not one of: auto, true, false"
    ):
        load_config("tiny", overrides=["loss.truncated_logprobs=maybe"])
    with pytest.raises(ConfigError, match=r"^loss\.truncated_logprobs=true needs a truncating sampler"):
        load_config("tiny", overrides=["loss.truncated_logprobs=true"])


def test_hf_backend_hands_top_k_to_its_sampler(monkeypatch):
    """The hf backend's decode draws every token with the run's temperature, top-k (0 = off) and
    top-p (applied in that order, as vLLM; tests/test_rollout_hf.py checks the draws)."""
    from grpo_fast.rollout.hf import decoder
    from grpo_fast.task import tiny

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    seen = []
    original = decoder.sample_next

    def spy(logits, params, *rest):  # rest: the backend's generator
        seen.append((params.temperature, params.top_k, params.top_p))
        return original(logits, params, *rest)

    monkeypatch.setattr(decoder, "sample_next", spy)
    cfg = load_config("tiny", overrides=["rollout.top_k=4", "rollout.top_p=0.8", "rollout.group_size=2"])
    params = sampling_params(cfg.rollout)
    decoder.HFBackend(model, tok, 8).generate([tok("1+2=")["input_ids"]], params)
    assert seen and set(seen) == {(params.temperature, 4, 0.8)}


def test_probe_pass_reads_the_full_vocabulary():
    """``PolicyLoss(..., truncated=False)`` (the weight-sync probe; vLLM's prompt log-probs are the
    full vocabulary's) gives the untruncated log-probs; the default call the truncated ones."""
    from grpo_fast.policy.batch import Sequence, make_microbatches
    from grpo_fast.task import tiny

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    cfg = load_config("tiny", overrides=["rollout.top_k=3"])
    mb = make_microbatches([Sequence(tok("12+34=46")["input_ids"], 6, 1.0, 0.5)], 1, tok.pad_token_id, False)[
        0
    ]
    policy = build_policy_loss(cfg, model, None)
    plain = build_policy_loss(load_config("tiny"), model, None)
    with torch.no_grad():
        full = plain(mb, LossOptions(), 1.0).logprobs
        assert torch.equal(policy(mb, LossOptions(), 1.0, truncated=False).logprobs, full)
        trunc = policy(mb, LossOptions(), 1.0).logprobs
    assert (trunc - full).min() > 1e-3  # log π − log Σ_kept π > log π: the kept mass is below 1
