"""Health monitor on synthetic metric streams: each check's boundary, cooldown, the temperature
boost, and resume through state_dict."""

import json
import math

import pytest

from grpo_fast.errors import ConfigError
from grpo_fast.obs.health import HealthMonitor, HealthThresholds, repeated_ngram_ratio

LOOP = "the answer is 5 " * 20  # 80 words, 4 distinct 4-grams out of 77
PROSE = "First add the two numbers, then divide the sum by three to get the mean of the values."


def kinds(events):
    return [(e.kind, e.severity) for e in events]


def feed(monitor, key, values, start=0):
    """Update with one metric per step; returns the events of the last step."""
    events = []
    for i, v in enumerate(values):
        events = monitor.update(start + i, {key: v}, [])
    return events


# ----------------------------------------------------------------------------------------------
# repeated_ngram_ratio
# ----------------------------------------------------------------------------------------------


def test_repeated_ngram_ratio_hand_values():
    assert repeated_ngram_ratio("a b a b a b", n=2) == pytest.approx(1 - 2 / 5)  # ab ba ab ba ab
    assert repeated_ngram_ratio("x " * 10, n=4) == pytest.approx(1 - 1 / 7)  # 7 four-grams, 1 distinct
    assert repeated_ngram_ratio(LOOP, n=4) == pytest.approx(1 - 4 / 77)
    assert repeated_ngram_ratio(PROSE, n=4) == 0.0
    assert repeated_ngram_ratio("too short", n=4) == 0.0
    assert repeated_ngram_ratio("", n=4) == 0.0


# ----------------------------------------------------------------------------------------------
# Checks
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("entropy", "expected"),
    [
        (0.5, [("entropy_low", "warning")]),  # < 1.0: collapse risk
        (1.2, [("entropy_low", "info")]),  # below the 1.5–3.0 band
        (1.5, []),
        (2.2, []),
        (3.0, []),
        (3.5, [("entropy_high", "info")]),
        (4.5, [("entropy_high", "warning")]),  # > 4.0: over-exploration
        (math.nan, []),  # unmeasured
    ],
)
def test_entropy_bands(entropy, expected):
    events = HealthMonitor().update(0, {"train/entropy_mean": entropy}, [])
    assert kinds(events) == expected
    for e in events:
        assert e.value == entropy and e.suggestion


def test_entropy_warning_suggests_temperature_or_entropy_bonus():
    (event,) = HealthMonitor().update(3, {"train/entropy_mean": 0.4}, [])
    assert "rollout.temperature" in event.suggestion and "loss.entropy_coef" in event.suggestion
    assert event.step == 3 and "collapse" in event.message


def test_grad_norm_spike_against_the_running_median():
    # history 1,1,1,2,1 → median 1; 10.5 > 10 × 1 → spike; 9.9 is not.
    mon = HealthMonitor()
    assert feed(mon, "train/grad_norm", [1.0, 1.0, 1.0, 2.0, 1.0, 9.9]) == []
    events = mon.update(6, {"train/grad_norm": 10.5}, [])
    assert kinds(events) == [("grad_norm_spike", "warning")]
    assert events[0].value == 10.5 and "train.lr" in events[0].suggestion


def test_no_spike_before_min_history():
    assert feed(HealthMonitor(), "train/grad_norm", [1.0, 1.0, 1.0, 1.0, 500.0]) == []


def test_nonfinite_grad_norm_is_critical_and_stays_out_of_the_median():
    mon = HealthMonitor()
    feed(mon, "train/grad_norm", [1.0] * 5)
    assert kinds(mon.update(5, {"train/grad_norm": math.inf}, [])) == [("grad_norm_nonfinite", "critical")]
    assert kinds(mon.update(6, {"train/grad_norm": math.nan}, [])) == [("grad_norm_nonfinite", "critical")]
    assert mon.state_dict()["grad_norms"] == [1.0] * 5


@pytest.mark.parametrize(
    ("length", "expected"),
    [
        (90.0, [("length_collapse", "warning")]),  # (90 − 200) / 200 = −55%
        (100.0, [("length_collapse", "warning")]),  # exactly −50%
        (101.0, []),
        (299.0, []),
        (300.0, [("length_explosion", "warning")]),  # exactly +50%
    ],
)
def test_response_length_against_the_running_mean(length, expected):
    mon = HealthMonitor()
    feed(mon, "train/response_length_mean", [180.0, 220.0, 200.0, 190.0, 210.0])  # mean 200
    assert kinds(mon.update(5, {"train/response_length_mean": length}, [])) == expected


def test_repetition_share_of_looping_responses():
    # 2 of 10 loop: 20% > 10% → warning; 1 of 10 is exactly 10%, not above.
    mon = HealthMonitor()
    (event,) = mon.update(0, {}, [LOOP] * 2 + [PROSE] * 8)
    assert (event.kind, event.value) == ("repetition", pytest.approx(0.2))
    assert HealthMonitor().update(0, {}, [LOOP] + [PROSE] * 9) == []


@pytest.mark.parametrize(("share", "fires"), [(0.8, True), (0.75, False), (0.1, False)])
def test_zero_variance_groups(share, fires):
    events = HealthMonitor().update(0, {"train/zero_variance_fraction": share}, [])
    assert kinds(events) == ([("zero_variance", "warning")] if fires else [])


def test_zero_variance_is_quiet_without_a_group_baseline():
    """REINFORCE++ (``loss.advantage=reinforce_pp``) whitens over the batch: a group of equal rewards
    still has a signal, and with ``rollout.group_size=1`` every group is one (tests/test_sweep.py)."""
    assert HealthMonitor(group_baseline=False).update(0, {"train/zero_variance_fraction": 1.0}, []) == []


def test_missing_keys_and_no_responses_are_quiet():
    assert HealthMonitor().update(0, {"train/loss": 1.0}, []) == []


def test_several_findings_in_one_step():
    mon = HealthMonitor()
    events = mon.update(0, {"train/entropy_mean": 0.2, "train/zero_variance_fraction": 0.9}, [LOOP] * 5)
    assert [e.kind for e in events] == ["entropy_low", "repetition", "zero_variance"]


# ----------------------------------------------------------------------------------------------
# Cooldown, temperature boost, thresholds, resume
# ----------------------------------------------------------------------------------------------


def test_cooldown_repeats_a_persisting_condition_every_n_steps_and_escalates_at_once():
    mon = HealthMonitor(HealthThresholds(cooldown_steps=10))
    reported = [s for s in range(25) if mon.update(s, {"train/entropy_mean": 1.2}, [])]
    assert reported == [0, 10, 20]
    # info → warning is reported at once, inside the cooldown
    assert kinds(mon.update(21, {"train/entropy_mean": 0.5}, [])) == [("entropy_low", "warning")]
    assert mon.update(22, {"train/entropy_mean": 0.5}, []) == []


def test_temperature_boost_is_off_by_default():
    mon = HealthMonitor()
    mon.update(5, {}, [LOOP] * 5)
    assert mon.temperature_boost(5) == 0.0


def test_temperature_boost_decays_linearly_after_a_repetition_event():
    # amount 0.2 over 10 steps from the detection at step 5: 0.2 · (1 − (step − 5) / 10)
    mon = HealthMonitor(HealthThresholds(auto_temperature_boost=True))
    mon.update(5, {}, [LOOP] * 5)
    assert mon.temperature_boost(4) == 0.0
    assert mon.temperature_boost(5) == pytest.approx(0.2)
    assert mon.temperature_boost(10) == pytest.approx(0.1)
    assert mon.temperature_boost(14) == pytest.approx(0.02)
    assert mon.temperature_boost(15) == 0.0
    mon.update(12, {}, [LOOP] * 5)  # a new detection re-arms it, even inside the cooldown
    assert mon.temperature_boost(12) == pytest.approx(0.2)


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"entropy_warn_low": 2.0}, "entropy_warn_low <= entropy_healthy_low"),
        ({"grad_norm_window": 0}, "grad_norm_window must be >= 1"),
    ],
)
def test_bad_thresholds(kwargs, match):
    with pytest.raises(ConfigError, match=match):
        HealthThresholds(**kwargs)


def test_state_dict_round_trip_keeps_the_running_median_and_cooldowns():
    t = HealthThresholds(auto_temperature_boost=True)
    a = HealthMonitor(t)
    feed(a, "train/grad_norm", [1.0, 2.0, 1.0, 1.0, 1.0])
    a.update(5, {"train/entropy_mean": 1.2}, [LOOP] * 3)
    state = json.loads(json.dumps(a.state_dict()))  # JSON-safe, as a checkpoint would store it

    b = HealthMonitor(t)
    b.load_state_dict(state)
    # the median survived: 15 > 10 × 1 is a spike for b exactly as for a
    assert kinds(b.update(6, {"train/grad_norm": 15.0}, [])) == kinds(
        a.update(6, {"train/grad_norm": 15.0}, [])
    )
    assert kinds(b.update(6, {}, [])) == []
    # cooldown survived: entropy_low was reported at step 5, not again at 7
    assert b.update(7, {"train/entropy_mean": 1.2}, []) == []
    assert b.temperature_boost(6) == a.temperature_boost(6) == pytest.approx(0.18)


def test_event_to_dict_is_a_health_jsonl_line():
    (event,) = HealthMonitor().update(2, {"train/entropy_mean": 0.5}, [])
    line = json.loads(json.dumps(event.to_dict()))
    assert set(line) == {"step", "kind", "severity", "message", "suggestion", "value"}
    assert line["step"] == 2 and line["kind"] == "entropy_low"
