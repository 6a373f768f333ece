"""A policy that answers the tiny task's prompts, for tests that check each response is kept with
the prompt it answers (rollouts, rewards, training sequences, across ranks).

``AnswerModel`` is a stand-in causal LM with the interface the rollout backends call (``forward``
with ``input_ids``, ``attention_mask``, ``position_ids``, a transformers ``DynamicCache`` in
``past_key_values``; one parameter, so an engine's copy can be pushed to): it writes each token
into its cache (one-hot) and reads every row's tokens back *from the cache* to choose the next
one. So a row continues the prompt its cache holds: a backend that expands, pads or orders rows
wrongly makes it answer another prompt, which the tests see. The answer to a row's prompt
``a+b=`` is ``a + b`` on the even samples of its group and ten times that (a trailing 0) on the
odd ones (a row's sample index: the rows before it in the batch whose cache holds the same
prompt), then EOS: the two share every token up to the 0, so the samples of a prompt may share
its prefill. A response kept under another prompt of the batch is then neither, unless the two
prompts have the same sum (the tests use distinct sums; the loop's few coincidences pass).

``install(monkeypatch, tokenizer)`` makes the training loop's ``hf`` backend sample with it (the
policy still trains; the backend keeps the oracle across weight updates); ``install_in_process``
does the same for the rest of a spawned rank's process.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import DynamicCache


def expected(prompt: str, sample: int) -> str:
    """The oracle's response (digits) to ``prompt`` (``"a+b="``) as sample ``sample`` of its group."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return str(a + b) + "0" * (sample % 2)


def judge(prompt: str, response: str) -> str:
    """``"right"`` (``a + b``), ``"tenfold"`` (``a + b`` then 0, the odd samples; cut to
    ``rollout.max_tokens`` 4 for a three-digit sum) or ``"foreign"``: neither of the oracle's
    answers to ``prompt``."""
    a, b = (int(x) for x in prompt.rstrip("=").split("+"))
    return {str(a + b): "right", (str(a + b) + "0")[:4]: "tenfold"}.get(response.strip(), "foreign")


def check_grouped(rollout, questions: list[str], n: int, tokenizer) -> None:
    """A backend's ``rollout`` of the oracle for ``questions``, ``n`` samples each: every
    response kept under its own prompt, in prompt order, its samples alternating right/tenfold,
    and rewarded 1/0/1... by the tiny task's reward against the even samples' answer."""
    from grpo_fast.task import tiny

    prompts = [tokenizer.decode(p) for p in rollout.response_prompt_ids()]
    assert prompts == [q for q in questions for _ in range(n)]
    judged = [judge(p, r) for p, r in zip(prompts, rollout.response_text)]
    assert judged == [("right", "tenfold")[k % 2] for k in range(n)] * len(questions)
    rewards = [
        tiny.tiny_reward_fn(r, expected(p, 0))["reward"] for p, r in zip(prompts, rollout.response_text)
    ]
    assert rewards == [(1.0, 0.0)[k % 2] for k in range(n)] * len(questions)


class AnswerModel(torch.nn.Module):
    """The oracle as a causal LM (module docstring): ``forward(...) -> .logits [R, L, V]``."""

    def __init__(self, tokenizer):
        super().__init__()
        self.tok = tokenizer
        self.vocab = len(tokenizer)
        self.scale = torch.nn.Parameter(torch.ones(()))  # NaN until pushed, in a fake engine's copy
        self.equals = tokenizer.convert_tokens_to_ids("=")

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False, **_
    ):
        onehot = torch.nn.functional.one_hot(input_ids, self.vocab).float()[:, None]  # [R, 1, L, V]
        if mask_given := attention_mask is not None:
            new = attention_mask[:, -input_ids.shape[1] :]
            onehot = onehot * new[:, None, :, None]  # padding is not a token
        cache = past_key_values if past_key_values is not None else DynamicCache()
        _, history = cache.update(onehot, onehot, 0)  # every row's tokens so far, read back
        rows = [
            [int(t) for t, real in zip(h.argmax(-1).tolist(), h.sum(-1).tolist()) if real > 0]
            for h in history[:, 0]
        ]
        start = len(rows[0]) - input_ids.shape[1] if not mask_given else None
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        prompts = [self._prompt(r) for r in rows]
        for i, row in enumerate(rows):
            sample = prompts[:i].count(prompts[i])  # the rows before it with its prompt
            width = input_ids.shape[1]
            for j in range(width):  # position j of this call: the tokens up to it
                upto = len(row) - (width - 1 - j) if start is None else start + j + 1
                logits[i, j, self._next(row[: max(upto, 0)], sample)] = 0.0
        return SimpleNamespace(logits=self.scale * logits, past_key_values=cache if use_cache else None)

    def _prompt(self, row: list[int]) -> tuple[int, ...]:
        return tuple(row[: row.index(self.equals) + 1]) if self.equals in row else tuple(row)

    def _next(self, row: list[int], sample: int) -> int:
        special = {self.tok.pad_token_id, self.tok.eos_token_id}
        if self.equals not in row or self.tok.eos_token_id in row[row.index(self.equals) :]:
            return self.tok.eos_token_id
        text = self.tok.decode([t for t in row if t not in special])
        prompt, _, sampled = text.partition("=")
        target = expected(prompt + "=", sample)
        if len(sampled) >= len(target):
            return self.tok.eos_token_id
        return self.tok.convert_tokens_to_ids(target[len(sampled)])


def _oracle_backend(ctx):
    from grpo_fast.rollout.hf import HFBackend

    class OracleBackend(HFBackend):
        def load_weights(self, staged, version: int) -> None:
            """The policy trains; the rollouts stay the oracle's."""
            self.version = version

    return OracleBackend(AnswerModel(ctx.tokenizer), ctx.tokenizer, ctx.cfg.rollout.generation_batch_size)


def install(monkeypatch, tokenizer) -> None:
    """The training loop's ``hf`` backend samples with ``AnswerModel``, for this test."""
    from grpo_fast.loop import setup

    monkeypatch.setattr(setup, "make_backend", _oracle_backend)


def install_in_process(tokenizer) -> None:
    """The same for the rest of this process (a spawned rank)."""
    from grpo_fast.loop import setup

    setup.make_backend = _oracle_backend


def check_microbatch(mb, tokenizer) -> list[str]:
    """For one training microbatch (a row per sequence, or shared prompts: ``[prompt, r_1 … r_k]``
    rows): each sequence's response (its labels) judged against the prompt it is trained behind,
    the tokens before the position that predicts its first label, and its advantage's sign
    (``"right+"``, ``"tenfold-"``, ...)."""
    out = []
    ids = mb.input_ids.flatten()
    width = mb.input_ids.shape[1]
    positions = (
        mb.position_ids.flatten() if mb.position_ids is not None else torch.arange(ids.numel()) % width
    )
    for k in mb.sequence_ids.unique().tolist():
        tokens = (mb.sequence_ids == k).nonzero()[:, 0]
        first = int(mb.select_index[tokens[0]])  # the prompt's last token
        prompt_ids = ids[first - int(positions[first]) : first + 1]
        prompt = tokenizer.decode(prompt_ids.tolist(), skip_special_tokens=True)
        response = tokenizer.decode(mb.labels[tokens].tolist(), skip_special_tokens=True)
        adv = float(mb.advantages[tokens[0]])
        sign = "+" if adv > 0 else "-" if adv < 0 else "0"
        out.append(judge(prompt, response) + sign)
    return out
