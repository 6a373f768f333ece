"""LoRA, QLoRA and 8-bit AdamW under FSDP2 (``train.parallelism=fsdp``) on CPU with 2 gloo ranks:
the same first step as DDP (LoRA, QLoRA; 8-bit AdamW to its quantization error), half the
optimizer bytes on each rank, the adapter pushed from shards (vLLM serves what the trainer
computes: adapter, merged, QLoRA's dequantized base), exact resumes of sharded checkpoints, a
LoRA run that learns; the planner's per-rank LoRA and QLoRA terms."""

from __future__ import annotations

import copy
import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from support.ranks import join_cpu_ranks, start_ranks
from test_fsdp import _free_port, _loop_overrides, _metrics_diff, _rank_microbatches
from test_lora import _lora_policy
from test_rollout_vllm import FakeVLLMEngine

from grpo_fast import dist
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.errors import ConfigError
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.optimization import optimize_on_rollout
from grpo_fast.loop.state import Trainer
from grpo_fast.policy import fsdp, sharded_checkpoint
from grpo_fast.policy import lora as lora_mod
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.policy.model import load_policy
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny
from grpo_fast.tools import plan

ROOT = Path(__file__).resolve().parents[1]
LR = 1e-4
LORA = ["model.lora.r=16", "model.lora.alpha=32", f"train.lr={LR}", "model.lora.lr_scale=1"]
# A Qwen2 whose shards start mid-block: 2 ranks hold 40 rows × 80 = 3,200 values of q_proj (12.5
# blocks of 256), 68 × 80 of gate_proj (21.25): 8-bit AdamW's blocks on a shard are not one rank's
ODD = {
    "hidden_size": 80,
    "intermediate_size": 136,
    "num_hidden_layers": 2,
    "layer_types": ["full_attention"] * 2,
}


def _odd_model(tok):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{**tiny.build_model_config(tok).to_diff_dict(), **ODD})
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config)


def _build(kind: str, folder: str):
    """``(cfg, tokenizer, model)`` of a case: ``lora`` (the tiny model with a rank-16 adapter, its
    lora_B random so both matrices train), ``qlora`` (the same on the NF4 base saved in
    ``folder``), ``adamw8bit`` (full fine-tuning of the odd-shaped Qwen2 with 8-bit AdamW),
    ``lora_8bit`` (``lora`` with 8-bit AdamW)."""
    if kind in ("lora", "lora_8bit"):
        more = ["train.optimizer=adamw8bit"] if kind == "lora_8bit" else []
        return _lora_policy(*LORA, *more)
    if kind == "qlora":
        tok = tiny.build_tokenizer()
        cfg = load_config("tiny", overrides=[*LORA, "model.load_in_4bit=true"])
        torch.manual_seed(cfg.seed)
        model = load_policy(cfg, tok, torch.device("cpu"), base_path=folder)
        g = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for name, p in model.named_parameters():
                if "lora_B" in name:
                    p.copy_(0.5 * torch.randn(p.shape, generator=g))
        return cfg, tok, model
    tok = tiny.build_tokenizer()
    return load_config("tiny", overrides=["train.optimizer=adamw8bit", "train.lr=1e-3"]), tok, _odd_model(tok)


def _trained(model) -> dict[str, torch.Tensor]:
    """The trainable parameters, whole (gathered under FSDP: every rank calls it)."""
    return {
        n: fsdp.to_local_value(p.detach()).clone() for n, p in model.named_parameters() if p.requires_grad
    }


def _moments(optimizer, model) -> dict[str, dict[str, torch.Tensor]]:
    """8-bit AdamW's moments as the optimizer holds them, dequantized, and each value's rounding
    bound, whole (each rank's rows gathered in rank order): ``{name: {m, v, m_err, v_err}}``. The
    bound is bitsandbytes' own quantizer's (``_quantizer_buckets``): the farthest a value scaled
    by its block's absmax can be from the code it was given, times the absmax."""
    import bitsandbytes.functional as F

    out = {}
    for name, p in model.named_parameters():
        state = optimizer.state.get(p, {})
        if state.get("state1") is None or state["state1"].dtype != torch.uint8:
            continue
        entry = {}
        for i, key in ((1, "m"), (2, "v")):
            q, absmax, code = state[f"state{i}"], state[f"absmax{i}"], state[f"qmap{i}"]
            low, high = _quantizer_buckets(code)
            reach = torch.maximum(code - low, high - code)  # [256]: how far a value given each code can be
            value = F.dequantize_blockwise(q, absmax=absmax, code=code, blocksize=256)
            blocks = torch.arange(q.numel()) // 256
            err = (reach[q.reshape(-1).long()] * absmax[blocks]).reshape(q.shape)
            entry[key], entry[f"{key}_err"] = value, err
        out[name] = {
            k: torch.cat(dist.all_gather_objects(v)) if isinstance(p, _dtensor()) else v
            for k, v in entry.items()
        }
    return out


def _quantizer_buckets(code: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(low, high)`` ``[256]``: the interval of scaled values (in [-1, 1]) that bitsandbytes'
    ``quantize_blockwise`` on this device gives each code of ``code``, found by asking the quantizer
    itself (a block of 256: the values probed and a 1.0 that makes the absmax 1), bisecting each
    boundary to adjacent floats. Not the nearest code's interval: bitsandbytes' CPU kernel
    (0.50.2) binary-searches the table, and gives 0 < x < 1.5e-5 the unsigned code 7 (1.56e-5).
    A code the quantizer never gives has an empty interval (NaN: a value holding it fails)."""
    quantize = lambda xs: torch.ops.bitsandbytes.quantize_blockwise(
        torch.cat([xs, xs.new_ones(1)]), code, 256
    )[0][:-1]
    t = torch.arange(1, 256)  # boundary t: the least x given a code >= t
    lo, hi = torch.full((255,), -1.0, dtype=torch.float64), torch.ones(255, dtype=torch.float64)
    below = quantize(lo.float()).long() >= t  # already at -1: the edge is -1
    above = quantize(hi.float()).long() < t  # not even at 1: no value reaches it
    for _ in range(60):
        mid = ((lo + hi) / 2).float().double()
        up = quantize(mid.float()).long() >= t
        hi, lo = torch.where(up, mid, hi), torch.where(up, lo, mid)
    edge = torch.where(below, -1.0, torch.where(above, math.inf, hi))
    low = torch.cat([edge.new_tensor([-1.0]), edge])  # code q's interval: [edge q, edge q+1)
    high = torch.cat([edge, edge.new_tensor([1.0])])
    empty = ~(low < high)
    low, high = low.float(), high.clamp(max=1.0).float()
    return low.masked_fill(empty, math.nan), high.masked_fill(empty, math.nan)


def _dtensor():
    from torch.distributed.tensor import DTensor

    return DTensor


def _train(kind: str, mode: str, world, folder: str, steps: int = 3, ckpt_dir: str | None = None) -> dict:
    """``steps`` optimizer steps of case ``kind`` under ``mode`` (ddp | fsdp) on this rank's share
    of a fixed batch (rank 0 in 3 microbatches, rank 1 in 1: FSDP pads it with fillers). Returns
    the global loss of step 1, the trainable weights before and after each step and the gradients
    each step applied (whole), this rank's bytes after step 1, and for 8-bit AdamW its moments
    after step 1.
    ``ckpt_dir``: a sharded checkpoint of step 1 written there."""
    cfg, tok, model = _build(kind, folder)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    if mode == "fsdp":
        fsdp.shard_policy(policy, None, torch.device("cpu"), world.world_size)
    else:
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy = DDP(policy)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, params)
    mbs = _rank_microbatches(cfg, tok, world.rank, world.world_size, micro_batch=3 if world.rank == 0 else 8)
    (missing,) = fsdp.padding_count([len(mbs)], torch.device("cpu"), mode == "fsdp")
    fillers = fsdp.fillers(missing, mbs[0], tok.pad_token_id, torch.device("cpu"))
    trainer = Trainer(policy, optimizer, params, cfg, world)
    lr = cfg.train.lr * (cfg.model.lora.lr_scale if cfg.model.lora.r else 1.0)
    out = {"weights": [_trained(model)], "grads": [], "optimizer": type(optimizer).__name__, "lr": lr}
    out["counts"] = lora_mod.trainable_counts(model)
    real_step = optimizer.step

    def recording_step(*a, **k):
        grads = {
            n: fsdp.to_local_value(p.grad).clone() for n, p in model.named_parameters() if p.grad is not None
        }
        out["grads"].append(grads)  # whole (FSDP: the reduce-scattered shards gathered)
        result = real_step(*a, **k)
        if "bytes" not in out:  # after the first step: its gradients (not freed yet) and the state
            out["bytes"] = fsdp.local_bytes(model, optimizer)
        return result

    optimizer.step = recording_step
    for step in range(steps):
        stats = optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0, fillers=fillers)
        out["weights"].append(_trained(model))
        if step == 0:
            (out["loss"],) = dist.all_reduce_sum([float(stats.sums["loss"])], torch.device("cpu"))
            if cfg.train.optimizer == "adamw8bit":
                out["moments"] = _moments(optimizer, model)
            if ckpt_dir is not None:
                state = {"x": 0} if world.is_main else None
                sharded_checkpoint.save(Path(ckpt_dir), 1, {"model": model}, optimizer, tok, state, keep=1)
    return out


def _resumed(kind: str, world, folder: str, ckpt_dir: str, steps: int) -> list[dict]:
    """Case ``kind`` under FSDP, loaded from the step-1 checkpoint in ``ckpt_dir`` (fresh model and
    optimizer), then ``steps`` more steps on the same batch: the weights after each."""
    cfg, tok, model = _build(kind, folder)
    with torch.no_grad():  # the checkpoint must bring the weights back: start from others
        for p in model.parameters():
            if p.requires_grad:
                p.add_(0.25)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    fsdp.shard_policy(policy, None, torch.device("cpu"), world.world_size)
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = build_optimizer(cfg, params)
    saved = torch.load(Path(ckpt_dir) / "step_000001" / "trainer_state.pt", weights_only=True)
    sharded_checkpoint.load(Path(ckpt_dir) / "step_000001", {"model": model}, optimizer, saved)
    mbs = _rank_microbatches(cfg, tok, world.rank, world.world_size, micro_batch=3 if world.rank == 0 else 8)
    (missing,) = fsdp.padding_count([len(mbs)], torch.device("cpu"), True)
    fillers = fsdp.fillers(missing, mbs[0], tok.pad_token_id, torch.device("cpu"))
    trainer = Trainer(policy, optimizer, params, cfg, world)
    weights = []
    for _ in range(steps):
        optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0, fillers=fillers)
        weights.append(_trained(model))
    return weights


class FakeLoRAEngine(FakeVLLMEngine):
    """The fake engine serving a peft adapter on top of its base, as vLLM's LoRA request does:
    ``load_adapter(folder)`` reads peft's files (``PeftModel.from_pretrained``)."""

    def __init__(self, model, tokenizer):
        super().__init__(model, tokenizer)
        self.model.load_state_dict(model.state_dict())  # it serves its base from the start, as vLLM does
        self.adapter = None
        self.adapter_files: dict[str, torch.Tensor] = {}

    def load_adapter(self, folder: str, version: int | None = None) -> None:
        from peft import PeftModel
        from safetensors.torch import load_file

        self.adapter_files = load_file(Path(folder) / "adapter_model.safetensors")
        self.adapter = PeftModel.from_pretrained(copy.deepcopy(self.model), folder).eval()
        self.calls.append("load_adapter")

    @torch.no_grad()
    def _logprobs(self, seq, n_prompt, temperature):
        served = self.adapter if self.adapter is not None else self.model
        logits = served(input_ids=torch.tensor([seq])).logits[0, n_prompt - 1 : -1].double()
        return torch.log_softmax(logits, -1).gather(-1, torch.tensor(seq[n_prompt:])[:, None])[:, 0].tolist()


def _push(kind: str, lora_sync: str, world, folder: str) -> dict:
    """Case ``kind`` (its lora_B random: the adapter changes the policy) sharded on the ranks,
    pushed to a fake engine serving its base, with the weight-sync probe on (the probe compares the engine's log-probs of a sequence with
    the sharded policy's own: ``WeightSyncError`` on a gap): the calls, the probe's gap, what the
    engine was handed."""
    from grpo_fast.rollout.vllm import VLLMBackend, WeightSyncError, WeightSyncProbe

    cfg, tok, model = _build(kind, folder)
    plain_base = tiny.build_model(tok, seed=cfg.seed)
    engine = FakeLoRAEngine(plain_base, tok)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    fsdp.shard_policy(policy, None, torch.device("cpu"), world.world_size)
    ids = tok("37+45=82")["input_ids"]

    def trainer_logprobs(token_ids):
        seq = loss_trajectories(
            Rollout([token_ids[:1]], [token_ids[1:]]),
            advantages=torch.zeros(1),
            length_norm="sequence_mean",
            max_length=16,
        )
        mb = make_microbatches(seq, 1, tok.pad_token_id, packing=False)[0]
        with torch.no_grad():
            return policy(mb, LossOptions(), 1.0, truncated=False).logprobs

    probe = WeightSyncProbe(ids, trainer_logprobs, tolerance=1e-4)
    backend = VLLMBackend(
        engine, tok, sleep_level=0, probe=probe, lora_sync=lora_sync, push_base=kind == "qlora"
    )
    try:
        backend.update_weights(model, step=1)
    except WeightSyncError as exc:  # the engine serves something else: the test says what
        return {"calls": backend.calls, "gap": backend.weight_sync_abs_diff, "error": str(exc)}
    return {
        "calls": backend.calls,
        "gap": backend.weight_sync_abs_diff,
        "files": engine.adapter_files,
        "adapter": fsdp.gathered_adapter(model),
    }


STEP_CASES = [("lora", "ddp"), ("lora", "fsdp"), ("qlora", "ddp"), ("qlora", "fsdp"), ("adamw8bit", "ddp"),
              ("adamw8bit", "fsdp"), ("lora_8bit", "ddp"), ("lora_8bit", "fsdp")]  # fmt: skip


RESUMED = ("adamw8bit", "lora")  # the cases whose step-1 checkpoint is resumed
PUSHES = (("lora", "adapter"), ("lora", "merged"), ("qlora", "adapter"))


def _step_worker(rank, world_size, port, root, cases=STEP_CASES, resumed=RESUMED, pushes=PUSHES):
    """Every case of ``cases`` trained, the checkpoints of ``resumed`` resumed, ``pushes`` pushed;
    rank 0 saves what they returned to ``root/results.pt``."""
    join_cpu_ranks(rank, world_size, port)
    world = dist.DistInfo(rank=rank, world_size=world_size)
    folder, root = str(Path(root) / "base"), Path(root)
    results = {}
    for kind, mode in cases:
        ckpt_dir = str(root / f"ckpt_{kind}") if mode == "fsdp" and kind in resumed else None
        results[kind, mode] = _train(kind, mode, world, folder, ckpt_dir=ckpt_dir)
    for kind in resumed:
        results[kind, "resumed"] = _resumed(kind, world, folder, str(root / f"ckpt_{kind}"), steps=2)
    results["bytes_by_rank"] = dist.all_gather_objects(
        {key: r["bytes"] for key, r in results.items() if isinstance(r, dict)}
    )
    for kind, sync in pushes:
        results[kind, sync] = _push(kind, sync, world, folder)
    if rank == 0:
        torch.save(results, root / "results.pt")
    dist.shutdown()


@pytest.fixture(scope="module")
def step_results(tmp_path_factory):
    root = tmp_path_factory.mktemp("fsdp_lora")
    tok = tiny.build_tokenizer()
    tiny.build_model(tok, seed=load_config("tiny").seed).save_pretrained(root / "base")
    tok.save_pretrained(root / "base")
    start_ranks(_step_worker, args=(2, _free_port(), str(root)), nprocs=2, join=True)
    return torch.load(root / "results.pt", weights_only=False) | {"root": root}


def _worst(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


def _ulps(t: torch.Tensor) -> torch.Tensor:
    """One fp32 ulp of each value of ``t`` (at least the smallest normal's)."""
    return torch.finfo(torch.float32).eps * t.abs().clamp(min=torch.finfo(torch.float32).tiny)


ROUNDING = 16 * 2.0**-24  # an fp32 Adam update's own rounding, relative: a handful of ops at 2^-24 each


def _first_step_bound(ddp: dict, got: dict) -> dict[str, torch.Tensor]:
    """How far the two runs' weights can be after one Adam step (torch's AdamW and bitsandbytes'
    8-bit one alike: the first step reads the unquantized moments ``m = (1-β₁)g``, ``v = (1-β₂)g²``
    and moves each weight by ``lr·g/(|g| + ε)``): the two updates from each run's own gradient
    (they differ in fp32 summation order), each update's rounding, one fp32 ulp of the weight."""
    lr, eps = ddp["lr"], 1e-8
    update = lambda g: lr * g / (g.abs() + eps)
    out = {}
    for name, g in ddp["grads"][0].items():
        g, g_other = g.double(), got["grads"][0][name].double()
        w = ddp["weights"][1][name].double()
        out[name] = (update(g_other) - update(g)).abs() + 2 * ROUNDING * lr + 2 * _ulps(w)
    return out


def _assert_within(got: dict, ddp: dict, bound: dict, what: str) -> None:
    assert got.keys() == ddp.keys() == bound.keys(), what
    for k in ddp:
        gap = (got[k].double() - ddp[k].double()).abs()
        assert (gap <= bound[k]).all(), (what, k, gap.max().item(), (gap - bound[k]).max().item())


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["lora", "qlora"])
def test_lora_under_fsdp_takes_the_ddp_step(step_results, kind):
    """The same adapter, the same microbatches (rank 1 padded with fillers under FSDP): the loss
    of step 1 to 1e-4 relative, the gradients to fp32 summation order; every adapter weight
    moved by Adam's first step (at most lr, lr where |g| ≫ ε) and FSDP's adapter is DDP's to what
    that step explains (``_first_step_bound``); after three steps still within 1/1000 of lr a
    step. Only the adapter trains (QLoRA: the NF4 base's bytes sharded and gathered, never
    updated)."""
    ddp, got = step_results[kind, "ddp"], step_results[kind, "fsdp"]
    assert got["optimizer"] == ddp["optimizer"] == "AdamW"
    assert got["counts"] == ddp["counts"]  # what the log says trains, of how many (NF4: values, not bytes)
    assert abs(got["loss"] - ddp["loss"]) <= 1e-4 * abs(ddp["loss"])
    start, lr = ddp["weights"][0], ddp["lr"]
    assert start.keys() == got["weights"][0].keys() and all(".lora_" in k for k in start)
    assert _worst(start, got["weights"][0]) == 0.0  # the same start
    assert got["grads"][0].keys() == start.keys()  # nothing else has a gradient
    for k, g in ddp["grads"][0].items():
        torch.testing.assert_close(got["grads"][0][k], g, rtol=1e-5, atol=1e-7 * g.abs().max().item())
    for k in start:
        moved = (ddp["weights"][1][k] - start[k]).abs()
        assert (moved <= lr + 2 * _ulps(start[k])).all() and moved.max() >= 0.99 * lr, (k, moved.max())
    _assert_within(got["weights"][1], ddp["weights"][1], _first_step_bound(ddp, got), "step 1")
    three = {k: 3e-3 * lr + 2 * _ulps(w).double() for k, w in ddp["weights"][3].items()}
    _assert_within(got["weights"][3], ddp["weights"][3], three, "step 3")


def _moment_bounds(ddp: dict, got: dict, betas) -> dict[str, dict[str, torch.Tensor]]:
    """How far the two 8-bit runs' stored moments can be after step 1, per value: each run's
    dequantized moment is within its rounding bound (``_moments``) of ``(1-β₁)g`` (``(1-β₂)g²``)
    of its own gradient, and the gradients differ in fp32 summation order."""
    b1, b2 = betas
    out = {}
    for name, mine in ddp["moments"].items():
        theirs = got["moments"][name]
        g, g_other = ddp["grads"][0][name].double(), got["grads"][0][name].double()
        out[name] = {
            "m": mine["m_err"] + theirs["m_err"] + (1 - b1) * (g_other - g).abs() + 2 * _ulps(mine["m"]),
            "v": mine["v_err"]
            + theirs["v_err"]
            + (1 - b2) * (g_other**2 - g**2).abs()
            + 2 * _ulps(mine["v"]),
        }
    return out


def _second_step_bound(ddp: dict, got: dict, betas, same_state: bool = False) -> dict[str, torch.Tensor]:
    """How far the two 8-bit runs' weights can be after step 2, per value, given the moments each
    stored after step 1 (dequantized: ``_moments``; 32-bit state, below 4,096 values:
    ``(1-β₁)g₁``, ``(1-β₂)g₁²``) and each run's step-2 gradient: where they were after step 1, plus
    the gap between the two runs' second updates ``lr·(m₂/c₁)/(√v₂/c₂ + ε)`` with ``m₂ = β₁m₁ +
    (1-β₁)g₂``, ``v₂ = β₂v₁ + (1-β₂)g₂²`` (``c₁ = 1-β₁²``, ``c₂ = √(1-β₂²)``), each widened by its fp32
    arithmetic: a few ulps of m₂ and v₂ (the update is monotone in each, so at a corner) and of
    the update itself. ``same_state``: FSDP's run as if it had stored DDP's moments (what the
    gap would be without the quantization's difference)."""
    b1, b2 = betas
    lr, eps = ddp["lr"], 1e-8
    c1, c2 = 1 - b1**2, math.sqrt(1 - b2**2)
    update = lambda m, v: lr * (m / c1) / (v.clamp(min=0).sqrt() / c2 + eps)

    def second_update(run: dict, name: str, moments_of: dict) -> tuple[torch.Tensor, torch.Tensor]:
        g1, g2 = run["grads"][0][name].double(), run["grads"][1][name].double()
        if name in moments_of["moments"]:
            m1, v1 = moments_of["moments"][name]["m"].double(), moments_of["moments"][name]["v"].double()
        else:
            m1, v1 = (1 - b1) * g1, (1 - b2) * g1 * g1
        m2, v2 = b1 * m1 + (1 - b1) * g2, b2 * v1 + (1 - b2) * g2 * g2
        dm, dv = 4 * _ulps(m2) + 4 * _ulps(m1), 4 * _ulps(v2) + 4 * _ulps(v1)
        centre = update(m2, v2)
        swing = torch.stack(
            [(update(m2 + a * dm, v2 + b * dv) - centre).abs() for a in (-1, 1) for b in (-1, 1)]
        )
        return centre, swing.amax(0) + ROUNDING * centre.abs()

    out = {}
    for name in ddp["grads"][1]:
        mine, my_slack = second_update(ddp, name, ddp)
        theirs, their_slack = second_update(got, name, ddp if same_state else got)
        w1_gap = (got["weights"][1][name].double() - ddp["weights"][1][name].double()).abs()
        w2 = ddp["weights"][2][name].double()
        out[name] = w1_gap + (theirs - mine).abs() + my_slack + their_slack + 2 * _ulps(w2)
    return out


@pytest.mark.slow
def test_8bit_adamw_under_fsdp_is_ddps_to_its_quantization_error(step_results):
    """bitsandbytes' 8-bit AdamW on each rank's shards (``ShardedAdamW8bit``), on a model whose
    shards start mid-block. Step 1 reads the unquantized moments: DDP's step to what the
    gradients' summation order explains (``_first_step_bound``). The stored moments then differ
    from DDP's by at most the two quantizations' rounding, from bitsandbytes' code and each
    block's absmax (``_moment_bounds``), and some do differ (the blocks are the shards', not one
    rank's); the weights after step 2 are what Adam's second update gives from the moments each
    run stored (``_second_step_bound``), and some are farther apart than they would be had both
    stored the same moments (the gap is the quantization's)."""
    ddp, got = step_results["adamw8bit", "ddp"], step_results["adamw8bit", "fsdp"]
    assert (ddp["optimizer"], got["optimizer"]) == ("AdamW8bit", "ShardedAdamW8bit")
    assert abs(got["loss"] - ddp["loss"]) <= 1e-5 * abs(ddp["loss"])
    _assert_within(got["weights"][1], ddp["weights"][1], _first_step_bound(ddp, got), "step 1")
    betas = load_config("tiny").train.betas
    bounds = _moment_bounds(ddp, got, betas)
    assert bounds.keys() == got["moments"].keys() and len(bounds) == 10  # q, o, gate, up, down × 2 layers
    differ = 0
    for name, mine in ddp["moments"].items():
        for key in ("m", "v"):
            gap = (got["moments"][name][key].double() - mine[key].double()).abs()
            assert (gap <= bounds[name][key]).all(), (name, key, (gap - bounds[name][key]).max().item())
            differ += int((gap > 0).sum())
    assert differ > 0
    _assert_within(got["weights"][2], ddp["weights"][2], _second_step_bound(ddp, got, betas), "step 2")
    same = _second_step_bound(ddp, got, betas, same_state=True)
    assert any(((got["weights"][2][k] - ddp["weights"][2][k]).abs() > same[k]).any() for k in same)


def _expected_8bit_bytes(shapes: list[torch.Size], ranks: int) -> tuple[list[int], int]:
    """8-bit AdamW's bytes (two uint8 moments, one fp32 absmax a block of 256 each; 32-bit
    moments below 4,096 values; the two 256-entry fp32 code tables once) per rank of ``ranks``
    holding ``torch.chunk``'s rows of each shape, and on one rank holding all."""

    def held(numels_8bit, numels_32bit):
        return 2048 + sum(2 * n + 8 * -(-n // 256) for n in numels_8bit) + 8 * sum(numels_32bit)

    per_rank = []
    for r in range(ranks):
        big, small = [], []
        for s in shapes:
            rows = torch.empty(s[0]).chunk(ranks)
            n = (rows[r].numel() if r < len(rows) else 0) * (math.prod(s) // s[0])
            (big if math.prod(s) >= 4096 else small).append(n)
        per_rank.append(held(big, small))
    whole = held(
        [math.prod(s) for s in shapes if math.prod(s) >= 4096],
        [math.prod(s) for s in shapes if math.prod(s) < 4096],
    )
    return per_rank, whole


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw8bit", "lora_8bit"])
def test_8bit_adamw_state_per_rank_is_half_of_ddps(step_results, kind):
    """Measured local state after step 1: each rank holds half of DDP's 8-bit AdamW bytes, plus the
    code tables every rank keeps and a partial block where its shard ends mid-block; to the byte
    what bitsandbytes' layout gives for each rank's rows. Which parameters get 8-bit state is the
    whole parameter's size, as on one rank (the adapter's 256×16 lora_B: 4,096 values, 8-bit,
    though each rank holds 2,048)."""
    by_rank = step_results["bytes_by_rank"]
    ddp = by_rank[0][kind, "ddp"]["optimizer"]
    shapes = [w.shape for w in step_results[kind, "ddp"]["weights"][0].values()]
    per_rank, whole = _expected_8bit_bytes(shapes, 2)
    assert ddp == whole
    assert [by_rank[r][kind, "fsdp"]["optimizer"] for r in (0, 1)] == per_rank
    assert all(abs(b - ddp / 2) <= 2048 + 8 * len(shapes) for b in per_rank), (per_rank, ddp)
    fp32_adam = 8 * sum(math.prod(s) for s in shapes)
    assert ddp < 0.45 * fp32_adam or kind == "lora_8bit"  # the saving itself (the adapter is mostly small)


@pytest.mark.slow
def test_lora_under_fsdp_holds_half_the_adapter_and_its_base(step_results):
    """LoRA under FSDP: each rank holds half of the frozen base and of the adapter (weights,
    gradients, AdamW state), the two halves adding up to DDP's; the planner's per-rank items
    for 2 ranks within 2% of what a rank holds. QLoRA: the NF4 base's packed bytes are sharded
    too, its quantization state is not (each rank keeps the block absmaxes whole), and the
    planner's per-rank items are within 2% of what a rank holds as well."""
    by_rank = step_results["bytes_by_rank"]
    whole = by_rank[0]["lora", "ddp"]
    for item in ("weights", "grads", "optimizer"):
        halves = [by_rank[r]["lora", "fsdp"][item] for r in (0, 1)]
        assert sum(halves) == whole[item], item
        assert all(0.45 * whole[item] <= h <= 0.55 * whole[item] for h in halves), (item, halves)
    arch = plan.Arch.from_hf_config(tiny.build_model_config(tiny.build_tokenizer()))
    for kind, more in (("lora", []), ("qlora", ["model.load_in_4bit=true"])):
        cfg = load_config(
            "tiny", overrides=[*LORA, *more, "train.parallelism=fsdp", "train.mixed_precision=no"]
        )
        planned = plan.plan_memory(cfg, arch, 80 * plan.GB, world_size=2)
        for item in ("weights", "grads", "optimizer"):
            for r in (0, 1):
                held = by_rank[r][kind, "fsdp"][item]
                assert abs(getattr(planned, item) - held) <= 0.02 * held, (
                    kind,
                    item,
                    getattr(planned, item),
                    held,
                )
    # QLoRA: the packed NF4 bytes are halved; their block absmaxes stay whole on each rank
    q_whole = by_rank[0]["qlora", "ddp"]["weights"]
    q_rank = [by_rank[r]["qlora", "fsdp"]["weights"] for r in (0, 1)]
    assert max(q_rank) < 0.6 * q_whole and sum(q_rank) > q_whole


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["adamw8bit", "lora"])
def test_a_sharded_checkpoint_resumes_the_steps_exactly(step_results, kind):
    """A sharded checkpoint written after step 1 (8-bit AdamW's blockwise state on shards; LoRA's
    adapter and its AdamW state, no base), loaded into a fresh model and optimizer whose weights
    were moved: steps 2 and 3 are the straight run's, bitwise. A LoRA checkpoint also holds the
    adapter in peft's format, equal to the shards."""
    from safetensors.torch import load_file

    straight = step_results[kind, "fsdp"]["weights"]
    resumed = step_results[kind, "resumed"]
    for step, weights in zip((2, 3), resumed):
        assert weights.keys() == straight[step].keys()
        assert all(torch.equal(weights[k], straight[step][k]) for k in weights), (kind, step)
    folder = step_results["root"] / f"ckpt_{kind}" / "step_000001"
    if kind == "lora":
        files = load_file(folder / "adapter_model.safetensors")
        shards = {k.replace(".default", ""): v for k, v in straight[1].items()}
        assert files.keys() == shards.keys() and all(torch.equal(files[k], shards[k]) for k in files)
        assert json.loads((folder / "adapter_config.json").read_text())["r"] == 16
    state = torch.load(folder / "trainer_state.pt", weights_only=True)
    assert state["optimizer_quantized_over"] == (2 if kind == "adamw8bit" else None)


@pytest.mark.slow
def test_an_8bit_state_quantized_on_two_ranks_is_refused_on_one(step_results):
    """The 8-bit state's blocks are each rank's: one process loading the 2-rank checkpoint stops
    with one line before reading anything (the model left as it was)."""
    cfg, _tok, model = _build("adamw8bit", "")
    before = {k: v.clone() for k, v in model.state_dict().items()}
    optimizer = build_optimizer(cfg, model.parameters())
    folder = step_results["root"] / "ckpt_adamw8bit" / "step_000001"
    saved = torch.load(folder / "trainer_state.pt", weights_only=True)
    with pytest.raises(ConfigError) as err:
        sharded_checkpoint.load(folder, {"model": model}, optimizer, saved)
    assert str(err.value) == (
        f"resume=true: the 8-bit AdamW state of {folder} is quantized in blocks of each of its 2 "
        "rank(s)' shards; resume on 2 rank(s) (now 1)"
    )
    assert all(torch.equal(before[k], v) for k, v in model.state_dict().items())


@pytest.mark.slow
@pytest.mark.parametrize("kind, sync", [("lora", "adapter"), ("lora", "merged"), ("qlora", "adapter")])
def test_the_push_from_shards_serves_what_the_trainer_computes(step_results, kind, sync):
    """From sharded weights: the adapter gathered and written as a peft folder (``adapter``), the
    adapter merged into gathered base weights (``merged``), QLoRA's NF4 base gathered and pushed
    dequantized once, then its adapter; each time the weight-sync probe held (the engine's
    log-probs of a sequence are the sharded policy's, fp32: mean gap < 1e-5; 1e-4 for NF4) and
    the adapter files are the gathered adapter itself."""
    got = step_results[kind, sync]
    assert got["gap"] < (1e-4 if kind == "qlora" else 1e-5), got  # the probe held
    calls = {"adapter": ["load_adapter"], "merged": ["load_weights"]}[sync]
    if kind == "qlora":
        calls = ["load_weights(base)", *calls]
    assert got["calls"][: len(calls)] == calls and "probe" in got["calls"]
    if sync == "adapter":
        shards = {k.replace(".default", ""): v for k, v in got["adapter"].items()}
        assert got["files"].keys() == shards.keys()
        assert all(torch.equal(got["files"][k], shards[k]) for k in shards)


def _vllm_loop_worker(rank, world_size, port, root):
    """The tiny preset with configs/lora.yaml under FSDP on 2 ranks with ``rollout.backend=vllm``,
    each rank's engine a ``FakeLoRAEngine`` serving the built-in base (no warm start: the base
    stays the engine's): 2 steps, every push through ``RolloutSide.sync_weights``; each rank saves
    its engine's calls and the adapter files it loaded last to ``root/engine_{rank}.pt``."""
    from grpo_fast import train

    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False  # the group is the test's: run() leaves it
    tok = tiny.build_tokenizer()
    overrides = [f"output_dir={root}/run", "steps=2", "sft.steps=0", "eval_every=0", "checkpoint_every=0",
                 "logging.progress=false", "train.parallelism=fsdp", "rollout.backend=vllm"]  # fmt: skip
    cfg = load_config("tiny", [str(ROOT / "configs/lora.yaml")], overrides, check_device=False)
    engine = FakeLoRAEngine(tiny.build_model(tok, seed=cfg.seed), tok)
    train.run(cfg, engine=engine)
    torch.save({"calls": engine.calls, "files": engine.adapter_files}, Path(root) / f"engine_{rank}.pt")
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_the_loop_syncs_the_adapter_alone_from_shards_to_each_ranks_engine(tmp_path):
    """``RolloutSide.sync_weights`` under FSDP with LoRA and the vllm backend: before the first
    rollout and after each of 2 steps, each rank's engine loads the adapter alone (never full
    weights), gathered whole from the shards: the probe finds the engine serving the trainer's
    policy (fp32 on both sides, < 1e-5), and the adapter both engines hold last is ``final/``'s,
    bitwise."""
    from safetensors.torch import load_file

    start_ranks(_vllm_loop_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in rows if r["step"] > 0]
    assert [r["step"] for r in steps] == [1, 2] and all(r["world_size"] == 2 for r in rows)
    assert max(r["rollout/weight_sync_abs_diff"] for r in steps) < 1e-5
    final = load_file(tmp_path / "run" / "final" / "adapter_model.safetensors")
    for rank in (0, 1):
        engine = torch.load(tmp_path / f"engine_{rank}.pt", weights_only=False)
        assert engine["calls"].count("load_adapter") == 3 and "load_weights" not in engine["calls"]
        assert engine["files"].keys() == final.keys() and all(".lora_" in k for k in final)
        assert all(torch.equal(engine["files"][k], final[k]) for k in final)


def _resume_worker(rank, world_size, port, root, more):
    """The tiny preset under FSDP on 2 ranks with the overrides ``more``: a straight 4-step run
    (checkpoints of steps 3 and 4); rank 0 copies its folder to ``resumed`` as a run stopped after
    the step-3 checkpoint leaves it (no final/, no later checkpoint; its later rows stay: the resume
    drops them), which is then resumed to step 4. (The real SIGTERM under FSDP:
    tests/test_fsdp.py::test_sharded_checkpoints_resume_exactly_and_on_one_rank.)"""
    import shutil

    from grpo_fast import train

    join_cpu_ranks(rank, world_size, port)
    dist._OWN_GROUP = False  # one process group for the two runs (each run() would destroy it)
    root = Path(root)
    train.run(load_config("tiny", overrides=_loop_overrides(root / "straight", *more)))
    if rank == 0:
        shutil.copytree(root / "straight", root / "resumed")
        shutil.rmtree(root / "resumed" / "final")
        shutil.rmtree(root / "resumed" / "checkpoints" / "step_000004")
    dist.barrier()
    train.run(load_config("tiny", overrides=_loop_overrides(root / "resumed", "resume=true", *more)))
    torch.distributed.destroy_process_group()


@pytest.mark.slow
def test_a_lora_run_under_fsdp_resumed_from_its_checkpoint_is_the_straight_run(tmp_path):
    """LoRA with 8-bit AdamW under FSDP, in the loop: the sharded checkpoint of step 3 holds the
    adapter and its optimizer state (no base weight: the base is output_dir/base, as under DDP) and
    the adapter in peft's format; the run resumed from it has the straight run's metrics, metric
    for metric, and its final adapter, bitwise; final/ is a peft adapter (no full model) whose base
    resolves, equal to the last checkpoint's. Planted: ``sharded_checkpoint.load`` without the
    optimizer's state (``set_optimizer_state_dict`` skipped) → another final adapter."""
    from peft import PeftModel
    from safetensors.torch import load_file
    from torch.distributed.checkpoint import FileSystemReader
    from transformers import AutoModelForCausalLM

    more = (*LORA[:2], "train.optimizer=adamw8bit")
    start_ranks(_resume_worker, args=(2, _free_port(), str(tmp_path), more), nprocs=2, join=True)
    saved = tmp_path / "straight" / "checkpoints" / "step_000003"
    keys = FileSystemReader(str(saved / "dcp")).read_metadata().state_dict_metadata.keys()
    model_keys = [k for k in keys if k.startswith("model.")]
    assert model_keys and all(".lora_" in k for k in model_keys), model_keys[:3]
    assert any(k.startswith("optimizer.") and k.endswith("absmax1") for k in keys)  # the 8-bit state
    assert (saved / "adapter_model.safetensors").is_file() and not list(saved.glob("model*.safetensors"))
    diff = _metrics_diff()
    straight = diff.read_rows(tmp_path / "straight")
    assert [r["step"] for r in straight] == [0, 1, 2, 3, 4] and all(r["world_size"] == 2 for r in straight)
    assert diff.differences(straight, diff.read_rows(tmp_path / "resumed")) == []
    for run in ("straight", "resumed"):
        final = tmp_path / run / "final"
        assert not list(final.glob("model*.safetensors"))
        config = json.loads((final / "adapter_config.json").read_text())
        assert Path(config["base_model_name_or_path"]) == (tmp_path / run / "base").resolve()
        last = load_file(tmp_path / run / "checkpoints" / "step_000004" / "adapter_model.safetensors")
        got = load_file(final / "adapter_model.safetensors")
        assert got.keys() == last.keys() and all(torch.equal(got[k], last[k]) for k in got)
    a, b = (
        load_file(tmp_path / run / "final" / "adapter_model.safetensors") for run in ("straight", "resumed")
    )
    assert all(torch.equal(a[k], b[k]) for k in a)
    base = AutoModelForCausalLM.from_pretrained(tmp_path / "straight" / "base")
    PeftModel.from_pretrained(base, str(tmp_path / "straight" / "final"))  # loads as a peft adapter


@pytest.mark.slow
def test_torchrun_trains_the_tiny_preset_with_lora_under_fsdp(tmp_path):
    """``torchrun --nproc_per_node=2 -m grpo_fast.train --preset tiny --config configs/lora.yaml
    train.parallelism=fsdp``: greedy eval rises by ≥ 0.15 over 100 GRPO steps (as one process does
    with configs/lora.yaml, tests/test_lora.py), every row from 2 ranks."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc_per_node=2",
        "-m", "grpo_fast.train", "--preset", "tiny", "--config", "configs/lora.yaml", "train.parallelism=fsdp",
        "steps=100", "eval_every=50", "logging.progress=false", f"output_dir={tmp_path}",
    ]  # fmt: skip
    res = subprocess.run(
        cmd,
        capture_output=True,
        text=True,
        timeout=2400,
        cwd=ROOT,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert all(r["world_size"] == 2 for r in rows)
    evals = [(r["step"], r["eval/accuracy"]) for r in rows if "eval/accuracy" in r]
    assert evals[0][0] == 0 and evals[-1][0] == 100
    assert evals[-1][1] - evals[0][1] >= 0.15, evals


def test_the_planner_prints_one_ranks_qlora_budget(capsys):
    """``grpo-fast plan --world-size 2`` for QLoRA on Qwen2.5-Math-7B under FSDP: each rank holds
    half of the packed NF4 bytes, of the bf16 rest and of the adapter, but all of the NF4 block
    absmaxes (4/64 B a quantized value, kept on the Linear4bit modules); gathered in flight are the
    layers' frozen bytes (NF4 packed) and one layer's adapter gradient, and the root without a
    gradient (the head is frozen); vLLM's copy is the whole base, not the rank's share."""
    overrides = ["model.name_or_path=Qwen/Qwen2.5-Math-7B", "train.parallelism=fsdp"]
    cfg = load_config("rtx4090", [str(ROOT / "configs/qlora.yaml")], overrides, check_device=False)
    arch = plan.arch_for(cfg)
    one = plan.plan_memory(cfg, arch, 24 * plan.GB, world_size=1)
    two = plan.plan_memory(cfg, arch, 24 * plan.GB, world_size=2)
    absmax = arch.quantizable_params() * 4 / 64  # 6.53 G quantized values: 0.41 GB
    assert two.weights == pytest.approx((one.weights - absmax) / 2 + absmax)
    assert (two.grads, two.optimizer) == pytest.approx((one.grads / 2, one.optimizer / 2))
    assert two.vllm_weights == pytest.approx(one.vllm_weights)
    assert two.gathered_root == pytest.approx(arch.root_params * 2)  # bf16 embeddings + head, no grads
    adapter_layer = arch.lora_params(16, "all-linear") // arch.layers
    linear_layer = arch.quantizable_params() // arch.layers
    frozen = linear_layer * 0.5 + (arch.layer_params - linear_layer) * 2  # NF4 packed + bf16 norms, biases
    assert two.gathered_layers == pytest.approx(2 * (frozen + adapter_layer * 2) + adapter_layer * (2 + 4))
    assert two.train_peak < one.train_peak
    argv = [
        "--preset",
        "rtx4090",
        "--gpu-mem-gb",
        "24",
        "--world-size",
        "2",
        "--config",
        str(ROOT / "configs/qlora.yaml"),
    ]
    assert plan.main([*argv, *overrides]) == 0
    out = capsys.readouterr().out
    assert "gathered in flight: 2 layers + 1 layer's adapter's gradients" in out
    assert "gathered root: embeddings + lm_head + norm " in out and ", + gradients" not in out
