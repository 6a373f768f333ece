"""FSDP2 (``train.parallelism=fsdp``) against DDP on CPU, 2 gloo ranks: one training step, the two
ways to accumulate gradients over microbatches, and the weight push from shards.

    python -m pytest bench/test_bench_fsdp.py -p no:cacheprovider \
        --benchmark-json bench/results/fsdp-cpu-$(date -u +%F).json

The model: the tiny task's Qwen2 widened to hidden 256, MLP 768, 6 decoder layers (4.7 M
parameters, 3.15 MB of fp32 weights per layer; the vocabulary is the tiny task's 15 tokens, so
the decoder is nearly all of it). The rollout batch: 8 prompts × 8 responses (the tiny task's
prompt and response lengths), 32 per rank. Each case is one group of ``bench/results`` rows:

- ``fsdp-cpu-train_step``: ``optimize_on_rollout`` (forward + backward of every microbatch, grad
  clip, AdamW) under DDP and under FSDP, one microbatch of 32 per rank;
- ``fsdp-cpu-grad_accumulation``: FSDP with 4 microbatches of 8 per rank, reduce-scattering every
  microbatch's gradients (``per_microbatch``, what grpo_fast does) or deferring to the last
  (``deferred``: ``set_requires_gradient_sync(False)`` before the others);
- ``fsdp-cpu-weight_push``: ``VLLMBackend.update_weights`` into tests/test_rollout_vllm.py's
  FakeVLLMEngine, from whole weights (``ddp``) and from shards (``fsdp``); ``layer_bytes`` is
  one decoder layer's fp32 weights;
- ``fsdp-cpu-lora``: the same step with a rank-16 LoRA adapter on every linear layer of the
  decoder (``lora``: the frozen fp32 base; ``qlora``: the base in NF4 from a folder), under DDP
  and under FSDP;
- ``fsdp-cpu-adamw8bit``: the full fine-tuning step with bitsandbytes' 8-bit AdamW, under DDP
  (``bnb.optim.AdamW8bit``) and under FSDP (``ShardedAdamW8bit`` on each rank's shards), beside
  the ``fsdp-cpu-train_step`` rows (plain AdamW).

The pytest process is rank 0 and times the step with pytest-benchmark; rank 1 is a spawned
process that runs each call as rank 0 tells it (one 8-byte broadcast per call, inside the timed
region), so the time of a round is the time both ranks take. ``peak_memory_bytes`` is the larger
rank's ``grpo_fast.obs.memory.tracked_peak_bytes`` of one more call (what the step allocates on
top of what existed before it: the weights, the optimizer state and DDP's buckets are not in
it); ``peak_by_rank`` has both, ``passes_peak_by_rank`` the same for the step's forward and
backward passes alone (where gradients are held), ``held_by_rank`` the weight and AdamW bytes
each rank keeps between steps, ``weights_by_rank`` and ``optimizer_by_rank`` the two apart
(``fsdp.local_bytes``: local shards, a 4-bit base's quantization state included, shared tensors
once). Each rank runs one thread, so the two ranks use the 2 cores.
"""

from __future__ import annotations

import contextlib
import datetime
import multiprocessing
import socket
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import NamedTuple
from unittest import mock

import pytest
import torch

from grpo_fast import dist
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.loop import optimization
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.state import Trainer
from grpo_fast.loop.stats import StepStats
from grpo_fast.obs.memory import tracked_peak_bytes
from grpo_fast.policy import fsdp
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # FakeVLLMEngine

from bench.workloads_train_step import _describe, device_name

WORLD = 2
DIMS = {
    "hidden_size": 256,
    "intermediate_size": 768,
    "num_hidden_layers": 6,
    "layer_types": ["full_attention"] * 6,
}
PROMPTS, GROUP = 8, 8  # 64 responses: 4 whole groups per rank
ROUNDS = 5
TIMEOUT_S = 300  # a rank that stops answering fails the case instead of hanging it
STEP, PEAK, STOP = 0, 1, 2  # what rank 0 tells rank 1 to do next

CASES = {
    # case: (microbatch size, arm, what trains) — 32 responses per rank
    "ddp": (32, "ddp", "full"),
    "fsdp": (32, "fsdp", "full"),
    "per_microbatch": (8, "fsdp", "full"),
    "deferred": (8, "fsdp_deferred", "full"),
    "push_ddp": (None, "push_whole", "full"),
    "push_fsdp": (None, "push_sharded", "full"),
    "lora_ddp": (32, "ddp", "lora"),
    "lora_fsdp": (32, "fsdp", "lora"),
    "qlora_ddp": (32, "ddp", "qlora"),
    "qlora_fsdp": (32, "fsdp", "qlora"),
    "adamw8bit_ddp": (32, "ddp", "adamw8bit"),
    "adamw8bit_fsdp": (32, "fsdp", "adamw8bit"),
}
LORA = ["model.lora.r=16", "model.lora.alpha=32", "model.lora.lr_scale=1"]
TRAINS = {
    "full": [],
    "lora": LORA,
    "qlora": [*LORA, "model.load_in_4bit=true"],
    "adamw8bit": ["train.optimizer=adamw8bit"],
}


def _model(tok):
    from transformers import AutoModelForCausalLM, Qwen2Config

    config = Qwen2Config(**{**tiny.build_model_config(tok).to_diff_dict(), **DIMS})
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config)


def _policy_model(cfg, tok, folder: Path, rank: int):
    """The bench model; under LoRA with a fresh rank-16 adapter on every decoder linear (peft,
    lora_A seeded), its base written to ``folder`` by rank 0 (transformers writes from rank 0
    only) and loaded from there (in NF4 for QLoRA)."""
    if not cfg.model.lora.r:
        return _model(tok)
    from grpo_fast.policy.model import load_policy

    if rank == 0:
        _model(tok).save_pretrained(folder)
    torch.distributed.barrier()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return load_policy(cfg, tok, torch.device("cpu"), base_path=str(folder))


def _microbatches(cfg, tok, rank: int, micro_batch: int):
    """This rank's share of a fixed rollout batch (the tiny task's lengths: prompts of 3-6 tokens,
    responses of 1-4), with the global length normalizers, in microbatches of ``micro_batch``."""
    g = torch.Generator().manual_seed(123)
    rand_len = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    prompts = [torch.randint(3, 15, (rand_len(3, 7),), generator=g).tolist() for _ in range(PROMPTS)]
    responses = [
        torch.randint(3, 15, (rand_len(1, 5),), generator=g).tolist() for _ in range(PROMPTS * GROUP)
    ]
    adv = torch.randn(PROMPTS * GROUP, generator=g)
    per = PROMPTS // WORLD
    lo, hi = rank * per, (rank + 1) * per
    seqs = loss_trajectories(
        Rollout(prompts[lo:hi], responses[lo * GROUP : hi * GROUP]),
        advantages=adv[lo * GROUP : hi * GROUP],
        length_norm=cfg.loss.length_norm,
        max_length=cfg.rollout.max_tokens,
        num_sequences=len(responses),
        num_tokens=sum(map(len, responses)),
    )
    return make_microbatches(seqs, micro_batch, tok.pad_token_id, packing=False)


@contextlib.contextmanager
def _fsdp_deferred_sync(trainer: Trainer, defer: bool):
    """The alternative to grpo_fast's per-microbatch reduce-scatter: no gradient sync in this
    microbatch's backward when ``defer`` (FSDP2 keeps the unsharded gradients), the last syncs."""
    trainer.policy.set_requires_gradient_sync(not defer)
    yield


class Work(NamedTuple):
    """One case on one rank: ``step`` (the timed call), ``accumulate`` (its forward and backward
    passes alone; None for a push), ``held`` (the bytes this rank keeps between steps,
    ``fsdp.local_bytes``: its weights and optimizer state, shards under FSDP; DDP's gradient
    buckets, a full fp32 gradient, are not in it) and ``info`` (what rank 0 records)."""

    step: Callable[[], object]
    accumulate: Callable[[], None] | None
    held: Callable[[], dict[str, int]]
    info: dict


def _workload(case: str, rank: int, folder: Path) -> Work:
    micro_batch, arm, trains = CASES[case]
    cfg = load_config("tiny", overrides=["train.lr=1e-4", *TRAINS[trains]])
    tok = tiny.build_tokenizer()
    model = _policy_model(cfg, tok, folder, rank)
    layer_bytes = sum(p.numel() * p.element_size() for p in fsdp.decoder_layers(model)[0].parameters())
    info = {"layer_bytes": layer_bytes, "weights_bytes": sum(p.numel() * 4 for p in model.parameters())}
    engine = None
    if arm.startswith("push"):
        from test_rollout_vllm import FakeVLLMEngine

        from grpo_fast.rollout.vllm import VLLMBackend

        engine = FakeVLLMEngine(model, tok)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    if arm in ("ddp", "push_whole"):
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy = DDP(policy)
    else:
        fsdp.shard_policy(policy, None, torch.device("cpu"), WORLD)
    if engine is not None:
        backend = VLLMBackend(engine, tok, sleep_level=0)
        return Work(
            lambda: backend.update_weights(model, step=1), None, lambda: fsdp.local_bytes(model), info
        )
    params = [p for p in model.parameters() if p.requires_grad]
    trainer = Trainer(
        policy, build_optimizer(cfg, params), params, cfg, dist.DistInfo(rank=rank, world_size=WORLD)
    )
    info |= {
        "optimizer": type(trainer.optimizer).__name__,
        "trainable_params": sum(p.numel() for p in params),
    }
    mbs = _microbatches(cfg, tok, rank, micro_batch)
    info |= {"microbatches": len(mbs), "tokens": sum(int(mb.input_ids.numel()) for mb in mbs)}
    sync = _fsdp_deferred_sync if arm == "fsdp_deferred" else optimization._deferred_sync

    def step() -> float:
        with mock.patch.object(optimization, "_deferred_sync", sync):
            stats = optimization.optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0)
        return stats.grad_norm

    def accumulate() -> None:
        """The step's forward and backward passes alone (its reduce-scatters or all-reduces
        included; no clip, no AdamW), then the gradients dropped."""
        with mock.patch.object(optimization, "_deferred_sync", sync):
            optimization._accumulate_gradients(trainer, mbs, (), StepStats(), LossOptions(), 1.0, None)
        trainer.optimizer.zero_grad(set_to_none=True)

    return Work(step, accumulate, lambda: fsdp.local_bytes(model, trainer.optimizer), info)


def _join(rank: int, port: int) -> None:
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


def _tell(command: int) -> int:
    """Rank 0 sends ``command``; rank 1 receives it (its argument is ignored)."""
    t = torch.tensor([command])
    torch.distributed.broadcast(t, src=0)
    return int(t)


def _rank1(case: str, port: int, folder: str) -> None:
    _join(1, port)
    _serve(_workload(case, 1, Path(folder)))


def _serve(work: Work) -> None:
    """Rank 1: run each call rank 0 asks for, until it says stop."""
    while (command := _tell(STEP)) != STOP:
        if command == STEP:
            work.step()
        else:
            dist.all_gather_objects(_memory(work))
    torch.distributed.barrier()  # STOP received: rank 0 may now close the group
    torch.distributed.destroy_process_group()


def _memory(work: Work) -> tuple[int, int | None, dict[str, int]]:
    """``tracked_peak_bytes`` of one step, and of its forward and backward passes alone; the
    bytes held between steps (``fsdp.local_bytes``)."""
    passes = None if work.accumulate is None else tracked_peak_bytes(work.accumulate)
    return tracked_peak_bytes(work.step), passes, work.held()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run_case(benchmark, request, case: str, what: str) -> None:
    port, threads = _free_port(), torch.get_num_threads()
    folder = tempfile.TemporaryDirectory()  # a LoRA base is loaded from a folder
    peer = multiprocessing.get_context("spawn").Process(
        target=_rank1, args=(case, port, folder.name), daemon=True
    )
    peer.start()
    try:
        _join(0, port)
        work = _workload(case, 0, Path(folder.name))
        out = []
        benchmark.pedantic(lambda: out.append((_tell(STEP), work.step())[1]), rounds=ROUNDS, warmup_rounds=1)
        _tell(PEAK)
        peaks, passes, held = zip(*dist.all_gather_objects(_memory(work)))
        _tell(STOP)
        torch.distributed.barrier()
        device = device_name(torch.device("cpu"))  # with this rank's one thread
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)
        folder.cleanup()
        peer.join(timeout=TIMEOUT_S)  # measured: up to 60+ s to exit after its last call at load 10-14
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0, f"rank 1 exited with {peer.exitcode}"
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=case.removeprefix("push_"),
        case=what,
        status="ok",
        peak_memory_bytes=max(peaks),
        peak_by_rank=list(peaks),
        # the forward and backward passes alone: where the gradients are held (None for a push)
        passes_peak_by_rank=None if work.accumulate is None else list(passes),
        held_by_rank=[h["weights"] + h["optimizer"] for h in held],
        weights_by_rank=[h["weights"] for h in held],
        optimizer_by_rank=[h["optimizer"] for h in held],
        grad_norm=out[-1],
        ranks=WORLD,
        **work.info,
    )
    benchmark.extra_info["device"] = device


MODEL = "tiny Qwen2 at hidden 256, 6 layers (4.7 M params), 2 gloo ranks × 1 thread"


@pytest.mark.benchmark(group="fsdp-cpu-train_step")
@pytest.mark.parametrize("case", ["ddp", "fsdp"])
def test_train_step_ddp_vs_fsdp(benchmark, request, case):
    _run_case(benchmark, request, case, f"{MODEL}: one optimizer step, 32 responses per rank in 1 microbatch")


@pytest.mark.benchmark(group="fsdp-cpu-grad_accumulation")
@pytest.mark.parametrize("case", ["per_microbatch", "deferred"])
def test_fsdp_gradient_accumulation(benchmark, request, case):
    _run_case(benchmark, request, case, f"{MODEL}: one optimizer step, 4 microbatches of 8 per rank")


@pytest.mark.benchmark(group="fsdp-cpu-weight_push")
@pytest.mark.parametrize("case", ["push_ddp", "push_fsdp"])
def test_weight_push(benchmark, request, case):
    _run_case(benchmark, request, case, f"{MODEL}: update_weights into the fake vLLM engine")


@pytest.mark.benchmark(group="fsdp-cpu-lora")
@pytest.mark.parametrize("case", ["lora_ddp", "lora_fsdp", "qlora_ddp", "qlora_fsdp"])
def test_lora_step_ddp_vs_fsdp(benchmark, request, case):
    _run_case(
        benchmark,
        request,
        case,
        f"{MODEL}, LoRA r 16 on every decoder linear: one step, 32 responses per rank",
    )


@pytest.mark.benchmark(group="fsdp-cpu-adamw8bit")
@pytest.mark.parametrize("case", ["adamw8bit_ddp", "adamw8bit_fsdp"])
def test_8bit_adamw_step_ddp_vs_fsdp(benchmark, request, case):
    _run_case(benchmark, request, case, f"{MODEL}, 8-bit AdamW: one optimizer step, 32 responses per rank")
