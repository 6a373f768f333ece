"""Per-prompt pass rates, and the three options they drive.

``PassRateTable`` holds, for every training prompt ``i``, the number of responses scored correct
and the number of responses generated over the whole run so far:

    pass_rate(i) = correct_i / attempts_i        (None while attempts_i = 0: "unseen")

"Correct" is what the loop passes to ``update`` per response (the reward's ``answer_reward``, a
0/1 number; a fraction in [0, 1] counts as that fraction of a success). Plain counts, no
decay: with a dataset of thousands of prompts a prompt is met once or twice per run, and two
visits of 8 responses weigh the same. The table is plain Python lists (``state_dict``), saved in
checkpoints and restored on resume.

The options (``rollout.*``):

- ``difficulty_filter=[lo, hi]``: a pass over the data leaves out the prompts already seen whose
  pass rate is outside ``[lo, hi]`` (``in_band``; the sampler, ``grpo_fast.loop.optim.PromptSampler``).
- ``curriculum=easy_first``: each pass visits its prompts from the easiest to the hardest
  (``easiness_key``): by ``Example.difficulty`` when the data has one (lower first), else by pass
  rate (higher first, unseen prompts before every seen one).
- ``curriculum=paced``: each step draws at random from the easiest ``q`` of the prompts, ``q``
  growing from ``rollout.curriculum_start`` to 1 over ``rollout.curriculum_steps``
  (``paced_quantile``), by the same easiness: a mixture that shifts to the hard end, never a sort.
- ``adaptive_group_size``: group sizes per prompt in ``[min, max]``, more for prompts rarely
  solved, with the step's total number of responses kept exactly (``group_sizes``).

Example:
    >>> table = PassRateTable(3)
    >>> table.update([0, 2], [[1, 0, 0, 0], [1, 1, 1, 1]])
    >>> table.pass_rate(0), table.pass_rate(1), table.pass_rate(2)
    (0.25, None, 1.0)
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Sequence

__all__ = ["CURRICULA", "PassRateTable", "easiness_key", "group_sizes", "in_band", "paced_quantile"]

CURRICULA = ("none", "easy_first", "paced")  # rollout.curriculum


class PassRateTable:
    """Correct responses and attempts per training prompt (see the module docstring).

    Args:
        n: the number of training prompts (indices ``0 … n−1``, as ``PromptSampler`` draws them).
    """

    def __init__(self, n: int):
        if n <= 0:
            raise ValueError("no training examples to keep pass rates for")
        self.n = n
        self.correct = [0.0] * n
        self.attempts = [0] * n

    def update(self, prompt_indices: Sequence[int], correct: Sequence[Sequence[float]]) -> None:
        """Add one group per prompt: ``correct[j]`` holds the correctness (0…1) of each response
        to prompt ``prompt_indices[j]`` (groups may differ in size; a prompt may appear twice).

        Every data-parallel rank must hold the same table: pass the whole step's prompts (all
        ranks' groups, gathered), on every rank.
        """
        if len(prompt_indices) != len(correct):
            raise ValueError(f"{len(prompt_indices)} prompts but {len(correct)} groups of results")
        for i, group in zip(prompt_indices, correct):
            if not 0 <= i < self.n:
                raise IndexError(f"prompt index {i} is outside the table's {self.n} prompts")
            values = [float(c) for c in group]
            if any(not 0.0 <= c <= 1.0 for c in values):
                raise ValueError(f"correctness must be in [0, 1], got {values} for prompt {i}")
            self.correct[i] += sum(values)
            self.attempts[i] += len(values)

    def pass_rate(self, i: int) -> float | None:
        """``correct / attempts`` of prompt ``i``, or None before its first response."""
        return self.correct[i] / self.attempts[i] if self.attempts[i] else None

    def seen(self, i: int) -> bool:
        return self.attempts[i] > 0

    def summary(self) -> dict[str, float]:
        """For logging: the fraction of prompts seen and their mean pass rate (NaN if none)."""
        rates = [self.correct[i] / a for i, a in enumerate(self.attempts) if a]
        return {
            "seen_fraction": len(rates) / self.n,
            "pass_rate_mean": sum(rates) / len(rates) if rates else math.nan,
        }

    def state_dict(self) -> dict:
        return {"n": self.n, "correct": list(self.correct), "attempts": list(self.attempts)}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"the checkpoint's pass-rate table has {state['n']} prompts, the data {self.n}")
        self.correct = [float(c) for c in state["correct"]]
        self.attempts = [int(a) for a in state["attempts"]]

    def group_sizes(
        self, prompt_indices: Sequence[int], group_size: int, min_size: int, max_size: int, total: int
    ) -> list[int]:
        """``group_sizes`` for these prompts, from their pass rates (None for the unseen)."""
        return group_sizes([self.pass_rate(i) for i in prompt_indices], group_size, min_size, max_size, total)


def in_band(rate: float | None, band: Sequence[float] | None) -> bool:
    """Whether ``rollout.difficulty_filter=band`` keeps a prompt of pass rate ``rate``: always
    when there is no band or the prompt is unseen (None), else when ``lo ≤ rate ≤ hi``.

    Example: band ``[0.1, 0.9]``: 0.05 → False, 0.5 → True, 0.9 → True, 1.0 → False, None → True.
    """
    if band is None or rate is None:
        return True
    return band[0] <= rate <= band[1]


def easiness_key(rate: float | None, difficulty: float | None, by_difficulty: bool) -> tuple:
    """The sort key of ``curriculum=easy_first`` (ascending = easiest first).

    ``by_difficulty`` (the data has ``Example.difficulty``): lower difficulty first, unknown
    difficulty (None) last. Otherwise by pass rate: unseen prompts first (nothing known yet:
    they keep the pass's shuffled order), then the seen ones from the highest rate to the lowest.

    Example: rates ``[None, 0.5, 1.0, 0.0]`` sort as ``None, 1.0, 0.5, 0.0``.
    """
    if by_difficulty:
        return (difficulty is None, difficulty if difficulty is not None else 0.0)
    return (rate is not None, -(rate or 0.0))


def paced_quantile(step: int, start: float, steps: int) -> float:
    """``curriculum=paced``: the share of the prompts, easiest first, step ``step`` (1, 2, …) draws
    from: ``start`` at step 1, growing linearly to 1 at step ``steps + 1`` and after.

    Example: start 0.25 over 100 steps: step 1 → 0.25, step 51 → 0.625, step 101 → 1.0.
    """
    return start + (1.0 - start) * min(1.0, max(step - 1, 0) / steps)


def group_sizes(
    rates: Sequence[float | None], group_size: int, min_size: int, max_size: int, total: int
) -> list[int]:
    """Responses per prompt by difficulty, between ``min_size`` and ``max_size``, summing to ``total``.

    1. Target ``t_j = max − (max − min)·q_j`` for a prompt of pass rate ``q_j`` (never solved:
       ``max``; always solved: ``min``); an unseen prompt (None) targets ``group_size``.
    2. One shift ``λ`` for all: ``x_j = clamp(t_j + λ, min, max)`` with ``Σ x_j = total`` (exact:
       ``Σ clamp`` is piecewise linear in ``λ``). All prompts unseen: ``λ = 0``, every size
       ``group_size`` (the fixed-group batch).
    3. Round by largest remainder: ``⌊x_j⌋`` each, then one more to the ``total − Σ⌊x_j⌋``
       prompts with the largest ``x_j − ⌊x_j⌋`` (ties: the earlier prompt).

    Example:
        min 2, max 8, group 4, total 16, rates ``[1, 0, None, 0.5]``: targets ``[2, 8, 4, 5]``
        (Σ 19); ``λ = −1`` gives ``[2 (1 clamped), 7, 3, 4]`` (Σ 16): sizes ``[2, 7, 3, 4]``.
        Rates ``[0.25, None, None, None]``: targets ``[6.5, 4, 4, 4]``, ``λ = −0.625``,
        ``x = [5.875, 3.375, 3.375, 3.375]``, floors Σ 14; the 2 left go to prompts 0 and 1:
        ``[6, 4, 3, 3]``.
    """
    n = len(rates)
    if not 2 <= min_size <= group_size <= max_size:
        raise ValueError(f"need 2 <= min_size={min_size} <= group_size={group_size} <= max_size={max_size}")
    if not n * min_size <= total <= n * max_size:
        raise ValueError(
            f"total={total} responses cannot be split over {n} prompts in [{min_size}, {max_size}]"
        )
    if n == 0:
        return []
    targets = [float(group_size) if q is None else max_size - (max_size - min_size) * q for q in rates]

    def filled(shift: float) -> float:
        return sum(min(max(t + shift, min_size), max_size) for t in targets)

    # Σ clamp(t + λ) changes slope only where some t + λ meets min or max: find the segment holding
    # total between two consecutive breakpoints, then solve the linear piece.
    points = sorted({float(min_size) - t for t in targets} | {float(max_size) - t for t in targets})
    shift = points[0]  # a single breakpoint: min = group = max, every size the same
    for lo, hi in itertools.pairwise(points):
        f_lo, f_hi = filled(lo), filled(hi)
        if f_lo <= total <= f_hi:
            shift = lo if f_hi == f_lo else lo + (total - f_lo) * (hi - lo) / (f_hi - f_lo)
            break
    x = [min(max(t + shift, min_size), max_size) for t in targets]
    sizes = [math.floor(v + 1e-9) for v in x]  # 2.9999999997 from the solve is 3
    left = total - sum(sizes)
    order = sorted(range(n), key=lambda j: (-(x[j] - sizes[j]), j))
    for j in order:  # one more each, largest remainder first
        if left <= 0:
            break
        if sizes[j] < max_size:
            sizes[j] += 1
            left -= 1
    for j in reversed(order):  # rounding overshoot (at most a unit or so): smallest remainder first
        if left >= 0:
            break
        if sizes[j] > min_size:
            sizes[j] -= 1
            left += 1
    assert sum(sizes) == total and all(min_size <= s <= max_size for s in sizes), (sizes, total)
    return sizes
