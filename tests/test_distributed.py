"""Data parallelism on CPU with gloo: 2 ranks train exactly like 1 rank, and torchrun runs the preset."""

import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch
from support.ranks import join_cpu_ranks, start_ranks

from grpo_fast import dist
from grpo_fast.algo.loss_options import LossOptions
from grpo_fast.config import load_config
from grpo_fast.loop.optim import build_optimizer
from grpo_fast.loop.optimization import optimize_on_rollout
from grpo_fast.loop.state import Trainer
from grpo_fast.policy.batch import loss_trajectories, make_microbatches
from grpo_fast.policy.loss import PolicyLoss
from grpo_fast.policy.value import ValueHead
from grpo_fast.rollout import Rollout
from grpo_fast.task import tiny

GROUP = 4
PROMPTS = 4  # 16 responses: each of 2 ranks takes 2 whole groups


def _global_rollout(separated: bool = False):
    """A fixed synthetic rollout batch: prompts, responses of mixed lengths, advantages.

    ``separated``: the first half of the prompts (rank 0's on 2 ranks) and their responses are
    all longer than the second half's, so length-sorted microbatches of 8 hold the same
    sequences on 1 rank as on 2.
    """
    g = torch.Generator().manual_seed(123)
    rand_len = lambda lo, hi: int(torch.randint(lo, hi, (1,), generator=g))
    prompt_len = [(10, 12) if separated and i < PROMPTS // 2 else (3, 7) for i in range(PROMPTS)]
    prompts = [torch.randint(3, 15, (rand_len(*lh),), generator=g).tolist() for lh in prompt_len]
    responses = [
        [*torch.randint(3, 15, (rand_len(1, 5),), generator=g).tolist(), 1] for _ in range(PROMPTS * GROUP)
    ]
    adv = torch.randn(PROMPTS * GROUP, generator=g)
    return prompts, responses, adv


def _one_step(cfg, rank: int, world_size: int, separated: bool = False) -> dict[str, torch.Tensor]:
    """One optimizer step on this rank's share of the global rollout batch; returns the weights."""
    tok = tiny.build_tokenizer()
    model = tiny.build_model(tok, seed=0)
    world = dist.DistInfo(rank=rank, world_size=world_size)
    prompts, responses, adv = _global_rollout(separated)
    per_rank = PROMPTS // world_size
    p_lo, p_hi = rank * per_rank, (rank + 1) * per_rank
    my_prompts, my_resp = prompts[p_lo:p_hi], responses[p_lo * GROUP : p_hi * GROUP]
    my_adv = adv[p_lo * GROUP : p_hi * GROUP]
    lengths = [len(r) for r in my_resp]
    n_seq, n_tok = dist.all_reduce_sum([len(lengths), sum(lengths)], torch.device("cpu"))  # as the loop does
    seqs = loss_trajectories(
        Rollout(my_prompts, my_resp),
        advantages=my_adv,
        length_norm=cfg.loss.length_norm,
        max_length=cfg.rollout.max_tokens,
        num_sequences=int(n_seq),
        num_tokens=n_tok,
    )
    head = None
    if cfg.loss.advantage == "gae":  # a value head (random, not zero: a gradient into the trunk) with targets
        head = ValueHead(model.config.hidden_size)
        torch.nn.init.normal_(head.proj.weight, std=0.5, generator=torch.Generator().manual_seed(7))
        g = torch.Generator().manual_seed(11)
        targets = [torch.randn(len(r), generator=g) for r in responses][p_lo * GROUP : p_hi * GROUP]
        for t, ret in zip(seqs, targets):
            t.token_returns, t.token_values = ret, 0.5 * ret
    mbs = make_microbatches(seqs, int(cfg.train.micro_batch_size), tok.pad_token_id, packing=False)
    policy = PolicyLoss(model, autocast=None, backend="torch_chunked")
    value_params = []
    if head is not None:
        policy.attach_value_head(head, cfg.critic.trunk_coef, cfg.critic.value_clip)
        value_params = list(head.parameters())
    if world.enabled:
        from torch.nn.parallel import DistributedDataParallel as DDP

        policy = DDP(policy)
    params = list(model.parameters())
    optimizer = build_optimizer(cfg, params, value_params)
    grads = {}  # the (all-reduced) gradients the step applies: freed right after it
    named = lambda: [*model.named_parameters(), *(head.named_parameters(prefix="value_head") if head else [])]
    real_step = optimizer.step

    def recording_step(*a, **k):
        grads.update({f"grad/{n}": p.grad.detach().clone() for n, p in named()})
        return real_step(*a, **k)

    optimizer.step = recording_step
    optimize_on_rollout(
        Trainer(policy, optimizer, params + value_params, cfg, world, value_head=head),
        mbs,
        options=LossOptions(),
        temperature=1.0,
    )
    return {**{n: p.detach().clone() for n, p in named()}, **grads}


def _worker(rank, world_size, port, overrides, out_path, separated=False):
    join_cpu_ranks(rank, world_size, port)
    cfg = load_config("tiny", overrides=overrides)
    state = _one_step(cfg, rank, world_size, separated)
    if rank == 0:
        torch.save(state, out_path)
    dist.shutdown()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.mark.parametrize("length_norm", ["sequence_mean", "token_mean", "constant"])
def test_one_step_on_two_ranks_equals_one_rank(tmp_path, length_norm):
    """Realistic split: micro batch 3 on 16 sequences gives different microbatches on 1 and 2
    ranks, so gradients agree to fp32 summation order, and weights after one AdamW step differ
    only by what those gradient differences explain. (Adam's first step is lr·g/(|g| + eps):
    weights whose gradient is ~eps = 1e-8 turn that rounding into up to a few % of a step.
    Same microbatches: next test, bitwise.)"""
    overrides = [f"loss.length_norm={length_norm}", "train.micro_batch_size=3", "train.lr=1e-4"]
    out = tmp_path / "rank0.pt"
    start_ranks(_worker, args=(2, _free_port(), overrides, str(out)), nprocs=2, join=True)
    two = torch.load(out)
    one = _one_step(load_config("tiny", overrides=overrides), rank=0, world_size=1)
    start = tiny.build_model(tiny.build_tokenizer(), seed=0).state_dict()
    weights = [k for k in one if not k.startswith("grad/")]
    moved = max((one[k] - start[k]).abs().max().item() for k in weights)
    assert moved > 5e-5  # the step did change the weights (Adam's first step moves each by ≈ lr)
    # Adam's first step moves a weight by lr·g/(|g| + eps), lr = the largest move: two ranks' step
    # differs from one rank's only as much as their gradients' g/(|g| + eps) do, and by the fp32
    # rounding of the update (a weight whose gradient is ~eps turns a rounding-level gradient
    # difference into up to a few % of a step: 1.8e-6 at lr 1e-4 with the fused head of 58aa2b8)
    for k in (k for k in weights if f"grad/{k}" in one):  # a tied lm_head is the embeddings' tensor
        g1, g2 = one[f"grad/{k}"].double(), two[f"grad/{k}"].double()
        direction = lambda g: g / (g.abs() + 1e-8)
        explained = moved * (direction(g1) - direction(g2)).abs()
        rounding = 4 * torch.finfo(torch.float32).eps * (one[k].abs() + moved)
        excess = ((one[k] - two[k]).abs().double() - explained - rounding).max().item()
        assert excess <= 0, (k, excess)
    assert max((one[k] - two[k]).abs().max().item() for k in weights) <= 0.05 * moved
    # the all-reduced gradient is the 1-rank gradient up to fp32 summation order: a few ulps of
    # the tensor's largest entry (fp32 eps ≈ 1.2e-7) where terms cancel
    for k in (k for k in one if k.startswith("grad/")):
        torch.testing.assert_close(two[k], one[k], rtol=1e-5, atol=1e-6 * one[k].abs().max().item())


@pytest.mark.parametrize("value_head", [False, True])
def test_same_microbatches_on_two_ranks_give_a_bitwise_identical_step(tmp_path, value_head):
    """With the same microbatches (each rank's 8 sequences are one microbatch on 1 rank too),
    data parallelism adds no rounding of its own: the scale by the world size (2) and DDP's
    averaging are exact, and a + b is the same sum on either side. The tiny preset's optimizer;
    with ``value_head``, a value head in the loss module (loss.advantage=gae, half its value
    loss's gradient into the shared layers): its weights and gradients too."""
    overrides = ["loss.length_norm=token_mean", "train.micro_batch_size=8"]
    if value_head:
        overrides += ["loss.advantage=gae", "critic.trunk_coef=0.5", "critic.lr=0.01"]
    out = tmp_path / "rank0.pt"
    start_ranks(_worker, args=(2, _free_port(), overrides, str(out), True), nprocs=2, join=True)
    two = torch.load(out)
    one = _one_step(load_config("tiny", overrides=overrides), rank=0, world_size=1, separated=True)
    assert any(k.startswith("grad/value_head") for k in one) == value_head
    for k in one:
        assert torch.equal(one[k], two[k]), k


@pytest.mark.slow
@pytest.mark.skipif(
    shutil.which("torchrun") is None
    and not os.path.exists(os.path.join(os.path.dirname(sys.executable), "torchrun")),
    reason="torchrun not found",
)
def test_torchrun_tiny_preset_on_two_cpu_ranks(tmp_path):
    """Two ranks started by ``python -m grpo_fast.train --nproc-per-node 2`` (torch's own launcher,
    run in that process: what ``torchrun --standalone --nproc_per_node=2`` does; the other torchrun
    tests start torchrun itself)."""
    cmd = [
        sys.executable,
        "-m",
        "grpo_fast.train",
        "--nproc-per-node",
        "2",
        "--preset",
        "tiny",
        f"output_dir={tmp_path}",
        "steps=4",
        "sft.steps=30",
        "eval_every=2",
        "checkpoint_every=2",
        "data.eval_subset_size=32",
        "logging.progress=false",
    ]
    res = subprocess.run(
        cmd, capture_output=True, text=True, timeout=900, env={**os.environ, "OMP_NUM_THREADS": "1"}
    )
    assert res.returncode == 0, res.stderr[-3000:]
    rows = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in rows] == [0, 1, 2, 3, 4]  # rank 0 alone writes the metrics
    assert all(r["world_size"] == 2 for r in rows)
    assert (tmp_path / "checkpoints" / "step_000002" / "trainer_state.pt").is_file()
    state = torch.load(tmp_path / "checkpoints" / "step_000002" / "trainer_state.pt", weights_only=False)
    assert state["world_size"] == 2 and len(state["rng"]) == 2  # every rank's RNG, for resume
    assert (tmp_path / "final" / "model.safetensors").is_file()
