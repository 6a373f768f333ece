"""What must agree across data-parallel ranks and what must differ, on 2 CPU ranks (gloo): the
health monitor's temperature boost agrees, the hf sampling streams differ."""

import os
import socket

import torch
import torch.multiprocessing as mp

from grpo_fast import dist
from grpo_fast.health import HealthMonitor, HealthThresholds

LOOP = "the answer is 5 " * 20  # a repetition loop: arms the boost
PROSE = "First add the two numbers, then divide the sum by three to get the mean of the values."


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _join(rank: int, world_size: int, port: int) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        RANK=str(rank),
        WORLD_SIZE=str(world_size),
        LOCAL_RANK=str(rank),
        OMP_NUM_THREADS="1",
    )
    torch.set_num_threads(1)
    assert dist.init("cpu").world_size == world_size


def _boost_worker(rank, world_size, port, looping_rank, out_path):
    _join(rank, world_size, port)
    mon = HealthMonitor(HealthThresholds(auto_temperature_boost=True))
    responses = [LOOP] * 4 if rank == looping_rank else [PROSE] * 4  # each rank sees its own share
    mon.update(5, {}, responses)
    rows = [(mon.temperature_boost(step), mon.shared_temperature_boost(step)) for step in (5, 6, 10, 15)]
    gathered = dist.all_gather_objects(rows)
    if rank == 0:
        torch.save(gathered, out_path)
    dist.shutdown()


def _boosts(tmp_path, looping_rank):
    out = tmp_path / f"boost_{looping_rank}.pt"
    mp.spawn(_boost_worker, args=(2, _free_port(), looping_rank, str(out)), nprocs=2, join=True)
    return torch.load(out)  # [rank][step] -> (local boost, shared boost)


def test_temperature_boost_agrees_across_ranks(tmp_path):
    # rank 1 alone sees loops: its local boost differs from rank 0's (the bug: two temperatures
    # in one step); the shared boost is rank 0's (none) on both ranks
    by_rank = _boosts(tmp_path, looping_rank=1)
    local = [[lb for lb, _ in rows] for rows in by_rank]
    shared = [[sb for _, sb in rows] for rows in by_rank]
    assert local[0] == [0.0] * 4 and local[1][0] > 0
    assert shared[0] == shared[1] == local[0]
    # rank 0 sees loops: both ranks raise the temperature by 0.2 at step 5, decaying linearly
    # over temperature_boost_steps = 10 (0.2·(1 − 1/10) = 0.18 at step 6, 0.1 at 10, 0 at 15)
    by_rank = _boosts(tmp_path, looping_rank=0)
    shared = [[sb for _, sb in rows] for rows in by_rank]
    assert shared[0] == shared[1]
    assert [round(b, 6) for b in shared[0]] == [0.2, 0.18, 0.1, 0.0]
