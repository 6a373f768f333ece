"""Rollouts with transformers ``generate`` on the training model itself (CPU and GPU).

No second copy of the weights and nothing to synchronize: the policy samples from exactly the
weights it trains. Slower than vLLM on a GPU (no paged KV cache, no continuous batching), so
the GPU presets use vLLM; this backend is what CPU runs and tests use.
"""

from __future__ import annotations

import contextlib

import torch

from grpo_fast.rollout.base import BackendContext, BackendSpec, Rollout, SamplingParams


class HFBackend:
    """``generate`` in chunks of ``generation_batch_size`` sequences, prompts left-padded."""

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
        tok = self.tokenizer
        model = self.model
        was_training = model.training
        model.eval()
        greedy = params.temperature == 0
        if greedy and params.n != 1:
            raise ValueError("greedy sampling (temperature 0) with n > 1 gives n identical responses")
        device = next(model.parameters()).device
        prompts_per_call = max(1, self.generation_batch_size // params.n)
        response_ids: list[list[int]] = []
        finish: list[str] = []
        try:
            for start in range(0, len(prompt_ids), prompts_per_call):
                chunk = prompt_ids[start : start + prompts_per_call]
                width = max(len(p) for p in chunk)
                ids = torch.full((len(chunk), width), tok.pad_token_id, dtype=torch.long)
                mask = torch.zeros((len(chunk), width), dtype=torch.long)
                for i, p in enumerate(chunk):  # left padding: the last prompt token is at -1
                    ids[i, width - len(p) :] = torch.tensor(p)
                    mask[i, width - len(p) :] = 1
                kwargs = dict(
                    max_new_tokens=params.max_tokens,
                    min_new_tokens=params.min_tokens or None,
                    num_return_sequences=params.n,
                    pad_token_id=tok.pad_token_id,
                    eos_token_id=tok.eos_token_id,
                    do_sample=not greedy,
                )
                if not greedy:
                    # transformers: temperature, then top-k (0 = off), then top-p, as vLLM
                    kwargs.update(temperature=params.temperature, top_p=params.top_p, top_k=params.top_k)
                if params.stop:
                    kwargs.update(stop_strings=list(params.stop), tokenizer=tok)
                autocast = (
                    torch.autocast(device.type, dtype=self.autocast_dtype)
                    if self.autocast_dtype is not None
                    else contextlib.nullcontext()
                )
                with autocast:
                    out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), **kwargs)
                new = out[:, width:].tolist()  # host-device sync: the sampled ids to Python
                for row in new:
                    ids_row, reason = _trim(row, tok, params)
                    response_ids.append(ids_row)
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
        )


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
)
