"""tools/suite_profile.py, the suite's profile by kind of test: skipped tests left out, each test
counted once in the first kind whose rule matches, the slowest listed from the first file, and a
missing or broken file one line with exit 2."""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("suite_profile", ROOT / "tools" / "suite_profile.py")
suite_profile = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(suite_profile)


def _junit(path: Path, cases: list[tuple[str, str, float, bool]]) -> Path:
    rows = "".join(
        f'<testcase classname="tests.{m}" name="{n}" time="{t}">'
        + ("<skipped/>" if skip else "")
        + "</testcase>"
        for m, n, t, skip in cases
    )
    path.write_text(
        f'<?xml version="1.0"?><testsuites><testsuite name="pytest">{rows}</testsuite></testsuites>'
    )
    return path


CASES = [
    ("test_train", "test_tiny_preset_learns[hf]", 120.0, False),  # learning run (before "resume")
    ("test_train", "test_sigkill_then_resume_gives_the_same_metrics[hf]@tiny_straight", 30.0, False),
    ("test_fsdp", "test_fsdp_step_equals_ddp", 12.0, False),
    ("test_token_logprobs", "test_matches_float64_reference[fp32]", 0.5, False),
    ("test_config", "test_unknown_key", 0.25, False),
    ("test_batch", "test_packing", 0.25, False),
    ("test_vllm_engine", "test_real_engine", 99.0, True),  # skipped: not counted
]


def test_kinds_sum_each_test_once_and_skipped_ones_not_at_all(tmp_path):
    times = suite_profile.read(_junit(tmp_path / "a.xml", CASES))
    assert len(times) == 6 and "test_vllm_engine::test_real_engine" not in times
    kinds = suite_profile.by_kind(times)
    learning, kill, _, ranks, kernels, cli, _, other = (kinds[k] for k, _ in suite_profile.KINDS)
    assert (learning, kill, ranks, kernels, cli, other) == (
        (1, 120.0),
        (1, 30.0),
        (1, 12.0),
        (1, 0.5),
        (1, 0.25),
        (1, 0.25),
    )
    assert sum(n for n, _ in kinds.values()) == 6


def test_two_profiles_side_by_side_and_bad_files_are_one_line(tmp_path, capsys):
    before = _junit(tmp_path / "before.xml", CASES)
    after = _junit(tmp_path / "after.xml", [("test_train", "test_tiny_preset_learns[hf]", 60.0, False)])
    assert suite_profile.main([str(before), str(after), "--slowest", "2"]) == 0
    rows = [re.split(r"\s{2,}", ln) for ln in capsys.readouterr().out.splitlines() if ln.strip()]
    assert ["all", "6, 2.7, 100%", "1, 1.0, 100%"] in rows  # 162.5 s; 60 s
    assert [r for r in rows if r[0].startswith("test_")] == [
        ["test_train::test_tiny_preset_learns[hf]", "120.0", "60.0"],
        ["test_train::test_sigkill_then_resume_gives_the_same_metrics[hf]@tiny_straight", "30.0", "-"],
    ]
    (tmp_path / "bad.xml").write_text("<not xml")
    assert suite_profile.main([str(tmp_path / "bad.xml")]) == 2
    assert suite_profile.main([str(tmp_path / "missing.xml")]) == 2
    err = capsys.readouterr().err.splitlines()
    assert (
        err[0].startswith("error: not a JUnit XML file")
        and err[1].startswith("error: ")
        and "missing.xml" in err[1]
    )
