"""GRPO training: ``python -m grpo_fast.train --preset NAME [--config F.yaml ...] [key=value ...]``
(``--nproc-per-node N``: N ranks on this machine, started as ``torchrun --standalone`` does).

The variant: GRPO (Shao et al. 2024) as used for R1-Zero-style reasoning RL, on-policy by
default, with the choices our users reach for as config keys:

- advantages: reward minus the group mean, divided by the group std (``loss.scale_rewards=group``),
  the whole batch's std (``batch``) or nothing (``none``, Dr. GRPO); zero-variance groups get
  zero advantage;
- loss (``LossOptions``, ``grpo_fast.algo.loss_options``): the clipped surrogate with
  ``clip_low``/``clip_high`` (DAPO's clip-higher) and an optional dual clip or ratio cap
  ``loss.delta``; GSPO's sequence-level ratio; CISPO (``loss.type=cispo``: the clipped,
  detached importance weight × advantage × log π); or REINFORCE with/without baseline;
- length normalization as per-token loss weights: ``sequence_mean`` (GRPO), ``constant``
  (Dr. GRPO), ``token_mean`` (DAPO);
- optional KL penalty to the initial policy (k1/k2/k3, fixed or adaptive β, in the loss or in
  the reward), entropy bonus, several epochs per rollout batch with KL early stop.

Where it deviates from the paper: the KL term is off by default (β = 0, as in DAPO and
Dr. GRPO); with one epoch per rollout batch (the default) the importance ratio is 1, so π_old
is never computed — the loss is the on-policy policy gradient and its clipping never triggers.
With ``rollout.backend=vllm`` the samples come from vLLM's copy of the weights; their small
log-prob gap to the trainer is logged (``rollout/logprob_abs_diff``) and corrected only with
``rollout.is_correction=true`` (truncated importance sampling, ``grpo_fast.algo.sampler_correction``).

Each step reads top to bottom (the phases live in ``grpo_fast.loop``):

    rollout_phase       the producer: prompts → generate → rewards            loop/producer.py
                        (no collective, nothing of the trainer); then the
                        finalize: pass rates, dynamic sampling, shaping,      loop/rollout_phase.py
                        KL in the reward, advantages
    optimization_phase  trajectories → microbatches → fused lm_head + loss →  loop/optimization.py
                        backward → clip → step → LR step
    sync_weights        the trainer's weights to the rollout side (vllm:      loop/state.py
                        push + weight-sync probe)
    close_step          one all-reduce of the step's sums; the adaptive β and  loop/stats.py, loop/state.py
                        entropy coefficient; the step and non-finite-step counters;
                        the metrics row
    end_of_step         health, eval, samples, log; stops; checkpoint         loop/step_end.py

That is the lockstep outline (``lockstep``, the default). With ``rollout.max_staleness > 0`` (or
the hf decoder in a process of its own, ``rollout.placement=process``) generation runs apart from
training (``pipeline.train``, loop/pipeline.py): a producer generates and scores step k + S's
batch while the trainer trains step k on a batch sampled S optimizer steps earlier, corrected
against the sampler's log-probs; the same phases, with a queue between them.

Around it: one run per ``output_dir`` (a lock held for the run's life; a used folder needs
``resume=true`` or ``overwrite=true``; a resume keeps the run-defining keys:
``grpo_fast.obs.run_folder``), and SIGTERM/SIGINT, which stop each phase at the end of its
current unit with what can be resumed written (``grpo_fast.loop.preempt``). A rollout engine
apart from the trainer that died or timed out (``EngineError``) stops the run with one line and
the checkpoint of the last finished step (``grpo_fast.loop.checkpointing``).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

import torch

from grpo_fast import dist, threads
from grpo_fast.config import PRESETS, Config, load_config, presets_and_keys_help
from grpo_fast.config_checks import pipelined
from grpo_fast.errors import ConfigError, Preempted, cli_errors, cwd_on_path, exit_process
from grpo_fast.loop import pipeline, preempt, step
from grpo_fast.loop.setup import setup
from grpo_fast.loop.state import Run
from grpo_fast.loop.step_end import finish
from grpo_fast.obs import eta, run_folder
from grpo_fast.obs.metrics import PhaseProgress
from grpo_fast.policy import parallel
from grpo_fast.policy.model import quiet_transformers, resolve_device


def parse_args(argv: list[str] | None, prog: str = "python -m grpo_fast.train") -> argparse.Namespace:
    """Options and ``key=value`` overrides in any order (``--config`` may follow overrides)."""
    p = argparse.ArgumentParser(
        prog=prog,
        description="GRPO training. Overrides are OmegaConf dot-list pairs, e.g. train.lr=3e-6 steps=50.",
        epilog=presets_and_keys_help(),
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    p.add_argument("--preset", default="tiny", help=f"{' | '.join(PRESETS)} (default: tiny; listed below)")
    p.add_argument("--config", action="append", default=[], metavar="FILE.yaml", help="layered in order")
    p.add_argument(
        "--dry-run",
        action="store_true",
        help="print the resolved config (with each value's source), the memory plan and the data; load no model",
    )
    p.add_argument(
        "--nproc-per-node",
        type=int,
        default=None,
        metavar="N",
        help="start N ranks on this machine, as torchrun --standalone --nproc-per-node N does (a bad "
        "input is then one line, with no launcher traceback after it)",
    )
    p.add_argument("overrides", nargs="*", metavar="key=value")
    return p.parse_intermixed_args(argv)


@cli_errors
def main(argv: list[str] | None = None, prog: str = "python -m grpo_fast.train") -> int:
    args = parse_args(argv, prog)
    if args.nproc_per_node is not None:
        if os.environ.get("WORLD_SIZE"):  # a torchrun worker already
            raise ConfigError(
                "--nproc-per-node starts the ranks itself: give it without torchrun, or torchrun alone"
            )
        if args.nproc_per_node < 1:
            raise ConfigError(f"--nproc-per-node={args.nproc_per_node}: give 1 rank or more")
        if not args.dry_run:
            return launch(args.nproc_per_node, _without_nproc(list(sys.argv[1:] if argv is None else argv)))
    if args.dry_run:
        from grpo_fast.tools.dry_run import dry_run

        with _as_rank_zero_of(args.nproc_per_node):  # the checks the ranks' world decides, as rank 0
            return dry_run(args.preset, args.config, args.overrides)
    cfg = load_config(args.preset, args.config, args.overrides)
    restart = threads.wait_policy_restart(cfg.threads.wait_policy)
    if restart is not None and threads.started_by_command:  # libgomp read its wait when torch loaded
        os.execve(restart[0][0], *restart)  # this command again, OMP_WAIT_POLICY set (once)
    run(cfg)
    return 0


def launch(nproc: int, argv: list[str]) -> int:
    """``nproc`` ranks of ``python -m grpo_fast.train argv`` on this machine, started by torch's
    elastic launcher in this process as ``torchrun --standalone --nproc-per-node nproc`` starts them
    (the same environment: ``WORLD_SIZE``, ``RANK``, ``LOCAL_RANK``, ``OMP_NUM_THREADS=1`` unless
    set). Returns the first failed rank's exit code (0 when all finished): a rank that stopped on
    a bad input has printed its one line already (local rank 0 prints it, ``errors.cli_errors``);
    torchrun would add its ``ChildFailedError`` traceback and failure table, which this leaves
    out. A rank that died without a line (a signal, a crash) gets one line naming it."""
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.run import get_args_parser
    from torch.distributed.run import run as torchrun

    launcher = get_args_parser().parse_args(
        ["--standalone", f"--nproc-per-node={nproc}", "--module", "grpo_fast.train", *argv]
    )
    # quiet: the elastic agent's per-rank failure lines (the ranks say what failed) and torchrun's
    # OMP_NUM_THREADS banner (each rank's plan line says its threads)
    quiet = [logging.getLogger(name) for name in ("torch.distributed.elastic", "torch.distributed.run")]
    levels = [q.level for q in quiet]
    for q in quiet:
        q.setLevel(logging.CRITICAL)
    try:
        torchrun(launcher)
    except ChildFailedError as exc:
        rank, failure = exc.get_first_failure()
        code = failure.exitcode
        if code < 0:  # killed by a signal: nothing of ours printed
            sig = signal.Signals(-code).name if -code in signal.valid_signals() else f"signal {-code}"
            print(f"error: rank {rank} was killed by {sig}; the other ranks were stopped", file=sys.stderr)
            return 128 - code
        if code not in (2, 130) and code <= 128:  # not a UserError's, a Ctrl-C's or a signal stop's
            print(f"error: rank {rank} exited with code {code} (its output above says why)", file=sys.stderr)
        return code
    finally:
        for q, level in zip(quiet, levels):
            q.setLevel(level)
    return 0


def _without_nproc(argv: list[str]) -> list[str]:
    """``argv`` less ``--nproc-per-node N`` / ``--nproc-per-node=N`` (the ranks get the rest)."""
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc-per-node":
            skip = True
        elif not a.startswith("--nproc-per-node="):
            out.append(a)
    return out


@contextlib.contextmanager
def _as_rank_zero_of(nproc: int | None):
    """While inside: torchrun's environment for rank 0 of ``nproc`` on one node (the dry run's
    checks of the ranks' world), or nothing for None."""
    if nproc is None:
        yield
        return
    env = {"WORLD_SIZE": str(nproc), "RANK": "0", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": str(nproc)}
    with dist.environ_set(env):
        yield


def run(cfg: Config, engine=None) -> Path:
    """Train with ``cfg``; returns the output directory. ``engine``: a rollout engine to use
    instead of building one (tests pass a fake vLLM engine here)."""
    out = Path(cfg.output_dir)
    if (problem := threads.wait_policy_problem(cfg.threads.wait_policy)) is not None:
        raise ConfigError(problem)
    sp = parallel.group_size(cfg)  # ranks that split each sequence (torchrun's world must divide)
    check_output_dir(out)  # on every rank, before anything loads: a bad path fails in a second
    quiet_transformers()
    device = resolve_device(cfg)
    world = dist.init(device.type, sp)  # the mesh: dp × sp
    threads_before = torch.get_num_threads()  # setup sets the run's (threads.intra_op)
    try:
        # the folder's lock, for the run's life; SIGTERM/SIGINT: each phase stops at its unit's end
        with run_folder.claim(out, cfg, world), preempt.handle_signals(out, not world.enabled):
            return _train(cfg, device, world, out, engine)
    finally:
        threads.follower = None  # the run's (loop.setup): it follows the machine no longer
        torch.set_num_threads(threads_before)  # a library caller's process keeps its own
        dist.shutdown()


def check_output_dir(out: Path) -> None:
    """Create ``out`` (and its parents) and write a probe file in it; ``ConfigError`` naming
    ``output_dir`` when either fails (a path under a file, no permission, a read-only mount)."""
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"output_dir={str(out)!r} cannot be created: {exc.strerror or exc}") from None
    try:
        with tempfile.NamedTemporaryFile(dir=out, prefix=".write_probe_"):
            pass
    except OSError as exc:
        raise ConfigError(f"output_dir={str(out)!r} is not writable: {exc.strerror or exc}") from None


def _train(cfg: Config, device: torch.device, world: dist.DistInfo, out: Path, engine) -> Path:
    """Setup, then the steps (``lockstep``, or the pipeline when generation runs apart from
    training: ``rollout.max_staleness > 0``, ``rollout.placement=process``); then the final model,
    and what the run timed into this machine's history for the next plan line
    (``grpo_fast.obs.eta``; a run stopped by a signal too)."""
    t_start, asked, run, first = time.perf_counter(), cfg, None, 0
    try:
        run = setup(cfg, device, world, out, engine)
        cfg, first = run.cfg, run.trainer.state.step  # with the planner's "auto" values resolved
        with PhaseProgress(
            cfg.logging.progress and world.is_main, cfg.steps, run.trainer.state.step
        ) as progress:
            if pipelined(cfg):  # a producer apart, a queue between: grpo_fast.loop.pipeline
                pipeline.train(run, progress)
            else:
                lockstep(run, progress)
    except Preempted:  # a signal: what the run timed until then still counts
        eta.record_run(asked, device, world, out, first, run.sft_steps if run is not None else None)
        raise
    finish(run, t_start, first)
    eta.record_run(asked, device, world, out, first, run.sft_steps)  # as asked: as the plan line saw it
    return out


def lockstep(run: Run, progress: PhaseProgress) -> None:
    """The lockstep outline: ``grpo_fast.loop.step.train`` with generation when each step asks
    for it and the new weights loaded into the backend at once (``step.Lockstep``)."""
    step.train(run, step.Lockstep(run), progress)


def entry() -> None:
    """The console script (``pyproject.toml``): ``main``'s exit code, at once after a signal; the
    working directory on the import path, as ``python -m`` has it (``errors.cwd_on_path``)."""
    cwd_on_path()
    exit_process(main())


if __name__ == "__main__":
    entry()
