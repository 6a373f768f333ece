"""torch.distributed for data-parallel GRPO: one process per GPU (or CPU rank), launched by torchrun.

Each rank generates for its share of the prompts (whole groups, so group normalization needs no
communication) and trains with DDP; rank 0 logs and writes checkpoints. Outside torchrun every
function here is a no-op for a world of one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


_OWN_GROUP = False  # whether init() created the default process group


def init(device_type: str) -> DistInfo:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on CUDA)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    global _OWN_GROUP
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        _OWN_GROUP = True
    info = DistInfo(
        rank=torch_dist.get_rank(),
        world_size=torch_dist.get_world_size(),
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
    )
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    return info


def shutdown() -> None:
    """Destroy the process group ``init`` created. One created by someone else stays: a
    single-process vLLM engine makes its own world of 1 and tears it down at exit."""
    global _OWN_GROUP
    if _OWN_GROUP and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    _OWN_GROUP = False


def all_reduce_sum(values: list[float], device: torch.device) -> list[float]:
    """Sum a few floats over ranks (one collective; a host-device sync)."""
    if not (torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t)
    return t.tolist()


def all_reduce_max(values: list[float], device: torch.device) -> list[float]:
    """The largest of a few floats over ranks (one collective; a host-device sync)."""
    if not (torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX)
    return t.tolist()


def all_gather_objects(obj):
    """Every rank's ``obj``, in rank order (pickled; for small per-step records only)."""
    if not (torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        return [obj]
    out = [None] * torch_dist.get_world_size()
    torch_dist.all_gather_object(out, obj)
    return out


def broadcast_object(obj, src: int = 0):
    if not (torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if torch_dist.is_initialized() and torch_dist.get_world_size() > 1:
        torch_dist.barrier()
