"""torch.distributed for GRPO: one process per GPU (or CPU rank), launched by torchrun, arranged
as a mesh of two axes.

- ``dp`` (data parallel): each dp rank generates for its share of the prompts (whole groups, so
  group normalization needs no communication) and trains on it (DDP, or FSDP2 across dp ranks);
- ``sp`` (sequence parallel, ``train.sequence_parallel``; size 1 unless asked for): the ranks of
  one sp group share one batch and each holds a slice of every sequence's tokens in training.

Ranks are laid out sp-major: ranks ``[k·S, (k+1)·S)`` form dp rank k's sp group (S = sp size), so
an sp group sits on neighbouring devices (one node). Every site asks for the axis it means
(``world.dp.rank``, ``dist.all_reduce_sum(..., axis=world.dp)``); ``world.rank`` is the global
rank (rank 0 logs and writes checkpoints). Outside torchrun every function here is a no-op for a
world of one.

Example (4 ranks, ``sequence_parallel=2``): rank 3 is dp rank 1, sp rank 1.
    >>> w = DistInfo(rank=3, world_size=4, sp_size=2)
    >>> (w.dp.rank, w.dp.size, w.sp.rank, w.sp.size)
    (1, 2, 1, 2)
"""

from __future__ import annotations

import contextlib
import os
import threading
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as torch_dist


@dataclass(frozen=True)
class Axis:
    """One axis of the mesh as this rank sees it: its index along the axis, the axis's size, and
    the process group of the ranks that differ from this one only along it (None in a world of
    one, or where no group was made: a ``DistInfo`` built by hand, whose collectives then go to
    every rank when the axis spans them all, ``whole_world``)."""

    rank: int = 0
    size: int = 1
    group: Any = None
    whole_world: bool = True  # the axis spans every rank: without a group of its own, the default one

    @property
    def enabled(self) -> bool:
        return self.size > 1


@dataclass(frozen=True)
class DistInfo:
    """This process's place in the run: global ``rank`` of ``world_size``, ``local_rank`` on its
    node, and the mesh (``dp`` × ``sp``, ``sp_size`` ranks per sequence-parallel group)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    sp_size: int = 1
    groups: dict = field(default_factory=dict, compare=False, repr=False)  # "dp"/"sp" -> process group
    mesh: Any = field(default=None, compare=False, repr=False)  # the DeviceMesh (dp, sp), or None

    def __post_init__(self) -> None:
        if self.sp_size < 1 or self.world_size % self.sp_size:
            raise ValueError(f"sequence-parallel size {self.sp_size} does not divide {self.world_size} ranks")

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        """More than one process (any axis)."""
        return self.world_size > 1

    @property
    def dp(self) -> Axis:
        """The data-parallel axis: this rank's share of the prompts, the gradient average."""
        return Axis(
            self.rank // self.sp_size,
            self.world_size // self.sp_size,
            self.groups.get("dp"),
            self.sp_size == 1,
        )

    @property
    def ranks(self) -> Axis:
        """Every rank as one axis: the rollout side's split. Each rank generates and scores its own
        share of the prompts (under sequence parallelism too: an sp group then trains its ranks'
        shares together, ``grpo_fast.loop.sp_group``), so the rollout's sums, gathers and decisions
        go over every rank; ``dp`` when ``sp_size`` is 1."""
        return Axis(self.rank, self.world_size, None, True)

    @property
    def sp(self) -> Axis:
        """The sequence-parallel axis: the ranks that split one batch's tokens."""
        return Axis(
            self.rank % self.sp_size, self.sp_size, self.groups.get("sp"), self.sp_size == self.world_size
        )


_OWN_GROUP = False  # whether init() created the default process group


def init(device_type: str, sequence_parallel: int = 1) -> DistInfo:
    """Join the process group torchrun describes in the environment (gloo on CPU, nccl on CUDA)
    and build the mesh: ``sequence_parallel`` ranks per sp group (it must divide the world)."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo(sp_size=1)
    global _OWN_GROUP
    if not torch_dist.is_initialized():
        torch_dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
        _OWN_GROUP = True
    rank, world = torch_dist.get_rank(), torch_dist.get_world_size()
    if world % sequence_parallel:
        raise ValueError(f"train.sequence_parallel={sequence_parallel} does not divide the {world} ranks")
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device_type == "cuda":
        torch.cuda.set_device(local_rank)
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh(
        device_type, (world // sequence_parallel, sequence_parallel), mesh_dim_names=("dp", "sp")
    )
    groups = {"dp": mesh.get_group("dp"), "sp": mesh.get_group("sp")}
    return DistInfo(rank, world, local_rank, sequence_parallel, groups, mesh)


def shutdown() -> None:
    """Destroy the process group ``init`` created. One created by someone else stays: a
    single-process vLLM engine makes its own world of 1 and tears it down at exit."""
    global _OWN_GROUP
    if _OWN_GROUP and torch_dist.is_initialized():
        torch_dist.destroy_process_group()
    _OWN_GROUP = False


def _group_of(axis: Axis | None):
    """The process group of ``axis`` (None: the whole world), or False when it has one rank (no
    collective to run). Raises inside ``no_collectives``."""
    forbidden = getattr(_LOCAL, "forbidden", None)
    if forbidden:
        raise RuntimeError(f"a collective inside {forbidden[-1]}, which must run none")
    if not (torch_dist.is_initialized() and torch_dist.get_world_size() > 1):
        return False
    if axis is None:
        return None
    if axis.size <= 1:
        return False
    if axis.group is None and not axis.whole_world:
        raise ValueError(
            f"an axis of {axis.size} of the ranks without a process group (a DistInfo built by hand)"
        )
    return axis.group  # None: the default group, every rank


@contextlib.contextmanager
def environ_set(env: dict[str, str]):
    """While inside: ``os.environ`` with ``env``'s variables set (for what reads them as it starts:
    torchrun's world for the dry run, a vLLM engine core as it spawns); each restored on the way
    out, an exception included (a variable that was unset is removed again)."""
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


_LOCAL = threading.local()  # .forbidden: the names of this thread's enclosing no_collectives blocks


@contextlib.contextmanager
def no_collectives(what: str):
    """Within the block, every collective of this module called from this thread raises
    ``RuntimeError`` naming ``what``: for code that must never wait on another rank (the rollout
    producer; a thread of its own in an asynchronous run)."""
    stack = _LOCAL.__dict__.setdefault("forbidden", [])
    stack.append(what)
    try:
        yield
    finally:
        stack.pop()


def all_reduce_sum(values: list[float], device: torch.device, axis: Axis | None = None) -> list[float]:
    """Sum a few floats over the ranks of ``axis`` (None: every rank); one collective, a
    host-device sync."""
    group = _group_of(axis)
    if group is False:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, group=group)
    return t.tolist()


def all_reduce_max(values: list[float], device: torch.device, axis: Axis | None = None) -> list[float]:
    """The largest of a few floats over the ranks of ``axis`` (None: every rank); one
    collective, a host-device sync."""
    group = _group_of(axis)
    if group is False:
        return list(values)
    t = torch.tensor(values, dtype=torch.float64, device=device)
    torch_dist.all_reduce(t, op=torch_dist.ReduceOp.MAX, group=group)
    return t.tolist()


def all_gather_objects(obj, axis: Axis | None = None):
    """Every rank's ``obj`` along ``axis`` (None: every rank), in rank order (pickled; for small
    per-step records only)."""
    group = _group_of(axis)
    if group is False:
        return [obj]
    out = [None] * torch_dist.get_world_size(group)
    torch_dist.all_gather_object(out, obj, group=group)
    return out


def broadcast_object(obj, src: int = 0):
    """Global rank ``src``'s ``obj`` on every rank."""
    if _group_of(None) is False:
        return obj
    box = [obj]
    torch_dist.broadcast_object_list(box, src=src)
    return box[0]


def barrier() -> None:
    if _group_of(None) is not False:
        torch_dist.barrier()


def unwrap(model: torch.nn.Module) -> torch.nn.Module:
    """The module a DDP wrapper holds (``model`` itself when not wrapped: FSDP2 shards in place and
    keeps the class). The one place that knows DDP's ``.module``."""
    return getattr(model, "module", model)


def whole_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's whole value as a plain tensor (``full_tensor``: a collective over its mesh,
    which every rank runs in the same order), or ``t`` itself. A shard offloaded to CPU RAM (FSDP's
    ``CPUOffloadPolicy``) is copied to the mesh's device for the all-gather first."""
    from torch.distributed.tensor import DTensor

    if not isinstance(t, DTensor):
        return t
    kind = t.device_mesh.device_type
    if t.device.type != kind:
        local = t.to_local().to(kind, non_blocking=True)
        t = DTensor.from_local(local, t.device_mesh, t.placements, shape=t.shape, stride=t.stride())
    return t.full_tensor()
