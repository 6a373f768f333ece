"""The hf backend's own decoding (grpo_fast/rollout/hf/decoder.py ``decode`` and ``sample_next``): each
prompt prefilled once for its ``n`` samples, one uniform per row drawn against the cumulative
probabilities, the sampled tokens' log-probs returned. The same distribution as
``torch.multinomial`` (a χ² test), greedy the same tokens as transformers' ``generate``, the
log-probs those the trainer computes for the same tokens."""

from __future__ import annotations

import math

import pytest
import torch

from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout.base import SamplingParams
from grpo_fast.rollout.hf import HFBackend, decode, sample_next
from grpo_fast.task import tiny

# The χ² statistic's 0.999 quantile by degrees of freedom (a wrong sampler fails; a right one fails
# one run in 1,000, and the seeds below are fixed).
CHI2_999 = {2: 13.82, 3: 16.27, 4: 18.47, 5: 20.52}


def _chi2(samples: torch.Tensor, probs: torch.Tensor) -> float:
    counts = torch.bincount(samples, minlength=probs.numel()).double()
    expected = probs.double() * samples.numel()
    keep = expected > 0
    assert counts[~keep].sum() == 0  # never a token of probability 0
    return float(((counts[keep] - expected[keep]) ** 2 / expected[keep]).sum())


@pytest.mark.parametrize(
    ("top_k", "top_p", "kept"),
    [(0, 1.0, 6), (3, 1.0, 3), (0, 0.8, 3)],
    ids=["full", "top_k-3", "top_p-0.8"],
)
def test_inverse_cdf_sampling_draws_the_truncated_distribution(top_k, top_p, kept):
    """20,000 draws over a 6-token vocabulary at temperature 0.7: the counts fit the (truncated,
    renormalized) softmax by χ², as torch.multinomial's draws of the same distribution do."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.5, 0.2, -0.4, 1.1, 0.7, -1.3]]).repeat(20000, 1)
    params = SamplingParams(n=1, temperature=0.7, top_p=top_p, max_tokens=1, min_tokens=0, top_k=top_k)
    tokens, lps = sample_next(logits, params)
    scaled = logits[0] / 0.7
    order = scaled.argsort(descending=True)
    probs = torch.zeros(6)
    probs[order[:kept]] = scaled[order[:kept]].softmax(-1)  # the kept set here: the first `kept` by value
    stat = _chi2(tokens, probs)
    reference = _chi2(torch.multinomial(probs, 20000, replacement=True), probs)
    assert stat < CHI2_999[kept - 1] and reference < CHI2_999[kept - 1], (stat, reference)
    torch.testing.assert_close(lps, probs.log()[tokens], rtol=0, atol=1e-6)  # the drawn distribution's


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_log_probs_hold_at_a_real_vocabulary(temperature):
    """Qwen2.5's 151,936 entries: the returned log-prob is the tempered log-softmax's to fp32
    rounding (its normalizer a pairwise sum, not the end of the sampling cumsum, which drifts)."""
    torch.manual_seed(0)
    logits = torch.randn(16, 151936) * 4
    params = SamplingParams(n=1, temperature=temperature, top_p=1.0, max_tokens=1, min_tokens=0)
    tokens, lps = sample_next(logits, params)
    exact = (logits.double() / temperature).log_softmax(-1).gather(-1, tokens[:, None])[:, 0]
    torch.testing.assert_close(lps.double(), exact, rtol=0, atol=2e-6)


def test_a_wrong_sampler_fails_the_chi2_test():
    """Planted: the untruncated softmax at temperature 1 instead of 0.7 is rejected by the same test."""
    torch.manual_seed(0)
    logits = torch.tensor([[1.5, 0.2, -0.4, 1.1, 0.7, -1.3]])
    probs = (logits[0] / 0.7).softmax(-1)
    wrong = torch.multinomial(logits[0].softmax(-1), 20000, replacement=True)
    assert _chi2(wrong, probs) > CHI2_999[5]


def _prompts(tok):
    return [tok(e.question)["input_ids"] for e in tiny.examples("eval")[:5]]


def test_greedy_decoding_matches_transformers_generate():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=4).eval()
    prompts = _prompts(tok)
    params = SamplingParams(n=1, temperature=0.0, top_p=1.0, max_tokens=5, min_tokens=0)
    ours, _ = decode(model, prompts, params, tok)
    width = max(map(len, prompts))
    ids = torch.tensor([[tok.pad_token_id] * (width - len(p)) + p for p in prompts])
    mask = (torch.arange(width)[None] >= torch.tensor([width - len(p) for p in prompts])[:, None]).long()
    theirs = model.generate(
        input_ids=ids, attention_mask=mask, max_new_tokens=5, do_sample=False, pad_token_id=tok.pad_token_id,
        eos_token_id=tok.eos_token_id,
    )[:, width:].tolist()  # fmt: skip
    for a, b in zip(ours, theirs):
        n = next((i + 1 for i, t in enumerate(b) if t == tok.eos_token_id), len(b))
        assert a[:n] == b[:n]


def test_each_prompt_is_prefilled_once_and_the_log_probs_are_the_trainers():
    """n = 8 samples of 5 prompts: the prefill runs 5 rows (not 40); each sampled token's log-prob
    (temperature 0.7, top-k 5) equals the trainer's log-prob of it through the fused op with the
    same truncation, to fp32 rounding. (With min_tokens the sampler's first tokens exclude EOS,
    which the trainer's distribution does not: vLLM's processed log-probs do the same; tested
    below.)"""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=2)
    seen, head = [], []
    hook = model.register_forward_pre_hook(
        lambda m, a, k: seen.append(k["input_ids"].shape), with_kwargs=True
    )
    head_hook = model.lm_head.register_forward_pre_hook(lambda m, a: head.append(a[0].shape[:2]))
    params = SamplingParams(n=8, temperature=0.7, top_p=1.0, max_tokens=4, min_tokens=0, top_k=5, seed=None)
    torch.manual_seed(0)
    rollout = HFBackend(model, tok, generation_batch_size=40).generate(_prompts(tok), params)
    hook.remove()
    head_hook.remove()
    assert seen[0] == (5, max(map(len, _prompts(tok))))  # one prefill row per prompt
    assert all(shape == (40, 1) for shape in seen[1:])  # then one token per sample and step
    assert head[0] == (5, 1)  # the prefill's lm_head at each prompt's last position only
    seqs = loss_trajectories(rollout, advantages=torch.zeros(40), length_norm="sequence_mean", max_length=4)
    loss = PolicyLoss(model, autocast=None, backend="torch_chunked", top_k=5, top_p=1.0)
    for mb in make_microbatches(seqs, 40, tok.pad_token_id, packing=False):
        with torch.no_grad():
            trainer = loss(mb, LossOptions(), 0.7).logprobs
        torch.testing.assert_close(trainer, mb.sampler_logprobs, rtol=0, atol=1e-5)
        assert (trainer - mb.sampler_logprobs).abs().max() < 1e-5 and math.isfinite(float(trainer.sum()))


def test_min_tokens_holds_eos_off():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=2)
    params = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=6, min_tokens=3)
    torch.manual_seed(1)
    rows, _ = decode(model, _prompts(tok), params, tok)
    assert all(tok.eos_token_id not in row[:3] for row in rows)
    free = SamplingParams(n=8, temperature=1.0, top_p=1.0, max_tokens=6, min_tokens=0)
    torch.manual_seed(1)
    early = decode(model, _prompts(tok), free, tok)[0]
    assert any(tok.eos_token_id in row[:3] for row in early)  # without it the model does end early


def test_stop_strings_end_a_row_in_the_step_that_completes_them():
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=8, min_tokens=0, stop=("1",))
    torch.manual_seed(3)
    out = HFBackend(model, tok, generation_batch_size=16).generate(_prompts(tok)[:2], params)
    for text, reason in zip(out.response_text, out.finish_reason):
        if "1" in text:
            assert text.endswith("1") and reason == "stop"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("mask_kind", ["none", "bool", "additive"])
@pytest.mark.parametrize("groups", [1, 3], ids=["mha", "gqa-3"])
def test_one_query_attention_is_as_close_to_float64_as_sdpa(dtype, mask_kind, groups):
    """The decode step's attention (hf/attention.py ``one_query_attention``), one query a row over
    11 cached positions with padding masked out, against float64 attention: its error is at most
    1.25x torch sdpa's own at that dtype (measured 0.93-1.08x in fp32, 1.00-1.03x in bf16)."""
    import torch.nn.functional as F

    from grpo_fast.rollout.hf.attention import one_query_attention

    g = torch.Generator().manual_seed(groups)
    b, kvh, k, d = 6, 2, 11, 16
    q = torch.randn(b, kvh * groups, 1, d, generator=g, dtype=torch.float64)
    key, value = (torch.randn(b, kvh, k, d, generator=g, dtype=torch.float64) for _ in range(2))
    keep = torch.rand(b, 1, 1, k, generator=g) > 0.3
    keep[..., -1] = True  # every row attends to its own new token
    if mask_kind == "none":
        keep[:] = True
    mask = {
        "none": None,
        "bool": keep,
        "additive": torch.zeros(b, 1, 1, k, dtype=dtype).masked_fill(~keep, torch.finfo(dtype).min),
    }[mask_kind]
    kr, vr = key.repeat_interleave(groups, 1), value.repeat_interleave(groups, 1)
    scores = (q @ kr.transpose(-1, -2)) * d**-0.5
    ref = (scores.masked_fill(~keep, -math.inf).softmax(-1) @ vr).transpose(1, 2)  # [b, 1, h, d]
    ours = one_query_attention(q.to(dtype), key.to(dtype), value.to(dtype), mask, d**-0.5)
    sdpa = F.scaled_dot_product_attention(
        q.to(dtype), kr.to(dtype), vr.to(dtype), attn_mask=mask, scale=d**-0.5
    ).transpose(1, 2)
    assert ours.shape == (b, 1, kvh * groups, d) and ours.dtype == dtype
    err, err_sdpa = ((x.double() - ref).abs().max().item() for x in (ours, sdpa))
    assert err <= 1.25 * err_sdpa, (err, err_sdpa)


def test_decode_steps_take_the_one_query_path_and_the_model_gets_its_attention_back(monkeypatch):
    """While the hf backend generates, every decode step's attention (one query a row: 3 layers a
    step) goes through ``one_query_attention`` and the prefill does not; afterwards, and after an
    exception inside ``decode_steps``, the model's attention implementation is its own again
    (training must not run through it)."""
    from grpo_fast.rollout.hf import attention

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=2)
    before = model.config._attn_implementation
    calls, steps = [], []
    real = attention.one_query_attention
    monkeypatch.setattr(
        attention, "one_query_attention", lambda q, *a: calls.append(tuple(q.shape)) or real(q, *a)
    )
    hook = model.register_forward_pre_hook(
        lambda m, a, k: steps.append(k["input_ids"].shape[1]), with_kwargs=True
    )
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=4, min_tokens=0)
    HFBackend(model, tok, generation_batch_size=20).generate(_prompts(tok), params)
    hook.remove()
    decode_steps = steps.count(1)
    assert steps[0] > 1 and decode_steps == len(steps) - 1 >= 1
    assert calls == [(20, 4, 1, 32)] * (3 * decode_steps)  # 20 rows, 4 heads, head size 32
    assert model.config._attn_implementation == before
    with pytest.raises(RuntimeError), attention.decode_steps(model):
        assert model.config._attn_implementation == attention.PREFIX + before
        raise RuntimeError
    assert model.config._attn_implementation == before


def test_the_preallocated_cache_layer_holds_what_transformers_layer_holds():
    """``grpo_fast.rollout.hf.cache``'s layer against transformers' ``DynamicLayer`` through the
    same calls (a prefill of 3, the batch repeated, single steps past its capacity of 5 so that it
    grows, a crop, a row selection): the same keys, values and length after each, exactly."""
    from transformers.cache_utils import DynamicLayer

    from grpo_fast.rollout.hf.cache import decode_cache

    tok = tiny.build_tokenizer()
    ours = decode_cache(tiny.build_model(tok, seed=0), capacity=5).layers[0]
    theirs = DynamicLayer()
    g = torch.Generator().manual_seed(0)

    def both(call, *args):
        getattr(ours, call)(*args)
        getattr(theirs, call)(*args)
        assert ours.get_seq_length() == theirs.get_seq_length()
        assert torch.equal(ours.keys, theirs.keys) and torch.equal(ours.values, theirs.values)

    both("update", torch.randn(2, 2, 3, 4, generator=g), torch.randn(2, 2, 3, 4, generator=g))
    both("batch_repeat_interleave", 3)
    for _ in range(6):  # 3 + 6 = 9 positions: past the capacity of 5, it grows
        both("update", torch.randn(6, 2, 1, 4, generator=g), torch.randn(6, 2, 1, 4, generator=g))
    both("crop", -2)
    both("batch_select_indices", torch.tensor([5, 0, 2]))
    both("update", torch.randn(3, 2, 2, 4, generator=g), torch.randn(3, 2, 2, 4, generator=g))
    assert type(ours).__name__ == "PreallocatedLayer" and ours.get_seq_length() == 9


def test_decoding_with_the_preallocated_cache_samples_what_the_growing_one_does(monkeypatch):
    """The same seeded sampling (8 prompts of different lengths × 4, 6 tokens) with the decoder's
    own cache and with the one transformers makes: the same tokens, the same log-probs."""
    import grpo_fast.rollout.hf.decoder as decoder

    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=3).eval()
    # 6, 5 and 4 tokens: left padding, so the mask matters
    prompts = [tok(e.question)["input_ids"][i % 3 :] for i, e in enumerate(tiny.examples("eval")[:8])]
    params = SamplingParams(n=4, temperature=1.0, top_p=1.0, max_tokens=6, min_tokens=6)
    runs = []
    for own in (True, False):
        if not own:
            monkeypatch.setattr(decoder, "decode_cache", lambda model, capacity: None)
        with torch.no_grad():
            runs.append(decode(model, prompts, params, tok, torch.Generator().manual_seed(0)))
    (ids_a, lps_a), (ids_b, lps_b) = runs
    assert ids_a == ids_b
    assert max(abs(a - b) for ra, rb in zip(lps_a, lps_b) for a, b in zip(ra, rb)) < 1e-6


def test_a_draw_that_rounds_past_the_last_mass_takes_the_most_likely_token(monkeypatch):
    """A uniform of exactly 1 (u·total = total) lands past every entry of mass > 0 under top-k 2
    over 6 tokens (the last entries have none): the row then takes its most likely token, with
    that token's log-prob, never a token the truncation removed."""
    logits = torch.tensor([[0.5, 2.0, -1.0, 1.5, -3.0, -2.0], [1.0, 0.0, 3.0, -1.0, 2.5, 0.2]])
    monkeypatch.setattr(torch, "rand", lambda *shape, **kw: torch.ones(*shape))
    params = SamplingParams(n=1, temperature=1.0, top_p=1.0, max_tokens=1, min_tokens=0, top_k=2)
    token, lp = sample_next(logits, params)
    assert token.tolist() == [1, 2]  # each row's argmax
    kept = logits.topk(2, -1).values  # the two tokens left: the log-prob is over them alone
    assert torch.allclose(lp, kept[:, 0] - kept.logsumexp(-1))
