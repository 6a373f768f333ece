"""Where the test suite's time goes: by kind of test, and the slowest tests, from pytest's JUnit XML.

    python -m pytest -n 2 --dist loadgroup --no-loadscope-reorder --junitxml=before.xml
    python tools/suite_profile.py before.xml                 # one profile
    python tools/suite_profile.py before.xml after.xml       # side by side
    python tools/suite_profile.py before.xml --slowest 25 --markdown

A test's time is JUnit's: setup + call + teardown, so a module- or session-scoped fixture counts
in the first test that asks for it (the two-rank spawn of a module's fixture, the tiny preset's
run of ``tiny_preset_run``). The sum over tests is the workers' busy time: on 2 workers the
suite's wall time is about half of it. The kinds are read from the test's file and name (first
rule that matches, ``KINDS``); a test that does two things counts as the first.
"""

from __future__ import annotations

import argparse
import re
import sys
import xml.etree.ElementTree as ET
from pathlib import Path

# (kind, pattern on "file::name") — first match wins
KINDS: tuple[tuple[str, str], ...] = (
    ("learning runs (a preset's whole run, eval gain)", r"learns"),
    ("kill, signal and resume", r"sigkill|sigterm|sigint|killed|resume|signal|ctrl_c|dead_worker"),
    ("combinations (64 two-step runs)", r"^test_combinations::"),
    (
        "several ranks (mp.spawn, torchrun)",
        r"torchrun|two_ranks|_ranks|^test_(distributed|fsdp|fsdp_lora|sequence_parallel|ranks|vllm_ranks)::",
    ),
    (
        "kernels and losses (Triton interpreter, memory)",
        r"^test_(fused_linear_grpo_loss|token_logprobs|grpo_loss|truncated_logprobs|loss_reference|core|"
        r"course|policy_loss_casts|loss_peers|sapo|is_weights_raw)::",
    ),
    (
        "command line, config and run folders",
        r"^test_(cli|faults|user_inputs|dry_run_refuses|config|config_keys|run_folder|threads|stops|plan|"
        r"first_minutes|doctor|docs|report|bench_report|profile_tool)::",
    ),
    (
        "sandbox and tools",
        r"^test_(sandbox|sandbox_cli|sandbox_pool|environments|user_env_faults|multi_turn|tool_training)",
    ),
    ("other training runs and units", r""),
)


def read(path: Path) -> dict[str, float]:
    """``{"file::name": seconds}`` of every test that ran (skipped ones left out)."""
    out = {}
    for case in ET.parse(path).getroot().iter("testcase"):
        if case.find("skipped") is not None:
            continue
        module = case.get("classname", "").split(".")[-1]
        out[f"{module}::{case.get('name')}"] = float(case.get("time") or 0.0)
    return out


def kind_of(test: str) -> str:
    for kind, pattern in KINDS:
        if re.search(pattern, test):
            return kind
    raise AssertionError("the last kind matches everything")


def by_kind(times: dict[str, float]) -> dict[str, tuple[int, float]]:
    out = {kind: (0, 0.0) for kind, _ in KINDS}
    for test, t in times.items():
        n, s = out[kind_of(test)]
        out[kind_of(test)] = (n + 1, s + t)
    return out


def report(profiles: list[tuple[str, dict[str, float]]], slowest: int, markdown: bool) -> str:
    names = [name for name, _ in profiles]
    kinds = [by_kind(times) for _, times in profiles]
    totals = [sum(times.values()) for _, times in profiles]
    lines = []
    head = ["kind", *(f"{n}: tests, min, share" for n in names)]
    rows = [
        [
            kind,
            *(
                f"{k[kind][0]}, {k[kind][1] / 60:.1f}, {k[kind][1] / max(tot, 1e-9):.0%}"
                for k, tot in zip(kinds, totals)
            ),
        ]
        for kind, _ in KINDS
    ]
    rows.append(
        ["all", *(f"{len(times)}, {tot / 60:.1f}, 100%" for (_, times), tot in zip(profiles, totals))]
    )
    lines += _table(head, rows, markdown)
    lines.append("")
    first = profiles[0][1]
    order = sorted(first, key=first.get, reverse=True)[:slowest]
    head = ["test", *(f"{n} (s)" for n in names)]
    rows = [[t, *(f"{times[t]:.1f}" if t in times else "-" for _, times in profiles)] for t in order]
    lines += _table(head, rows, markdown)
    return "\n".join(lines)


def _table(head: list[str], rows: list[list[str]], markdown: bool) -> list[str]:
    if markdown:
        return [
            "| " + " | ".join(head) + " |",
            "|" + "---|" * len(head),
            *(
                "| " + " | ".join(f"`{c}`" if i == 0 and "::" in c else c for i, c in enumerate(r)) + " |"
                for r in rows
            ),
        ]
    widths = [max(len(str(r[i])) for r in [head, *rows]) for i in range(len(head))]
    return ["  ".join(str(c).ljust(w) for c, w in zip(r, widths)).rstrip() for r in [head, *rows]]


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("xml", nargs="+", type=Path, help="pytest --junitxml files (the first sets the order)")
    ap.add_argument("--slowest", type=int, default=25, help="how many of the slowest tests to list")
    ap.add_argument("--markdown", action="store_true", help="Markdown tables (for docs/development.md)")
    args = ap.parse_args(argv)
    for path in args.xml:
        if not path.is_file():
            print(f"error: {path}: no such file (pytest --junitxml=... writes it)", file=sys.stderr)
            return 2
    try:
        profiles = [(path.stem, read(path)) for path in args.xml]
    except ET.ParseError as e:
        print(f"error: not a JUnit XML file: {e}", file=sys.stderr)
        return 2
    print(report(profiles, args.slowest, args.markdown))
    return 0


if __name__ == "__main__":
    sys.exit(main())
