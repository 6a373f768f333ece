"""The prompt sampler: which training prompts each step draws, pass after pass over the data."""

from __future__ import annotations

import random
from collections.abc import Sequence

from grpo_fast.algo.difficulty import CURRICULA, PassRateTable, easiness_key, in_band

__all__ = ["PromptSampler"]


class PromptSampler:
    """Draws prompt indices without replacement, reshuffling (with a seed) at each pass over the data.

    Every data-parallel rank holds the same sampler, draws the same global set of prompts, and
    keeps its own slice; ``state_dict`` makes resume exact.

    A pass's order is fixed when its first prompt is drawn: the seeded shuffle of pass ``e``
    (``random.Random(seed·100003 + e)``), then, with the options (``grpo_fast.algo.difficulty``):

    - ``difficulty_filter=[lo, hi]`` (needs ``table``): the prompts already seen whose pass rate
      is outside ``[lo, hi]`` are left out of the pass (``skipped`` counts them); were that every
      prompt, the pass keeps them all (a run never starves).
    - ``curriculum="easy_first"``: the pass is stably sorted from the easiest to the hardest
      (``easiness_key``): by ``difficulty`` (one number or None per prompt, lower first) when
      given, else by the ``table``'s pass rates at that moment (unseen first, then the highest
      rate first); ties keep the shuffled order. The first pass by pass rate is the plain
      shuffle (nothing is known yet); a run shorter than a pass ends before the hardest prompts.

    Without options the sequence and the state are what they always were.

    Example:
        >>> table = PassRateTable(4)
        >>> s = PromptSampler(4, seed=0, table=table, curriculum="easy_first")
        >>> first = s.next(4)  # the first pass: the shuffle
        >>> table.update(first, [[1.0], [0.0], [0.5], [0.25]])
        >>> [table.pass_rate(i) for i in s.next(4)]  # the second: easiest first
        [1.0, 0.5, 0.25, 0.0]
    """

    def __init__(
        self,
        n: int,
        seed: int,
        *,
        table: PassRateTable | None = None,
        difficulty_filter: Sequence[float] | None = None,
        curriculum: str = "none",
        difficulty: Sequence[float | None] | None = None,
    ):
        if n <= 0:
            raise ValueError("no training examples to sample from")
        if curriculum not in CURRICULA:
            raise ValueError(f"unknown curriculum {curriculum!r}; expected one of {', '.join(CURRICULA)}")
        by_rate = curriculum == "easy_first" and difficulty is None
        if table is None and (difficulty_filter is not None or by_rate):
            raise ValueError("difficulty_filter and a curriculum by pass rate need the pass-rate table")
        if table is not None and table.n != n:
            raise ValueError(f"the pass-rate table has {table.n} prompts, the sampler {n}")
        if difficulty is not None and len(difficulty) != n:
            raise ValueError(f"{len(difficulty)} difficulties for {n} prompts")
        self.n, self.seed = n, seed
        self.table, self.band, self.curriculum = table, difficulty_filter, curriculum
        self.difficulty = None if difficulty is None else list(difficulty)
        self._options = difficulty_filter is not None or curriculum != "none"
        self.epoch, self.pos, self.skipped = 0, 0, 0
        self._order = self._pass_order()

    def _shuffle(self) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 100_003 + self.epoch).shuffle(order)
        return order

    def _pass_order(self) -> list[int]:
        order = self._shuffle()
        self.skipped = 0
        if self.band is not None:
            kept = [i for i in order if in_band(self.table.pass_rate(i), self.band)]
            if kept:
                self.skipped, order = len(order) - len(kept), kept
        if self.curriculum == "easy_first":
            by_difficulty = self.difficulty is not None
            rate = self.table.pass_rate if self.table is not None else (lambda i: None)
            diff = self.difficulty.__getitem__ if by_difficulty else (lambda i: None)
            order.sort(key=lambda i: easiness_key(rate(i), diff(i), by_difficulty))
        return order

    def next(self, k: int) -> list[int]:
        out = []
        while len(out) < k:
            if self.pos == len(self._order):
                self.epoch, self.pos = self.epoch + 1, 0
                self._order = self._pass_order()
            take = min(k - len(out), len(self._order) - self.pos)
            out.extend(self._order[self.pos : self.pos + take])
            self.pos += take
        return out

    def state_dict(self) -> dict:
        state = {"n": self.n, "seed": self.seed, "epoch": self.epoch, "pos": self.pos}
        if self._options:  # the pass's order depends on the table when it began: keep it
            state.update(order=list(self._order), skipped=self.skipped)
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"the checkpoint's sampler saw {state['n']} examples, the data has {self.n}")
        self.seed, self.epoch, self.pos = state["seed"], state["epoch"], state["pos"]
        if "order" in state:
            self._order, self.skipped = [int(i) for i in state["order"]], int(state["skipped"])
        else:
            self._order = self._shuffle()
