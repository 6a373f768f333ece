"""The tiny preset alone and beside another training process: wall time by thread setting.

    python bench/contention.py                        # this tree, 3 rounds, the table at the end
    python bench/contention.py --tree /tmp/main-snap  # another checkout (e.g. ``git archive main``)
    python bench/contention.py --rounds 1 --steps 10 --sft-steps 10   # a quick look

Each run is ``python -m grpo_fast.train --preset tiny steps=S sft.steps=W logging.progress=false``
in a fresh process, its output folder a fresh temporary one. The variants (``--variant``, default
``defaults``, ``1 thread``, ``2 threads``) differ only in the environment each run starts with:
``defaults`` leaves the thread count and OpenMP wait policy to the tree under test, the others
set ``OMP_NUM_THREADS``. ``TREE=PATH`` in a variant runs that checkout instead of ``--tree``:
before and after alternate in one window, e.g. ``--variant "main:TREE=/tmp/main-snap"
--variant "branch:"``. Each variant runs alone and beside a contender, alternating in the same
window (variant × contention in one order per round, the order rotated each round).

The contender is not grpo_fast: a plain PyTorch training loop (``--contender-loop``: a 2-layer
transformer encoder, d_model 256, batch 16 × 64 tokens, AdamW) with PyTorch's own defaults (one
OpenMP thread per core, libgomp's default spin-wait: ``OMP_WAIT_POLICY`` and ``OMP_NUM_THREADS``
removed from its environment), i.e. what another engineer's job on a shared machine runs. It is
started before, and stopped after, each contended run.

Printed: for each run its wall time, the GRPO seconds from the run's ``done:`` line and the
1-minute load average (``os.getloadavg``) when it started; at the end a table of medians and the
contended / alone ratio. The figures mean something only next to the load: on a shared machine,
re-measure idle (load ≈ 0 before the first run) before quoting them.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_VARIANTS = ("defaults:", "1 thread:OMP_NUM_THREADS=1", "2 threads:OMP_NUM_THREADS=2")
THREAD_ENV = ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "GOMP_SPINCOUNT", "MKL_NUM_THREADS")


def contender_loop() -> None:
    """Train a small transformer encoder forever, with PyTorch's thread defaults."""
    import torch

    torch.manual_seed(0)
    layer = torch.nn.TransformerEncoderLayer(256, 4, 1024, batch_first=True)
    model = torch.nn.TransformerEncoder(layer, 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    x = torch.randn(16, 64, 256)
    while True:
        loss = model(x).pow(2).mean()
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)


def parse_variant(text: str) -> tuple[str, dict[str, str]]:
    """``LABEL:KEY=V,KEY=V`` → (label, env); ``LABEL:`` sets nothing."""
    label, _, pairs = text.partition(":")
    env = {}
    for pair in filter(None, pairs.split(",")):
        key, eq, value = pair.partition("=")
        if not eq:
            raise SystemExit(f"error: --variant {text!r}: {pair!r} is not KEY=VALUE")
        env[key] = value
    return label, env


def start_contender() -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    proc = subprocess.Popen([sys.executable, __file__, "--contender-loop"], env=env)
    time.sleep(3.0)  # its import and first steps: the run starts against a contender at work
    return proc


def one_run(tree: Path, env_extra: dict[str, str], args: argparse.Namespace) -> tuple[float, float | None]:
    """(wall seconds, GRPO seconds from the ``done:`` line) of one fresh training process."""
    env = {k: v for k, v in os.environ.items() if k not in THREAD_ENV}
    env_extra = dict(env_extra)
    env.update(env_extra, PYTHONPATH=env_extra.pop("TREE", str(tree)))  # a variant's own checkout
    with tempfile.TemporaryDirectory(prefix="contention-") as out:
        cmd = [sys.executable, "-m", "grpo_fast.train", "--preset", "tiny", f"steps={args.steps}",
               f"sft.steps={args.sft_steps}", "logging.progress=false", f"output_dir={out}/run",
               *args.override]  # fmt: skip
        t0 = time.perf_counter()
        res = subprocess.run(cmd, env=env, capture_output=True, text=True, cwd=out)
        wall = time.perf_counter() - t0
    if res.returncode != 0:
        raise SystemExit(f"error: {' '.join(cmd)} exited {res.returncode}:\n{res.stderr[-2000:]}")
    done = re.search(r"done: \d+ steps in ([0-9.]+)s", res.stdout + res.stderr)
    plan = re.search(r"plan: .*", res.stdout + res.stderr)
    if args.verbose and plan:
        print(f"    {plan.group(0)}", flush=True)
    if args.verbose:  # the thread count following the machine (threads.intra_op=auto): its changes
        for change in re.findall(r".*CPU threads \(other work.*", res.stdout + res.stderr):
            print(f"    {change.strip()}", flush=True)
    return wall, float(done.group(1)) if done else None


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tree", type=Path, default=ROOT, help="the checkout whose grpo_fast runs (PYTHONPATH)")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--sft-steps", type=int, default=20)
    p.add_argument("--variant", action="append", help="LABEL:KEY=V,... (environment of the run)")
    p.add_argument("--override", action="append", default=[], help="key=value passed to every run")
    p.add_argument("--alone-only", action="store_true", help="skip the contended runs")
    p.add_argument("--verbose", action="store_true", help="print each run's plan line")
    p.add_argument("--contender-loop", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.contender_loop:
        contender_loop()
        return 0
    variants = [parse_variant(v) for v in (args.variant or DEFAULT_VARIANTS)]
    cells = [(label, env, contended) for label, env in variants for contended in (False, True)]
    if args.alone_only:
        cells = [c for c in cells if not c[2]]
    results: dict[tuple[str, bool], list[tuple[float, float | None, float]]] = {}
    print(f"tree {args.tree}, {os.cpu_count()} cores, tiny steps={args.steps} sft.steps={args.sft_steps}")
    for r in range(args.rounds):
        order = cells[r % len(cells) :] + cells[: r % len(cells)]
        for label, env, contended in order:
            contender = start_contender() if contended else None
            try:
                load = os.getloadavg()[0]
                wall, grpo = one_run(args.tree, env, args)
            finally:
                if contender is not None:
                    contender.kill()
                    contender.wait()
            results.setdefault((label, contended), []).append((wall, grpo, load))
            where = "beside a contender" if contended else "alone"
            grpo_s = f"{grpo:.1f}" if grpo is not None else "?"
            print(f"round {r + 1} {label:<12} {where:<18} wall {wall:6.1f} s  GRPO {grpo_s:>6} s  load {load:.2f}",
                  flush=True)  # fmt: skip
    print("\nmedian wall s (GRPO s) [1-min load at the runs' starts]")
    print(f"{'variant':<14}{'alone':>28}{'beside a contender':>28}{'ratio':>8}")
    for label, _ in variants:
        row, med = [], {}
        for contended in (False, True):
            runs = results.get((label, contended))
            if not runs:
                row.append(f"{'-':>28}")
                continue
            med[contended] = statistics.median(w for w, _, _ in runs)
            grpos = [g for _, g, _ in runs if g is not None]
            g = f"({statistics.median(grpos):.1f})" if grpos else ""
            loads = ",".join(f"{ld:.1f}" for _, _, ld in runs)
            row.append(f"{med[contended]:>8.1f} {g:>7} [{loads}]".rjust(28))
        ratio = f"{med[True] / med[False]:.2f}×" if len(med) == 2 else "-"
        print(f"{label:<14}{''.join(row)}{ratio:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
