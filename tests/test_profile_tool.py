"""tools/profile.py on the tiny model (CPU): both paths profiled, traces, tables and the summary
written; clear one-line errors for a device the preset cannot use."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def test_profiles_fused_and_eager_on_the_tiny_model(tmp_path):
    out = tmp_path / "profile"
    # One torch thread: on a shared 2-core machine two OpenMP threads can spin 10x slower; this test
    # checks the tool works, not its speed (≈ 10 s).
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [
            sys.executable,
            str(ROOT / "tools" / "profile.py"),
            "--preset",
            "tiny",
            "--device",
            "cpu",
            "--steps",
            "1",
            "--out",
            str(out),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]

    summary = json.loads((out / "summary.json").read_text())
    assert summary["command"].startswith("python tools/profile.py --preset tiny")
    rows = {r["path"]: r for r in summary["rows"]}
    assert (rows["fused"]["backend"], rows["eager"]["backend"]) == ("torch_chunked", "eager")
    for name, row in rows.items():
        assert row["step_s"] > 0 and row["peak_bytes"] > 0 and row["tokens"] > 0, row
        trace = json.loads((out / f"trace_{name}.json").read_text())
        names = {e.get("name") for e in trace["traceEvents"]}
        assert "optimization_step_0" in names and "aten::mm" in names  # the step and its matmuls
        table = (out / f"ops_{name}.txt").read_text()
        assert "Self CPU" in table and "aten::" in table
        assert row["top_ops"], row

    md = (out / "summary.md").read_text()
    assert "| fused | torch_chunked |" in md and "| eager | eager |" in md
    assert "Eager / fused: time ×" in md
    assert md in proc.stdout


def _load_tool():
    spec = importlib.util.spec_from_file_location("grpo_fast_profile_tool", ROOT / "tools" / "profile.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_refuses_what_the_machine_or_preset_cannot_do(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT))  # `bench` is imported from the repository root
    tool = _load_tool()
    assert tool.main(["--preset", "rtx4090", "--device", "cpu"]) == 2
    assert "needs --device cuda" in capsys.readouterr().err
    assert tool.main(["--steps", "0"]) == 2
    assert "--steps must be >= 1" in capsys.readouterr().err
    assert tool.main(["--memory-cap-gb", "24"]) == 2
    assert "--memory-cap-gb caps CUDA memory" in capsys.readouterr().err
