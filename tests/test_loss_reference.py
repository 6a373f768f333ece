"""Every loss variant against an independent reference: ``tests/loss_reference.py``, a plain
float64 per-token loop written from the papers' formulas that shares no code with
``grpo_fast.algo.core`` (the eager reference the ops are otherwise tested against).

- The plain reference itself: imports nothing but the standard library, hand-worked values,
  its hand-written gradient against central differences.
- The eager float64 reference (``core.eager_grpo_loss_from_logits``) against it on every
  combination of the structural options (loss type × ratio level × on/off-policy × dual clip
  × δ × top-entropy), the others (clip-higher, KL estimator and β, entropy bonus, length
  normalization, temperature) cycled through them: loss, parts, per-token outputs, clipped
  flags, the entropy threshold and the logits gradient, to float64 rounding.
- Both ops on every backend that runs on a CPU (``torch_chunked``, ``eager``, and ``triton``
  under the interpreter, on fewer combinations) in fp32 against it, within 2x the eager fp32
  run's error entry by entry (``grpo_fast.testing.assert_close_to_reference``).
- ``core.length_norm_weights`` against the reference's hand-made weights.
"""

from __future__ import annotations

import ast
import itertools
import math
from pathlib import Path

import pytest
import torch
from loss_reference import KNOWN_TYPES, PlainOptions, plain_grpo_loss, plain_length_norm_weights

from grpo_fast.algo.core import eager_grpo_loss_from_logits, length_norm_weights
from grpo_fast.algo.loss_options import LOSS_TYPES, LossOptions
from grpo_fast.ops import fused_linear_grpo_loss, grpo_loss_from_logits
from grpo_fast.testing import (
    assert_close_to_reference,
    backend_device,
    lm_head_grad_scales,
    logit_grad_scale,
    output_scales,
)

pytestmark = pytest.mark.filterwarnings("ignore:.*encountered in:RuntimeWarning")  # numpy, interpreter

LENGTHS = [3, 1, 4, 2, 5, 3]  # six responses; then two padding rows of weight 0 (their own id)
N = sum(LENGTHS) + 2  # 20 tokens: chunks of 8 cut responses 3 and 6 (the fused op's two passes)
V, D = 11, 6
MAX_LENGTH = 6  # Dr. GRPO's constant
# per response: a target ratio r = exp(lp − old) for its tokens (×(1 ± 2%) jitter) and its advantage;
# with ε = 0.2 (or ε_high = 0.28), δ ∈ {1.1, 2.5}, dual clip 3: r = 1.6 with A > 0 is clipped high,
# 0.6 with A < 0 low, 3.6 with A < 0 dual-clipped (and capped by either δ), 0.9 inside the range,
# 1.45 with A < 0 above it on the side the min keeps unclipped (capped by δ = 1.1), 1.15 with A < 0
# inside the range but above δ = 1.1: the min takes clip(r)·A = r·A, not clipped, gradient −A·r
RESPONSES = [(1.6, 1.0), (0.6, -0.8), (1.15, -0.5), (3.6, -1.2), (0.9, 0.7), (1.45, -0.4)]
TEMPERATURES = (1.0, 0.7)
BOUNDARIES = (0.8, 1.2, 1.28, 1.1, 2.5, 3.0)  # ratios must keep away: fp32 may not flip a branch


def _inputs(seed: int = 0):
    """One batch: ``N`` tokens (responses of ``LENGTHS`` + 2 padding rows), logits ``[N, V]`` as
    ``hidden @ weightᵀ`` (float64), labels, per-response advantages, ``old`` (by temperature: the
    ratios are of the tempered log-probs) hitting every branch, ``ref``, sequence ids. Ratios, token
    and sequence ones, are ≥ 1 % away from every boundary."""
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(N, D, generator=g, dtype=torch.float64)
    weight = 1.5 * torch.randn(V, D, generator=g, dtype=torch.float64) / math.sqrt(D)
    logits = hidden @ weight.t()
    labels = torch.randint(0, V, (N,), generator=g)
    seq = torch.tensor([i for i, n in enumerate(LENGTHS) for _ in range(n)] + [len(LENGTHS)] * 2)
    ratio_of = [r for r, _ in RESPONSES] + [1.0]
    adv_of = [a for _, a in RESPONSES] + [0.0]
    jitter = 1.0 + 0.02 * (2 * torch.rand(N, generator=g, dtype=torch.float64) - 1)
    ratio = torch.tensor([ratio_of[i] for i in seq], dtype=torch.float64) * jitter
    lp = {t: torch.log_softmax(logits / t, -1).gather(1, labels[:, None])[:, 0] for t in TEMPERATURES}
    old = {t: lp[t] - ratio.log() for t in TEMPERATURES}
    ref = lp[1.0] + 0.3 * torch.randn(N, generator=g, dtype=torch.float64)
    advantages = torch.tensor([adv_of[i] for i in seq], dtype=torch.float64)
    seq_ratio = torch.tensor([ratio[seq == i].log().mean().exp().item() for i in seq.tolist()])
    for r in (*ratio.tolist(), *seq_ratio.tolist()):
        assert all(abs(r - b) > 0.01 * b for b in BOUNDARIES), f"ratio {r} too close to a boundary"
    return dict(hidden=hidden, weight=weight, logits=logits, labels=labels, advantages=advantages,
                old=old, ref=ref, sequence_ids=seq)  # fmt: skip


def _weights(length_norm: str) -> torch.Tensor:
    rows = plain_length_norm_weights(LENGTHS, length_norm, MAX_LENGTH)
    return torch.tensor([w for row in rows for w in row] + [0.0, 0.0], dtype=torch.float64)


# ---------------------------------------------------------------------------- the combinations

KL_CASES = [(0.0, None), (0.0, "k3"), (0.1, "k1"), (0.1, "k2"), (0.07, "k3")]  # (β, estimator); None: no ref
COEFS = [0.0, 0.05, -0.03]  # the entropy bonus, and a penalty
CLIPS = [(0.2, 0.2), (0.2, 0.28)]  # symmetric, and DAPO's clip-higher
NORMS = ["sequence_mean", "constant", "token_mean"]


def _combos() -> list[dict]:
    """Every combination of loss type × ratio level × on/off-policy × dual clip × δ × ρ (the
    options that change which branch a token takes), the other options cycled through them with
    coprime periods, so that every pair of their values meets across the list."""
    out = []
    structural = itertools.product(
        LOSS_TYPES, ["token", "sequence"], [False, True], [None, 3.0], [None, 1.1, 2.5], [1.0, 0.4]
    )
    for kind, level, off_policy, dual, delta, rho in structural:
        if (dual is not None and kind != "grpo_clip") or (delta is not None and kind == "sapo"):
            continue  # LossOptions refuses these (dual clip is grpo_clip's; SAPO's gate is bounded)
        i = len(out)
        (clip_low, clip_high), (beta, estimator) = CLIPS[i % 2], KL_CASES[i % 5]
        out.append(dict(
            type=kind, importance_sampling_level=level, off_policy=off_policy, dual_clip=dual, delta=delta,
            top_entropy_quantile=rho, clip_low=clip_low, clip_high=clip_high, beta=beta,
            kl_estimator=estimator or "k3", with_ref=estimator is not None, entropy_coef=COEFS[i % 3],
            length_norm=NORMS[(i // 2) % 3], temperature=0.7 if i % 7 < 3 else 1.0,
        ))  # fmt: skip
    return out


COMBOS = _combos()


def _name(c: dict) -> str:
    skip = {"off_policy", "with_ref", "kl_estimator"}
    kl = f"kl={c['kl_estimator']}" if c["with_ref"] else "no-ref"
    return ",".join(
        [*(f"{k}={v}" for k, v in c.items() if k not in skip), kl, "off" if c["off_policy"] else "on"]
    )


def _options(c: dict) -> dict:
    """The ``LossOptions`` fields of combination ``c``."""
    keys = ("type", "clip_low", "clip_high", "dual_clip", "delta", "importance_sampling_level",
            "top_entropy_quantile", "beta", "kl_estimator", "entropy_coef")  # fmt: skip
    return {k: c[k] for k in keys}


def _plain(c: dict, x: dict, logits: torch.Tensor | None = None):
    """The plain reference on combination ``c``, inputs ``x``."""
    w = _weights(c["length_norm"])
    return plain_grpo_loss(
        (x["logits"] if logits is None else logits).tolist(), x["labels"].tolist(), x["advantages"].tolist(),
        w.tolist(), PlainOptions(**_options(c)),
        old_logprobs=x["old"][c["temperature"]].tolist() if c["off_policy"] else None,
        ref_logprobs=x["ref"].tolist() if c["with_ref"] else None,
        sequence_ids=x["sequence_ids"].tolist(), temperature=c["temperature"],
    )  # fmt: skip


def _op_args(c: dict, x: dict, dtype: torch.dtype, device: torch.device) -> tuple[tuple, dict]:
    """``(positional tail, keywords)`` of either op on combination ``c``, in ``dtype`` on ``device``."""
    on = lambda t: t.to(device, dtype)
    kw = dict(
        old_logprobs=on(x["old"][c["temperature"]]) if c["off_policy"] else None,
        ref_logprobs=on(x["ref"]) if c["with_ref"] else None,
        temperature=c["temperature"], options=LossOptions(**_options(c)),
    )  # fmt: skip
    if c["importance_sampling_level"] == "sequence":
        kw["sequence_ids"] = x["sequence_ids"].to(device)
    tail = (x["labels"].to(device), on(x["advantages"]), on(_weights(c["length_norm"])))
    return tail, kw


def test_combinations_cover_every_option_value_with_every_loss_type():
    """The list above leaves no value of any option untried with any loss type (a δ with every
    type but SAPO, a dual clip with grpo_clip)."""
    assert set(LOSS_TYPES) <= set(KNOWN_TYPES), "a loss type without a plain reference"
    for kind in LOSS_TYPES:
        mine = [c for c in COMBOS if c["type"] == kind]
        seen = lambda key, mine=mine: {str(c[key]) for c in mine}
        assert seen("importance_sampling_level") == {"token", "sequence"}
        assert seen("off_policy") == {"False", "True"} and seen("top_entropy_quantile") == {"1.0", "0.4"}
        assert seen("length_norm") == set(NORMS) and seen("entropy_coef") == {str(x) for x in COEFS}
        assert {(c["beta"], c["kl_estimator"] if c["with_ref"] else None) for c in mine} == set(KL_CASES)
        assert {(c["clip_low"], c["clip_high"]) for c in mine} == set(CLIPS)
        assert seen("temperature") == {"0.7", "1.0"}
        assert seen("delta") == ({"None"} if kind == "sapo" else {"None", "1.1", "2.5"})
        assert seen("dual_clip") == ({"None", "3.0"} if kind == "grpo_clip" else {"None"})


# ---------------------------------------------------------------------------- the plain reference


def test_plain_reference_imports_only_the_standard_library():
    tree = ast.parse((Path(__file__).parent / "loss_reference.py").read_text())
    imported = {
        (node.module if isinstance(node, ast.ImportFrom) else alias.name).split(".")[0]
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for alias in node.names
    }
    assert imported == {"__future__", "math", "dataclasses"}, imported


def test_plain_reference_hand_values():
    """One token, uniform logits over V = 4 (lp = −ln 4), A = 1, log r = 0.5 (r = e^0.5 ≈ 1.6487):
    grpo_clip −1.2 (clipped, gradient 0); reinforce −1.6487 (∂/∂lp = −r·A); CISPO −sg(1.2)·1·lp =
    1.2·ln 4 ≈ 1.6636 (∂/∂lp = −1.2); SAPO (τ = 1) −4·σ(0.6487) ≈ −2.6269 (∂/∂lp = −4σ(1−σ)·r ≈
    −1.4867); with β = 0.1, k3 and ref = lp + ln 2: d = ln 2, k3 = 2 − ln 2 − 1 ≈ 0.3069,
    ∂k3/∂lp = 1 − e^d = −1; entropy ln 4 ≈ 1.3863, and c = 0.5 subtracts 0.6931."""
    lp = -math.log(4.0)
    run = lambda **o: plain_grpo_loss(
        [[0.0] * 4], [0], [1.0], [1.0], PlainOptions(**o), old_logprobs=[lp - 0.5]
    )
    clip = run()
    assert clip.loss == pytest.approx(-1.2) and clip.clipped == [True] and clip.g_lp == [0.0]
    r = math.exp(0.5)
    reinforce = run(type="reinforce_with_baseline")
    assert reinforce.loss == pytest.approx(-r) and reinforce.g_lp[0] == pytest.approx(-r)
    cispo = run(type="cispo")
    assert cispo.loss == pytest.approx(1.2 * math.log(4)) and cispo.g_lp[0] == pytest.approx(-1.2)
    sig = 1 / (1 + math.exp(-(r - 1)))
    sapo = run(type="sapo")
    assert sapo.loss == pytest.approx(-4 * sig, abs=1e-12) and sapo.loss == pytest.approx(-2.6269, abs=1e-4)
    assert sapo.g_lp[0] == pytest.approx(-4 * sig * (1 - sig) * r) and sapo.g_lp[0] == pytest.approx(
        -1.4867, abs=1e-4
    )
    kl = plain_grpo_loss([[0.0] * 4], [0], [1.0], [1.0], PlainOptions(beta=0.1, entropy_coef=0.5),
                         ref_logprobs=[lp + math.log(2.0)])  # fmt: skip
    assert kl.kl[0] == pytest.approx(1 - math.log(2)) and kl.entropy[0] == pytest.approx(math.log(4))
    # on-policy: pg = −1 (r = 1), ∂/∂lp = −1 + 0.1·(−1); KL part 0.1·0.3069; bonus −0.5·ln 4
    assert kl.loss == pytest.approx(-1 + 0.1 * (1 - math.log(2)) - 0.5 * math.log(4))
    assert kl.g_lp[0] == pytest.approx(-1.1) and kl.g_h[0] == pytest.approx(-0.5)
    assert (kl.pg, kl.kl_part, kl.entropy_part) == pytest.approx(
        (-1.0, 0.1 * (1 - math.log(2)), -0.5 * math.log(4))
    )


def test_plain_reference_quantile_is_linear_interpolation():
    # entropies of the weighted tokens [0.1, 0.5, 1.0, 2.0]; ρ = 0.5: the 0.5-quantile at rank
    # 0.5·3 = 1.5, halfway between 0.5 and 1.0: 0.75 (the zero-weight token's 9.0 is left out)
    from loss_reference import _quantile

    assert _quantile([2.0, 0.1, 1.0, 0.5], 0.5) == pytest.approx(0.75)
    assert _quantile([], 0.5) == math.inf


@pytest.mark.parametrize("kind", [k for k in LOSS_TYPES if k != "cispo"])  # CISPO's weight is detached
@pytest.mark.parametrize("level", ["token", "sequence"])
def test_plain_gradient_matches_central_differences(kind, level):
    """The hand-written ∂loss/∂logits of the plain reference against central differences of its own
    loss (h = 1e-6, with π_old and the top-entropy mask held fixed by construction), with every
    term on: β·k3, an entropy bonus, the cap δ."""
    x = _inputs(seed=4)
    c = dict(COMBOS[0], type=kind, importance_sampling_level=level, off_policy=True, with_ref=True, beta=0.1,
             kl_estimator="k2", entropy_coef=0.05, top_entropy_quantile=1.0, dual_clip=None,
             delta=None if kind == "sapo" else 2.5, temperature=0.7, length_norm="token_mean")  # fmt: skip
    base = _plain(c, x)
    h = 1e-6
    for t, j in [(0, 3), (5, 0), (9, 7), (14, 10), (17, 2)]:
        up, down = x["logits"].clone(), x["logits"].clone()
        up[t, j] += h
        down[t, j] -= h
        numeric = (_plain(c, x, up).loss - _plain(c, x, down).loss) / (2 * h)
        assert base.grad_logits[t][j] == pytest.approx(numeric, rel=1e-6, abs=1e-9), (t, j)


# ---------------------------------------------------------------------------- the eager reference


def _tensor(values, like=torch.float64):
    return torch.tensor(values, dtype=like)


def _compare_exact(out, plain, grad, c):
    """The eager float64 reference ``out`` (and its logits gradient) against ``plain``, to float64
    rounding (1e-10 relative)."""
    close = lambda a, b, what: torch.testing.assert_close(
        a.detach().double().cpu(),
        _tensor(b),
        rtol=1e-10,
        atol=1e-12,
        msg=lambda m: f"{what} ({_name(c)}): {m}",
    )
    close(out.loss, plain.loss, "loss")
    close(out.logprobs, plain.logprobs, "logprobs")
    close(out.entropy, plain.entropy, "entropy")
    close(out.log_ratio, plain.log_ratio, "log_ratio")
    close(torch.stack(list(out.parts)), [plain.pg, plain.kl_part, plain.entropy_part], "parts")
    assert (out.kl is None) == (plain.kl is None), _name(c)
    if plain.kl is not None:
        close(out.kl, plain.kl, "kl")
    assert out.clipped.tolist() == plain.clipped, f"clipped ({_name(c)})"
    assert (out.entropy_threshold is None) == (plain.threshold is None), _name(c)
    if plain.threshold is not None:
        close(out.entropy_threshold, plain.threshold, "entropy_threshold")
    close(grad, plain.grad_logits, "grad_logits")


def test_eager_reference_matches_the_plain_one_on_every_combination():
    x = _inputs()
    for c in COMBOS:
        logits = x["logits"].clone().requires_grad_()
        tail, kw = _op_args(c, x, torch.float64, torch.device("cpu"))
        out = eager_grpo_loss_from_logits(logits, *tail, **kw)
        out.loss.backward()
        _compare_exact(out, _plain(c, x), logits.grad, c)


def test_the_combinations_exercise_every_branch():
    """Off-policy, each loss type clips where its formula says (grpo_clip on both sides and by the
    dual clip, CISPO its weight, δ the unclipped types), SAPO never; and ρ = 0.4 drops tokens."""
    x = _inputs()
    for c in COMBOS:
        plain = _plain(c, x)
        if c["off_policy"] and c["type"] == "grpo_clip":
            assert any(plain.clipped), _name(c)
        if c["off_policy"] and c["type"] in ("reinforce_with_baseline", "no_baseline"):
            assert any(plain.clipped) == (c["delta"] is not None), _name(c)
        if c["type"] == "sapo" or not c["off_policy"]:
            assert not any(plain.clipped), _name(c)
        if c["top_entropy_quantile"] < 1:
            assert plain.threshold is not None and min(plain.entropy) < plain.threshold < max(plain.entropy)
    off = [c for c in COMBOS if c["off_policy"] and c["importance_sampling_level"] == "token"]
    dual = [_plain(c, x) for c in off if c["dual_clip"] == 3.0 and c["delta"] is None]
    assert dual and all(p.clipped[RESPONSE_START[3]] for p in dual)  # r ≈ 3.6, A < 0: bounded at 3·|A|


RESPONSE_START = [sum(LENGTHS[:i]) for i in range(len(LENGTHS))]


# ---------------------------------------------------------------------------- the ops, in fp32

BACKENDS = ["torch_chunked", "eager", "triton"]


def _op_combos(backend: str) -> list[dict]:
    """All combinations on the CPU backends; under the Triton interpreter (slow) the first of each
    loss type × ratio level × on/off-policy."""
    if backend != "triton":
        return COMBOS
    first = {}
    for c in COMBOS:
        first.setdefault((c["type"], c["importance_sampling_level"], c["off_policy"]), c)
    return list(first.values())


def _check_fp32(c, plain, out, eager, grads, eager_grads, scales):
    """An fp32 op's output against ``plain`` (float64), each entry within 2x the eager fp32 run's
    error there (``assert_close_to_reference``); ``clipped`` exactly."""
    name = _name(c)
    per_token = torch.tensor(plain.per_token, dtype=torch.float64)
    loss_scale = (_weights(c["length_norm"]) * per_token).abs().sum().item()
    assert_close_to_reference(
        out.loss, _tensor(plain.loss), eager.loss, name=f"loss ({name})", scale=loss_scale
    )
    parts = [plain.pg, plain.kl_part, plain.entropy_part]
    assert_close_to_reference(torch.stack(list(out.parts)), _tensor(parts), torch.stack(list(eager.parts)),
                              name=f"parts ({name})", scale=loss_scale)  # fmt: skip
    for field in ("logprobs", "entropy", "kl", "log_ratio"):
        ref = getattr(plain, field if field != "log_ratio" else "log_ratio")
        assert (getattr(out, field) is None) == (ref is None), field
        if ref is not None:
            scale = scales.get(field, scales["logprobs"])
            assert_close_to_reference(getattr(out, field), _tensor(ref), getattr(eager, field),
                                      name=f"{field} ({name})", scale=scale)  # fmt: skip
    assert out.clipped.cpu().tolist() == plain.clipped, f"clipped ({name})"
    if plain.threshold is not None:
        assert_close_to_reference(out.entropy_threshold, _tensor(plain.threshold), eager.entropy_threshold,
                                  name=f"entropy_threshold ({name})", scale=scales["entropy"].max())  # fmt: skip
    for (what, grad), eager_grad, (ref, scale) in zip(grads.items(), eager_grads, scales["grads"]):
        assert_close_to_reference(grad, ref, eager_grad, name=f"{what} ({name})", scale=scale)


@pytest.mark.parametrize("backend", BACKENDS)
def test_grpo_loss_from_logits_matches_the_plain_reference(backend):
    x = _inputs(seed=1)
    device, cpu = backend_device(backend), torch.device("cpu")
    logits32 = x["logits"].float()
    for c in _op_combos(backend):
        plain = _plain(c, x, logits32.double())
        runs = []
        for fn, dev in ((grpo_loss_from_logits, device), (eager_grpo_loss_from_logits, cpu)):
            z = logits32.to(dev, copy=True).requires_grad_()
            tail, kw = _op_args(c, x, torch.float32, dev)
            extra = dict(backend=backend) if fn is grpo_loss_from_logits else {}
            out = fn(z, *tail, **kw, **extra)
            out.loss.backward()
            runs.append((out, z.grad))
        (ours, grad), (eager, eager_grad) = runs
        g_lp, g_h = _tensor(plain.g_lp_size), _tensor(plain.g_h)
        scales = output_scales(logits32, c["temperature"], _tensor(plain.logprobs),
                               x["ref"] if c["with_ref"] else None, c["kl_estimator"])  # fmt: skip
        scales["log_ratio"] = scales["logprobs"] * (3 if c["importance_sampling_level"] == "sequence" else 1)
        grad_scale = logit_grad_scale(logits32, x["labels"], c["temperature"], g_lp, g_h)
        scales["grads"] = [(_tensor(plain.grad_logits), grad_scale)]
        _check_fp32(c, plain, ours, eager, {"grad_logits": grad}, [eager_grad], scales)


@pytest.mark.parametrize("backend", BACKENDS)
def test_fused_linear_grpo_loss_matches_the_plain_reference(backend):
    """Logits ``hidden @ weightᵀ`` never materialized, in chunks of 8 rows (GSPO's sequences and
    the top-entropy threshold across chunks: the two-pass mode); the plain reference runs on the
    float64 product and its logits gradient is carried to ``hidden`` and ``weight`` by hand."""
    x = _inputs(seed=2)
    device, cpu = backend_device(backend), torch.device("cpu")
    h32, w32 = x["hidden"].float(), x["weight"].float()
    logits64 = h32.double() @ w32.double().t()
    terms = h32.double().abs() @ w32.double().abs().t()
    for c in _op_combos(backend):
        plain = _plain(c, x, logits64)
        tail, kw = _op_args(c, x, torch.float32, device)
        h, w = h32.to(device, copy=True).requires_grad_(), w32.to(device, copy=True).requires_grad_()
        ours = fused_linear_grpo_loss(h, w, *tail, **kw, chunk_size=8, backend=backend)
        ours.loss.backward()
        he, we = h32.clone().requires_grad_(), w32.clone().requires_grad_()
        tail, kw = _op_args(c, x, torch.float32, cpu)
        eager = eager_grpo_loss_from_logits(he @ we.t(), *tail, **kw)
        eager.loss.backward()
        g_lp, g_h = _tensor(plain.g_lp_size), _tensor(plain.g_h)
        scales = output_scales(logits64, c["temperature"], _tensor(plain.logprobs),
                               x["ref"] if c["with_ref"] else None, c["kl_estimator"], terms=terms)  # fmt: skip
        scales["log_ratio"] = scales["logprobs"] * (3 if c["importance_sampling_level"] == "sequence" else 1)
        scale_h, scale_w = lm_head_grad_scales(h32, w32, x["labels"], c["temperature"], g_lp, g_h)
        g64 = _tensor(plain.grad_logits)
        scales["grads"] = [(g64 @ w32.double(), scale_h), (g64.t() @ h32.double(), 3 * scale_w)]  # 3 chunks
        _check_fp32(c, plain, ours, eager, {"grad_hidden": h.grad, "grad_weight": w.grad},
                    [he.grad, we.grad], scales)  # fmt: skip


# ---------------------------------------------------------------------------- length normalization


@pytest.mark.parametrize("length_norm", NORMS)
def test_length_norm_weights_match_the_plain_ones(length_norm):
    """``core.length_norm_weights`` on the ``[B, T]`` mask of ``LENGTHS`` gives the plain weights
    (GRPO ``1/(|o|·B)``, Dr. GRPO ``1/(L·B)``, DAPO ``1/Σ|o|``) on the response tokens, 0 elsewhere."""
    mask = torch.arange(max(LENGTHS))[None, :] < torch.tensor(LENGTHS)[:, None]
    w = length_norm_weights(mask, length_norm, max_length=MAX_LENGTH).double()
    plain = plain_length_norm_weights(LENGTHS, length_norm, MAX_LENGTH)
    torch.testing.assert_close(w[mask], _tensor([x for row in plain for x in row]), rtol=1e-7, atol=0)
    assert (w[~mask] == 0).all()
