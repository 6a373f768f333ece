"""A policy that answers the tiny task's prompts, for tests that check each response is kept with
the prompt it answers (rollouts, rewards, training sequences, across ranks).

``install(monkeypatch, tokenizer)`` (or ``install_in_process`` where there is no ``monkeypatch``,
in a spawned rank) wraps the tiny model class's ``generate`` (which the fake vLLM engine calls)
with a logits processor, and its ``forward`` when it runs with a KV cache (the hf backend's own
decoding, ``grpo_fast.rollout.hf.decode``), so that every row is forced to answer *that row's own
prompt*: ``a + b`` on the even samples of a group, ``a + b + 1`` on the odd ones, then EOS. Under
``generate`` the prompt is read back from the row's tokens; under the hf decode, from the prefill
(one row per prompt) and the contract that prompt ``i``'s ``n`` samples are rows ``i·n … i·n + n − 1``.
Everything else is the backends' own: left padding, the expansion into samples, stopping. A
response kept under another prompt of the batch is graded against that prompt's answer, and with
two-digit operands it is then neither right nor off by one.
"""

from __future__ import annotations

import torch
from transformers import LogitsProcessor, LogitsProcessorList, Qwen2ForCausalLM


def expected(prompt: str, sample: int) -> str:
    """The oracle's response (digits) to ``prompt`` (``"a+b="``) as sample ``sample`` of its group."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return str(a + b + sample % 2)


def judge(prompt: str, response: str) -> str:
    """``"right"`` (``a + b``), ``"off_by_one"`` (``a + b + 1``, the odd samples) or ``"foreign"``:
    the response answers none of the oracle's two answers to ``prompt``."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return {str(a + b): "right", str(a + b + 1): "off_by_one"}.get(response.strip(), "foreign")


class _ForceAnswer(LogitsProcessor):
    def __init__(self, tokenizer, n: int):
        self.tok, self.n = tokenizer, n
        self.special = {tokenizer.pad_token_id, tokenizer.eos_token_id}

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        forced = torch.full_like(scores, -float("inf"))
        for i, row in enumerate(input_ids.tolist()):
            text = self.tok.decode([t for t in row if t not in self.special])
            prompt, _, sampled = text.partition("=")
            target = expected(prompt + "=", i % self.n)  # row i: prompt i // n, sample i % n
            done = self.tok.eos_token_id in row[row.index(self.tok.convert_tokens_to_ids("=")) :]
            nxt = (
                self.tok.eos_token_id
                if done or len(sampled) >= len(target)
                else self.tok.convert_tokens_to_ids(target[len(sampled)])
            )
            forced[i, nxt] = 0.0
        return forced


def _wrap(tokenizer):
    real = Qwen2ForCausalLM.generate

    def generate(self, *args, **kwargs):
        n = kwargs.get("num_return_sequences") or 1
        return real(self, *args, logits_processor=LogitsProcessorList([_ForceAnswer(tokenizer, n)]), **kwargs)

    return generate


def _wrap_forward(tokenizer):
    """``forward`` with a KV cache (decoding): the last position's logits forced to the oracle's
    next token of each row. A forward whose cache is empty is a prefill: one row per prompt."""
    real = Qwen2ForCausalLM.forward
    state = {"prompts": [], "step": 0}
    special = {tokenizer.pad_token_id, tokenizer.eos_token_id}

    def forward(self, *args, **kwargs):
        out = real(self, *args, **kwargs)
        if not kwargs.get("use_cache") or kwargs.get("input_ids") is None or _in_generate(self):
            return out
        if kwargs.get("past_key_values") is None:  # a prefill: remember each row's prompt
            state["prompts"] = [
                tokenizer.decode([t for t in row if t not in special]) for row in kwargs["input_ids"].tolist()
            ]
            state["step"] = 0
        rows = out.logits.shape[0]
        n = rows // len(state["prompts"])
        forced = torch.full_like(out.logits[:, -1], -float("inf"))
        for r in range(rows):
            target = expected(state["prompts"][r // n], r % n)
            step = state["step"]
            forced[
                r,
                tokenizer.convert_tokens_to_ids(target[step])
                if step < len(target)
                else tokenizer.eos_token_id,
            ] = 0.0
        state["step"] += 1
        out.logits = torch.cat([out.logits[:, :-1], forced[:, None]], dim=1)
        return out

    return forward


def _in_generate(model) -> bool:
    return getattr(model, "_oracle_in_generate", False)


def _wrap_generate(tokenizer):
    inner = _wrap(tokenizer)

    def generate(self, *args, **kwargs):
        self._oracle_in_generate = True  # transformers' generate has its own forcing (the logits processor)
        try:
            return inner(self, *args, **kwargs)
        finally:
            self._oracle_in_generate = False

    return generate


def install(monkeypatch, tokenizer) -> None:
    """Every tiny model answers as the oracle, for this test."""
    monkeypatch.setattr(Qwen2ForCausalLM, "generate", _wrap_generate(tokenizer))
    monkeypatch.setattr(Qwen2ForCausalLM, "forward", _wrap_forward(tokenizer))


def install_in_process(tokenizer) -> None:
    """The same for the rest of this process (a spawned rank)."""
    Qwen2ForCausalLM.generate = _wrap_generate(tokenizer)
    Qwen2ForCausalLM.forward = _wrap_forward(tokenizer)


def check_microbatch(mb, tokenizer) -> list[str]:
    """For one (unpacked) training microbatch: each sequence's response judged against the prompt
    in front of it, and its advantage's sign (``"right+"``, ``"off_by_one-"``, ...)."""
    out = []
    lengths = mb.select.sum(dim=1).tolist()
    advantages = mb.advantages.split(lengths)
    for r, n in enumerate(lengths):
        if n == 0:
            continue
        cols = mb.select[r].nonzero()[:, 0]
        prompt = tokenizer.decode(mb.input_ids[r, : int(cols[0]) + 1].tolist(), skip_special_tokens=True)
        response = tokenizer.decode(mb.input_ids[r, int(cols[0]) + 1 : int(cols[-1]) + 2].tolist(),
                                    skip_special_tokens=True)  # fmt: skip
        sign = "+" if float(advantages[r][0]) > 0 else "-" if float(advantages[r][0]) < 0 else "0"
        out.append(judge(prompt, response) + sign)
    return out
