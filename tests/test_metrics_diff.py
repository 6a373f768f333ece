"""tools/metrics_diff.py, the bitwise run-to-run comparison the refactors are checked with: equal
runs agree, a last-bit change, a missing key or a missing step is reported, and the machine's
fields (time, memory, throughput, gpu) are left out."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("metrics_diff", ROOT / "tools" / "metrics_diff.py")
metrics_diff = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(metrics_diff)

ROWS = [
    {"step": 0, "eval/accuracy": 0.25},
    {"step": 1, "train/loss": -1.2e-8, "train/kl": float("nan"), "time/step_s": 0.1, "memory/peak_gb": 0.6},
]


def _write(folder: Path, rows) -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return folder


def test_equal_runs_agree_whatever_the_machine_fields(tmp_path):
    other = [dict(r) for r in ROWS]
    other[1].update({"time/step_s": 9.9, "memory/peak_gb": 3.0, "throughput/tokens_per_s": 1.0})
    assert metrics_diff.differences(ROWS, other) == []


def test_a_last_bit_a_missing_key_and_a_missing_step_are_reported():
    nudged = [dict(r) for r in ROWS]
    nudged[1]["train/loss"] = -1.2000000000000002e-08  # one ulp away
    assert metrics_diff.differences(ROWS, nudged) == [
        "step 1: train/loss -1.2e-08 != -1.2000000000000002e-08"
    ]
    missing = [dict(r) for r in ROWS]
    del missing[0]["eval/accuracy"]
    assert metrics_diff.differences(ROWS, missing) == ["step 0: eval/accuracy only in A"]
    assert metrics_diff.differences(ROWS, ROWS[:1])[0].startswith("steps differ")


def test_the_command_exits_1_on_a_difference(tmp_path):
    a = _write(tmp_path / "a", ROWS)
    b = _write(tmp_path / "b", [ROWS[0], {**ROWS[1], "train/loss": 0.0}])
    run = lambda x, y: subprocess.run(
        [sys.executable, str(ROOT / "tools" / "metrics_diff.py"), str(x), str(y)],
        capture_output=True,
        text=True,
    )
    same, different = run(a, a), run(a, b)
    assert same.returncode == 0 and "identical: 2 rows" in same.stdout
    assert different.returncode == 1 and "step 1: train/loss" in different.stdout
