"""Several gloo ranks on this machine for the multi-rank tests: start them (``start_ranks``, the
tests' ``mp.spawn``), join a group as one rank (what a rank calls first), or run
``grpo_fast.train.main(argv)`` on ranks as torchrun would start them (``main_on_ranks``)."""

from __future__ import annotations

import contextlib

import torch

# What the ranks' server imports once (multiprocessing's forkserver: one per pytest process, for
# the session): a pair of ranks then starts as two forks of a process that holds torch and the
# package, not two interpreters importing them (the 148 tests of the 10 files that start ranks:
# 364 -> 201 s on 2 workers, 11.1 -> 6.3 worker-min). The hf workers' preload comes with it (a
# process that starts both has one server).
RANK_PRELOAD = ["grpo_fast.train", "grpo_fast.rollout.hf._forkserver"]


def _started(rank: int, fn, env: dict[str, str], *args) -> None:
    """A rank forked from the server: the starting process's environment as it was at the start
    (the server's own is its first start's: a test's ``monkeypatch.setenv`` must reach the ranks,
    as it did when each was a spawn), then ``fn(rank, *args)``."""
    import os

    os.environ.clear()
    os.environ.update(env)
    fn(rank, *args)


def start_ranks(fn, args: tuple = (), nprocs: int = 2, join: bool = True):
    """``torch.multiprocessing.spawn(fn, args, nprocs, join)`` with the ranks forked from the
    preloaded server (``RANK_PRELOAD``) instead of spawned: ``fn(rank, *args)`` on each; with
    ``join=False`` the ``ProcessContext`` to join. A rank that raises fails the join, as with spawn."""
    import os

    import torch.multiprocessing as mp

    mp.get_context("forkserver").set_forkserver_preload(RANK_PRELOAD)
    return mp.start_processes(
        _started, args=(fn, dict(os.environ), *args), nprocs=nprocs, join=join, start_method="forkserver"
    )


def join_cpu_ranks(rank: int, world_size: int, port: int, sequence_parallel: int = 1):
    """Join a ``world_size``-rank gloo group on this machine as ``rank`` (the environment torchrun
    would set, one OpenMP thread per rank); returns ``grpo_fast.dist.init``'s ``DistInfo`` (its mesh
    with sp groups of ``sequence_parallel`` ranks). What the multi-rank tests' spawned workers call
    first."""
    import os

    from grpo_fast import dist

    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    info = dist.init("cpu", sequence_parallel)
    assert info.world_size == world_size
    return info


def _main_on_rank(
    rank: int, world_size: int, port: int, args: list[str], out: str, setup: str | None
) -> None:
    """One rank of ``main_on_ranks``: ``setup(rank)`` (``"module:function"``, imported here), then
    ``grpo_fast.train.main(args)``; its exit code and the last line it wrote to stderr go to
    ``out/rank_{rank}.json``."""
    import contextlib
    import importlib
    import io
    import json
    from pathlib import Path

    from grpo_fast import dist
    from grpo_fast.train import main

    if setup is not None:
        module, _, name = setup.partition(":")
        getattr(importlib.import_module(module), name)(rank)
    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False  # the group is this worker's: main() leaves it
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        code = main(args)
    lines = [ln for ln in err.getvalue().splitlines() if ln.strip()]
    Path(out, f"rank_{rank}.json").write_text(json.dumps({"code": code, "last": lines[-1] if lines else ""}))
    torch.distributed.destroy_process_group()


def main_on_ranks(args: list[str], out, world_size: int = 2, limit: float = 120.0, setup: str | None = None):
    """``grpo_fast.train.main(args)`` on ``world_size`` gloo ranks (``start_ranks``, as torchrun
    would start them); each rank's ``{"code", "last"}`` (exit code, last stderr line), in rank
    order. ``setup``: ``"module:function"`` each rank calls with its rank first (a test's
    monkeypatching). Raises ``TimeoutError`` (after killing them) when the ranks are not done
    within ``limit`` seconds: a rank left waiting in a collective."""
    import json
    import os
    import signal
    import socket
    import time
    from pathlib import Path

    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    ctx = start_ranks(
        _main_on_rank, args=(world_size, port, list(args), str(out), setup), nprocs=world_size, join=False
    )
    deadline = time.monotonic() + limit
    while not ctx.join(timeout=1.0):
        if time.monotonic() > deadline:
            for proc in ctx.processes:
                with contextlib.suppress(ProcessLookupError):
                    os.kill(proc.pid, signal.SIGKILL)
            raise TimeoutError(
                f"the {world_size} ranks were not done within {limit:g} s (a rank waits in a collective)"
            )
    return [json.loads((out / f"rank_{r}.json").read_text()) for r in range(world_size)]
