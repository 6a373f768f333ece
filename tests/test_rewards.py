"""Rewards and the math grader: extraction, normalization, an equivalence table, pathological
inputs under a time bound, grading off the main thread, the hard-kill path, the registry."""

import threading
import time

import pytest

from grpo_fast.errors import ConfigError
from grpo_fast.task import rewards
from grpo_fast.task.rewards import (
    REWARD_FNS,
    MathGrader,
    extract_boxed,
    extract_last_number,
    get_reward_fn,
    gsm8k_reward_fn,
    is_equivalent,
    normalize_answer,
    r1_zero_reward_fn,
    register_reward,
)

# A hang, not a slow machine: pathological inputs take < 0.02 s when the cheap pre-checks reject
# them and at most the soft timeout (0.6 s) when they reach the worker, whose hard limit is 1.0 s +
# kill + restart (≈0.5 s idle, seconds at load 8 on 2 cores); unguarded, 9^9^9^9 never returns.
# How fast they return is not asserted: on a shared machine the load would decide it.
HANG_S = 60.0


def wrap(answer: str) -> str:
    return f"Let me think. </think> <answer> {answer} </answer>"


# ----------------------------------------------------------------------------------------------
# Extraction and normalization
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("so $\\boxed{5}$.", "5"),
        ("\\boxed{\\frac{1}{2}}", "\\frac{1}{2}"),
        ("\\boxed{\\{1,2\\}}", "\\{1,2\\}"),  # escaped braces do not close the box
        ("first \\boxed{1} then \\boxed{2}", "2"),  # the last box wins
        ("\\fbox{7}", "7"),
        ("\\boxed{1} and \\fbox{3}", "3"),
        ("\\boxed 5$ done", "5"),
        ("\\boxed{a^{2}+b}", "a^{2}+b"),
        ("\\boxed{1", None),  # unclosed
        ("no box here", None),
        ("\\boxed", None),
    ],
    ids=[
        "dollar",
        "frac",
        "escaped-braces",
        "last",
        "fbox",
        "fbox-last",
        "space-form",
        "nested",
        "unclosed",
        "none",
        "bare-cmd",
    ],
)
def test_extract_boxed(text, expected):
    assert extract_boxed(text) == expected


@pytest.mark.parametrize(
    ("raw", "expected"),
    [
        ("\\boxed{\\dfrac12}", "\\frac{1}{2}"),
        ("x = 1{,}000 \\text{ cm}.", "1000"),
        ("10\\text{ cm}^2", "10"),
        ("\\left( 1, 2 \\right)", "(1,2)"),
        ("30^\\circ", "30"),
        ("30^{\\circ}", "30"),
        ("50\\%", "50"),
        ("\\$5.00", "5.00"),
        ("\\text{(A)}", "A"),
        ("a \\cdot b", "a\\cdot b"),  # the space after a command before a letter stays
        ("\\sqrt2", "\\sqrt{2}"),
        (".5", "0.5"),
        ("-.5", "-0.5"),
        ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
        ("\\mathrm{Monday}", "Monday"),
        ("1,2,3", "1,2,3"),  # a list, not a thousands separator
    ],
)
def test_normalize_answer(raw, expected):
    assert normalize_answer(raw) == expected


def test_extract_last_number():
    from fractions import Fraction

    assert extract_last_number("3 apples cost $1,250.50, so -2 left") == -2
    assert extract_last_number("it costs $1,250.50") == Fraction(125050, 100)
    assert extract_last_number("x-5") == 5  # a minus after a letter is subtraction
    assert extract_last_number("no digits") is None
    assert extract_last_number("9" * 100) is None  # longer than anyone's answer


# ----------------------------------------------------------------------------------------------
# The equivalence table
# ----------------------------------------------------------------------------------------------

EQUIVALENT = [
    ("0.5", "\\frac{1}{2}"),
    ("1/2", "\\frac{1}{2}"),
    ("\\dfrac{3}{4}", "0.75"),
    ("\\tfrac{3}{4}", "\\frac34"),
    ("1,000", "1000"),
    ("1000.0", "1,000"),
    ("x^2+2x+1", "(x+1)^2"),
    ("3+2x", "2x+3"),
    ("0.5x", "\\frac{x}{2}"),
    ("(1,2)", "\\left(1,2\\right)"),
    ("30", "30^\\circ"),
    ("50", "50\\%"),
    ("5", "\\$5"),
    ("A", "\\text{(A)}"),
    ("3", "x=3"),
    ("12", "12 \\text{ inches}"),
    ("\\frac{\\sqrt2}{2}", "\\sqrt{2}/2"),
    ("\\sqrt{12}", "2\\sqrt{3}"),
    ("\\sqrt{18}", "3\\sqrt{2}"),
    ("\\{2,1\\}", "\\{1,2\\}"),
    ("0.333333", "\\frac13"),  # 6-decimal rounding, as math-verify's float_rounding=6
    ("- 3", "-3"),
    ("\\begin{pmatrix} 1 \\\\ 2 \\end{pmatrix}", "\\begin{pmatrix}1\\\\2\\end{pmatrix}"),
    ("1", "\\sin^2 x + \\cos^2 x"),
    ("\\boxed{7}", "7"),
    ("e^{x^{2}}", "e^{x^2}"),  # a symbolic tower is not mistaken for a numeric one
]

NOT_EQUIVALENT = [
    ("3", "2"),
    ("0.333", "\\frac13"),
    ("3.14159", "\\pi"),
    ("x+2", "x+1"),
    ("x^3", "x^2"),
    ("(0,1]", "[0,1)"),
    ("(2,1)", "(1,2)"),
    ("90^\\circ", "\\frac{\\pi}{2}"),
    ("", "5"),
    ("5", ""),
    ("\\boxed{}", "0"),
    ("-1", "1"),
]


@pytest.mark.parametrize(("pred", "gold"), EQUIVALENT, ids=[f"{p}={g}" for p, g in EQUIVALENT])
def test_equivalent_pairs(pred, gold):
    assert is_equivalent(pred, gold)


@pytest.mark.parametrize(("pred", "gold"), NOT_EQUIVALENT, ids=[f"{p}!={g}" for p, g in NOT_EQUIVALENT])
def test_not_equivalent_pairs(pred, gold):
    assert not is_equivalent(pred, gold)


# ----------------------------------------------------------------------------------------------
# Reward functions
# ----------------------------------------------------------------------------------------------


def scores(fmt, ans, reward):
    return {"format_reward": fmt, "answer_reward": ans, "reward": reward}


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        (wrap("\\frac{1}{2}"), "0.5", scores(1.0, 1.0, 1.0)),
        (wrap("The answer is \\boxed{(x+1)^2}"), "x^2+2x+1", scores(1.0, 1.0, 1.0)),
        (wrap("4"), "5", scores(1.0, 0.0, 0.0)),
        ("The answer is <answer> 5 </answer>", "5", scores(0.0, 0.0, 0.0)),  # no "</think> <answer>"
        ("reasoning </think> <answer> 5", "5", scores(0.0, 0.0, 0.0)),  # never closed
        ("r </think>\n<answer> 5 </answer>", "5", scores(0.0, 0.0, 0.0)),  # the tag pair is literal
        (
            "r </think> <answer> 4 </answer> wait, no: <answer> 5 </answer>",
            "5",
            scores(1.0, 1.0, 1.0),
        ),  # the LAST answer pair counts
        (wrap("\\boxed{3} \\boxed{1,000}"), "1000", scores(1.0, 1.0, 1.0)),
        (wrap("5"), "\\boxed{5}", scores(1.0, 1.0, 1.0)),  # a boxed ground truth
        ("", "5", scores(0.0, 0.0, 0.0)),
    ],
    ids=[
        "frac",
        "boxed-symbolic",
        "wrong",
        "no-think",
        "unclosed",
        "newline",
        "last-pair",
        "last-box",
        "boxed-truth",
        "empty",
    ],
)
def test_r1_zero_reward_fn(response, truth, expected):
    assert r1_zero_reward_fn(response, truth) == expected


@pytest.mark.parametrize(
    ("response", "truth", "expected"),
    [
        (wrap("72"), "72", scores(1.0, 1.0, 1.0)),
        (wrap("It is 1,000 dollars"), "1000", scores(1.0, 1.0, 1.0)),
        (wrap("18.00"), "18", scores(1.0, 1.0, 1.0)),
        (wrap("-3"), "-3", scores(1.0, 1.0, 1.0)),
        ("16 - 3 - 4 = 9 eggs, times $2 is $18", "18", scores(0.0, 1.0, 1.0)),  # no tags: last number
        (wrap("19") + " later 18", "18", scores(1.0, 0.0, 0.0)),  # the answer tag wins
        (wrap("no number"), "18", scores(1.0, 0.0, 0.0)),
        ("nothing", "18", scores(0.0, 0.0, 0.0)),
    ],
    ids=["plain", "commas", "decimal", "negative", "fallback", "tag-wins", "tag-no-number", "nothing"],
)
def test_gsm8k_reward_fn(response, truth, expected):
    assert gsm8k_reward_fn(response, truth) == expected


@pytest.mark.parametrize("fn", [r1_zero_reward_fn, gsm8k_reward_fn], ids=["r1_zero", "gsm8k"])
@pytest.mark.parametrize("garbage", [None, 17, "\x00\xff", "<answer></answer>" * 1000, "</think> <answer>"])
def test_rewards_never_raise_on_garbage(fn, garbage):
    out = fn(garbage, garbage)
    assert set(out) == {"format_reward", "answer_reward", "reward"}
    assert all(isinstance(v, float) and v in (0.0, 1.0) for v in out.values())


# ----------------------------------------------------------------------------------------------
# Pathological inputs: a time bound, on the main thread and off it
# ----------------------------------------------------------------------------------------------

PATHOLOGICAL = {
    "tower": "9^9^9^9",
    "tower-braced": "9^{9^{9^{9}}}",
    "tower-spaced": "9 ^ { 9 ^ 9 }",
    "huge-exponent": "9^{99999999}",
    "pow-of-pow": "10^{10^{10}}",
    "factorial-of-power": "(10^{10})!",
    "factorial-of-factorial": "((10!)!)!",
    "big-factorial": "100000!",
    "big-power": "99^{99999}",
    "binomial": "\\binom{10^{5}}{5\\cdot 10^{4}}",
    "100k-sum": "1+" * 50_000 + "1",
    "100k-digits": "9" * 100_000,
    "100k-spaces": " " * 100_000,
    "deep-braces": "{" * 5000 + "1" + "}" * 5000,
    "deep-fracs": "\\frac{" * 300 + "1" + "}{2}" * 300,
    "unbalanced": "\\frac{1}{2" + "\\left(" * 100,
    "unclosed-boxes": "\\boxed{" * 30_000,
    "units-spam": "1" * 50_000 + "\\text{ cm}" * 1000,
}


def grade_all(results: dict):
    for name, answer in PATHOLOGICAL.items():
        for response, truth in ((wrap(answer), "3"), (wrap("3"), answer)):
            start = time.perf_counter()
            out = r1_zero_reward_fn(response, truth)
            results[name] = (max(results.get(name, (0.0,))[0], time.perf_counter() - start), out["reward"])


def check_times(results: dict):
    assert set(results) == set(PATHOLOGICAL)
    for name, (seconds, reward) in results.items():
        assert reward == 0.0, name
        assert seconds < HANG_S, f"{name}: {seconds:.2f} s"


def test_pathological_inputs_return_zero_without_hanging():
    results = {}
    grade_all(results)
    check_times(results)


def test_pathological_inputs_off_the_main_thread():
    results = {}
    worker = threading.Thread(target=grade_all, args=(results,))
    worker.start()
    worker.join(timeout=10 * HANG_S)
    assert not worker.is_alive()
    check_times(results)


def test_symbolic_grading_off_the_main_thread_and_concurrently():
    # math-verify's own timeouts use signal.alarm and fail off the main thread; ours do not.
    pairs = [*EQUIVALENT[:8], *NOT_EQUIVALENT[:4]]
    expected = [True] * 8 + [False] * 4
    outcomes: dict[int, list[bool]] = {}

    def grade(k):
        outcomes[k] = [is_equivalent(p, g) for p, g in pairs]

    threads = [threading.Thread(target=grade, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=60)
    assert outcomes == {k: expected for k in range(4)}


def test_hard_timeout_kills_a_stuck_worker_and_recovers():
    # A 20,000-term sum takes math-verify ≈3 s to parse (2-core machine); with the soft limit
    # off, only the hard limit can stop it: the call returns False at ≈0.3 s, the worker is
    # replaced, and the next call is graded normally. A fresh worker's first comparison (sympy
    # warming up) may itself take > 0.3 s on a loaded machine, so those two run with a 30 s limit.
    grader = MathGrader(timeout_s=30.0, soft_timeout_s=60.0)
    try:
        assert grader.equivalent("x^2+2x+1", "(x+1)^2")
        first_pid = grader._proc.pid
        grader.timeout_s = 0.3
        start = time.perf_counter()
        assert not grader.equivalent("3", "+".join(["x"] * 20_000))
        assert time.perf_counter() - start >= 0.3  # it waited its limit, then
        assert grader._proc.pid != first_pid  # killed the worker: the hard limit, not the answer
        grader.timeout_s = 30.0
        assert grader.equivalent("x^2+2x+1", "(x+1)^2")
    finally:
        grader.close()


def test_soft_timeout_keeps_the_worker():
    grader = MathGrader(timeout_s=30.0, soft_timeout_s=0.2)
    try:
        assert grader.equivalent("1", "1.0")
        pid = grader._proc.pid
        start = time.perf_counter()
        assert not grader.equivalent("3", "+".join(["x"] * 20_000))
        # the time is the behaviour: the parse takes ≈3 s unloaded (8 s at load 6.5, measured
        # 2026-12), the soft limit stops it at 0.2 s; 2 s of slack for a loaded machine
        assert time.perf_counter() - start < 0.2 + 2.0
        assert grader._proc.pid == pid
    finally:
        grader.close()


# ----------------------------------------------------------------------------------------------
# Registry
# ----------------------------------------------------------------------------------------------


def test_registry_has_the_builtins():
    assert get_reward_fn("r1_zero") is r1_zero_reward_fn
    assert get_reward_fn("gsm8k") is gsm8k_reward_fn


def test_unknown_reward_names_the_registered_ones():
    with pytest.raises(ConfigError, match=r"'r1zero'.*gsm8k, r1_zero"):
        get_reward_fn("r1zero")


def test_register_a_custom_reward(monkeypatch):
    monkeypatch.setattr(rewards, "REWARD_FNS", dict(REWARD_FNS))

    @register_reward("exact")
    def exact(response, ground_truth):
        return {"reward": float(response.strip() == ground_truth)}

    assert get_reward_fn("exact")(" 4 ", "4") == {"reward": 1.0}
    register_reward("exact")(exact)  # the same function again is fine
    with pytest.raises(ValueError, match="'exact'"):
        register_reward("exact")(lambda r, g: {"reward": 0.0})


# ----------------------------------------------------------------------------------------------
# Several rewards with weights
# ----------------------------------------------------------------------------------------------


def _exact(response, ground_truth):
    ok = float(response == ground_truth)
    return {"format_reward": 1.0, "answer_reward": ok, "reward": ok}


def _short(response, ground_truth):
    if response == "boom":
        raise RuntimeError("no")
    return {"reward": 1.0 / len(response), "format_reward": 0.0}


def test_weighted_reward_sums_the_parts_and_reports_each():
    from grpo_fast.task.rewards import GuardedReward, WeightedReward

    both = WeightedReward([GuardedReward(_exact, "exact"), GuardedReward(_short, "short")], [2.0, -0.5])
    # "42" == "42": 2·1 − 0.5·(1/2) = 1.75; format_reward is exact's (the first part returning it)
    assert both("42", "42") == {
        "reward": 1.75,
        "reward/exact": 1.0,
        "reward/short": 0.5,
        "format_reward": 1.0,
        "answer_reward": 1.0,
    }
    assert both("4", "42")["reward"] == -0.5  # 2·0 − 0.5·1
    assert both.names == ["exact", "short"] and both.name == "2·exact + -0.5·short"
    with pytest.raises(ValueError, match="2 reward parts need as many weights, got 1"):
        WeightedReward(both.parts, [1.0])


def test_weighted_reward_guards_each_part():
    from grpo_fast.errors import RewardError
    from grpo_fast.task.rewards import GuardedReward, WeightedReward

    tolerant = WeightedReward(
        [GuardedReward(_exact, "exact", "zero"), GuardedReward(_short, "short", "zero")]
    )
    batch = tolerant.for_batch(step=2)
    batch("ab", "ab")
    out = batch("boom", "boom")  # short raises: its part scores 0, exact's 1 stands
    assert out["reward"] == 1.0 and out["reward/short"] == 0.0 and out["reward/exact"] == 1.0
    assert batch.errors == 1 and batch.errors_by_part == {"exact": 0, "short": 1}
    assert [s["reward"] for s in batch.scores] == [1.5, 1.0]  # every score of the batch, in order
    strict = WeightedReward([GuardedReward(_exact, "exact"), GuardedReward(_short, "my.mod:short")])
    with pytest.raises(
        RewardError, match=r"^reward function 'my.mod:short' raised RuntimeError: no on response 0 of step 5"
    ):
        strict.for_batch(step=5)("boom", "x")


def test_task_builds_the_weighted_reward_from_the_config(tmp_path, monkeypatch):
    from grpo_fast.config import load_config
    from grpo_fast.task.loader import load_task

    (tmp_path / "bonus_rewards.py").write_text(
        "def short(response, ground_truth):\n    return {'reward': float(len(response) <= 2)}\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    cfg = load_config(
        "tiny", overrides=["data.reward=[auto,bonus_rewards:short]", "data.reward_weights=[1,0.25]"]
    )
    task = load_task(cfg)
    assert task.reward_parts == ["tiny", "short"]
    # "82" is right (tiny: 1) and short (1): 1 + 0.25
    assert task.reward_fn("82", "82") == {
        "reward": 1.25,
        "reward/tiny": 1.0,
        "reward/short": 1.0,
        "format_reward": 1.0,
        "answer_reward": 1.0,
    }
    assert load_task(load_config("tiny")).reward_parts == []  # one reward: no parts
    with pytest.raises(ConfigError, match=r"^data\.reward: unknown reward 'nope': registered rewards are"):
        load_task(load_config("tiny", overrides=["data.reward=[auto,nope]"]))
    with pytest.raises(ConfigError, match=r"data\.reward=\['auto', 'tiny'\] names the reward 'tiny' twice"):
        load_task(load_config("tiny", overrides=["data.reward=[auto,tiny]"]))
