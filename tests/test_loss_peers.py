"""The loss variants TRL and Liger-Kernel implement too, on the same inputs as grpo_fast's.

Each case is one of TRL's ``loss_type`` values (the length normalization it implies, as loss
weights here: ``grpo``/``sapo`` per-sequence mean, ``dr_grpo`` the constant ``B·L``, ``dapo``/``bnpo``
/``cispo`` the token mean) with the options both sides have: clip-higher, δ, GSPO's sequence-level
ratio, β·k3, the top-entropy quantile and the entropy bonus (TRL only), CISPO and SAPO.
TRL's and Liger's CISPO clip the weight at ``epsilon_high`` itself, with no lower bound: the same
as grpo_fast's ``clip(r, 1 − clip_low, 1 + clip_high)`` for ``1 + clip_high = epsilon_high`` on
ratios above ``1 − clip_low`` (0.01 here).

- TRL 1.16 ``GRPOTrainer._compute_loss`` in float64, on a trainer stand-in (``_trl_loss``), against
  grpo_fast's eager reference in float64: the loss and the logits gradient to 1e-10.
- Liger-Kernel 0.8 ``LigerFusedLinearGRPOLoss`` (it computes in fp32 whatever the input dtype)
  against ``fused_linear_grpo_loss`` in fp32: the loss and both gradients against grpo_fast's
  float64 reference, each within 4x the eager fp32 run's error there (twice our own factor: Liger's
  rounding is not ours to bound), plus the rounding scale of the entry.

Both skip, with the reason, where their package is not importable: they run in the ``peers``
environment (``python3 -m venv .venv-peers && .venv-peers/bin/pip install -e ".[dev,peers]"``,
``.venv-peers/bin/python -m pytest tests/test_loss_peers.py``).
"""

from __future__ import annotations

import math
from collections import defaultdict
from types import SimpleNamespace

import pytest
import torch
from loss_reference import PlainOptions, plain_grpo_loss

from grpo_fast.algo.core import eager_grpo_loss_from_logits
from grpo_fast.algo.loss_options import LOSS_TYPES, LossOptions
from grpo_fast.ops import fused_linear_grpo_loss
from grpo_fast.testing import assert_close_to_reference, lm_head_grad_scales, logit_scale, row_upstream_grads

PEERS_MISSING = (
    "needs the peers extra in its own environment: pip install -e '.[dev,peers]' (trl, liger-kernel)"
)

B, T, V, D = 5, 4, 13, 8
LENGTHS = [4, 2, 3, 4, 1]  # completion lengths (mask)
ADVANTAGES = [1.0, -0.7, 0.4, -1.3, 0.9]
# per response: the ratio r = exp(lp − old) of its tokens (±2 %): clipped high (A > 0), inside,
# inside, capped by δ = 2.5 and bounded low... every branch of the clip with A's sign
RATIOS = [1.6, 0.6, 1.05, 3.2, 0.9]


def _inputs(temperature: float, seed: int = 0):
    """``[B, T]`` completions, the policy's hidden states ``[B, T, D]`` and lm_head ``[V, D]``
    (float64), ``old`` and ``ref`` log-probs ``[B, T]``."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(B, T, D, generator=g, dtype=torch.float64)
    weight = 1.5 * torch.randn(V, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    ids = torch.randint(0, V, (B, T), generator=g)
    mask = (torch.arange(T)[None, :] < torch.tensor(LENGTHS)[:, None]).long()
    logits = hidden @ weight.t() / temperature
    lp = torch.log_softmax(logits, -1).gather(-1, ids[..., None])[..., 0]
    jitter = 1.0 + 0.02 * (2 * torch.rand(B, T, generator=g, dtype=torch.float64) - 1)
    old = lp - (torch.tensor(RATIOS, dtype=torch.float64)[:, None] * jitter).log()
    ref = lp + 0.3 * torch.randn(B, T, generator=g, dtype=torch.float64)
    return dict(hidden=hidden, weight=weight, ids=ids, mask=mask, old=old, ref=ref,
                advantages=torch.tensor(ADVANTAGES, dtype=torch.float64))  # fmt: skip


# (TRL/Liger options, grpo_fast options, length norm); TRL's epsilon_high is CISPO's absolute bound
CASES = {
    "grpo": (dict(loss_type="grpo"), dict(), "sequence_mean"),
    "grpo-clip-higher-T0.7": (dict(loss_type="grpo", epsilon_high=0.28, temperature=0.7), dict(clip_high=0.28), "sequence_mean"),
    "dr_grpo": (dict(loss_type="dr_grpo"), dict(), "constant"),
    "dapo": (dict(loss_type="dapo", epsilon_high=0.28), dict(clip_high=0.28), "token_mean"),
    "bnpo": (dict(loss_type="bnpo"), dict(), "token_mean"),
    "dapo-delta": (dict(loss_type="dapo", delta=2.5), dict(delta=2.5), "token_mean"),
    "grpo-beta-k3": (dict(loss_type="grpo", beta=0.04), dict(beta=0.04, kl_estimator="k3"), "sequence_mean"),
    "gspo": (dict(loss_type="grpo", importance_sampling_level="sequence", epsilon_low=3e-2, epsilon_high=4e-2),
             dict(importance_sampling_level="sequence", clip_low=3e-2, clip_high=4e-2), "sequence_mean"),
    "gspo-dapo-beta": (dict(loss_type="dapo", importance_sampling_level="sequence", beta=0.04),
                       dict(importance_sampling_level="sequence", beta=0.04), "token_mean"),
    "cispo": (dict(loss_type="cispo", epsilon_high=1.28), dict(type="cispo", clip_low=0.99, clip_high=0.28), "token_mean"),
    "cispo-beta": (dict(loss_type="cispo", epsilon_high=2.0, beta=0.04),
                   dict(type="cispo", clip_low=0.99, clip_high=1.0, beta=0.04), "token_mean"),
}  # fmt: skip
if "sapo" in LOSS_TYPES:
    # TRL picks τ with torch.where on Python floats: a float32 tensor (its default τ_neg = 1.05 is
    # 1.0499999523 there), so the cases use τ that fp32 holds exactly
    CASES["sapo"] = (
        dict(loss_type="sapo", sapo_temperature_neg=1.0),
        dict(type="sapo", sapo_tau_neg=1.0),
        "sequence_mean",
    )
    CASES["sapo-taus"] = (dict(loss_type="sapo", sapo_temperature_pos=0.75, sapo_temperature_neg=1.25),
                          dict(type="sapo", sapo_tau_pos=0.75, sapo_tau_neg=1.25), "sequence_mean")  # fmt: skip
# TRL only: the 80/20 top-entropy quantile (a quantile at rank 0.6·13 = 7.8: between two entropies)
# and the entropy bonus (TRL's is a token mean whatever the loss type: the dapo weights)
TRL_ONLY = {
    "dapo-top-entropy": (dict(loss_type="dapo", top_entropy_quantile=0.4), dict(top_entropy_quantile=0.4), "token_mean"),
    "dapo-entropy-bonus": (dict(loss_type="dapo", entropy_coef=0.05), dict(entropy_coef=0.05), "token_mean"),
}  # fmt: skip


def _flat(x: dict, key: str) -> torch.Tensor:
    """``[B, T, ...] -> [N, ...]``: the completion tokens, row-major (what grpo_fast's ops take)."""
    return x[key][x["mask"].bool()]


def _weights(mask: torch.Tensor, length_norm: str) -> torch.Tensor:
    """The loss weights TRL's normalization implies, ``[N]``, written out (not core's)."""
    m = mask.double()
    per_row = {
        "sequence_mean": m / (m.sum(-1, keepdim=True) * B),
        "constant": m / (T * B),
        "token_mean": m / m.sum(),
    }[length_norm]
    return per_row[mask.bool()]


def _ours64(x: dict, ours: dict, length_norm: str, temperature: float, off_policy: bool):
    """grpo_fast's eager reference in float64 on the flattened tokens: ``(output, logits [N, V] leaf)``."""
    logits = (_flat(x, "hidden") @ x["weight"].t()).detach().requires_grad_()
    seq = torch.arange(B)[:, None].expand(B, T)[x["mask"].bool()]
    level = ours.get("importance_sampling_level", "token")
    out = eager_grpo_loss_from_logits(
        logits, _flat(x, "ids"), x["advantages"][:, None].expand(B, T)[x["mask"].bool()],
        _weights(x["mask"], length_norm), old_logprobs=_flat(x, "old") if off_policy else None,
        ref_logprobs=_flat(x, "ref"), temperature=temperature,
        sequence_ids=seq if level == "sequence" else None, options=LossOptions(**ours),
    )  # fmt: skip
    out.loss.backward()
    return out, logits


# ---------------------------------------------------------------------------- TRL


def _trl_loss(logits: torch.Tensor, x: dict, trl_options: dict, off_policy: bool) -> torch.Tensor:
    """TRL's ``GRPOTrainer._compute_loss`` on ``logits [B, T, V]`` (already tempered).

    A reach into TRL's internals, written against trl 1.16.0 (read 2026-12): the method runs on a
    stand-in ``self`` built without ``__init__`` that carries only the attributes the loss reads,
    in eval mode (no gradient-accumulation scaling), one process; the per-token log-probs and
    entropies come from ``logits`` instead of a model forward."""
    from trl import GRPOTrainer

    o = dict(
        epsilon_low=0.2,
        epsilon_high=0.2,
        beta=0.0,
        importance_sampling_level="token",
        delta=None,
        top_entropy_quantile=1.0,
        entropy_coef=0.0,
        sapo_temperature_pos=1.0,
        sapo_temperature_neg=1.05,
    )
    o.update((k, v) for k, v in trl_options.items() if k != "temperature")  # fmt: skip
    log_p = torch.log_softmax(logits, -1)
    per_token_logps = log_p.gather(-1, x["ids"][..., None])[..., 0]
    entropies = -(log_p.exp() * log_p).sum(-1)
    trainer = object.__new__(GRPOTrainer)
    one_process = SimpleNamespace(
        num_processes=1, sync_gradients=True, gather=lambda t: t, gather_for_metrics=lambda t: t,
        reduce=lambda t, reduction="sum": t, pad_across_processes=lambda t, dim=0, pad_index=0: t,
    )  # fmt: skip
    trainer.__dict__.update(
        _get_per_token_logps_and_entropies=lambda *a, **k: (per_token_logps, entropies, None),
        aux_loss_enabled=False, top_entropy_quantile=o["top_entropy_quantile"], off_policy_mask_threshold=None,
        importance_sampling_level=o["importance_sampling_level"], beta=o["beta"], loss_type=o["loss_type"],
        epsilon_low=o["epsilon_low"], epsilon_high=o["epsilon_high"], use_vllm=False,
        vllm_importance_sampling_correction=False, model=SimpleNamespace(training=False),
        current_gradient_accumulation_steps=1, max_completion_length=T, accelerator=one_process,
        _entropy_bonus_enabled=o["entropy_coef"] != 0.0, entropy_coef=o["entropy_coef"],
        use_adaptive_entropy=False, _metrics=defaultdict(lambda: defaultdict(list)),
        args=SimpleNamespace(use_bias_correction_kl=False, delta=o["delta"], steps_per_generation=1,
                             sapo_temperature_pos=o["sapo_temperature_pos"],
                             sapo_temperature_neg=o["sapo_temperature_neg"]),
    )  # fmt: skip
    inputs = dict(
        prompt_ids=torch.zeros(B, 1, dtype=torch.long), prompt_mask=torch.ones(B, 1, dtype=torch.long),
        completion_ids=x["ids"], completion_mask=x["mask"], advantages=x["advantages"],
        ref_per_token_logps=x["ref"], num_items_in_batch=x["mask"].sum().double(),
    )  # fmt: skip
    if off_policy:
        inputs["old_per_token_logps"] = x["old"]
    return trainer._compute_loss(None, inputs)


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("case", [*CASES, *TRL_ONLY])
def test_trl_compute_loss_matches(case, off_policy):
    pytest.importorskip("trl", reason=PEERS_MISSING)
    trl_options, ours, length_norm = {**CASES, **TRL_ONLY}[case]
    temperature = trl_options.get("temperature", 1.0)
    x = _inputs(temperature)
    logits = (x["hidden"] @ x["weight"].t() / temperature).detach().requires_grad_()
    trl = _trl_loss(logits, x, trl_options, off_policy)
    trl.backward()
    out, our_logits = _ours64(x, ours, length_norm, temperature, off_policy)
    assert trl.item() == pytest.approx(out.loss.item(), rel=1e-10, abs=1e-12)
    # TRL differentiates the tempered logits, grpo_fast the raw ones: ∂/∂z = ∂/∂(z/T) / T
    torch.testing.assert_close(
        our_logits.grad * temperature, logits.grad[x["mask"].bool()], rtol=1e-9, atol=1e-12
    )
    assert (logits.grad[~x["mask"].bool()] == 0).all()  # padding has no gradient on either side
    if off_policy and ours.get("type", "grpo_clip") == "grpo_clip":
        assert out.clipped.any()  # the case reaches a clipped branch


# ---------------------------------------------------------------------------- Liger-Kernel


@pytest.mark.parametrize("off_policy", [False, True], ids=["on-policy", "off-policy"])
@pytest.mark.parametrize("case", list(CASES))
def test_liger_fused_linear_grpo_loss_matches(case, off_policy):
    """Liger's and grpo_fast's fused lm_head + loss, both fp32, against grpo_fast's float64
    eager reference; Liger refuses GSPO's sequence level with CISPO and SAPO (as here: none)."""
    pytest.importorskip("liger_kernel", reason=PEERS_MISSING)
    from liger_kernel.chunked_loss import LigerFusedLinearGRPOLoss

    trl_options, ours, length_norm = CASES[case]
    temperature = trl_options.get("temperature", 1.0)
    x = _inputs(temperature)
    options = {"epsilon_low": 0.2, "epsilon_high": 0.2, "beta": 0.0, **trl_options}
    liger_loss = LigerFusedLinearGRPOLoss(compiled=False, use_ref_model=options["beta"] != 0, chunk_size=2,
                                          max_completion_length=T, **options)  # fmt: skip
    h, w = x["hidden"].float().requires_grad_(), x["weight"].float().requires_grad_()
    loss, _ = liger_loss(
        h, w, x["ids"], x["mask"], x["advantages"].float(), ref_per_token_logps=x["ref"].float(),
        old_per_token_logps=x["old"].float() if off_policy else None,
    )  # fmt: skip
    loss.backward()
    ref, ref_logits = _ours64(x, ours, length_norm, temperature, off_policy)
    n = int(x["mask"].sum())
    hf, wf = _flat(x, "hidden").float().requires_grad_(), x["weight"].float().requires_grad_()
    seq = torch.arange(B)[:, None].expand(B, T)[x["mask"].bool()]
    kw = dict(
        old_logprobs=_flat(x, "old").float() if off_policy else None, ref_logprobs=_flat(x, "ref").float(),
        temperature=temperature, options=LossOptions(**ours),
        sequence_ids=seq if ours.get("importance_sampling_level") == "sequence" else None,
    )  # fmt: skip
    args = (_flat(x, "ids"), x["advantages"][:, None].expand(B, T)[x["mask"].bool()].float(),
            _weights(x["mask"], length_norm).float())  # fmt: skip
    fused = fused_linear_grpo_loss(hf, wf, *args, **kw, chunk_size=4, backend="torch_chunked")
    fused.loss.backward()
    he, we = _flat(x, "hidden").float().requires_grad_(), x["weight"].float().requires_grad_()
    eager = eager_grpo_loss_from_logits(he @ we.t(), *args, **kw)
    eager.loss.backward()
    gh64 = ref_logits.grad @ x["weight"]
    gw64 = ref_logits.grad.t() @ _flat(x, "hidden")
    g_lp, g_h = row_upstream_grads(he.detach() @ we.detach().t(), *args, **kw)
    scale_h, scale_w = lm_head_grad_scales(he, we, args[0], temperature, g_lp, g_h)
    # the loss's rounding: Σ|w·ℓ| (its terms), and each log-prob's (the fp32 logits' rounding)
    # times how much the loss moves with it
    logit_rounding = logit_scale(ref_logits, temperature, terms=he.detach().abs() @ we.detach().abs().t())
    plain = plain_grpo_loss(
        (he.detach() @ we.detach().t()).double().tolist(), args[0].tolist(), args[1].tolist(), args[2].tolist(),
        PlainOptions(**ours), old_logprobs=None if kw["old_logprobs"] is None else kw["old_logprobs"].tolist(),
        ref_logprobs=kw["ref_logprobs"].tolist(), temperature=temperature,
        sequence_ids=None if kw["sequence_ids"] is None else kw["sequence_ids"].tolist(),
    )  # fmt: skip
    per_token = torch.tensor(plain.per_token, dtype=torch.float64)
    loss_scale = (args[2].double() * per_token).abs().sum() + (g_lp * logit_rounding).sum()
    liger_grads = (h.grad[x["mask"].bool()], w.grad)
    for who, factor, value, (grad_h, grad_w) in (("liger", 4.0, loss, liger_grads),
                                                  ("grpo_fast", 2.0, fused.loss, (hf.grad, wf.grad))):  # fmt: skip
        assert_close_to_reference(
            value, ref.loss, eager.loss, name=f"{who} loss", scale=loss_scale, factor=factor
        )
        assert_close_to_reference(
            grad_h, gh64, he.grad, name=f"{who} grad_hidden", scale=scale_h, factor=factor
        )
        assert_close_to_reference(
            grad_w, gw64, we.grad, name=f"{who} grad_weight", scale=4 * scale_w, factor=factor
        )
    assert (h.grad[~x["mask"].bool()] == 0).all() and n == sum(LENGTHS)
