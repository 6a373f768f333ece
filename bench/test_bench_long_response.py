"""Long responses under sequence parallelism (``train.sequence_parallel``) on CPU, 2 gloo ranks.

    python -m pytest bench/test_bench_long_response.py -k activation_peak -p no:cacheprovider \
        --benchmark-json bench/results/long-response-peak-cpu-$(date -u +%F).json
    # the step, each variant in a fresh process, alternated: sp1, sp2, sp2, sp1 (files a-d)
    python -m pytest bench/test_bench_long_response.py -k "train_step and sp1" -p no:cacheprovider \
        --benchmark-json bench/results/long-response-step-cpu-$(date -u +%F)a.json

The model: bench/peers/workloads.py's ``wide_config`` (the wide peer cases' random Qwen2: D 512,
MLP 1,536, 8 heads over 2 KV heads, V = 32,768, tied) at ``LAYERS`` layers. Two groups of rows:

- ``long-response-cpu-train_step``: one optimizer step (``optimize_on_rollout``: forward and
  backward of every microbatch, grad clip, AdamW) on a rollout batch of ``STEP_BATCH``: one prompt
  of 128 tokens × 4 responses of 1,024, one sequence a microbatch. ``sp1``: plain data parallelism,
  each rank trains 2 of the responses (DDP); ``sp2``: one sp group, both ranks train all 4, each
  holding half of every sequence's tokens (DDP over both). The same work per step on the 2 cores;
  from the second microbatch on, each rank holds the accumulated gradients beside a microbatch's
  activations (1,152 tokens, or 576 under ``sp2``).
  ``all_to_all_share_by_rank``: the wall time each rank spent in the Ulysses all-to-alls
  (``grpo_fast.policy.ulysses``; the peer's lag included) over its step time, summed over the
  timed rounds; ``peak_by_rank`` the tracked peak of one more step, ``passes_peak_by_rank`` of its
  forward and backward passes alone (the AdamW step's temporaries left out);
- ``long-response-cpu-activation_peak``: the forward and backward of ONE sequence of L tokens
  (128 prompt + L − 128 response), for L = 512 … 8,192: ``peak_by_rank`` is each rank's
  ``grpo_fast.obs.memory.tracked_peak_bytes`` (the bytes the pass allocates on top of the weights
  and their existing ``.grad``: activations, the loss chunk, the gradients as they are summed in);
  ``sp1`` runs the whole sequence on each rank, ``sp2`` half of it with the all-to-alls.

The pytest process is rank 0 and times the step with pytest-benchmark; rank 1 is a spawned process
that runs each call as rank 0 tells it (one 8-byte broadcast per call, inside the timed region), so
a round's time is the time both ranks take. Each rank runs one thread (the 2 cores).
"""

from __future__ import annotations

import datetime
import multiprocessing
import time
from collections.abc import Callable
from typing import NamedTuple

import pytest
import torch
from test_bench_fsdp import _free_port, _tell  # the 2-rank harness: rank 0 tells rank 1 each call

from bench.workloads_train_step import _describe, device_name
from grpo_fast import dist
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.optimization import _accumulate_gradients, optimize_on_rollout
from grpo_fast.loop.state import Trainer
from grpo_fast.loop.stats import StepStats
from grpo_fast.obs.memory import tracked_peak_bytes
from grpo_fast.policy import sequence_parallel, ulysses
from grpo_fast.policy.batch import Sequence, assign_loss_weights, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.rollout.trajectory import Trajectory

WORLD = 2
LAYERS = 2
PROMPT_TOKENS = 128
STEP_BATCH = dict(group=4, response_tokens=1024, micro_batch=1)
LENGTHS = (512, 1024, 2048, 4096, 8192)
ROUNDS = 3
TIMEOUT_S = 1800  # a rank that stops answering fails the case instead of hanging it
STEP, PEAK, RESET, STOP = 0, 1, 2, 3  # what rank 0 tells rank 1 to do next


class A2ATimer:
    """Wall seconds spent in ``all_to_all_single`` by this process (the Ulysses exchanges), by
    standing in for ``torch.distributed`` inside ``grpo_fast.policy.ulysses``."""

    def __init__(self):
        self.seconds = 0.0
        self.calls = 0

    def __getattr__(self, name):
        return getattr(torch.distributed, name)

    def all_to_all_single(self, *args, **kwargs):
        t0 = time.perf_counter()
        out = torch.distributed.all_to_all_single(*args, **kwargs)
        self.seconds += time.perf_counter() - t0  # gloo on CPU: returns when the data is there
        self.calls += 1
        return out


TIMER = A2ATimer()


def _model(max_positions: int):
    from transformers import AutoModelForCausalLM

    from bench.peers.workloads import wide_config

    config = wide_config(layers=LAYERS, max_positions=max_positions)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return AutoModelForCausalLM.from_config(config, attn_implementation="sdpa")


def _tokens(n: int, seed: int) -> list[int]:
    return torch.randint(3, 32768, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class Work(NamedTuple):
    step: Callable[[], object]  # the timed call
    info: dict
    passes: Callable[[], object] | None = None  # a step's forward and backward passes alone


def _world(sp: int, rank: int) -> dist.DistInfo:
    """This rank's place: 2 dp ranks (``sp`` 1) or one sp group of 2, with the mesh's groups."""
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (WORLD // sp, sp), mesh_dim_names=("dp", "sp"))
    groups = {"dp": mesh.get_group("dp"), "sp": mesh.get_group("sp")}
    return dist.DistInfo(rank, WORLD, rank, sp, groups, mesh)


def _train_step(sp: int, rank: int) -> Work:
    """One optimizer step on this rank's share of ``STEP_BATCH`` (module docstring)."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    world = _world(sp, rank)
    g, n, mb_size = STEP_BATCH["group"], STEP_BATCH["response_tokens"], STEP_BATCH["micro_batch"]
    model = _model(PROMPT_TOKENS + n)
    if sp > 1:
        ulysses.enable(model, sp)
    cfg = load_config("tiny", overrides=["train.lr=1e-5", f"train.sequence_parallel={sp}"])
    policy = DDP(PolicyLoss(model, autocast=None, backend="torch_chunked"))
    responses = [_tokens(n, 10 + i) for i in range(g)]
    adv = torch.tensor([1.0, -1.0] * (g // 2))
    share = slice(world.dp.rank * g // world.dp.size, (world.dp.rank + 1) * g // world.dp.size)
    prompt = _tokens(PROMPT_TOKENS, 1)
    seqs = [Trajectory(prompt, r, advantage=float(a)) for r, a in zip(responses, adv)]
    assign_loss_weights(seqs, length_norm="sequence_mean", max_length=n)  # over all 4, then this rank's
    seqs = seqs[share]
    mbs = [sequence_parallel.shard(mb, world.sp) for mb in make_microbatches(seqs, mb_size, 0, packing=False)]
    params = list(model.parameters())
    trainer = Trainer(policy, build_optimizer(cfg, params), params, cfg, world)
    clock = {"step_s": 0.0}

    def step() -> float:
        t0 = time.perf_counter()
        stats = optimize_on_rollout(trainer, mbs, options=LossOptions(), temperature=1.0)
        clock["step_s"] += time.perf_counter() - t0
        return stats.grad_norm

    def passes() -> None:
        """The step's forward and backward passes (DDP's all-reduce included; no clip, no AdamW),
        then the gradients dropped."""
        _accumulate_gradients(trainer, mbs, (), StepStats(), LossOptions(), 1.0, None)
        trainer.optimizer.zero_grad(set_to_none=True)

    info = {"tokens_per_rank": sum(int(mb.input_ids.numel()) for mb in mbs), "clock": clock}
    return Work(step, info, passes)


def _one_sequence(sp: int, rank: int, length: int) -> Work:
    """Forward and backward of one ``length``-token sequence (module docstring)."""
    world = _world(sp, rank)
    model = _model(length)
    loss_fn = PolicyLoss(model, autocast=None, backend="torch_chunked")
    seq = Sequence(_tokens(length, 3), PROMPT_TOKENS, 1.0, 1.0 / (length - PROMPT_TOKENS))
    mb = sequence_parallel.shard(make_microbatches([seq], 1, 0, packing=False)[0], world.sp)

    def step() -> None:
        loss_fn(mb, LossOptions(), 1.0).loss.backward()

    step()  # the parameters' .grad exist from here on: the measured passes add to them in place
    return Work(step, {"tokens_per_rank": int(mb.input_ids.numel())})


def _workload(case: str, rank: int) -> Work:
    kind, sp, length = CASES[case]
    return _train_step(sp, rank) if kind == "step" else _one_sequence(sp, rank, length)


CASES = {
    **{f"step_sp{sp}": ("step", sp, None) for sp in (1, 2)},
    **{f"peak_{n}_sp{sp}": ("peak", sp, n) for n in LENGTHS for sp in (1, 2)},
}


def _join(rank: int, port: int) -> None:
    ulysses.torch_dist = TIMER  # this process's all-to-alls are timed
    torch.set_num_threads(1)
    torch.distributed.init_process_group(
        "gloo",
        init_method=f"tcp://127.0.0.1:{port}",
        rank=rank,
        world_size=WORLD,
        timeout=datetime.timedelta(seconds=TIMEOUT_S),
    )


def _report(work: Work) -> dict:
    """This rank's tracked peak of one more call, and its all-to-all and step seconds so far."""
    clock = work.info.get("clock", {})
    record = {"a2a_s": TIMER.seconds, "a2a_calls": TIMER.calls, "step_s": clock.get("step_s")}
    record["peak"] = tracked_peak_bytes(work.step)
    record["passes_peak"] = None if work.passes is None else tracked_peak_bytes(work.passes)
    return record


def _reset(work: Work) -> None:
    """Start counting: the warm-up's seconds left out."""
    TIMER.seconds, TIMER.calls = 0.0, 0
    work.info.get("clock", {}).update(step_s=0.0)


def _rank1(case: str, port: int) -> None:
    _join(1, port)
    work = _workload(case, 1)
    while (command := _tell(STEP)) != STOP:
        if command == STEP:
            work.step()
        elif command == RESET:
            _reset(work)
        else:
            dist.all_gather_objects(_report(work))
    torch.distributed.barrier()  # STOP received: rank 0 may now close the group
    torch.distributed.destroy_process_group()


def _run_case(benchmark, request, case: str, what: str, rounds: int) -> None:
    port, threads = _free_port(), torch.get_num_threads()
    peer = multiprocessing.get_context("spawn").Process(target=_rank1, args=(case, port), daemon=True)
    peer.start()
    try:
        _join(0, port)
        work = _workload(case, 0)
        if CASES[case][0] == "step":  # warm-up, outside the counted seconds
            _tell(STEP), work.step()
        _tell(RESET), _reset(work)
        out = []
        benchmark.pedantic(lambda: out.append((_tell(STEP), work.step())[1]), rounds=rounds, warmup_rounds=0)
        _tell(PEAK)
        reports = dist.all_gather_objects(_report(work))
        _tell(STOP)
        torch.distributed.barrier()
        device = device_name(torch.device("cpu"))
    finally:
        if torch.distributed.is_initialized():
            torch.distributed.destroy_process_group()
        torch.set_num_threads(threads)
        peer.join(timeout=120)
        if peer.is_alive():
            peer.kill()
    assert peer.exitcode == 0, f"rank 1 exited with {peer.exitcode}"
    kind, sp, length = CASES[case]
    extra = {}
    if kind == "step":
        extra = {
            "grad_norm": out[-1],
            "step_s_by_rank": [r["step_s"] for r in reports],
            "all_to_all_s_by_rank": [r["a2a_s"] for r in reports],
            "all_to_all_calls_by_rank": [r["a2a_calls"] for r in reports],
            "all_to_all_share_by_rank": [r["a2a_s"] / r["step_s"] if r["step_s"] else None for r in reports],
            # the forward and backward passes alone (the optimizer step's own temporaries left out)
            "passes_peak_by_rank": [r["passes_peak"] for r in reports],
        }
    _describe(
        benchmark,
        request,
        torch.device("cpu"),
        impl=f"sp{sp}",
        case=what,
        status="ok",
        peak_memory_bytes=max(r["peak"] for r in reports),
        peak_by_rank=[r["peak"] for r in reports],
        sequence_parallel=sp,
        sequence_tokens=length,
        ranks=WORLD,
        tokens_per_rank=work.info["tokens_per_rank"],
        **extra,
    )
    benchmark.extra_info["device"] = device


MODEL = f"random Qwen2 (wide_config: D 512, 8/2 heads, V 32,768) at {LAYERS} layers, 2 gloo ranks × 1 thread"


@pytest.mark.benchmark(group="long-response-cpu-train_step")
@pytest.mark.parametrize("impl", ["sp1", "sp2"])
def test_long_response_train_step(benchmark, request, impl):
    what = (
        f"{MODEL}: one optimizer step, 1 prompt of {PROMPT_TOKENS} × 4 responses of 1,024, one a microbatch"
    )
    _run_case(benchmark, request, f"step_{impl}", what, ROUNDS)


@pytest.mark.benchmark(group="long-response-cpu-activation_peak")
@pytest.mark.parametrize("length", LENGTHS)
@pytest.mark.parametrize("impl", ["sp1", "sp2"])
def test_one_sequence_activation_peak(benchmark, request, impl, length):
    what = f"{MODEL}: forward + backward of one {length}-token sequence ({PROMPT_TOKENS} prompt)"
    _run_case(benchmark, request, f"peak_{length}_{impl}", what, 1)
