"""The per-prompt pass-rate table and what it drives: the difficulty filter, the easy-first
curriculum and adaptive group sizes (hand-worked), and exact resume of the table and the sampler."""

import json
import random

import pytest

from grpo_fast.algo.difficulty import PassRateTable, easiness_key, group_sizes, in_band
from grpo_fast.algo.prompt_sampler import PromptSampler


def test_pass_rate_is_correct_over_attempts_for_the_whole_run():
    t = PassRateTable(3)
    assert t.pass_rate(0) is None and not t.seen(0)
    t.update([0, 2], [[1, 0, 0, 0], [1, 1]])
    t.update([0], [[1, 1, 0.5, 1]])  # a fraction counts as that fraction of a success
    # prompt 0: (1 + 3.5) / 8 = 0.5625; prompt 2: 2 / 2
    assert (t.pass_rate(0), t.pass_rate(1), t.pass_rate(2)) == (0.5625, None, 1.0)
    assert t.summary() == {"seen_fraction": 2 / 3, "pass_rate_mean": (0.5625 + 1.0) / 2}
    with pytest.raises(ValueError, match=r"correctness must be in \[0, 1\]"):
        t.update([1], [[2.0]])
    with pytest.raises(IndexError, match="prompt index 3 is outside the table's 3 prompts"):
        t.update([3], [[1.0]])
    with pytest.raises(ValueError, match="2 prompts but 1 groups"):
        t.update([0, 1], [[1.0]])


def test_table_state_is_plain_python_and_round_trips():
    t = PassRateTable(4)
    t.update([1, 3], [[1, 0], [0.25]])
    state = json.loads(json.dumps(t.state_dict()))  # plain types: it survives JSON
    u = PassRateTable(4)
    u.load_state_dict(state)
    assert [u.pass_rate(i) for i in range(4)] == [None, 0.5, None, 0.25]
    with pytest.raises(ValueError, match="has 4 prompts, the data 5"):
        PassRateTable(5).load_state_dict(state)


def test_band_and_easiness_key():
    band = [0.1, 0.9]
    assert [in_band(q, band) for q in (0.05, 0.1, 0.5, 0.9, 1.0, None)] == [
        False,
        True,
        True,
        True,
        False,
        True,
    ]
    assert in_band(0.0, None)
    # by pass rate: unseen first, then the highest rate first
    rates = [0.5, None, 1.0, 0.0]
    assert sorted(range(4), key=lambda i: easiness_key(rates[i], None, False)) == [1, 2, 0, 3]
    # by difficulty: lower first, unknown last
    levels = [3.0, None, 1.0, 5.0]
    assert sorted(range(4), key=lambda i: easiness_key(None, levels[i], True)) == [2, 0, 3, 1]


@pytest.mark.parametrize(
    ("rates", "expected"),
    [
        # targets [2, 8, 4, 5] (Σ 19); λ = −1: [2 (1 clamped up), 7, 3, 4]
        ([1.0, 0.0, None, 0.5], [2, 7, 3, 4]),
        # targets [6.5, 4, 4, 4], λ = −0.625: [5.875, 3.375 ×3], floors Σ 14, +1 to prompts 0 and 1
        ([0.25, None, None, None], [6, 4, 3, 3]),
        ([None, None, None, None], [4, 4, 4, 4]),  # nothing known: the fixed group size
        ([1.0, 1.0, 1.0, 1.0], [4, 4, 4, 4]),  # all equally easy: the shift brings them back to 4
        # targets [8, 8, 2, 2] (Σ 20); λ = −2: [6, 6, 2, 2] (the easy ones clamped at 2)
        ([0.0, 0.0, 1.0, 1.0], [6, 6, 2, 2]),
    ],
    ids=["mixed", "remainders", "unseen", "all-easy", "two-hard"],
)
def test_group_sizes_hand_values(rates, expected):
    sizes = group_sizes(rates, group_size=4, min_size=2, max_size=8, total=16)
    assert sizes == expected and sum(sizes) == 16


def test_group_sizes_keep_the_total_and_bounds_everywhere():
    rng = random.Random(0)
    for _ in range(500):
        n, lo = rng.randint(1, 12), rng.randint(2, 4)
        g = rng.randint(lo, lo + 4)
        hi = rng.randint(g, g + 8)
        rates = [rng.choice([None, 0.0, 1.0, rng.random()]) for _ in range(n)]
        sizes = group_sizes(rates, g, lo, hi, n * g)
        assert sum(sizes) == n * g and all(lo <= s <= hi for s in sizes), (rates, g, lo, hi, sizes)
    with pytest.raises(ValueError, match="total=40 responses cannot be split over 2 prompts in"):
        group_sizes([None, None], 4, 2, 8, 40)
    table = PassRateTable(3)
    table.update([0], [[1.0, 1.0, 1.0, 1.0]])
    assert table.group_sizes([0, 1, 2], 4, 2, 8, 12) == group_sizes([1.0, None, None], 4, 2, 8, 12)


def test_sampler_without_options_keeps_its_sequence_and_state():
    plain = PromptSampler(10, seed=3)
    with_table = PromptSampler(10, seed=3, table=PassRateTable(10))  # a table alone changes nothing
    order = list(range(10))
    random.Random(3 * 100_003).shuffle(order)  # pass 0: the seeded shuffle
    assert plain.next(10) == order == with_table.next(10)
    assert plain.next(25) == with_table.next(25)
    assert plain.state_dict() == {"n": 10, "seed": 3, "epoch": 3, "pos": 5}


def test_difficulty_filter_skips_seen_prompts_outside_the_band():
    table = PassRateTable(6)
    s = PromptSampler(6, seed=0, table=table, difficulty_filter=[0.1, 0.9])
    first = s.next(6)
    assert sorted(first) == list(range(6)) and s.skipped == 0  # pass 0: nothing seen, nothing skipped
    # prompts 0 and 1 solved every time (1.0 > 0.9), 2 never (0.0 < 0.1); 3-5 in between
    table.update(range(6), [[1, 1], [1, 1], [0, 0], [1, 0], [0.5, 0.5], [1, 0]])
    second = s.next(3)
    assert s.skipped == 3
    rest = s.next(3)  # the pass holds the 3 kept prompts only; the next pass starts
    assert sorted(second) == [3, 4, 5] and s.epoch == 2 and s.pos == 3
    assert sorted(rest) == [3, 4, 5]


def test_difficulty_filter_never_starves_the_run():
    table = PassRateTable(3)
    s = PromptSampler(3, seed=0, table=table, difficulty_filter=[0.0, 0.5])
    table.update(s.next(3), [[1.0], [1.0], [1.0]])  # all solved: all outside the band
    assert sorted(s.next(3)) == [0, 1, 2] and s.skipped == 0


def test_easy_first_by_pass_rate_orders_each_pass_after_the_first():
    table = PassRateTable(5)
    s = PromptSampler(5, seed=1, table=table, curriculum="easy_first")
    plain = PromptSampler(5, seed=1)
    first = s.next(5)
    assert first == plain.next(5)  # pass 0: all unseen, the shuffle itself
    table.update([0, 1, 2, 3], [[0.0], [1.0], [0.5], [0.75]])  # prompt 4 not scored: unseen
    assert s.next(5) == [4, 1, 3, 2, 0]  # unseen, then 1.0, 0.75, 0.5, 0.0


def test_easy_first_by_difficulty_needs_no_table():
    levels = [5.0, 1.0, None, 3.0, 1.0, 2.0]
    s = PromptSampler(6, seed=2, curriculum="easy_first", difficulty=levels)
    order = s.next(6)
    assert [levels[i] for i in order] == [1.0, 1.0, 2.0, 3.0, 5.0, None]
    shuffled = list(range(6))
    random.Random(2 * 100_003).shuffle(shuffled)
    assert order[:2] == [i for i in shuffled if levels[i] == 1.0]  # ties keep the shuffled order


def test_sampler_with_options_resumes_exactly():
    """The state keeps the running pass's order (built from the table when it began), so a sampler
    rebuilt from a fresh table, then restored, draws the same prompts as the one that ran on."""
    table = PassRateTable(8)
    s = PromptSampler(8, seed=4, table=table, difficulty_filter=[0.0, 0.9], curriculum="easy_first")
    rng = random.Random(0)
    for _ in range(3):  # three steps of 4 prompts: into the second pass, which filter and order shape
        idx = s.next(4)
        table.update(idx, [[float(rng.random() < 0.5 + i / 16) for _ in range(4)] for i in idx])
    saved_sampler, saved_table = json.loads(json.dumps(s.state_dict())), table.state_dict()
    ahead = []
    for _ in range(4):
        idx = s.next(4)
        ahead.append(idx)
        table.update(idx, [[1.0, 0.0] for _ in idx])

    table2 = PassRateTable(8)
    s2 = PromptSampler(8, seed=4, table=table2, difficulty_filter=[0.0, 0.9], curriculum="easy_first")
    table2.load_state_dict(saved_table)
    s2.load_state_dict(saved_sampler)
    for expected in ahead:
        idx = s2.next(4)
        assert idx == expected
        table2.update(idx, [[1.0, 0.0] for _ in idx])


def test_sampler_refuses_options_without_what_they_need():
    with pytest.raises(ValueError, match="need the pass-rate table"):
        PromptSampler(4, seed=0, difficulty_filter=[0.0, 0.5])
    with pytest.raises(ValueError, match="need the pass-rate table"):
        PromptSampler(4, seed=0, curriculum="easy_first")
    with pytest.raises(ValueError, match="unknown curriculum 'hard_first'"):
        PromptSampler(4, seed=0, curriculum="hard_first")
    with pytest.raises(ValueError, match="3 difficulties for 4 prompts"):
        PromptSampler(4, seed=0, curriculum="easy_first", difficulty=[1.0, 2.0, 3.0])
