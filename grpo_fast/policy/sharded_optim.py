"""bitsandbytes' 8-bit AdamW on FSDP2's shards (``train.optimizer=adamw8bit`` with
``train.parallelism=fsdp``).

bitsandbytes steps plain tensors; FSDP2's parameters are ``DTensor`` s, each rank holding rows
of every parameter (``Shard(0)``). ``ShardedAdamW8bit`` is bitsandbytes' own ``AdamW8bit``
(written against bitsandbytes 0.50.2) whose ``param_groups`` hold those DTensors (the LR
schedule, gradient clipping and ``torch.distributed.checkpoint`` see the model's parameters),
while each step hands bitsandbytes' update the rank's local shard and its local gradient
(``to_local()``: views, no copy): the same kernel as one rank's ``AdamW8bit``, on 1/N of the
values. Nothing is communicated in the step; the state is 1/N per rank.

What differs from one rank's 8-bit AdamW on the whole tensor:

- **Blocks.** bitsandbytes quantizes each moment in blocks of 256 consecutive values, each with
  its fp32 absmax. Here the blocks run over the local shard: where a rank's first row does not
  start at a multiple of 256 values of the whole tensor, its blocks are offset from one rank's,
  and the stored moments differ by at most the 8-bit code's rounding in each (the update itself
  reads the unquantized moments, so a first step is the same as one rank's).
- **Which parameters get 8-bit state** is decided by the whole parameter's size (bitsandbytes'
  ``min_8bit_size``, 4,096 values), as one rank decides, not by the shard's.

Checkpoints (``state_dict``): both moments are DTensors shaped and sharded like their parameter
(DCP reshards them); the block absmaxes of a rank are one row of an ``[N, blocks of rank 0]``
DTensor (zero-padded), which only N ranks can load: ``quantized_over`` (N) is recorded with a
checkpoint, and a resume on another number of ranks is refused before anything is read.
"""

from __future__ import annotations

import contextlib
import math

import bitsandbytes as bnb
import torch
from torch.distributed.tensor import DTensor, Shard

BLOCK = 256  # bitsandbytes' blockwise optimizer blocks (optimizer.py: init_state, 0.50.2)
_QUANT = bnb.optim.optimizer.Optimizer8bit._FSDP_WRAPPED_QUANT_STATE_KEY  # its state_dict's nesting


class ShardedAdamW8bit(bnb.optim.AdamW8bit):
    """``bnb.optim.AdamW8bit(params, lr=..., betas=..., weight_decay=...)`` over FSDP2 DTensor
    parameters (plain tensors are stepped as bitsandbytes does). Every rank builds it over its
    sharded parameters, in the same order.

    Example: ``ShardedAdamW8bit([p for p in model.parameters() if p.requires_grad], lr=1e-5)``
    after ``fully_shard(model)``; a ``[1536, 1536]`` weight on 2 ranks: each rank's two moments
    are ``[768, 1536]`` uint8 (1.18 MB) with 4,608 fp32 absmaxes each (18 KB).
    """

    def get_config(self, gindex: int, pindex: int, group: dict) -> dict:
        """bitsandbytes' config, with its 8-bit-or-32-bit choice made by the whole parameter's
        size: ``init_state`` compares the local shard's size to ``min_8bit_size``."""
        config = super().get_config(gindex, pindex, group)
        whole = self.param_groups[gindex]["params"][pindex].numel()
        config["min_8bit_size"] = 0 if whole >= config["min_8bit_size"] else math.inf
        return config

    @contextlib.contextmanager
    def _local(self, p: torch.Tensor):
        """``p``'s local shard with the local shard of its gradient as ``.grad``, and ``p``'s
        state reachable under it, for bitsandbytes' per-parameter methods; ``p`` itself when
        it is a plain tensor."""
        if not isinstance(p, DTensor):
            yield p
            return
        local = p.to_local()  # under no_grad: the DTensor's local tensor itself (a view of the shard)
        local.grad = None if p.grad is None else p.grad.to_local()
        self.state[local] = self.state[p]  # the same dict: what bitsandbytes writes lands in p's state
        try:
            yield local
        finally:
            del self.state[local]
            local.grad = None

    @torch.no_grad()
    def init_state(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        with self._local(p) as local:
            super().init_state(group, local, gindex, pindex)

    @torch.no_grad()
    def update_step(self, group: dict, p: torch.Tensor, gindex: int, pindex: int) -> None:
        with self._local(p) as local:
            if local.numel() == 0:  # a rank holding no rows of a parameter smaller than the mesh
                self.state[local]["step"] += 1
                return
            super().update_step(group, local, gindex, pindex)

    def state_dict(self) -> dict:
        """bitsandbytes' state dict, each DTensor parameter's state as DTensors on its mesh:
        ``state1`` / ``state2`` like the parameter, ``absmax1`` / ``absmax2`` as this rank's row of
        ``[N, blocks]`` (``_blocks_dtensor``). A collective-free view: nothing is copied but the
        absmax rows."""
        sd = super().state_dict()
        params = [p for group in self.param_groups for p in group["params"]]
        for index, state in sd["state"].items():
            p = params[index]
            quant = state.get(_QUANT)
            if not isinstance(p, DTensor) or quant is None:
                continue
            for key in ("state1", "state2"):
                quant[key] = DTensor.from_local(
                    quant[key], p.device_mesh, p.placements, shape=p.shape, stride=p.stride()
                )
            for key in ("absmax1", "absmax2"):
                if key in quant:
                    quant[key] = _blocks_dtensor(quant[key], p)
        return sd

    def load_state_dict(self, state_dict: dict, move_to_device: bool = True) -> None:
        """``state_dict`` (``state_dict``'s layout, as DCP loads it) back into local tensors. Its
        states are keyed as its ``param_groups`` list them (indices, or the FQNs
        ``set_optimizer_state_dict`` passes), in the order of this optimizer's parameters."""
        saved = [key for group in state_dict["param_groups"] for key in group["params"]]
        params = dict(zip(saved, (p for group in self.param_groups for p in group["params"])))
        state_dict = {**state_dict, "state": dict(state_dict["state"])}
        for name, state in list(state_dict["state"].items()):
            quant = state.get(_QUANT) if isinstance(state, dict) else None
            if quant is None or not isinstance(params.get(name), DTensor):
                continue
            local = params[name].to_local()
            quant = {k: _as_local(v) for k, v in quant.items()}
            for key in ("absmax1", "absmax2"):
                if key in quant:
                    quant[key] = quant[key][0, : _n_blocks(local.numel())].clone()
            state_dict["state"][name] = {**state, _QUANT: quant}
        super().load_state_dict(state_dict, move_to_device=move_to_device)


def _n_blocks(numel: int) -> int:
    return -(-numel // BLOCK)


def _as_local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def _blocks_dtensor(absmax: torch.Tensor, p: DTensor) -> DTensor:
    """This rank's block absmaxes ``[blocks]`` as its row of an ``[N, blocks of rank 0]`` DTensor
    (``Shard(0)`` on ``p``'s mesh; a rank with fewer rows pads with zeros). Rank 0 holds the most
    rows under FSDP2's ``Shard(0)`` (``torch.chunk``: ceil(rows / N) each, the last ones fewer)."""
    if p.device_mesh.ndim != 1 or tuple(p.placements) != (Shard(0),):
        raise ValueError(f"8-bit AdamW on shards needs Shard(0) on a 1-D mesh, got {p.placements}")
    n = p.device_mesh.size()
    rows = p.shape[0]
    per_row = p.numel() // rows if rows else 0
    most = _n_blocks(-(-rows // n) * per_row)
    row = torch.zeros(1, most, dtype=absmax.dtype, device=absmax.device)
    row[0, : absmax.numel()] = absmax
    return DTensor.from_local(row, p.device_mesh, [Shard(0)], shape=(n, most), stride=(most, 1))


def quantized_over(optimizer: torch.optim.Optimizer) -> int | None:
    """The number of ranks whose shards ``optimizer``'s 8-bit state is quantized over (its block
    layout; 1 for bitsandbytes' own 8-bit optimizers on whole tensors), or None for an optimizer
    without blockwise state (torch's AdamW): a checkpoint of it loads on that many ranks only."""
    if isinstance(optimizer, ShardedAdamW8bit):
        params = [p for group in optimizer.param_groups for p in group["params"]]
        meshes = {p.device_mesh.size() for p in params if isinstance(p, DTensor)}
        return meshes.pop() if meshes else 1
    if isinstance(optimizer, bnb.optim.optimizer.Optimizer8bit) and optimizer.args.optim_bits == 8:
        return 1
    return None
