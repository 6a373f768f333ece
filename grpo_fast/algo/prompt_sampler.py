"""The prompt sampler: which training prompts each step draws, pass after pass over the data."""

from __future__ import annotations

import math
import random
from collections.abc import Sequence

from grpo_fast.algo.difficulty import CURRICULA, PassRateTable, easiness_key, in_band, paced_quantile

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

    - ``curriculum="paced"`` (``pace=(start, steps)``): a step's prompts are ``k`` distinct ones
      drawn uniformly (seeded per draw) from the easiest ``q = paced_quantile(step, start, steps)``
      of all the prompts (by ``easiness_key``, ties broken by a seeded shuffle fixed for the run;
      by pass rate the ranking is taken anew at each draw). The step's mix is the pool's: easy
      ones only at first, then easy and harder ones in their share of the pool, the whole data
      once ``q = 1``; never a sort (a draw without replacement across steps would favour the
      newly admitted, the easy ones being used up: the sort again). No passes: a prompt may come
      back before every prompt was drawn.

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
        pace: tuple[float, int] | None = None,
    ):
        if n <= 0:
            raise ValueError("no training examples to sample from")
        if curriculum not in CURRICULA:
            raise ValueError(f"unknown curriculum {curriculum!r}; expected one of {', '.join(CURRICULA)}")
        by_rate = curriculum != "none" and difficulty is None
        if (curriculum == "paced") != (pace is not None):
            raise ValueError("pace=(start, steps) is needed with curriculum='paced', and only then")
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
        self.pace, self.draws = pace, 0  # paced: the draws so far (each seeds its own)
        self._ties = self._shuffle(salt=1) if pace is not None else None  # the ranking's tie-break
        self._order = self._pass_order()

    def _shuffle(self, salt: int = 0) -> list[int]:
        order = list(range(self.n))
        random.Random(self.seed * 100_003 + self.epoch if not salt else f"{self.seed}/ties").shuffle(order)
        return order

    def _pass_order(self) -> list[int]:
        order = self._shuffle()
        self.skipped = 0
        if self.band is not None:
            kept = [i for i in order if in_band(self.table.pass_rate(i), self.band)]
            if kept:
                self.skipped, order = len(order) - len(kept), kept
        if self.curriculum == "easy_first":
            order.sort(key=self._easiness)
        return order

    def _easiness(self, i: int) -> tuple:
        by_difficulty = self.difficulty is not None
        rate = self.table.pass_rate(i) if self.table is not None else None
        return easiness_key(rate, self.difficulty[i] if by_difficulty else None, by_difficulty)

    def _next_paced(self, k: int, step: int) -> list[int]:
        """``curriculum="paced"``: ``k`` distinct prompts drawn uniformly from those admitted at
        ``step`` (class docstring); each call its own seeded draw (``draws``: exact resume)."""
        q = paced_quantile(step, *self.pace)
        rank = {i: r for r, i in enumerate(self._ties)}  # the fixed tie-break among equal easiness
        easiest = sorted(range(self.n), key=lambda i: (self._easiness(i), rank[i]))
        admitted = easiest[: max(k, math.ceil(q * self.n))]
        if self.band is not None:  # rollout.difficulty_filter: the seen prompts outside the band leave
            kept = [i for i in admitted if in_band(self.table.pass_rate(i), self.band)]
            self.skipped = len(admitted) - len(kept)
            admitted = kept if len(kept) >= k else admitted
        self.draws += 1
        return random.Random(self.seed * 1_000_003 + self.draws).sample(admitted, k)

    def next(self, k: int, step: int = 1) -> list[int]:
        """The next ``k`` prompt indices; ``step`` (1, 2, …) paces ``curriculum="paced"``."""
        if self.pace is not None:
            return self._next_paced(k, step)
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
        if self.pace is not None:  # the pace too: a resume with more steps keeps the run's
            state.update(draws=self.draws, pace=list(self.pace))
        return state

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"the checkpoint's sampler saw {state['n']} examples, the data has {self.n}")
        self.seed, self.epoch, self.pos = state["seed"], state["epoch"], state["pos"]
        if "order" in state:
            self._order, self.skipped = [int(i) for i in state["order"]], int(state["skipped"])
        else:
            self._order = self._shuffle()
        self.draws = int(state.get("draws", 0))
        if "pace" in state:
            self.pace = (float(state["pace"][0]), int(state["pace"][1]))
