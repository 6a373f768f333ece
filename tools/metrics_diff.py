"""Compare two runs' ``metrics.jsonl`` step by step, bitwise, leaving out what measures the machine.

    python tools/metrics_diff.py RUN_A RUN_B        # folders (or metrics.jsonl files)

Every key of every step must be present in both and equal as JSON numbers (``==`` on the
parsed floats, so ``-0.0`` and ``0.0`` are equal and NaN equals NaN only when both are NaN),
except the fields that measure the machine rather than the run: ``time/*``, ``memory/*``,
``throughput/*``, ``gpu/*``. Exit 0 and one line when they agree; exit 1 and the first
differences (step, key, both values) when not. The refactors that must not change behaviour
are checked with it: ``grpo-fast train --preset tiny steps=40`` before and after.
"""

from __future__ import annotations

import argparse
import json
import math
import sys
from pathlib import Path

MACHINE_PREFIXES = ("time/", "memory/", "throughput/", "gpu/", "fleet/")


def read_rows(path: Path) -> list[dict]:
    path = path / "metrics.jsonl" if path.is_dir() else path
    with open(path) as fh:
        return [json.loads(line) for line in fh if line.strip()]


def _same(a, b) -> bool:
    if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
        return True
    return a == b


def differences(rows_a: list[dict], rows_b: list[dict]) -> list[str]:
    """One line per difference: a missing step or key, or two values that differ."""
    out = []
    if [r.get("step") for r in rows_a] != [r.get("step") for r in rows_b]:
        out.append(f"steps differ: {[r.get('step') for r in rows_a]} vs {[r.get('step') for r in rows_b]}")
        return out
    for ra, rb in zip(rows_a, rows_b):
        keys = {k for k in (*ra, *rb) if not k.startswith(MACHINE_PREFIXES)}
        for key in sorted(keys):
            if key not in ra or key not in rb:
                out.append(f"step {ra['step']}: {key} only in {'A' if key in ra else 'B'}")
            elif not _same(ra[key], rb[key]):
                out.append(f"step {ra['step']}: {key} {ra[key]!r} != {rb[key]!r}")
    return out


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("a", type=Path)
    p.add_argument("b", type=Path)
    p.add_argument("--show", type=int, default=20, help="how many differences to print")
    args = p.parse_args(argv)
    rows_a, rows_b = read_rows(args.a), read_rows(args.b)
    diffs = differences(rows_a, rows_b)
    if diffs:
        print(f"{len(diffs)} differences between {args.a} and {args.b}:")
        print("\n".join("  " + d for d in diffs[: args.show]))
        return 1
    n_keys = sum(len([k for k in r if not k.startswith(MACHINE_PREFIXES)]) for r in rows_a)
    print(f"identical: {len(rows_a)} rows, {n_keys} values (time/memory/throughput/gpu fields left out)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
