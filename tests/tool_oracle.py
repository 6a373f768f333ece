"""A scripted tool user, for tests of multi-turn rollouts: a stand-in causal LM that calls the
calculator on the ``tiny_tools`` task's prompts (``"a*b="``).

``ToolUser`` has the interface the rollout backends call (``forward`` with ``input_ids``,
``attention_mask``, ``position_ids``, a transformers ``DynamicCache``) and, like
``answer_oracle.AnswerModel``, writes each token into its cache (one-hot; a masked position is no
token) and reads every row's tokens back *from the cache* to choose the next one. So what it
answers comes from what the backend put in that row's cache: a tool output prefilled into the
wrong row, at the wrong place or not at all, gives a wrong answer.

Its script for the response to ``a*b=``, one token at a time:

- ``"use"``: ``<calc>a*b</calc>`` (the turn stops there; the calculator inserts
  ``<result>P</result>``), then ``P`` copied from the result in the cache, then EOS;
- ``"loop"``: ``<calc>a*b</calc>`` again after every result: it never stops calling (the caps
  must end it);
- ``"guess"``: ``0`` then EOS, no call.

The operands are written one character a token (``"100"`` as ``1 0 0``), as a model samples
them whatever the tokenizer's merges: a tokenizer with a merged ``"00"`` token encodes the same
text differently, so re-encoding the model's text would change the token ids.
"""

from __future__ import annotations

from types import SimpleNamespace

import torch
from transformers import DynamicCache


class ToolUser(torch.nn.Module):
    """The scripted tool user (module docstring): ``forward(...) -> .logits [R, L, V]``."""

    def __init__(self, tokenizer, mode: str = "use"):
        super().__init__()
        assert mode in ("use", "loop", "guess")
        self.tok, self.mode = tokenizer, mode
        self.vocab = len(tokenizer)
        self.scale = torch.nn.Parameter(torch.ones(()))  # a fake engine's copy is pushed to
        ids = tokenizer.convert_tokens_to_ids
        self.equals, self.eos = ids("="), tokenizer.eos_token_id
        self.open, self.close, self.result_end = ids("<calc>"), ids("</calc>"), ids("</result>")

    def forward(
        self, input_ids, attention_mask=None, position_ids=None, past_key_values=None, use_cache=False, **_
    ):
        onehot = torch.nn.functional.one_hot(input_ids, self.vocab).float()[:, None]  # [R, 1, L, V]
        if attention_mask is not None:
            onehot = onehot * attention_mask[:, -input_ids.shape[1] :][:, None, :, None]
        cache = past_key_values if past_key_values is not None else DynamicCache()
        _, history = cache.update(onehot, onehot, 0)  # every row's tokens so far, read back
        logits = torch.full((*input_ids.shape, self.vocab), -1e4)
        for i, h in enumerate(history[:, 0]):
            row = [int(t) for t, real in zip(h.argmax(-1).tolist(), h.sum(-1).tolist()) if real > 0]
            logits[i, -1, self.next_token(row)] = 0.0  # the backends read the last position only
        return SimpleNamespace(logits=self.scale * logits, past_key_values=cache if use_cache else None)

    def script(self, prompt: list[int]) -> list[int]:
        """The call's tokens for ``prompt`` (``a*b=``): ``<calc>``, one token a character, ``</calc>``."""
        text = self.tok.decode(prompt, skip_special_tokens=True).rstrip("=")
        return [self.open, *self.tok.convert_tokens_to_ids(list(text)), self.close]

    def next_token(self, row: list[int]) -> int:
        if self.equals not in row:
            return self.eos
        cut = row.index(self.equals) + 1
        prompt, response = row[:cut], row[cut:]
        if self.eos in response:
            return self.eos
        if self.mode == "guess":
            script = [self.tok.convert_tokens_to_ids("0"), self.eos]
            tail = response
        elif self.result_end in response:  # after a result: copy it (use) or call again (loop)
            last = len(response) - 1 - response[::-1].index(self.result_end)
            tail = response[last + 1 :]
            if self.mode == "use":
                result = response[response.index(self.result_end, 0) - 1 :: -1]
                digits = []
                for t in result:  # the result's digits, read back from the cache
                    piece = self.tok.convert_ids_to_tokens(t)
                    if not piece.isdigit():
                        break
                    digits.append(t)
                script = [*digits[::-1], self.eos]
            else:
                script = self.script(prompt)
        else:
            tail, script = response, self.script(prompt)
        return script[len(tail)] if len(tail) < len(script) else self.eos
